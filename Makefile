# The two commands of the README. Each runs scripts/setup.sh first (idempotent, fast when done).
.PHONY: demo test setup lint

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python -m cwm_plugin.demo

test: setup
	@.venv/bin/python -m pytest

lint: setup
	@.venv/bin/ruff check .
