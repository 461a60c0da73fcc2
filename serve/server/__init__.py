"""The HTTP server (`steward serve`): OpenAI-style endpoints over the engine, persistent sessions, metrics.

`api` (FastAPI app; its middlewares in `access`, body parsing and request schemas in `bodies`, the error shape in
`errors`) → `completions` (one request as engine ops + decode) and `store` (persistent sessions and the aux worker's
hand-offs) → `state` (session logs, restore), `decode` (streamed greedy decoding), `metrics`. The server
uses the engine and the manager; neither imports it.
"""
