"""Request bodies: JSON parsing with the refusals a handler needs (depth, digit limit, lone surrogates), the
`Idempotency-Key` header, and the pydantic request schemas `/openapi.json` describes (bodies are validated by hand
in the handlers, with the errors of `errors.py`; the schemas document them and let a schema fuzzer exercise them)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from kvsteward.serve.server.errors import ApiError

MAX_JSON_DEPTH = 64  # nesting of a request body (objects + arrays); deeper bodies are refused with a 400


def _check_json(value: Any) -> None:
    """Refuse what parses but no handler can use: nesting deeper than MAX_JSON_DEPTH, and strings that are not
    Unicode text (lone surrogates such as "\\ud800", which no tokenizer or log encodes). Iterative: linear."""
    stack = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"{path or 'body'} is not valid Unicode text (a lone surrogate at character "
                                    f"{e.start})", param=path or None) from None
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                               param=path.split(".")[0].split("[")[0] or None)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    stack.append((k, path or "body", depth + 1))  # a key: reported at its object
                    sub = f"{path}.{k}" if path else k
                else:
                    sub = f"{path}[{k}]"
                stack.append((x, sub, depth + 1))


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer literal beyond Python's digit limit
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_json(body)
    return body


# -- request schemas (OpenAPI only: bodies are validated by hand, with the errors above) -----------------------------
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(None, description="text, or OpenAI text parts")


class CacheOps(_Open):
    drop: dict[str, list[int]] = Field(default_factory=dict,
                                       description="'after message i' -> message indices leaving attention")
    reposition: list[int] = Field(default_factory=list, description="boundaries where survivors are repositioned")


class BlueprintEntry(_Open):
    span: list[int] | None = Field(None, description="[start, end) logical tokens", min_length=2, max_length=2)
    message: int | None = Field(None, description="a whole message (chat completions only)")
    readers: list[int] = Field(default_factory=list, description="steps that will read the span")


class StreamOptions(_Open):
    include_usage: bool = False


class _SessionSpecFields(_Open):
    policy: str | None = Field(None, description="policy or arm (default: the server's)")
    budget: int | None = Field(None, ge=1)
    limit: int | None = Field(None, ge=1, description="bounded positions L")
    blueprint: list[BlueprintEntry] | None = None


class ChatCompletionRequest(_SessionSpecFields):
    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = Field(1, description="one choice: decoding is greedy")
    tools: list[dict[str, Any]] | None = None
    cache: CacheOps | None = None


class SessionCreateRequest(_SessionSpecFields):
    model: str | None = None
    tools: list[dict[str, Any]] | None = None


class SessionTurnRequest(_Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(default_factory=list, description="the turn's new messages")
    cache: CacheOps | None = None
    generate: bool | None = Field(None, description="generate a reply (default: when max_tokens is given)")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None


REQUEST_MODELS = (ChatCompletionRequest, SessionCreateRequest, SessionTurnRequest)


def body_doc(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def install_openapi(app: FastAPI) -> None:
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            config = getattr(app.state, "config", None)
            for name in ("ChatCompletionRequest", "SessionCreateRequest", "SessionTurnRequest"):
                if config is not None:  # one model is served: the only name `model` may give
                    prop = schema["components"]["schemas"][name]["properties"]["model"]
                    prop.pop("anyOf", None)
                    prop.update({"type": "string", "enum": [config.model_name]})
            if config is not None and config.api_keys:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e][\x20-\x7e]{0,254}")  # printable ASCII, <= 255 characters


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not IDEMPOTENCY_KEY_RE.fullmatch(key) or key != key.strip():
        raise ApiError(400, "Idempotency-Key must be 1 to 255 printable ASCII characters", param="Idempotency-Key")
    return key
