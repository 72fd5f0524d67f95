# shardplan: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test
# the second environment: transformers 5 (which has no Flax models, so it cannot be the first one's)
VENV5  := .venv-hf5
PY5    := $(VENV5)/bin/python
STAMP5 := $(VENV5)/.installed-hf5

.PHONY: demo test test-fast test-hf5 bench clean venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(STAMP5): pyproject.toml
	$(PYTHON) -m venv $(VENV5)
	$(PY5) -m pip install --quiet --upgrade pip
	$(PY5) -m pip install --quiet -e '.[hf5]'
	touch $(STAMP5)

venv: $(STAMP) $(STAMP5)

## Plan GPT (4 blocks) on 32 H100s (layouts, memory choices and stages searched together) and print the report.
demo: $(STAMP)
	$(VENV)/bin/shardplan plan --model gpt --set layers=4 -p 32 --machine h100

## Run the test suite: JOBS worker processes (pytest-xdist), one test file per worker at a time so a
## file's shared compilations and process groups stay in one process. JOBS=0 runs in this process.
## Then the Hugging Face models on transformers 5 in the second environment (tests/torch_hf5).
JOBS ?= 2
test: $(STAMP) $(STAMP5)
	$(PY) -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=25
	$(PY5) -m pytest tests/torch_hf5

## The transformers 5 tests alone (the second environment).
test-hf5: $(STAMP5)
	$(PY5) -m pytest tests/torch_hf5

## Everyday work: everything but the tests marked slow (process groups, compiled third-party models).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder -m "not slow"

## Run the benchmarks (writes JSON under benchmarks/results/).
bench: $(STAMP)
	$(VENV)/bin/shardplan bench --out benchmarks/results/table1.json

clean:
	rm -rf $(VENV) $(VENV5) build *.egg-info .pytest_cache
