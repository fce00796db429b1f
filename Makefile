# The first Python 3.10+ found (3.11 first: the test constraints' torch is built for it here);
# `make PYTHON=python3.12 test` picks another.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	&& { echo $$p; break; }; done)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# A second, small environment without torch: the suite must pass there too (torch is optional).
NOTORCH       ?= .venv-notorch
NOTORCH_STAMP := $(NOTORCH)/.installed

.PHONY: demo test lint bench bench-quick clean venv

$(STAMP): pyproject.toml constraints-test.txt
	@test -n "$(PYTHON)" && command -v $(PYTHON) >/dev/null 2>&1 || { echo "no Python 3.10+ found ($(PYTHON)); set PYTHON=python3.x"; exit 1; }
	@echo "flightq: creating $(VENV) with $(PYTHON), then installing flightq, torch and the test tools (minutes on a first run)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --progress-bar on -c constraints-test.txt -e '.[torch,tensordict,test,bench,ray,metrics,processors]'
	@touch $(STAMP)

$(NOTORCH_STAMP): pyproject.toml constraints-test.txt
	@test -n "$(PYTHON)" && command -v $(PYTHON) >/dev/null 2>&1 || { echo "no Python 3.10+ found ($(PYTHON)); set PYTHON=python3.x"; exit 1; }
	@echo "flightq: creating $(NOTORCH), a second environment without torch"
	$(PYTHON) -m venv $(NOTORCH)
	$(NOTORCH)/bin/python -m pip install --quiet --upgrade pip
	$(NOTORCH)/bin/python -m pip install --progress-bar on -c constraints-test.txt -e '.[test,metrics]'
	@touch $(NOTORCH_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flightq demo

lint: $(STAMP)
	$(VENV)/bin/ruff check flightq tests benchmarks
	$(VENV)/bin/ruff format --check flightq tests benchmarks
	$(VENV)/bin/mypy flightq benchmarks/flightq_bench

# The suite with torch, then tests/ again without it: tests that need torch skip there
# ("torch is not installed"), every other one must pass.
test: lint $(NOTORCH_STAMP)
	$(VENV)/bin/pytest -q
	$(NOTORCH)/bin/pytest -q -p no:cacheprovider tests

# The side-by-side benchmark measures TransferQueue and Ray too: the peers extra.
PEERS := $(VENV)/.peers

$(PEERS): $(STAMP)
	@echo "flightq: installing the peers extra (TransferQueue, Ray) into $(VENV)"
	$(PIP) install --progress-bar on -c constraints-test.txt -e '.[torch,tensordict,test,bench,ray,metrics,processors,peers]'
	@touch $(PEERS)

bench: $(PEERS)
	$(VENV)/bin/flightq bench --out bench-results

bench-quick: $(PEERS)
	$(VENV)/bin/flightq bench --quick --out bench-results

clean:
	rm -rf $(VENV) $(NOTORCH) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
