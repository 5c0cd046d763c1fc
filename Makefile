# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv from nothing.
# torch is installed first: TORCH_SPEC defaults to the CPU wheel these machines keep on disk;
# override it elsewhere, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url ..."`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainbus demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[bench]"
	$(BIN)/python benchmarks/bus.py
	$(BIN)/python benchmarks/step_overhead.py

# What CI runs before the suite: ruff's lint and format check, mypy strict (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks conftest.py
	$(BIN)/ruff format --check src tests examples benchmarks conftest.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist .pytest_cache
