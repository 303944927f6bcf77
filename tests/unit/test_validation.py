"""What the trainer refuses before any model loads (a3po_trl/validation.py), each with the field and the fix:
GRPOTrainer options it cannot honour, vLLM settings, truncated sampling the behavior log-probs cannot weight, datasets
without prompts; and that the trainer runs these checks before it resolves a model."""

import pytest
from datasets import Dataset
from helpers import COMMON
from tiny import length_reward, make_prompts

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.validation import check_supported, check_train_dataset


def _config(tmp_path, **overrides):
    return AsyncA3POConfig(output_dir=str(tmp_path), **{**COMMON, **overrides})


CB = {"use_transformers_continuous_batching": True}
BAD_CONTINUOUS_BATCHING_OPTIONS = [
    ({**CB, "use_vllm": True}, "both choose how completions are generated"),
    # continuous batching drops unsupported processors and reports the processed distribution's log-probs only
    ({**CB, "top_p": 0.9}, r"top_p=0.9 processes that distribution.*use_transformers_continuous_batching=False"),
    ({**CB, "repetition_penalty": 1.2}, r"repetition_penalty=1.2 processes"),
    ({**CB, "generation_kwargs": {"min_p": 0.1}}, r"min_p=0.1 processes"),
    ({**CB, "transformers_continuous_batching_config": {"blocks": 4}}, "not a valid ContinuousBatchingConfig"),
    # a captured CUDA graph would replay the sampler's random numbers
    ({**CB, "transformers_continuous_batching_config": {"use_cuda_graph": True}}, r"'use_cuda_graph'\]=True"),
    # a cache sized from the free memory could schedule (and sample) the same batch differently
    (
        {
            **CB,
            "reproducible_generation": True,
            "transformers_continuous_batching_config": {"max_memory_percent": 0.5},
        },
        "sized from the free memory.*Set 'num_blocks'",
    ),
]

VLLM = {"use_vllm": True}
BAD_VLLM_OPTIONS = [
    ({**VLLM, "vllm_mode": "remote"}, "vllm_mode='remote' must be one of"),
    ({**VLLM, "vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode=True.*vllm_gpu_memory_utilization"),
    ({**VLLM, "vllm_structured_outputs_regex": "[0-9]+"}, "vllm_structured_outputs_regex.*masked distribution"),
    ({**VLLM, "vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2.*vllm_mode='server'"),
    ({**VLLM, "vllm_importance_sampling_correction": False}, "vllm_importance_sampling_correction=False.*cannot"),
    ({**VLLM, "vllm_importance_sampling_mode": "token_mask"}, "vllm_importance_sampling_mode=.*behavior_weight_cap"),
    ({**VLLM, "vllm_importance_sampling_clip_max": 2.0}, "vllm_importance_sampling_clip_max=2.0.*behavior_weight_cap"),
    ({**VLLM, "behavior_logps_source": "forward"}, "behavior_logps_source='forward'.*'generation'"),
    # vLLM reports only the truncated (processed) log-probs: an on-policy ratio would be the kept mass, not 1
    ({**VLLM, "top_p": 0.7}, r"top_p=0.7 \(in the config\).*Set top_p=1.0, or generate with use_vllm=False"),
    ({**VLLM, "top_k": 5}, r"top_k=5 .*Set top_k=0"),
    ({**VLLM, "min_p": 0.1}, r"min_p=0.1 .*Set min_p=0.0"),
    ({**VLLM, "repetition_penalty": 1.1}, r"repetition_penalty=1.1 .*Set repetition_penalty=1.0"),
    ({**VLLM, "generation_kwargs": {"presence_penalty": 0.5}}, r"presence_penalty=0.5 \(in generation_kwargs\)"),
    # the untruncated log-probs of a forward cannot weight samples drawn from a truncated distribution
    ({"behavior_logps_source": "forward", "top_p": 0.9}, r"top_p=0.9.*behavior_logps_source='generation'"),
]


@pytest.mark.parametrize("overrides, message", BAD_VLLM_OPTIONS)
def test_vllm_settings_that_cannot_be_honoured_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_supported(_config(tmp_path, **overrides), {})


@pytest.mark.parametrize("overrides, message", BAD_CONTINUOUS_BATCHING_OPTIONS)
def test_continuous_batching_settings_that_cannot_be_honoured_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_supported(_config(tmp_path, **overrides), {})


def test_continuous_batching_with_neutral_sampling_and_a_sized_cache_is_accepted(tmp_path):
    check_supported(
        _config(
            tmp_path,
            **CB,
            top_p=1.0,
            generation_kwargs={"top_k": 0},
            reproducible_generation=True,
            transformers_continuous_batching_config={"num_blocks": 8, "max_memory_percent": 0.2},
        ),
        {},
    )


def test_rollout_func_with_tools_is_rejected(tmp_path):
    with pytest.raises(NotImplementedError, match="rollout_func together with tools"):
        check_supported(_config(tmp_path), {"rollout_func": length_reward, "tools": [length_reward]})


@pytest.mark.parametrize(
    "dataset, message",
    [
        (Dataset.from_dict({"question": ["a", "b"]}), "no 'prompt' column"),
        (Dataset.from_dict({"prompt": []}), "empty"),
    ],
)
def test_bad_datasets_are_rejected(dataset, message):
    with pytest.raises(ValueError, match=message):
        check_train_dataset(dataset)


def test_an_environment_may_supply_the_prompts():
    check_train_dataset(Dataset.from_dict({"question": ["a"]}), environment_owns_prompts=True)


@pytest.mark.parametrize(
    "overrides, kwargs, error, message",
    [
        ({**VLLM, "vllm_mode": "remote"}, {}, ValueError, "vllm_mode='remote' must be one of"),
        ({}, {"rollout_func": length_reward, "tools": [length_reward]}, NotImplementedError, "rollout_func together"),
        ({}, {"train_dataset": Dataset.from_dict({"prompt": []})}, ValueError, "empty"),
    ],
)
def test_the_trainer_refuses_before_it_resolves_a_model(tmp_path, overrides, kwargs, error, message):
    kwargs = {"train_dataset": make_prompts(8), **kwargs}
    with pytest.raises(error, match=message):
        AsyncA3POTrainer(
            model="does-not-exist/never-loaded",
            reward_funcs=[length_reward],
            args=_config(tmp_path, **overrides),
            **kwargs,
        )


def _stand_in_trainer(tmp_path, zero_stage=None, fsdp2=False, reward_funcs=(length_reward,), **overrides):
    from types import SimpleNamespace

    plugin = SimpleNamespace(zero_stage=zero_stage)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), is_fsdp2=fsdp2)
    return SimpleNamespace(
        args=_config(tmp_path, dynamic_sampling=True, **overrides),
        is_deepspeed_enabled=zero_stage is not None,
        is_fsdp_enabled=fsdp2,
        accelerator=accelerator,
        reward_funcs=list(reward_funcs),
    )


def test_dynamic_sampling_refuses_a_reward_model_scored_in_the_main_thread_and_a_filter_that_does_not_import(
    tmp_path,
):
    from torch import nn

    from a3po_trl.validation import _check_dynamic_sampling

    reward_model = nn.Linear(1, 1)
    _check_dynamic_sampling(_stand_in_trainer(tmp_path, reward_funcs=(reward_model,)))  # DDP: scored in the thread
    _check_dynamic_sampling(_stand_in_trainer(tmp_path, zero_stage=3))  # ZeRO-3 with reward functions only
    for sharded in ({"zero_stage": 3}, {"fsdp2": True}):
        with pytest.raises(NotImplementedError, match="dynamic_sampling=True with a reward model under"):
            _check_dynamic_sampling(_stand_in_trainer(tmp_path, reward_funcs=(reward_model,), **sharded))
    with pytest.raises(ValueError, match="dynamic_sampling_filter='missing_module.keep'"):
        _check_dynamic_sampling(_stand_in_trainer(tmp_path, dynamic_sampling_filter="missing_module.keep"))
