#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, and the vLLM backend's tests in their own environment
# (scripts/setup_vllm.sh: vLLM pins transformers < 5.20). Extra arguments go to the main pytest run.
# The vLLM environment is built while the main run goes (mostly downloads and unpacking), and its tests then run
# beside the main run (which keeps about one core of two busy on average: its launches wait on their processes);
# their output is printed when both have ended. A3PO_VLLM_AFTER=1 runs them after the main run instead (one suite at
# a time), A3PO_SKIP_VLLM=1 not at all, A3PO_VLLM_TESTS="path ..." only those. Each run lists its slowest tests (CI's
# time budget: keep them cheap). The exit status is the main run's where it failed, else the vLLM run's.
set -euo pipefail
cd "$(dirname "$0")/.."
A3PO_EXTRAS="${A3PO_EXTRAS:-deepspeed}" bash scripts/setup.sh  # the suite launches DeepSpeed ZeRO-2/3 runs
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
VLLM_TESTS=(tests/integration/test_vllm.py tests/integration/test_vllm_in_flight.py
  tests/integration/test_vllm_server_in_flight.py tests/integration/test_fsdp2_vllm.py tests/end_to_end/test_gpu_check.py)
if [ -n "${A3PO_VLLM_TESTS:-}" ]; then read -r -a VLLM_TESTS <<<"$A3PO_VLLM_TESTS"; fi  # a subset, space-separated
vllm_log="$(mktemp)"
vllm_status_file="$(mktemp)"

run_vllm_tests() {
  # one thread each for the engine and the trainer: stable timings on a small machine
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv-vllm/bin/python -m pytest -q --durations=15 -m vllm "${VLLM_TESTS[@]}"
}

vllm_part() {  # set up .venv-vllm, then (unless A3PO_VLLM_AFTER=1) run its tests; the status goes to a file
  local status=0
  nice -n 10 bash scripts/setup_vllm.sh || status=$?
  if [ "$status" -ne 0 ]; then
    echo "scripts/setup_vllm.sh failed (exit $status)"
  elif [ "${A3PO_VLLM_AFTER:-0}" != "1" ]; then
    echo "[test.sh] vLLM tests started $(date -u +%H:%M:%S) beside the main run"
    run_vllm_tests || status=$?
    echo "[test.sh] vLLM tests ended $(date -u +%H:%M:%S), exit $status"
  fi
  echo "$status" >"$vllm_status_file"
}

vllm_pid=""
if [ "${A3PO_SKIP_VLLM:-0}" != "1" ]; then
  set -m  # the vLLM part in a process group of its own: ended with this script, however it ends
  vllm_part >"$vllm_log" 2>&1 &
  vllm_pid=$!
  set +m
  trap 'kill -- -"$vllm_pid" 2>/dev/null || true' EXIT
fi
# shellcheck disable=SC1091
. .venv/bin/activate
suite_status=0
python -m pytest -q --durations=25 "$@" || suite_status=$?
deactivate
[ -n "$vllm_pid" ] || exit "$suite_status"
kill -0 "$vllm_pid" 2>/dev/null && echo "[test.sh] main run ended $(date -u +%H:%M:%S); waiting for the vLLM part"
wait "$vllm_pid" || true
vllm_status="$(cat "$vllm_status_file" 2>/dev/null)"
vllm_status="${vllm_status:-1}"  # no status written: the part was killed
echo "---------------- vLLM part (.venv-vllm) ----------------"
cat "$vllm_log"
if [ "$vllm_status" -eq 0 ] && [ "${A3PO_VLLM_AFTER:-0}" = "1" ] && [ "$suite_status" -eq 0 ]; then
  run_vllm_tests || vllm_status=$?
fi
[ "$suite_status" -eq 0 ] || exit "$suite_status"
exit "$vllm_status"
