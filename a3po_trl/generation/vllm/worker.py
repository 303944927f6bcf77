"""Code that runs inside vLLM's workers: the trainer's extension of a server's workers, and its in-process calls.

Start a server that the trainer loads full-weight versions into (CPU path) with
``--worker-extension-cls a3po_trl.generation.vllm.worker.A3POWorkerExtension``; the trainer then calls
``a3po_repack_lm_head`` through ``/collective_rpc`` after each weight reload.
"""

from __future__ import annotations


def repack_lm_head(worker) -> bool:
    """Redo the LM head's post-load processing. vLLM's CPU kernels keep a packed copy of each linear weight; a tied
    LM head shares its weight with the embedding, which a reload updates without re-packing the head's copy, so the
    head would keep scoring with the old weights. Returns whether there was anything to redo."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return False
    method.process_weights_after_loading(head)
    return True


class A3POWorkerExtension:
    """Mixed into a vLLM server's worker class (``--worker-extension-cls``)."""

    def a3po_repack_lm_head(self) -> bool:
        return repack_lm_head(self)
