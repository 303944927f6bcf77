#!/usr/bin/env bash
# Create .venv and install a3po-trl with its test and demo dependencies.
# On a machine without an NVIDIA GPU the CPU build of torch is pinned first, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[dev${A3PO_EXTRAS:+,$A3PO_EXTRAS}]"
