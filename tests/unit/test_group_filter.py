"""Dynamic sampling's pure parts (a3po_trl/rollout/dynamic_sampling.py): which groups the filter keeps, which drawn
groups make a batch (the bound and its flat filler), the merged batch, and the producer's refills with a stand-in
backend (each refill a new prompt batch, with the newest published weights). No model, no trainer."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from a3po_trl import AsyncA3POConfig
from a3po_trl.functional import group_advantages
from a3po_trl.generation import BatchProducer, GenerationBackend, ScoredBatch
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights
from a3po_trl.rollout.dynamic_sampling import (
    DynamicSampler,
    GroupAccumulator,
    keep_groups,
    merge_groups,
    resolve_group_filter,
)
from a3po_trl.rollout.trajectories import NO_VERSION

NAN = float("nan")


def keep_if_any_positive(rewards):
    """A user filter at module level (picklable): keep groups where some completion scored above 0."""
    return bool((rewards.nan_to_num(0.0) > 0).any())


# ---- the filter -----------------------------------------------------------------------------------------------------
def test_default_filter_drops_groups_whose_weighted_reward_sum_does_not_vary():
    # three groups of 2, two reward functions weighted 1 and 0.5
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 2.0], [2.0, 0.0], [0.0, NAN], [NAN, NAN]])
    weights = torch.tensor([1.0, 0.5])
    # group 0: 1, 1 (flat); group 1: 2, 2 (flat once weighted, though each function varies); group 2: 0 and unscored
    assert keep_groups(rewards, 2, weights) == [False, False, False]
    rewards[1, 0] = 1.5  # group 0 now 1, 1.5
    assert keep_groups(rewards, 2, weights) == [True, False, False]
    both_unscored = torch.tensor([[NAN], [NAN]])
    assert keep_groups(both_unscored, 2, torch.ones(1)) == [False]
    with pytest.raises(ValueError, match="whole groups"):
        keep_groups(torch.zeros(3, 1), 2, torch.ones(1))


def test_under_normalize_then_sum_the_default_filter_keeps_a_group_whose_weighted_raw_sum_is_flat():
    # raw weighted sums 0 + 2 and 2 + 0 agree, but each function is normalised within the group before the sum:
    # the trainer's advantages for this group are not 0, so it carries a signal
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    weights = torch.tensor([1.0, 2.0])
    advantages, _, _ = group_advantages(rewards, weights, 2, aggregation="normalize_then_sum")
    assert advantages.abs().min() > 0.5
    assert keep_groups(rewards, 2, weights, aggregation="normalize_then_sum") == [True]
    assert keep_groups(rewards, 2, weights, aggregation="sum_then_normalize") == [False]  # sums 2, 2: flat there
    sampler = DynamicSampler(1, 2, 1, weights, pad_token_id=0, aggregation="normalize_then_sum")
    assert sampler.keep(SimpleNamespace(rewards_per_func=rewards)) == [True]


#: Exactly representable rewards and weights (so a flat group is flat bit for bit), NaN for a function's None.
_REWARDS = st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0, NAN])
_WEIGHTS = st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0])


@st.composite
def _reward_batches(draw):
    groups, num_generations, functions = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rows = groups * num_generations
    rewards = draw(st.lists(_REWARDS, min_size=rows * functions, max_size=rows * functions))
    weights = draw(st.lists(_WEIGHTS, min_size=functions, max_size=functions))
    # float64: the rounding of a group's mean (which centring turns into advantages of ~1e-7 in float32, magnified
    # by a small batch std under normalize_then_sum) stays far below the smallest real advantage of these rewards
    rewards = torch.tensor(rewards, dtype=torch.float64).view(rows, functions)
    return rewards, torch.tensor(weights, dtype=torch.float64), num_generations


@settings(max_examples=300, deadline=None)
@given(
    _reward_batches(),
    st.sampled_from(["group", "batch", "none"]),
    st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
)
def test_the_default_filter_drops_exactly_the_groups_whose_advantages_are_all_zero(batch, scale_rewards, aggregation):
    rewards, weights, num_generations = batch
    keep = keep_groups(rewards, num_generations, weights, aggregation=aggregation)
    advantages, _, _ = group_advantages(rewards, weights, num_generations, scale_rewards, aggregation)
    for group, kept in enumerate(keep):
        group_advantages_ = advantages[group * num_generations : (group + 1) * num_generations]
        all_zero = torch.allclose(group_advantages_, torch.zeros_like(group_advantages_), atol=1e-9)
        assert kept != all_zero, (group, group_advantages_)


def test_a_user_filter_sees_each_groups_rewards_per_function():
    seen = []

    def record(rewards):
        seen.append(rewards.shape)
        return keep_if_any_positive(rewards)

    rewards = torch.tensor([[0.0], [0.0], [0.0], [3.0]])
    assert keep_groups(rewards, 2, torch.ones(1), record) == [False, True]
    assert seen == [torch.Size([2, 1])] * 2


def test_the_filter_setting_resolves_a_dotted_path_and_refuses_what_does_not_import():
    assert resolve_group_filter(None) is None
    assert resolve_group_filter(keep_if_any_positive) is keep_if_any_positive
    assert resolve_group_filter("test_group_filter.keep_if_any_positive").__name__ == "keep_if_any_positive"
    with pytest.raises(ValueError, match="dynamic_sampling_filter='no_such_module.f': importing no_such_module"):
        resolve_group_filter("no_such_module.f")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        resolve_group_filter("test_group_filter.nothing")
    with pytest.raises(ValueError, match="dotted import path"):
        resolve_group_filter("flat")


def test_config_validates_the_bound_and_a_filter_that_a_checkpoint_cannot_save(tmp_path):
    def config(**kwargs):
        return AsyncA3POConfig(str(tmp_path), use_cpu=True, dynamic_sampling=True, **kwargs)

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="dynamic_sampling_max_gen_batches=.* must be an integer >= 1"):
            config(dynamic_sampling_max_gen_batches=bad)
    with pytest.raises(ValueError, match="define the function at module level"):
        config(dynamic_sampling_filter=lambda rewards: True)
    custom = config(dynamic_sampling_filter=keep_if_any_positive)
    assert custom.dynamic_sampling_max_gen_batches == 10
    # loggers (TensorBoard) write the config as JSON: the function as its import path
    assert json.loads(custom.to_json_string())["dynamic_sampling_filter"] == f"{__name__}.keep_if_any_positive"
    assert not AsyncA3POConfig(str(tmp_path), use_cpu=True).dynamic_sampling


# ---- which groups make the batch ------------------------------------------------------------------------------------
def test_kept_groups_fill_the_batch_in_draw_order_and_the_surplus_is_dropped():
    accumulator = GroupAccumulator(groups_needed=3, max_draws=10)
    accumulator.add([True, False, False])
    assert accumulator.wants_more
    accumulator.add([False, True, False])
    accumulator.add([True, True, True])
    assert not accumulator.wants_more and not accumulator.bound_reached
    assert accumulator.selection() == [(0, 0), (1, 1), (2, 0)]
    assert accumulator.filtered_groups() == 4  # the flat groups of the first two draws


def test_a_full_first_draw_draws_nothing_more():
    accumulator = GroupAccumulator(groups_needed=2, max_draws=10)
    accumulator.add([True, True])
    assert not accumulator.wants_more and accumulator.selection() == [(0, 0), (0, 1)]
    assert accumulator.filtered_groups() == 0


def test_at_the_bound_the_flat_groups_of_the_last_draw_complete_the_batch():
    accumulator = GroupAccumulator(groups_needed=3, max_draws=2)
    accumulator.add([False, True, False])
    accumulator.add([False, False, True])
    assert not accumulator.wants_more and accumulator.bound_reached
    # the two kept groups, then the first flat group of the last draw
    assert accumulator.selection() == [(0, 1), (1, 2), (1, 0)]
    assert accumulator.filtered_groups() == 3  # 4 rejected, one of them trained as filler
    flat = GroupAccumulator(groups_needed=2, max_draws=3)
    for _ in range(3):
        flat.add([False, False])
    assert flat.bound_reached and flat.selection() == [(2, 0), (2, 1)] and flat.filtered_groups() == 4


# ---- the merged batch -----------------------------------------------------------------------------------------------
def scored(prompt_width, completion_width, rewards, version, tag):
    rows = len(rewards)
    return ScoredBatch(
        index=-1,
        version=version,
        tensors={
            "prompt_ids": torch.full((rows, prompt_width), 5),
            "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
            "completion_ids": torch.full((rows, completion_width), 7),
            "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
            "behavior_logps": torch.full((rows, completion_width), -0.5 * (version + 1)),
            "token_versions": torch.full((rows, completion_width), version),
        },
        rewards_per_func=torch.tensor(rewards).view(rows, 1),
        is_truncated=torch.zeros(rows, dtype=torch.bool),
        completion_lengths=torch.full((rows,), completion_width),
        texts={"prompt": [f"{tag}{i}" for i in range(rows)], "completion": ["c"] * rows},
        timings={"generation": 1.0},
        rows=[{"prompt": f"{tag}{i}"} for i in range(rows)],
        extra_logs={"note": [f"{tag}{i}" for i in range(rows)]},
        logged_metrics={"m": [float(version)]},
    )


def test_merged_rows_keep_their_tokens_versions_and_behavior_logps_repadded():
    first = scored(2, 3, [1.0, 1.0, 0.0, 1.0], version=0, tag="a")  # groups of 2: flat, signal
    second = scored(4, 5, [0.0, 2.0, 3.0, 3.0], version=2, tag="b")  # signal, flat
    second.tensors["tool_mask"] = torch.tensor([[1, 0, 0, 1, 1]] * 4)  # a rollout_func's env_mask, in one draw
    merged = merge_groups([first, second], [(0, 1), (1, 0)], num_generations=2, pad_token_id=0)
    assert merged.tensors["tool_mask"].tolist() == [[1] * 5] * 2 + [[1, 0, 0, 1, 1]] * 2
    assert merged.texts["prompt"] == ["a2", "a3", "b0", "b1"] == [row["prompt"] for row in merged.rows]
    assert merged.extra_logs["note"] == ["a2", "a3", "b0", "b1"]
    assert merged.rewards_per_func.view(-1).tolist() == [0.0, 1.0, 0.0, 2.0]
    t = merged.tensors
    assert t["prompt_ids"].shape == (4, 4) and t["completion_ids"].shape == (4, 5)
    assert t["prompt_ids"][0].tolist() == [0, 0, 5, 5] and t["prompt_mask"][0].tolist() == [0, 0, 1, 1]  # left pad
    assert t["completion_ids"][0].tolist() == [7, 7, 7, 0, 0] and t["completion_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert t["token_versions"][0].tolist() == [0, 0, 0, NO_VERSION, NO_VERSION]
    assert t["token_versions"][2].tolist() == [2] * 5
    assert t["behavior_logps"][0, :3].tolist() == [-0.5] * 3 and t["behavior_logps"][3].tolist() == [-1.5] * 5
    assert merged.timings["generation"] == 2.0  # both draws were paid for
    assert merged.logged_metrics["m"] == [0.0, 2.0]
    assert merged.version == 0


# ---- the sampler and the producer's refills ------------------------------------------------------------------------
class Backend(GenerationBackend):
    def __init__(self):
        layout = StagingLayout({"w": torch.Size([1])}, {"w": torch.float32}, torch.device("cpu"))
        super().__init__(VersionedWeights(layout, ParameterGather()), torch.device("cpu"))

    def load_weights(self, weights, version):
        pass

    def generate(self, prompt_ids, should_stop, seed):
        raise NotImplementedError


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def make_producer(flat_prompts, num_batches, max_draws, on_draw=None):
    """Batches of two groups of 2; a prompt in ``flat_prompts`` gets the same reward for both completions."""
    backend = Backend()
    draws = []

    def rollout(backend, rows, should_stop, state, draw):
        draws.append((draw, rows[0]["prompt"], backend.version))
        if on_draw is not None:
            on_draw(draw)
        rewards = []
        for row in rows[::2]:
            rewards += [1.0, 1.0] if row["prompt"] in flat_prompts else [0.0, 1.0]
        batch = scored(1, 1, rewards, backend.version, "p")
        batch.rows, batch.texts["prompt"] = rows, [row["prompt"] for row in rows]
        return batch

    prompts = iter([[{"prompt": p}] * 2 + [{"prompt": p + 1}] * 2 for p in range(0, 1000, 2)])
    sampler = DynamicSampler(
        groups_needed=2, num_generations=2, max_draws=max_draws, reward_weights=torch.ones(1), pad_token_id=0
    )
    producer = BatchProducer(
        backend, prompts, rollout, lambda i: 0, num_batches, queue_size=4, poll_interval=0.01, refill=sampler.fill
    )
    return producer, draws


def test_refills_draw_new_prompts_with_the_newest_weights_until_the_batch_carries_signal_only():
    module, holder = Policy(), []

    def publish_during_the_first_refill(draw):
        if draw == 1:  # the trainer publishes version 1 while the first refill is generated
            with torch.no_grad():
                module.w.fill_(1.0)
            holder[0].publish(module, 1)

    # prompts 0, 2, 3, 5 flat: batch 0 draws (0, 1), (2, 3), (4, 5) and keeps 1 and 4; batch 1 draws (6, 7)
    producer, draws = make_producer({0, 2, 3, 5}, num_batches=2, max_draws=10, on_draw=publish_during_the_first_refill)
    holder.append(producer)
    producer.start(module, 0, trainer_state=None)
    try:
        first, _ = producer.get()
        second, _ = producer.get()
    finally:
        producer.stop()
    assert [row["prompt"] for row in first.rows[::2]] == [1, 4]
    assert first.sampling_stats == {"draws": 3.0, "filtered_groups": 4.0, "bound_reached": 0.0, "prompts_drawn": 6.0}
    assert [row["prompt"] for row in second.rows[::2]] == [6, 7] and second.sampling_stats["draws"] == 1.0
    assert [draw for draw, _, _ in draws] == [0, 1, 2, 3]  # each draw numbered: its own sampling seed
    assert producer.draw_starts() == {0: 0, 1: 3, 2: 4}
    # the refill after the publication generated with version 1; each row keeps the version that generated it
    assert [version for _, _, version in draws] == [0, 0, 1, 1]
    assert first.version == 0 and first.tensors["token_versions"].view(-1).tolist() == [0, 0, 1, 1]


def test_an_all_flat_stream_ends_each_batch_at_the_bound_with_a_warning(caplog):
    producer, draws = make_producer(set(range(1000)), num_batches=3, max_draws=3)
    producer.start(Policy(), 0)
    with caplog.at_level(logging.WARNING, logger="a3po_trl.rollout.dynamic_sampling"):
        try:
            batches = [producer.get()[0] for _ in range(3)]
        finally:
            producer.stop()
    assert len(draws) == 9
    assert all(b.sampling_stats["bound_reached"] == 1.0 and b.sampling_stats["draws"] == 3.0 for b in batches)
    # the flat groups drawn last complete each batch
    assert [row["prompt"] for row in batches[0].rows[::2]] == [4, 5]
    warnings = [r.getMessage() for r in caplog.records if "dynamic_sampling_max_gen_batches=3" in r.getMessage()]
    assert len(warnings) == 2  # the 1st and 2nd time, then the 4th, 8th, ...
