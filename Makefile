# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv from nothing.
# torch is installed first: TORCH_SPEC defaults to the CPU wheel these machines keep on disk;
# override it elsewhere, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url ..."`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench lint docs clean

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

# The documentation site (mkdocs.yml) into site/: the pages under docs/ and the API reference
# generated from the docstrings. --strict: a page missing from the nav, a broken link or anchor,
# a cross-reference to a name that does not exist fails the build, naming the page. The docs
# packages are in the dev extra (pyproject.toml), so $(STAMP) installed them. NO_MKDOCS_2_WARNING:
# the Material theme's banner about its end of life (pyproject.toml says so where it is pinned).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# What CI runs before the suite: ruff's lint and format check, mypy strict (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks tools conftest.py
	$(BIN)/ruff format --check src tests examples benchmarks tools conftest.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist site .pytest_cache
