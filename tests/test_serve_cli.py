"""`steward serve` as the lead mounts it (a Typer callback app), and the embedded SmolLM2 behind the openai client."""

from __future__ import annotations

import openai
import pytest
import typer
from typer.testing import CliRunner

from kvsteward.pipelines import cli_serve


def mounted() -> typer.Typer:
    root = typer.Typer()
    root.add_typer(cli_serve.app, name="serve")

    @root.command()
    def other() -> None:  # a second command, as in the real `steward` app
        pass

    return root


def test_serve_mounts_as_a_single_command():
    result = CliRunner().invoke(mounted(), ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for option in ["--model", "--port", "--policy", "--budget", "--limit", "--max-body-bytes", "--cache-bytes",
                   "--session-bytes", "--data-dir"]:
        assert option in result.output


def test_bad_default_policy_is_refused_before_serving(tmp_path):
    from kvsteward.models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "m")
    from kvsteward.models import load_tokenizer

    load_tokenizer("smollm2").save_pretrained(tmp_path / "m")
    result = CliRunner().invoke(mounted(), ["serve", "--model", str(tmp_path / "m"), "--policy", "h2o"])
    assert result.exit_code != 0 and "needs a budget" in result.output


@pytest.mark.slow
def test_smollm2_answers_the_openai_client(tmp_path):
    from kvsteward.serve.engine import Engine
    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import ServerThread

    app = create_app(Engine.load("smollm2"), ServerConfig(model_name="smollm2", data_dir=tmp_path))
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="smollm2", max_tokens=24, messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one word."}])
        assert "paris" in r.choices[0].message.content.lower()
        assert r.choices[0].finish_reason == "stop"  # <|im_end|> ends the reply
        # the same question in a persistent session: same reply, and the session closes it as the template does
        http = client._client
        sid = http.post(url + "/v1/sessions", json={}).json()["id"]
        turn = http.post(f"{url}/v1/sessions/{sid}/messages", timeout=120, json={"max_tokens": 24, "messages": [
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]}).json()
        assert turn["reply"]["content"] == r.choices[0].message.content
        rec = app.state.store.acquire(sid)
        app.state.store.release(rec)
        tok = app.state.chat.engine.tokenizer
        assert tok.decode(rec.session.tokens).endswith("<|im_start|>assistant\n" + turn["reply"]["content"]
                                                       + "<|im_end|>\n")
