# Two entry points (see README): `make demo` and `make test`.
.PHONY: setup demo test test-fast lint-deploy

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup
	.venv/bin/python -m pytest -q -ra tests

# Unit tests only (no vLLM engine).
test-fast: setup
	.venv/bin/python -m pytest -q -ra -m "not slow" tests

lint-deploy:
	bash scripts/validate_deploy.sh
