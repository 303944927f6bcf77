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

The exchange is in place and exact (a copy, no arithmetic), one parameter at a time, and undone before the call
returns, also when the forward raises. It must run where no autograd graph holds the parameters (before the
micro-step's training forward): the training thread is the only one that touches the trained parameters (the
generator holds its own copy of whatever training changes).

What is kept and exchanged is what each process holds of the trainable parameters: the whole parameters on one
process, under DDP and ZeRO-1/2; this process's shard under FSDP2 (the DTensor's local tensor) and its partition under
ZeRO-3 (``ds_tensor``). Peak extra memory: the kept copy (its size: docs/GPU.md, "The guarded method's kept
weights") and one parameter's (shard's) temporary. A sharded backend also holds gathered copies of some parameters
between forwards (FSDP2 the modules it keeps unsharded after a forward, by default the root's: the final norm,
``lm_head``, tied embeddings; ZeRO-3 its persistent small parameters and any a no-grad forward left gathered): they are
released before each exchange and after it, so that the exchanged forward gathers the kept values and the next training
forward the trained ones again (a gathered copy left holding the kept values would train with them).

The check's forward draws its random numbers (dropout's, with ``disable_dropout=False``) from the state the training
forward after it starts from, which is restored when it ends: the reference sees the training forward's dropout masks,
and the training forward draws what it would draw without a check.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter the optimizer trains (``requires_grad``), in the model's order."""
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def _local_values(parameter: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this process's values of ``parameter`` (sharing its storage): under ZeRO-3 its
    partition (``ds_tensor``, flat and padded), under FSDP2 the DTensor's local shard, otherwise the parameter."""
    if hasattr(parameter, "ds_tensor"):
        return parameter.ds_tensor.detach()
    values = parameter.detach()
    return values.to_local() if hasattr(values, "to_local") else values


def _released(model: torch.nn.Module) -> None:
    """Drop every gathered copy of ``model``'s parameters, so that a forward gathers them again from what each process
    holds: under FSDP2 reshard every sharded module (a module a forward left unsharded, the root's by default, exposes
    whole plain tensors until its backward or a reshard); under ZeRO-3 (parameters that carry a ``ds_id``) release
    every gathered parameter, the persistent ones included (the optimizer's ``empty_partition_cache``: the next
    forward gathers them again). Local to each process: no collective."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = None
    partitioned = []
    for module in model.modules():
        if FSDPModule is not None and isinstance(module, FSDPModule):
            module.reshard()
        partitioned += [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
    if partitioned:
        _zero3_optimizer(partitioned).empty_partition_cache()


def _zero3_optimizer(partitioned: list[torch.Tensor]):
    """The DeepSpeed ZeRO-3 optimizer that holds ``partitioned`` (ZeRO-3 parameters), refusing what this module cannot
    exchange in place: parameters outside a ZeRO-3 optimizer, or offloaded to NVMe (their partition not resident)."""
    optimizer = getattr(partitioned[0], "_z3_optimizer", None)
    if optimizer is None:
        raise RuntimeError(
            "prox_logp_method='guarded': the model's ZeRO-3 parameters belong to no DeepSpeed ZeRO-3 optimizer (a "
            "model partitioned outside training): the previous version's weights cannot be exchanged into it."
        )
    if any(getattr(parameter.ds_tensor, "final_location", None) is not None for parameter in partitioned):
        raise ValueError(
            "prox_logp_method='guarded' cannot exchange weights offloaded to NVMe (DeepSpeed offload_param_device: "
            "nvme): offload them to the CPU (offload_param_device: cpu) or use prox_logp_method='loglinear'."
        )
    return optimizer


def _after_partitions_change(parameters: list[torch.Tensor]) -> None:
    """What ZeRO-3's optimizer does after its step writes the partitions: drop the secondary partitions (ZeRO++ hpZ),
    which copy the primary ones and would otherwise be gathered instead of the new values."""
    partitioned = [parameter for parameter in parameters if hasattr(parameter, "ds_id")]
    if partitioned:
        _zero3_optimizer(partitioned).invalidate_secondary_tensor()


def _draws_random_numbers(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` draws random numbers: in training mode, with a dropout module of ``p > 0`` or an
    attention module's ``attention_dropout > 0`` (TRL's ``disable_dropout=False``)."""
    if not model.training:
        return False
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        attention_dropout = getattr(module, "attention_dropout", 0)  # transformers' attention modules
        if isinstance(attention_dropout, (int, float)) and attention_dropout > 0:
            return True
    return False


@contextmanager
def _random_state_restored(device: torch.device, restore: bool = True):
    """Within the block ``device``'s random generator draws from its state now, which is restored when the block ends
    (the default CPU generator for the CPU, the device's own otherwise); nothing is saved or restored unless
    ``restore``. The generators are the process's: the generation thread's draws from the same one while the block
    runs would be rewound too, so this is done only where the forward draws (dropout on)."""
    if not restore:
        yield
        return
    device = torch.device(device)
    if device.type == "cpu":
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)
        return
    module = torch.get_device_module(device.type)
    state = module.get_rng_state(device)
    try:
        yield
    finally:
        module.set_rng_state(state, device)


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
        """Copy what this process holds of ``model``'s trainable parameters as they are now (the whole parameters, or
        its shard or partition: see the module's doc), as version ``version``, to ``device`` (each parameter's own by
        default). Read from what the optimizer writes (gathered copies are only copies of it), without a collective."""
        _released(model)  # under FSDP2 an unsharded module's parameters are plain tensors, not the shards
        named = trainable_parameters(model)
        with torch.no_grad():
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
        _released(model)
        named = trainable_parameters(model)
        if [name for name, _ in named] != self._names:
            raise RuntimeError(
                "The model's trainable parameters are not those kept (another model, or requires_grad changed since "
                "keep()): the kept version cannot be swapped in."
            )
        parameters = [parameter for _, parameter in named]
        local = [_local_values(parameter) for parameter in parameters]
        if [tuple(value.shape) for value in local] != [tuple(kept.shape) for kept in self._values]:
            raise RuntimeError(
                "The kept values' shapes differ from what this process holds of the model's parameters (kept under "
                "another sharding, e.g. restored from a checkpoint of another number of processes or another "
                "backend): the kept version cannot be swapped in."
            )
        self._exchange(local)
        _after_partitions_change(parameters)
        try:
            yield
        finally:
            _released(model)  # the forward's gathered copies hold the kept values: gather the trained ones again
            self._exchange(local)
            _after_partitions_change(parameters)

    def _exchange(self, local: list[torch.Tensor]) -> None:
        """Exchange the kept values with ``local`` (what this process holds of each parameter), in place."""
        with torch.no_grad():
            self._values = [kept.to(values.device) for kept, values in zip(self._values, local)]
            for values, kept in zip(local, self._values):
                held = values.clone()
                values.copy_(kept)
                kept.copy_(held)

    def logps(self, trainer, model: torch.nn.Module, inputs: dict, weights_of: torch.nn.Module) -> torch.Tensor:
        """Per-token log-probs ``(B, T)`` of ``inputs``' completions under the kept version: ``trainer``'s own
        training forward (``_get_per_token_logps_and_entropies``, no grad) through ``model`` (as the loss calls it,
        possibly wrapped) with the kept values exchanged into ``weights_of`` (the unwrapped model whose trainable
        parameters were kept). Its random draws (dropout's) start from the state the training forward after it will
        start from, which is restored when it returns (the module's doc)."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        device = inputs["completion_ids"].device
        with (
            self.swapped_in(weights_of),
            torch.no_grad(),
            _random_state_restored(device, restore=_draws_random_numbers(model)),
        ):
            return trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )[0]
