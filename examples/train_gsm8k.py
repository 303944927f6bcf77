"""Train a small LM on math word problems with asynchronous A-3PO, and measure held-out accuracy before and after.

The main job of a3po-trl. With no arguments it trains a LoRA adapter (r=16, every linear layer) of the offline
SmolLM2-135M-Instruct on generated one-step GSM8K-style problems, on CPU or GPU. Measured on 2 CPU cores (seed 42,
60 steps; docs/BENCHMARKS.md, "The main job", from benchmarks/results/demo-smollm2.json): 14.7 min, greedy
accuracy on 200 held-out problems 25.0% +- 3.1% -> 33.5% +- 3.3% (paired gain +8.5% +- 3.7%, McNemar p = 0.033):

    python examples/train_gsm8k.py --output_dir outputs/demo

Every `AsyncA3POConfig` field (hence every `GRPOConfig` / `TrainingArguments` field) and every `trl.ModelConfig`
field (`--model_name_or_path`, `--use_peft`, `--lora_r`, ...) is a command-line flag, as in TRL's own scripts; a
YAML file can hold them too (`--config recipe.yaml`). Examples:

    # LoRA on the real GSM8K (from the hub, or a local .jsonl/.parquet file or save_to_disk directory)
    python examples/train_gsm8k.py --dataset openai/gsm8k --max_steps 200
    # full fine-tuning instead of LoRA
    python examples/train_gsm8k.py --use_peft false --learning_rate 2e-5
    # two processes on one CPU machine (DDP over gloo); only the main process evaluates and writes files
    accelerate launch --multi_gpu --num_processes 2 examples/train_gsm8k.py --use_cpu --max_steps 10
    # several GPUs
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/train_gsm8k.py

Rewards: `correctness_reward` (1.0 for the right final number) and `format_reward` (0.5 for a marked final answer),
weighted 1.0 and 0.0 by default (the format reward is logged, not trained on; `--reward_weights 1.0 0.1` adds it).
Output directory: the trained model or LoRA adapter with its tokenizer, `metrics.jsonl` (every log entry and the
accuracy evaluations), `training.png` (reward, accuracy, staleness, step time), `timeline.png` (the last steps of the
two threads' timeline; the full trace is in `timeline/trace-rank*.json`) and `results.json` (summary).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.tasks import evaluate_accuracy, load_gsm8k, make_math_splits, plot_training
from a3po_trl.tasks.demo_settings import DEMO_SYSTEM_PROMPT, demo_defaults
from a3po_trl.tasks.evaluation import paired_accuracy_test
from a3po_trl.tasks.offline_model import resolve_model_path
from a3po_trl.tasks.rewards import correctness_reward, format_reward


@dataclass
class DemoArguments:
    """Data and evaluation options of the example (the training options are `AsyncA3POConfig`'s)."""

    dataset: str = field(
        default="builtin",
        metadata={
            "help": "'builtin' (generated GSM8K-style problems, offline), 'gsm8k' (openai/gsm8k from the hub), or a "
            "hub dataset name / local .json/.jsonl/.parquet/.csv file / save_to_disk directory in GSM8K's schema."
        },
    )
    difficulty: str = field(
        default="basic", metadata={"help": "Builtin problems: basic (one step), easy, medium, hard, or a level 0-5."}
    )
    num_train: int = field(default=1000, metadata={"help": "Number of training problems."})
    num_eval: int = field(default=200, metadata={"help": "Number of held-out problems for the accuracy evaluation."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the generated problems and of the data split."})
    system_prompt: str | None = field(
        default=DEMO_SYSTEM_PROMPT,
        metadata={"help": "System message placed before every problem; '' for none (the model's default)."},
    )
    accuracy_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Greedy tokens per held-out problem; default: max_completion_length."}
    )
    accuracy_batch_size: int = field(default=50, metadata={"help": "Held-out problems decoded together."})
    accuracy_before: bool = field(default=True, metadata={"help": "Evaluate held-out accuracy before training."})
    accuracy_after: bool = field(default=True, metadata={"help": "Evaluate held-out accuracy after training."})
    metrics_file: str = field(default="metrics.jsonl", metadata={"help": "JSONL metrics file in output_dir."})
    plot_file: str = field(default="training.png", metadata={"help": "PNG plot file in output_dir."})
    timeline_file: str = field(
        default="timeline.png", metadata={"help": "PNG of the last steps of the pipeline's timeline, in output_dir."}
    )
    timeline_steps: int = field(default=20, metadata={"help": "Optimizer steps drawn in the timeline PNG."})


def make_parser() -> TrlParser:
    """TRL's parser over (DemoArguments, AsyncA3POConfig, ModelConfig), with this script's defaults."""
    parser = TrlParser((DemoArguments, AsyncA3POConfig, ModelConfig))
    parser.set_defaults(**demo_defaults())
    return parser


def load_data(demo_args: DemoArguments):
    """(train, held-out) datasets with ``prompt``/``question``/``answer`` columns."""
    system_prompt = demo_args.system_prompt or None
    if demo_args.dataset == "builtin":
        difficulty = int(demo_args.difficulty) if demo_args.difficulty.isdigit() else demo_args.difficulty
        return make_math_splits(
            demo_args.num_train, demo_args.num_eval, difficulty, demo_args.dataset_seed, system_prompt=system_prompt
        )
    source = "openai/gsm8k" if demo_args.dataset == "gsm8k" else demo_args.dataset
    train = load_gsm8k(source, split="train", system_prompt=system_prompt)
    try:
        held_out = load_gsm8k(source, split="test", system_prompt=system_prompt)
        if Path(source).is_file():  # a single file holds one split: carve the held-out problems out of it
            raise ValueError(source)
    except ValueError:
        parts = train.train_test_split(test_size=demo_args.num_eval, seed=demo_args.dataset_seed)
        train, held_out = parts["train"], parts["test"]
    train = train.shuffle(seed=demo_args.dataset_seed).select(range(min(demo_args.num_train, len(train))))
    held_out = held_out.shuffle(seed=demo_args.dataset_seed).select(range(min(demo_args.num_eval, len(held_out))))
    return train, held_out


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log entry (with its step) to a JSONL file, on the main process only."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            write_jsonl(self.path, {"step": state.global_step, **logs})


def write_jsonl(path: Path, record: dict) -> None:
    """Append one JSON record to ``path``."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=float) + "\n")


def strip_quantization_config(model_dir: str) -> None:
    """Remove a leftover ``quantization_config`` from a fully fine-tuned model's saved config.json."""
    config_path = Path(model_dir) / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.pop("quantization_config", None) is not None:
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _accuracy(trainer, dataset, demo_args, training_args, label: str) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = evaluate_accuracy(
        model,
        trainer.processing_class,
        dataset,
        max_new_tokens=demo_args.accuracy_max_new_tokens or training_args.max_completion_length,
        batch_size=demo_args.accuracy_batch_size,
    )
    print(
        f"[accuracy {label}] {result['accuracy']:.1%} +- {result['stderr']:.1%} "
        f"({result['num_correct']}/{result['count']} held-out problems, {result['seconds']:.0f} s)",
        flush=True,
    )
    return result


def main(demo_args: DemoArguments, training_args: AsyncA3POConfig, model_args: ModelConfig) -> dict:
    """Evaluate, train, evaluate, save; returns the summary written to ``results.json`` (main process)."""
    started, started_cpu = time.perf_counter(), time.process_time()
    run_start = _run_start()
    model_path = resolve_model_path(model_args.model_name_or_path)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    train_dataset, eval_dataset = load_data(demo_args)
    trainer = AsyncA3POTrainer(
        model=model_path,
        reward_funcs=[correctness_reward, format_reward],
        args=training_args,
        train_dataset=train_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    accelerator = trainer.accelerator
    is_main = accelerator.is_main_process
    output_dir = Path(training_args.output_dir)
    metrics_path = output_dir / demo_args.metrics_file
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)
        method = f"LoRA r={model_args.lora_r}" if model_args.use_peft else "full fine-tuning"
        print(
            f"Model {model_args.model_name_or_path} ({method}), {len(train_dataset)} training / {len(eval_dataset)} "
            f"held-out problems, {accelerator.num_processes} process(es) on {accelerator.device}, "
            f"{training_args.max_steps} steps, seed {training_args.seed}",
            flush=True,
        )
    trainer.add_callback(JsonlMetricsCallback(metrics_path))

    evaluations = {}
    if is_main and demo_args.accuracy_before:
        evaluations["before"] = _accuracy(trainer, eval_dataset, demo_args, training_args, "before")
        write_jsonl(metrics_path, {"step": 0, "label": "before", **_record(evaluations["before"])})
    accelerator.wait_for_everyone()

    train_started = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - train_started
    print(
        f"[rank {accelerator.process_index}/{accelerator.num_processes}] training done: "
        f"global_step={trainer.state.global_step}",
        flush=True,
    )

    if is_main and demo_args.accuracy_after:
        evaluations["after"] = _accuracy(trainer, eval_dataset, demo_args, training_args, "after")
        write_jsonl(
            metrics_path, {"step": trainer.state.global_step, "label": "after", **_record(evaluations["after"])}
        )
    accelerator.wait_for_everyone()

    trainer.save_model(training_args.output_dir)
    summary = {}
    if is_main:
        if not model_args.use_peft:
            strip_quantization_config(training_args.output_dir)
        plot_path = plot_training(metrics_path, output_dir / demo_args.plot_file, title="A-3PO on math problems")
        summary = _summary(
            evaluations, trainer, training_args, model_args, demo_args, started, started_cpu, train_seconds
        )
        summary["plot"], summary["model_dir"], summary["metrics"] = str(plot_path), str(output_dir), str(metrics_path)
        block = _provenance_block(run_start, trainer)
        if block is not None:  # where and when it ran, as every benchmark record says it
            summary["provenance"] = block
        if training_args.timeline:
            timeline_path = output_dir / demo_args.timeline_file
            summary["timeline"] = trainer.save_timeline(str(timeline_path), last_steps=demo_args.timeline_steps)
        (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        _print_summary(summary)
    accelerator.wait_for_everyone()
    trainer.end()
    return summary


def _run_start():
    """``(start time, load meter, intra-op threads)`` for the summary's provenance block where this checkout's
    ``benchmarks`` package is importable (from the repository root: ``PYTHONPATH=. python examples/train_gsm8k.py``),
    else None."""
    try:
        from benchmarks.common.machine import LoadMeter
    except ImportError:
        return None
    import torch

    return time.time(), LoadMeter().start(), torch.get_num_threads()


def _provenance_block(run_start, trainer) -> dict | None:
    """The provenance block of ``benchmarks/common/provenance.py`` (what the committed demo record carries): the
    start, commit, machine, other processes' share of it (the whole run) and the threads set; None where
    ``benchmarks`` is not importable (:func:`_run_start`)."""
    if run_start is None:
        return None
    from benchmarks.common.provenance import provenance, trainer_threads

    started, meter, process = run_start
    threads = trainer_threads(trainer, process)  # the counts train() set: the user's, or the library's choice
    return provenance(started, threads, meter.stop()["foreign_cpu_frac"])


def _record(result: dict) -> dict:
    keys = ("accuracy", "stderr", "count", "num_correct", "mean_completion_tokens", "seconds")
    return {key: result[key] for key in keys}


def _summary(evaluations, trainer, training_args, model_args, demo_args, started, started_cpu, train_seconds) -> dict:
    summary = {
        "model": model_args.model_name_or_path,
        "lora": bool(model_args.use_peft),
        "dataset": demo_args.dataset,
        "difficulty": demo_args.difficulty,
        "seed": training_args.seed,
        "dataset_seed": demo_args.dataset_seed,
        "global_step": trainer.state.global_step,
        "num_processes": trainer.accelerator.num_processes,
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - started_cpu,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for label, result in evaluations.items():
        summary[label] = {**_record(result), "samples": result["samples"], "correct": result["correct"]}
    if "before" in evaluations and "after" in evaluations:
        summary["paired_test"] = paired_accuracy_test(
            evaluations["before"]["correct"], evaluations["after"]["correct"]
        )
    return summary


def _print_summary(summary: dict) -> None:
    lines = ["", "=" * 72]
    for label in ("before", "after"):
        if label in summary:
            result = summary[label]
            lines.append(
                f"Held-out accuracy {label + ':':7} {result['accuracy']:6.1%} +- {result['stderr']:.1%} "
                f"(n={result['count']})"
            )
    if "paired_test" in summary:
        test = summary["paired_test"]
        lines.append(
            f"Gain: {test['gain']:+.1%} +- {test['stderr']:.1%} (paired; {test['improved']} problems fixed, "
            f"{test['regressed']} broken, McNemar p={test['p_value']:.2g})"
        )
    lines.append(
        f"Run time: {summary['total_seconds'] / 60:.1f} min in total, {summary['train_seconds'] / 60:.1f} min "
        f"training ({summary['global_step']} steps); CPU time {summary['cpu_seconds'] / 60:.1f} min"
    )
    lines.append(f"Plot:    {summary['plot']}")
    lines.append(f"Model:   {summary['model_dir']}{' (LoRA adapter)' if summary['lora'] else ''}")
    lines.append(f"Metrics: {summary['metrics']}")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    demo_args, training_args, model_args = make_parser().parse_args_and_config()
    main(demo_args, training_args, model_args)
