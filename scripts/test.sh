#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite, multi-process tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# DeepSpeed, for the tests only (ckptio reads and writes its checkpoints without it): the real DeepSpeed writes the
# ZeRO checkpoints the tests read and loads the universal folders ckptio writes; it builds against the installed torch
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing deepspeed (test-only)"
  DS_BUILD_OPS=0 .venv/bin/pip install -q --no-build-isolation deepspeed -c scripts/constraints.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import deepspeed" 2>/dev/null || { echo "[setup] deepspeed failed to install" >&2; exit 1; }
fi
# the report page's test opens it in a real headless browser: Chromium from the system's packages, where they can be
# installed (Debian/Ubuntu as root, as in CI); the test then requires it instead of skipping
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  if ! command -v chromium >/dev/null; then
    echo "[setup] installing chromium (the system's package) for the report page's browser test"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
      || echo "[setup] chromium could not be installed: the browser test will fail" >&2
  fi
  export CKPTIO_REQUIRE_BROWSER=1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# three workers on two cores (two left a quarter of the CPU idle: many tests wait on child processes, servers and
# fsync), each test file on one of them (its module fixtures built once); the longest files go first (conftest.py).
# CKPTIO_TEST_WORKERS changes the number.
exec .venv/bin/python -m pytest -q -n "${CKPTIO_TEST_WORKERS:-3}" --dist loadfile --durations=15 "$@"
