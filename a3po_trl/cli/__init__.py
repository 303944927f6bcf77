"""The command line of a3po-trl: ``a3po-trl grpo``, TRL's ``trl grpo`` (the same flags and ``--config`` YAML files,
plus every ``AsyncA3POConfig`` field) training with ``AsyncA3POTrainer``.

``a3po-trl grpo ...`` (:func:`main`, the console script) launches the training program through ``accelerate
launch``, as ``trl grpo`` does; ``accelerate launch [options] -m a3po_trl.cli grpo ...`` and ``python -m a3po_trl.cli
grpo ...`` (:func:`run`) are that program. An argument the command refuses ends it with exit status 2 and a message
naming the flag and the fix, before any model loads.
"""

from __future__ import annotations

import argparse
import sys

from .arguments import CommandLineError, make_parser, parse_command_line

COMMANDS = {"grpo": "Train with GRPO's arguments and AsyncA3POTrainer (`a3po-trl grpo --help` lists the options)"}


def _dispatch(argv: list[str] | None, launching: bool) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="a3po-trl", description="Asynchronous RL post-training with A-3PO: TRL's commands, AsyncA3POTrainer."
    )
    subcommands = top.add_subparsers(dest="command", metavar="{grpo}")
    for name, help_text in COMMANDS.items():
        subcommands.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv[:1])  # --help, or an unknown command: argparse prints and exits
        top.print_help()
        return 0
    from . import grpo

    try:
        return grpo.launch(argv[1:]) if launching else grpo.run(argv[1:])
    except CommandLineError as error:
        print(f"a3po-trl {argv[0]}: error: {error}", file=sys.stderr, flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    """The ``a3po-trl`` console script: ``a3po-trl grpo ...`` checks its arguments, then launches the training
    program through ``accelerate launch``."""
    return _dispatch(argv, launching=True)


def run(argv: list[str] | None = None) -> int:
    """``python -m a3po_trl.cli grpo ...`` (one process of ``accelerate launch -m a3po_trl.cli grpo ...``): checks its
    arguments, then trains in this process."""
    return _dispatch(argv, launching=False)


__all__ = ["CommandLineError", "main", "make_parser", "parse_command_line", "run"]
