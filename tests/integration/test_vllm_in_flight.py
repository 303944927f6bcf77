"""In-flight weight updates with the colocated vLLM engine (``use_vllm=True, vllm_mode="colocate"``,
``in_flight_weight_updates=True``), for real on vLLM's CPU build: a version published while a batch is generated is
loaded between two engine steps and the batch's requests continue with it; every token carries vLLM's own label of the
weights that sampled it and the log-prob those weights gave it over the KV cache as it was; no prefix-cache block of
older weights serves a later request; training through it logs the in-flight metrics and keeps the staleness bound
per token. What the engine cannot do with it (LoRA adapters, a server) is refused with the reason.
"""

import os

import pytest
import torch
from helpers import COMMON as TRAINER_COMMON
from helpers import SWITCH_AFTER, logged
from in_flight_replay import LOGP_TOLERANCE, full_forward, long_prompts, moved, plain_copy, replay
from tiny import length_reward, make_prompts, make_tokenizer, make_vllm_model
from vllm_lockstep import EngineLockstep, StepHook

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer  # noqa: E402

pytestmark = pytest.mark.vllm

COMMON = {
    **TRAINER_COMMON,
    "bf16": False,
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 256,
    "in_flight_weight_updates": True,
}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_in_flight_trainer(tokenizer, tmp_path, model=None, **overrides):
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 4, **overrides})
    return AsyncA3POTrainer(
        model=model if model is not None else make_vllm_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory):
    """One trainer and its colocated backend (engine) for the backend-level tests; each test starts from version 0."""
    trainer = make_in_flight_trainer(tokenizer, tmp_path_factory.mktemp("in-flight"), max_completion_length=12)
    backend = trainer._build_backend()
    try:
        yield trainer, backend
    finally:
        backend.close()


def test_a_version_published_mid_batch_is_loaded_between_engine_steps_with_each_tokens_label_and_logprob(engine):
    trainer, backend = engine
    tokenizer, temperature = trainer._tokenizer, trainer.temperature
    old = plain_copy(trainer)
    new = moved(old)
    backend.reset()
    backend.publish(old, 0)
    assert backend.refresh() and backend.version == 0
    prompts = long_prompts(tokenizer, 4)
    hook = StepHook(backend, lambda step: step == SWITCH_AFTER and backend.publish(new, 1))
    try:
        out = backend.generate(prompts, None, seed=3)
    finally:
        hook.remove()

    assert backend.version == 1
    assert out.timings["in_flight_weight_loads"] == 1 and out.timings["in_flight_weight_load"] > 0
    assert all(len(ids) > SWITCH_AFTER for ids in out.completion_ids), "every completion must outlive the switch"
    # the first SWITCH_AFTER engine steps (the prefill and the decode steps after it) sampled with version 0, the rest
    # with version 1; each token's version is vLLM's own label of it
    for ids, versions in zip(out.completion_ids, out.token_versions):
        assert versions == [0] * SWITCH_AFTER + [1] * (len(ids) - SWITCH_AFTER)
    outputs = hook.in_order()
    for output, versions, ids, logps in zip(outputs, out.token_versions, out.completion_ids, out.logps):
        completion = output.outputs[0]
        labels = [span.version for span in completion.weight_versions for _ in range(span.start, span.end)]
        assert [int(label) for label in labels] == versions
        # each behavior log-prob is the engine's own log-prob of the token it sampled ...
        engine_logps = [position[token].logprob for position, token in zip(completion.logprobs, ids)]
        assert torch.equal(logps, torch.tensor(engine_logps, dtype=torch.float32))
    # ... which is what the weights that sampled it gave it over the cache as it was: a replay with the same switch
    # points, each step's forward by its version over one shared cache (the prompt and the tokens before the switch
    # computed by version 0)
    distinct = 0.0
    for prompt, ids, versions, logps in zip(prompts, out.completion_ids, out.token_versions, out.logps):
        replayed = replay({0: old, 1: new}, prompt, ids, versions, temperature)
        assert (logps - replayed).abs().max().item() < LOGP_TOLERANCE
        before = full_forward(old, prompt, ids, temperature)[:SWITCH_AFTER]
        assert (logps[:SWITCH_AFTER] - before).abs().max().item() < LOGP_TOLERANCE
        after = full_forward(new, prompt, ids, temperature)[SWITCH_AFTER:]
        distinct = max(distinct, (logps[SWITCH_AFTER:] - after).abs().max().item())
    assert distinct > 1e-3  # version 1 over version 0's cache is not version 1 alone

    # the prefix cache could not be reset while the batch's requests held their blocks; it is before the next batch,
    # whose identical prompts then get no block computed by version 0: version 1's log-probs over its own cache
    assert backend._prefix_cache_stale
    again = backend.generate(prompts, None, seed=4)
    assert not backend._prefix_cache_stale
    assert all(versions == [1] * len(versions) for versions in again.token_versions)
    for prompt, ids, logps in zip(prompts, again.completion_ids, again.logps):
        assert (logps - full_forward(new, prompt, ids, temperature)).abs().max().item() < LOGP_TOLERANCE


def test_a_load_waits_until_every_request_of_the_batch_is_scheduled(engine):
    """A request the engine has not scheduled yet looks its prompt up in the prefix cache when it is: a version is
    loaded mid-batch only once no request waits, so no block of older weights serves a request of newer ones."""
    trainer, backend = engine
    module = plain_copy(trainer)
    backend.reset()
    backend.publish(module, 0)
    backend.refresh()
    max_seqs = backend.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    prompts = long_prompts(trainer._tokenizer, max_seqs + 2)  # two wait for a free slot
    loads = []  # (engine steps done, requests waiting) at each load
    refresh = backend.refresh

    def recording_refresh(*args, **kwargs):
        loads.append((hook.steps, backend._in_flight.waiting_requests()))
        return refresh(*args, **kwargs)

    backend.refresh = recording_refresh
    hook = StepHook(backend, lambda step: step == 1 and backend.publish(moved(module), 1))
    try:
        out = backend.generate(prompts, None, seed=5)
    finally:
        hook.remove()
        del backend.refresh
    assert out.timings["in_flight_weight_loads"] == 1 and len(loads) == 1
    steps_before_load, waiting = loads[0]
    # put off from step 2 until the waiting requests were scheduled (once the first ones had ended)
    assert waiting == 0 and steps_before_load > 2
    assert all(versions[0] == 0 for versions in out.token_versions)  # every request started before the load
    assert any(1 in versions for versions in out.token_versions)  # and the late ones went on after it


def test_training_with_in_flight_loads_tags_every_token_and_logs_the_metrics(tokenizer, tmp_path, monkeypatch):
    """The trainer's runs through the colocated engine: batch ``b >= 2`` samples its first 3 tokens with version
    ``b - 2`` and the rest with ``b - 1`` (switch points fixed by the schedule, :class:`EngineLockstep`)."""
    trainer = make_in_flight_trainer(tokenizer, tmp_path, max_steps=4, max_staleness=2, max_completion_length=12)
    lockstep = EngineLockstep(trainer, monkeypatch.setattr, lag=2, num_batches=4)
    try:
        trainer.train()
    finally:
        trainer._backend.close()
    assert lockstep.start_versions == {0: 0, 1: 0, 2: 0, 3: 1}
    for index in range(4):
        assert torch.equal(lockstep.token_versions[index], lockstep.expected_versions(index)), index
        assert lockstep.scored_versions[index] == lockstep.start_versions[index]
    assert (lockstep.masks[2].sum(dim=1) > SWITCH_AFTER).any(), "some completion must outlive the switch"
    frac = logged(trainer, "a3po/multi_version_trajectories_frac")
    assert frac[:2] == [0.0, 0.0] and all(0 < f <= 1 for f in frac[2:])
    assert logged(trainer, "a3po/completion_versions_max") == [1.0, 1.0, 2.0, 2.0]
    assert all(1.0 < v <= 2.0 for v in logged(trainer, "a3po/completion_versions_mean")[2:])
    assert logged(trainer, "async/in_flight_weight_loads") == [0.0, 0.0, 1.0, 1.0]
    assert all(t > 0 for t in logged(trainer, "async/in_flight_weight_load_time")[2:])
    assert max(logged(trainer, "a3po/staleness_max")) == 2.0  # the bound, on the oldest tokens
    assert all(0 < m < 2 for m in logged(trainer, "a3po/staleness_mean")[2:])  # per token: 2 and 1 mixed


def test_in_flight_loads_continue_across_a_checkpoint_and_resume(tokenizer, tmp_path, monkeypatch):
    """A run saved at step 2 and resumed to step 6 through the colocated engine: the resumed engine is labelled with
    the checkpoint's version and its batches switch mid-batch from there (batch ``b >= 2`` of the resumed run from
    ``2 + b - 2`` to ``2 + b - 1``), every token tagged with vLLM's own label."""
    settings = dict(max_staleness=2, max_completion_length=12, save_strategy="steps", save_steps=2)
    first = make_in_flight_trainer(tokenizer, tmp_path, max_steps=2, **settings)
    try:
        first.train()
    finally:
        first._backend.close()
    assert (tmp_path / "out" / "checkpoint-2").is_dir()

    resumed = make_in_flight_trainer(tokenizer, tmp_path, max_steps=6, **settings)
    lockstep = EngineLockstep(resumed, monkeypatch.setattr, lag=2, num_batches=4)
    try:
        resumed.train(resume_from_checkpoint=True)
    finally:
        resumed._backend.close()
    assert resumed.state.global_step == 6
    assert lockstep.start_versions == {0: 2, 1: 2, 2: 2, 3: 3}  # versions numbered from the checkpoint's step
    for index in range(4):
        assert torch.equal(lockstep.token_versions[index], lockstep.expected_versions(index)), index
    assert set(lockstep.token_versions[2][lockstep.masks[2]].tolist()) == {2, 3}
    assert logged(resumed, "async/in_flight_weight_loads")[-4:] == [0.0, 0.0, 1.0, 1.0]
    assert max(logged(resumed, "a3po/staleness_max")[-4:]) == 2.0


def test_a_peft_model_is_refused_by_the_backend_before_the_engine_starts(tokenizer, tmp_path):
    """LoRA versions are adapters a request keeps to its end: refused at start (a ``peft_config`` already in
    validation, a model that is a PEFT model when the backend is built), with the fix."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_vllm_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = make_in_flight_trainer(tokenizer, tmp_path, model=model)
    with pytest.raises(ValueError, match="cannot switch a running request to another adapter"):
        trainer._build_backend()
