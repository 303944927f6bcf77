"""The intra-op thread counts train() chooses on a CPU when the user sets neither (a3po_trl.generation.cpu_threads)."""

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, Qwen2VLConfig

from a3po_trl import AsyncA3POConfig
from a3po_trl.generation.cpu_threads import SMALL_PRODUCT, choose_cpu_threads, largest_product, split_cores

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, vocab_size=259)
#: SmolLM2-135M's sizes
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, vocab_size=49152)


def _args(**overrides):
    kwargs = dict(output_dir="out", per_device_train_batch_size=8, num_generations=8, max_completion_length=64)
    return AsyncA3POConfig(**{**kwargs, **overrides}, use_cpu=True, report_to="none")


def test_the_largest_product_is_tokens_times_hidden_times_the_widest_of_mlp_and_vocabulary():
    assert largest_product(SMOLLM2, 8, 64) == 8 * 64 * 576 * 49152 > SMALL_PRODUCT
    assert largest_product(TINY, 8, 32) == 8 * 32 * 32 * 259 < SMALL_PRODUCT
    assert largest_product(LlamaConfig(hidden_size=64, intermediate_size=4096, vocab_size=100), 1, 1) == 64 * 4096
    # a multimodal model's sizes are in its text config
    vision_language = Qwen2VLConfig(text_config=dict(hidden_size=128, intermediate_size=256, vocab_size=1000))
    assert largest_product(vision_language, 2, 4) == 2 * 4 * 128 * 1000
    assert largest_product(SimpleNamespace(hidden_size=None), 8, 64) is None


def test_small_products_run_one_intra_op_thread_each_and_large_ones_keep_pytorchs_count():
    small = choose_cpu_threads(_args(), TINY, generation_shares_cpu=True, available=2)
    assert (small.training, small.generation) == (1, 1) and "is small" in small.reason
    large = choose_cpu_threads(_args(), SMOLLM2, generation_shares_cpu=True, available=2)
    assert (large.training, large.generation) == (None, None) and "keep PyTorch's 2" in large.reason
    # the batch shape counts: SmolLM2 with two 4-token completions per micro-batch has small products
    short = choose_cpu_threads(_args(per_device_train_batch_size=2, num_generations=2, max_completion_length=4),
                               SMOLLM2, generation_shares_cpu=True, available=2)  # fmt: skip
    assert (short.training, short.generation) == (1, 1)


def test_with_generation_in_a_process_large_products_split_the_cores_between_the_two_processes():
    # two processes at PyTorch's count each spin on each other's cores (SmolLM2 on 2 cores: the step more than twice
    # the thread's): the cores are split, training taking the odd one
    large = choose_cpu_threads(_args(), SMOLLM2, generation_shares_cpu=True, available=2, generation_in_process=True)
    assert (large.training, large.generation) == (1, 1) and "split, 1 intra-op threads for training" in large.reason
    assert split_cores(2) == (1, 1) and split_cores(7) == (4, 3) and split_cores(16) == (8, 8)
    assert split_cores(1) == (1, 1)
    wide = choose_cpu_threads(_args(), SMOLLM2, generation_shares_cpu=True, available=7, generation_in_process=True)
    assert (wide.training, wide.generation) == (4, 3)
    # small products: one each, as with the thread; a config without sizes: split too (never both at every core)
    small = choose_cpu_threads(_args(), TINY, generation_shares_cpu=True, available=8, generation_in_process=True)
    assert (small.training, small.generation) == (1, 1)
    unknown = choose_cpu_threads(
        _args(), SimpleNamespace(), generation_shares_cpu=True, available=8, generation_in_process=True
    )
    assert (unknown.training, unknown.generation) == (4, 4) and "does not give its sizes" in unknown.reason
    # the user's counts are used as set, in a process too
    mine = choose_cpu_threads(
        _args(generation_num_threads=2), SMOLLM2, generation_shares_cpu=True, available=2, generation_in_process=True
    )
    assert (mine.training, mine.generation) == (None, 2) and mine.reason is None


@pytest.mark.parametrize(
    "overrides, shares, available, expected",
    [
        ({"training_num_threads": 2}, True, 2, (2, None)),  # the user's choice, as set
        ({"generation_num_threads": 1}, True, 2, (None, 1)),
        ({"training_num_threads": 2, "generation_num_threads": 2}, True, 2, (2, 2)),
        ({}, False, 2, (None, None)),  # no generation thread on this CPU: nothing to share
        ({}, True, 1, (None, None)),  # one thread already
    ],
)
def test_a_count_the_user_set_or_no_sharing_leaves_the_counts_alone(overrides, shares, available, expected):
    chosen = choose_cpu_threads(_args(**overrides), TINY, generation_shares_cpu=shares, available=available)
    assert (chosen.training, chosen.generation) == expected and chosen.reason is None


def test_a_config_without_sizes_keeps_pytorchs_count_and_says_why():
    chosen = choose_cpu_threads(_args(), SimpleNamespace(), generation_shares_cpu=True, available=2)
    assert (chosen.training, chosen.generation) == (None, None) and "does not give its sizes" in chosen.reason


def test_the_demo_sets_no_thread_counts_and_the_rule_keeps_pytorchs_count_for_its_model():
    from a3po_trl.tasks.demo_settings import demo_defaults

    defaults = demo_defaults(["--use_cpu"])
    assert defaults["bf16"] is False
    assert "generation_num_threads" not in defaults and "training_num_threads" not in defaults
    # the demo's batch on SmolLM2 (its default model): the counts train() then chooses
    shape = {k: defaults[k] for k in ("per_device_train_batch_size", "num_generations", "max_completion_length")}
    chosen = choose_cpu_threads(_args(**shape), SMOLLM2, generation_shares_cpu=True, available=2)
    assert (chosen.training, chosen.generation) == (None, None)


def test_the_time_to_accuracy_study_reruns_the_thread_split_its_records_ran(monkeypatch):
    from benchmarks import time_to_accuracy

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert time_to_accuracy._recorded_thread_split() == {"generation_num_threads": 1, "training_num_threads": 1}
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert time_to_accuracy._recorded_thread_split() == {"generation_num_threads": 2, "training_num_threads": 2}
