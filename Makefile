# EvalForge — the two commands are `make demo` and `make test`; both set up first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo lint bench clean

setup: ## create .venv/ and install everything (idempotent)
	@bash scripts/setup.sh

test: setup ## run the whole test suite
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup ## run the main job end to end on embedded defaults
	$(PY) scripts/demo.py

lint: setup ## ruff
	$(VENV)/bin/ruff check .

bench: setup ## every benchmark in bench/, each prints a table
	@set -e; for script in bench/*.py; do echo "== $$script"; $(PY) $$script; echo; done

clean: ## remove the virtual environment and run outputs
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
