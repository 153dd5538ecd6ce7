# Two entry points (see README): `make run` and `make test`. Each creates .venv on first use and
# installs only what it needs, at the versions in constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SERVE_STAMP := $(VENV)/.installed-serve
BENCH_STAMP := $(VENV)/.installed-bench
SCALEOUT_STAMP := $(VENV)/.installed-scaleout

.PHONY: run serve test test-fast test-scaleout verify mutants bench bench-big bench-cold bench-target bench-vllm clean clean-vllm

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

# ray[serve] (~400 MB, ~1 minute): only for the Ray Serve replicas (docs/scale-out.md).
$(SCALEOUT_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim,dev,serve,scaleout]'
	touch $@

$(BENCH_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[bench]'
	touch $@

run: $(RUN_STAMP)
	$(BIN)/python -m batch $(ARGS)

# The HTTP server on the simulated GPU in real time (batch serve; ARGS="--port 9000 --time-scale 0.1").
serve: $(SERVE_STAMP)
	$(BIN)/batch serve --port 8000 $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

# The suite without the tests marked slow (proofs, long stateful runs, subprocesses; pyproject.toml).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not slow"

# The scale-out tests with Ray installed (tests/test_scaleout*.py; the Ray ones skip without it).
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

# The iteration target's trade-off on the simulated clock (bench/target_sweep.py; docs/fairness.md section 6).
bench-target: $(BENCH_STAMP)
	$(BIN)/python bench/target_sweep.py --plot docs/img/target_tradeoff.png $(ARGS)

# Batch beside vLLM's own V1 scheduler on one simulated clock (bench/vllm_compare.py; ARGS="--traces DIR").
# An optional extra: its own venv, .venv-vllm (about 3 minutes and 2.2 GB, no GPU), never touched by
# `make run` or `make test`, and nothing is installed into .venv. Recipe: ../shared/guides/vllm-comparison.md.
VLLM_VENV := .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/pip install -q
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm

$(VLLM_STAMP): bench/requirements-vllm.txt bench/requirements-vllm-nodeps.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) $$(grep -E '^torch==' bench/requirements-vllm.txt)
	$(VLLM_PIP) --no-deps -r bench/requirements-vllm-nodeps.txt
	$(VLLM_PIP) -r bench/requirements-vllm.txt
	touch $@

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/vllm_compare.py $(ARGS)

clean:
	rm -rf $(VENV)

clean-vllm:
	rm -rf $(VLLM_VENV)
