"""Eager decoding against a static cache with a compiled step, in ``generate``: the generator's CPU time per token.

    python -m benchmarks.compiled_decode                       # the launch-bound proxy (tiny) and SmolLM2, on CPU
    python -m benchmarks.compiled_decode --models tiny --device cuda   # on a GPU (CUDA graphs: reduce-overhead)

Issue 57 asks whether the generator should decode with a static KV cache and a compiled step (``generate``'s own
auto-compilation, which TRL turns off with ``disable_compile=True``): kept only if it cuts the generator's CPU time
per token on the launch-bound proxy (the tiny model) by at least 2x, or the main job's generation time (SmolLM2)
measurably. This measures the best case of that path, plain ``generate`` with greedy decoding and nothing of the
trainer's around it (no behavior log-prob recorder, no own random stream, no in-flight loads: each would add eager
work per token that compilation does not remove), so a path that misses the bar here misses it in the trainer too.

Timed without keeping scores (the best case); one more call per path keeps them, for the comparison. Three paths on
the same batch (``--rows`` copies of one prompt, ``--new-tokens`` tokens each, no early stop):
``eager`` (the dynamic cache, what the generator runs), ``static`` (the static cache, eager), ``compiled`` (the static
cache, the forward compiled by ``generate``: inductor on CPU, CUDA graphs on a GPU; the first call, which compiles,
timed apart). Per path, ``--reps`` timed calls after one untimed: the calling thread's CPU seconds
(``time.thread_time``, one intra-op thread: the ops run on it) and wall seconds per generated token (per batch step),
each repetition kept, with their medians and ranges. The compiled path's greedy tokens and log-probs are compared
with the eager path's (agreement and the largest log-prob difference). The rule is applied and written: ``keep`` or
``drop``.

Outputs: ``<out>/compiled-decode.json`` (with its provenance block: when, at which commit, where, the load) and
``.md``. CPU time is robust to other processes on the machine (a thread
waiting for a core is not running); wall time is not, and the machine's load is recorded beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.machine import LoadMeter
from benchmarks.common.provenance import provenance, thread_roles

HERE = Path(__file__).resolve().parent
#: The rule's bar on the launch-bound proxy: compiled CPU time per token at most 1/2 of eager's.
PROXY_FACTOR = 2.0
#: The main job: the demo's generation (60 steps, one batch each, up to 64 tokens: decode steps at most).
MAIN_JOB_DECODE_STEPS = 60 * 64
#: "Measurably": the main job's generation time, the compilation included, at least this much lower.
MAIN_JOB_SAVING = 0.05


def load(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer, description)``: ``tiny`` (the launch-bound proxy), ``smollm2`` (the main job's model) or
    a saved model's folder (loaded in ``dtype``)."""
    if name == "tiny":
        from a3po_trl.tasks.tiny_model import make_byte_tokenizer, make_tiny_llama

        tokenizer = make_byte_tokenizer()
        return make_tiny_llama(tokenizer, seed=0), tokenizer, "random 2-layer Llama, hidden 32, byte tokenizer"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a3po_trl.tasks.offline_model import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct") if name == "smollm2" else name
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), tokenizer, str(path)


def configs(tokenizer, new_tokens: int, device: str) -> dict:
    from transformers import CompileConfig, GenerationConfig

    base = dict(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
    )
    mode = "reduce-overhead" if device == "cuda" else None  # CUDA graphs on a GPU; inductor's default on CPU
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    compile_config._compile_all_devices = device != "cuda"  # generate auto-compiles only on accelerators otherwise
    return {
        "eager": GenerationConfig(**base, disable_compile=True),
        "static": GenerationConfig(**base, cache_implementation="static", disable_compile=True),
        "compiled": GenerationConfig(
            **base, cache_implementation="static", disable_compile=False, compile_config=compile_config
        ),
    }


def timed_generate(model, batch, config, device: str):
    """One ``generate`` call: ``(output, cpu seconds of this thread, wall seconds)``."""
    if device == "cuda":
        torch.cuda.synchronize()
    cpu, wall = time.thread_time(), time.perf_counter()
    with torch.no_grad():
        output = model.generate(**batch, generation_config=config)
    if device == "cuda":
        torch.cuda.synchronize()
    return output, time.thread_time() - cpu, time.perf_counter() - wall


def logps(output, prompt_length: int) -> torch.Tensor:
    """``(rows, tokens)`` log-probs of the greedy tokens under each step's scores."""
    tokens = output.sequences[:, prompt_length:]
    scores = torch.stack(output.scores, dim=1).float().log_softmax(-1)
    return scores.gather(2, tokens.unsqueeze(-1)).squeeze(-1)


def measure_model(name: str, options) -> dict:
    """Every path on model ``name`` (see :func:`load`); ``options``: ``device``, ``rows``, ``new_tokens``, ``reps`` and
    optionally ``dtype`` (a saved model's)."""
    model, tokenizer, description = load(name, getattr(options, "dtype", torch.float32))
    model = model.to(options.device).eval()
    tokenizer.padding_side = "left"
    prompt = "Write the sum of 12 and 7, then explain it in one sentence."
    batch = tokenizer([prompt] * options.rows, return_tensors="pt", padding=True).to(options.device)
    prompt_length = batch["input_ids"].size(1)
    paths, outputs = {}, {}
    for path, config in configs(tokenizer, options.new_tokens, options.device).items():
        output, cpu, wall = timed_generate(model, batch, config, options.device)  # untimed: builds, compiles
        first = {"cpu_seconds": cpu, "wall_seconds": wall}
        cpus, walls = [], []
        for _ in range(options.reps):
            output, cpu, wall = timed_generate(model, batch, config, options.device)
            cpus.append(cpu / options.new_tokens)
            walls.append(wall / options.new_tokens)
        scored = copy.deepcopy(config)
        scored.output_scores = True  # one more call, untimed, for the comparison of log-probs
        outputs[path] = timed_generate(model, batch, scored, options.device)[0]
        paths[path] = {
            "first_call": first,
            # every repetition kept ("all", in the order they ran), and their median and range
            "cpu_per_token": {"median": statistics.median(cpus), "min": min(cpus), "max": max(cpus), "all": cpus},
            "wall_per_token": {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "all": walls},
        }
        print(f"[compiled_decode] {name} {path}: {paths[path]['cpu_per_token']['median'] * 1e3:.3f} ms CPU/token "
              f"(first call {first['wall_seconds']:.1f} s)", flush=True)  # fmt: skip
    eager, compiled = outputs["eager"], outputs["compiled"]
    same = (eager.sequences == compiled.sequences).float().mean().item()
    difference = (logps(eager, prompt_length) - logps(compiled, prompt_length)).abs().max().item()
    return {
        "model": description,
        "rows": options.rows,
        "new_tokens": options.new_tokens,
        "paths": paths,
        "cpu_ratio": paths["eager"]["cpu_per_token"]["median"] / paths["compiled"]["cpu_per_token"]["median"],
        "wall_ratio": paths["eager"]["wall_per_token"]["median"] / paths["compiled"]["wall_per_token"]["median"],
        "wall_separated": paths["compiled"]["wall_per_token"]["max"] < paths["eager"]["wall_per_token"]["min"],
        "token_agreement": same,
        "max_logp_difference": difference,
    }


def main_job_saving(result: dict, decode_steps: int = MAIN_JOB_DECODE_STEPS) -> float:
    """The share of the main job's generation time the compiled path saves over ``decode_steps`` batch steps, its
    compilation (the first call's extra time over eager's) included, and one compilation only (the most favourable
    case: every later prompt length that changes the shapes compiles again)."""
    eager, compiled = result["paths"]["eager"], result["paths"]["compiled"]
    per_step = eager["wall_per_token"]["median"]
    saved = decode_steps * (per_step - compiled["wall_per_token"]["median"])
    compile_cost = compiled["first_call"]["wall_seconds"] - eager["first_call"]["wall_seconds"]
    return (saved - compile_cost) / (decode_steps * per_step)


def decide(results: dict) -> dict:
    """The rule: keep the compiled path iff the proxy's CPU time per token falls by ``PROXY_FACTOR`` or more, or the
    main job's generation time falls measurably: every compiled repetition faster per token than every eager one,
    and the demo's generation (:data:`MAIN_JOB_DECODE_STEPS`) at least :data:`MAIN_JOB_SAVING` shorter with the
    compilation counted."""
    proxy = results.get("tiny")
    main_job = results.get("smollm2")
    proxy_met = proxy is not None and proxy["cpu_ratio"] >= PROXY_FACTOR
    saving = main_job_saving(main_job) if main_job is not None else None
    main_met = main_job is not None and main_job["wall_separated"] and saving >= MAIN_JOB_SAVING
    return {"keep": bool(proxy_met or main_met), "proxy_met": proxy_met, "main_job_met": main_met, "saving": saving}


def markdown(report: dict) -> str:
    lines = [
        f"Eager decoding against a static cache with a compiled step ({report['device']}, "
        f"{report['threads']} intra-op thread(s), torch {report['torch']}, transformers {report['transformers']}; "
        f"load average {report['load_average'][0]:.1f} at start). Per generated token (one batch step), medians "
        f"over {report['reps']} calls after an untimed one: the calling thread's CPU time and the wall time.",
        "",
        "| model | rows x tokens | path | CPU ms/token | wall ms/token (range) | first call (s) |",
        "|---|---|---|---:|---|---:|",
    ]
    for name, result in report["results"].items():
        for path, figures in result["paths"].items():
            cpu, wall = figures["cpu_per_token"], figures["wall_per_token"]
            lines.append(
                f"| {name} | {result['rows']} x {result['new_tokens']} | {path} | {cpu['median'] * 1e3:.3f} | "
                f"{wall['median'] * 1e3:.3f} ({wall['min'] * 1e3:.3f}-{wall['max'] * 1e3:.3f}) | "
                f"{figures['first_call']['wall_seconds']:.2f} |"
            )
    lines += ["", "| model | eager / compiled, CPU | eager / compiled, wall | greedy tokens equal | largest log-prob "
              "difference |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, result in report["results"].items():
        lines.append(
            f"| {name} | {result['cpu_ratio']:.2f}x | {result['wall_ratio']:.2f}x | {result['token_agreement']:.1%} | "
            f"{result['max_logp_difference']:.2e} |"
        )
    decision = report["decision"]
    verdict = "keep the compiled path" if decision["keep"] else "drop it: the eager path stays the only one"
    saving = "-" if decision["saving"] is None else f"{decision['saving']:+.1%}"
    lines += [
        "",
        f"**Decision** (issue 57's rule: at least {PROXY_FACTOR:g}x less CPU time per token on the proxy, or the main "
        f"job's generation time measurably lower: every compiled repetition faster per token than every eager one "
        f"and the demo's {MAIN_JOB_DECODE_STEPS} decode steps at least {MAIN_JOB_SAVING:.0%} shorter with one "
        f"compilation counted): {verdict} (proxy: {'met' if decision['proxy_met'] else 'not met'}; main job: "
        f"{'met' if decision['main_job_met'] else 'not met'}, saving {saving}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import os

    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="comma list: tiny, smollm2, or a model path")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=16, help="completions decoded together (the studies' batch)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: the ops run on the caller)")
    parser.add_argument("--out", default=str(HERE / "results"))
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    started, meter = time.time(), LoadMeter().start()
    results = {name: measure_model(name, options) for name in options.models.split(",")}
    # every path runs on the calling thread, on --threads intra-op threads: no training or generation thread
    block = provenance(started, thread_roles(process=options.threads), meter.stop()["foreign_cpu_frac"])
    report = {
        "device": options.device,
        "threads": options.threads,
        "reps": options.reps,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": list(os.getloadavg()),
        "results": results,
        "decision": decide(results),
        "provenance": block,
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled-decode.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "compiled-decode.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
