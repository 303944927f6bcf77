"""Checks that run before any model is loaded: settings and datasets the trainer cannot honour fail with the fix."""

from __future__ import annotations

from datasets import IterableDataset
from trl import GRPOConfig

from .generation.vllm_setup import check_vllm_settings

_UNSUPPORTED_ARGS = {
    "use_transformers_continuous_batching": (
        True,
        "the generation thread calls generate on its own copy of the weights; set "
        "use_transformers_continuous_batching=False",
    ),
}


def check_supported(args: GRPOConfig, kwargs: dict) -> None:
    """Reject, before any model is loaded, the GRPOTrainer options this trainer cannot honour."""
    for name, (bad_value, fix) in _UNSUPPORTED_ARGS.items():
        if getattr(args, name, None) == bad_value:
            raise NotImplementedError(f"{name}={bad_value!r} is not supported by AsyncA3POTrainer: {fix}.")
    check_vllm_settings(args)
    if args.use_vllm and getattr(args, "behavior_logps_source", "generation") == "forward":
        raise ValueError(
            "behavior_logps_source='forward' needs the generator's own Hugging Face model; with use_vllm=True the "
            "behavior log-probs are the engine's (of the temperature-scaled distribution, processed_logprobs). Set "
            "behavior_logps_source='generation'."
        )
    processed = [
        f"{name}={getattr(args, name)!r}"
        for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0))
        if getattr(args, name) not in (neutral, None)
    ]
    if not args.use_vllm and getattr(args, "behavior_logps_source", "generation") == "forward" and processed:
        raise ValueError(
            f"Sampling with {', '.join(processed)} draws tokens from a processed distribution, whose log-probs the "
            "behavior weight needs; behavior_logps_source='forward' computes the untruncated ones only. Set "
            "behavior_logps_source='generation' (the generator records both while generating), or leave the sampling "
            "settings at their neutral values."
        )
    if kwargs.get("rollout_func") is not None and (kwargs.get("tools") or kwargs.get("environment_factory")):
        raise NotImplementedError(
            "rollout_func together with tools or environment_factory is not supported by AsyncA3POTrainer: pass "
            "either a rollout_func (which then runs its own tool calls) or tools / environment_factory."
        )


def check_train_dataset(dataset, environment_owns_prompts: bool = False) -> None:
    """A dataset the trainer can draw generation batches from (with an ``environment_factory``, the environment's
    ``reset`` may supply the prompts, so a ``prompt`` column is optional, as in GRPOTrainer)."""
    if dataset is None or isinstance(dataset, IterableDataset):
        return
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty; it needs at least one generation batch worth of prompts.")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and not environment_owns_prompts:
        raise ValueError(
            f"train_dataset has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, "
            "e.g. dataset.rename_column('question', 'prompt')."
        )
