"""How the main thread reads the training module's weights whole: for the generator, and for a saved model.

Under DeepSpeed ZeRO-3 and FSDP2 every process holds a shard of each parameter, and making one whole is a collective:
every process must take part in every gather, in the same order, or the run deadlocks. A backend never decides that
on its own: the trainer injects one :class:`ParameterGather` (:func:`as_parameter_gather` turns ``None`` or a
ZeRO-3-style context-manager factory into one), and a backend reads weights only through
:meth:`ParameterGather.full_tensors`, which yields one whole tensor per parameter it is given. The publication
(:meth:`~a3po_trl.generation.weights.VersionedWeights.publish`) iterates all of a version's trainable parameters
through it, with no early exit, from the main thread of every process.

- :class:`ParameterGather`: parameters already whole (one process, DDP, ZeRO-1/2): the tensors themselves.
- :class:`ContextGather`: ZeRO-3's ``deepspeed.zero.GatheredParameters`` over the whole list at once.
- :class:`DTensorGather`: FSDP2 (``fully_shard``): ``DTensor.full_tensor()`` per parameter, so no more than one
  parameter is ever gathered at a time beside what the caller keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch


class ParameterGather:
    """Reads parameters whole. This base class is for parameters that are whole already (no collective)."""

    sharded = False
    """Whether the parameters are sharded across processes (each read is then a collective)."""

    def full_tensors(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` for each ``(name, parameter)``, in order. The tensor may be the parameter's own
        storage or a temporary: copy it before the next item. Under sharding, every process must exhaust the
        iterator over the same names."""
        for name, param in named_params:
            yield name, param.detach()


class ContextGather(ParameterGather):
    """A context-manager factory that makes a list of parameters whole while it is open (ZeRO-3's
    ``GatheredParameters``), applied to everything :meth:`full_tensors` is given at once."""

    sharded = True

    def __init__(self, factory: Callable):
        self.factory = factory

    def full_tensors(self, named_params):
        named_params = list(named_params)
        with self.factory([param for _, param in named_params]):
            for name, param in named_params:
                yield name, param.detach()


class DTensorGather(ParameterGather):
    """FSDP2: ``full_tensor()`` (an all-gather) of each ``DTensor`` parameter in turn; plain tensors as they are."""

    sharded = True

    def full_tensors(self, named_params):
        from torch.distributed.tensor import DTensor

        for name, param in named_params:
            param = param.detach()
            yield name, param.full_tensor() if isinstance(param, DTensor) else param


def as_parameter_gather(gather) -> ParameterGather:
    """``None`` (whole parameters), a :class:`ParameterGather`, or a ZeRO-3-style context-manager factory."""
    if gather is None:
        return ParameterGather()
    if isinstance(gather, ParameterGather):
        return gather
    return ContextGather(gather)


def whole_state_dict(gather: ParameterGather, named_params: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """``{name: whole tensor, on CPU}`` of ``named_params``, read through ``gather`` (on every process together when
    the parameters are sharded), under the module's own names: PEFT picks an adapter's tensors by the model's module
    names, activation-checkpointing wrappers included, so a saved adapter's files are renamed after writing
    (:func:`~a3po_trl.generation.weights.names.strip_checkpoint_wrapper_from_files`)."""
    return {name: t.to("cpu", copy=True) for name, t in gather.full_tensors(named_params)}
