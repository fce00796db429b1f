PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-quick clean venv

$(STAMP): pyproject.toml constraints-test.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=python3.x"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints-test.txt -e '.[torch,test,bench,ray]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flightq demo

lint: $(STAMP)
	$(VENV)/bin/ruff check flightq tests benchmarks
	$(VENV)/bin/ruff format --check flightq tests benchmarks
	$(VENV)/bin/mypy flightq benchmarks/flightq_bench

test: lint
	$(VENV)/bin/pytest -q

# The side-by-side benchmark measures TransferQueue and Ray too: the peers extra.
PEERS := $(VENV)/.peers

$(PEERS): $(STAMP)
	$(PIP) install --quiet -c constraints-test.txt -e '.[torch,test,bench,ray,peers]'
	@touch $(PEERS)

bench: $(PEERS)
	$(VENV)/bin/flightq bench --out bench-results

bench-quick: $(PEERS)
	$(VENV)/bin/flightq bench --quick --out bench-results

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
