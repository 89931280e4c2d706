#!/usr/bin/env bash
# The GPU check: one CUDA GPU, under 8 minutes. Its CUDA tests, then benchmarks/gpu_check.py's table
# (gradients of the speed layer vs the reference path in bf16, our decode loop with CUDA graphs vs
# model.generate, a step beside TRL's where TRL is installed, QLoRA, peak memory), written to --out.
#
#   bash scripts/gpu_check.sh [--out gpu-check.md]    # on the GPU machine, from a checkout
#   bash scripts/gpu_check.sh --device cpu             # the dry run CI does (tiny model, float32)
#
# PYTHON picks the interpreter (default: .venv/bin/python when there is one, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
# The tests that run on a CUDA GPU (their CUDA cases skip themselves without one); the project's
# addopts name pytest-xdist, which a GPU image need not have
"$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -k cuda \
  tests/test_trainer.py tests/test_decode_step.py tests/test_lean_generation.py tests/test_timing.py
exec "$PYTHON" benchmarks/gpu_check.py "$@"
