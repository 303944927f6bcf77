"""Train a small LM to use a calculator tool on math word problems: multi-turn A-3PO rollouts, offline on CPU.

The model (SmolLM2-135M-Instruct, LoRA) may call `calculator(expression)`; the tool's result is appended to the
conversation and the model continues, all in the generation thread, overlapping training. Tool-result tokens are
masked out of the loss, and every generated token records the weight version that generated it (a trajectory whose
turns span an update is staled token by token). Rewards: `correctness_reward` (1.0 for the right final number) and
`tool_use_reward` (0.2 for at least one calculator call that returned a value), weighted 1.0 and 1.0. Each prompt
carries one worked example (a call, its result, the answer) and a cue, without which the 135M model almost never
writes a well-formed call.

    python examples/train_calculator_agent.py --output_dir outputs/agent
    # the same run with synchronous generation
    python examples/train_calculator_agent.py --async_generation false
    accelerate launch --multi_gpu --num_processes 2 examples/train_calculator_agent.py --use_cpu --max_steps 2 \
        --per_device_train_batch_size 4

SmolLM2's own chat template has no tool syntax, so the prompts are rendered with Qwen3's ChatML tool template (TRL
ships it and parses its `<tool_call>` blocks); SmolLM2's `<|im_start|>`/`<|im_end|>` tokens are the ones it uses.
Measured on 2 CPU cores (seed 42): 59.0 s/step with the generation thread, 69.1 s/step synchronous
(docs/BENCHMARKS.md). Every `AsyncA3POConfig` and `trl.ModelConfig` field is a command-line flag, as in
`train_gsm8k.py`. The output directory gets the LoRA adapter, `metrics.jsonl` and `results.json` (seconds per
step, tool calls, rewards).
"""

from __future__ import annotations

import ast
import json
import operator
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from train_gsm8k import JsonlMetricsCallback
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.tasks import make_math_splits
from a3po_trl.tasks.demo_settings import demo_defaults
from a3po_trl.tasks.offline_model import resolve_model_path
from a3po_trl.tasks.rewards import correctness_reward

SYSTEM_PROMPT = "Use the calculator tool for arithmetic. End your final answer with '#### <number>'."
#: Appended to every problem: without it (and the worked example below) SmolLM2-135M almost never writes a tool call
#: (log-prob of "<tool_call>" as its first tokens: -5 to -10); with both, about a third of its samples at
#: temperature 0.7 are well-formed calls.
CUE = "\nUse the calculator. Start your reply with <tool_call>"
#: One worked example, as conversation turns before the problem: a call, its result, the final answer.
WORKED_EXAMPLE = [
    {"role": "user", "content": "A book costs $12. How many dollars do 3 books cost?" + CUE},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 3"}}}
        ],
    },
    {"role": "tool", "name": "calculator", "content": "36"},
    {"role": "assistant", "content": "3 books cost 12 * 3 = 36 dollars.\n#### 36"},
]
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / and parentheses, e.g. "12 * (3 + 4)".

    Returns:
        The value of the expression.
    """

    def evaluate(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    value = evaluate(ast.parse(str(expression), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def tool_use_reward(completions, **kwargs) -> list[float]:
    """0.2 for a trajectory with at least one tool call that returned a value (not an error), else 0.0."""
    rewards = []
    for completion in completions:
        messages = completion if isinstance(completion, list) else []
        used = any(m.get("role") == "tool" and not str(m.get("content")).startswith("{'error'") for m in messages)
        rewards.append(0.2 if used else 0.0)
    return rewards


@dataclass
class AgentArguments:
    """Data options of the example (the training options are `AsyncA3POConfig`'s)."""

    num_train: int = field(default=1000, metadata={"help": "Number of generated training problems."})
    difficulty: str = field(default="basic", metadata={"help": "basic (one step), easy, medium, hard, or 0-5."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the generated problems."})


def agent_defaults(argv: list[str] | None = None) -> dict:
    """`train_gsm8k.py`'s CPU-friendly defaults, with room for a tool call and its result in the completion."""
    defaults = demo_defaults(argv)
    defaults.update(
        output_dir="outputs/train_calculator_agent",
        max_steps=20,
        max_completion_length=128,
        temperature=0.7,  # explore calls to the tool
        reward_weights=[1.0, 1.0],
        max_tool_calling_iterations=2,
        tool_call_timeout=10.0,
    )
    return defaults


def tool_tokenizer(model_path: str):
    """The model's tokenizer, rendering with Qwen3's ChatML tool template (see the module doc)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return tokenizer


def with_worked_example(row: dict) -> dict:
    """The problem's prompt as: system message, the worked example, the problem with the cue."""
    system, *rest = row["prompt"]
    *earlier, question = rest
    return {"prompt": [system, *WORKED_EXAMPLE, *earlier, {**question, "content": question["content"] + CUE}]}


def main(agent_args: AgentArguments, training_args: AsyncA3POConfig, model_args: ModelConfig) -> dict:
    model_path = resolve_model_path(model_args.model_name_or_path)
    difficulty = int(agent_args.difficulty) if agent_args.difficulty.isdigit() else agent_args.difficulty
    train_dataset, _ = make_math_splits(
        agent_args.num_train, 1, difficulty, agent_args.dataset_seed, system_prompt=SYSTEM_PROMPT
    )
    train_dataset = train_dataset.map(with_worked_example)
    trainer = AsyncA3POTrainer(
        model=model_path,
        reward_funcs=[correctness_reward, tool_use_reward],
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tool_tokenizer(model_path),
        peft_config=get_peft_config(model_args),
        tools=[calculator],
    )
    output_dir = Path(training_args.output_dir)
    is_main = trainer.accelerator.is_main_process
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        mode = "asynchronous" if training_args.async_generation else "synchronous"
        print(
            f"Calculator agent: {model_args.model_name_or_path}, {training_args.max_steps} steps, {mode} generation, "
            f"{trainer.accelerator.num_processes} process(es), seed {training_args.seed}",
            flush=True,
        )
    trainer.add_callback(JsonlMetricsCallback(output_dir / "metrics.jsonl"))
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.save_model(training_args.output_dir)
    summary = {}
    if is_main:
        summary = _summary(trainer, training_args, seconds)
        (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(summary, indent=2), flush=True)
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return summary


def _summary(trainer, training_args, seconds: float) -> dict:
    history = trainer.state.log_history

    def values(key):
        return [entry[key] for entry in history if key in entry]

    step_times = values("step_time")
    return {
        "steps": trainer.state.global_step,
        "async_generation": training_args.async_generation,
        "seed": training_args.seed,
        "train_seconds": seconds,
        "seconds_per_step_median": statistics.median(step_times) if step_times else None,
        "tool_calls_per_trajectory": statistics.fmean(values("tools/call_frequency")),
        "tool_failures_per_call": statistics.fmean(values("tools/failure_frequency")),
        "turns_per_trajectory": statistics.fmean(values("tools/turns_mean")),
        "correctness_first_last": [values("rewards/correctness_reward/mean")[i] for i in (0, -1)],
        "tool_use_first_last": [values("rewards/tool_use_reward/mean")[i] for i in (0, -1)],
    }


if __name__ == "__main__":
    parser = TrlParser((AgentArguments, AsyncA3POConfig, ModelConfig))
    parser.set_defaults(**agent_defaults(sys.argv[1:]))
    main(*parser.parse_args_and_config())
