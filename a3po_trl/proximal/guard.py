"""``prox_logp_method="guarded"``: A-3PO's interpolation, checked every ``prox_check_interval`` generation batches
against its exact target (the log-probs of the version one before the trained weights:
:mod:`a3po_trl.proximal.previous_weights`), and the recomputed anchor while the check's error, relative to one
optimizer step's drift (:func:`~a3po_trl.functional.interpolation_check_sums`), exceeds ``prox_error_budget``. The
state goes into every checkpoint, one file per process. What it measures, decides and costs: docs/ARCHITECTURE.md,
"The guarded proximal method".
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from ..functional import interpolation_check_sums, interpolation_check_verdict
from ..generation.schedule import PlannedBatch, micro_step_after
from ..runtime.timing import IntervalTimer
from .previous_weights import PreviousVersionWeights

logger = logging.getLogger(__name__)

STATE_FILE = "a3po_proximal_guard-rank{rank}.json"
WEIGHTS_FILE = "a3po_proximal_guard_weights-rank{rank}.pt"


class ProximalGuard:
    """The guard's state and decisions (see the module's doc); one per trainer, used by the training thread only."""

    def __init__(self, interval: int, budget: float):
        self.interval = interval
        self.budget = budget
        self.recompute = False
        """Whether the batches taken from now on train with the recomputed anchor."""
        self.checking = False
        """Whether the batch in training is checked."""
        self.checks = 0
        """Checks settled that measured at least one token."""
        self.switches = 0
        self.last_error: float | None = None
        self.last_relative: float | None = None
        self.previous = PreviousVersionWeights()
        self.timer = IntervalTimer()
        self._pending: torch.Tensor | None = None
        self._checked_versions: frozenset[int] = frozenset()
        self._batches_per_epoch = 1
        self._warned_still = False

    # ---- the schedule ------------------------------------------------------------------------------------------
    def batch_number(self, planned: PlannedBatch) -> int:
        """The generation batch's number counted from the first batch of the first epoch."""
        return self._number(planned.epoch, planned.index_in_epoch)

    def _number(self, epoch: int, index_in_epoch: int) -> int:
        return epoch * self._batches_per_epoch + index_in_epoch

    def is_checked(self, planned: PlannedBatch) -> bool:
        return self._is_checked_number(self.batch_number(planned))

    def _is_checked_number(self, number: int) -> bool:
        """Whether the batch numbered ``number`` (:meth:`batch_number`) is checked: batches 1, 1 + interval, ..."""
        return number >= 1 and (number - 1) % self.interval == 0

    def start_run(self, plan, steps_in_epoch: int) -> None:
        """Read the run's plan: which versions train checked batches, and the version just past the run's end if
        the micro-step after its last one (where a run continued with a larger ``max_steps`` goes on) trains a
        checked batch: the run's last step then keeps the weights that check needs, for the checkpoint written at
        the end."""
        per_batch = plan.micro_steps_per_batch
        self._batches_per_epoch = max(1, math.ceil(steps_in_epoch / per_batch))
        checked = {
            version
            for batch in plan.batches
            if self.is_checked(batch)
            for version in range(batch.first_version, batch.last_version + 1)
        }
        if plan.micro_steps:
            following = micro_step_after(plan.micro_steps[-1], steps_in_epoch)
            if self._is_checked_number(self._number(following.epoch, following.position // per_batch)):
                checked.add(following.version)
        self._checked_versions = frozenset(checked)

    def keep_if_due(self, model: torch.nn.Module, version: int) -> None:
        """On the last micro-step of version ``version``, before its forward: keep its trainable weights if the next
        version trains a checked batch (its micro-steps need them), else free what was kept."""
        if version + 1 in self._checked_versions:
            self.previous.keep(model, version)
        else:
            self.previous.forget()

    def end_run(self) -> None:
        """When ``train()`` returns or raises: free the kept weights (a checkpoint written at the run's end holds
        them; a later ``train()`` call starts from a checkpoint or from scratch)."""
        self.previous.forget()

    # ---- a batch ----------------------------------------------------------------------------------------------
    def begin_batch(self, planned: PlannedBatch, accelerator) -> dict[str, float]:
        """When the trainer takes a batch: settle the check in progress, if any (on every process together), and
        return the settled check's metrics; from then on ``recompute`` is the anchor the batch trains with and
        ``checking`` whether it is checked. The first batch of a run resumed inside it (``first_offset > 0``) settles
        nothing: the check in progress is its own, restored from the checkpoint, and settles with the next batch, over
        all its micro-steps, as in the uninterrupted run."""
        resumed_inside = planned.first_offset > 0
        metrics = self._settle(accelerator) if self._pending is not None and not resumed_inside else {}
        self.checking = self.is_checked(planned)
        return metrics

    def reference(self, trainer, model, inputs: dict) -> torch.Tensor | None:
        """Before a training micro-step's forward: the exact target's log-probs of its micro-batch if its batch is
        checked (``None`` for other micro-batches, and for a micro-step whose version before it was not kept, e.g.
        version 0); then, on the last micro-step of an optimizer step (the weights are still this version's:
        DeepSpeed steps its optimizer inside the backward that follows), keep them if the next step is checked."""
        version = trainer.state.global_step
        logps = None
        if self.checking and self.previous.version == version - 1:
            with self.timer.time(trainer.accelerator.device):
                logps = self.previous.logps(trainer, model, inputs, trainer._unwrapped_model())
        if trainer.accelerator.sync_gradients:
            self.keep_if_due(trainer._unwrapped_model(), version)
        return logps

    def add(self, loglinear, current, exact, staleness, mask) -> None:
        """Add one checked micro-batch's sums to the check in progress (on the device: nothing waits)."""
        sums = interpolation_check_sums(loglinear, current, exact, staleness, mask)
        self._pending = sums if self._pending is None else self._pending + sums

    def _settle(self, accelerator) -> dict[str, float]:
        sums, self._pending = self._pending, None
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
        error, relative, exceeds = interpolation_check_verdict(sums.tolist(), self.budget)
        if error is None:  # no token of staleness >= 1 in the checked batch: nothing measured
            return {}
        if exceeds is None:  # the step moved no checked token: no scale to judge the error by, the anchor stays
            if not self._warned_still:
                self._warned_still = True
                logger.info(
                    "prox_logp_method='guarded': a check found that the optimizer step moved none of its tokens' "
                    "log-probs (advantages all 0, or a learning rate of 0): its error (%.3g nats per token) has no "
                    "step's drift to be measured against, so it decides nothing and the anchor in use stays.",
                    error,
                )
            return {"a3po/prox_check_error": error}
        self.checks += 1
        if exceeds != self.recompute:
            self.switches += 1
            logger.info(
                "prox_logp_method='guarded': the interpolation's check measured %.3g nats per token, %.2f of one "
                "optimizer step's drift (budget %.2f): training with the %s anchor from the next batch on.",
                error,
                relative,
                self.budget,
                "recomputed" if exceeds else "interpolated",
            )
        self.recompute, self.last_error, self.last_relative = exceeds, error, relative
        return {"a3po/prox_check_error": error, "a3po/prox_check_error_relative": relative}

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "recompute": self.recompute,
            "checks": self.checks,
            "switches": self.switches,
            "last_error": self.last_error,
            "last_relative": self.last_relative,
            "pending": None if self._pending is None else self._pending.tolist(),
            "kept_version": self.previous.version,
        }

    def save(self, directory: str, process_index: int) -> None:
        """Write this process's state (and the kept weights, when a checked micro-step follows) into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        if self.previous.version is not None:
            torch.save(self.previous.state(), os.path.join(directory, WEIGHTS_FILE.format(rank=process_index)))
        with open(os.path.join(directory, STATE_FILE.format(rank=process_index)), "w") as file:
            json.dump(self.state_dict(), file)

    def load(self, directory: str, process_index: int, device) -> None:
        """Take back what :meth:`save` wrote into ``directory`` (the check in progress onto ``device``); a checkpoint
        without it leaves the guard as it is, with a warning."""
        path = os.path.join(directory, STATE_FILE.format(rank=process_index))
        if not os.path.exists(path):
            logger.warning(
                "Resuming from %s, which holds no state of prox_logp_method='guarded' (written by another method): "
                "the guard starts again from the interpolation.",
                directory,
            )
            return
        with open(path) as file:
            state = json.load(file)
        self.recompute, self.checks, self.switches = state["recompute"], state["checks"], state["switches"]
        self.last_error, self.last_relative = state["last_error"], state["last_relative"]
        pending = None if state["pending"] is None else torch.tensor(state["pending"], dtype=torch.float64)
        self._pending = None if pending is None else pending.to(device)
        if state["kept_version"] is not None:
            weights = os.path.join(directory, WEIGHTS_FILE.format(rank=process_index))
            kept = torch.load(weights, map_location="cpu", weights_only=True)
            self.previous.load_state(kept)
