"""The weight path to the generator (:mod:`a3po_trl.generation.weights`): which dtype the generator holds, where the
versions are staged, the generator's own copies, parameter names across wrappers, and the memory plan.

Every GPU-class failure is made visible here on the CPU: dtypes are checked under bf16 mixed precision, a CUDA device
is passed as data to the rules that depend on it, and real model sizes are planned on the meta device."""

import os
import sys
import types

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import make_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from a3po_trl.generation.vllm.make_backend import engine_dtype
from a3po_trl.generation.vllm.sampling import VLLMSamplingSettings
from a3po_trl.generation.vllm.weight_loading import vllm_staging_layout, write_lora_adapter
from a3po_trl.generation.weights import (
    ParameterGather,
    StagingLayout,
    VersionedWeights,
    checkpoint_dtype,
    generator_dtype,
    vllm_weight_name,
)
from a3po_trl.generation.weights.copies import generator_copy, unsharded_copy
from a3po_trl.generation.weights.memory_plan import GeneratorMemoryError, GeneratorSetup, plan_generator_memory
from a3po_trl.generation.weights.store import STAGING_ALIGNMENT

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CPU, GPU = torch.device("cpu"), torch.device("cuda:0")


# ---- the dtype rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend, device, mixed_precision, checkpoint, expected",
    [
        ("generate", CPU, "no", FP32, None),  # a float32 CPU run generates with exactly the training weights
        ("generate", GPU, "no", BF16, None),  # generate in full precision: as the trainer holds the weights
        ("generate", GPU, "bf16", FP32, BF16),  # fp32 master weights (FSDP2 upcast, ModelConfig.dtype) under bf16
        ("generate", CPU, "bf16", FP32, BF16),
        ("generate", GPU, "fp16", BF16, FP16),
        ("vllm", CPU, "no", BF16, None),  # float32 stays the CPU choice (vLLM's auto would pick bf16 there)
        ("vllm", GPU, "no", FP32, BF16),  # vLLM's auto on a GPU: a float32 checkpoint is served in bf16
        ("vllm", GPU, "no", FP16, FP16),  # ... and a half-precision one in its own dtype
        ("vllm", GPU, "no", None, BF16),
        ("vllm", GPU, "bf16", FP32, BF16),
        ("vllm", CPU, "fp16", FP32, FP16),
    ],
)
def test_the_generator_holds_the_dtype_the_trainer_computes_in(backend, device, mixed_precision, checkpoint, expected):
    rule = generator_dtype(backend=backend, device=device, mixed_precision=mixed_precision, checkpoint=checkpoint)
    assert rule == expected


def test_a_gpu_without_bfloat16_serves_a_float32_checkpoint_in_float16():
    rule = generator_dtype(backend="vllm", device=GPU, mixed_precision="no", checkpoint=FP32, bf16_supported=False)
    assert rule == FP16


def test_checkpoint_dtype_reads_the_config_in_either_spelling(tokenizer):
    config = make_model(tokenizer).config
    config.dtype = "bfloat16"
    assert checkpoint_dtype(config) == BF16
    config.dtype = torch.float16
    assert checkpoint_dtype(config) == FP16


def test_the_vllm_engine_of_a_float32_model_on_a_gpu_is_not_float32(monkeypatch, tokenizer):
    """The 7B out-of-memory: a model loaded in float32 (TRL's ModelConfig default) made a float32 engine."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    model = make_model(tokenizer)  # float32 weights, float32 config
    assert engine_dtype(model, CPU, "no") == FP32
    assert engine_dtype(model, GPU, "no") == BF16
    assert engine_dtype(model, GPU, "bf16") == BF16
    assert engine_dtype(model.to(FP16), GPU, "no") == BF16  # the checkpoint's dtype decides, as vLLM's auto


# ---- the staging store ---------------------------------------------------------------------------------------------
def test_versions_are_staged_in_the_generator_dtype_and_allocated_on_first_publish(tokenizer):
    model = make_model(tokenizer)
    names = [name for name, _ in model.named_parameters()]
    weights = VersionedWeights(StagingLayout.of(model, names, CPU, BF16), ParameterGather())
    assert weights.allocated_sets == 0
    weights.publish(model, 0)
    assert weights.allocated_sets == 1
    captured = {}
    assert weights.load_newer(-1, None, lambda buffers, v, state: captured.update(buffers)) == 0
    for name, param in model.named_parameters():
        assert captured[name].dtype == BF16 and torch.equal(captured[name], param.detach().to(BF16))
    weight_bytes = 2 * sum(p.numel() for p in model.parameters())  # one buffer, each view aligned
    assert weight_bytes <= weights.layout.bytes_per_version < weight_bytes + STAGING_ALIGNMENT * len(names)


class DroppingGather(ParameterGather):
    """A gather that loses the last parameter (a bug in a gather must not publish a half-written version)."""

    def full_tensors(self, named_params):
        named_params = list(named_params)
        yield from super().full_tensors(named_params[:-1])


def test_a_version_missing_a_weight_is_refused_and_its_buffer_reused(tokenizer):
    model = make_model(tokenizer)
    names = [name for name, _ in model.named_parameters()]
    weights = VersionedWeights(StagingLayout.of(model, names, CPU), DroppingGather())
    with pytest.raises(RuntimeError, match="lack"):
        weights.publish(model, 0)
    assert weights.versions == [] and weights.newest == -1
    weights.gather = ParameterGather()
    weights.publish(model, 1)
    assert weights.versions == [1] and weights.allocated_sets == 1  # the half-written set was reused


def test_vllm_staging_is_in_host_memory_pinned_when_the_engine_is_on_a_gpu(tokenizer):
    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"]))
    on_gpu = vllm_staging_layout(model, BF16, GPU)
    assert on_gpu.device == CPU and on_gpu.pin_memory  # never a second whole model on the GPU
    assert set(on_gpu.dtypes.values()) == {BF16}
    assert sorted(on_gpu.shapes) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    on_cpu = vllm_staging_layout(model, None, CPU)
    assert not on_cpu.pin_memory and set(on_cpu.dtypes.values()) == {FP32}


# ---- the generator's copies ----------------------------------------------------------------------------------------
def test_the_generator_copy_casts_its_own_weights_shares_frozen_ones_and_keeps_buffers(tokenizer):
    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    copy = generator_copy(model, CPU, BF16, share_frozen=True)
    source, own = dict(model.named_parameters()), dict(copy.named_parameters())
    for name, param in source.items():
        if param.requires_grad:
            assert own[name].dtype == BF16 and own[name] is not param and not own[name].requires_grad
            assert torch.equal(own[name], param.detach().to(BF16))
        else:
            assert own[name] is param  # the frozen base: the trainer's own tensor, not a copy
    for (name, buffer), (_, original) in zip(copy.named_buffers(), model.named_buffers()):
        assert buffer.dtype == original.dtype, name  # rotary frequencies keep float32


def test_the_unsharded_copy_is_built_on_the_meta_device_in_its_dtype_without_drawing_random_numbers(tokenizer):
    model = make_model(tokenizer, tie_word_embeddings=True)
    state = torch.random.get_rng_state()
    copy = unsharded_copy(model, ParameterGather(), CPU, BF16)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # tied weights stay tied
    for name, param in model.named_parameters():
        own = dict(copy.named_parameters())[name]
        assert own.dtype == BF16 and not own.is_meta and torch.equal(own, param.detach().to(BF16))
    assert all(not buffer.is_meta for buffer in copy.buffers())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # it computes: the same logits as the bf16 original
        torch.testing.assert_close(copy(ids).logits, model.to(BF16)(ids).logits, rtol=0, atol=0)


def test_the_unsharded_copy_matches_names_through_activation_checkpointing_wrappers(tokenizer):
    """accelerate's FSDP2 activation checkpointing wraps each decoder layer: its parameters are named
    ``..._checkpoint_wrapped_module...``, which the copy (built from the config, unwrapped) is not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_model(tokenizer)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    copy = unsharded_copy(model, ParameterGather(), CPU)
    assert not any("_checkpoint_wrapped_module" in name for name, _ in copy.named_parameters())


def test_weight_names_lose_every_wrapper_vllm_and_lora_files_do_not_know(tmp_path, tokenizer):
    assert (
        vllm_weight_name(
            "base_model.model.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.base_layer.weight"
        )
        == "model.layers.0.self_attn.q_proj.weight"
    )
    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"]))
    weights = {
        name.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): p
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    write_lora_adapter(str(tmp_path), weights, model.peft_config["default"], "default")
    from safetensors.torch import load_file

    keys = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert keys and not any("_checkpoint_wrapped_module" in key or ".default." in key for key in keys)


def test_adapter_files_saved_from_a_wrapped_model_are_renamed_in_place(tmp_path):
    """PEFT writes an adapter's tensors under the model's own module names, activation-checkpointing wrappers
    included; the saved files must load into a model without them."""
    from safetensors.torch import load_file, save_file

    from a3po_trl.generation.weights.names import strip_checkpoint_wrapper_from_files

    wrapped = "base_model.model.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.lora_A.weight"
    (tmp_path / "ref").mkdir()
    save_file({wrapped: torch.ones(2)}, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})
    save_file({"plain.weight": torch.zeros(1)}, tmp_path / "ref" / "adapter_model.safetensors")
    assert strip_checkpoint_wrapper_from_files(str(tmp_path)) == [str(tmp_path / "adapter_model.safetensors")]
    assert list(load_file(tmp_path / "adapter_model.safetensors")) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    ]
    assert list(load_file(tmp_path / "ref" / "adapter_model.safetensors")) == ["plain.weight"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_model.safetensors", "ref"]  # no temporary left


# ---- backends under bf16 mixed precision ---------------------------------------------------------------------------
def test_the_generate_backend_under_bf16_holds_and_stages_bf16_and_keeps_an_fp32_lm_head(tokenizer):
    from transformers import GenerationConfig

    from a3po_trl.generation.hf import HFGenerateBackend, HFGenerationSettings
    from a3po_trl.patches import cast_lm_head_to_fp32

    model = make_model(tokenizer)
    settings = HFGenerationSettings(GenerationConfig(do_sample=True, max_new_tokens=4), [0], 0, autocast_dtype=BF16)
    backend = HFGenerateBackend(model, settings, patch_fn=cast_lm_head_to_fp32, dtype=BF16)
    dtypes = dict(backend.weights.layout.dtypes)
    assert dtypes.pop("lm_head.weight") == FP32 and backend.module.lm_head.weight.dtype == FP32
    assert set(dtypes.values()) == {BF16}
    assert {p.dtype for n, p in backend.module.named_parameters() if n != "lm_head.weight"} == {BF16}
    backend.publish(model, 0)
    assert backend.refresh()
    assert torch.equal(backend.module.lm_head.weight, model.lm_head.weight)  # fp32 head: exactly the trainer's
    backend.close()


class FakeLLM:
    """Stands in for ``vllm.LLM``: records its arguments and the weights of the latest reload."""

    def __init__(self, **kwargs):
        self.kwargs, self.llm_engine, self.loaded = kwargs, None, {}

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.loaded = {name: tensor.clone() for name, tensor in kwargs["weights_iterator"]}

    def reset_prefix_cache(self):
        return True  # as vLLM's, when no request holds a block


def test_the_colocated_engine_waits_for_its_loads_before_the_staging_buffer_is_released(monkeypatch, tokenizer):
    """The lock on the staging buffer is released when ``load_weights`` returns: copies still queued on the generation
    thread's stream would read a buffer the main thread is overwriting with the next version."""
    import a3po_trl.generation.vllm.colocate as colocate

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    waited = []
    monkeypatch.setattr(colocate, "wait_for_copies", lambda devices: waited.append(list(devices)))
    model = make_model(tokenizer)
    backend = colocate.VLLMColocateBackend(
        model, "unused", VLLMSamplingSettings(max_tokens=4), {"dtype": "bfloat16"}, CPU, dtype=BF16
    )
    backend.publish(model, 0)
    assert backend.refresh()
    assert waited == [[CPU]]
    assert {t.dtype for t in backend.llm.loaded.values()} == {BF16}  # staged in the engine's dtype
    backend.close()


# ---- the memory plan, on the meta device, at real sizes ------------------------------------------------------------
GB = 1e9


def qwen25_7b():
    config = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def llama3_8b():
    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def with_lora(model, dtype):
    model = model.to(dtype)
    lora = LoraConfig(
        r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    return get_peft_model(model, lora)


def items(plan):
    return {item.what: item.bytes for item in plan.items}


def numel(model, trainable_only=False):
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@pytest.fixture(scope="module")
def qwen():
    model = qwen25_7b().to(FP32)  # what FSDP2 holds under bf16 mixed precision, and ModelConfig.dtype's default
    assert 7.6e9 < numel(model) < 7.63e9  # Qwen2.5-7B's 7.62 B parameters
    return model


def test_fsdp2_over_8_gpus_full_weights_generate_plan_in_bf16_at_7b(qwen):
    """The shipped fsdp2.yaml, Qwen2.5-7B, 8 processes: the generator's copy and staging in bf16 (15.2 GB each), not
    in the fp32 of the master weights (30.5 GB each)."""
    n = numel(qwen)
    setup = GeneratorSetup(
        backend="generate", generation_device=GPU, training_device=GPU, dtype=BF16, sharded=True,
        gradient_shards=8, optimizer_shards=8,
    )  # fmt: skip
    plan = plan_generator_memory(qwen, setup)
    assert items(plan) == {
        "generator copy (whole model)": 2 * n,
        "staging, one version": 2 * n,
        "training, not allocated yet: gradients": 4 * n // 8,
        "training, not allocated yet: optimizer states": 2 * 4 * n // 8,
    }
    assert plan.bytes_on(GPU) == pytest.approx(41.9 * GB, rel=0.01)
    plan.check({"cuda:0": int(60 * GB)})  # fits an 80 GB GPU beside the 3.8 GB parameter shard
    as_trained = plan_generator_memory(qwen, GeneratorSetup(**{**setup.__dict__, "dtype": None}))
    assert as_trained.bytes_on(GPU) - plan.bytes_on(GPU) == pytest.approx(30.5 * GB, rel=0.01)
    with pytest.raises(GeneratorMemoryError, match="bf16=True") as refused:
        as_trained.check({"cuda:0": int(60 * GB)})
    assert "LoRA (peft_config)" in str(refused.value)


def test_ddp_full_weights_vllm_colocate_at_7b_refuses_an_fp32_engine_and_fits_a_bf16_one(qwen):
    n = numel(qwen)
    setup = GeneratorSetup(
        backend="vllm-colocate", generation_device=GPU, training_device=GPU, dtype=BF16,
        vllm_gpu_memory_utilization=0.3, device_total_bytes=int(80 * GB),
    )  # fmt: skip
    plan = plan_generator_memory(qwen, setup)
    assert plan.engine_weights_bytes == 2 * n
    assert items(plan)["vLLM engine (its reservation: weights + KV cache)"] == int(24 * GB)
    assert items(plan)["staging, one version"] == 2 * n and plan.bytes_on(CPU) == 2 * n  # pinned host memory
    plan.check({})
    fp32_engine = plan_generator_memory(qwen, GeneratorSetup(**{**setup.__dict__, "dtype": FP32}))
    with pytest.raises(GeneratorMemoryError, match=r"28\.4 GiB in float32") as refused:
        fp32_engine.check({})
    assert "vllm_gpu_memory_utilization" in str(refused.value)


@pytest.mark.parametrize("backend", ["generate", "vllm-colocate"])
def test_lora_at_8b_copies_and_stages_only_the_adapter(backend):
    model = with_lora(llama3_8b(), BF16)
    adapter = numel(model, trainable_only=True)
    assert 40e6 < adapter < 45e6  # r=16 on every projection of Llama-3-8B: 42 M
    setup = GeneratorSetup(
        backend=backend, generation_device=GPU, training_device=GPU, dtype=BF16,
        device_total_bytes=int(80 * GB), vllm_gpu_memory_utilization=0.3,
    )  # fmt: skip
    plan = plan_generator_memory(model, setup)
    assert items(plan)["staging, one version"] == 2 * adapter
    if backend == "generate":
        assert items(plan)["generator copy (trainable weights; frozen ones shared)"] == 2 * adapter
    assert plan.bytes_on(GPU) < (25 * GB if backend == "vllm-colocate" else 1 * GB)


def test_lora_under_fsdp2_copies_the_whole_model_and_reproducible_generation_keeps_versions():
    model = with_lora(llama3_8b(), BF16)
    setup = GeneratorSetup(
        backend="generate", generation_device=GPU, training_device=GPU, dtype=BF16, sharded=True, staging_sets=4,
        gradient_shards=8, optimizer_shards=8,
    )  # fmt: skip
    plan = plan_generator_memory(model, setup)
    adapter = numel(model, trainable_only=True)
    assert items(plan)["generator copy (whole model)"] == 2 * numel(model)
    assert items(plan)["staging, 3 more versions (reproducible_generation)"] == 3 * 2 * adapter
    with pytest.raises(GeneratorMemoryError, match="reproducible_generation=False"):
        plan.check({"cuda:0": int(10 * GB)})


def test_the_plan_is_what_the_generate_backend_allocates(tokenizer):
    """The estimate against the tensors a backend really holds, on a tiny model under bf16."""
    from transformers import GenerationConfig

    from a3po_trl.generation.hf import HFGenerateBackend, HFGenerationSettings

    model = get_peft_model(make_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    settings = HFGenerationSettings(GenerationConfig(do_sample=True), [0], 0, autocast_dtype=BF16)
    setup = GeneratorSetup(backend="generate", generation_device=CPU, training_device=CPU, dtype=BF16)
    plan = items(plan_generator_memory(model, setup))
    backend = HFGenerateBackend(model, settings, dtype=BF16)
    backend.publish(model, 0)
    copied = sum(p.numel() * p.element_size() for p in backend._own.values())
    assert plan["generator copy (trainable weights; frozen ones shared)"] == copied
    assert plan["staging, one version"] == backend.weights.allocated_sets * backend.weights.layout.bytes_per_version
    backend.close()
