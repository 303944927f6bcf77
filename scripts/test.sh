#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, then the vLLM backend's tests in their own environment
# (scripts/setup_vllm.sh: vLLM pins transformers < 5.20). Extra arguments go to the first pytest run.
# A3PO_SKIP_VLLM=1 skips the vLLM part.
set -euo pipefail
cd "$(dirname "$0")/.."
A3PO_EXTRAS="${A3PO_EXTRAS:-deepspeed}" bash scripts/setup.sh  # the suite launches DeepSpeed ZeRO-2/3 runs
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q "$@"
deactivate
if [ "${A3PO_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh
  # one thread each for the engine and the trainer: stable timings on a small machine
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv-vllm/bin/python -m pytest -q -m vllm tests/integration/test_vllm.py tests/integration/test_vllm_in_flight.py \
    tests/integration/test_vllm_server_in_flight.py tests/integration/test_fsdp2_vllm.py tests/end_to_end/test_gpu_check.py
fi
