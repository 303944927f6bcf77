"""The arguments of ``a3po-trl grpo``: those of TRL's ``trl grpo`` (its script arguments, ``ModelConfig``, the dataset
mixture and ``GRPOConfig``, read by TRL's ``TrlParser`` from the command line and ``--config`` YAML files), with
``AsyncA3POConfig`` in place of ``GRPOConfig``, so every A-3PO field is a flag and a YAML key too.

As with ``trl grpo``, what the parser does not know is an option of ``accelerate launch`` (``--num_processes 2``,
``--multi_gpu``, ``--config_file``, TRL's ``--accelerate_config zero2``), on the command line or as a YAML key;
anything else is refused here, naming it, before a dataset or a model loads.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from ..config import AsyncA3POConfig

logger = logging.getLogger(__name__)

#: Set by ``a3po-trl grpo`` for the processes it launches: they know the launch options of the YAML file were applied.
LAUNCHED_ENV = "A3PO_TRL_LAUNCHED"

#: TRL's own launcher option: a file, or the name of an accelerate config shipped in ``trl/accelerate_configs``.
ACCELERATE_CONFIG_OPTION = "--accelerate_config"


class CommandLineError(ValueError):
    """A command line or config file the command refuses; the message names the flag or key and the fix."""


@dataclass
class CommandLine:
    """A parsed ``a3po-trl grpo`` command line."""

    script_args: Any
    """TRL's ``GRPOScriptArguments``: ``dataset_name``, ``reward_funcs``, ``reward_model_name_or_path``, ..."""
    training_args: AsyncA3POConfig
    model_args: Any
    """TRL's ``ModelConfig``: ``model_name_or_path``, ``use_peft``, ``lora_r``, ``dtype``, ..."""
    dataset_args: Any
    """TRL's ``DatasetMixtureConfig``: ``datasets`` (``DatasetConfig`` list), ``streaming``, ``test_split_size``."""
    launch_args: list[str]
    """The options for ``accelerate launch``: the config file's, then the command line's (which win)."""
    training_argv: list[str]
    """The arguments the launched processes parse again: the command line without its launch options."""


def make_parser(prog: str = "a3po-trl grpo"):
    """TRL's parser of ``trl grpo`` (``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``,
    ``DatasetMixtureConfig``) with ``AsyncA3POConfig`` as its training arguments, and the fields ``AsyncA3POConfig``
    declares listed in a group of their own, each with its docstring as its help."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    parser = TrlParser(
        (GRPOScriptArguments, AsyncA3POConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description=(
            "TRL's `trl grpo` with AsyncA3POTrainer: the same flags and --config YAML files, plus the A-3PO options "
            "listed last. Trains in this process under `accelerate launch -m a3po_trl.cli grpo ...`; `a3po-trl grpo` "
            "launches it through accelerate, as `trl grpo` does."
        ),
        epilog=(
            "Options not listed here go to `accelerate launch` (--num_processes 2, --multi_gpu, --config_file FILE, "
            "TRL's --accelerate_config zero2, ...), on the command line or as keys of the --config file, as with "
            "`trl grpo`. Under `accelerate launch -m a3po_trl.cli grpo`, put them before -m."
        ),
    )
    group_a3po_options(parser)
    return parser


def a3po_field_names() -> list[str]:
    """The fields ``AsyncA3POConfig`` declares itself: its own, and ``disable_dropout``, whose default it changes."""
    return list(inspect.get_annotations(AsyncA3POConfig))


def parameter_docs(cls: type) -> dict[str, str]:
    """Each parameter's description in a docstring written in TRL's style: ``name (`type`, ...):`` indented under
    ``Parameters:``, then its description indented one level deeper, up to a blank line."""
    docs: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        entry = re.match(r"^ {4}(\w+) \(`", line)
        if entry:
            current = entry.group(1)
            docs[current] = []
        elif current is not None and line.startswith(" " * 8):
            docs[current].append(line.strip())
        else:
            current = None
    return {name: " ".join(lines) for name, lines in docs.items()}


def group_a3po_options(parser: argparse.ArgumentParser) -> None:
    """Move the options of ``AsyncA3POConfig``'s own fields into an "A-3PO options" group of ``--help``, with the
    field's docstring paragraph as help (its metadata help where the docstring has none)."""
    names = set(a3po_field_names())
    docs = parameter_docs(AsyncA3POConfig)
    group = parser.add_argument_group(
        "A-3PO options (AsyncA3POConfig)",
        "Asynchronous generation and the decoupled A-3PO loss; every option above keeps its GRPOConfig meaning.",
    )
    for action in list(parser._actions):
        if action.dest not in names:
            continue
        for other in parser._action_groups:
            if action in other._group_actions:
                other._group_actions.remove(action)
        group._group_actions.append(action)
        if action.option_strings[0].startswith("--no_"):
            action.help = f"Set {action.dest} to False."
        elif action.dest in docs:
            action.help = docs[action.dest].replace("%", "%%")


def launch_options() -> dict[str, argparse.Action | None]:
    """The options ``accelerate launch`` takes (``None`` for TRL's ``--accelerate_config``, which takes one value)."""
    from accelerate.commands.launch import launch_command_parser

    options: dict[str, argparse.Action | None] = {
        name: action
        for name, action in launch_command_parser()._option_string_actions.items()
        if name not in ("-h", "--help", "-m", "--module")
    }
    options[ACCELERATE_CONFIG_OPTION] = None
    return options


def takes_value(action: argparse.Action | None) -> bool:
    return action is None or action.nargs != 0


def parse_command_line(argv: list[str], launching: bool, parser=None) -> CommandLine:
    """Parse ``argv`` (what follows ``grpo``) as ``trl grpo`` does, and refuse what neither the parser nor
    ``accelerate launch`` knows.

    ``launching``: ``a3po-trl grpo``, which passes launch options to ``accelerate launch``. Otherwise the command runs
    in this process (``python -m a3po_trl.cli grpo``, or under ``accelerate launch``): a launch option on the command
    line is refused (it belongs before ``-m``), one in the config file is ignored, as TRL's script ignores it.
    """
    import yaml
    from trl.cli.commands.training import _subtract_subsequence

    parser = parser if parser is not None else make_parser()
    config_path = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    try:
        parsed = parser.parse_args_and_config(argv, return_remaining_strings=True, separate_remaining_strings=True)
    except OSError as error:
        raise CommandLineError(f"--config {config_path}: cannot read the config file ({error}).") from error
    except yaml.YAMLError as error:
        raise CommandLineError(f"--config {config_path}: not a valid YAML file ({error}).") from error
    except ValueError as error:  # a value the dataclasses refuse (AsyncA3POConfig, GRPOConfig, TrainingArguments)
        raise CommandLineError(str(error)) from error
    script_args, training_args, model_args, dataset_args, config_remaining, cli_remaining = parsed
    known = launch_options()
    candidates = [option for option in parser._option_string_actions if option.startswith("--")] + list(known)
    config_launch_args = _config_launch_args(config_remaining, known, candidates, config_path)
    if launching:
        _check_cli_launch_args(cli_remaining, known, candidates)
        launch_args = config_launch_args + cli_remaining  # as trl grpo: the command line comes last, and wins
    else:
        _refuse_cli_launch_args(cli_remaining, known, candidates)
        if config_launch_args and not os.environ.get(LAUNCHED_ENV):
            logger.warning(
                "The config file %s sets options of `accelerate launch` (%s); they apply under `a3po-trl grpo`, which "
                "launches the processes, and are ignored here: pass them to `accelerate launch` before `-m`.",
                config_path,
                " ".join(config_launch_args),
            )
        launch_args = []
    return CommandLine(
        script_args=script_args,
        training_args=training_args,
        model_args=model_args,
        dataset_args=dataset_args,
        launch_args=launch_args,
        training_argv=_subtract_subsequence(argv, cli_remaining),
    )


def _suggestion(flag: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(flag, candidates, n=3, cutoff=0.75)
    return f" Did you mean {' or '.join(close)}?" if close else ""


def _config_launch_args(
    remaining: list[str], known: dict[str, argparse.Action | None], candidates: list[str], config_path: str | None
) -> list[str]:
    """The keys of the config file that the parser left (``["--key", "value", ...]``, as ``TrlParser`` returns them),
    as ``accelerate launch`` options; a key it does not know either is refused. A switch (``multi_gpu: true``) becomes
    the bare flag, and is dropped when false."""
    launch_args = []
    for flag, value in zip(remaining[::2], remaining[1::2]):
        if flag not in known:
            key = flag[2:]
            close = difflib.get_close_matches(flag, candidates, n=3, cutoff=0.75)
            hint = f" Did you mean {' or '.join(c[2:] for c in close)}?" if close else ""
            raise CommandLineError(
                f"The config file {config_path} sets `{key}`, which is neither an option of a3po-trl grpo (a field "
                f"of AsyncA3POConfig / GRPOConfig, ModelConfig, the script or dataset-mixture arguments) nor one of "
                f"`accelerate launch`.{hint} Fix its spelling or remove it (`a3po-trl grpo --help` lists the options)."
            )
        if takes_value(known[flag]):
            launch_args += [flag, value]
        elif value.lower() in ("true", "1", "yes"):
            launch_args.append(flag)
    return launch_args


def _unknown_option_error(token: str, candidates: list[str]) -> CommandLineError:
    flag = token.split("=", 1)[0]
    if not flag.startswith("-"):
        return CommandLineError(
            f"Unexpected argument {token!r}: a3po-trl grpo takes only options (--name value). If it is the value of "
            "the option before it, check that option's spelling; `a3po-trl grpo --help` lists the options."
        )
    return CommandLineError(
        f"Unknown option {flag}: neither an option of a3po-trl grpo (a field of AsyncA3POConfig / GRPOConfig, "
        f"ModelConfig, the script or dataset-mixture arguments) nor one of `accelerate launch`."
        f"{_suggestion(flag, candidates)} `a3po-trl grpo --help` lists the options."
    )


def _check_cli_launch_args(tokens: list[str], known: dict[str, argparse.Action | None], candidates: list[str]) -> None:
    """Refuse a token of the command line that is neither an ``accelerate launch`` option nor a value of one."""
    values_left = 0
    for token in tokens:
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            if flag not in known:
                raise _unknown_option_error(token, candidates)
            action = known[flag]
            values_left = 0 if "=" in token or not takes_value(action) else _value_count(action)
        elif values_left:
            values_left -= 1
        else:
            raise _unknown_option_error(token, candidates)


def _value_count(action: argparse.Action | None) -> int:
    """How many bare tokens after a launch option are its values."""
    if action is None or action.nargs in (None, "?"):
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    return sys.maxsize  # "+", "*": any number of values


def _refuse_cli_launch_args(
    tokens: list[str], known: dict[str, argparse.Action | None], candidates: list[str]
) -> None:
    """In-process run: an ``accelerate launch`` option on the command line came after ``-m a3po_trl.cli``."""
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in known:
            raise CommandLineError(
                f"{flag} is an option of `accelerate launch`, not of the training program: put it before "
                f"`-m a3po_trl.cli` (accelerate launch {token} ... -m a3po_trl.cli grpo ...), or run "
                "`a3po-trl grpo`, which passes it to accelerate launch."
            )
        raise _unknown_option_error(token, candidates)


def accelerate_config_argument(launch_args: list[str]) -> list[str]:
    """TRL's ``--accelerate_config NAME`` (a file, or a config shipped with TRL) as ``--config_file PATH``."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    try:
        return resolve_accelerate_config_argument(launch_args)
    except ValueError as error:
        raise CommandLineError(f"{ACCELERATE_CONFIG_OPTION}: {error}") from error
