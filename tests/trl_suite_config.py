"""Configs for running TRL's own GRPO test suite (../shared/trl_suite/run.sh) against AsyncA3POTrainer.

The harness rebinds ``GRPOConfig`` in TRL's test module; ``--config trl_suite_config:AsyncA3POConfigStaleness2``
(with this folder on ``PYTHONPATH``) runs every test with ``max_staleness=2`` instead of the derived default. Not a
test module: pytest does not collect it.
"""

from dataclasses import dataclass, field

from a3po_trl import AsyncA3POConfig


@dataclass
class AsyncA3POConfigStaleness2(AsyncA3POConfig):
    """``AsyncA3POConfig`` whose ``max_staleness`` defaults to 2: the generator may run two optimizer steps ahead."""

    max_staleness: int | None = field(default=2, metadata={"help": "Largest allowed staleness (default 2 here)."})
