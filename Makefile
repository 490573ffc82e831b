# The two commands of the README. Each runs scripts/setup.sh first (idempotent, fast when done).
.PHONY: demo test setup lint

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/python -m cwm_plugin.demo

# The checks first: ruff, and import-linter's contracts (pyproject's [tool.importlinter]: the
# layers, no package importing one above it, no import circle).
test: setup lint
	@.venv/bin/python -m pytest

lint: setup
	@.venv/bin/ruff check .
	@.venv/bin/lint-imports --no-cache
