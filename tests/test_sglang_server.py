"""A real SGLang server (sglang 0.5.21, `python -m sglang.launch_server`) with `--radix-cache-backend kvsteward`, on
CPU, against the kvsteward engine: for every request the greedy tokens equal the engine's (fp32, same weights, the
same history and ops).

One server for the whole module (a tiny random Llama, fp32), started once (~30 s) in SGLang's own virtualenv
(`make sglang-venv`), with msgpack IPC (`SGLANG_USE_PICKLE_IPC=0`: the op channel is a JSON string that survives
it), a small KV pool (`--max-total-tokens`) admitted to eagerly (`--schedule-conservativeness 0.05`), so that
concurrent decodes run out of KV and retract, and small prefill chunks
(`--chunked-prefill-size`, so that a long message is prefilled across many chunks). The last test kills it mid-request
and starts it again. No skip on CPU: a missing `.venv-sglang` fails.
"""

from __future__ import annotations

import threading

import pytest
import requests
import torch

from kvsteward.serve.bench.sglang import AgentSession, LoadPoller, retractions, tree_stats
from kvsteward.serve.server.testing import free_port
from kvsteward.serve.sglang.launch import SglangServer, server_command
from kvsteward.serve.sglang.ops import SglangHistory, generate_exact, request_fields

pytestmark = pytest.mark.slow

POOL = 1200  # KV slots: eight concurrent 350-token rows do not fit
CHUNK = 32  # prefill chunk: the 400-token message takes 13 chunks
VOCAB = 256


def tiny_folder(path):
    """A 2-layer random Llama whose logits are peaked (initializer_range 0.2): greedy choices have clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                         initializer_range=0.2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from kvsteward.serve.engine import Engine

    torch.set_num_threads(1)
    folder = tiny_folder(tmp_path_factory.mktemp("tiny"))
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    cmd = server_command(str(folder), port, max_total_tokens=POOL, context_length=4096, skip_tokenizer=True,
                         extra=("--chunked-prefill-size", str(CHUNK), "--schedule-conservativeness", "0.05"))
    # sglang's own strict checks, on every scheduler step: the accounting equation (available + evictable +
    # protected + uncached = total) and the KV page invariants (no in-flight slot free, no page freed twice)
    env = {"SGLANG_USE_PICKLE_IPC": "0", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
           "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1"}
    server = SglangServer(cmd, port, env=env, log=log)
    server.start()
    engine = Engine(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    try:
        yield server, engine, log
    finally:
        server.kill()


def replay(session, messages, cache):
    """The kvsteward engine's own bookkeeping for the same history: append each message, then its boundary ops."""
    starts = [sum(len(m) for m in messages[:i]) for i in range(len(messages))]
    for i, m in enumerate(messages):
        session.append(list(m), logits="last" if i == len(messages) - 1 else None)
        if str(i) in (cache or {}).get("drop", {}):
            session.drop([t for j in cache["drop"][str(i)] for t in range(starts[j], starts[j] + len(messages[j]))])
        if i in (cache or {}).get("reposition", []):
            session.reposition()


def engine_tokens(engine, messages, cache, n):
    s = engine.session("full")
    replay(s, messages, cache)
    return s.generate(n)


def generate(url, body, n=8, timeout=300):
    body = {**body, "sampling_params": {**body.get("sampling_params", {}), "max_new_tokens": n, "temperature": 0.0,
                                        "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def generate_concurrently(url, cases, n, timeout=300) -> dict[int, list]:
    """Every (messages, cache) case as its own `/generate` request, all in flight at once: output ids by case."""
    results: dict[int, list] = {}

    def worker(k):
        results[k] = generate(url, request_fields(*cases[k]), n=n, timeout=timeout)["output_ids"]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(cases))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout)
    return results


def msg(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


A, B, C, D, E = msg(1, 20), msg(2, 30), msg(3, 15), msg(4, 10), msg(5, 12)


def test_plain_drop_and_reposition_equal_the_engine(served):
    server, engine, _ = served
    cases = [([A, B, C], None, 0), ([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]}, len(A + C)),
             ([A, B, C, D], {"drop": {"2": [1]}}, len(A + C)),  # a plain drop: positions kept (the offset hook)
             ([A, B, C, D], {"drop": {"2": [1]}}, len(A + C + D) - 1)]  # the same again: its whole prefix reused
    for messages, cache, cached in cases:
        out = generate(server.url, request_fields(messages, cache))
        assert out["output_ids"] == engine_tokens(engine, messages, cache, 8), (messages, cache)
        assert out["meta_info"]["cached_tokens"] >= cached, (cache, out["meta_info"])
    # the extra_key carrier reaches the same state
    out = generate(server.url, request_fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]}, via="extra_key"))
    assert out["output_ids"] == engine_tokens(engine, [A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]}, 8)
    assert out["meta_info"]["cached_tokens"] == len(A + C + D) - 1


def test_a_batch_of_concurrent_mixed_requests(served):
    """Six requests at once on one cached pre-op state: none, plain drops, drops with a reposition, and a plain
    history: every one equals the engine, and the tree re-prefilled none (a re-prefill is served as plain tokens, not
    the engine's state; the server log names why: `kvsteward: re-prefill ...`). It runs before the tests that fill
    the 1,200-slot pool: once in ~10 full-file runs after them, three of these requests were re-prefilled (issue 43's
    notes; the reason is logged since)."""
    server, engine, log = served
    generate(server.url, request_fields([E, A, B, C]), n=1)  # the pre-op state the op requests continue
    before = tree_stats(log.read_text(errors="replace")).get("reprefill", 0)
    cases = [([E, A, B, C, D], None), ([E, A, B, C, D], {"drop": {"3": [1]}}),
             ([E, A, B, C, D], {"drop": {"3": [2]}, "reposition": [3]}), ([E, A, B, C, D], {"drop": {"3": [1, 2]}}),
             ([E, B, D], None), ([E, A, B, C, E], {"drop": {"3": [3]}, "reposition": [3]})]
    results = generate_concurrently(server.url, cases, 12)
    text = log.read_text(errors="replace")
    reasons = [line for line in text.splitlines() if "kvsteward: re-prefill" in line]
    assert tree_stats(text).get("reprefill", 0) == before, reasons[-3:]
    for k, (messages, cache) in enumerate(cases):
        assert results[k] == engine_tokens(engine, messages, cache, 12), k


def agent(seed: int, keep: int = 2, reposition_every: int = 2) -> AgentSession:
    """An agent-like conversation (`serve.bench.sglang.AgentSession`): per turn a tool response and the prompt for
    the reply; after each reply the tool responses older than the last `keep` are dropped (AKV's rolling rule), and
    every `reposition_every`-th drop also repositions (0: never)."""
    sizes = {"system": 16, "task": 10, "tool": 24, "prompt": 3}
    return AgentSession(lambda kind, k: msg(seed * 1000 + list(sizes).index(kind) * 100 + k, sizes[kind]), keep=keep,
                        reposition_every=reposition_every)


def play(server, engine, session: AgentSession, client: SglangHistory, turns: int, n: int = 6) -> list[dict]:
    """Each turn: the request (compact after the first), the reply appended as the agent would, and the same
    history through the engine: the tokens must be equal."""
    outs = []
    for t in range(turns):
        if session.drops_next():  # an op follows the reply: the tree must hold the state through it (its last tokens)
            seal = client.fields(*session.seal())
            generate(server.url, seal, n=1)
        messages, cache = session.request()
        body = client.fields(messages, cache)
        out = generate(server.url, body, n=n)
        assert out["output_ids"] == engine_tokens(engine, messages, cache, n), t
        session.reply(out["output_ids"])
        outs.append({"body": body, "out": out, "messages": messages, "cache": cache})
    return outs


def test_repeated_turns_send_only_what_is_new_and_reuse_op_prefixes(served):
    """A multi-turn conversation in the compact form (each turn: its base history's key, the new messages, the new
    ops): the server continues its remembered state; every turn reuses the previous turn's cached state (all but
    what its drops removed) and its tokens equal the engine's."""
    server, engine, _ = served
    outs = play(server, engine, agent(7), SglangHistory(), turns=7)
    for t, o in enumerate(outs):
        spec = o["body"]["sampling_params"]["custom_params"]["kvsteward"]
        assert ('"base"' in spec) == (t > 0)  # compact after the first turn: only what is new travels
        if t:
            full = request_fields(o["messages"], o["cache"])["sampling_params"]["custom_params"]["kvsteward"]
            assert len(spec) < len(full)
            # everything but the new tool response and prompt was cached (survivors of the drop included)
            new = len(o["messages"][-1]) + len(o["messages"][-2])
            assert o["out"]["meta_info"]["cached_tokens"] >= len(o["body"]["input_ids"]) - new - 1, t
    assert any(o["cache"]["drop"] for o in outs) and any(o["cache"]["reposition"] for o in outs)
    sizes = [len(o["body"]["sampling_params"]["custom_params"]["kvsteward"]) for o in outs]
    assert max(sizes[2:]) < 1.5 * min(sizes[2:])  # what a turn sends does not grow with the conversation


MARGIN = 8  # the seal's generated token and the reply's closing: computed, not yet in the next row


@pytest.mark.parametrize("reposition_every", [0, 2])
def test_ten_turns_use_no_more_than_the_physical_row(served, reposition_every):
    """Ten agent turns (rolling drops; with repositions, every second drop repositions) with `/v1/loads` polled:
    the tokens in use never exceed the last turn's physical row (+ its decode) + MARGIN with plain drops, and the row
    + the repositioned survivors' model-written keys (kept: versions rotate from them) with repositions. Before issue
    43 the dropped tokens and every older version stayed locked (the full history and more). The tree re-prefilled
    nothing and sglang's strict checks held on every step."""
    server, engine, log = served
    before = tree_stats(log.read_text(errors="replace"))
    n = 6
    with LoadPoller(server.url, interval=0.02) as loads:
        outs = play(server, engine, agent(21 + reposition_every, reposition_every=reposition_every), SglangHistory(),
                    turns=10, n=n)
    row = len(outs[-1]["body"]["input_ids"]) + n
    history = sum(len(m) for m in outs[-1]["messages"]) + n
    messages, cache = outs[-1]["messages"], outs[-1]["cache"]
    survivors = 0
    if cache["reposition"]:  # the resident tokens at the last reposition: their original keys stay
        b = max(cache["reposition"])
        dropped = {j for k, v in cache["drop"].items() if int(k) <= b for j in v}
        survivors = sum(len(messages[i]) for i in range(b + 1) if i not in dropped)
    bound = row + survivors + MARGIN
    assert loads.samples > 0 and 0 < loads.peak_used <= bound, (loads.peak_used, row, survivors, history)
    assert history > row + 100  # what today's tree would lock, at least
    after = tree_stats(log.read_text(errors="replace"))
    assert after["reprefill"] == before.get("reprefill", 0) and after["refused"] == before.get("refused", 0)
    assert "Mem Leak" not in log.read_text(errors="replace")


def test_six_concurrent_sessions_fit_the_small_pool(served):
    """Six agent sessions (plain drops), ten turns each, at once in the 1,200-slot pool: their full histories (~2,100
    tokens) do not fit, their physical rows (~1,000) do. The dead KV of every drop is free on demand, so sglang
    retracts nothing, the tree re-prefills nothing, and every turn's tokens equal the engine's. (With repositions
    every second drop, and refuse + hold + `generate_exact`, 11 of 60 turns are still re-prefilled after 180
    refusals: issue 43's notes.)"""
    server, engine, log = served
    text = log.read_text(errors="replace")
    retracted, stats = retractions(text), tree_stats(text)
    played: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(k):
        try:
            session, client, outs = agent(40 + k, reposition_every=0), SglangHistory(), []
            for _ in range(10):
                if session.drops_next():
                    generate(server.url, client.fields(*session.seal()), n=1)
                messages, cache = session.request()
                out = generate(server.url, client.fields(messages, cache), n=6, timeout=900)
                session.reply(out["output_ids"])
                outs.append((messages, cache, out))
            played[k] = outs
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with LoadPoller(server.url, interval=0.05) as loads:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=1200)
    assert not errors, errors
    text = log.read_text(errors="replace")
    histories = sum(sum(len(m) for m in outs[-1][0]) for outs in played.values())
    assert histories > POOL  # the full histories do not fit
    assert retractions(text) == retracted, "sglang retracted requests"
    after = tree_stats(text)
    assert after["reprefill"] == stats.get("reprefill", 0), after
    assert loads.peak_used <= POOL
    for k, outs in played.items():
        for t, (messages, cache, out) in enumerate(outs):
            assert out["output_ids"] == engine_tokens(engine, messages, cache, 6), (k, t)


def test_a_lost_pre_op_state_is_refused_and_rebuilt_exactly(served):
    """`miss: "refuse"`: a plain request that needs nearly the whole pool evicts a session's cached states; the
    session's next request (two drops in its history) is refused before any work, with a 409 `kvsteward_miss` naming
    the state to rebuild, and `generate_exact` rebuilds both pre-op states (the one before each drop) from the
    messages it holds, then serves the request: its tokens equal the engine's, and the tree re-prefilled nothing.
    Without the field the same request is re-prefilled as plain tokens (counted), as before."""
    server, engine, log = served
    messages = [msg(601, 40), msg(602, 60), msg(603, 30), msg(604, 50), msg(605, 30), msg(606, 8)]
    cache = {"drop": {"2": [1], "4": [3]}}
    history = SglangHistory(miss="refuse")

    def send(body, n):
        return generate(server.url, body, n=n)

    expected = engine_tokens(engine, messages, cache, 6)
    out, _ = generate_exact(send, history, history.fields(messages, cache), messages, cache, 6)
    assert out["output_ids"] == expected
    before = tree_stats(log.read_text(errors="replace"))
    generate(server.url, {"input_ids": msg(607, POOL - 60)}, n=1)  # evicts all but <= 59 cached slots
    refused = generate(server.url, request_fields(messages, cache, miss="refuse"), n=6)
    reason = refused["meta_info"]["finish_reason"]
    assert reason["err_type"] == "kvsteward_miss" and reason["status_code"] == 409, reason
    assert reason["kvsteward_pre_op_tokens"] == sum(map(len, messages[:3])) and refused["output_ids"] == []
    out, refusals = generate_exact(send, history, history.fields(messages, cache, full=True), messages, cache, 6)
    assert out["output_ids"] == expected and refusals == 2, (refusals, out["meta_info"])
    after = tree_stats(log.read_text(errors="replace"))
    assert after["reprefill"] == before.get("reprefill", 0)
    assert after["refused_miss"] == before.get("refused_miss", 0) + 3
    # the old path, for comparison: evicted again, sent without the field, served as plain tokens and counted
    generate(server.url, {"input_ids": msg(608, POOL - 60)}, n=1)
    generate(server.url, request_fields(messages, cache), n=6)
    assert tree_stats(log.read_text(errors="replace"))["reprefill"] == after["reprefill"] + 1


def test_retraction_under_memory_pressure(served):
    """Eight concurrent decodes whose KV outgrows the pool: sglang admits them by an estimate of their decode length,
    runs out mid-decode, retracts some (their rows freed, nothing inserted) and re-admits them later, re-matched
    through the tree: the op node again, over the shared pre-op state the running requests keep locked. Every one
    still equals the engine. (Exactness needs the pre-op state in the tree: one evicted before a request is matched
    is re-prefilled from the survivors, `stats["reprefill"]`, which is not the engine's state.)"""
    server, engine, log = served
    n = 300  # eight rows of ~340 tokens in a 1200-slot pool
    retracted = False
    # Whether sglang retracts depends on how many of the eight it admitted together, which depends on arrival
    # timing (freed dead KV admits more, a loaded machine staggers arrivals, a faster extend finishes sooner): up to
    # five bursts of fresh conversations until one retracts; every request of every burst must equal the engine.
    for burst in range(5):
        p, q = msg(200 + 1000 * burst, 30), msg(201 + 1000 * burst, 10)
        generate(server.url, request_fields([p, q, msg(202 + 1000 * burst, 2)]), n=1)
        ops = [{"drop": {"1": [1]}}, {"drop": {"1": [1]}, "reposition": [1]}, None, {"drop": {"1": [0]}}]
        cases = [([p, q, msg(300 + 1000 * burst + k, 10)], ops[k % 4]) for k in range(8)]
        before = log.read_text(errors="replace").count("#retracted_reqs")
        results = generate_concurrently(server.url, cases, n, timeout=600)
        for k, (messages, cache) in enumerate(cases):
            assert results[k] == engine_tokens(engine, messages, cache, n), (burst, k)
        if log.read_text(errors="replace").count("#retracted_reqs") > before:
            retracted = True
            break
    assert retracted, "no retraction happened in five bursts: raise the load"


def test_chunked_prefill_across_many_chunks(served):
    server, engine, _ = served
    long = msg(500, 400)
    generate(server.url, request_fields([A, long, B]), n=1)
    for messages, cache in [([A, long, B, C], {"drop": {"2": [0]}}), ([A, long, B, C, msg(501, 300)], None),
                            ([A, long, B, C], {"drop": {"2": [0]}, "reposition": [2]})]:
        out = generate(server.url, request_fields(messages, cache), n=8)
        assert out["output_ids"] == engine_tokens(engine, messages, cache, 8), cache


def test_kill_mid_request_then_a_clean_restart(served):
    """A streamed request is in flight (its first tokens arrived) when the server's whole process group is killed:
    the stream breaks off. A new server then starts clean (empty tree and history store) and serves a compact-form
    conversation exactly again (its client starts over in the full form)."""
    server, engine, _ = served
    body = request_fields([msg(600, 50)])
    body["sampling_params"].update({"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True})
    chunks, done, broke = 0, False, False
    with requests.post(f"{server.url}/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        try:
            for line in r.iter_lines():
                if not line:
                    continue
                chunks += 1
                if chunks == 1:
                    server.kill()  # mid-request: SIGKILL to the server, its scheduler and detokenizer
                if line.strip() == b"data: [DONE]":
                    done = True
        except requests.RequestException:
            broke = True
    assert chunks >= 1 and not done, (chunks, done, broke)
    server.start()
    play(server, engine, agent(11), SglangHistory(), turns=5)
