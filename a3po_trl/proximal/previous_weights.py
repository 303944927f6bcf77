"""The exact reference of A-3PO's interpolated anchor: the log-probs of the weight version it targets.

A-3PO's anchor for a token trained by the weights of version ``v`` (``v = global_step``, the optimizer steps taken)
interpolates between the behavior log-probs (version ``v - d``) and the current ones (version ``v``) with weight
``w = 1/d`` on the behavior's: were log-probs linear in the version, it would equal the log-probs of version
``v - 1``, *one version before the trained weights*, whatever the token's staleness ``d >= 1``, whatever the batch's
age, with one optimizer step per generation batch or several. That version is the interpolation's target, and the
reference of every check of it.

The weights of version ``v - 1`` are the trainable parameters as the optimizer step that made version ``v`` found
them. :class:`PreviousVersionWeights` keeps a copy of the trainable parameters at a version (taken after the optimizer
step that made it, before the next one: ``keep(model, v - 1)``), and computes a micro-batch's log-probs with them
exchanged into the model for one no-grad forward (:meth:`PreviousVersionWeights.logps`): the same forward the
training step runs (the trainer's ``_get_per_token_logps_and_entropies``), on the same model, so the reference differs
from the target version's own forward by nothing but the exchanged values. Only the trainable parameters are kept:
with LoRA, the adapters.

The exchange is in place and exact (a copy, no arithmetic), one parameter at a time (peak extra memory: the kept copy
plus the largest parameter), and undone before the call returns, also when the forward raises. It must run where no
autograd graph holds the parameters (before the micro-step's training forward): the training thread is the only one
that touches the trained parameters (the generator holds its own copy of whatever training changes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter the optimizer trains (``requires_grad``), in the model's order."""
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def _local_values(parameter: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this process's values of ``parameter`` (sharing its storage): FSDP2 keeps them in
    the DTensor's local shard; otherwise the parameter itself (under ZeRO-3, inside :func:`_whole`)."""
    values = parameter.detach()
    return values.to_local() if hasattr(values, "to_local") else values


def _resharded(model: torch.nn.Module) -> None:
    """Under FSDP2, put every sharded module's parameters back in their sharded form (a module a forward left
    unsharded, the root's by default, exposes whole plain tensors until its backward): what is kept and exchanged is
    always this process's shard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def _whole(parameters: list[torch.Tensor], modify: bool):
    """Within the block the parameters hold their whole values: under DeepSpeed ZeRO-3 (partitioned parameters carry
    a ``ds_id``) they are gathered on every process, and with ``modify`` what the block writes into them is
    partitioned again when it ends (every process writes the same, process 0's is kept); elsewhere nothing to do.
    A collective under ZeRO-3: every process enters it together."""
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0 if modify else None):
        yield


class PreviousVersionWeights:
    """A copy of a model's trainable parameters at one weight version, and the log-probs of that version.

    ``keep(model, version)`` copies them (replacing what was kept); ``version`` is the version kept (``None`` before
    the first ``keep``); ``logps(...)`` runs one no-grad forward with the kept values in place of the model's.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self._names: list[str] = []
        self._values: list[torch.Tensor] = []

    def keep(self, model: torch.nn.Module, version: int, device: torch.device | str | None = None) -> None:
        """Copy ``model``'s trainable parameters as they are now, as version ``version``, to ``device`` (each
        parameter's own by default)."""
        _resharded(model)
        named = trainable_parameters(model)
        with torch.no_grad(), _whole([parameter for _, parameter in named], modify=False):
            values = [_local_values(parameter).clone() for _, parameter in named]
            if device is not None:
                values = [value.to(device) for value in values]
        self._names = [name for name, _ in named]
        self._values = values
        self.version = version

    def forget(self) -> None:
        """Drop the kept copy (its memory)."""
        self.version, self._names, self._values = None, [], []

    def state(self) -> dict:
        """What a checkpoint keeps: the version, the parameters' names and this process's values."""
        return {"version": self.version, "names": list(self._names), "values": list(self._values)}

    def load_state(self, state: dict) -> None:
        """Take back what :meth:`state` returned (values on any device: they move to their parameter's on use)."""
        self.version, self._names, self._values = state["version"], list(state["names"]), list(state["values"])

    @property
    def nbytes(self) -> int:
        """Bytes the kept copy holds."""
        return sum(value.numel() * value.element_size() for value in self._values)

    @contextmanager
    def swapped_in(self, model: torch.nn.Module):
        """Within the block, ``model``'s trainable parameters hold the kept values (and the kept copy the model's);
        both are exchanged back when it ends."""
        if self.version is None:
            raise RuntimeError("PreviousVersionWeights.swapped_in before any keep(): no version is kept.")
        _resharded(model)
        named = trainable_parameters(model)
        if [name for name, _ in named] != self._names:
            raise RuntimeError(
                "The model's trainable parameters are not those kept (another model, or requires_grad changed since "
                "keep()): the kept version cannot be swapped in."
            )
        parameters = [parameter for _, parameter in named]
        self._exchange(parameters)
        try:
            yield
        finally:
            self._exchange(parameters)

    def _exchange(self, parameters: list[torch.Tensor]) -> None:
        with torch.no_grad(), _whole(parameters, modify=True):
            local = [_local_values(parameter) for parameter in parameters]
            self._values = [kept.to(values.device) for kept, values in zip(self._values, local)]
            for parameter, kept in zip(local, self._values):
                held = parameter.clone()
                parameter.copy_(kept)
                kept.copy_(held)

    def logps(self, trainer, model: torch.nn.Module, inputs: dict, weights_of: torch.nn.Module) -> torch.Tensor:
        """Per-token log-probs ``(B, T)`` of ``inputs``' completions under the kept version: ``trainer``'s own
        training forward (``_get_per_token_logps_and_entropies``, no grad) through ``model`` (as the loss calls it,
        possibly wrapped) with the kept values exchanged into ``weights_of`` (the unwrapped model whose trainable
        parameters were kept)."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.swapped_in(weights_of), torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )[0]
