"""Every name of ``a3po_trl``'s internals that a benchmark reads, in one place.

The public API is what ``a3po_trl`` exports; the benchmarks also look inside: at the batch producer's counters and
queue, at the generator's weight backend, and at the source files and functions a py-spy profile passes through. A
module or attribute renamed in the package is fixed here, once; nothing else under ``benchmarks/`` names them.
"""

from __future__ import annotations

# --- the batch producer of the last ``train()`` ------------------------------------------------------------------


def batch_producer(trainer):
    """The batch producer (generation thread and queue) of the trainer's last ``train()`` (None before one, or for
    TRL's trainer)."""
    return getattr(trainer, "last_batch_producer", None)


def producer_counts(producer) -> dict:
    """Batches the producer made and the trainer consumed, of how many, and the queue's bound and deepest fill."""
    return {
        "produced": producer.produced,
        "consumed": producer.consumed,
        "num_batches": producer.num_batches,
        "queue_bound": producer.queue.maxsize,
        "max_queue_depth": producer.queue.max_depth_seen,
    }


def queue_depth(producer) -> int:
    """Batches waiting in the producer's queue now."""
    return len(producer.queue)


# --- the generator's weights ----------------------------------------------------------------------------------------


def generator_dtype(trainer) -> str:
    """The dtype of the generator's copy of the first trainable weight (e.g. ``torch.bfloat16``)."""
    backend = trainer._backend
    return str(backend.weights.layout.dtypes[backend.trainable_names[0]])


def shared_server_counts(trainer) -> dict | None:
    """For a full-weight vLLM server shared by several processes: seconds waited for it and version switches."""
    shared = getattr(trainer._backend, "_shared", None)
    if shared is None:
        return None
    return {"wait_seconds": shared.wait_seconds, "switches": shared.switches}


def hf_generator(model):
    """The Hugging Face ``generate`` backend the generation thread would hold for ``model``, with version 0 published
    and loaded (its own copies checked equal to the trainer's weights)."""
    import torch
    from transformers import GenerationConfig

    from a3po_trl.generation import HFGenerateBackend, HFGenerationSettings

    settings = HFGenerationSettings(GenerationConfig(), eos_token_ids=[0], pad_token_id=0)
    generator = HFGenerateBackend(model, settings)
    generator.publish(model, version=0)
    assert generator.refresh()
    params = dict(model.named_parameters())
    assert all(torch.equal(generator._own[name], params[name]) for name in generator.trainable_names)
    return generator


def generator_memory(generator, trainer_module) -> dict:
    """Parameters the generator copies and shares with ``trainer_module``, and the bytes of its tensors whose storage
    is not the trainer's (weights), and of the staging buffers the first publication allocates."""

    def storages(tensors) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    trainer = storages(list(trainer_module.parameters()) + list(trainer_module.buffers()))
    generator_tensors = storages(list(generator.module.parameters()) + list(generator.module.buffers()))
    return {
        "copied_parameters": generator.copied_parameter_count,
        "shared_parameters": generator.shared_parameter_count,
        "generator_weights_bytes": sum(size for ptr, size in generator_tensors.items() if ptr not in trainer),
        "staging_bytes": generator.weights.layout.bytes_per_version,
        "staged_weights": len(generator.weights.layout.shapes),
    }


# --- where a py-spy profile's samples are ---------------------------------------------------------------------------

#: A sample is the generation thread's when its stack has all of these.
GENERATION_THREAD_FRAMES = ("generation/producer.py", "_run (")
#: A sample is the training (main) thread's when its stack has this.
TRAINING_LOOP_FRAME = "_inner_training_loop"
#: (activity, substrings that must all be in the stack), first match wins: work before waits, since with
#: ``async_generation=False`` generation runs inside the trainer's get.
PROFILE_ACTIVITIES = [
    ("recompute forward", ("attach_proximal_logps", "_get_per_token_logps_and_entropies")),
    ("behavior logps (recorded while sampling)", ("_record (", "sampling.py")),
    ("behavior logps (extra forward)", ("per_token_logps_fused",)),
    ("generate: model forward (decoding)", ("generate (", "_wrapped_call_impl")),
    ("generate: token selection, stopping, bookkeeping", ("generate (",)),
    ("rewards", ("score_completions",)),
    ("rewards", ("_calculate_rewards",)),
    ("wait: generator waits for staleness bound", ("_wait_for_version",)),
    ("wait: queue full", ("put (", "generation/queue.py")),
    ("wait: trainer waits for samples", ("get (", "generation/producer.py")),
    ("batch intake (move, gather, metrics)", ("make_training_batch",)),
    ("weight refresh (generator copy)", ("refresh (", "generation/backend.py")),
    ("weight publish", ("_publish_weights",)),
    ("backward: LM head + log-softmax (TRL's chunked kernel)", ("backward (", "chunked_logprob.py")),
    ("backward: model body", ("backward (",)),
    ("optimizer step", ("optimizer",)),
    ("loss forward: LM head + log-softmax (TRL's chunked kernel)", ("compute_loss", "chunked_logprob.py")),
    ("loss forward: model body", ("compute_loss", "_wrapped_call_impl")),
    ("loss forward: rest (A-3PO / GRPO loss terms, metrics)", ("compute_loss",)),
]
