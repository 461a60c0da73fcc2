"""`steward bench sglang`: SGLang + kvsteward against SGLang's default radix cache, same requests, same run.

The workload is agent-like (`AgentSession`): concurrent sessions, each a system prompt and a task, then turns of one
tool response and a generated reply; after every reply, tool responses older than the last `keep` are dropped —
AKV's rolling rule — and every `reposition_every`-th drop also repositions. Both servers get the *same* token
stream per turn (`input_ids` = the physical tokens, the survivors):

- **default**: sglang's own radix cache. It keys KV by tokens only, so after a drop the request's prefix diverges at
  the first dropped message and everything after it is prefilled again (what AKV's baseline does).
- **kvsteward**: the same `input_ids`, plus the op history (compact form: `SglangHistory`); the tree applies the drop
  to the cached state (a drop node; a reposition re-rotates K into new slots) and prefills only the new messages.

A second, op-free pass of the same sessions (no drops, no kvsteward field) measures what the plugin costs requests
that carry no ops: `no_op_overhead` = mean request latency on the kvsteward server / on the default one.

Per pass: requests/s, output tokens/s, p50/p95 request latency, cached-token ratio (sglang's `cached_tokens` /
`prompt_tokens`, summed), prompt tokens computed, and peak KV tokens in use (`/v1/loads`, polled). One server at a
time: the default one first, then the kvsteward one.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Progress = Callable[[str], None]


@dataclass
class AgentSession:
    """One agent conversation as message token ids. `make(kind, k)` gives the ids of the k-th message of a kind:
    "system", "task", "tool", "prompt" (the generation prompt that opens a reply). The last message of every
    request is the prompt; `reply(ids)` turns it into the whole assistant message (prompt + generated tokens, plus
    `closing` — what the chat template puts after a reply)."""

    make: Callable[[str, int], list[int]]
    keep: int = 2
    reposition_every: int = 2
    ops: bool = True
    closing: list[int] = field(default_factory=list)
    messages: list[list[int]] = field(default_factory=list)
    cache: dict = field(default_factory=lambda: {"drop": {}, "reposition": []})
    tools: list[int] = field(default_factory=list)
    turn: int = 0
    drops: int = 0

    def request(self) -> tuple[list[list[int]], dict]:
        """The next turn's messages and cache ops (the rolling drop after the previous reply, then a tool response
        and the prompt)."""
        if not self.messages:
            self.messages = [self.make("system", 0), self.make("task", 0)]
        elif self.ops and len(self.tools) > self.keep:
            gone, self.tools = self.tools[: -self.keep], self.tools[-self.keep:]
            boundary = len(self.messages) - 1  # right after the previous reply
            self.cache["drop"][str(boundary)] = gone
            self.drops += 1
            if self.reposition_every and self.drops % self.reposition_every == 0:
                self.cache["reposition"].append(boundary)
        self.tools.append(len(self.messages))
        self.messages += [self.make("tool", self.turn), self.make("prompt", self.turn)]
        self.turn += 1
        return [list(m) for m in self.messages], {"drop": dict(self.cache["drop"]),
                                                  "reposition": list(self.cache["reposition"])}

    def reply(self, output_ids: list[int]) -> None:
        self.messages[-1] = self.messages[-1] + list(output_ids) + list(self.closing)

    def drops_next(self) -> bool:
        """Whether the next request drops right after the reply just appended: then the state through that reply
        must be in the server's tree first (`seal`)."""
        return bool(self.messages) and self.ops and len(self.tools) > self.keep

    def seal(self) -> tuple[list[list[int]], dict]:
        """The history so far (ending with the reply), for a 1-token request that computes and caches the reply's
        last tokens: sglang caches a finished request's KV up to its last *computed* token, i.e. without the last
        generated token (and the template's closing tokens, never generated), and an op can only follow a state the
        tree holds whole (an op after an uncached state is served by re-prefilling the survivors, which is not the
        engine's state). The next request's compact base is this history."""
        return [list(m) for m in self.messages], {"drop": dict(self.cache["drop"]),
                                                  "reposition": list(self.cache["reposition"])}


class LoadPoller:
    """Polls sglang's `/v1/loads` every `interval` s in a thread while in use (`with LoadPoller(url) as p:`): peak and
    mean `num_used_tokens` (total - available - evictable: what admission sees as taken), running and waiting
    requests. With `metrics=True` also `/metrics` (the server needs `--enable-metrics`): peak allocated slots =
    `sglang:num_used_tokens` + `sglang:kv_evictable_tokens`."""

    def __init__(self, url: str, interval: float = 0.1, metrics: bool = False):
        self.url, self.interval, self.metrics = url, interval, metrics
        self.samples = 0
        self.peak_used = self.peak_running = self.peak_waiting = self.peak_allocated = 0
        self._used_sum = self._running_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import requests

        while not self._stop.is_set():
            try:
                loads = requests.get(f"{self.url}/v1/loads", params={"include": "core"}, timeout=5).json()["loads"]
                used = sum(int(_find(x, "num_used_tokens") or 0) for x in loads)
                running = sum(int(_find(x, "num_running_reqs") or 0) for x in loads)
                waiting = sum(int(_find(x, "num_waiting_reqs") or 0) for x in loads)
                self.samples += 1
                self.peak_used = max(self.peak_used, used)
                self.peak_running = max(self.peak_running, running)
                self.peak_waiting = max(self.peak_waiting, waiting)
                self._used_sum += used
                self._running_sum += running
                if self.metrics:
                    text = requests.get(f"{self.url}/metrics", timeout=5).text
                    m = prometheus_values(text)
                    self.peak_allocated = max(self.peak_allocated, int(m.get("sglang:num_used_tokens", 0)
                                                                       + m.get("sglang:kv_evictable_tokens", 0)))
            except Exception:  # noqa: BLE001 (a missed sample is not an error of the run)
                pass
            self._stop.wait(self.interval)

    @property
    def mean_used(self) -> float:
        return self._used_sum / self.samples if self.samples else 0.0

    @property
    def mean_running(self) -> float:
        return self._running_sum / self.samples if self.samples else 0.0


def prometheus_values(text: str) -> dict[str, float]:
    """Sum of each metric's samples over its labels (gauges and counters of one server)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def tree_stats(log_text: str) -> dict:
    """The kvsteward tree's counters: the last `kvsteward tree stats:` line of a server log ({} if none)."""
    import json

    marker = "kvsteward tree stats: "
    i = log_text.rfind(marker)
    if i < 0:
        return {}
    return json.loads(log_text[i + len(marker):].split("\n", 1)[0])


def retractions(log_text: str) -> int:
    """Requests sglang retracted (summed `#retracted_reqs: N` of its decode out-of-memory lines)."""
    import re

    return sum(int(m) for m in re.findall(r"#retracted_reqs: (\d+)", log_text))


def _find(d, key):
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


ARMS = ("default", "kvsteward_nofree", "kvsteward", "kvsteward_aux")
BFCL_WORKLOADS = {"bfcl": "long_context", "bfcl-base": "base"}  # workload -> BFCL v4 multi-turn category
WORKLOADS = ("synthetic", *BFCL_WORKLOADS)
AUX_TRIGGER = "Memory management mode"


@dataclass
class ReplaySession:
    """A fixed conversation replayed turn by turn, teacher-forced, so that every arm sends the same prompts.
    `pieces` = [(role, token ids)] as the chat template writes each message; `prompt` = the generation prompt ids.
    Each request ends with `prompt` where the conversation's next assistant message starts; the server generates
    (its tokens are measured, then discarded) and the request's last message becomes the conversation's own
    assistant message. After each assistant message, tool responses older than the last `keep` are dropped (AKV's
    rolling rule), every `reposition_every`-th drop also repositions (`ops=False`: never)."""

    pieces: list[tuple[str, list[int]]]
    prompt: list[int]
    keep: int = 2
    reposition_every: int = 2
    ops: bool = True
    max_turns: int | None = None
    messages: list[list[int]] = field(default_factory=list)
    cache: dict = field(default_factory=lambda: {"drop": {}, "reposition": []})
    tools: list[int] = field(default_factory=list)
    pos: int = 0
    turn: int = 0
    drops: int = 0

    def turns(self) -> int:
        n = sum(1 for role, _ in self.pieces[1:] if role == "assistant")
        return min(n, self.max_turns) if self.max_turns else n

    def done(self) -> bool:
        return self.turn >= self.turns()

    def request(self) -> tuple[list[list[int]], dict]:
        if self.messages and self.ops and len(self.tools) > self.keep:
            gone, self.tools = self.tools[: -self.keep], self.tools[-self.keep:]
            self.cache["drop"][str(len(self.messages) - 1)] = gone
            self.drops += 1
            if self.reposition_every and self.drops % self.reposition_every == 0:
                self.cache["reposition"].append(len(self.messages) - 1)
        while self.pos < len(self.pieces) and (self.pieces[self.pos][0] != "assistant" or self.pos == 0):
            role, ids = self.pieces[self.pos]
            if role == "tool":
                self.tools.append(len(self.messages))
            self.messages.append(list(ids))
            self.pos += 1
        self.messages.append(list(self.prompt))
        return [list(m) for m in self.messages], {"drop": dict(self.cache["drop"]),
                                                  "reposition": list(self.cache["reposition"])}

    def reply(self, _output_ids=None) -> None:
        self.messages[-1] = list(self.pieces[self.pos][1])  # teacher-forced: the conversation's own message
        self.pos += 1
        self.turn += 1

    def drops_next(self) -> bool:
        return bool(self.messages) and self.ops and len(self.tools) > self.keep

    def seal(self) -> tuple[list[list[int]], dict]:
        return [list(m) for m in self.messages], {"drop": dict(self.cache["drop"]),
                                                  "reposition": list(self.cache["reposition"])}


def synthetic_conversations(tokenizer, n: int, turns: int, tool_words: int = 60, reply_words: int = 12,
                            seed: int = 0) -> list[list[dict]]:
    """`n` support-agent conversations: a system prompt, a task, then per turn a tool response tagged `[cursor N]`
    with `tool_words` words of synthetic output and an assistant reply of `reply_words` words."""
    import random

    words = ["ticket", "order", "status", "owner", "printer", "shipped", "refund", "team", "queue", "error", "log",
             "service", "region", "pending", "closed", "priority", "customer", "invoice", "note", "update"]
    out = []
    for k in range(n):
        rng = random.Random(seed * 1000 + k)

        def text(m: int, rng: random.Random = rng) -> str:
            return " ".join(rng.choice(words) for _ in range(m))

        msgs = [{"role": "system", "content": "You are a support agent. Use the tools; answer briefly."},
                {"role": "user", "content": f"Session {k}: find who owns ticket {rng.randint(1, 999)}. {text(12)}"}]
        for _ in range(turns):
            msgs.append({"role": "tool", "content": f"[cursor {len(msgs)}] {text(tool_words)}"})
            msgs.append({"role": "assistant", "content": text(reply_words)})
        out.append(msgs)
    return out


def workload_sessions(tokenizer, workload: str, n: int, turns: int, keep: int, reposition_every: int,
                      tool_words: int = 60, ops: bool = True) -> list[ReplaySession]:
    """The sessions of a workload, at most `turns` assistant turns each: `bfcl` (BFCL v4 multi-turn `long_context`
    conversations with their executed ground-truth calls and real tool responses, `kvsteward.synth.traces.bfcl`:
    the category whose tool responses run to 650-1,300 tokens, where a drop frees something), `bfcl-base` (the same
    conversations in `base`, tool responses of 10-60 tokens) or `synthetic`."""
    from kvsteward.synth.chat import generation_prompt, message_token_ids

    if workload in BFCL_WORKLOADS:
        from kvsteward.synth.traces.bfcl import bfcl_sessions

        convs = bfcl_sessions([BFCL_WORKLOADS[workload]], n, form="trace")
    elif workload == "synthetic":
        convs = synthetic_conversations(tokenizer, n, turns, tool_words)
    else:
        raise ValueError(f"unknown workload {workload!r} ({' | '.join(WORKLOADS)})")
    prompt = tokenizer.encode(generation_prompt(tokenizer, [{"role": "user", "content": "x"}]),
                              add_special_tokens=False)
    out = []
    for msgs in convs[:n]:
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in msgs]
        pieces = list(zip([m["role"] for m in msgs], message_token_ids(tokenizer, msgs), strict=True))
        out.append(ReplaySession(pieces, prompt, keep=keep, reposition_every=reposition_every, ops=ops,
                                 max_turns=turns))
    return out


def footprint(sessions: list[ReplaySession]) -> dict:
    """What the pool must hold at the end of the replays, without a server: `rows` = the final physical rows (what
    the prompts keep after the drops) summed over sessions, `histories` = the full conversations. A pool between the
    two is the benchmark's pressure point (rows fit, histories do not)."""
    import copy

    rows = histories = 0
    for s in sessions:
        s = copy.deepcopy(s)
        msgs: list[list[int]] = []
        while not s.done():
            msgs, cache = s.request()
            s.reply()
        dropped = {i for ids in cache["drop"].values() for i in ids} if msgs else set()
        rows += sum(len(m) for i, m in enumerate(msgs) if i not in dropped)
        histories += sum(len(m) for m in msgs)
    return {"rows": rows, "histories": histories}


def play_arm(url: str, sessions: list[ReplaySession], max_new_tokens: int, arm: str, aux_trigger: list[int],
             aux_tokens: int = 8, metrics: bool = True, poll_s: float = 0.25, miss: str = "refuse") -> dict:
    """Every session's turns, sessions concurrently (one thread each), with `/v1/loads` and `/metrics` polled.
    kvsteward arms send the op history (compact form) and seal the state before each drop; `kvsteward_aux` also
    sends an aux fork (the history + the trigger, `aux_tokens` generated) before each drop (SideQuest's pattern; no
    adapter here: the fork is an ordinary request on the pre-op state, its decision not applied); `default` sends the
    same physical `input_ids` without ops. Latency of a turn includes its seal and fork. `miss`: what a kvsteward
    request whose pre-op state was evicted gets, "refuse" (the client rebuilds the state exactly:
    `ops.generate_exact`; counted in `refusals`) or "reprefill" (served as plain tokens, counted by the tree)."""
    import requests

    from kvsteward.serve.sglang import aux
    from kvsteward.serve.sglang.ops import SglangHistory, generate_exact, request_fields

    kv = arm != "default"
    lock = threading.Lock()
    acc = {"latencies": [], "output_tokens": 0, "prompt_tokens": 0, "computed": 0, "seals": 0, "forks": 0,
           "refusals": 0}
    errors: list[BaseException] = []

    def post(body: dict, n: int) -> dict:
        body.setdefault("sampling_params", {}).update({"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
        r = requests.post(f"{url}/generate", json=body, timeout=3600)
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        with lock:
            acc["prompt_tokens"] += int(meta.get("prompt_tokens", 0))
            acc["computed"] += int(meta.get("prompt_tokens", 0)) - int(meta.get("cached_tokens", 0))
        return out

    def exact(history: SglangHistory, body: dict, messages: list[list[int]], cache: dict | None, n: int,
              count: str | None = None) -> dict:
        out, refusals = generate_exact(post, history, body, messages, cache, n)
        with lock:
            acc["refusals"] += refusals
            if count:
                acc[count] += 1
        return out

    def play(s: ReplaySession) -> None:
        history = SglangHistory(miss=miss)
        try:
            while not s.done():
                t0 = time.perf_counter()
                if kv and s.drops_next():  # the state the drop follows must be cached whole
                    messages, cache = s.seal()  # held until the op request continues it
                    exact(history, history.fields(messages, cache, hold=True), messages, cache, 1, "seals")
                    if arm == "kvsteward_aux":
                        fork = aux.fork_request(messages, cache, aux_trigger, miss=miss)
                        exact(history, fork, [*messages, list(aux_trigger)], cache, aux_tokens, "forks")
                messages, cache = s.request()
                if kv:
                    cache = cache if s.ops else None
                    out = exact(history, history.fields(messages, cache), messages, cache, max_new_tokens)
                else:
                    out = post({"input_ids": request_fields(messages, cache if s.ops else None)["input_ids"]},
                               max_new_tokens)
                dt = time.perf_counter() - t0
                s.reply(out["output_ids"])
                with lock:
                    acc["latencies"].append(dt)
                    acc["output_tokens"] += len(out["output_ids"])
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(e)

    m0 = prometheus_values(requests.get(f"{url}/metrics", timeout=10).text) if metrics else {}
    with LoadPoller(url, interval=poll_s, metrics=metrics) as loads:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=play, args=(s,)) for s in sessions]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    m1 = prometheus_values(requests.get(f"{url}/metrics", timeout=10).text) if metrics else {}

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    lat = sorted(acc["latencies"])

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(round(p * (len(lat) - 1))))] if lat else 0.0

    queued = delta("sglang:queue_time_seconds_count")
    return {"requests": len(lat), "wall_s": wall, "requests_per_s": len(lat) / wall if wall else 0.0,
            "output_tok_s": acc["output_tokens"] / wall if wall else 0.0, "output_tokens": acc["output_tokens"],
            "p50_s": pct(0.5), "p95_s": pct(0.95), "mean_s": statistics.fmean(lat) if lat else 0.0,
            "running_peak": loads.peak_running, "running_mean": loads.mean_running,
            "waiting_peak": loads.peak_waiting,
            "queue_time_mean_s": delta("sglang:queue_time_seconds_sum") / queued if queued else 0.0,
            "prompt_tokens": acc["prompt_tokens"], "prompt_tokens_computed": acc["computed"],
            "seal_requests": acc["seals"], "fork_requests": acc["forks"], "refusals": acc["refusals"],
            "peak_kv_used": loads.peak_used, "mean_kv_used": loads.mean_used,
            "peak_kv_allocated": loads.peak_allocated, "load_samples": loads.samples}


def bench_sglang(model_dir: str, tokenizer, concurrency: int = 4, turns: int = 8, max_new_tokens: int = 16,
                 keep: int = 2, reposition_every: int = 2, tool_words: int = 60, max_total_tokens: int = 16384,
                 dtype: str = "float32", port: int | None = None, threads: int = 2,
                 progress: Progress | None = None, log_dir: str | None = None, workload: str = "synthetic",
                 repeats: int = 3, arms: tuple[str, ...] = ARMS, sessions: int | None = None, aux_tokens: int = 8,
                 no_op: bool = True, no_op_sessions: int = 2, poll_s: float = 0.25, miss: str = "refuse") -> dict:
    """The benchmark's JSON: {"default": {...}, "kvsteward": {...}, "kvsteward_nofree": {...}, "kvsteward_aux":
    {...}, "no_op_overhead": float, "repeats": {arm: [...]}, "workload": {...}}.

    Arms (one server at a time, on the same `--max-total-tokens` pool): `default` (sglang's radix cache),
    `kvsteward_nofree` (the tree before issue 43: KVSTEWARD_FREE=off), `kvsteward` (dead KV freed: lazy),
    `kvsteward_aux` (freeing + an aux fork before each drop). `repeats` rounds, the arm order reversed every other
    round; each server gets a warm-up through the op path first (one short session with drops). Per arm: the mean
    over rounds of each number (per-round values under "repeats"); `reprefills` etc. from the tree's stats line.
    `no_op_overhead`: mean turn latency of op-free sessions on the kvsteward server / on the default one (each
    round, after the timed pass, `no_op_sessions` synthetic sessions of 3 turns). `miss`: see `play_arm`."""
    import json
    import os
    from pathlib import Path

    from kvsteward.serve.server.testing import free_port
    from kvsteward.serve.sglang.launch import SglangServer, server_command

    port = port or free_port()
    n = sessions or concurrency
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    trigger = tokenizer.encode(AUX_TRIGGER, add_special_tokens=False)

    def make(ops: bool = True, k: int = n, t: int = turns, wl: str = workload) -> list[ReplaySession]:
        return workload_sessions(tokenizer, wl, k, t, keep, reposition_every, tool_words, ops=ops)

    rounds: dict[str, list[dict]] = {a: [] for a in arms}
    no_ops: dict[str, list[float]] = {"default": [], "kvsteward": []}
    for r in range(repeats):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            cmd = server_command(model_dir, port, kvsteward=arm != "default", dtype=dtype,
                                 max_total_tokens=max_total_tokens, max_running_requests=max(8, concurrency),
                                 context_length=8192, extra=("--enable-metrics",))
            log = Path(log_dir) / f"sglang-{arm}-{r}.log" if log_dir else Path(
                os.environ.get("TMPDIR", "/tmp")) / f"kvsteward-bench-{os.getpid()}-{arm}-{r}.log"
            env = {"KVSTEWARD_FREE": "off" if arm == "kvsteward_nofree" else "lazy"}
            with SglangServer(cmd, port, log=log, threads=threads, env=env) as url:
                if progress:
                    progress(f"round {r + 1}/{repeats}: {arm} server up")
                # warm-up through the op path (drops, a seal, a reposition): first-request costs out of the timing
                play_arm(url, workload_sessions(tokenizer, "synthetic", 1, 3, 1, 2, 20), 2, arm, trigger, 2,
                         poll_s=poll_s)
                before = tree_stats(log.read_text(errors="replace"))
                retracted = retractions(log.read_text(errors="replace"))
                res = play_arm(url, make(), max_new_tokens, arm, trigger, aux_tokens, poll_s=poll_s, miss=miss)
                text = log.read_text(errors="replace")
                after = tree_stats(text)
                res["retractions"] = retractions(text) - retracted
                for key in ("reprefill", "compactions", "freed", "forks", "refused", "compacted_miss", "pinned",
                            "refused_miss", "op_nodes"):
                    if key in after:
                        res["tree_" + key] = after[key] - (before.get(key, 0) if key != "op_nodes" else 0)
                res["reprefills"] = res.get("tree_reprefill", 0)
                res["strict_check_failures"] = text.count("Mem Leak") + text.count("double free") + \
                    text.count("use-after-free")
                if no_op and arm in no_ops:
                    op_free = workload_sessions(tokenizer, "synthetic", no_op_sessions, 3, keep, 0, tool_words,
                                                ops=False)
                    no_ops[arm].append(play_arm(url, op_free, max_new_tokens, arm, trigger, poll_s=poll_s)["mean_s"])
            rounds[arm].append(res)
            if log_dir:  # what a long run has measured so far survives its interruption
                (Path(log_dir) / "rounds.json").write_text(json.dumps({"rounds": rounds, "no_op_s": no_ops}))
            if progress:
                progress(f"round {r + 1}: {arm}: {res['output_tok_s']:.1f} output tok/s, p95 {res['p95_s']:.2f} s, "
                         f"{res['retractions']} retractions, peak used {res['peak_kv_used']}, "
                         f"re-prefills {res['reprefills']}, refusals {res['refusals']}")

    def mean(xs: list[dict]) -> dict:
        keys = [k for k, v in xs[0].items() if isinstance(v, int | float)]
        return {k: statistics.fmean(x[k] for x in xs) for k in keys}

    out: dict = {arm: mean(rounds[arm]) for arm in arms if rounds[arm]}
    if no_ops["default"] and no_ops["kvsteward"]:
        out["no_op_overhead"] = statistics.fmean(no_ops["kvsteward"]) / statistics.fmean(no_ops["default"])
    if "default" in out and "kvsteward" in out and out["default"]["output_tok_s"]:
        out["kvsteward_vs_default_output_tok_s"] = out["kvsteward"]["output_tok_s"] / out["default"]["output_tok_s"]
    out["repeats"] = rounds
    out["no_op_mean_latency_s"] = no_ops
    out["workload"] = {"model": model_dir, "workload": workload, "sessions": n, "concurrency": n,
                       "final_tokens": footprint(make()),
                       "turns": turns, "max_new_tokens": max_new_tokens, "keep_tool_responses": keep,
                       "reposition_every_nth_drop": reposition_every, "tool_words": tool_words, "dtype": dtype,
                       "max_total_tokens": max_total_tokens, "server_threads": threads, "repeats": repeats,
                       "arms": list(arms), "aux_tokens": aux_tokens, "teacher_forced": True, "miss": miss}
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m kvsteward.serve.bench.sglang --workload bfcl ...` (the arguments of `steward bench sglang`)."""
    import argparse
    import json

    from kvsteward import models
    from kvsteward.serve.sglang.ops import MISS_MODES

    p = argparse.ArgumentParser(description=bench_sglang.__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--workload", default="synthetic", choices=list(WORKLOADS))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--reposition-every", type=int, default=2)
    p.add_argument("--tool-words", type=int, default=60)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--aux-tokens", type=int, default=8)
    p.add_argument("--no-op", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--miss", default="refuse", choices=list(MISS_MODES))
    p.add_argument("--log-dir", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    folder = models.resolve(a.model)
    tok = models.load_tokenizer(a.model)
    result = bench_sglang(folder, tok, concurrency=a.concurrency, turns=a.turns, max_new_tokens=a.max_new_tokens,
                          keep=a.keep, reposition_every=a.reposition_every, tool_words=a.tool_words,
                          max_total_tokens=a.max_total_tokens, dtype=a.dtype, threads=a.threads,
                          log_dir=a.log_dir or None, workload=a.workload, repeats=a.repeats,
                          arms=tuple(a.arms.split(",")), aux_tokens=a.aux_tokens, no_op=a.no_op, miss=a.miss,
                          progress=lambda m: print(m, file=__import__("sys").stderr, flush=True))
    result["workload"]["model"] = a.model
    print(json.dumps(result, indent=None if a.json else 2))


def match_prefix_scaling(message_counts: tuple[int, ...] = (8, 32, 128), message_len: int = 32, keep: int = 2,
                         repeats: int = 20, progress: Progress | None = None) -> dict:
    """What `OpRadixCache.match_prefix` costs per request as a conversation grows, on sglang's own tree and pools
    (CPU, in this process; no model: slots are allocated, not computed). For each length n: an agent conversation
    (`AgentSession`, rolling drops of old tool responses, a reposition every second drop) played turn by turn
    until it holds n messages, each turn matched and then cached as sglang would; then the next request is matched
    `repeats` times (median, milliseconds) in the full form (every message's ids in the payload) and in the compact
    form (base key + new messages), and as a plain token request on sglang's own `RadixCache` (the baseline)."""
    import statistics as stats
    from array import array
    from types import SimpleNamespace

    from kvsteward.serve.sglang.compat import prepare_sglang

    prepare_sglang()
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from transformers import LlamaConfig

    from kvsteward.kernels.rope import config_model_rope
    from kvsteward.serve.sglang.ops import SglangHistory, request_fields
    from kvsteward.serve.sglang.tree import OpRadixCache

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4})

    class KV(SimpleNamespace):
        def get_evicted_seqlen(self, component_type) -> int:
            return 0

        def swa_dead_lo(self, page_size: int) -> int:
            return 0

    class Req:
        def __init__(self, ids, custom=None):
            self.origin_input_ids, self.output_ids = array("q", ids), array("q")
            self.sampling_params = SimpleNamespace(custom_params=custom)
            self.extra_key, self.cache_salt, self.priority, self.lora_id = None, None, 0, None
            self.kv = KV(req_pool_idx=None, cache_protected_len=0)
            self.last_node = None

    def setup(cls, slots):
        pool = MHATokenToKVPool(size=slots, page_size=1, dtype=torch_dtype, head_num=2, head_dim=16, layer_num=1,
                                device="cpu", enable_memory_saver=False)
        alloc = TokenToKVPoolAllocator(slots, torch_dtype, "cpu", pool, need_sort=False)
        rows = ReqToTokenPool(4, 1 << 16, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc, page_size=1)
        return (cls(params, rope=config_model_rope(config)) if cls is OpRadixCache else cls(params)), rows, alloc

    def match(cache, req):
        ids = req.origin_input_ids
        t0 = time.perf_counter()
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, req.extra_key, limit=len(ids) - 1), req=req))
        return time.perf_counter() - t0, m

    def serve(cache, rows, alloc, req):
        """match, then as the scheduler: lock, allocate the rest, finish (insert, free, unpin, release)."""
        dt, m = match(cache, req)
        n = len(m.device_indices)
        req.kv.req_pool_idx = rows.alloc_rows(1)[0]
        cache.inc_lock_ref(m.last_device_node)
        req.last_node, req.kv.cache_protected_len = m.last_device_node, n
        new = alloc.alloc(len(req.origin_input_ids) - n)
        row = rows.req_to_token[req.kv.req_pool_idx]
        row[:n], row[n: len(req.origin_input_ids)] = m.device_indices.to(torch.int32), new.to(torch.int32)
        up_to = len(req.origin_input_ids)
        cache.insert_req(req, up_to=up_to)
        cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, up_to)])
        cache.unpin(req)
        cache.on_release(req, inserted=True)
        rows.free_rows([req.kv.req_pool_idx])
        return dt

    import torch

    torch_dtype = torch.float32
    sizes = {"system": message_len, "task": message_len, "tool": message_len, "prompt": 3}

    def make(kind: str, k: int) -> list[int]:
        g = torch.Generator().manual_seed(hash((kind, k)) % (1 << 31) if kind != "prompt" else 7)
        return torch.randint(10, 30000, (sizes[kind],), generator=g).tolist()

    rows_out = []
    for n_messages in message_counts:
        slots = 8 * n_messages * message_len + 4096
        ours, ours_rows, ours_alloc = setup(OpRadixCache, slots)
        base, base_rows, base_alloc = setup(RadixCache, slots)
        session, client = AgentSession(make, keep=keep), SglangHistory()
        reply = [11, 12, 13]
        while True:
            messages, cache = session.request()
            body = client.fields(messages, cache)
            serve(ours, ours_rows, ours_alloc, Req(body["input_ids"], body["sampling_params"]["custom_params"]))
            serve(base, base_rows, base_alloc, Req(body["input_ids"]))
            session.reply(reply)
            if session.drops_next():  # the seal: the state through the reply cached before the next drop
                seal = client.fields(*session.seal())
                serve(ours, ours_rows, ours_alloc, Req(seal["input_ids"], seal["sampling_params"]["custom_params"]))
            if len(session.messages) + 2 >= n_messages:
                break
        messages, cache = session.request()
        compact = client.fields(messages, cache)
        full = request_fields(messages, cache)
        timings = {}
        for name, cache_obj, body in (("compact", ours, compact), ("full", ours, full), ("radix", base, full)):
            custom = body["sampling_params"]["custom_params"] if name != "radix" else None
            ts = [match(cache_obj, Req(body["input_ids"], custom))[0] for _ in range(repeats)]
            timings[name] = stats.median(ts) * 1e3
        row = {"messages": len(messages), "resident_tokens": len(full["input_ids"]),
               "payload_bytes_full": len(full["sampling_params"]["custom_params"]["kvsteward"]),
               "payload_bytes_compact": len(compact["sampling_params"]["custom_params"]["kvsteward"]),
               "match_ms_full": timings["full"], "match_ms_compact": timings["compact"],
               "match_ms_radix_baseline": timings["radix"],
               "ops_in_history": len(cache["drop"]) + len(cache["reposition"])}
        rows_out.append(row)
        if progress:
            progress(f"match_prefix at {row['messages']} messages: {row}")
    return {"rows": rows_out, "message_len": message_len, "keep": keep, "repeats": repeats}


if __name__ == "__main__":
    main()
