# shardplan: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test

.PHONY: demo test test-fast bench clean venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

## Plan GPT (4 blocks) on 32 H100s (layouts, memory choices and stages searched together) and print the report.
demo: $(STAMP)
	$(VENV)/bin/shardplan plan --model gpt --set layers=4 -p 32 --machine h100

## Run the test suite: JOBS worker processes (pytest-xdist), one test file per worker at a time so a
## file's shared compilations and process groups stay in one process. JOBS=0 runs in this process.
JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile

## Everyday work: everything but the tests marked slow (process groups, compiled third-party models).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not slow"

## Run the benchmarks (writes JSON under benchmarks/results/).
bench: $(STAMP)
	$(VENV)/bin/shardplan bench --out benchmarks/results/table1.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
