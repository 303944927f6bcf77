"""Starting a `trl vllm-serve` server for the vLLM tests (test_vllm.py, test_fsdp2_vllm.py,
test_vllm_server_in_flight.py), and two training processes generating with vLLM (tests/scripts/distributed_vllm.py)."""

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


def stop_server(process, grace_seconds: float = 30) -> None:
    """Stop a server from :func:`start_server` and everything it started (its own process group): SIGTERM, then
    SIGKILL if it is still there after ``grace_seconds``. Nothing happens if it already exited."""
    import signal
    import subprocess

    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace_seconds)


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


def launch_two_processes(tmp_path, model_dir, mode, *extra, timeout=900):
    """``tests/scripts/distributed_vllm.py`` under ``accelerate launch`` with two CPU processes (gloo): the
    launcher's result, its wall time and each rank's report (a rank that was killed writes none)."""
    import json
    import sys

    from helpers import free_port, run_process_tree

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tmp_path / "ddp.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: all\n"
        f"mixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\nmain_process_port: {free_port()}\n"
    )
    script = os.path.join(root, "tests", "scripts", "distributed_vllm.py")
    out = tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), script, str(out),
        str(model_dir), mode, *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    result = run_process_tree(command, env=env, timeout=timeout, cwd=root)
    seconds = time.monotonic() - start
    reports = {
        rank: json.loads((out / f"rank{rank}.json").read_text())
        for rank in range(2)
        if (out / f"rank{rank}.json").exists()
    }
    return result, seconds, reports
