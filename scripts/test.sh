#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, then the vLLM backend's tests in their own environment
# (scripts/setup_vllm.sh: vLLM pins transformers < 5.20). Extra arguments go to the first pytest run.
# A3PO_SKIP_VLLM=1 skips the vLLM part. The vLLM environment is built while the first run goes (mostly downloads and
# unpacking, off the suite's critical path); each run lists its slowest tests (CI's time budget: keep them cheap).
set -euo pipefail
cd "$(dirname "$0")/.."
A3PO_EXTRAS="${A3PO_EXTRAS:-deepspeed}" bash scripts/setup.sh  # the suite launches DeepSpeed ZeRO-2/3 runs
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
vllm_setup_pid=""
vllm_setup_log="$(mktemp)"
if [ "${A3PO_SKIP_VLLM:-0}" != "1" ]; then
  nice -n 10 bash scripts/setup_vllm.sh >"$vllm_setup_log" 2>&1 &
  vllm_setup_pid=$!
fi
# shellcheck disable=SC1091
. .venv/bin/activate
suite_status=0
python -m pytest -q --durations=25 "$@" || suite_status=$?
deactivate
if [ -n "$vllm_setup_pid" ]; then
  if ! wait "$vllm_setup_pid"; then
    cat "$vllm_setup_log"
    echo "scripts/setup_vllm.sh failed (its output above)" >&2
    exit 1
  fi
fi
[ "$suite_status" -eq 0 ] || exit "$suite_status"
if [ "${A3PO_SKIP_VLLM:-0}" != "1" ]; then
  # one thread each for the engine and the trainer: stable timings on a small machine
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv-vllm/bin/python -m pytest -q --durations=15 -m vllm \
    tests/integration/test_vllm.py tests/integration/test_vllm_in_flight.py \
    tests/integration/test_vllm_server_in_flight.py tests/integration/test_fsdp2_vllm.py tests/end_to_end/test_gpu_check.py
fi
