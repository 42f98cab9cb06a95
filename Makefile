# Tessera: `make demo` and `make test` each set up .venv on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard proto/*.proto)

.PHONY: setup test test-fast demo chaos proto bench-kernels clean lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Generated stubs are committed under services/rpc/; tests/test_proto_drift.py checks they match.
proto: setup
	$(PY) -m services.rpc.generate

# pytest-xdist: a test file runs whole in one of TEST_WORKERS processes (its module fixtures once); on CI's 2 cores
# two workers finish the suite in ~80% of one's time (much of it waits on servers, Ray and subprocesses)
TEST_WORKERS ?= 2
# numba's cache filled first by one process (services/index/warm.py, beside the linters), so that the retrieval-index
# services the tests start (which ready the loops before they listen) load them in seconds rather than each compile
# them for a minute. On this repository's 2-core machine the tests took 669.9 s with that cache against 748.7 s with
# none, and the warm-up itself 115-146 s: little or nothing is saved in all
test: setup
	$(PY) -m services.index.warm > /dev/null & warm=$$!; $(MAKE) --no-print-directory lint; lint=$$?; \
		wait $$warm && test $$lint = 0
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop: all but the tests marked slow (Ray, servers, subprocesses, long runs under Triton's
# interpreter), under 2 minutes on 2 CPU cores; make test runs them all
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# the layers of pyproject.toml's [tool.importlinter] and ruff's small rule set
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check --quiet .

demo: setup
	$(VENV)/bin/tessera demo

# A bounded soak on local Ray: workers and store shards SIGKILLed while clients send prompts; fails on a wrong
# output or a lost chunk (services/launch/chaos.py). CHAOS_ARGS="--json PATH" keeps the report
CHAOS_S ?= 60
chaos: setup
	$(VENV)/bin/tessera chaos --duration-s $(CHAOS_S) $(CHAOS_ARGS)

# GPU only: correctness against the twins, then timings beside SDPA (bench/kernels/README.md)
bench-kernels: setup
	$(PY) bench/kernels/kernels.py --out bench/kernels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
