"""The `steward` CLI: one sub-command group per pipeline stage."""

from __future__ import annotations

import os

import typer

# Thread count is the user's to set; only default it so 2-core machines are not oversubscribed by tokenizers.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kvsteward.pipelines import (  # noqa: E402
    cli_engine,
    cli_eval,
    cli_models,
    cli_pipeline,
    cli_results,
    cli_serve,
    cli_synth,
    cli_train,
)

app = typer.Typer(help="kvsteward: learned KV-cache memory manager — synth → train → serve/eval.", no_args_is_help=True)
app.add_typer(cli_models.app, name="models", help="Provision models (embedded SmolLM2, local folders, hub ids).")
app.add_typer(cli_engine.engine_app, name="engine", help="Exactness checks of the cache engine.")
app.add_typer(cli_engine.bench_app, name="bench", help="Speed benchmarks (ratios measured side by side).")
app.add_typer(cli_synth.synth_app, name="synth", help="Trace synthesis, hindsight annotation, datasets.")
app.add_typer(cli_synth.plan_app, name="plan", help="Planner dependency extraction.")
app.add_typer(cli_train.app, name="train", help="Train the learned memory manager (LoRA + distillation).")
app.add_typer(cli_eval.app, name="eval", help="Long-session benchmark and learned-manager metrics.")
app.add_typer(cli_serve.app, name="serve", help="Serve over HTTP: OpenAI-compatible + AKV cache ops + sessions.")
app.add_typer(cli_pipeline.app, name="pipeline", help="The end-to-end pipeline, cached by input hash and resumable.")
app.add_typer(cli_results.app, name="results", help="The headline results: docs/results/*/result.json → summary.json.")
app.command("report", help="RUN_DIR/report.html + PNGs for a pipeline run folder, logged to its MLflow run.")(
    cli_pipeline.report_command)


def main() -> None:
    """The `steward` entry point: the app, with a missing model or adapter reported as one line, not a traceback."""
    from kvsteward.models import ModelNotFound

    try:
        app()
    except ModelNotFound as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2) from e


if __name__ == "__main__":
    main()
