# Two entry points (see README): `make demo` and `make test`.
# Tests run with `python -P`: the repository root is not on sys.path, so the
# tests import the installed package, as a user's process does.
.PHONY: setup demo test test-fast lint-deploy

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

# Two workers (pytest-xdist), one core each (tests/conftest.py), each test file
# whole on one of them (its module-scoped engines are built once), the longest
# files first (tests/conftest.py: LONGEST_FILES; xdist's reordering by test count off).
test: setup
	.venv/bin/python -P -m pytest -q -ra --durations=20 -n 2 --dist loadfile --no-loadscope-reorder tests

# Unit tests only (no vLLM engine).
test-fast: setup
	.venv/bin/python -P -m pytest -q -ra -m "not slow" tests

lint-deploy:
	bash scripts/validate_deploy.sh
