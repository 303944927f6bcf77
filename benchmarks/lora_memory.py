"""Extra memory of the generator's policy copy: LoRA (adapters only) against full fine-tuning (a whole copy).

    python -m benchmarks.lora_memory                      # SmolLM2-135M-Instruct (offline), LoRA r=16 on all linears
    python -m benchmarks.lora_memory --model tiny         # the tiny random Llama (a3po_trl.tasks.tiny_model)

The generator thread of `AsyncA3POTrainer` holds an `HFGenerateBackend`: with LoRA its frozen base tensors ARE the
trainer's (same storage) and only the adapter tensors are its own, plus a staging buffer of the same size that the
main thread publishes into. This script builds the policy both ways on the same model and reports, for each, the
bytes of tensors the generator owns (parameters, buffers and staging, counted by storage so shared tensors count
zero), the process RSS growth while building it, and the bytes one weight publication copies.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from benchmarks.common.internals import generator_memory, hf_generator
from benchmarks.common.machine import LoadMeter
from benchmarks.common.provenance import provenance, thread_roles


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def load_model(name: str):
    if name == "tiny":
        from a3po_trl.tasks.tiny_model import make_byte_tokenizer, make_tiny_llama

        return make_tiny_llama(make_byte_tokenizer())
    from transformers import AutoModelForCausalLM

    from a3po_trl.tasks.offline_model import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)


def measure(model, label: str) -> dict:
    gc.collect()
    before = rss_bytes()
    generator = hf_generator(model)
    gc.collect()
    grown = rss_bytes() - before
    trainable = [p for p in model.parameters() if p.requires_grad]
    result = {
        "setup": label,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        **generator_memory(generator, model),
        "publish_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "rss_growth_bytes": grown,
    }
    result["extra_bytes"] = result["generator_weights_bytes"] + result["staging_bytes"]
    del generator
    gc.collect()
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="'tiny', a model id or a local directory")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-target-modules", default="all-linear")
    parser.add_argument("--out", default=None, help="JSON file to write the results to")
    args = parser.parse_args(argv)

    from peft import LoraConfig, get_peft_model

    started, meter = time.time(), LoadMeter().start()
    results = [measure(load_model(args.model), "full fine-tuning")]
    gc.collect()
    lora_config = LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=args.lora_target_modules, task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(load_model(args.model), lora_config)
    results.append(measure(peft_model, f"LoRA r={args.lora_r} ({args.lora_target_modules})"))

    mib = 2**20
    print(f"Generator's extra memory, {args.model}:")
    print("| setup | copied parameters | shared parameters | generator weights | staging | one publish | RSS growth |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['setup']} | {r['copied_parameters']:,} | {r['shared_parameters']:,} | "
            f"{r['generator_weights_bytes'] / mib:.1f} MiB | {r['staging_bytes'] / mib:.1f} MiB | "
            f"{r['publish_bytes'] / mib:.2f} MiB | {r['rss_growth_bytes'] / mib:.1f} MiB |"
        )
    full, lora = results
    print(f"LoRA generator extra memory: {lora['extra_bytes'] / full['extra_bytes']:.2%} of a full copy's.")
    # memory, not time, is measured, in this process's thread alone
    block = provenance(started, thread_roles(process=torch.get_num_threads()), meter.stop()["foreign_cpu_frac"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "results": results, "provenance": block}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
