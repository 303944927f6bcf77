"""The vLLM backends, for real, on this CPU (``vllm-cpu``): weight versions reach the engine, log-probs match the
trainer's, training keeps its staleness bound, LoRA versions are adapters, faults end the run cleanly.

These run only where vLLM is installed (``scripts/setup_vllm.sh`` builds that environment; ``scripts/test.sh``
runs them, as CI does).
"""

import logging
import os
import time

import pytest
import torch
from helpers import COMMON as TRAINER_COMMON
from helpers import free_port, logged
from tiny import length_reward, make_prompts, make_tokenizer, make_vllm_model
from vllm_launch import launch_two_processes, start_server, stop_server, wait_healthy
from vllm_lockstep import check_lockstep_reports

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer  # noqa: E402
from a3po_trl.generation import GenerationStopped  # noqa: E402
from a3po_trl.padding import pad_rows  # noqa: E402

pytestmark = pytest.mark.vllm

#: fp32 engine against the fp32 training forward: what vLLM's CPU kernels differ by (measured ~1e-6 on this model).
LOGP_TOLERANCE = 1e-4

COMMON = {
    **TRAINER_COMMON,
    "bf16": False,  # the trainer's forward in fp32, as the engine: the log-probs must then agree to kernel rounding
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 256,
}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def lora_config(**overrides):
    from peft import LoraConfig

    return LoraConfig(
        **{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **overrides}
    )


def make_vllm_trainer(tokenizer, tmp_path, peft_config=None, **overrides):
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 4, **overrides})
    return AsyncA3POTrainer(
        model=make_vllm_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def trainer_logps(trainer, prompt_ids, completion_ids):
    """The training forward's log-probs of each completion (one row per prompt), unpadded."""
    pad = trainer._tokenizer.pad_token_id
    prompts, prompt_mask = pad_rows(prompt_ids, pad, "left")
    completions, completion_mask = pad_rows(completion_ids, pad, "right")
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompts, completions], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completions.size(1),
        )[0]
    return [row[: len(ids)] for row, ids in zip(logps, completion_ids)]


@torch.no_grad()
def perturb(module):
    for param in module.parameters():
        if param.requires_grad:
            param.add_(torch.randn_like(param) * 0.05)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_published_version_reaches_the_engine_and_its_logps_match_the_trainer(tokenizer, tmp_path, lora):
    trainer = make_vllm_trainer(tokenizer, tmp_path, peft_config=lora_config() if lora else None)
    backend = trainer._build_backend()
    try:
        module = trainer._unwrapped_model()
        if lora:
            assert backend.trainable_names and all("lora_" in name for name in backend.trainable_names)
        prompts = [tokenizer(text)["input_ids"] for text in ("hello there", "a", "The quick brown fox jumps")]
        previous = None
        for version in range(3):
            if version:
                perturb(module)
            backend.publish(module, version)
            assert backend.refresh() and backend.version == version
            out = backend.generate(prompts, None, seed=1234)
            again = backend.generate(prompts, None, seed=1234)
            assert out.completion_ids == again.completion_ids  # a batch's seed fixes its samples
            for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
                assert (engine - trained).abs().max().item() < LOGP_TOLERANCE
            if previous is not None:
                assert out.completion_ids != previous or version == 0
            previous = out.completion_ids
        if lora:
            assert backend._lora_request.lora_name.endswith("-v2")  # one adapter per version, the base never reloaded
        backend.reset()  # a second train() starts again from a version the engine already loaded
        backend.publish(module, 2)
        assert backend.refresh()
        out = backend.generate(prompts, None, seed=5)
        for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
            assert (engine - trained).abs().max().item() < LOGP_TOLERANCE
    finally:
        backend.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_with_vllm_keeps_the_staleness_bound_and_matches_the_engine(tokenizer, tmp_path, lora):
    trainer = make_vllm_trainer(
        tokenizer, tmp_path, peft_config=lora_config() if lora else None, max_staleness=1, max_steps=4
    )
    trainer.train()
    engine = trainer.last_batch_producer
    assert engine.produced == engine.consumed == engine.num_batches == 4
    assert max(logged(trainer, "a3po/staleness_max")) == 1
    versions = [int(v) for v in logged(trainer, "async/generator_version")]
    assert versions == sorted(versions) and versions[-1] >= 1  # later batches came from newer weights
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert mismatch and max(mismatch) < LOGP_TOLERANCE  # tokens of the current version: engine == trainer
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))
    trainer._backend.close()


def test_dynamic_sampling_with_a_colocated_engine_and_lora_trains_signal_carrying_groups(tokenizer, tmp_path):
    """Refills generate with the engine (new prompts, the newest adapter) and keep the engine's log-probs."""
    draws = []

    def half_flat(completions, answer, **kwargs):  # a constant for every other prompt
        draws.append(answer[0])
        return [1.0 if int(a) % 4 == 3 else r for a, r in zip(answer, length_reward(completions))]

    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"),
        **{**COMMON, "max_steps": 3, "max_staleness": 1, "dynamic_sampling": True, "per_device_train_batch_size": 8},
    )
    trainer = AsyncA3POTrainer(
        model=make_vllm_model(tokenizer),
        reward_funcs=[half_flat],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    try:
        trainer.train()
    finally:
        trainer._backend.close()
    assert len(draws) > 3 and any(int(a) % 4 == 3 for a in draws)  # flat groups were drawn...
    assert logged(trainer, "frac_reward_zero_std") == [0.0] * 3  # ... and dropped
    assert sum(logged(trainer, "a3po/dynamic_sampling_extra_batches")) == len(draws) - 3
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert mismatch and max(mismatch) < LOGP_TOLERANCE  # rows of every draw carry the engine's log-probs


def test_every_colocated_batch_is_generated_by_the_version_it_is_tagged_with(tokenizer, tmp_path, monkeypatch):
    """The engine's own report (``CompletionOutput.weight_versions``, the label set at every load) of every token of
    every batch of a run is the version the batch is tagged with (the version loaded at every engine step of it); a
    batch sampled by other weights fails."""
    from a3po_trl.generation.vllm import colocate
    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch

    reported = []
    check = colocate.check_token_versions

    def recording(outputs, step_versions):
        labels = {span.version for output in outputs for done in output.outputs for span in done.weight_versions}
        reported.append((labels, {v for row in step_versions for v in row}))
        return check(outputs, step_versions)

    monkeypatch.setattr(colocate, "check_token_versions", recording)
    trainer = make_vllm_trainer(tokenizer, tmp_path, max_staleness=1, max_steps=3)
    trainer.train()
    tags = [int(v) for v in logged(trainer, "async/generator_version")]
    assert len(tags) == 3 and tags[-1] >= 1
    assert reported == [({str(tag)}, {tag}) for tag in tags]
    backend = trainer._backend
    try:
        backend.llm.update_weight_version("elsewhere")  # weights changed behind the backend's back
        with pytest.raises(WeightVersionMismatch, match="by 'elsewhere'"):
            backend.generate([[5, 6, 7]], None, seed=1)
    finally:
        backend.close()


def test_a_multi_turn_rollout_generates_every_turn_with_the_engine_and_its_logps_match(tokenizer, tmp_path):
    """A rollout_func continues each completion after appended 'environment' tokens (a second engine call on the
    longer prefix): the engine's log-probs of both turns match the trainer's forward over the whole sequence, and the
    appended tokens carry no version and stay out of the loss."""
    feedback = tokenizer(" [ok] ", add_special_tokens=False)["input_ids"]

    def rollout(prompts, trainer):
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        first = trainer.generate_completions(prompt_ids)
        second = trainer.generate_completions([p + c + feedback for p, c in zip(prompt_ids, first["completion_ids"])])
        rows = zip(first["completion_ids"], first["logprobs"], second["completion_ids"], second["logprobs"])
        out = {"prompt_ids": prompt_ids, "completion_ids": [], "logprobs": [], "env_mask": []}
        for c1, l1, c2, l2 in rows:
            out["completion_ids"].append(c1 + feedback + c2)
            out["logprobs"].append(l1 + [0.0] * len(feedback) + l2)
            out["env_mask"].append([1] * len(c1) + [0] * len(feedback) + [1] * len(c2))
        return out

    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 2, "max_staleness": 0})
    trainer = AsyncA3POTrainer(
        model=make_vllm_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16, conversational=False),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.train()
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert len(mismatch) == 2 and max(mismatch) < LOGP_TOLERANCE  # staleness 0 everywhere: every model token
    assert logged(trainer, "completions/mean_length")[0] > len(feedback)  # both turns generated something
    trainer._backend.close()


def test_lora_configs_vllm_cannot_serve_are_merged_and_still_match(tokenizer, tmp_path, caplog):
    trainer = make_vllm_trainer(tokenizer, tmp_path, peft_config=lora_config(use_dora=True))
    with caplog.at_level(logging.WARNING):
        backend = trainer._build_backend()
    assert "DoRA" in caplog.text and "merged" in caplog.text
    try:
        module = trainer._unwrapped_model()
        prompts = [tokenizer(text)["input_ids"] for text in ("hello", "2+2=")]
        for version in range(2):
            if version:
                perturb(module)
            backend.publish(module, version)
            backend.refresh()
            out = backend.generate(prompts, None, seed=7)
            for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
                assert (engine - trained).abs().max().item() < LOGP_TOLERANCE
    finally:
        backend.close()


def test_stop_ends_a_running_batch_within_a_decoding_step(tokenizer, tmp_path):
    trainer = make_vllm_trainer(tokenizer, tmp_path, max_completion_length=200)
    backend = trainer._build_backend()
    try:
        backend.publish(trainer._unwrapped_model(), 0)
        backend.refresh()
        prompts = [tokenizer("count to a thousand")["input_ids"]] * 4
        polls = []

        def stop_after_two_steps():  # the stop is asked for once per decoding step: set after the second
            polls.append(time.perf_counter())
            return len(polls) > 2

        start = time.perf_counter()
        with pytest.raises(GenerationStopped):
            backend.generate(prompts, stop_after_two_steps, seed=0)
        assert len(polls) == 3  # seen at the first step after it was set, with up to 200 tokens left to decode
        assert time.perf_counter() - start < 5
        assert not backend.llm.llm_engine.has_unfinished_requests()  # aborted, nothing left running
        assert len(backend.generate(prompts[:1], None, seed=0).completion_ids) == 1  # the engine is still usable
    finally:
        backend.close()


# ---- server mode: a real `trl vllm-serve` on this machine -----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tokenizer):
    """One server for the module, on a saved tiny model; the tests that leave it with other weights run last."""
    root = tmp_path_factory.mktemp("vllm-server")
    make_vllm_model(tokenizer).save_pretrained(root / "model")
    port = free_port()
    log_path = root / "server.log"
    process = start_server(root / "model", port, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path)
        yield {"url": url, "port": port, "model": root / "model", "process": process}
    finally:
        stop_server(process)


def make_server_trainer(tokenizer, tmp_path, server, peft_config=None, **overrides):
    from transformers import AutoModelForCausalLM

    settings = {**COMMON, "vllm_mode": "server", "vllm_server_base_url": server["url"], "max_steps": 4, **overrides}
    return AsyncA3POTrainer(
        model=AutoModelForCausalLM.from_pretrained(server["model"]),
        reward_funcs=[length_reward],
        args=AsyncA3POConfig(output_dir=str(tmp_path / "out"), **settings),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def _check_versions_against_trainer(trainer, backend, tokenizer):
    module = trainer._unwrapped_model()
    prompts = [tokenizer("hello there")["input_ids"]] * 2 + [tokenizer("The quick brown fox")["input_ids"]] * 2
    for version in range(3):
        if version:
            perturb(module)
        backend.publish(module, version)
        assert backend.refresh() and backend.version == version
        out = backend.generate(prompts, None, seed=99)
        assert out.completion_ids[0] != out.completion_ids[1]  # each row of a group samples its own completion
        assert backend.generate(prompts, None, seed=99).completion_ids == out.completion_ids
        for engine, trained in zip(out.logps, trainer_logps(trainer, prompts, out.completion_ids)):
            assert (engine - trained).abs().max().item() < LOGP_TOLERANCE


def test_server_lora_versions_are_adapters_whose_logps_match_the_trainer(tokenizer, tmp_path, vllm_server):
    trainer = make_server_trainer(tokenizer, tmp_path, vllm_server, peft_config=lora_config())
    backend = trainer._build_backend()
    try:
        _check_versions_against_trainer(trainer, backend, tokenizer)
        assert backend._adapter[0].endswith("-v2")
    finally:
        backend.close()


def test_server_rows_of_one_history_sample_their_own_completions_reproducibly(tokenizer, tmp_path, vllm_server):
    """Rows that are not in groups (a later turn, a rollout_func call): two rows with the same prompt must not share
    a random stream, and the batch's seed still fixes every row's sample."""
    trainer = make_server_trainer(tokenizer, tmp_path, vllm_server)
    backend = trainer._build_backend()  # generates with whatever weights the server holds: only the streams matter
    try:
        a, b = tokenizer("hello there")["input_ids"], tokenizer("The quick brown fox")["input_ids"]
        out = backend.generate([a, b, a, b], None, seed=123)
        assert out.completion_ids[0] != out.completion_ids[2] and out.completion_ids[1] != out.completion_ids[3]
        assert backend.generate([a, b, a, b], None, seed=123).completion_ids == out.completion_ids
        unseeded = backend.generate([a, b, a, b], None, seed=None)
        assert unseeded.completion_ids[0] != unseeded.completion_ids[2]
    finally:
        backend.close()


def test_training_against_the_server_with_lora_keeps_the_staleness_bound(tokenizer, tmp_path, vllm_server):
    """Runs before the full-weight tests, which leave the server with other base weights."""
    trainer = make_server_trainer(
        tokenizer, tmp_path, vllm_server, peft_config=lora_config(), max_staleness=1, max_steps=3
    )
    trainer.train()
    engine = trainer.last_batch_producer
    assert engine.produced == engine.consumed == engine.num_batches == 3
    assert max(logged(trainer, "a3po/staleness_max")) == 1
    versions = [int(v) for v in logged(trainer, "async/generator_version")]
    assert trainer._backend._adapter[0].endswith(f"-v{versions[-1]}")  # the last batch's version, as an adapter
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert mismatch and max(mismatch) < LOGP_TOLERANCE
    trainer._backend.close()


def _check_two_process_run(result, reports):
    """Both processes trained 3 steps on their own batches within the staleness bound, their engines' log-probs of
    the sampled tokens match the trainer's for each version, and the advantages are GRPOTrainer's over both
    processes' rewards."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert sorted(reports) == [0, 1]
    for r in reports.values():
        assert r["world_size"] == 2 and "error" not in r
        assert r["global_step"] == 3 and r["batches_consumed"] == 3
        assert 0 <= r["max_staleness_seen"] <= 1
        assert r["mismatch_max"] and max(r["mismatch_max"]) < LOGP_TOLERANCE
        assert "a3po-generation" not in r["threads_alive"]  # the generation thread is joined
    from a3po_trl.functional import group_advantages

    for step in range(3):
        calls = [reports[rank]["advantage_calls"][step] for rank in range(2)]
        assert calls[0]["rewards"] == calls[1]["rewards"]  # every process sees every process's rewards
        rewards = torch.tensor(calls[0]["rewards"])
        assert rewards.shape == (8, 1)  # 2 processes x 4 completions
        expected, _, _ = group_advantages(rewards, torch.ones(1), 4, scale_rewards="batch")
        local = reports[0]["local_advantages"][step] + reports[1]["local_advantages"][step]
        assert torch.allclose(torch.tensor(sorted(local)), torch.sort(expected).values, atol=1e-6)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("vllm-model") / "model"
    make_vllm_model(tokenizer).save_pretrained(directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_training_processes_each_generate_with_their_own_colocated_engine(tmp_path, saved_model, lora):
    """DDP on two CPU processes (gloo), vllm_mode='colocate': an in-process engine per process, loaded with that
    process's published versions."""
    result, _, reports = launch_two_processes(tmp_path, saved_model, "colocate", *(["--lora"] if lora else []))
    _check_two_process_run(result, reports)


@pytest.mark.slow
def test_two_ddp_processes_colocated_engines_load_versions_mid_batch(tmp_path, saved_model):
    """in_flight_weight_updates under DDP with an engine per process (full weights, the switch points fixed by the
    schedule): every process's batches 2 and 3 switch mid-batch to the version every process published."""
    result, _, reports = launch_two_processes(tmp_path, saved_model, "colocate", "--in-flight", "--steps", "4")
    assert result.returncode == 0 and sorted(reports) == [0, 1], result.stderr[-6000:]
    assert all(r["distributed_type"] == "DistributedType.MULTI_CPU" for r in reports.values())
    check_lockstep_reports(list(reports.values()))


@pytest.mark.slow
def test_an_engine_failing_in_one_process_ends_both_processes(tmp_path, saved_model):
    """Process 1's engine raises on its second batch: that process's train() raises naming the cause, and the other
    process's, instead of waiting for it in the collectives that follow, raises naming process 1 and the cause."""
    result, seconds, reports = launch_two_processes(tmp_path, saved_model, "colocate", "--fail-rank", "1", timeout=600)
    assert result.returncode != 0
    assert "engine failure injected in process 1" in reports[1]["error"]
    assert reports[0]["error"].startswith("PeerProcessFailed: Taking the next generation batch failed on process 1: ")
    assert "engine failure injected in process 1" in reports[0]["error"], reports[0]["error"]
    assert "a3po-generation" not in reports[1]["threads_alive"]
    assert seconds < 400  # the launcher returned: no rank was left waiting (a hang would run into the timeout)


@pytest.mark.slow
def test_two_training_processes_share_one_server_with_their_own_adapters(tmp_path, vllm_server):
    """DDP on two CPU processes (gloo), one server: each process loads its own adapter per version."""
    result, _, reports = launch_two_processes(
        tmp_path, vllm_server["model"], "server", "--url", vllm_server["url"], "--lora"
    )
    _check_two_process_run(result, reports)
    assert reports[0]["adapter"][0] != reports[1]["adapter"][0]  # each process its own adapter


def test_every_server_batch_is_generated_by_the_version_the_server_is_labelled_with(tokenizer, tmp_path, vllm_server):
    import requests

    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch

    trainer = make_server_trainer(tokenizer, tmp_path, vllm_server)
    backend = trainer._build_backend()
    url, prompts = vllm_server["url"], [[5, 6, 7], [5, 6, 7]]
    try:
        for version in range(2):
            backend.publish(trainer._unwrapped_model(), version)
            assert backend.refresh()
            assert requests.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": str(version)}
            backend.generate(prompts, None, seed=1)
        requests.post(f"{url}/update_weight_version", json={"new_version": "elsewhere"}, timeout=10)
        with pytest.raises(WeightVersionMismatch, match="'elsewhere' before"):
            backend.generate(prompts, None, seed=1)
    finally:
        backend.close()


def test_server_full_weight_versions_reload_and_their_logps_match_the_trainer(tokenizer, tmp_path, vllm_server):
    trainer = make_server_trainer(tokenizer, tmp_path, vllm_server)
    backend = trainer._build_backend()
    try:
        _check_versions_against_trainer(trainer, backend, tokenizer)
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("reproducible", [False, True], ids=["newest", "reproducible"])
def test_two_training_processes_share_one_full_weight_server(tmp_path, vllm_server, reproducible):
    """DDP on two CPU processes (gloo), one server with full weights: every batch of every process is generated by
    the version it is tagged with (the log-probs match the trainer's for it), and each version reaches the server
    once, loaded by whichever process needed it first; reproducibly, every batch by exactly its scheduled version, and
    a second run samples the same completions."""
    extra, url = ["--reproducible"] if reproducible else [], vllm_server["url"]
    result, _, reports = launch_two_processes(tmp_path, vllm_server["model"], "server", "--url", url, *extra)
    _check_two_process_run(result, reports)
    used = {version for r in reports.values() for _, version, _, _ in r["batches"]}
    assert sum(r["shared_switches"] for r in reports.values()) == len(used)  # forward only: each version loaded once
    for r in reports.values():
        assert [index for index, _, _, _ in r["batches"]] == [0, 1, 2]
        assert all(version >= needed for _, version, needed, _ in r["batches"])
        if reproducible:
            assert [version for _, version, _, _ in r["batches"]] == [needed for _, _, needed, _ in r["batches"]]
    if reproducible:  # the same completions again, although the server batches the processes' requests differently
        (tmp_path / "again").mkdir()
        again = launch_two_processes(tmp_path / "again", vllm_server["model"], "server", "--url", url, *extra)[2]
        for rank in range(2):
            assert [b[3] for b in again[rank]["batches"]] == [b[3] for b in reports[rank]["batches"]]


@pytest.mark.slow
def test_a_generation_failing_in_one_process_sharing_a_full_weight_server_ends_both(tmp_path, vllm_server):
    """Process 1's generation raises on its second batch while process 0 may be waiting for it to finish with the
    server's version: both processes end, each naming the cause, no rank left waiting."""
    result, seconds, reports = launch_two_processes(
        tmp_path, vllm_server["model"], "server", "--url", vllm_server["url"], "--fail-rank", "1", timeout=600
    )
    assert result.returncode != 0
    assert sorted(reports) == [0, 1], result.stderr[-3000:]
    for report in reports.values():  # process 0: its own generation's error or the agreement's, both naming the cause
        assert "engine failure injected in process 1" in report["error"], report["error"]
    assert "a3po-generation" not in reports[1]["threads_alive"]
    assert seconds < 400  # the launcher returned: no rank was left waiting (a hang would run into the timeout)


def test_server_down_at_start_is_an_error_naming_the_url_within_the_timeout(tokenizer, tmp_path):
    from a3po_trl.generation.vllm.server import VLLMServerError

    url = f"http://127.0.0.1:{free_port()}"
    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"),
        **{**COMMON, "vllm_mode": "server", "vllm_server_base_url": url},
        vllm_server_timeout=2,
        max_steps=2,
    )
    trainer = AsyncA3POTrainer(
        model=make_vllm_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    with pytest.raises(VLLMServerError, match=f"{url}.*vllm_server_timeout=2"):
        trainer.train()
    assert time.perf_counter() - start < 30


def test_a_weight_sync_that_hangs_fails_after_its_timeout(tokenizer, tmp_path, vllm_server):
    import socket

    from a3po_trl.generation.vllm.server import VLLMServerError

    trainer = make_server_trainer(tokenizer, tmp_path, vllm_server, weight_sync_timeout=1.0)
    backend = trainer._build_backend()
    silent = socket.socket()  # accepts connections, never answers: a server stuck in a weight load
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        backend.base_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend.publish(trainer._unwrapped_model(), 0)
        start = time.perf_counter()
        with pytest.raises(VLLMServerError, match="did not answer within 1.0 s"):
            backend.refresh()
        assert time.perf_counter() - start < 10
        assert backend.version == -1  # the version did not count as loaded
    finally:
        silent.close()
        backend.close()


def test_training_against_the_server_then_its_death_ends_train_within_seconds_checkpoint_intact(
    tokenizer, tmp_path, vllm_server
):
    """Runs last: it kills the module's server."""
    import signal

    from transformers import TrainerCallback

    from a3po_trl.generation.vllm.server import VLLMServerError

    killed_at = {}

    class KillServerAfterStep(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.killpg(vllm_server["process"].pid, signal.SIGKILL)
                vllm_server["process"].wait(30)
                killed_at["time"] = time.perf_counter()

    trainer = make_server_trainer(
        tokenizer, tmp_path, vllm_server, max_steps=8, max_staleness=1, save_strategy="steps", save_steps=1
    )
    trainer.add_callback(KillServerAfterStep())
    with pytest.raises(VLLMServerError, match=vllm_server["url"]):
        trainer.train()
    assert time.perf_counter() - killed_at["time"] < 15
    assert not trainer.last_batch_producer.thread.is_alive()  # joined
    mismatch = logged(trainer, "a3po/behavior_mismatch_max")
    assert mismatch and max(mismatch) < LOGP_TOLERANCE
    checkpoint = tmp_path / "out" / "checkpoint-2"
    from transformers import AutoModelForCausalLM

    restored = AutoModelForCausalLM.from_pretrained(checkpoint)  # the last checkpoint loads whole
    assert (checkpoint / "trainer_state.json").exists() and restored is not None


@pytest.mark.slow
def test_backends_benchmark_reports_every_field(tokenizer, tmp_path):
    """``benchmarks/backends.py`` on a tiny saved model, generate against in-process vLLM (the SmolLM2 numbers in the
    docs/BENCHMARKS.md come from the same script)."""
    import json
    import subprocess
    import sys

    model_dir = tmp_path / "model"
    make_vllm_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "backends.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [
        sys.executable, "-m", "benchmarks.backends", "--model", str(model_dir), "--backends", "generate,vllm-colocate",
        "--steps", "3", "--warmup", "1", "--batch", "4", "--num-generations", "4", "--max-completion-length", "8",
        "--max-model-len", "512", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=900, cwd=root)
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["results"]] == ["generate", "vllm-colocate"]
    for row in report["results"]:
        assert row["seconds_per_step"] > 0 and row["generation_tokens_per_second"] > 0
        assert row["pipelining_ideal"] == max(row["generation_seconds_per_batch"], row["training_seconds_per_step"])
        # the ratio as defined (a bound on it would assert a timing, which a loaded machine moves)
        assert row["ratio_to_ideal"] == pytest.approx(row["seconds_per_step"] / row["pipelining_ideal"])
    assert "| vllm-colocate |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_a_shared_full_weight_server_killed_mid_run_ends_both_processes_within_seconds(tmp_path, tokenizer):
    """Two processes share a server of their own; process 0 kills it once checkpoint 2 is saved: both processes'
    train() fail with an error naming the server's URL within seconds, their generation threads joined, and the last
    checkpoint loads whole."""
    model_dir = tmp_path / "model"
    make_vllm_model(tokenizer).save_pretrained(model_dir)
    port = free_port()
    server = start_server(model_dir, port, tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, tmp_path / "server.log")
        result, _, reports = launch_two_processes(
            tmp_path, model_dir, "server", "--url", url, "--steps", "8", "--kill-server", str(server.pid),
            "--kill-at-step", "2", timeout=600,
        )  # fmt: skip
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 9)
    assert result.returncode != 0
    assert sorted(reports) == [0, 1], result.stderr[-3000:]
    killed_at = reports[0]["killed_at"]
    for r in reports.values():
        assert url in r["error"], r["error"]
        assert r["ended_at"] - killed_at < 30
        assert "a3po-generation" not in r["threads_alive"]
        assert 2 <= r["global_step"] < 8
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists()
    assert AutoModelForCausalLM.from_pretrained(checkpoint) is not None
