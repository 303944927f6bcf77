"""Starting a `trl vllm-serve` server for the vLLM tests (test_vllm.py, test_fsdp2_vllm.py)."""

import os
import time


def start_server(model_dir, port, log_path, max_model_len: int = 256, slow_steps: bool = False):
    """`trl vllm-serve` as a user starts it, plus what the trainer's CPU paths need (see docs/VLLM.md). With
    ``slow_steps``, every engine step of the server takes at least `vllm_slow_steps.STEP_SECONDS` (its worker
    extension is the product's, from a test module that slows the worker down)."""
    import shutil
    import subprocess
    import sys

    trl = shutil.which("trl", path=os.path.dirname(sys.executable))
    extension = (
        "vllm_slow_steps.SlowStepsWorkerExtension"
        if slow_steps
        else "a3po_trl.generation.vllm.worker.A3POWorkerExtension"
    )
    command = [
        trl, "vllm-serve", "--model", str(model_dir), "--dtype", "float32", "--enforce_eager", "true",
        "--host", "127.0.0.1", "--port", str(port), "--max_model_len", str(max_model_len), "--skip-tokenizer-init",
        "--worker-extension-cls", extension,
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "8",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": "1"}
    if slow_steps:
        tests = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    log = open(log_path, "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(process, url, log_path, timeout=300):
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({process.returncode}): {open(log_path).read()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.exceptions.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM server not healthy after {timeout} s: {open(log_path).read()[-3000:]}")
