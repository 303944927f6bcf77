"""In-flight weight updates in the ``generate`` backend (a3po_trl/generation/hf/in_flight.py): a version published
while a batch is generated is loaded between two decode steps, every token is tagged with the version that sampled
it, and its behavior log-prob is exactly what those weights gave it over the KV cache as it was; and the settings
the feature cannot honour are refused before any model loads (a3po_trl/validation.py)."""

import copy

import pytest
import torch
from tiny import length_reward, make_model
from transformers import DynamicCache, GenerationConfig

from a3po_trl import AsyncA3POConfig
from a3po_trl.generation import HFGenerateBackend, HFGenerationSettings
from a3po_trl.rollout import RolloutSettings, run_rollout
from a3po_trl.validation import check_supported

TEMPERATURE = 0.8
SWITCH_AFTER = 4  # tokens sampled by version 0 before version 1 is published
NEW_TOKENS = 10
PROMPTS = ["abcd", "wxyz", "1234", "q+r="]  # 4 byte tokens each: no padding, so the replay needs no position ids


def _settings(tokenizer, in_flight: bool) -> HFGenerationSettings:
    config = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return HFGenerationSettings(
        generation_config=config,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        temperature=TEMPERATURE,
        in_flight_updates=in_flight,
    )


def _rollout_settings(tokenizer) -> RolloutSettings:
    return RolloutSettings(
        tokenize_prompts=lambda prompts, tools: [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
        decode=lambda ids, prompt_ids, prompts: tokenizer.batch_decode(ids, skip_special_tokens=True),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        reward_funcs=[length_reward],
        reward_func_names=["length_reward"],
        reward_processing_classes=[None],
        sampling_seeds=lambda index: 1234,
    )


def _two_versions(tokenizer):
    """Version 0 (a tiny random model) and version 1 (the same, every weight moved)."""
    old = make_model(tokenizer, seed=3).eval()
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return old, new


def _publish_mid_generation(backend, module, version: int, before_forward: int):
    """Publish ``module`` as ``version`` from inside the generator's forward number ``before_forward`` (1: the
    prefill), before it runs: the forward still uses the loaded weights, and the next decode step the new ones."""
    forwards = [0]

    def hook(_module, args, kwargs):
        forwards[0] += 1
        if forwards[0] == before_forward:
            backend.publish(module, version)

    return backend.module.register_forward_pre_hook(hook, with_kwargs=True)


def _replay(models_by_version, prompt_ids, generated, step_versions) -> torch.Tensor:
    """Teacher-forced decoding of ``generated`` after ``prompt_ids`` over one shared KV cache, each step's forward
    run by the version that sampled that step: the log-probs each token got when it was sampled, ``(B, N)``."""
    cache = DynamicCache()
    out = models_by_version[step_versions[0]](input_ids=prompt_ids, past_key_values=cache, use_cache=True)
    columns = []
    for step in range(generated.size(1)):
        logps = torch.log_softmax(out.logits[:, -1].float() / TEMPERATURE, dim=-1)
        columns.append(logps.gather(1, generated[:, step : step + 1]).squeeze(1))
        if step + 1 < generated.size(1):
            model = models_by_version[step_versions[step + 1]]
            out = model(input_ids=generated[:, step : step + 1], past_key_values=cache, use_cache=True)
    return torch.stack(columns, dim=1)


def _full_forward(model, prompt_ids, generated) -> torch.Tensor:
    """Log-probs of ``generated`` under one full-sequence forward of ``model`` (no cache from other weights)."""
    logits = model(input_ids=torch.cat([prompt_ids, generated], dim=1)).logits[:, prompt_ids.size(1) - 1 : -1]
    return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(2, generated.unsqueeze(2)).squeeze(2)


@torch.no_grad()
def test_a_version_published_mid_batch_samples_the_rest_and_each_token_keeps_its_own_log_prob(tokenizer):
    old, new = _two_versions(tokenizer)
    backend = HFGenerateBackend(old, _settings(tokenizer, in_flight=True))
    backend.publish(old, 0)
    backend.refresh()
    handle = _publish_mid_generation(backend, new, 1, before_forward=SWITCH_AFTER)
    batch = run_rollout(_rollout_settings(tokenizer), backend, [{"prompt": p} for p in PROMPTS])
    handle.remove()

    tensors = batch.tensors
    mask = tensors["completion_mask"].bool()
    lengths = mask.sum(dim=1)
    assert (lengths > SWITCH_AFTER).all(), "every completion must outlive the switch"
    expected = torch.tensor([0] * SWITCH_AFTER + [1] * (tensors["token_versions"].size(1) - SWITCH_AFTER))
    assert torch.equal(tensors["token_versions"][mask], expected.expand_as(mask)[mask])
    assert (tensors["token_versions"][~mask] == -1).all()
    assert backend.version == 1
    assert batch.timings["in_flight_weight_loads"] == 1 and batch.timings["in_flight_weight_load"] > 0

    # the replay: the same tokens, each step's forward by the version that sampled it, over the cache as it was
    prompt_ids = tensors["prompt_ids"]
    generated = tensors["completion_ids"]
    step_versions = expected.tolist()
    replayed = _replay({0: old, 1: new}, prompt_ids, generated, step_versions)
    recorded = tensors["behavior_logps"]
    assert torch.allclose(recorded[mask], replayed[mask], atol=1e-5)
    # and they are not what either version alone gives: before the switch version 0's, after it a mix (version 1's
    # forward over version 0's cache of the earlier tokens), which a full forward of version 1 does not reproduce
    after = mask.clone()
    after[:, :SWITCH_AFTER] = False
    assert not torch.allclose(recorded[after], _replay({0: old, 1: old}, prompt_ids, generated, step_versions)[after])
    assert (recorded[after] - _full_forward(new, prompt_ids, generated)[after]).abs().max() > 1e-3
    before = mask & ~after
    assert torch.allclose(recorded[before], _full_forward(old, prompt_ids, generated)[before], atol=1e-5)


@torch.no_grad()
def test_without_in_flight_updates_a_version_published_mid_batch_waits_for_the_next_batch(tokenizer):
    old, new = _two_versions(tokenizer)
    backend = HFGenerateBackend(old, _settings(tokenizer, in_flight=False))
    backend.publish(old, 0)
    backend.refresh()
    handle = _publish_mid_generation(backend, new, 1, before_forward=SWITCH_AFTER)
    batch = run_rollout(_rollout_settings(tokenizer), backend, [{"prompt": p} for p in PROMPTS])
    handle.remove()
    mask = batch.tensors["completion_mask"].bool()
    assert (batch.tensors["token_versions"][mask] == 0).all() and backend.version == 0
    assert "in_flight_weight_loads" not in batch.timings
    assert backend.refresh() and backend.version == 1  # loaded between batches, as before


def _config(tmp_path, **overrides):
    return AsyncA3POConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        report_to="none",
        in_flight_weight_updates=True,
        **overrides,
    )


@pytest.mark.parametrize(
    "overrides, kwargs, error, fix",
    [
        ({"behavior_logps_source": "forward"}, {}, ValueError, "behavior_logps_source='generation'"),
        ({"reproducible_generation": True}, {}, ValueError, "in_flight_weight_updates=False for reproducible"),
        ({"async_generation": False}, {}, ValueError, "async_generation=True"),
        ({}, {"rollout_func": lambda prompts, trainer: {}}, NotImplementedError, "rollout_func"),
    ],
)
def test_what_in_flight_updates_cannot_do_is_refused_before_any_model_loads(tmp_path, overrides, kwargs, error, fix):
    with pytest.raises(error, match="in_flight_weight_updates=True") as raised:
        check_supported(_config(tmp_path, **overrides), kwargs)
    assert fix in str(raised.value)
    check_supported(_config(tmp_path), {})  # the supported setting passes


def _vllm_config(tmp_path, mode):
    args = _config(tmp_path)
    args.use_vllm, args.vllm_mode = True, mode  # set after construction: no vLLM is needed to be checked
    return args


def test_in_flight_updates_with_a_vllm_server_pass_shared_or_not_and_lora_is_refused(tmp_path, monkeypatch):
    from peft import LoraConfig

    check_supported(_vllm_config(tmp_path, "server"), {})  # full weights: loaded mid-batch through pause / resume
    with pytest.raises(NotImplementedError, match="vllm_mode='server' and LoRA") as raised:
        check_supported(_vllm_config(tmp_path, "server"), {"peft_config": LoraConfig(r=4)})
    assert "cannot switch a running request to another adapter" in str(raised.value)
    server, colocate = _vllm_config(tmp_path, "server"), _vllm_config(tmp_path, "colocate")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_supported(server, {})  # a server shared by two training processes (see .shared_server)
    check_supported(colocate, {})  # one engine per process


def test_in_flight_updates_with_vllm_colocate_pass_and_with_lora_are_refused(tmp_path):
    from peft import LoraConfig

    check_supported(_vllm_config(tmp_path, "colocate"), {})  # full weights: the engine loads between steps
    with pytest.raises(NotImplementedError, match="use_vllm=True and LoRA") as raised:
        check_supported(_vllm_config(tmp_path, "colocate"), {"peft_config": LoraConfig(r=4)})
    assert "cannot switch a running request to another adapter" in str(raised.value)
    assert "in_flight_weight_updates=False" in str(raised.value)
    for overrides in ({"behavior_logps_source": "forward"}, {"reproducible_generation": True}):
        args = _vllm_config(tmp_path, "colocate")
        for name, value in overrides.items():
            setattr(args, name, value)
        with pytest.raises((ValueError, NotImplementedError), match="in_flight_weight_updates=True"):
            check_supported(args, {})  # every other refusal holds with vLLM too


def test_in_flight_updates_is_a_flag_and_a_yaml_key_of_the_command(tmp_path):
    from a3po_trl.cli.arguments import make_parser

    parser = make_parser()
    config = tmp_path / "config.yaml"
    config.write_text("in_flight_weight_updates: true\n")
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    assert parser.parse_args_and_config(base)[1].in_flight_weight_updates is False
    for argv in (["--in_flight_weight_updates", "true"], ["--config", str(config)]):  # (a config sets defaults)
        assert parser.parse_args_and_config([*base, *argv])[1].in_flight_weight_updates is True


@pytest.mark.parametrize(
    "labelled, statuses, fix",
    [
        (False, {}, "vLLM >= 0.32"),
        (True, {"/is_paused": 404}, "VLLM_SERVER_DEV_MODE=1"),
        (True, {"/inference/v1/generate": 403}, "--enable-scale-out"),
        (True, {"/inference/v1/generate": 404}, "--enable-scale-out"),
    ],
)
def test_a_server_without_the_routes_in_flight_loads_need_is_refused_naming_the_flag(labelled, statuses, fix):
    from types import SimpleNamespace

    import requests

    from a3po_trl.generation.vllm.server import VLLMServerError
    from a3po_trl.generation.vllm.server_in_flight import check_in_flight_server

    def request(method, url, **kwargs):  # a server with every route unless `statuses` says otherwise
        path = url.removeprefix("http://server")
        return SimpleNamespace(status_code=statuses.get(path, 400 if path.startswith("/inference") else 200))

    backend = SimpleNamespace(
        base_url="http://server", request_timeout=1.0, _labelled=labelled, _requests=requests,
        _session=SimpleNamespace(request=request),
    )  # fmt: skip
    with pytest.raises(VLLMServerError, match="in_flight_weight_updates=True with the vLLM server") as raised:
        check_in_flight_server(backend)
    assert fix in str(raised.value) and "in_flight_weight_updates=False" in str(raised.value)
    check_in_flight_server(
        SimpleNamespace(
            **{
                **vars(backend),
                "_labelled": True,
                "_session": SimpleNamespace(
                    request=lambda method, url, **kwargs: SimpleNamespace(
                        status_code=400 if "inference" in url else 200
                    )
                ),
            }
        )
    )
