# Two entry points (see README): `make demo` and `make test`.
# Tests run with `python -P`: the repository root is not on sys.path, so the
# tests import the installed package, as a user's process does.
.PHONY: setup demo test test-fast lint-deploy

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup
	.venv/bin/python -P -m pytest -q -ra --durations=20 tests

# Unit tests only (no vLLM engine).
test-fast: setup
	.venv/bin/python -P -m pytest -q -ra -m "not slow" tests

lint-deploy:
	bash scripts/validate_deploy.sh
