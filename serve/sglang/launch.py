"""Start, wait for, and stop a real `python -m sglang.launch_server` with the kvsteward backend (tests, benchmarks).

The server runs in SGLang's own virtualenv (`make sglang-venv` builds `.venv-sglang`; `KVSTEWARD_SGLANG_PYTHON`
names another interpreter), not in the caller's. On a machine without CUDA it gets the flags that run on CPU
(`CPU_FLAGS`, env `SGLANG_USE_CPU_ENGINE=1`; docs/serving.md, "SGLang deployment"). `SglangServer` is a context
manager: it starts the server in its own process group, polls `/health` until it answers 200 — sleeping between
tries whatever the answer (503 while the server starts, or no connection yet) — and kills the whole group on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvsteward.paths import side_python

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-overlap-schedule", "--disable-cuda-graph", "--grammar-backend", "none")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GLOO_SOCKET_IFNAME": "lo"}


def sglang_python() -> str:
    """The interpreter of SGLang's virtualenv: `KVSTEWARD_SGLANG_PYTHON`, else the repository's `.venv-sglang`."""
    return side_python("KVSTEWARD_SGLANG_PYTHON", ".venv-sglang", "sglang-venv", "sglang and kvsteward")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (Linux `PR_SET_PDEATHSIG`). A server
    whose caller was killed (a test run stopped with SIGTERM skips its finalizers) otherwise lives on, and sglang's
    idle scheduler spins a core; sglang's own processes already die with the launcher."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def spawn(cmd: list[str], env: dict, stdout) -> subprocess.Popen:
    """Start `cmd` in its own process group (killed as a group) that dies with this process (on Linux)."""
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def server_command(model: str, port: int, *, kvsteward: bool = True, dtype: str = "float32",
                   max_total_tokens: int | None = 8192, context_length: int = 2048, max_running_requests: int = 8,
                   lora: dict[str, str] | None = None, lora_rank: int | None = None, skip_tokenizer: bool = False,
                   extra: tuple[str, ...] = (), python: str | None = None) -> list[str]:
    """The command line of a server on `model` (a local folder) at 127.0.0.1:`port`. `kvsteward=False` keeps
    sglang's default radix cache (the baseline); `lora` = {name: adapter folder} enables LoRA serving (torch_native
    backend on CPU) and the custom logit processor the aux manager decodes with."""
    cmd = [python or sglang_python(), "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--context-length", str(context_length),
           "--max-running-requests", str(max_running_requests), "--random-seed", "0"]
    if max_total_tokens:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if kvsteward:
        cmd += ["--radix-cache-backend", "kvsteward"]
    if skip_tokenizer:  # token-id requests only (a model folder without a tokenizer)
        cmd += ["--skip-tokenizer-init"]
    if on_cpu():
        cmd += list(CPU_FLAGS)
    if lora:
        cmd += ["--enable-lora", "--lora-paths", *[f"{k}={v}" for k, v in lora.items()],
                "--max-loras-per-batch", str(max(2, len(lora))), "--enable-custom-logit-processor"]
        if lora_rank:
            cmd += ["--max-lora-rank", str(lora_rank)]
        if on_cpu():
            cmd += ["--lora-backend", "torch_native"]
    return cmd + list(extra)


class SglangServer:
    """`with SglangServer(cmd) as url:` — a server started from `server_command(...)`, up and healthy inside the
    block, killed (its whole process group) after. `restart()` kills and starts it again with the same command."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None, timeout: float = 600,
                 log: str | Path | None = None, threads: int = 1):
        self.cmd, self.port, self.timeout = cmd, port, timeout
        self.env = {**os.environ, **(CPU_ENV if on_cpu() else {}), "SGLANG_PLUGINS": "kvsteward",
                    "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.log_path = Path(log) if log else None
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0  # seconds from start to healthy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        import requests

        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 (kept for the run)
        t0 = time.monotonic()
        self.proc = spawn(self.cmd, env=self.env, stdout=out)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited with {self.proc.returncode} before it was healthy"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - t0 > self.timeout:
                self.kill()
                raise TimeoutError(f"sglang server not healthy after {self.timeout:.0f} s")
            time.sleep(1.0)  # on a 503 (starting) as on a refused connection
        self.started_s = time.monotonic() - t0
        return self.url

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server's whole process group (it spawns a scheduler and a detokenizer) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print("sglang server did not exit after the kill", file=sys.stderr)
        self.proc = None

    def restart(self) -> str:
        self.kill()
        return self.start()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
