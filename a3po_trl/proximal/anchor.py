"""The one object the loss asks for a micro-batch's proximal log-probs: :class:`ProximalAnchor`."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..functional import approximate_proximal_logps
from ..metrics.loss import approximation_error_metrics
from ..runtime.timing import IntervalTimer
from ..timeline import TRAINING_LANE
from .guard import ProximalGuard
from .methods import PROXIMAL_METHOD_TABLE, ProximalMethod, batch_method, needs_recompute_forward


class Anchor(NamedTuple):
    """A micro-batch's proximal log-probs, as its batch's method computes them."""

    proximal: torch.Tensor
    """What the loss trains with."""
    loglinear: torch.Tensor | None
    """A-3PO's interpolation, where the method computes it (trained with, or measured)."""


class ProximalAnchor:
    """The proximal log-probs of decoupled PPO for the trainer's micro-batches, by ``prox_logp_method`` (see
    docs/ARCHITECTURE.md, "The proximal anchor").

    Per generation batch (:meth:`begin_batch`, when the trainer takes it) the method it trains with, which under
    ``guarded`` the guard chooses (:attr:`guard`); before a micro-step's forward (:meth:`prepare`) the recompute
    forward where the batch needs it and the guard's exact reference; after it (:meth:`of`) the anchor, and the
    metrics of what it cost and measured (:meth:`metrics`). The cost of the proximal log-probs is ``a3po/prox_time``
    (device time, read at log time)."""

    def __init__(self, method: str, check_interval: int = 1, error_budget: float = 1.0):
        self.method = method
        self.guard: ProximalGuard | None = ProximalGuard(check_interval, error_budget) if method == "guarded" else None
        """The interpolation's checks and the anchor they chose, with ``prox_logp_method="guarded"``."""
        self.timer = IntervalTimer()
        """The seconds the proximal log-probs took since the last micro-step's metrics (``a3po/prox_time``)."""

    @classmethod
    def from_config(cls, args) -> ProximalAnchor:
        return cls(args.prox_logp_method, args.prox_check_interval, args.prox_error_budget)

    @property
    def batch_method(self) -> str:
        """The entry of :data:`~a3po_trl.proximal.PROXIMAL_METHOD_TABLE` the batch in training trains with."""
        return batch_method(self.method, self.guard is not None and self.guard.recompute)

    @property
    def entry(self) -> ProximalMethod:
        return PROXIMAL_METHOD_TABLE[self.batch_method]

    # ---- a run, a batch ----------------------------------------------------------------------------------------
    def start_run(self, plan, steps_in_epoch: int) -> None:
        """Read the run's plan (which batches the guard checks)."""
        if self.guard is not None:
            self.guard.start_run(plan, steps_in_epoch)

    def end_run(self) -> None:
        """When ``train()`` ends: free what the run kept for its checks."""
        if self.guard is not None:
            self.guard.end_run()

    def begin_batch(self, planned, accelerator) -> dict[str, float]:
        """When the trainer takes a batch: the guard settles its check and chooses the batch's anchor. Returns the
        settled check's metrics."""
        return {} if self.guard is None else self.guard.begin_batch(planned, accelerator)

    # ---- a micro-step ------------------------------------------------------------------------------------------
    def prepare(self, trainer, model, inputs: dict) -> torch.Tensor | None:
        """Before a training micro-step's forward: the recompute forward at the first micro-step of a batch that
        needs it (:meth:`attach_proximal_logps`), and under ``guarded`` the exact target's log-probs of a checked
        micro-batch (``None`` otherwise), before the training forward (the kept weights are exchanged in and out)."""
        self._attach_proximal_logps_if_due(trainer, inputs)
        return None if self.guard is None else self.guard.reference(trainer, model, inputs)

    def of(self, inputs: dict, current_logps, staleness, mask, device, exact_logps=None) -> Anchor:
        """The micro-batch's anchor as its batch's method says: the A-3PO interpolation, the current weights' (the
        recomputed ones, or this forward's own, detached), both (``metrics``), or the behavior log-probs themselves
        (the ``behavior`` ablation). Only the interpolation is timed here (a recompute forward is timed where it
        runs, and reusing this forward's log-probs costs nothing). A checked micro-batch (``exact_logps``, from
        :meth:`prepare`) adds its sums to the guard's check. ``device``: the training device (where it is timed)."""
        method = self.entry
        if method.anchor == "behavior":
            return Anchor(inputs["behavior_logps"], None)
        loglinear = None
        if method.interpolates:
            with self.timer.time(device):
                loglinear = approximate_proximal_logps(inputs["behavior_logps"], current_logps, staleness)
        if method.anchor == "loglinear":
            proximal = loglinear
        else:
            recomputed = inputs.get("recomputed_proximal_logps")
            proximal = current_logps.detach() if recomputed is None else recomputed
        if exact_logps is not None:  # a checked micro-batch of prox_logp_method="guarded"
            self.guard.add(loglinear, current_logps, exact_logps, staleness, mask)
        return Anchor(proximal, loglinear)

    def metrics(self, accelerator, inputs, anchor: Anchor, sampling_logps, mask, step: int, train: bool) -> dict:
        """What the anchor cost and measured at this micro-step: under ``guarded`` (training) the anchor chosen and
        the check's seconds; under ``metrics`` the error of the log-linear estimate against recompute's anchor."""
        values = {}
        if self.guard is not None and train:
            values["a3po/prox_recompute_fraction"] = float(self.batch_method == "guarded-recompute")
            values["a3po/prox_check_time"] = self.guard.timer.take()
        if self.method == "metrics":
            compared = mask.bool()
            if "recompute_version" in inputs:  # recomputed with the weights of the batch's first optimizer step only
                # against recompute's anchor at every micro-step, with how many versions the trained weights are
                # past it (0 on a batch's first step): where A-3PO's interpolation holds within a batch
                age = (step - inputs["recompute_version"]).float()
                values.update(
                    approximation_error_metrics(
                        accelerator, anchor.loglinear, anchor.proximal, sampling_logps, compared, age, "anchor_"
                    )
                )
                compared = compared & (inputs["recompute_version"] == step).unsqueeze(1)
            values.update(
                approximation_error_metrics(accelerator, anchor.loglinear, anchor.proximal, sampling_logps, compared)
            )
        return values

    # ---- the recompute forward ---------------------------------------------------------------------------------
    def _attach_proximal_logps_if_due(self, trainer, inputs: dict) -> None:
        """At the first micro-step of a generation batch whose method anchors at the weights of its first optimizer
        step while later micro-steps train newer ones (:func:`needs_recompute_forward`): compute those log-probs for
        every micro-batch of the generation batch now, before any of its optimizer steps. Nothing otherwise, or when
        this micro-batch has them already (a later micro-step, or a later iteration over the batch)."""
        if "recomputed_proximal_logps" in inputs or "versions_training_batch" not in inputs:
            return
        buffered = getattr(trainer, "_buffered_inputs", None) or []
        micro_batches = buffered if any(batch is inputs for batch in buffered) else [inputs]
        batch_index, versions = int(inputs["batch_index"]), int(inputs["versions_training_batch"])
        self.attach_proximal_logps(trainer, micro_batches, batch_index, versions)

    def attach_proximal_logps(
        self, trainer, micro_batches: list[dict], batch_index: int, versions_training_batch: int
    ) -> None:
        """Add ``recomputed_proximal_logps`` (one no-grad forward of ``trainer``'s current weights) and
        ``recompute_version`` to each of ``micro_batches``, the generation batch ``batch_index``, if the method needs
        them (:func:`needs_recompute_forward`); otherwise nothing, and the loss anchors as the method says."""
        if not needs_recompute_forward(self.batch_method, versions_training_batch):
            return
        device = trainer.accelerator.device
        start = time.perf_counter()
        with self.timer.time(device):
            # the micro-batches were split from one padded batch: one call over their rows, in micro-batches
            input_ids = torch.cat([torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1) for b in micro_batches])
            attention_mask = torch.cat(
                [torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1) for b in micro_batches]
            )
            with torch.no_grad():
                logps = trainer._get_per_token_logps_and_entropies(
                    trainer.model,
                    input_ids,
                    attention_mask,
                    micro_batches[0]["completion_ids"].size(1),
                    batch_size=trainer.args.per_device_train_batch_size,
                )[0]
        rows = [b["prompt_ids"].size(0) for b in micro_batches]
        for batch, batch_logps in zip(micro_batches, logps.split(rows)):
            batch["recomputed_proximal_logps"] = batch_logps
            batch["recompute_version"] = torch.full((batch_logps.size(0),), trainer.state.global_step, device=device)
        # on CUDA the host's span: the forward's launch, which ends before its kernels do (a3po/prox_time has the
        # device time); waiting for them here would stall the training thread
        trainer.timeline.record(TRAINING_LANE, "recompute forward", start, time.perf_counter(), {"batch": batch_index})
