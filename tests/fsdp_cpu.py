"""Run the real accelerate/transformers FSDP2 code path on a CPU-only machine (tests only; see docs/FSDP2.md).

``accelerate launch`` with an FSDP config sets ``ACCELERATE_USE_FSDP=true`` and the ``FSDP_*`` variables, and the
Accelerator builds its FSDP plugin from them, but ``AcceleratorState`` switches to ``DistributedType.FSDP`` only when
the process group runs on an accelerator (``MULTI_GPU``, ``MULTI_XPU``, ...): with ``use_cpu=True`` the state stays
``MULTI_CPU`` and the plugin is dropped, so the Trainer's ``is_fsdp_enabled`` is False and the model is wrapped in
DDP. :func:`force_fsdp_on_cpu` finishes what ``AcceleratorState.__init__`` skips on CPU (the same three assignments
it makes on GPUs), so ``Accelerator.prepare`` shards the model with ``fully_shard`` over gloo, and checkpoints,
``save_model`` and ``unwrap_model`` take their FSDP2 paths as on GPUs.
"""

from __future__ import annotations

import os

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_PATCHED = "_a3po_fsdp_on_cpu"


def force_fsdp_on_cpu() -> None:
    """Patch ``AcceleratorState`` (idempotent) so that a gloo (``MULTI_CPU``) run with an FSDP plugin, or with
    ``ACCELERATE_USE_FSDP=true`` from the launcher, becomes ``DistributedType.FSDP``. Call before the trainer is
    built."""
    if getattr(AcceleratorState, _PATCHED, False):
        return
    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        wants_fsdp = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if self.distributed_type == DistributedType.MULTI_CPU and wants_fsdp and fsdp_plugin is not None:
            # What AcceleratorState.__init__ does for MULTI_GPU & co. when FSDP is requested.
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__
    setattr(AcceleratorState, _PATCHED, True)
