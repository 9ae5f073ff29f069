# The README's two commands: `make train` and `make test`. Each sets up .venv on first use.
# `make test` runs ruff, then the whole suite; `make test-fast` is the inner loop, `make lint` runs ruff alone.
# `pip install torch==2.13.0` takes the CPU wheel where one is provided locally (this machine's
# pip find-links) and PyPI's CUDA build on a GPU machine; nothing is reinstalled while the
# stamp is newer than pyproject.toml.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkzero-installed
TORCH_VERSION ?= 2.13.0
# --durations=30: the run ends with its 30 slowest tests, where the suite's time goes (issue 31).
# One pytest worker more than cores: a test that runs the CLI keeps ~1.3 cores busy (its launcher and rank 0
# work alone at times), so cores + 1 workers fill the idle time (2 cores, e2e tests: 79% busy at -n 2, 91% at 3).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
# --max-worker-restart 0: a worker that crashes fails its test and is not replaced, because pytest-xdist 3.8's
# loadgroup scheduler can hang forever after replacing one (pytest-xdist issue 1378); the run ends red, not stuck.
# --capture=sys: Python's output is captured per test as usual, but what native code writes to the file descriptors
# (XLA's and gloo's logs) reaches the log, so the message of a worker that crashes is not lost with it.
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --max-worker-restart 0 --capture=sys \
	--durations=30

.PHONY: setup train test test-fast lint clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/chunkzero train $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The inner loop: the framework-free core's tests and the engines' single-process unit tests, none
# marked slow (seconds, not minutes). `make test` stays the whole suite, and is what CI runs.
FAST_TESTS ?= tests/core $(wildcard tests/*/test_*_unit.py)
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" $(FAST_TESTS)

# ruff's rules are in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
