"""RULER needle tasks, generated offline with RULER's own generator (the PyPI package `nvidia-long-context-eval`,
`long_context_eval/data/synthetic/niah.py`, installed in `.venv-kvpress`) for any tokenizer, and RULER's metric.

The synthetic haystacks used here need no download: `repeat` ("The grass is green. ...", RULER's niah_single_1) and
`needle` (the haystack is other key-value needles, RULER's niah_multikey_2). The prompt is RULER's niah template with
a marker between the context and the question, so that the context (what a press compresses) and the question
(asked after compression, as kvpress's pipeline does) come apart exactly.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

MARK = "@@QUESTION@@"
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n" + MARK
            + "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
# RULER's configurations (RULER scripts/synthetic.yaml) of the tasks whose haystack needs no download
TASKS = {
    "niah_single_1": {"type_haystack": "repeat", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_multikey_2": {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"},
}


@functools.cache  # one lookup per interpreter, not one per task
def generator_script(python: str) -> str:
    out = subprocess.run([python, "-c", "import long_context_eval, os; print(os.path.dirname("
                          "long_context_eval.__file__))"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"RULER's generator is not installed in {python} (`make kvpress-venv`): "
                           f"{out.stderr.strip()[-300:]}")
    return str(Path(out.stdout.strip()) / "data" / "synthetic" / "niah.py")


def generate(python: str, tokenizer_dir: str, task: str, samples: int, length: int, workdir: Path,
             seed: int = 42, tokens_to_generate: int = 32) -> list[dict]:
    """`samples` prompts of `task`, at most `length` tokens with the answer: [{"id", "context", "question",
    "answer_prefix", "outputs"}]. Deterministic in `seed`."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r} ({', '.join(TASKS)})")
    args = [python, generator_script(python), "--save_dir", str(workdir), "--save_name", task,
            "--tokenizer_path", tokenizer_dir, "--tokenizer_type", "hf", "--max_seq_length", str(length),
            "--tokens_to_generate", str(tokens_to_generate), "--num_samples", str(samples),
            "--random_seed", str(seed), "--template", TEMPLATE]
    for k, v in TASKS[task].items():
        args += [f"--{k}", v]
    out = subprocess.run(args, capture_output=True, text=True, cwd=workdir)
    if out.returncode:
        raise RuntimeError(f"RULER's generator failed on {task}: {out.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in (workdir / task / "validation.jsonl").read_text().splitlines() if line]
    return [split(f"{task}-{r['index']}", r["input"], r["outputs"]) for r in rows]


def split(task_id: str, text: str, outputs: list[str]) -> dict:
    context, question = text.split(MARK)
    query = re.search(r" for (.+) mentioned in the provided text\?$", question)
    if query is None:
        raise ValueError(f"{task_id}: not a RULER niah question: {question!r}")
    # RULER's answer prefix for niah (its templates): the model continues a sentence that leads to the value
    noun = "numbers" if " are all " in question else "number"
    verb = "are" if noun == "numbers" else "is"
    prefix = f" The special magic {noun} for {query.group(1)} mentioned in the provided text {verb}"
    return {"id": task_id, "context": context, "question": question, "answer_prefix": prefix, "outputs": outputs}


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's niah metric (`string_match_all`): the fraction of the references that occur in the prediction,
    case-insensitively."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)
