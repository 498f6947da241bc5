# make test  : set up .venv (CPU torch, triton, test tools) and run the test suite
# make bench : set up .venv and run the benchmark (on a machine without a GPU it runs the CPU paths)
VENV ?= .venv
PY := $(VENV)/bin/python
# pinned so pip never pulls the multi-GB CUDA build on a CPU machine; override on a GPU box
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test bench setup clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -q $(PYTEST_ARGS)

bench: setup
	$(PY) -m normkit bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
