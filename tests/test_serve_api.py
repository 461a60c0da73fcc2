"""The HTTP API: the unmodified `openai` client (plain and streaming) against a live uvicorn server, the cache grammar
end to end against the independent reference replay, stop handling, 4xx errors that name the problem, metrics,
and isolation between interleaved requests."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.engine.ops import SessionSpec, message_pieces, message_ranges
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.testing import ServerThread, tiny_chat_engine

torch.set_num_threads(1)

MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Open the file utils.py and tell me what parse() does."},
    {"role": "assistant", "content": "Calling read_file(path='utils.py')."},
    {"role": "tool", "content": "def parse(s):\n    return [int(x) for x in s.split(',')]\n" * 3},
    {"role": "assistant", "content": "parse() splits on commas and converts every field to int."},
    {"role": "user", "content": "Great. Now what would parse('1,2') return?"},
]
CACHE = {"drop": {"4": [3]}, "reposition": [4]}  # AKV rolling drop: the tool output leaves, survivors move down


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=1)


def make_app(engine, tmp_path, **kw):
    return create_app(engine, ServerConfig(data_dir=tmp_path, **kw))


@pytest.fixture
def client(engine, tmp_path):
    return TestClient(make_app(engine, tmp_path))


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


def reference_greedy(engine, messages, cache, n_tokens):
    """Replay messages + drop/reposition on transformers' own cache; check each engine token is a reference argmax."""
    tok = engine.tokenizer
    pieces = message_pieces(tok, messages)
    ranges = message_ranges(pieces)
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    for i, p in enumerate(pieces):
        ref.append(p)
        for j in cache.get("drop", {}).get(str(i), []):
            ref.drop(list(range(*ranges[j])))
        if i in cache.get("reposition", []):
            ref.reposition()
    gen = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    return ref, ref.append(gen)[-1]


def test_openai_client_plain_and_streaming(engine, tmp_path):
    with ServerThread(make_app(engine, tmp_path)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["kvsteward"]
        plain = client.chat.completions.create(model="kvsteward", messages=MESSAGES, max_tokens=8,
                                               extra_body={"cache": CACHE})
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8
        info = plain.model_extra["kvsteward"]
        assert info["resident_tokens"] < plain.usage.prompt_tokens  # the tool output left attention
        stream = client.chat.completions.create(model="kvsteward", messages=MESSAGES, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"cache": CACHE})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8
        again = client.chat.completions.create(model="kvsteward", messages=MESSAGES, max_tokens=8,
                                               extra_body={"cache": CACHE})
        assert again.model_extra["kvsteward"]["reused_tokens"] == plain.usage.prompt_tokens - 4  # all but the
        # generation prompt `<|im_start|>assistant\n` (4 tokens) came from the cached prompt state


def test_cache_grammar_end_to_end_matches_reference_replay(engine, client):
    body = chat(client, cache=CACHE, max_tokens=5)
    info = body["kvsteward"]
    tok = engine.tokenizer
    ref, logits = reference_greedy(engine, MESSAGES, CACHE, 5)
    pieces = message_pieces(tok, MESSAGES)
    dropped = len(pieces[3])
    assert info["resident_tokens"] == sum(map(len, pieces)) - dropped
    assert info["next_position"] == info["resident_tokens"]  # repositioned after message 4
    assert ref.positions == list(range(len(ref.positions))) and len(ref.logical) == info["resident_tokens"] + 4
    # the served tokens are greedy under the reference too (ties within float tolerance allowed)
    served = tok.encode(body["choices"][0]["message"]["content"], add_special_tokens=False)
    generated = []
    for t in served[:3]:  # re-encoding can merge tokens at the end; the first ones are stable
        assert logits[t] >= logits.max() - 1e-4
        generated.append(t)
        logits = ref.append([t])[-1]
    # and a different cache history gives a different state for the same text
    other = chat(client, max_tokens=5)
    assert other["kvsteward"]["history_key"] != info["history_key"]


def test_stop_strings_and_streaming_agree(client):
    full = chat(client, max_tokens=10)["choices"][0]["message"]["content"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.find(stop)
    body = chat(client, max_tokens=10, stop=[stop, "never-appears"])
    assert body["choices"][0]["message"]["content"] == full[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 10, "stop": stop,
                                                  "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == full[:cut]
    assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("body, status, match", [
    ({"cache": {"drop": {"9": [0]}}}, 400, r"boundary after message 9 is out of range: there are 6 messages"),
    ({"cache": {"drop": {"2": [5]}}}, 400, r"message 5 is not yet appended at the boundary after message 2"),
    ({"cache": {"drop": {"2": [17]}}}, 400, r"message 17 is unknown"),
    ({"cache": {"reposition": [6]}}, 400, r"cache.reposition: boundary after message 6 is out of range"),
    ({"cache": {"drop": {"5": [0, 1, 2, 3, 4, 5]}, "reposition": [5]}}, 400, r"reposition on an empty cache"),
    ({"blueprint": [{"span": [5, 2], "readers": [3]}]}, 400, r"blueprint\[0\].span \[5, 2\) is empty"),
    ({"blueprint": {"span": 1}}, 400, r"blueprint must be a list"),
    ({"blueprint": [{"message": 40, "readers": [1]}]}, 400, r"blueprint\[0\].message 40 is unknown"),
    ({"policy": "lru"}, 400, r"unknown policy 'lru'"),
    ({"policy": "h2o"}, 400, r"needs a budget"),
    ({"max_tokens": 0}, 400, r"max_tokens must be an integer in \[1, 4096\]"),
    ({"messages": []}, 400, r"messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, r"role 'robot'"),
    ({"n": 3}, 400, r"only n=1"),
    ({"stop": 5}, 400, r"stop must be"),
    ({"tools": {"name": "x"}}, 400, r"tools must be a list"),
])
def test_bad_requests_get_4xx_naming_the_problem_and_serving_continues(client, body, status, match):
    import re

    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert re.search(match, err["message"]), err
    assert err["type"] == "invalid_request_error"
    assert chat(client)["choices"][0]["finish_reason"] == "length"  # still serving


def test_streaming_errors_come_before_the_stream_and_sampling_fields_are_ignored(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                                                  "cache": {"reposition": [99]}})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "boundary after message 99 is out of range" in r.json()["error"]["message"]
    greedy = chat(client)["choices"][0]["message"]["content"]
    assert chat(client, temperature=0.9, top_p=0.5, seed=7)["choices"][0]["message"]["content"] == greedy


def test_malformed_and_oversized_bodies(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path, max_body_bytes=2000))
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "exceeds the limit of 2000" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 512):
            yield payload[i: i + 512]

    r = client.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2})
    assert r.status_code == 200


def test_interleaved_requests_equal_requests_alone(engine, tmp_path):
    variants = [
        {"cache": CACHE},
        {},
        {"cache": {"drop": {"3": [1, 2]}}},
        {"messages": MESSAGES[:4] + [{"role": "user", "content": "Summarise."}], "cache": {"reposition": [3]}},
        {"cache": {"drop": {"4": [3]}}},
        {"policy": "h2o", "budget": 48},
        {"blueprint": [{"message": 1, "readers": [6]}], "policy": "foresight", "budget": 48},
    ]
    alone = []
    for v in variants:  # each on a fresh server: nothing cached
        alone.append(chat(TestClient(make_app(engine, tmp_path / f"alone{len(alone)}")), **v))
    shared = TestClient(make_app(engine, tmp_path / "shared"))
    order = [0, 1, 2, 3, 4, 5, 6, 4, 2, 0, 6, 1, 3, 5]
    reused = 0
    for i in order:
        got = chat(shared, **variants[i])
        assert got["choices"][0]["message"]["content"] == alone[i]["choices"][0]["message"]["content"]
        assert got["kvsteward"]["history_key"] == alone[i]["kvsteward"]["history_key"]
        assert got["kvsteward"]["resident_tokens"] == alone[i]["kvsteward"]["resident_tokens"]
        reused += got["kvsteward"]["reused_tokens"]
    assert reused > 0
    text = shared.get("/metrics").text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["kvsteward_prefix_tokens_reused_total"] == reused
    rate = metrics["kvsteward_prefix_tokens_reused_total"] / metrics["kvsteward_prefix_tokens_requested_total"]
    assert metrics["kvsteward_prefix_cache_hit_rate"] == pytest.approx(rate)
    assert metrics['kvsteward_requests_total{endpoint="/v1/chat/completions",status="200"}'] == len(order)
    for name in ["kvsteward_prefix_cache_resident_tokens", "kvsteward_prefix_cache_evictions_total",
                 "kvsteward_sessions_active", "kvsteward_persisted_turns_total",
                 'kvsteward_request_latency_seconds_count{endpoint="/v1/chat/completions"}']:
        assert name in metrics


def test_server_defaults_apply_when_the_request_names_no_policy(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path, defaults=SessionSpec("streaming", budget=20, chunk=8)))
    info = chat(client)["kvsteward"]
    assert info["resident_tokens"] == 20  # the recent window of the streaming default
    assert chat(client, policy="full")["kvsteward"]["resident_tokens"] > 20
