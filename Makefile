# Two entry points (see README): `make run` and `make test`. Each creates .venv on first use and
# installs only what it needs, at the versions in constraints.txt; `make test` also builds .venv-vllm.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SERVE_STAMP := $(VENV)/.installed-serve
BENCH_STAMP := $(VENV)/.installed-bench
SCALEOUT_STAMP := $(VENV)/.installed-scaleout
# vLLM's own venv (its pins conflict with constraints.txt: fastapi, transformers): `make test` runs
# the tests marked vllm there, `make bench-vllm` the side-by-side comparison.
VLLM_VENV := .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/pip install -q
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
VLLM_TESTS := tests/test_vllm*.py

.PHONY: run serve lint test test-fast test-scaleout verify mutants bench bench-big bench-cold bench-vllm figures clean clean-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim]'
	touch $@

$(SERVE_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[serve]'
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim,dev,model,serve]'
	touch $@ $(RUN_STAMP) $(SERVE_STAMP)  # a superset of both: `make run` / `make serve` need not reinstall

# ray[serve] (~400 MB, ~1 minute): the Ray Serve replicas (docs/scale-out.md); make test installs it too.
$(SCALEOUT_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim,dev,serve,scaleout]'
	touch $@

$(BENCH_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[bench]'
	touch $@

run: $(RUN_STAMP)
	$(BIN)/python -m batch $(ARGS)

# The HTTP server on the simulated GPU in real time (batch-llm serve; ARGS="--port 9000 --time-scale 0.1").
serve: $(SERVE_STAMP)
	$(BIN)/batch-llm serve --port 8000 $(ARGS)

# ruff check . with the rules of pyproject.toml ([tool.ruff]); ruff comes with the dev extra.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .

# Every test, each in the environment it needs: .venv with every extra (the Ray tests included)
# runs all but the tests marked vllm, .venv-vllm runs those. BATCH_REQUIRE_ALL=1 makes a test that
# would be skipped for a missing install or data file fail instead (tests/conftest.py). Both runs
# always run; the target fails if either did. lint comes first: a finding stops the target before
# .venv-vllm is built or a test runs.
test: lint $(TEST_STAMP) $(SCALEOUT_STAMP) $(VLLM_STAMP)
	BATCH_REQUIRE_ALL=1 $(BIN)/python -m pytest -m "not vllm"; a=$$?; \
	BATCH_REQUIRE_ALL=1 $(VLLM_VENV)/bin/python -m pytest -m vllm $(VLLM_TESTS); b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

# The quick loop: .venv only, without the tests marked slow (proofs, long stateful runs,
# subprocesses, the Ray tests; pyproject.toml) or vllm; what is not installed is skipped.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not slow and not vllm"

# The scale-out tests alone, with Ray installed (tests/test_scaleout*.py; also part of make test).
test-scaleout: $(SCALEOUT_STAMP)
	$(BIN)/python -m pytest tests/test_scaleout.py tests/test_scaleout_ray.py

verify: $(TEST_STAMP)
	$(BIN)/python -m spec.verify
	BATCH_STATEFUL_STEPS=1000 BATCH_STATEFUL_EXAMPLES=100 $(BIN)/python -m pytest -q tests/test_stateful.py

# Plant each bug of tools/mutants.py in a fresh copy of the tree and report which check catches it
# (docs/mutants.md; ARGS="--scenarios --jobs 2 --only NAME,...").
mutants: $(TEST_STAMP)
	$(BIN)/python tools/mutants.py $(ARGS)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/bench.py $(ARGS)

bench-big: $(BENCH_STAMP)
	$(BIN)/python bench/bench.py --big $(ARGS)

# The seed's fairness test cold, a fresh process per measurement (ARGS="--seeds 20 --styles at_once,when_due").
bench-cold: $(RUN_STAMP)
	$(BIN)/python bench/cold_fairness.py $(ARGS)

# Batch beside vLLM's own V1 scheduler on one simulated clock (bench/vllm_compare.py; ARGS="--traces DIR").
# Its own venv, .venv-vllm (about 2 minutes and 2.2 GB, no GPU), which `make test` also builds and
# `make run` never touches; nothing of it is installed into .venv. Recipe: bench/requirements-vllm.txt;
# it also installs what `vllm serve` imports and this checkout (--no-deps -e), for
# `vllm serve --scheduler-cls batch.integrations.vllm.AsyncFairScheduler` (docs/vllm-plugin.md).
# vllm and xgrammar go in with --no-deps, so pip's resolver then lists their ~45 unmet requirements
# as errors; tools/pip_install.py prints one note line in their place (the list: in .venv-vllm).
$(VLLM_STAMP): bench/requirements-vllm.txt bench/requirements-vllm-nodeps.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) $$(grep -E '^torch==' bench/requirements-vllm.txt)
	$(VLLM_PIP) --no-deps -r bench/requirements-vllm-nodeps.txt
	$(VLLM_VENV)/bin/python tools/pip_install.py --no-deps-file bench/requirements-vllm-nodeps.txt \
	  --log $(VLLM_VENV)/pip-unmet-requirements.txt -- $(VLLM_PIP) -r bench/requirements-vllm.txt
	$(VLLM_PIP) --no-deps -e .
	touch $@

# Both clocks: the stub's and an H100's (batch.sim.gpu_profile); the load sweep writes
# docs/img/vllm-load-sweep.png; then the GPU model's calibration against its published figures.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/vllm_compare.py --fair-vllm --async-vllm --fcfs --gpu stub,h100-llama3-8b --load-sweep $(ARGS)
	$(VLLM_VENV)/bin/python bench/vllm_prefix_compare.py --gpu stub,h100-llama3-8b
	$(VLLM_VENV)/bin/python bench/gpu_calibration.py

# Every figure the README and docs/ quote, each step a fresh process (tools/figures.py; its first
# line in each generated file names the step, command and commit). ARGS="--list", "--only ablation,load",
# "--all" (the opt-in steps too: bench-big, Ray, the long real-time server runs).
figures: $(BENCH_STAMP) $(TEST_STAMP) $(SCALEOUT_STAMP) $(VLLM_STAMP)
	$(BIN)/python tools/figures.py $(ARGS)

clean:
	rm -rf $(VENV)

clean-vllm:
	rm -rf $(VLLM_VENV)
