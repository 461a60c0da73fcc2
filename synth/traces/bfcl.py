"""BFCL v4 multi-turn conversations as agent sessions with provenance (a real, not generated, workload).

The PyPI package `bfcl-eval` ships the multi-turn categories (`base`, `long_context`: 200 conversations each), their
ground-truth calls (one list of Python-syntax calls per user turn) and the tool simulators as plain Python classes
(`GorillaFileSystem`, `TwitterAPI`, `MathAPI`, `MessageAPI`, `TicketAPI`, `TradingBot`, `TravelAPI`,
`VehicleControlAPI`). Executing the ground truth against fresh simulators loaded with each conversation's
`initial_config` gives the tool responses: offline (the simulators import no network code, call nothing outside
their own state and write no files) and deterministic (their randomness is seeded by the scenario).

The executor (`execute`) mirrors `bfcl_eval`'s own `execute_multi_turn_func_call` (same class loading, same
`_load_scenario(deepcopy(config), long_context=...)`, the public methods of all involved classes in one namespace,
the same result formatting: strings as they are, dicts as `json.dumps`, anything else `str`, exceptions as
`Error during execution: ...`) but parses each call with `ast` (every ground-truth argument is a literal) instead of
`eval`, keeps no state in module globals, and names positional arguments from the method's signature so that every
call becomes an OpenAI `tool_calls` entry. `tests/test_synth_bfcl.py` checks it against BFCL's own executor.

Session layout (OpenAI chat format, one session per conversation): a system message listing the involved tools
(name, parameters, the tool-specific sentence of the description), then per turn the user message, one assistant
message per ground-truth call (no text, one structured call) followed by its tool response, and a closing assistant
message `CLOSING` (BFCL has no reference answer text). Every message keeps its index, so tool response i is cursor i.

Provenance (`value_reads`, the rule): a step (an assistant message) reads tool response c when it uses a value that
was *first shown* in c. The values of a step are the leaves of its calls' arguments (strings, and numbers written
with `str`) and the tokens of its text that are not plain words (ids, numbers, file names), each at least
`MIN_VALUE_CHARS` long. A value is shown in a message when it occurs there exactly, not inside a longer run of
letters, digits or `_`; its first showing is the earliest earlier message (system, user, assistant or tool) that
shows it. A value the user or the agent wrote before any response showed it reads nothing. What it misses: values
the agent derives (sums, counts, a date computed from a response), reformats (`150.0` shown, `150` used),
paraphrases or takes from a response without copying (a decision such as "the cheapest flight", the fact that a
file exists before `cd`), values shorter than the minimum (a three-letter ticker), and anything the final answer
would read: the closing message quotes nothing, so a response the user asked about ("what is my balance?") is read
only by the calls that copy its values. It may add: a value that first appears in a response by coincidence (a
number or a common word inside a long response). A step reads only the first showing, not later repeats.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from kvsteward.synth.rng import mix
from kvsteward.synth.traces.generate import split_of

CATEGORIES = ("base", "long_context")
ENV = "bfcl"
MIN_VALUE_CHARS = 4
CLOSING = "Done."
SYSTEM = ("You are an agent that completes the user's requests with these tools. Call one tool at a time and read "
          "its result before the next call.\n")
_TOKEN_RE = re.compile(r"[\w.\-/@#:$+]+")


@dataclass
class Call:
    """One executed ground-truth call."""

    source: str  # the ground truth's Python-syntax call, e.g. "cd(folder='document')"
    name: str
    arguments: dict[str, Any]
    cls: str  # the simulator class whose method ran
    output: str  # what BFCL's executor would return for it


def _bfcl():
    try:
        return importlib.import_module("bfcl_eval.constants.executable_backend_config")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("kvsteward.synth.traces.bfcl needs the PyPI package bfcl-eval (pip install --no-deps "
                          "bfcl-eval==2026.3.23 mpmath; see requirements.txt)") from e


def _data(name: str) -> list[dict[str, Any]]:
    _bfcl()
    text = resources.files("bfcl_eval").joinpath("data", *name.split("/")).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@cache
def _entries(category: str) -> tuple[dict[str, Any], ...]:
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; expected one of {', '.join(CATEGORIES)}")
    questions = _data(f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _data(f"possible_answer/BFCL_v4_multi_turn_{category}.json")}
    out = []
    for q in questions:
        gt = answers.get(q["id"])
        if gt is None or len(gt) != len(q["question"]):
            raise ValueError(f"{q['id']}: ground truth missing or not one list per turn")
        out.append({**q, "ground_truth": gt, "category": category})
    return tuple(out)


def load_entries(category: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The category's conversations in file order, each with its `ground_truth` (one list of calls per turn)."""
    entries = list(_entries(category))
    return copy.deepcopy(entries[:limit] if limit is not None else entries)


@cache
def _func_docs(cls: str) -> tuple[dict[str, Any], ...]:
    return tuple(_data(f"multi_turn_func_doc/{_bfcl().MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]}"))


def tool_listing(entry: dict[str, Any]) -> str:
    """The system message: one line per available tool (excluded functions left out), `name(p: type, ...)` and the
    tool's own sentence of the description (the part after "Tool description:")."""
    excluded = set(entry.get("excluded_function") or [])
    lines = [SYSTEM]
    for cls in entry["involved_classes"]:
        for doc in _func_docs(cls):
            if doc["name"] in excluded:
                continue
            props = doc.get("parameters", {}).get("properties", {})
            params = ", ".join(f"{p}: {v.get('type', 'any')}" for p, v in props.items())
            desc = doc.get("description", "").split("Tool description:")[-1].strip()
            lines.append(f"- {doc['name']}({params}): {desc}")
    return "\n".join(lines)


def _format(result: Any) -> str:
    """BFCL's formatting of a call's result (`execute_multi_turn_func_call`)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:  # noqa: BLE001 - BFCL's own fallback
            return str(result)
    return str(result)


class Simulators:
    """Fresh instances of a conversation's involved classes, loaded with its initial config (as BFCL does)."""

    def __init__(self, entry: dict[str, Any], long_context: bool):
        cfg = _bfcl()
        self.methods: dict[str, tuple[str, Any]] = {}
        for cls in entry["involved_classes"]:
            instance = getattr(importlib.import_module(cfg.CLASS_FILE_PATH_MAPPING[cls]), cls)()
            if cls not in cfg.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(entry["initial_config"].get(cls, {})), long_context=long_context)
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = (cls, method)

    def call(self, source: str) -> Call:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError(f"not a plain function call: {source!r}")
        name = node.func.id
        if name not in self.methods:
            raise ValueError(f"{source!r}: no involved class has a method {name!r}")
        cls, method = self.methods[name]
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        bound = inspect.signature(method).bind(*args, **kwargs)  # positional → named, for the tool_calls JSON
        arguments = dict(bound.arguments)
        try:
            output = _format(method(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - BFCL records the error as the response
            output = f"Error during execution: {e}"
        return Call(source=source, name=name, arguments=arguments, cls=cls, output=output)


def execute(entry: dict[str, Any]) -> list[list[Call]]:
    """Run the ground truth turn by turn against fresh simulators (state carries over between turns)."""
    sims = Simulators(entry, long_context=entry.get("category") == "long_context")
    return [[sims.call(src) for src in turn] for turn in entry["ground_truth"]]


# ---- provenance --------------------------------------------------------------------------------------------------

def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, str):
        yield value
    elif isinstance(value, int | float):
        yield str(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _leaves(v)


def step_values(message: dict[str, Any], min_chars: int = MIN_VALUE_CHARS) -> list[str]:
    """The values an assistant message uses: its calls' argument leaves and the tokens of its text that are not
    plain words (≥ `min_chars`)."""
    vals: list[str] = []
    for tc in message.get("tool_calls") or []:
        vals.extend(_leaves(json.loads(tc["function"]["arguments"] or "{}")))
    for tok in _TOKEN_RE.findall(message.get("content") or ""):
        tok = tok.strip(".:-/#$+")
        if not tok.isalpha():  # identifiers, numbers, file names; plain words are language, not values
            vals.append(tok)
    out = []
    for v in vals:
        if len(v.strip()) >= min_chars and v not in out:
            out.append(v)
    return out


def shown_text(message: dict[str, Any]) -> str:
    """What a message shows the agent: its content, plus the argument values of its calls (their JSON)."""
    parts = [message.get("content") or ""]
    for tc in message.get("tool_calls") or []:
        parts.append(tc["function"]["name"] + " " + (tc["function"]["arguments"] or ""))
    return "\n".join(parts)


def shows(text: str, value: str) -> bool:
    """`value` occurs in `text` exactly, not inside a longer run of letters, digits or `_`."""
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(value) + r"(?![A-Za-z0-9_])", text) is not None


def value_reads(messages: list[dict[str, Any]], min_chars: int = MIN_VALUE_CHARS) -> dict[int, list[int]]:
    """The rule: assistant step s reads tool message c < s when a value of s (`step_values`) is first shown in c.
    Returns `{step: [cursor ids ascending]}` (steps with no read left out); indices are message indices."""
    texts = [shown_text(m) for m in messages]
    reads: dict[int, list[int]] = {}
    for s, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        got = set()
        for v in step_values(m, min_chars):
            first = next((j for j in range(s) if shows(texts[j], v)), None)
            if first is not None and messages[first].get("role") == "tool":
                got.add(first)
        if got:
            reads[s] = sorted(got)
    return reads


# ---- sessions ----------------------------------------------------------------------------------------------------

def _import_split(tid: str) -> str:
    """The split `steward synth import` gives a session id (`importer.read_openai_jsonl`)."""
    return split_of(mix("import", tid))


def session_id(category: str, index: int) -> str:
    """`bfcl-<category>-<index>`, or with a `.k` suffix (smallest k ≥ 1) chosen so that the import gives it the split
    of `bfcl-base-<index>`: 185 of the 200 long_context conversations are base conversations with longer responses,
    so a conversation and its long_context version must share a split (no test conversation seen in training)."""
    want, tid, k = _import_split(f"bfcl-base-{index}"), f"bfcl-{category}-{index}", 0
    while _import_split(tid) != want:
        k += 1
        tid = f"bfcl-{category}-{index}.{k}"
    return tid


def entry_index(entry: dict[str, Any]) -> int:
    return int(entry["id"].rsplit("_", 1)[1])


def session(entry: dict[str, Any], executed: list[list[Call]] | None = None,
            min_chars: int = MIN_VALUE_CHARS) -> dict[str, Any]:
    """One conversation as an OpenAI-style session with its provenance: the line `steward synth import --planner
    provenance` reads (`id`, `messages`, `reads`, `env`, `question`, `answer`, `cues`; cue = the tool's class),
    plus `bfcl_id` and `category`."""
    executed = executed if executed is not None else execute(entry)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": tool_listing(entry)}]
    cues: dict[str, str] = {}
    for t, (turn, calls) in enumerate(zip(entry["question"], executed, strict=True)):
        for m in turn:
            msgs.append({"role": m["role"], "content": m["content"]})
        for k, c in enumerate(calls):
            cid = f"call_{t}_{k}"
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": cid, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}]})
            cues[str(len(msgs))] = c.cls
            msgs.append({"role": "tool", "tool_call_id": cid, "content": c.output})
        msgs.append({"role": "assistant", "content": CLOSING})
    reads = value_reads(msgs, min_chars)
    return {"id": session_id(entry["category"], entry_index(entry)), "bfcl_id": entry["id"],
            "category": entry["category"], "env": ENV, "question": entry["question"][0][0]["content"], "answer": "",
            "messages": msgs, "reads": {str(k): v for k, v in sorted(reads.items())}, "cues": cues}


def sessions(categories: Iterable[str] = CATEGORIES, limit: int | None = None,
             min_chars: int = MIN_VALUE_CHARS) -> list[dict[str, Any]]:
    """Every conversation of the categories (the first `limit` of each) as a session record (`session`)."""
    return [session(e, min_chars=min_chars) for cat in categories for e in load_entries(cat, limit)]


def bfcl_sessions(categories: Iterable[str] = CATEGORIES, limit: int | None = None,
                  form: str = "trace") -> list[list[dict[str, Any]]]:
    """Chat-message lists to replay (the bench's `--workload bfcl` input). `form="trace"`: `{role, content}` only,
    calls rendered Hermes-style into the assistant content and tool responses tagged `[cursor i]` (what `steward
    synth import` makes, any chat template prints it); `form="openai"`: structured `tool_calls` / `tool_call_id`."""
    if form not in ("trace", "openai"):
        raise ValueError(f"form must be 'trace' or 'openai', got {form!r}")
    from kvsteward.synth.traces.importer import openai_to_messages

    recs = sessions(categories, limit)
    if form == "openai":
        return [r["messages"] for r in recs]
    return [openai_to_messages(r["messages"], r["id"]) for r in recs]


def write_sessions(path, records: list[dict[str, Any]]) -> None:
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def summary(records: list[dict[str, Any]], tokenizer=None) -> dict[str, Any]:
    """Counts per category: conversations, user turns, tool responses, responses some later step reads, read edges,
    error responses, response characters; with a tokenizer also tokens (the trace form, as `steward synth import`
    writes it, piece by piece through the chat template): total, per conversation (mean, max), in tool responses."""
    from kvsteward.synth.traces.importer import openai_to_messages

    out: dict[str, Any] = {}
    for r in records:
        c = out.setdefault(r["category"], {"conversations": 0, "turns": 0, "tool_responses": 0,
                                           "responses_read": 0, "read_edges": 0, "error_responses": 0,
                                           "response_chars": 0})
        msgs = r["messages"]
        tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
        c["conversations"] += 1
        c["turns"] += sum(m["role"] == "user" for m in msgs)
        c["tool_responses"] += len(tools)
        c["responses_read"] += len({c2 for v in r["reads"].values() for c2 in v})
        c["read_edges"] += sum(len(v) for v in r["reads"].values())
        c["error_responses"] += sum(msgs[i]["content"].startswith("Error during execution") for i in tools)
        c["response_chars"] += sum(len(msgs[i]["content"]) for i in tools)
        if tokenizer is not None:
            from kvsteward.synth.chat import message_token_ids

            pieces = [len(p) for p in message_token_ids(tokenizer, openai_to_messages(msgs, r["id"]))]
            c["tokens"] = c.get("tokens", 0) + sum(pieces)
            c["max_tokens"] = max(c.get("max_tokens", 0), sum(pieces))
            c["response_tokens"] = c.get("response_tokens", 0) + sum(pieces[i] for i in tools)
    for c in out.values():
        if "tokens" in c:
            c["mean_tokens"] = round(c["tokens"] / c["conversations"], 1)
    return out
