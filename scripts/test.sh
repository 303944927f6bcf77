#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
A3PO_EXTRAS="${A3PO_EXTRAS:-deepspeed}" bash scripts/setup.sh  # the suite launches DeepSpeed ZeRO-2/3 runs
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
