"""Why pace answers the fee rate with the quantum: interventions on pace's own cache at each fact probe.

Plays each session through `pace` exactly as `steward eval longsession` does (same sessions, budget, chunk, limit,
whole-message oracle plan) and, when a fact probe's answer opens, greedy-decodes and teacher-forces the gold value
on forks of that state changed in one way each:

- `as_played`: nothing changed (must reproduce the benchmark's row);
- `drop_other_defs`: the definition messages the probe does not read are dropped (is a neighbouring definition the
  distractor?);
- `drop_unplanned`: every resident token that is neither a definition message, the system message nor the probes'
  own text is dropped (do the heavy-hitter filler tokens between the definitions and the query confuse it?);
- `defs_before_probe`: positions are reassigned so that the definition messages sit right before the probe text
  (the rest keep their order before them): the smallest rotary gap the same resident set allows;
- `original_positions`: the same resident set at the positions its tokens had in the uncompressed session
  (retention-only's geometry for pace's tokens). Under bounded positions whose limit these exceed, the fork
  renumbers at the first decoded token, and the rows equal `repositioned`'s (so they did in this study, L = 2048);
- `repositioned`: the engine's `reposition` op: positions 0..r-1 in logical order (`recomputed`'s geometry with
  pace's cached K/V);
- `recomputed`: the resident tokens, in order, prefilled from scratch at positions 0..r-1 (no stale K/V: the model
  reads the compressed text as a prompt).

Every position change goes through the engine's exact re-rotation (`move_resident`). Output: one JSON row per
(session, probe, intervention) with the forced-prefix match, gold NLL, the greedy text and the log-probabilities
of the gold value's and the other definitions' values' first differing tokens.

    python diagnose.py --seed 2031 --sessions 3 --distances 1024,7000 --out rows-seed2031.json
    python diagnose.py --seed 2031 --sessions 3 --interventions as_played,repositioned --out repositioned-seed2031.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsteward.eval import scoring
from kvsteward.eval.longsession.runner import RunConfig, play
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.session import move_resident
from kvsteward.synth.longsession.generate import generate_sessions

INTERVENTIONS = ("as_played", "drop_other_defs", "drop_unplanned", "defs_before_probe", "original_positions",
                 "repositioned", "recomputed")


def _reposition(s, new_pos: torch.Tensor) -> None:
    move_resident(s.table, s.engine.rope, new_pos)
    s.next_pos = int(new_pos.max()) + 1


def _variant(engine: Engine, s, name: str, defs: set[int], needed_defs: set[int], probe_start: int,
             system: tuple[int, int]):
    """A fork of `s` changed by intervention `name` (or a fresh session for `recomputed`)."""
    f = s.fork()
    logical = f.resident_logical()

    def in_defs(which: set[int]) -> torch.Tensor:
        return torch.tensor([any(a <= i < b for a, b in which) for i in logical.tolist()], dtype=torch.bool)

    if name == "as_played":
        return f
    if name == "drop_other_defs":
        f.drop(logical[in_defs(defs - needed_defs)].tolist())
        return f
    if name == "drop_unplanned":
        keep = in_defs(defs) | (logical >= probe_start) | ((logical >= system[0]) & (logical < system[1]))
        f.drop(logical[~keep].tolist())
        return f
    if name == "defs_before_probe":
        is_def, is_probe = in_defs(defs), logical >= probe_start
        order = torch.cat([torch.nonzero(~is_def & ~is_probe).view(-1), torch.nonzero(is_def).view(-1),
                           torch.nonzero(is_probe).view(-1)])
        new_pos = torch.empty_like(order)
        new_pos[order] = torch.arange(order.numel())
        _reposition(f, new_pos)
        return f
    if name == "repositioned":
        f.reposition()
        return f
    if name == "original_positions":
        _reposition(f, logical.clone())
        return f
    if name == "recomputed":
        fresh = engine.session("full", chunk=s.config.chunk)
        fresh.append([s.tokens[i] for i in logical.tolist()], kind="user", logits="last")
        return fresh
    raise ValueError(name)


def _first_token_logprob(s, value_ids: list[int], gold_ids: list[int]) -> float:
    """Log-probability of `value_ids` over `gold_ids` at the first token where they differ (teacher-forced on a
    fork up to that point); NaN when one is a prefix of the other."""
    k = 0
    while k < min(len(value_ids), len(gold_ids)) and value_ids[k] == gold_ids[k]:
        k += 1
    if k >= len(value_ids) or k >= len(gold_ids):
        return float("nan")
    f = s.fork()
    if k:
        f.append(value_ids[:k], kind="assistant", continue_message=True, logits=None)
    logp = torch.log_softmax(f.last_logits.float(), dim=-1)
    return float(logp[value_ids[k]])


def diagnose(engine: Engine, sess, cfg: RunConfig, interventions: tuple[str, ...] = INTERVENTIONS) -> list[dict]:
    tok = engine.tokenizer
    at = sess.layout.message_offsets
    ranges = list(zip(at[:-1], at[1:], strict=True))  # each context message's token span
    defs = {ranges[step[0]] for step in sess.definition_steps}
    regions = {r.key: r.message for r in sess.regions}
    rows = []

    def at_probe(s, probe) -> None:
        if probe.kind != "fact":
            return
        gold = tok.encode(probe.gold, add_special_tokens=False)
        needed_defs = {ranges[regions[k]] for k in probe.needs}
        others = {k: v for k, v in sess.facts.items() if v != probe.gold and v.strip()}
        for name in interventions:
            t0 = time.perf_counter()
            v = _variant(engine, s, name, defs, needed_defs, at[-1], ranges[0])
            generated = v.fork().generate(max(cfg.max_fact_tokens, len(gold) + 2), stop_ids=engine.stop_ids)
            competitors = {k: _first_token_logprob(v, tok.encode(val, add_special_tokens=False), gold)
                           for k, val in others.items()}
            rows.append({"session": sess.id, "distance": sess.distance, "probe": probe.id, "intervention": name,
                         "score": float(scoring.forced_prefix_match(generated, gold, tok)),
                         "nll": scoring.appended_gold_nll(v.fork(), gold),
                         "generated": tok.decode(generated, skip_special_tokens=True),
                         "resident": v.resident, "max_position": int(v.resident_positions().max()),
                         "competitor_logprob": competitors, "seconds": round(time.perf_counter() - t0, 2)})
            print(json.dumps({k: rows[-1][k] for k in ("session", "probe", "intervention", "score", "generated")}),
                  flush=True)

    play(engine, sess, "pace", cfg, on_probe=at_probe)  # the benchmark's own play; interventions read forks
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--distances", default="1024,7000")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=2048)
    ap.add_argument("--only", default="", help="comma-separated session ids to play (default: all)")
    ap.add_argument("--interventions", default=",".join(INTERVENTIONS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    engine = Engine.load("smollm2")
    cfg = RunConfig(arms=("pace",), budget=a.budget, chunk=512, limit=a.limit, code=False, blueprint="messages")
    sessions = generate_sessions(engine.tokenizer, a.sessions, a.length, [int(d) for d in a.distances.split(",")],
                                 a.seed)
    only = {x for x in a.only.split(",") if x}
    rows = []
    for sess in sessions:
        if only and sess.id not in only:
            continue
        rows += diagnose(engine, sess, cfg, tuple(a.interventions.split(",")))
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
