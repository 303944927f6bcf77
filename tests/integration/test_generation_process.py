"""``generation_process``: the ``generate`` backend in a process of its own samples what the thread backend samples,
bit for bit (completions, behavior log-probs), and a run with it trains the same weights; an error in the process is
raised with its traceback, a process that dies is named (also from ``train()``), no process outlives ``train()``, and
what it is not built for is refused."""

import functools
import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from helpers import logged, make_trainer, model_weights
from tiny import make_model, make_prompts, multiply
from transformers import GenerationConfig, TrainerCallback

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.builders.backend import check_generation_process_devices, patch_generator_copy
from a3po_trl.generation import HFGenerateBackend, HFGenerationSettings
from a3po_trl.generation.hf.process import ProcessGenerateBackend
from a3po_trl.types import GenerationStopped

SETTINGS = dict(
    reproducible_generation=True,
    max_staleness=1,
    max_steps=3,
    logging_steps=1,
    training_num_threads=1,
    generation_num_threads=1,
)
LOGGED = ["loss", "reward", "reward_std", "grad_norm", "async/generator_version"]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def _new_children(before: set) -> list:
    """The multiprocessing children started since ``before`` that are still alive (a test's own, not another's)."""
    return [child for child in multiprocessing.active_children() if child not in before]


def _settings(tokenizer) -> HFGenerationSettings:
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=8,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return HFGenerationSettings(config, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_the_process_samples_what_the_thread_samples_bit_for_bit(tokenizer, one_thread):
    model = make_model(tokenizer)
    patch = functools.partial(patch_generator_copy, temperature=1.0, cast_fp32=False)
    thread = HFGenerateBackend(model, _settings(tokenizer), patch_fn=patch)
    process = ProcessGenerateBackend(model, _settings(tokenizer), patch_fn=patch, num_threads=1)
    try:
        process.keep_versions = True  # two buffer sets: each one's handle is sent once
        for version in range(3):
            if version:
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.05 * torch.randn_like(param))
            for backend in (thread, process):
                backend.publish(model, version)
                assert backend.refresh() and backend.version == version
            expected = thread.generate(PROMPTS, None, seed=100 + version)
            got = process.generate(PROMPTS, None, seed=100 + version)
            assert got.completion_ids == expected.completion_ids
            assert any(len(ids) > 1 for ids in got.completion_ids)
            assert all(torch.equal(a, b) for a, b in zip(got.logps, expected.logps, strict=True))
            if version:
                process.release_versions_before(version)
        assert process.weights.layout.shared_memory and process.weights.allocated_sets == 2
        assert len(process._sent_buffers) == 2  # three loads, each buffer set's handle sent once
        with pytest.raises(GenerationStopped):
            process.generate(PROMPTS, lambda: True, seed=0)
        again = process.generate(PROMPTS, None, seed=102)  # the process serves on after a stop
        assert again.completion_ids == expected.completion_ids
    finally:
        process.close()
    assert process.pid is None


def test_an_error_in_the_process_is_raised_with_its_traceback_and_a_dead_process_is_named(tokenizer):
    model = make_model(tokenizer)
    backend = ProcessGenerateBackend(model, _settings(tokenizer), num_threads=1)
    try:
        backend.publish(model, 0)
        backend.refresh()
        with pytest.raises(IndexError) as info:
            backend.generate([[10**6]], None, seed=0)  # no such token: the embedding fails in the process
        assert "in the generation process while generating 1 completions" in "".join(info.value.__notes__)
        assert "the generation process's traceback" in str(info.value.__cause__)
        pid = backend.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"generation process \(pid {pid}\) died while generating.*-9"):
            backend.generate(PROMPTS, None, seed=0)
    finally:
        backend.close()


def test_a_run_in_a_generation_process_trains_the_threads_weights_bit_for_bit(tokenizer, tmp_path):
    before, runs = set(multiprocessing.active_children()), {}
    for in_process in (False, True):
        trainer = make_trainer(tokenizer, tmp_path / str(in_process), generation_process=in_process, **SETTINGS)
        trainer.train()
        runs[in_process] = trainer
        assert not _new_children(before)  # the process ended with train()
    in_thread, in_process = runs[False], runs[True]
    for key in LOGGED:
        assert logged(in_thread, key) and logged(in_thread, key) == logged(in_process, key), key
    a, b = model_weights(in_thread), model_weights(in_process)
    assert all(torch.equal(a[name], b[name]) for name in a)


class _KillGenerationProcess(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(self.trainer._backend.pid, signal.SIGKILL)


def test_a_generation_process_that_dies_fails_train_naming_it(tokenizer, tmp_path):
    before = set(multiprocessing.active_children())
    trainer = make_trainer(tokenizer, tmp_path, generation_process=True, **{**SETTINGS, "max_steps": 4})
    trainer.add_callback(_KillGenerationProcess(trainer))
    with pytest.raises(RuntimeError, match=r"generation process \(pid \d+\) died while"):
        trainer.train()
    assert not _new_children(before)


@pytest.mark.parametrize("setting", ["in_flight_weight_updates", "use_transformers_continuous_batching", "use_vllm"])
def test_what_a_generation_process_is_not_built_for_is_refused(tmp_path, setting):
    with pytest.raises(ValueError, match=f"not built for {setting}=True.*generation_process=False"):
        AsyncA3POConfig(output_dir=str(tmp_path), use_cpu=True, generation_process=True, **{setting: True})


def test_multi_turn_rollouts_and_a_gpu_are_refused_with_a_generation_process(tool_tokenizer, tmp_path):
    args = AsyncA3POConfig(output_dir=str(tmp_path), generation_process=True, use_cpu=True, report_to="none")
    with pytest.raises(NotImplementedError, match="single-turn rollouts only.*generation_process=False"):
        AsyncA3POTrainer(
            model=make_model(tool_tokenizer),
            reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
            args=args,
            train_dataset=make_prompts(8),
            processing_class=tool_tokenizer,
            tools=[multiply],
        )
    on_gpu = SimpleNamespace(
        args=SimpleNamespace(generation_device="cuda:0"), accelerator=SimpleNamespace(device=torch.device("cpu"))
    )
    with pytest.raises(ValueError, match="CPU only.*cuda:0.*CUDA IPC.*generation_process=False"):
        check_generation_process_devices(on_gpu)
