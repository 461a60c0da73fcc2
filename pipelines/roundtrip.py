"""The pipeline's `serve` stage: one round trip through `steward serve` with the OpenAI client.

A coding-agent conversation (the user asks, the assistant reads a file, the tool returns a long config, the assistant
notes what matters, the user asks again) is sent three times to a real `steward serve` process:

1. `turn`: the first four messages and the question, the whole cache kept;
2. `drop + reposition`: the same conversation, the tool response dropped after the assistant's note
   (`cache={"drop": {"3": [2]}, "reposition": [3]}`): its KV leaves attention and the survivors move to positions
   0..r-1 by exact re-rotation;
3. `reply`: the next turn of the dropped conversation (its reply appended, a new question): served from the cached
   dropped state (`reused_tokens`), the ops of request 2 repeated.

Each request's reply, prompt tokens, the server's `kvsteward` ledger (reused / resident tokens, next position, prefix
match) and latency are recorded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONFIG = "\n".join([
    "[server]", "host = \"0.0.0.0\"", "port = 8080", "workers = 4", "",
    "[database]", "url = \"postgres://app@db.internal:5432/orders\"", "pool_size = 16", "timeout_s = 30", "",
    *[f"[feature.flag_{i}]\nenabled = {'true' if i % 3 else 'false'}\nrollout = {i * 7 % 100}\n" for i in range(24)],
    "[logging]", "level = \"info\"", "format = \"json\"",
])

MESSAGES = [
    {"role": "user", "content": "Open config.toml."},
    {"role": "assistant", "content": "read_file(\"config.toml\")"},
    {"role": "tool", "content": CONFIG},
    {"role": "assistant", "content": "The server listens on port 8080."},
    {"role": "user", "content": "What port does the server listen on?"},
]
DROP = {"drop": {"3": [2]}, "reposition": [3]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"steward serve exited with {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"steward serve did not answer /health within {timeout:.0f}s")


def _ask(client, model: str, name: str, messages: list[dict], cache: dict | None, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                       extra_body={"cache": cache} if cache else None)
    latency = time.perf_counter() - t0
    kv = (r.model_extra or {}).get("kvsteward") or {}
    return {"name": name, "messages": len(messages), "cache": cache or {}, "reply": r.choices[0].message.content,
            "prompt_tokens": r.usage.prompt_tokens if r.usage else None, "latency_s": latency,
            **{k: kv.get(k) for k in ("reused_tokens", "resident_tokens", "next_position", "history_len",
                                      "history_key", "prefix_match")}}


def round_trip(model: str, out: Path, max_tokens: int = 24, log=print) -> dict:
    """Start `steward serve` on a free loopback port, run the three requests, stop it; returns the record."""
    import openai

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "kvsteward.pipelines.cli", "serve", "--model", model, "--port", str(port),
            "--data-dir", str(out / "data"), "--no-tiers", "--log-level", "warning"]
    base = f"http://127.0.0.1:{port}"
    with open(out / "server.log", "w") as server_log:
        proc = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        try:
            log(f"steward serve starting on {base} (log: {out / 'server.log'})")
            wait_healthy(base, proc)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
            served = client.models.list().data[0].id
            turns = [_ask(client, served, "turn (whole cache)", MESSAGES, None, max_tokens)]
            log(f"turn: {turns[-1]['reply']!r}")
            turns.append(_ask(client, served, "drop + reposition", MESSAGES, DROP, max_tokens))
            log(f"drop + reposition: {turns[-1]['reply']!r}")
            follow = MESSAGES + [{"role": "assistant", "content": turns[-1]["reply"] or ""},
                                 {"role": "user", "content": "Thanks. What port again?"}]
            turns.append(_ask(client, served, "reply (next turn)", follow, DROP, max_tokens))
            log(f"next turn: {turns[-1]['reply']!r}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    record = {"command": " ".join(["steward", *argv[3:]]), "model": served, "turns": turns,
              "resident_saved_tokens": (turns[0]["resident_tokens"] or 0) - (turns[1]["resident_tokens"] or 0),
              "answers_8080": ["8080" in (t["reply"] or "") for t in turns[:2]]}
    (out / "serve.json").write_text(json.dumps(record, indent=1))
    return record
