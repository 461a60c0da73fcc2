"""`steward synth ...` and `steward plan ...` (owned by the trace-synthesis work)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

synth_app = typer.Typer(no_args_is_help=True)
plan_app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}", soft_wrap=True)
    raise typer.Exit(2)


@synth_app.command()
def traces(
    tasks: int = typer.Option(50, help="number of tasks per environment (one correct trace each)"),
    seed: int = typer.Option(0, help="world and task seed (same seed → identical traces)"),
    out: Path = typer.Option(..., help="output folder (traces.jsonl + meta.json)"),
    env: str = typer.Option("research", "--env", "--source",
                            help="comma-separated environments: research, ops, support (agent traces), templated (the "
                                 "original research generator), or longsession (benchmark sessions, alone)"),
    min_hops: int | None = typer.Option(None, help="templated: fewest documents a task needs"),
    max_hops: int | None = typer.Option(None, help="templated: most documents a task needs"),
    page_words: int | None = typer.Option(None, help="templated: words per page of an opened document"),
    doc_words: int | None = typer.Option(None, help="templated: typical document length in words"),
    detour_rate: float | None = typer.Option(None, help="chance of an exploratory detour per hop"),
    compare_rate: float | None = typer.Option(None, help="share of two-branch comparison tasks"),
    recap_rate: float | None = typer.Option(None, help="share of final answers that restate the facts found"),
    world_size: int | None = typer.Option(None, help="templated: documents per split world"),
    top_k: int | None = typer.Option(None, help="search results per query"),
    option: list[str] = typer.Option([], "--option", "-o", help="an environment option KEY=VALUE (repeatable; see "
                                     "docs/synth.md for each environment's options)"),
    length: int = typer.Option(16384, help="longsession: session context length in tokens (measured with --model)"),
    distances: str = typer.Option("", help="longsession: comma-separated distances per seed (default length/4)"),
    chunk_tokens: int = typer.Option(2000, help="longsession: tokens per stdlib filler chunk (= per cursor)"),
    model: str = typer.Option("smollm2", help="longsession: tokenizer that measures the session length"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Generate correct traces with exact provenance: agent environments (one or several) or long sessions."""
    from kvsteward.synth.traces.trace import write_traces

    t0 = time.perf_counter()
    if env == "longsession":
        result, meta = _longsession_traces(tasks, seed, length, distances, chunk_tokens, model)
    else:
        given = {"min_hops": min_hops, "max_hops": max_hops, "page_words": page_words, "doc_words": doc_words,
                 "detour_rate": detour_rate, "top_k": top_k, "compare_rate": compare_rate,
                 "recap_rate": recap_rate, "world_size": world_size}
        shared = {k: v for k, v in given.items() if v is not None}  # unset: each environment's own default
        result, meta = _env_traces(env, tasks, seed, shared, option)
    path = write_traces(out, result, meta)
    summary = {"traces": len(result), "path": str(path), "wall_s": round(time.perf_counter() - t0, 2),
               "splits": {s: sum(t.split == s for t in result) for s in ("train", "validation", "test")},
               "envs": {e: sum(t.env == e for t in result) for e in dict.fromkeys(t.env for t in result)},
               "mean_messages": sum(len(t.messages) for t in result) / len(result),
               "mean_cursors": sum(len(t.cursors()) for t in result) / len(result)}
    print(json.dumps(summary) if as_json else f"wrote {len(result)} traces to {path}")


def _env_options(pairs: list[str]) -> dict[str, object]:
    """`--option KEY=VALUE` pairs, values parsed as JSON when they are (numbers, booleans), else kept as text."""
    out: dict[str, object] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.strip():
            _fail(f"--option {p!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _env_traces(env: str, tasks: int, seed: int, shared: dict, pairs: list[str]):
    """(traces, meta) of one or several agent environments (`synth.traces.envs`), `tasks` each."""
    from dataclasses import fields

    from kvsteward.synth.traces import envs as envm

    try:
        names = envm.env_names(env)
    except ValueError as e:
        _fail(str(e))
    explicit = _env_options(pairs)
    for key in [*explicit, *shared]:
        if not any(key in {f.name for f in fields(envm.options_type(n))} for n in names):
            flag = f"--option {key}" if key in explicit else "--" + key.replace("_", "-")
            _fail(f"{flag}: no environment among {', '.join(names)} has that option")
    result, metas = [], []
    try:
        with _progress() as p:
            for name in names:
                opts = envm.make_options(name, {**shared, **explicit})
                job = p.add_task(f"{name}: solving tasks", total=tasks)
                result += envm.generate(name, tasks, seed, opts, progress=lambda n, j=job: p.update(j, completed=n))
                metas.append(envm.generation_meta(name, tasks, seed, opts))
    except (ValueError, TypeError) as e:
        _fail(str(e))
    meta = metas[0] if len(metas) == 1 else {"envs": metas, "tasks": tasks, "seed": seed, "label_source": "oracle"}
    return result, meta


def _longsession_traces(tasks: int, seed: int, length: int, distances: str, chunk_tokens: int, model: str):
    """(traces, meta) of `--source longsession`: benchmark sessions re-expressed as traces."""
    from kvsteward.models import load_tokenizer
    from kvsteward.synth.longsession import traces as lst

    try:
        ds = lst.resolve_distances(length, [int(x) for x in distances.split(",") if x.strip()])
    except ValueError as e:
        _fail(f"--distances {distances!r}: {e}")
    tok = load_tokenizer(model)
    try:
        with _progress() as p:
            job = p.add_task("generating sessions", total=tasks)
            result = lst.longsession_traces(tok, tasks, length, seed, ds, chunk_tokens,
                                            progress=lambda n: p.update(job, completed=n))
    except (ValueError, RuntimeError) as e:  # RuntimeError: the stdlib ran out of filler chunks
        _fail(str(e))
    return result, lst.generation_meta(tasks, seed, length, ds, chunk_tokens, model)


@synth_app.command()
def hindsight(
    traces_dir: Path = typer.Argument(..., help="folder (or traces.jsonl) from `steward synth traces` / import"),
    out: Path = typer.Option(..., help="output folder for the DatasetDict (save_to_disk) and its card"),
    every: int = typer.Option(4, help="an auxiliary example every K tool responses"),
    model: str = typer.Option("smollm2", help="tokenizer / chat template: smollm2, a local folder, or a hub id"),
    max_tokens: int = typer.Option(4096, help="row length cap (main rows left-truncated, aux rows skipped)"),
    mask_prob: float = typer.Option(0.5, help="chance each expired cursor is pre-masked (already deleted)"),
    plan: bool = typer.Option(True, help="also emit `Planning mode` rows"),
    seed: int = typer.Option(0, help="seed of the pre-masking draw"),
    pack: bool = typer.Option(False, help="one packed row per trace (the trace plus every call, with the serving "
                                          "engine's positions and deletion history) instead of main/delete/plan rows"),
    trigger: str = typer.Option("ids", help="deletion trigger layout: ids (phrase + open cursor ids), notes (+ the "
                                "task and each cursor's reader note) or scores (the task and one header line per open "
                                "response, each decided at its own slot in one forward; see docs/training.md)"),
    audit: bool = typer.Option(True, "--audit/--no-audit", help="run the shortcut audit at the end (`steward synth "
                               "audit`) when the train and validation splits have deletion decisions"),
    as_json: bool = typer.Option(False, "--json", help="print the card statistics as JSON"),
) -> None:
    """Hindsight-annotate traces into a pre-tokenized DatasetDict (main / delete / plan rows, or packed rows) with
    a card."""
    from kvsteward.models import load_tokenizer
    from kvsteward.runs import parent_run_id, stage_run
    from kvsteward.synth.traces import dataset as dsm
    from kvsteward.synth.traces.trace import read_traces

    cfg = dsm.HindsightConfig(every=every, mask_prob=mask_prob, max_tokens=max_tokens, plan=plan, seed=seed,
                              model=model, pack=pack, trigger=trigger)
    try:
        cfg.validate()
        trs = read_traces(traces_dir)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    tok = load_tokenizer(model)
    with _progress() as p:
        job = p.add_task("annotating traces", total=len(trs))
        dd, skipped, lengths = dsm.build_dataset(trs, tok, cfg, progress=lambda n: p.update(job, completed=n))
    src = traces_dir if traces_dir.is_dir() else traces_dir.parent
    c = dsm.card(trs, dd, skipped, cfg, str(src.resolve()), lengths)
    dsm.save(dd, out, c)
    if parent_run_id():  # inside `steward pipeline run`: log the dataset in this stage's nested run
        with stage_run("hindsight"):
            logged = dsm.log_to_mlflow(dd, name=out.name)
    else:
        logged = dsm.log_to_mlflow(dd, name=out.name)
    if audit and not pack:
        c = _audit_after_hindsight(dd, out) or c
    if as_json:
        print(json.dumps({**c, "mlflow_logged": logged}))
    else:
        print(f"wrote {sum(len(dd[s]) for s in dd)} rows to {out}" + (" (logged to MLflow)" if logged else ""))
        if "audit" in c:
            _print_audit(c["audit"], brief=True)


def _audit_after_hindsight(dd, out: Path) -> dict | None:
    """The card with the audit recorded (`steward synth hindsight --audit`), or None when a split has no decision."""
    from kvsteward.synth.traces import audit as am

    train, val = am.split_decisions(dd)
    if not train or not val:
        console.print("audit skipped: the train or validation split has no deletion decision")
        return None
    result, fitted = am.audit_decisions(train, val)
    return am.write_audit(out, result, fitted)


def _print_audit(result: dict, brief: bool = False) -> None:
    """The audit as rich tables on stdout (`brief`: the overall table and the flags only)."""
    from rich.table import Table

    from kvsteward.synth.traces import audit as am

    out = Console(width=None if sys.stdout.isatty() else 150)  # a pipe gets 80 columns: too narrow for the table
    table = Table(title=f"shortcut audit: {result['n_decisions']} validation decisions "
                        f"({result['positive_rate']:.1%} expired), oracle F1 {result['oracle_f1']:.1f}")
    for h in am.HEADER:
        table.add_column(h, justify="left" if h in ("baseline", "setting (train)") else "right")
    flagged = {f["baseline"] for f in result["flags"] if f["env"] is None}
    for row in am.table_rows(result["baselines"]):
        table.add_row(*row, style="bold red" if row[0] in flagged else None)
    out.print(table)
    for title, key, measure in am.GROUPS:
        if brief or not am.shown(result, key):
            continue
        header, rows = am.group_table(result, key, measure)
        t = Table(title=f"{'F1' if measure == 'f1' else measure} by {title}")
        for h in header:
            t.add_column(h, justify="left" if h == header[0] else "right")
        for row in rows:
            t.add_row(*row)
        out.print(t)
    for f in result["flags"]:
        where = f" on {f['env']}" if f["env"] else ""
        out.print(f"[red]flag:[/red] {f['baseline']}{where} reaches validation F1 {f['f1']:.3f}: {f['message']}")


@synth_app.command()
def audit(
    ds: Path = typer.Argument(..., help="dataset folder from `steward synth hindsight` (per-boundary rows)"),
    write: bool = typer.Option(True, "--write/--no-write", help="record the result in DS/card.json and DS/README.md "
                               "and save the fitted baselines under DS/baselines/"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Shortcut audit: fit cheap non-model baselines on train, score them on validation, flag any that recovers the
    labels (validation F1 >= 0.95)."""
    from kvsteward.synth.traces import audit as am

    try:
        result = am.run_audit(ds, write=write)
    except am.AuditError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(result))
    else:
        _print_audit(result)


@synth_app.command()
def stats(
    ds: Path = typer.Argument(..., help="dataset folder from `steward synth hindsight`"),
    traces_dir: Path = typer.Option(None, "--traces", help="raw traces (default: the card's source)"),
    check_tokens: bool = typer.Option(True, help="also decode aux labels and check they spell the target"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Counts, lengths and an independent re-check of the deletion labels against the raw traces."""
    from kvsteward.synth.traces.stats import dataset_stats

    try:
        s = dataset_stats(ds, traces_dir, check_tokens=check_tokens)
    except FileNotFoundError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(s))
    else:
        for k, v in s.items():
            print(f"{k}: {v}")


def _make_planner(planner: str, model: str, endpoint: str | None, endpoint_model: str | None, max_new_tokens: int,
                  max_cursors: int, cursor_chars: int):
    """(name, LLMPlanner | None, reads function). `planner` is llm | lexical | next-step."""
    from kvsteward.synth.traces import planner as pl

    if planner == "lexical":
        return "lexical", None, pl.lexical_reads
    if planner == "next-step":
        return "next_step", None, pl.next_step_reads
    if planner != "llm":
        _fail(f"unknown planner {planner!r}: use llm, lexical or next-step")
    if endpoint:
        complete = pl.endpoint_completer(endpoint, endpoint_model or model, max_new_tokens)
        name = f"llm:{endpoint_model or model}@endpoint"
    else:
        with console.status(f"loading {model} ..."):
            complete = pl.local_completer(model, max_new_tokens)
        name = f"llm:{model}"
    llm = pl.LLMPlanner(complete, name=name, max_cursors=max_cursors, cursor_chars=cursor_chars)
    return name, llm, lambda t: llm.reads(t)[0]


@synth_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="OpenAI-style JSONL: one session per line ({'messages': [...]} or a list)"),
    out: Path = typer.Option(..., help="output traces folder (same format as `steward synth traces`)"),
    planner: str = typer.Option("llm", help="who labels the dependencies: provenance (the file's own `reads`, exact) "
                                "| llm | lexical | next-step"),
    model: str = typer.Option("smollm2", help="local model for --planner llm (or the endpoint's model name)"),
    endpoint: str = typer.Option(None, help="OpenAI-compatible base URL for the llm planner instead of a local model"),
    endpoint_model: str = typer.Option(None, help="model name to request from --endpoint (default: --model)"),
    next_step_prior: bool = typer.Option(True, help="also mark each step as reading the tool response right before"),
    max_new_tokens: int = typer.Option(6, help="reply length of the llm planner"),
    max_cursors: int = typer.Option(6, help="llm planner sees at most this many most recent cursors per step"),
    cursor_chars: int = typer.Option(120, help="characters of each cursor shown to the llm planner"),
) -> None:
    """Import user traces; their labels come from the file's provenance (`--planner provenance`) or a planner (label
    source recorded per trace)."""
    from kvsteward.synth.traces.importer import label_traces, provenance_traces, read_openai_jsonl
    from kvsteward.synth.traces.trace import write_traces

    try:
        raw = read_openai_jsonl(file)
        if planner == "provenance":
            labelled = provenance_traces(raw, str(file))
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if planner == "provenance":
        path = write_traces(out, labelled, {"imported_from": str(file.resolve()), "planner": "provenance",
                                            "label_source": "provenance"})
        print(f"imported {len(labelled)} traces to {path} (labels: the file's provenance)")
        return
    name, _, fn = _make_planner(planner, model, endpoint, endpoint_model, max_new_tokens, max_cursors, cursor_chars)
    with _progress() as p:
        job = p.add_task(f"labelling with {name}", total=len(raw))
        labelled = label_traces(raw, fn, name, next_step_prior, on_trace=lambda: p.advance(job))
    path = write_traces(out, labelled, {"imported_from": str(file.resolve()), "planner": name,
                                        "next_step_prior": next_step_prior, "label_source": labelled[0].label_source
                                        if labelled else None})
    print(f"imported {len(labelled)} traces to {path} (labels: {labelled[0].label_source if labelled else '-'})")


@synth_app.command()
def bfcl(
    out: Path = typer.Option(..., help="OpenAI-style JSONL to write, with provenance (`steward synth import "
                             "--planner provenance` reads it)"),
    categories: str = typer.Option("base,long_context", help="BFCL v4 multi-turn categories: base, long_context"),
    limit: int = typer.Option(None, help="only the first N conversations of each category"),
    min_chars: int = typer.Option(4, help="provenance: shortest value (characters) that can make a read"),
    model: str = typer.Option("", help="also count tokens with this model's tokenizer (e.g. smollm2)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """BFCL v4 multi-turn conversations as agent sessions: the ground-truth calls executed offline against bfcl-eval's
    simulators give the tool responses; provenance from the values the calls copy (docs/synth.md, "BFCL")."""
    from kvsteward.synth.traces import bfcl as bf

    cats = [c.strip() for c in categories.split(",") if c.strip()]
    bad = [c for c in cats if c not in bf.CATEGORIES]
    if not cats or bad:
        _fail(f"--categories {categories!r}: expected some of {', '.join(bf.CATEGORIES)}")
    if limit is not None and limit < 1:
        _fail("--limit must be at least 1")
    if min_chars < 1:
        _fail("--min-chars must be at least 1")
    try:
        records = bf.sessions(cats, limit, min_chars)
    except ImportError as e:
        _fail(str(e))
    bf.write_sessions(out, records)
    tok = None
    if model:
        from kvsteward.models import load_tokenizer

        tok = load_tokenizer(model)
    summary = {"sessions": len(records), "path": str(out), "categories": bf.summary(records, tok)}
    print(json.dumps(summary) if as_json else f"wrote {len(records)} sessions to {out}\n"
          + json.dumps(summary["categories"], indent=1))


@synth_app.command()
def export(
    traces_dir: Path = typer.Argument(..., help="traces folder"),
    out: Path = typer.Option(..., help="OpenAI-style JSONL to write (tool_calls + tool responses)"),
    provenance: bool = typer.Option(False, "--provenance", help="also write each session's exact labels (`reads`, "
                                    "env, question, answer, cues): `steward synth import --planner provenance`"),
    split: str = typer.Option("all", help="only the traces of this split (train | validation | test | all)"),
    env: str = typer.Option("", "--env", help="only the traces of these environments (comma-separated)"),
) -> None:
    """Write traces as OpenAI-style message JSONL (the format `steward synth import` reads)."""
    from kvsteward.synth.traces.importer import write_openai_jsonl
    from kvsteward.synth.traces.trace import read_traces

    try:
        trs = read_traces(traces_dir)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    want = {e.strip() for e in env.split(",") if e.strip()}
    trs = [t for t in trs if split in ("all", t.split) and (not want or t.env in want)]
    if not trs:
        _fail(f"no traces of split {split!r}{f' and env {sorted(want)}' if want else ''} in {traces_dir}")
    print(f"wrote {len(trs)} sessions to {write_openai_jsonl(trs, out, provenance)}")


@plan_app.command()
def extract(
    sessions: Path = typer.Option(..., help="traces folder with oracle reads (from `steward synth traces`)"),
    model: str = typer.Option("smollm2", help="local planner model (or the endpoint's model name)"),
    endpoint: str = typer.Option(None, help="OpenAI-compatible base URL instead of a local model"),
    endpoint_model: str = typer.Option(None, help="model name to request from --endpoint (default: --model)"),
    limit: int = typer.Option(5, help="score the first N sessions (the LLM planner is slow on CPU)"),
    every: int = typer.Option(4, help="boundary interval for the deletion-label quality"),
    max_new_tokens: int = typer.Option(6, help="reply length per step"),
    max_cursors: int = typer.Option(6, help="most recent cursors shown per step"),
    cursor_chars: int = typer.Option(120, help="characters shown per cursor"),
    blueprints_out: Path = typer.Option(None, help="write the LLM planner's blueprints (engine format) as JSONL"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """LLM planner vs the oracle: edge recall / precision, deletion-label quality; lexical and next-step baselines."""
    from kvsteward.synth.traces import planner as pl
    from kvsteward.synth.traces.trace import read_traces

    try:
        trs = read_traces(sessions)[:limit]
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if not trs or any(t.label_source != "oracle" for t in trs):
        _fail(f"{sessions} holds no oracle-labelled sessions to score against")
    name, llm, _ = _make_planner("llm", model, endpoint, endpoint_model, max_new_tokens, max_cursors, cursor_chars)
    t0 = time.perf_counter()
    predicted, failures = [], 0
    with _progress() as p:
        job = p.add_task("sessions", total=len(trs))
        for t in trs:
            steps = p.add_task(f"  {t.task_id}", total=len(pl.reader_steps(t)))
            reads, fail = llm.reads(t, on_step=lambda s=steps: p.advance(s))
            p.remove_task(steps)
            predicted.append(reads)
            failures += fail
            p.advance(job)
    wall = time.perf_counter() - t0
    result = {**pl.score(trs, predicted, every), "n_sessions": len(trs), "planner": name,
              "steps": sum(len(pl.reader_steps(t)) for t in trs), "parse_failures": failures, "wall_s": round(wall, 1),
              "with_next_step_prior": pl.score(trs, [pl.union(p, pl.next_step_reads(t)) for t, p in
                                                     zip(trs, predicted, strict=True)], every),
              "baselines": {"lexical": pl.score(trs, [pl.lexical_reads(t) for t in trs], every),
                            "next_step": pl.score(trs, [pl.next_step_reads(t) for t in trs], every)}}
    if blueprints_out:
        _write_blueprints(blueprints_out, trs, predicted, model if not endpoint else "smollm2")
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def _write_blueprints(path: Path, trs, predicted, tokenizer_name: str) -> None:
    from kvsteward.models import load_tokenizer
    from kvsteward.synth.traces.blueprint import blueprint_from_reads
    from kvsteward.synth.traces.tokens import PieceTokenizer, offsets

    ptok = PieceTokenizer(load_tokenizer(tokenizer_name))
    with open(path, "w") as f:
        for t, reads in zip(trs, predicted, strict=True):
            bp = blueprint_from_reads(reads, t.cursors(), offsets(ptok.pieces(t.messages)))
            f.write(json.dumps({"task_id": t.task_id, "blueprint": bp}) + "\n")
