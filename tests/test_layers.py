"""`kvsteward.serve`'s layers import one way: the engine imports none of the others, the manager only the engine, the
server and the SGLang plugin the engine and the manager; inside the manager, `decode` → `planner` → `thread` →
`worker`. Checked on every import statement of every module (function-level imports included), so a shortcut taken
inside a function body fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "serve"
# package → the serve packages its modules may import (itself included)
ALLOWED = {
    "engine": {"engine"},
    "manager": {"engine", "manager"},
    "server": {"engine", "manager", "server"},
    "sglang": {"engine", "manager", "sglang"},
    "bench": {"engine", "manager", "server", "sglang", "bench"},  # everything (serve/__init__.py)
}
# a module may import only those before it
MANAGER_ORDER = ["decode", "scores", "planner", "thread", "stack", "rule", "worker"]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _serve_targets(path: Path) -> set[tuple[str, str]]:
    """(package, module) pairs of `kvsteward.serve.<package>[.<module>]` that `path` imports."""
    out = set()
    for name in _imports(path):
        parts = name.split(".")
        if parts[:2] == ["kvsteward", "serve"] and len(parts) >= 3:
            out.add((parts[2], parts[3] if len(parts) > 3 else ""))
    return out


def test_every_serve_module_sits_in_a_layer():
    loose = [p.name for p in SERVE.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a layer package: {loose}"
    assert {p.name for p in SERVE.iterdir() if p.is_dir() and not p.name.startswith("__")} == set(ALLOWED)


def test_layers_import_one_way():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in (SERVE / pkg).glob("*.py"):
            for target, _ in _serve_targets(path):
                if target not in allowed:
                    bad.append(f"serve/{pkg}/{path.name} imports kvsteward.serve.{target}")
    assert not bad, "\n".join(bad)


def test_manager_modules_import_in_order():
    bad = []
    for i, name in enumerate(MANAGER_ORDER):
        for target, module in _serve_targets(SERVE / "manager" / f"{name}.py"):
            if target == "manager" and module in MANAGER_ORDER and MANAGER_ORDER.index(module) >= i:
                bad.append(f"manager/{name}.py imports manager.{module}")
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_wrong_import(tmp_path):
    """The walker sees an import inside a function body (what a lazy shortcut would use)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from kvsteward.serve.server.api import make_app\n")
    assert ("server", "api") in _serve_targets(p)


# ------------------------------------------------------------------------------------------- synth/ and eval/
ROOT = SERVE.parent
# (folder, package) → the kvsteward packages its modules must not import: the long-session side may read the trace
# side (sessions re-expressed as traces, the planners), never the reverse; each eval side reads only its own synth side;
# the peers side by side (kvpress beside the engine on RULER prompts) reads neither product.
FORBIDDEN = {
    ("synth", "traces"): ["kvsteward.synth.longsession", "kvsteward.eval.longsession"],
    ("synth", "longsession"): ["kvsteward.eval.manager"],
    ("eval", "manager"): ["kvsteward.eval.longsession", "kvsteward.synth.longsession"],
    ("eval", "longsession"): ["kvsteward.eval.manager", "kvsteward.synth.traces"],
    ("eval", "peers"): ["kvsteward.eval.manager", "kvsteward.eval.longsession", "kvsteward.synth"],
}
SHARED = {"synth": {"chat.py", "rng.py", "__init__.py"}, "eval": {"scoring.py", "tracking.py", "__init__.py"}}


def test_synth_and_eval_hold_their_products_and_a_few_shared_modules():
    for folder, shared in SHARED.items():
        assert {p.name for p in (ROOT / folder).glob("*.py")} == shared
        subpackages = {p.name for p in (ROOT / folder).iterdir() if p.is_dir() and not p.name.startswith("__")}
        assert subpackages == {pkg for f, pkg in FORBIDDEN if f == folder}
        for pkg in subpackages:
            doc = ast.get_docstring(ast.parse((ROOT / folder / pkg / "__init__.py").read_text()))
            assert doc, f"{folder}/{pkg}/__init__.py says what it is"


def test_synth_and_eval_sides_import_one_way():
    bad = []
    for (folder, pkg), forbidden in FORBIDDEN.items():
        for path in (ROOT / folder / pkg).rglob("*.py"):
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
