"""``a3po-trl grpo``: TRL's ``trl grpo`` training script with ``AsyncA3POTrainer``.

Two ways in, as with TRL: ``a3po-trl grpo ...`` checks the arguments, the rewards and the dataset, then launches the
training program through ``accelerate launch`` (with the launch options it was given: ``--num_processes 2``, ...),
as ``trl grpo`` launches ``trl/scripts/grpo.py``; ``accelerate launch ... -m a3po_trl.cli grpo ...`` (or ``python -m
a3po_trl.cli grpo ...``) is that program: it checks the same, then trains in this process. The steps of training
follow the installed TRL's script (``trl/scripts/grpo.py``'s ``main``): the model's init arguments, the quantization
and PEFT configs of ``ModelConfig``, ``train(resume_from_checkpoint=...)``, ``save_model``, ``push_to_hub``,
``end()``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any

from .arguments import LAUNCHED_ENV, CommandLine, CommandLineError, accelerate_config_argument, parse_command_line
from .data import load_training_data
from .rewards import resolve_rewards


def say(message: str) -> None:
    """A progress line, from the first process only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[a3po-trl grpo] {message}", flush=True)


@dataclass
class Inputs:
    """What the trainer receives besides its arguments, resolved before any model loads."""

    reward_funcs: list
    train_dataset: Any
    eval_dataset: Any


def check_model_name_or_path(name: str) -> None:
    """Refuse a ``--model_name_or_path`` that is neither a local folder nor a Hub id, before anything launches.

    An existing folder passes. A name that looks like a path (starting with ``/``, ``./``, ``../`` or ``~``, with more
    than the one ``/`` of ``org/name``, or naming a file) is refused when it is no folder. Anything else must have the
    form of a Hub id (``name`` or ``org/name``), checked offline (``huggingface_hub``'s ``validate_repo_id``): whether
    the Hub, or its local cache, holds it is found out when the model loads."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return
    refused = f"--model_name_or_path {name}: no such model directory or Hub id"
    fix = "Pass a folder written by save_pretrained, or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct."
    separators = [sep for sep in (os.sep, os.altsep) if sep and sep != "/"]
    looks_like_a_path = (
        name.startswith(("/", "~", "./", "../"))
        or name in (".", "..")
        or name.count("/") > 1
        or any(sep in name for sep in separators)
        or os.path.exists(path)
    )
    if looks_like_a_path:
        found = "a file, not a folder" if os.path.exists(path) else f"no such folder (from {os.getcwd()})"
        raise CommandLineError(f"{refused}: {found}. {fix}")
    try:
        validate_repo_id(name)
    except HFValidationError as error:
        raise CommandLineError(
            f"{refused}: no folder of that name in {os.getcwd()}, and not a valid Hub id ({error}). {fix}"
        ) from None


def prepare(command_line: CommandLine) -> Inputs:
    """Resolve the rewards and load the dataset, refusing what cannot train (no model, a model that is neither a
    folder nor a Hub id, a reward name that resolves to nothing, no dataset, a missing split or ``prompt`` column) with
    the flag and the fix; loads no model."""
    if not command_line.model_args.model_name_or_path:
        raise CommandLineError(
            "No model: pass --model_name_or_path (a Hub id such as Qwen/Qwen2.5-0.5B-Instruct, or a local folder "
            "written by save_pretrained), on the command line or in the --config file."
        )
    check_model_name_or_path(command_line.model_args.model_name_or_path)
    script_args = command_line.script_args
    reward_funcs = resolve_rewards(script_args.reward_model_name_or_path, script_args.reward_funcs)
    say(f"rewards: {', '.join(getattr(r, '__name__', str(r)) for r in reward_funcs)}")
    say("loading the dataset")
    evaluate = command_line.training_args.eval_strategy != "no"
    train_dataset, eval_dataset = load_training_data(script_args, command_line.dataset_args, evaluate)
    size = f"{len(train_dataset)} rows" if hasattr(train_dataset, "__len__") else "streaming"
    say(f"training data: {size}, columns {list(train_dataset.column_names or [])}")
    return Inputs(reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset)


def train(command_line: CommandLine, inputs: Inputs):
    """Train, save (and push) as ``trl grpo`` does, with ``AsyncA3POTrainer``. Returns the trainer."""
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from ..trainer import AsyncA3POTrainer

    script_args, training_args, model_args = (
        command_line.script_args,
        command_line.training_args,
        command_line.model_args,
    )
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    say(f"loading the model {model_args.model_name_or_path}")
    trainer = AsyncA3POTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=inputs.reward_funcs,
        args=training_args,
        train_dataset=inputs.train_dataset,
        eval_dataset=inputs.eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return trainer


def run(argv: list[str]) -> int:
    """The training program (``python -m a3po_trl.cli grpo``, one process of ``accelerate launch``): check, then
    train in this process."""
    command_line = parse_command_line(argv, launching=False)
    train(command_line, prepare(command_line))
    return 0


def launch(argv: list[str]) -> int:
    """``a3po-trl grpo``: check everything that can be checked without a model, then run the training program under
    ``accelerate launch`` with the launch options of the config file and the command line. Returns the exit status
    of the launch."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    command_line = parse_command_line(argv, launching=True)
    launch_args = accelerate_config_argument(command_line.launch_args)
    prepare(command_line)
    accelerate_args = launch_command_parser().parse_args(
        [*launch_args, "-m", "a3po_trl.cli", "grpo", *command_line.training_argv]
    )
    say(f"launching: accelerate launch {' '.join(launch_args)} -m a3po_trl.cli grpo ...".replace("  ", " "))
    previous = os.environ.get(LAUNCHED_ENV)
    os.environ[LAUNCHED_ENV] = "1"  # the launched processes inherit it: the YAML's launch options were applied
    try:
        launch_command(accelerate_args)
    except subprocess.CalledProcessError as error:  # the training process printed its error already
        return error.returncode
    finally:
        if previous is None:
            del os.environ[LAUNCHED_ENV]
        else:
            os.environ[LAUNCHED_ENV] = previous
    return 0
