"""What the generation thread needs for its rollouts, copied off the trainer: tokenizers of its own, reward functions,
the seed of each batch's random stream, and the multi-turn settings."""

from __future__ import annotations

import copy

from torch import nn
from trl.data_utils import is_conversational

from ..rollout import RolloutSettings, decode_completions
from ..rollout.multi_turn import AgentSettings
from ..rollout.seeds import sampling_seeds
from .sharding import shards_parameters


def rollout_settings(trainer, batch_numbers=None) -> RolloutSettings:
    """What the generation thread needs for its rollouts, copied. ``batch_numbers(index)`` is the global number of
    batch ``index`` of the run (its position in the sampler's order over epochs), from which its sampling seed
    derives."""
    tokenizer = copy.deepcopy(trainer.processing_class)  # the thread gets its own tokenizers
    chat_template, template_kwargs = trainer.chat_template, dict(trainer.chat_template_kwargs)

    def render(prompts, tools):
        return tokenizer.apply_chat_template(
            conversation=prompts,
            tools=tools or None,  # `or None`, as GRPOTrainer: some templates render tool boilerplate for []
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **template_kwargs,
        )["input_ids"]

    def tokenize(prompts, tools):
        if not is_conversational({"prompt": prompts[0]}):
            return tokenizer(text=prompts)["input_ids"]
        if tools is None or all(t is tools[0] for t in tools):
            return render(prompts, tools[0] if tools else None)
        return [render([prompt], prompt_tools)[0] for prompt, prompt_tools in zip(prompts, tools, strict=True)]

    args = trainer.args
    return RolloutSettings(
        tokenize_prompts=tokenize,
        decode=lambda ids, prompt_ids, prompts: decode_completions(tokenizer, ids, prompt_ids, prompts),
        eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id,
        reward_funcs=list(trainer.reward_funcs),
        reward_func_names=list(trainer.reward_func_names),
        reward_processing_classes=[copy.deepcopy(c) for c in trainer.reward_processing_classes],
        mask_truncated_completions=trainer.mask_truncated_completions,
        pad_to_multiple_of=trainer.pad_to_multiple_of,
        sampling_seeds=(
            None
            if batch_numbers is None
            else sampling_seeds(args.seed, trainer.accelerator.process_index, batch_numbers)
        ),
        deferred_reward_columns=deferred_reward_columns(trainer),
        async_loop=getattr(trainer, "async_loop", None),
        reward_workers=getattr(trainer, "_reward_workers", None),
        chat_template_kwargs=template_kwargs,
        agent=agent_settings(
            trainer, tokenizer, args.refresh_weights_between_turns and not args.reproducible_generation
        ),
        rollout_func=trainer.rollout_func,
        rollout_owner=trainer,
    )


def deferred_reward_columns(trainer) -> frozenset[int]:
    """Reward models whose forward is a collective (partitioned by ZeRO-3, sharded by FSDP2) are scored in the main
    thread."""
    if not shards_parameters(trainer):
        return frozenset()
    return frozenset(i for i, func in enumerate(trainer.reward_funcs) if isinstance(func, nn.Module))


def agent_settings(trainer, tokenizer, refresh_between_turns: bool) -> AgentSettings | None:
    """The multi-turn settings of a GRPOTrainer set up with ``tools`` or ``environment_factory`` (None otherwise);
    ``tokenizer`` is the generation thread's own copy."""
    factories = getattr(trainer, "environment_factories", None)
    if not trainer.tools and factories is None:
        return None
    environment_tools = dict(trainer._env_tools) if factories is not None else {}
    backend_limit = trainer.args.vllm_max_model_length if trainer.args.use_vllm else None
    config = trainer._unwrapped_model().config
    model_limit = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
    return AgentSettings(
        tokenizer=tokenizer,
        chat_template=trainer.chat_template,
        chat_template_kwargs=dict(trainer.chat_template_kwargs),
        standalone_tools=list(trainer._standalone_tools),
        environment_factories=factories,
        environment_tools=environment_tools,
        multi_environment=bool(getattr(trainer, "_multi_environment", False)),
        max_tool_calling_iterations=trainer.max_tool_calling_iterations,
        max_completion_length=trainer.max_completion_length,
        max_model_len=backend_limit or model_limit or (1 << 62),
        tool_call_timeout=trainer.args.tool_call_timeout,
        refresh_between_turns=refresh_between_turns,
        async_loop=getattr(trainer, "async_loop", None),
    )
