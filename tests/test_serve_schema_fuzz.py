"""A schema fuzzer (schemathesis) over `/openapi.json`: every operation, bodies generated from the request schemas
(`serve/server/bodies.py`) and mutated beyond them, and not one answer is a 5xx; every error has the API's shape.

The server runs a tiny random chat model with a small `max_tokens` limit, so a generated request costs
milliseconds; sessions are created for real (their ids come from the fuzzer too, so most turns answer 404)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.completions import ServeLimits
from kvsteward.serve.server.testing import tiny_chat_engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(tiny_chat_engine(seed=4), ServerConfig(
        data_dir=tmp_path_factory.mktemp("fuzz"), limits=ServeLimits(max_tokens_default=4, max_tokens_limit=8)))


def test_no_request_gets_a_5xx(app):
    """Each operation of the schema, 40 generated cases (schemathesis' strategies driven by hypothesis directly:
    its pytest plugin does not run under this pytest); GET and turns on a real session, DELETE on fuzzed ids."""
    from hypothesis import given

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 8
    from starlette.testclient import TestClient

    sid = TestClient(app).post("/v1/sessions", json={}).json()["id"]
    seen = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case):
            if "{session_id}" in case.operation.path and case.method.upper() != "DELETE":
                case.path_parameters = {"session_id": sid}  # a real session: the turn's body reaches the handler
            response = case.call()
            seen.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                err = response.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:500]

        run()
    # the fuzzer reached the handlers, not only the refusals
    assert sum(s < 300 for s in seen) >= 60 and sum(400 <= s < 500 for s in seen) >= 60, sorted(set(seen))


def test_the_schema_describes_the_request_bodies(app):
    from starlette.testclient import TestClient

    spec = TestClient(app).get("/openapi.json").json()
    bodies = {path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
              for path, ops in spec["paths"].items() for m, op in ops.items() if m == "post"}
    assert bodies == {"/v1/chat/completions": "ChatCompletionRequest", "/v1/sessions": "SessionCreateRequest",
                      "/v1/sessions/{session_id}/messages": "SessionTurnRequest"}
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "cache", "policy", "budget", "limit", "blueprint", "stream", "max_tokens"} <= set(chat)
