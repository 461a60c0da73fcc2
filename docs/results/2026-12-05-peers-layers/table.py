"""The study's table from peers.json (the --json output): python table.py

Loading, cells and the footer come from the per-head study's table.py (imported from its folder)."""

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("heads_table", HERE.parent / "2026-12-05-peers-heads" / "table.py")
heads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heads)
LABELS = {"": "one set for all layers and heads", "-layers": "one set per layer", "-heads": "per KV head"}


def main() -> None:
    r, rows = heads.load(HERE)
    print(heads.HEADER)
    for press, label, engines in (("tova", "one set per layer", ("tova", "tova-layers")),
                                  ("snapkv", "per KV head", ("snapkv", "snapkv-layers")), (None, "", ("h2o-layers",))):
        if press:
            print(f"| kvpress: {press} ({label}) | {heads.cells(r, rows, 'kvpress', press)} |")
        for name in engines:
            suffix = "-layers" if name.endswith("-layers") else ""
            print(f"| engine: {name} ({LABELS[suffix]}) | {heads.cells(r, rows, 'engine', name)} |")
    heads.footer(r)


if __name__ == "__main__":
    main()
