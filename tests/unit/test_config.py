"""AsyncA3POConfig: bad values refused naming the field, before any model loads; built from a GRPOConfig, every GRPO
setting survives, derived ones included."""

import dataclasses

import pytest
from helpers import COMMON
from tiny import length_reward, make_prompts
from trl import GRPOConfig

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

# Each exercises a value GRPOConfig / TrainingArguments.__post_init__ derives: the batch schedule from either of its
# two settings, bf16 from fp16, scale_rewards from a bool, eval_steps and do_eval from the eval strategy, the
# activation_checkpointing alias, report_to from a string.
GRPO_SETTINGS = {
    "defaults": {},
    "steps_per_generation": {"steps_per_generation": 2},
    "generation_batch_size": {"generation_batch_size": 8},
    "grpo_options": {
        "loss_type": "dr_grpo",
        "beta": 0.04,
        "num_generations": 2,
        "epsilon_high": 0.28,
        "scale_rewards": False,
        "temperature": 0.7,
        "top_p": 0.95,
        "num_iterations": 2,
        "gradient_accumulation_steps": 2,
        "reward_weights": [1.0, 0.5],
        "generation_kwargs": {"min_new_tokens": 1},
    },
    "training_arguments": {
        "eval_strategy": "steps",
        "per_device_eval_batch_size": 4,
        "bf16": False,
        "gradient_checkpointing": False,
        "lr_scheduler_kwargs": {"power": 2.0},
    },
}


def field_values(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.mark.parametrize("settings", GRPO_SETTINGS.values(), ids=GRPO_SETTINGS.keys())
def test_from_grpo_config_keeps_every_setting(tmp_path, settings):
    kwargs = {**COMMON, "output_dir": str(tmp_path), **settings}
    grpo = GRPOConfig(**kwargs)
    converted = AsyncA3POConfig.from_grpo_config(grpo)
    grpo_fields = field_values(grpo)
    assert {name: getattr(converted, name) for name in grpo_fields} == grpo_fields
    assert converted.mixed_precision == grpo.mixed_precision
    # the A-3PO settings are what AsyncA3POConfig derives from the same arguments (disable_dropout is GRPOConfig's)
    assert field_values(converted) == field_values(AsyncA3POConfig(**kwargs, disable_dropout=False))


def test_from_grpo_config_overrides(tmp_path):
    grpo = GRPOConfig(**COMMON, output_dir=str(tmp_path), generation_batch_size=8)
    converted = AsyncA3POConfig.from_grpo_config(grpo, max_staleness=3, prox_logp_method="recompute")
    assert (converted.max_staleness, converted.prox_logp_method) == (3, "recompute")
    assert (converted.generation_batch_size, converted.steps_per_generation) == (8, 2)
    # a schedule override replaces the carried schedule instead of conflicting with it
    rescheduled = AsyncA3POConfig.from_grpo_config(grpo, steps_per_generation=1)
    assert (rescheduled.generation_batch_size, rescheduled.steps_per_generation) == (4, 1)


def test_from_grpo_config_refuses_unknown_settings_and_other_types(tmp_path):
    grpo = GRPOConfig(**COMMON, output_dir=str(tmp_path))
    with pytest.raises(TypeError, match=r"\['max_stalenes'\]"):
        AsyncA3POConfig.from_grpo_config(grpo, max_stalenes=2)
    with pytest.raises(TypeError, match="needs a trl.GRPOConfig, got dict"):
        AsyncA3POConfig.from_grpo_config(dict(COMMON))


def test_every_proximal_method_is_accepted_and_an_unknown_one_lists_them(tmp_path):
    for method in ("loglinear", "recompute", "metrics", "behavior", "guarded"):
        assert AsyncA3POConfig(**COMMON, output_dir=str(tmp_path), prox_logp_method=method).prox_logp_method == method
    with pytest.raises(ValueError, match=r"'metrics', 'behavior', 'guarded'\)"):
        AsyncA3POConfig(**COMMON, output_dir=str(tmp_path), prox_logp_method="behaviour")


BAD_CONFIGS = [
    ({"max_staleness": -1}, "max_staleness=-1"),
    ({"max_staleness": 1.5}, "max_staleness=1.5"),
    ({"behavior_weight_cap": 1.0}, "behavior_weight_cap=1.0"),
    ({"behavior_weight_cap": 0.5}, "behavior_weight_cap=0.5"),
    ({"prox_logp_method": "exact"}, "prox_logp_method='exact'"),
    ({"behavior_weight_cap_mode": "clip"}, "behavior_weight_cap_mode='clip'"),
    ({"per_device_train_batch_size": 6}, "must be divisible by num_generations (4)"),
    ({"steps_per_generation": 3, "max_staleness": 1}, "max_staleness=1 is too small"),
    ({"generation_num_threads": 0}, "generation_num_threads=0"),
    ({"generation_poll_interval": 0}, "generation_poll_interval=0"),
    ({"generation_stop_timeout": -1}, "generation_stop_timeout=-1"),
    ({"reward_num_workers": -1}, "reward_num_workers=-1"),
    ({"reward_num_workers": 1.5}, "reward_num_workers=1.5"),
    ({"reward_num_workers": True}, "reward_num_workers=True"),
    ({"generation_batch_timeout": 0}, "generation_batch_timeout=0 must be a positive number of seconds, or None"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_bad_config_values_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError) as info:
        AsyncA3POConfig(output_dir=str(tmp_path), **{**COMMON, **overrides})
    assert message in str(info.value)


def test_a_generation_kwargs_temperature_that_differs_is_refused_before_the_model_loads(tmp_path):
    message = r"generation_kwargs sets temperature=0.5.*scaled by temperature=1.0.*Set temperature=0.5 in the config"
    with pytest.raises(ValueError, match=message):
        AsyncA3POConfig(output_dir=str(tmp_path), generation_kwargs={"temperature": 0.5}, **COMMON)
    # a GRPOConfig is converted, and refused, before the trainer resolves a model id that cannot load
    grpo = GRPOConfig(output_dir=str(tmp_path), generation_kwargs={"temperature": 0.5}, **COMMON)
    with pytest.raises(ValueError, match=message):
        AsyncA3POTrainer(
            model="does-not-exist/never-loaded", reward_funcs=[length_reward], args=grpo, train_dataset=make_prompts(8)
        )
    agreeing = AsyncA3POConfig(
        output_dir=str(tmp_path), temperature=0.7, generation_kwargs={"temperature": 0.7}, **COMMON
    )
    assert agreeing.generation_kwargs == {"temperature": 0.7}
