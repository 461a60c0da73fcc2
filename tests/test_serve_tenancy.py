"""The shared prefix cache is partitioned by owner: one API key can never learn, from `reused_tokens` or from latency,
what another key sent; each key still reuses its own prefixes, and a server without keys (one anonymous owner)
shares them across all requests as before."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.testing import bearer, tiny_chat_engine

torch.set_num_threads(1)

KEYS = {"k-alice-123": "alice", "k-bob-456": "bob"}
SYSTEM = {"role": "system", "content": "You are the payroll assistant of ACME."}


def chat(user: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": user}]


SECRET = chat("My salary is 93,250 EUR a year. Is that above the median?")


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=5)


def ask(client, key: str | None, messages: list[dict], stream: bool = False) -> dict:
    """The `kvsteward` object of a reply (from the last chunk when streaming)."""
    headers = bearer(key) if key else {}
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": stream},
                    headers=headers)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["kvsteward"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return next(c["kvsteward"] for c in reversed(chunks) if "kvsteward" in c)


@pytest.mark.parametrize("stream", [False, True])
def test_another_key_reuses_nothing_it_did_not_send_itself(engine, tmp_path, stream):
    client = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path, api_keys=KEYS)))
    secret = ask(client, "k-alice-123", SECRET)
    assert secret["prefix_match"] == "miss"
    # bob's first guess: he has sent nothing yet, so nothing is reused (alice's system prompt included)
    first = ask(client, "k-bob-456", chat("My salary is 50,000 EUR a year. Is that above the median?"), stream)
    assert first["reused_tokens"] == 0 and first["prefix_match"] == "miss"
    # the secret itself reuses exactly what a never-seen prompt of bob's reuses: his own system-prompt checkpoint
    hit = ask(client, "k-bob-456", SECRET, stream)
    never_seen = ask(client, "k-bob-456", chat("My salary is 71,000 EUR a year. Is that above the median?"), stream)
    assert hit["reused_tokens"] == never_seen["reused_tokens"] > 0
    # alice still reuses her whole prompt (her own state), and the two states are the same computation
    again = ask(client, "k-alice-123", SECRET, stream)
    assert again["prefix_match"] == "exact" and again["reused_tokens"] > hit["reused_tokens"]
    assert again["history_key"] == hit["history_key"] == secret["history_key"]


def test_without_keys_one_anonymous_owner_shares_the_cache(engine, tmp_path):
    client = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path)))
    first = ask(client, None, SECRET)
    again = ask(client, None, SECRET)
    assert first["reused_tokens"] == 0 and again["prefix_match"] == "exact" and again["reused_tokens"] > 0


def test_declared_public_system_prompts_are_shared_and_nothing_else(engine, tmp_path):
    """A system prompt the deployment declares public is prefilled once for every key; the rest of a conversation
    stays its owner's. A conversation whose first message's tokens differ at all (another text; tools rendered into
    the template's preamble) is not public."""
    config = ServerConfig(data_dir=tmp_path, api_keys=KEYS, public_prompts=(SYSTEM["content"],))
    app = create_app(engine, config)
    client = TestClient(app)
    ask(client, "k-alice-123", SECRET)
    first = ask(client, "k-bob-456", chat("My salary is 50,000 EUR a year. Is that above the median?"))
    system_tokens = first["reused_tokens"]
    assert first["prefix_match"] == "exact" and system_tokens > 0  # alice's public system prompt, nothing more
    hit = ask(client, "k-bob-456", SECRET)
    never_seen = ask(client, "k-bob-456", chat("My salary is 71,000 EUR a year. Is that above the median?"))
    assert hit["reused_tokens"] == never_seen["reused_tokens"] == system_tokens
    assert hit["history_key"] == ask(client, "k-alice-123", SECRET)["history_key"]  # the same computation
    private = [{"role": "system", "content": "You are the payroll assistant of ACME. Internal."}, SECRET[1]]
    ask(client, "k-alice-123", private)
    assert ask(client, "k-bob-456", private)["reused_tokens"] == 0


def test_the_cli_reads_public_system_prompts(tmp_path):
    from kvsteward.pipelines.cli_serve import read_public_prompts

    (tmp_path / "ok.json").write_text(json.dumps(["You are helpful.", "Você é útil."]))
    assert read_public_prompts(tmp_path / "ok.json") == ("You are helpful.", "Você é útil.")
    assert read_public_prompts(None) == ()
    (tmp_path / "bad.json").write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(ValueError, match="list of non-empty strings"):
        read_public_prompts(tmp_path / "bad.json")
