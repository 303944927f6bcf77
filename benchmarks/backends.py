"""Generation backends side by side: Hugging Face ``generate``, transformers' continuous batching
(``use_transformers_continuous_batching``) and vLLM (in-process and server), same shape.

For each backend, a short ``AsyncA3POTrainer`` run (A-3PO ``loglinear``, ``max_staleness=1``) in its own process, on
the demo's task and model, reporting: generation tokens/s, seconds per step, seconds per generation batch and per
training step, the pipelining ideal ``max(generation, training)`` and the measured step's ratio to it, and the
behavior/trainer log-prob mismatch of the backend. Runs in the vLLM environment (``bash scripts/setup_vllm.sh``):

    .venv-vllm/bin/python -m benchmarks.backends --backends generate,vllm-colocate,vllm-server --lora

``--backends generate,continuous-batching --repeats 2`` runs the two in-process Hugging Face backends in the project
environment, interleaved (generate, continuous batching, generate, ...), each row with the machine's load average
before it (a shared machine's load moves the numbers more than a backend does).

``--device cuda`` runs the same on a GPU (colocate on the training GPU; the server on ``--server-device``).
``--processes N`` runs each backend under ``accelerate launch`` with N training processes (DDP; on CPU, N gloo
processes): each process generates its own batch (``--batch`` completions) with its own engine (colocate) or through
the one server they share (full weights: the processes agree on the version it holds; LoRA: an adapter each).
Tokens/s then counts every process's completions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import internals
from benchmarks.common.demo import demo_trainer
from benchmarks.common.machine import LoadMeter
from benchmarks.common.provenance import omp_wait_policy, provenance, thread_roles
from benchmarks.common.runner import child_environment

BACKENDS = ("generate", "continuous-batching", "vllm-colocate", "vllm-server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model id, local directory or 'smollm2'")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (= completions per step)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024, help="vLLM's max_model_len (prompt + completion)")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on all linear layers (else full weights)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process (CPU)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--precision",
        default=None,
        choices=("fp32", "bf16"),
        help="fp32, or bf16 mixed precision (bf16=True: the generator and a vLLM engine hold bf16 weights); "
        "default bf16 on cuda, fp32 on cpu",
    )
    parser.add_argument(
        "--staleness", type=int, default=1, help="max_staleness (0: the mismatch is measured at every step)"
    )
    parser.add_argument("--server-device", default="1", help="CUDA_VISIBLE_DEVICES of the server with --device cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1, help="training processes (accelerate launch, DDP)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each backend, interleaved")
    parser.add_argument("--out", default=None, help="JSON file for the results (a .md table is written beside it)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--server-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load-before", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def _precision(options) -> str:
    return options.precision or ("bf16" if options.device == "cuda" else "fp32")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model_dir(name: str) -> str:
    from a3po_trl.tasks.offline_model import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct" if name == "smollm2" else name)


def _start_server(options, model_dir: str, log_path: Path):
    port = _free_port()
    trl = shutil.which("trl", path=os.path.dirname(sys.executable))
    command = [
        trl, "vllm-serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--max_model_len", str(options.max_model_len), "--skip-tokenizer-init",
        "--worker-extension-cls", "a3po_trl.generation.vllm.worker.A3POWorkerExtension",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": str(options.threads)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; without it vLLM's CPU backend reserves 90% of the memory
    if options.device == "cpu":
        command += ["--dtype", "float32", "--enforce_eager", "true"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = options.server_device
    if options.lora:
        command += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", str(2 * options.processes)]
    log = open(log_path, "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import requests

    start = time.time()
    while time.time() - start < 600:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited: {log_path.read_text()[-2000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                print(f"[backends] server up at {url} after {time.time() - start:.0f} s", flush=True)
                return process, url
        except requests.exceptions.RequestException:
            pass
        time.sleep(2)
    raise RuntimeError("the vLLM server did not come up within 600 s")


def _launch_config(options) -> str:
    """An accelerate config for ``--processes`` DDP processes on this machine (on CPU, gloo with ``use_cpu``)."""
    path = Path(tempfile.mkdtemp(prefix="a3po-backends-")) / "accelerate.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
        f"num_processes: {options.processes}\ngpu_ids: all\nmixed_precision: 'no'\nnum_machines: 1\n"
        f"machine_rank: 0\nmain_process_port: {_free_port()}\n"
    )
    return str(path)


def _run_one(options) -> dict:
    """One backend's run, in this process."""
    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
    from a3po_trl.tasks import make_math_splits

    backend = options.run_one
    train, _ = make_math_splits(256, 16, "easy", options.seed)
    vllm = {
        "use_vllm": backend.startswith("vllm"),
        "use_transformers_continuous_batching": backend == "continuous-batching",
    }
    if backend == "vllm-colocate":
        vllm.update(vllm_mode="colocate", vllm_max_model_length=options.max_model_len, vllm_gpu_memory_utilization=0.3)
    elif backend == "vllm-server":
        vllm.update(vllm_mode="server", vllm_server_base_url=options.server_url)
    args = AsyncA3POConfig(
        output_dir=str(Path(tempfile.gettempdir()) / "a3po-backends" / backend),  # nothing is saved; logs only
        per_device_train_batch_size=options.batch,
        num_generations=options.num_generations,
        max_completion_length=options.max_completion_length,
        max_steps=options.steps,
        learning_rate=1e-5,
        max_staleness=options.staleness,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=options.device == "cpu",
        bf16=_precision(options) == "bf16",
        seed=options.seed,
        **vllm,
    )
    trainer = demo_trainer(AsyncA3POTrainer, _model_dir(options.model), args, train, lora=options.lora)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "step_time" in h][options.warmup :]

    def mean(key):
        values = [h[key] for h in logs if key in h]
        return statistics.fmean(values) if values else None

    step = statistics.median(h["step_time"] for h in logs)
    generation = mean("async/generation_time")
    training = statistics.median(h["step_time"] - h.get("async/trainer_wait_time", 0.0) for h in logs)
    mismatch = [
        h["a3po/behavior_mismatch_max"] for h in trainer.state.log_history if "a3po/behavior_mismatch_max" in h
    ]
    mismatch_mean = [
        h["a3po/behavior_mismatch_mean"] for h in trainer.state.log_history if "a3po/behavior_mismatch_mean" in h
    ]
    shared = internals.shared_server_counts(trainer)  # a full-weight server shared by several processes
    return {
        "processes": trainer.accelerator.num_processes,
        "staleness_mean": mean("a3po/staleness_mean"),
        "shared_server_wait_seconds_per_step": shared["wait_seconds"] / options.steps if shared is not None else None,
        "shared_server_switches": shared["switches"] if shared is not None else None,
        "backend": backend,
        "load_before": getattr(options, "load_before", None),
        "seconds_per_step": step,
        "generation_seconds_per_batch": generation,
        "training_seconds_per_step": training,
        "pipelining_ideal": max(generation, training),
        "ratio_to_ideal": step / max(generation, training),
        "generation_tokens_per_second": mean("async/completion_tokens_per_second"),
        "mean_completion_length": mean("completions/mean_length"),
        "weight_sync_seconds": mean("async/weight_sync_time"),
        "weight_load_seconds": mean("async/weight_load_time"),
        "behavior_mismatch_max": max(mismatch) if mismatch else None,
        "behavior_mismatch_mean": statistics.fmean(mismatch_mean) if mismatch_mean else None,
        "behavior_mismatch_steps": len(mismatch),
        "generator_dtype": internals.generator_dtype(trainer),
        "total_seconds": total,
    }


def _table(results: list[dict], meta: dict) -> str:
    lines = [
        f"Backends, {meta['model']} ({'LoRA r=16' if meta['lora'] else 'full weights'}), {meta['batch']} completions "
        f"x {meta['max_completion_length']} tokens per step, {meta['steps']} steps ({meta['warmup']} warm-up left "
        f"out), {meta['threads']} thread(s) per process, device {meta['device']}, "
        f"{meta.get('processes', 1)} training process(es), {meta.get('precision', 'fp32')}, max_staleness "
        f"{meta.get('staleness', 1)}, load before: {meta['load']}.",
        "",
        "| backend | tokens/s | s/step | generation s/batch | training s/step | ideal | ratio | version load s "
        "| mismatch max | mismatch mean | staleness mean | shared-server wait s/step | load before |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mismatch = f"{r['behavior_mismatch_max']:.1e}" if r["behavior_mismatch_max"] is not None else "-"
        mean = f"{r['behavior_mismatch_mean']:.1e}" if r.get("behavior_mismatch_mean") is not None else "-"
        load = f"{r['weight_load_seconds']:.2f}" if r.get("weight_load_seconds") is not None else "-"
        lines.append(
            f"| {r['backend']} | {r['generation_tokens_per_second']:.1f} | {r['seconds_per_step']:.2f} | "
            f"{r['generation_seconds_per_batch']:.2f} | {r['training_seconds_per_step']:.2f} | "
            f"{r['pipelining_ideal']:.2f} | {r['ratio_to_ideal']:.2f} | {load} | {mismatch} | {mean} | "
            f"{_number(r.get('staleness_mean'))} | {_number(r.get('shared_server_wait_seconds_per_step'))} | "
            f"{_number(r.get('load_before'))} |"
        )
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    options = _parser().parse_args()
    if options.run_one:
        result = _run_one(options)
        if int(os.environ.get("RANK", "0")) == 0:
            print("A3PO_RESULT " + json.dumps(result), flush=True)
        return
    started, invocation = time.time(), LoadMeter(children=True).start()
    # every process, and its training and generation threads (not set: PyTorch's), run on OMP_NUM_THREADS=threads
    threads = thread_roles(options.threads, options.threads, options.threads)
    wait = omp_wait_policy(child_environment())  # the processes' environment
    meta = {k: getattr(options, k) for k in ("model", "lora", "batch", "max_completion_length", "steps", "warmup")}
    if options.processes > 1:
        meta["processes"] = options.processes
    meta.update(threads=options.threads, device=options.device, load=os.getloadavg()[0])
    if _precision(options) != "fp32" or options.staleness != 1:  # older result files have neither
        meta.update(precision=_precision(options), staleness=options.staleness)
    if options.repeats > 1:
        meta["repeats"] = options.repeats
    results = []
    for backend in options.backends.split(",") * options.repeats:
        if backend not in BACKENDS:
            raise SystemExit(f"--backends: unknown backend {backend!r}; choose from {BACKENDS}")
        server, extra = None, []
        log_dir = Path(tempfile.gettempdir())
        if backend == "vllm-server":
            server, url = _start_server(options, _model_dir(options.model), log_dir / "backends-server.log")
            extra = ["--server-url", url]
        env = child_environment({"OMP_NUM_THREADS": str(options.threads), "VLLM_CPU_KVCACHE_SPACE": "2"})
        if options.device == "cuda" and backend == "vllm-server":
            env["CUDA_VISIBLE_DEVICES"] = "0"
        print(f"[backends] {backend} ...", flush=True)
        load = os.getloadavg()[0]
        row_started, meter = time.time(), LoadMeter(children=True).start()
        launcher = [sys.executable]
        if options.processes > 1:  # each process runs `python -m benchmarks.backends`
            launcher += ["-m", "accelerate.commands.launch", "--config_file", _launch_config(options)]
        try:
            out = subprocess.run(
                [*launcher, "-m", "benchmarks.backends", *sys.argv[1:], "--run-one", backend, *extra,
                 "--load-before", str(load)],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(60)
        lines = [line for line in out.stdout.splitlines() if line.startswith("A3PO_RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{backend} failed ({out.returncode}):\n{out.stderr[-4000:]}")
        row = json.loads(lines[-1].removeprefix("A3PO_RESULT "))
        row["provenance"] = provenance(row_started, threads, meter.stop()["foreign_cpu_frac"], wait_policy=wait)
        results.append(row)
        print(f"[backends] {backend}: {json.dumps(results[-1])}", flush=True)
    # keep the other backends' rows of an earlier run of this shape
    if options.out and Path(options.out).exists() and options.repeats == 1:
        earlier = json.loads(Path(options.out).read_text())
        mine = ("load", "provenance")  # this invocation's own; each row kept carries its own block
        if {k: v for k, v in earlier["meta"].items() if k not in mine} == {
            k: v for k, v in meta.items() if k not in mine
        }:
            done = {r["backend"] for r in results}
            results = [r for r in earlier["results"] if r["backend"] not in done] + results
            results.sort(key=lambda r: BACKENDS.index(r["backend"]))
            meta["load"] = f"{earlier['meta']['load']} / {meta['load']}"
    meta["provenance"] = provenance(started, threads, invocation.stop()["foreign_cpu_frac"], wait_policy=wait)
    table = _table(results, meta)
    print(table)
    if options.out:
        Path(options.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        Path(options.out).with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
