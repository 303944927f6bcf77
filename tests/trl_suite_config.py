"""Configs for running TRL's own GRPO test suite (../shared/trl_suite/run.sh) against AsyncA3POTrainer.

The harness rebinds ``GRPOConfig`` in TRL's test module; ``--config trl_suite_config:AsyncA3POConfigStaleness2``
(with this folder on ``PYTHONPATH``) runs every test with a staleness bound of 2 instead of the derived default.
Not a test module: pytest does not collect it.
"""

from dataclasses import dataclass

from a3po_trl import AsyncA3POConfig


@dataclass
class AsyncA3POConfigStaleness2(AsyncA3POConfig):
    """``AsyncA3POConfig`` whose ``max_staleness``, when left unset, is 2: the generator may run two optimizer steps
    ahead. A batch schedule that trains one batch over more steps (the tests do not set ``max_staleness``) gets what
    it needs instead, as the derived default does."""

    def __post_init__(self):
        unset = self.max_staleness is None
        super().__post_init__()  # derives max_staleness = span when unset, after checking the batch schedule
        if unset:
            self.max_staleness = max(2, self.versions_spanned_per_generation_batch - 1)
