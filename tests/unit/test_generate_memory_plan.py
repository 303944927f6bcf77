"""The ``generate`` backend's memory plan on a GPU (issue 57, item 7): what its own stream's pool holds at a decode
step (the KV cache and the sampling logits), autocast's half-precision copies of float32 training weights, staging in
pinned host memory when the GPU is too full for the staged copy, and a warning (with ``expandable_segments``) when
even then the plan leaves less than the reserve. Real model sizes on the meta device; a CUDA device passed as data."""

import pytest
import torch
from helpers import make_trainer
from tiny import make_meta_qwen25

from a3po_trl.builders import generator_setup
from a3po_trl.generation.weights.memory_plan import (
    DEVICE_STAGING_RESERVE,
    GeneratorSetup,
    kv_bytes_per_token,
    plan_generator_memory,
    plan_generator_memory_choosing_staging,
)

BF16, FP32 = torch.bfloat16, torch.float32
CPU, GPU = torch.device("cpu"), torch.device("cuda:0")
GIB = 2**30


def items(plan):
    return {item.what: item.bytes for item in plan.items}


def test_the_kv_cache_per_token_follows_the_models_grouped_query_attention():
    config = make_meta_qwen25("7b").config  # 28 layers, 4 key-value heads of 128 (28 query heads over 3584)
    assert kv_bytes_per_token(config, BF16) == 2 * 28 * 4 * 128 * 2 == 57344
    assert kv_bytes_per_token(config, FP32) == 2 * 57344
    config.head_dim = 64  # an explicit head size wins over hidden_size / heads
    assert kv_bytes_per_token(config, BF16) == 2 * 28 * 4 * 64 * 2


def generate_setup(**changes):
    """Qwen2.5-1.5B, full fine-tuning on one H100, fp32 weights under bf16 autocast, 64 completions of 1024 tokens."""
    model = make_meta_qwen25("1.5b")
    setup = dict(
        backend="generate", generation_device=GPU, training_device=GPU, dtype=BF16, device_total_bytes=80 * GIB,
        generation_rows=64, completion_tokens=1024, kv_bytes_per_token=kv_bytes_per_token(model.config, BF16),
        vocab_size=model.config.vocab_size, autocast_copy_dtype=BF16,
    )  # fmt: skip
    return GeneratorSetup(**{**setup, **changes})


def test_the_generate_plan_counts_its_decode_pool_and_autocasts_copies():
    model = make_meta_qwen25("1.5b").to(FP32)
    n = sum(p.numel() for p in model.parameters())
    plan = items(plan_generator_memory(model, generate_setup()))
    kv = 64 * 1024 * 2 * 28 * 2 * 128 * 2  # rows x tokens x (keys and values x layers x 2 heads x 128 x bf16)
    assert plan["generate: KV cache, 64 rows x 1024 completion tokens (prompts add theirs)"] == kv  # 3.5 GiB
    assert plan["generate: sampling logits, 64 rows x 151936 (float32, x2)"] == 64 * 151936 * 4 * 2
    assert plan["training under bfloat16 autocast: copies of its float32 weights"] == 2 * n
    half_weights = items(plan_generator_memory(model.to(BF16), generate_setup()))  # nothing for autocast to copy
    assert half_weights["training under bfloat16 autocast: copies of its float32 weights"] == 0
    without = items(plan_generator_memory(model, generate_setup(generation_rows=0, autocast_copy_dtype=None)))
    assert not any(what.startswith(("generate:", "training under")) for what in without)


def test_generate_stages_in_pinned_host_memory_when_the_gpu_copy_would_eat_the_reserve():
    """Qwen2.5-7B under FSDP2 on 8 H100s: the whole-model generator copy and one staged version, 14.2 GiB each."""
    model = make_meta_qwen25("7b")
    version = 2 * sum(p.numel() for p in model.parameters())
    setup = generate_setup(
        sharded=True, gradient_shards=8, optimizer_shards=8, kv_bytes_per_token=kv_bytes_per_token(model.config, BF16),
        vocab_size=model.config.vocab_size, autocast_copy_dtype=None, processes_on_node=8,
    )  # fmt: skip
    host = plan_generator_memory(model, GeneratorSetup(**{**setup.__dict__, "staging_device": CPU}))
    reserve = int(DEVICE_STAGING_RESERVE * setup.device_total_bytes)
    roomy = plan_generator_memory_choosing_staging(model, setup, {"cuda:0": 75 * GIB})
    assert roomy.staging_location == "device cuda:0" and roomy.device_bytes == host.device_bytes + version
    assert "fits beside the generator" in roomy.staging_reason and roomy.reserve_warning({"cuda:0": 75 * GIB}) is None
    tight_free = host.device_bytes + version + reserve - 1  # the GPU copy would leave one byte under the reserve
    tight = plan_generator_memory_choosing_staging(model, setup, {"cuda:0": tight_free})
    assert tight.staging_location == "pinned host memory" and tight.pinned_host_bytes == version
    assert tight.device_bytes == roomy.device_bytes - version  # 14.2 GiB less on the GPU
    assert version / GIB > 14 and "kept for activations" in tight.staging_reason
    assert tight.reserve_warning({"cuda:0": tight_free}) is None  # on the host, the reserve is kept
    assert "pinned host memory" in tight.describe()
    lora_like = plan_generator_memory_choosing_staging(model, setup, {"cuda:0": tight_free + 1})
    assert lora_like.staging_location == "device cuda:0"


def test_a_plan_left_under_the_reserve_is_warned_of_with_expandable_segments_and_the_settings_that_lower_it():
    model = make_meta_qwen25("7b")
    setup = generate_setup(
        sharded=True, gradient_shards=8, optimizer_shards=8, kv_bytes_per_token=kv_bytes_per_token(model.config, BF16),
        vocab_size=model.config.vocab_size, autocast_copy_dtype=None, staging_sets=4,
    )  # fmt: skip
    free = {"cuda:0": 40 * GIB}
    plan = plan_generator_memory_choosing_staging(model, setup, free)
    assert plan.staging_location == "pinned host memory"
    plan.check(free)  # it fits: not refused
    warning = plan.reserve_warning(free)
    for words in ("under the 20% (16.0 GiB)", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                  "reproducible_generation=False", "vllm_mode='server'"):  # fmt: skip
        assert words in warning, words
    assert plan.reserve_warning({}) is None  # free memory unknown: nothing said


@pytest.mark.parametrize("bf16", [False, True])
def test_a_runs_setup_reads_the_decode_pool_and_autocast_from_its_arguments_and_model(tokenizer, tmp_path, bf16):
    trainer = make_trainer(tokenizer, tmp_path, bf16=bf16, generation_batch_chunk_size=None)
    setup = generator_setup(trainer)
    config = trainer.model.config
    held = BF16 if bf16 else FP32  # the generator's copy is in the mixed-precision dtype
    assert setup.generation_rows == trainer.args.generation_batch_size  # one process: the whole batch at once
    assert setup.completion_tokens == trainer.args.max_completion_length
    assert setup.kv_bytes_per_token == kv_bytes_per_token(config, held) > 0
    assert setup.vocab_size == config.vocab_size
    assert setup.autocast_copy_dtype == (BF16 if bf16 else None)  # fp32 weights under bf16 autocast
    chunked = generator_setup(make_trainer(tokenizer, tmp_path, generation_batch_chunk_size=2))
    assert chunked.generation_rows == 2
    assert not setup.keeps_previous_weights  # loglinear keeps no weights; guarded does, whole on one process
    guarded = generator_setup(make_trainer(tokenizer, tmp_path, prox_logp_method="guarded"))
    assert guarded.keeps_previous_weights and guarded.parameter_shards == 1


def test_the_guarded_methods_kept_weights_are_counted_and_warned_of_when_they_eat_the_reserve():
    """``prox_logp_method="guarded"`` keeps a copy of the trainable weights on the training device: Qwen2.5-7B in
    bf16 unsharded, 14.2 GiB per GPU (28.4 in fp32), an eighth of it under FSDP2 or ZeRO-3 on 8 GPUs, the adapters
    only with LoRA; a plan it pushes under the reserve is warned of, naming it (also on a training GPU that does not
    generate)."""
    from a3po_trl.generation.weights.memory_plan import KEPT_WEIGHTS

    model = make_meta_qwen25("7b").to(BF16)
    n = sum(p.numel() for p in model.parameters())
    setup = generate_setup(
        kv_bytes_per_token=kv_bytes_per_token(model.config, BF16), vocab_size=model.config.vocab_size,
        autocast_copy_dtype=None, staging_device=CPU, training_state_allocated=True,
    )  # fmt: skip
    assert KEPT_WEIGHTS not in items(plan_generator_memory(model, setup))  # not guarded: nothing kept
    guarded = generate_setup(**{**setup.__dict__, "keeps_previous_weights": True})
    kept = items(plan_generator_memory(model, guarded))[KEPT_WEIGHTS]
    assert kept == 2 * n and 14 < kept / GIB < 14.5
    assert items(plan_generator_memory(model.to(FP32), guarded))[KEPT_WEIGHTS] == 4 * n  # fp32 trainable weights
    sharded = generate_setup(**{**guarded.__dict__, "sharded": True, "parameter_shards": 8})
    assert items(plan_generator_memory(model.to(BF16), sharded))[KEPT_WEIGHTS] == 2 * n // 8
    for name, parameter in model.named_parameters():  # LoRA-like: only some weights train
        parameter.requires_grad_("q_proj" in name)
    adapters = 2 * sum(p.numel() for name, p in model.named_parameters() if "q_proj" in name)
    assert items(plan_generator_memory(model, guarded))[KEPT_WEIGHTS] == adapters
    model.requires_grad_(True)

    without = plan_generator_memory(model, setup)
    reserve = DEVICE_STAGING_RESERVE * setup.device_total_bytes
    free = {"cuda:0": int(without.device_bytes + reserve + GIB)}  # room for the reserve, not for the kept copy too
    assert without.reserve_warning(free) is None
    warning = plan_generator_memory(model, guarded).reserve_warning(free)
    assert "14.2 GiB are prox_logp_method='guarded''s kept copy" in warning
    assert "prox_logp_method='loglinear'" in warning and "LoRA" in warning and "FSDP2 or ZeRO-3" in warning
    apart = {**guarded.__dict__, "generation_device": torch.device("cuda:1"), "training_device_total_bytes": 80 * GIB}
    apart_plan = plan_generator_memory(model, generate_setup(**apart))
    assert "of cuda:0 free" in apart_plan.reserve_warning({"cuda:0": int(reserve), "cuda:1": 80 * GIB})
