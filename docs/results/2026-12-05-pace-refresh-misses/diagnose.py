"""Why pace-refresh answers the fee rate with the quantum at D = 1,024: interventions on the refreshed state.

Plays each session through `pace-refresh` exactly as `steward eval longsession` does and, when the chosen fact
probes' answers open, greedy-decodes and teacher-forces the gold value on fresh encodings of token lists built from
that state (every variant is a new session: after a refresh the resident K/V are a new session's, so changing the
text and prefilling afresh is the refresh of that text):

- `as_played`: the state itself (must reproduce the benchmark's row);
- `recomputed`: the resident tokens prefilled afresh (≈ as_played; differs only if the opener evicted);
- `one_chunk`: the same, one forward instead of chunks of H (does chunking matter?);
- `full_context`: every token of the session so far, nothing evicted (the full cache: the model's ceiling);
- `no_filler`: only the system message, the definition messages and the probe's own tokens;
- `no_filler_before`: the resident filler before the definitions (heavy hitters) dropped;
- `no_filler_after`: the resident filler between the definitions and the probe (the recent window) dropped;
- `needed_def_only`: the definition messages the probe does not read dropped (an oracle's knowledge);
- `defs_before_probe`: the definition messages moved right after the filler, next to the probe (order changed);
- `contiguous`: the system message and the session's text from the first definition on, with no holes.

For `as_played` it also records where the answer opening's last token attends (SmolLM2 through transformers' eager
attention over the same tokens): the attention mass on the needed line, on each other fact's line, on each
definition message, the system message, the resident filler and the probe text, per layer.

    python diagnose.py --seed 4513 --sessions 10 --distances 1024 --shard 0/2 --out rows-0.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsteward import models
from kvsteward.eval import scoring
from kvsteward.eval.longsession.runner import RunConfig, play
from kvsteward.serve.engine import Engine
from kvsteward.synth.longsession.generate import generate_sessions

INTERVENTIONS = ("as_played", "recomputed", "one_chunk", "full_context", "no_filler", "no_filler_before",
                 "no_filler_after", "needed_def_only", "defs_before_probe", "contiguous")


class _Stop(Exception):
    """Raised after the last probe of interest: the rest of the session is not needed."""


def _spans_mask(idx: list[int], spans) -> torch.Tensor:
    return torch.tensor([any(a <= i < b for a, b in spans) for i in idx], dtype=torch.bool)


def _variant_tokens(s, name: str, defs: list[tuple[int, int]], needed_defs: list[tuple[int, int]], probe_start: int,
                    system: tuple[int, int]) -> list[int] | None:
    """The logical indices a variant encodes (None: the played state itself)."""
    logical = s.resident_logical().tolist()
    if name == "as_played":
        return None
    if name in ("recomputed", "one_chunk"):
        return logical
    if name == "full_context":
        return list(range(len(s.tokens)))
    is_def = _spans_mask(logical, defs)
    is_sys = _spans_mask(logical, [system])
    is_probe = torch.tensor([i >= probe_start for i in logical])
    filler = ~(is_def | is_sys | is_probe)
    first_def, last_def = defs[0][0], defs[-1][1]
    before = torch.tensor([i < first_def for i in logical]) & filler
    after = torch.tensor([i >= last_def for i in logical]) & filler
    pick = {"no_filler": ~filler, "no_filler_before": ~before, "no_filler_after": ~after,
            "needed_def_only": ~(is_def & ~_spans_mask(logical, needed_defs))}
    if name in pick:
        return [i for i, k in zip(logical, pick[name].tolist(), strict=True) if k]
    if name == "defs_before_probe":
        others = [i for i, d, p in zip(logical, is_def.tolist(), is_probe.tolist(), strict=True) if not d and not p]
        return others + [i for i, d in zip(logical, is_def.tolist(), strict=True) if d] + \
            [i for i in logical if i >= probe_start]
    if name == "contiguous":
        return list(range(*system)) + list(range(first_def, len(s.tokens)))
    raise ValueError(name)


def _first_token_logprob(s, value_ids: list[int], gold_ids: list[int]) -> float:
    """Log-probability of `value_ids` at its first token that differs from `gold_ids` (teacher-forced to there)."""
    k = 0
    while k < min(len(value_ids), len(gold_ids)) and value_ids[k] == gold_ids[k]:
        k += 1
    if k >= len(value_ids) or k >= len(gold_ids):
        return float("nan")
    f = s.fork()
    if k:
        f.append(value_ids[:k], kind="assistant", continue_message=True, logits=None)
    return float(torch.log_softmax(f.last_logits.float(), dim=-1)[value_ids[k]])


@torch.no_grad()
def attention_mass(hf, token_ids: list[int], groups: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per layer, the last token's attention (mean over heads) summed over each group of positions."""
    out = hf(torch.tensor([token_ids]), output_attentions=True, use_cache=False)
    mass = {g: [] for g in groups}
    for att in out.attentions:  # [1, heads, q, k]
        row = att[0, :, -1, :].mean(0)
        for g, m in groups.items():
            mass[g].append(round(float(row[m].sum()), 5))
    return mass


def diagnose(engine: Engine, hf, sess, cfg: RunConfig, interventions: tuple[str, ...], probe_ids: set[str]) -> list:
    tok = engine.tokenizer
    at = sess.layout.message_offsets
    ranges = list(zip(at[:-1], at[1:], strict=True))
    defs = sorted(ranges[step[0]] for step in sess.definition_steps)
    regions = {r.key: r.message for r in sess.regions}
    rows: list[dict] = []
    seen: set[str] = set()

    def at_probe(s, probe) -> None:
        if probe.id not in probe_ids:
            return
        seen.add(probe.id)
        gold = tok.encode(probe.gold, add_special_tokens=False)
        needed_defs = sorted({ranges[regions[k]] for k in probe.needs})
        others = {k: v for k, v in sess.facts.items() if v != probe.gold and v.strip()}
        for name in interventions:
            t0 = time.perf_counter()
            idx = _variant_tokens(s, name, defs, needed_defs, at[-1], ranges[0])
            if idx is None:
                v = s.fork()
            else:
                chunk = len(idx) if name == "one_chunk" else s.config.chunk
                v = engine.session("full", chunk=chunk)
                v.append([s.tokens[i] for i in idx], kind="user", logits="last")
            generated = v.fork().generate(max(cfg.max_fact_tokens, len(gold) + 2), stop_ids=engine.stop_ids)
            row = {"session": sess.id, "distance": sess.distance, "probe": probe.id, "intervention": name,
                   "score": float(scoring.forced_prefix_match(generated, gold, tok)),
                   "nll": scoring.appended_gold_nll(v.fork(), gold),
                   "generated": tok.decode(generated, skip_special_tokens=True), "encoded": v.resident,
                   "competitor_logprob": {k: _first_token_logprob(v, tok.encode(val, add_special_tokens=False), gold)
                                          for k, val in others.items()},
                   "seconds": round(time.perf_counter() - t0, 2)}
            if name == "as_played":
                logical = s.resident_logical().tolist()
                groups = {"needed_line": _spans_mask(logical, sess.layout.needed_spans[probe.id])}
                for pid, spans in sess.layout.needed_spans.items():
                    if pid.startswith("fact:") and pid != probe.id:
                        groups[f"line:{pid[5:]}"] = _spans_mask(logical, spans)
                for j, d in enumerate(defs):
                    groups[f"def{j + 1}"] = _spans_mask(logical, [d])
                groups["system"] = _spans_mask(logical, [ranges[0]])
                groups["probe"] = torch.tensor([i >= at[-1] for i in logical])
                groups["filler"] = ~(groups["system"] | groups["probe"] | _spans_mask(logical, defs))
                row["attention"] = attention_mass(hf, s.table.field("token").tolist(), groups)
                row["group_tokens"] = {g: int(m.sum()) for g, m in groups.items()}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("session", "probe", "intervention", "score", "encoded",
                                                  "generated")}), flush=True)
        if seen >= probe_ids:
            raise _Stop

    try:
        play(engine, sess, "pace-refresh", cfg, on_probe=at_probe)
    except _Stop:
        pass
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--distances", default="1024")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=2048)
    ap.add_argument("--probes", default="fact:fee_rate")
    ap.add_argument("--shard", default="0/1", help="I/N: play every N-th session from the I-th")
    ap.add_argument("--only", default="", help="comma-separated session ids to play (default: all)")
    ap.add_argument("--interventions", default=",".join(INTERVENTIONS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    engine = Engine.load("smollm2")
    hf, _ = models.load("smollm2", attn_implementation="eager")
    cfg = RunConfig(arms=("pace-refresh",), budget=a.budget, chunk=512, limit=a.limit, code=False,
                    blueprint="messages")
    sessions = generate_sessions(engine.tokenizer, a.sessions, a.length, [int(d) for d in a.distances.split(",")],
                                 a.seed)
    i, n = (int(x) for x in a.shard.split("/"))
    only = {x for x in a.only.split(",") if x}
    rows: list[dict] = []
    for k, sess in enumerate(sessions):
        if k % n != i or (only and sess.id not in only):
            continue
        rows += diagnose(engine, hf, sess, cfg, tuple(a.interventions.split(",")), set(a.probes.split(",")))
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
