"""What the generation thread needs, read off the trainer once, in the main thread.

GRPOTrainer keeps what it has set up (the generation config, the tokenizer, tools and environments, reward functions,
ZeRO-3 and FSDP2 state) as attributes of the trainer. The generation thread must never read the trainer while it
trains, so everything it needs is read here once and copied into plain settings, by concern: how the weights are held
across processes (:mod:`.sharding`), the generation backend and its sampling settings (:mod:`.backend`), the batch
producer of each ``train()`` call (:mod:`.batch_producer`) and the rollout and multi-turn settings (:mod:`.rollout`).
"""

from .backend import (
    build_backend,
    cpu_threads,
    generation_engine,
    generator_setup,
    hf_generation_settings,
    vllm_sampling_settings,
)
from .batch_producer import (
    RunPlan,
    batch_numbers,
    build_batch_producer,
    check_kept_versions,
    plan_run,
    prompt_draws_to_keep,
)
from .rollout import agent_settings, deferred_reward_columns, rollout_settings
from .sharding import shards_parameters, uses_fsdp2, uses_zero3, weight_gather

__all__ = [
    "RunPlan",
    "agent_settings",
    "batch_numbers",
    "build_backend",
    "build_batch_producer",
    "check_kept_versions",
    "cpu_threads",
    "deferred_reward_columns",
    "generation_engine",
    "generator_setup",
    "hf_generation_settings",
    "plan_run",
    "prompt_draws_to_keep",
    "rollout_settings",
    "shards_parameters",
    "uses_fsdp2",
    "uses_zero3",
    "vllm_sampling_settings",
    "weight_gather",
]
