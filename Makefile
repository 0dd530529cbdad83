PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: install test test-fast serve bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this machine has the CPU build on disk; a looser pin pulls CUDA builds.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The unit tier alone (no checkpoint, no Redis server, no processes): under a minute on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "unit and not (model or stack or slow)" $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/conveyor up --host 127.0.0.1 --port $(PORT)

bench: $(STAMP)
	$(VENV)/bin/conveyor bench offline --workload uniform

clean:
	rm -rf $(VENV) *.egg-info
