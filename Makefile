# shardplan: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test

.PHONY: demo test bench clean venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

## Solve the default model (AlexNet, 8 devices, the paper's machine) and print the plan.
demo: $(STAMP)
	$(VENV)/bin/shardplan solve --model alexnet -p 8

## Run the test suite: JOBS worker processes (pytest-xdist), one test file per worker at a time so a
## file's shared compilations and process groups stay in one process. JOBS=0 runs in this process.
JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile

## Run the benchmarks (writes JSON under benchmarks/results/).
bench: $(STAMP)
	$(VENV)/bin/shardplan bench --out benchmarks/results/table1.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
