#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite, multi-process tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# two workers, each test file on one of them (its module fixtures built once); the longest files go first (conftest.py)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"
