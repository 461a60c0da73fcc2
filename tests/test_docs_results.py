"""The docs quote the measured numbers of `docs/results/summary.json`, and that file is what the study folders give.

- `summary.json` equals a fresh `steward results collect` over `docs/results/*/result.json` (whose metrics point
  into the measuring commands' own JSON outputs where those were kept): nobody edits the numbers by hand;
- every number the summary says a file cites appears verbatim in that file (as a whole number: 0.8 does not match
  0.85), README.md included;
- every study folder follows the layout (dated name, README.md, result.json) and is listed in the results index;
- the guides do not date their content by work session, and their links into docs/results resolve.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvsteward.pipelines.cli_results import (
    ResultsError,
    collect,
    dumps,
    format_value,
    load_study,
    missing_citations,
    resolve,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
# the before-stop hook's pattern: "session 17", "sessions 13–15" name work sessions
WORK_SESSION = re.compile(r"(^|[^-])\bsessions? [0-9]+[^/0-9]", re.I | re.M)


def test_summary_is_what_the_study_folders_give():
    fresh = dumps(collect(RESULTS))
    on_disk = (RESULTS / "summary.json").read_text()
    assert on_disk == fresh, "docs/results/summary.json is stale: run `steward results collect`"


def test_docs_quote_every_cited_number():
    summary = json.loads((RESULTS / "summary.json").read_text())
    problems = missing_citations(summary, REPO)
    assert not problems, "\n".join(problems)


def test_the_headline_topics_are_there():
    topics = collect(RESULTS)["topics"]
    assert {"longsession_8k", "longsession_32k", "manager", "shortcut_audit", "aux_thread_overhead"} <= set(topics)
    manager = topics["manager"]
    # the manager headline is measured on the agent environments, tested on one the adapter was not trained on
    assert manager["study"].endswith("manager-envs-heldout") and "pending" not in manager
    assert {"heldout_adapter_f1", "heldout_text_classifier_f1", "heldout_attention_mass_f1"} <= set(manager["metrics"])
    cited = [m for t in topics.values() for m in t["metrics"].values() if m.get("cited_in")]
    assert len(cited) >= 30


def test_every_study_folder_follows_the_layout_and_is_indexed():
    index = (RESULTS / "README.md").read_text()
    folders = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    assert folders
    for f in folders:
        rec = load_study(f)  # raises on a bad name, a missing file or a pointer into nothing
        assert f"({f.name}/)" in index, f"{f.name} is not listed in docs/results/README.md"
        if rec.get("superseded_by"):
            assert (RESULTS / rec["superseded_by"]).is_dir(), f"{f.name}: {rec['superseded_by']} does not exist"


def test_guides_name_no_work_sessions():
    docs = sorted((REPO / "docs").rglob("*.md"))
    hits = {str(p.relative_to(REPO)): WORK_SESSION.findall(p.read_text()) for p in docs}
    hits = {k: len(v) for k, v in hits.items() if v}
    assert not hits, f"guides and results name work sessions (date them instead): {hits}"


def test_relative_links_resolve():
    bad = []
    for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = p.read_text()
        for m in re.finditer(r"\]\(([^)#\s]+)\)", text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            base = REPO if p.parent == REPO else p.parent
            if not (base / target).exists():
                bad.append(f"{p.relative_to(REPO)}: {target}")
        for m in re.finditer(r"docs/results/([0-9]{4}-[0-9]{2}-[0-9]{2}-[a-z0-9-]+)", text):
            if not (RESULTS / m.group(1)).is_dir():
                bad.append(f"{p.relative_to(REPO)}: docs/results/{m.group(1)}")
    assert not bad, "\n".join(bad)


def _study(tmp_path: Path, name: str, **rec) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "README.md").write_text("# a study\n")
    base = {"study": name, "date": name[:10], "title": "t", "status": "current", "commands": ["steward x"],
            "environment": {}, "metrics": {}}
    (folder / "result.json").write_text(json.dumps(base | rec))
    return folder


def test_metrics_resolve_from_the_measuring_commands_output(tmp_path):
    folder = _study(tmp_path, "2026-01-02-bench", topic="bench",
                    metrics={"acc": {"from": "out.json", "path": ["arms", "pace", "by_distance", "7000", "acc"]},
                             "rate": {"ratio": [{"sum": [3, 4]}, 1000]}, "n": 12},
                    cite={"acc": {"format": ".2f", "in": ["doc.md"]},
                          "rate": {"format": ".1f", "scale": 100, "unit": " %", "in": ["doc.md"]}})
    (folder / "out.json").write_text(json.dumps({"arms": {"pace": {"by_distance": {"7000": {"acc": 0.7}}}}}))
    summary = collect(tmp_path)
    metrics = summary["topics"]["bench"]["metrics"]
    assert metrics["acc"] == {"value": 0.7, "text": "0.70", "cited_in": ["doc.md"]}
    assert metrics["rate"]["text"] == "0.7 %" and metrics["n"] == {"value": 12}
    (tmp_path / "doc.md").write_text("pace answers 0.70 of the probes and harms\n0.7 % of its deletions")
    assert missing_citations(summary, tmp_path) == []
    (tmp_path / "doc.md").write_text("pace answers 0.705 of the probes and harms 10.7 % of its deletions")
    assert len(missing_citations(summary, tmp_path)) == 2  # a longer number does not count as a quote


def test_layout_errors_are_named(tmp_path):
    with pytest.raises(ResultsError, match="YYYY-MM-DD"):
        load_study(_study(tmp_path, "bench-without-date"))
    with pytest.raises(ResultsError, match="does not exist"):
        load_study(_study(tmp_path, "2026-01-03-a", metrics={"x": {"from": "missing.json"}}))
    with pytest.raises(ResultsError, match="no 'b'"):
        folder = _study(tmp_path, "2026-01-04-b", metrics={"x": {"from": "o.json", "path": ["a", "b"]}})
        (folder / "o.json").write_text('{"a": {}}')
        load_study(folder)
    with pytest.raises(ResultsError, match="cite names metrics"):
        load_study(_study(tmp_path, "2026-01-05-c", cite={"y": {}}))
    _study(tmp_path, "2026-01-06-d", topic="t")
    _study(tmp_path, "2026-01-07-e", topic="t")
    tree = tmp_path / "two"
    tree.mkdir()
    for n in ("2026-01-06-d", "2026-01-07-e"):
        (tmp_path / n).rename(tree / n)
    with pytest.raises(ResultsError, match="two current studies"):
        collect(tree)


def test_format_and_resolve_basics(tmp_path):
    assert format_value(6.938893903907228e-18, {"format": ".1e"}) == "6.9e-18"
    assert format_value(56 / 216, {"format": ".0f", "scale": 100, "unit": " %"}) == "26 %"
    assert format_value(8567, {"format": ",d"}) == "8,567"
    assert resolve({"list": [1, {"ratio": [1, 4]}]}, tmp_path) == [1, 0.25]


def test_collect_cli_writes_then_checks(tmp_path):
    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    root = tmp_path / "docs" / "results"
    root.mkdir(parents=True)
    _study(root, "2026-01-02-x", topic="x", metrics={"n": 3}, cite={"n": {"format": "d", "in": ["README.md"]}})
    (tmp_path / "README.md").write_text("three: 3\n")
    runner = CliRunner()
    check = ["results", "collect", "--root", str(root), "--check"]
    assert runner.invoke(app, check).exit_code == 1  # no summary yet
    assert runner.invoke(app, ["results", "collect", "--root", str(root)]).exit_code == 0
    assert runner.invoke(app, check).exit_code == 0
    (tmp_path / "README.md").write_text("three: 33\n")
    result = runner.invoke(app, check)
    assert result.exit_code == 1 and "does not quote '3'" in result.output
