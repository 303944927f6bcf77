"""Multi-turn training through the trainer (tools, environments, ``rollout_func``): GRPOTrainer's semantics, tool
results masked out of the loss, per-token versions. The rollout loop itself is tested in test_multi_turn.py."""

import threading
import time

import pytest
import torch
from datasets import Dataset
from helpers import COMMON, logged
from tiny import CALL, DONE, encode, make_model, multiply, scripted_generate, tool_script

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.rollout.trajectories import NO_VERSION

#: the trainer tests' settings (helpers.COMMON) with groups of 3 and room for a tool call, its result and an answer
TOOL_COMMON = {**COMMON, "per_device_train_batch_size": 3, "num_generations": 3, "max_completion_length": 256}


def make_tool_trainer(tokenizer, tmp_path, script, tools=(), reward_funcs=None, dataset=None, env=None, **overrides):
    model = make_model(tokenizer, max_position_embeddings=2048)
    model.generate = scripted_generate(tokenizer, script)
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **{**TOOL_COMMON, "max_steps": 3, **overrides})
    kwargs = {"tools": list(tools)} if tools else {}
    if env is not None:
        kwargs["environment_factory"] = env
    if dataset is None and env is None:
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} times 2?"}] for i in range(6)]})
    return AsyncA3POTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def record_inputs(trainer):
    seen = []
    original = trainer._compute_a3po_loss

    def spy(model, inputs, exact_logps=None):
        seen.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return original(model, inputs, exact_logps)

    trainer._compute_a3po_loss = spy
    return seen


def mixed_script(text):
    """Row by row: a valid call, a call with a wrong argument name, a plain answer (as TRL's test_train_with_tools)."""
    if "<tool_response>" in text:
        return DONE
    row = mixed_script.counter = getattr(mixed_script, "counter", -1) + 1
    return [
        CALL.format(name="multiply", arguments='{"a": 3, "b": 4}'),
        CALL.format(name="multiply", arguments='{"a": 3, "c": 4}'),
        "I don't know any tool<|im_end|>",
    ][row % 3]


def test_tools_train_with_tool_results_masked_out_of_the_loss(tool_tokenizer, tmp_path):
    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]  # messages per trajectory: rewards calling the tool

    trainer = make_tool_trainer(tool_tokenizer, tmp_path, mixed_script, tools=[multiply], reward_funcs=[reward])
    seen = record_inputs(trainer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert logged(trainer, "tools/call_frequency") == pytest.approx([2 / 3] * 3)
    assert logged(trainer, "tools/failure_frequency") == pytest.approx([1 / 2] * 3)
    assert logged(trainer, "tools/turns_mean") == pytest.approx([5 / 3] * 3)
    assert logged(trainer, "tools/tool_result_tokens_mean")[0] > 0
    # weights loaded between turns: a trajectory's turns may come from several versions, which is logged
    assert len(logged(trainer, "a3po/multi_version_trajectories_frac")) == 3
    assert all(1.0 <= v <= 2.0 for v in logged(trainer, "a3po/completion_versions_max"))
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    inputs = seen[0]
    done = encode(tool_tokenizer, DONE)
    for row in range(3):
        ids = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist()
        mask = inputs["tool_mask"][row][: len(ids)].tolist()
        versions = inputs["token_versions"][row][: len(ids)].tolist()
        text = tool_tokenizer.decode(ids)
        if "<tool_response>" in text:  # a called tool: the result is attended to, not trained on
            tool_tokens = [t for t, m in zip(ids, mask) if m == 0]
            assert "<tool_response>" in tool_tokenizer.decode(tool_tokens)
            assert "tool_response" not in tool_tokenizer.decode([t for t, m in zip(ids, mask) if m == 1])
            assert ids[-len(done) :] == done and mask[-len(done) :] == [1] * len(done)
            assert all((v == NO_VERSION) == (m == 0) for v, m in zip(versions, mask))
        else:
            assert mask == [1] * len(ids)
    # the token count that normalizes the loss leaves tool tokens out, as GRPOTrainer's
    loss_tokens = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
    assert inputs["num_items_in_batch"] == loss_tokens < inputs["completion_mask"].sum()
    # the loss ignores whatever sits at tool positions (behavior log-probs there are placeholders)
    tool_positions = (inputs["tool_mask"] == 0) & inputs["completion_mask"].bool()
    model_positions = (inputs["tool_mask"] == 1) & inputs["completion_mask"].bool()

    def loss_with(positions):
        changed = {k: v.clone() for k, v in inputs.items()}
        changed["behavior_logps"][positions] -= 3.0
        with torch.no_grad():
            return trainer._compute_a3po_loss(trainer.model, changed).item()

    unchanged = loss_with(torch.zeros_like(tool_positions))
    assert loss_with(tool_positions) == unchanged
    assert loss_with(model_positions) != unchanged


def test_without_refresh_between_turns_versions_per_completion_are_not_logged(tool_tokenizer, tmp_path):
    """With refresh_weights_between_turns=False the batch's first version generates every turn: a completion cannot
    span versions, and the metrics counting them are left out of the logs."""
    trainer = make_tool_trainer(
        tool_tokenizer,
        tmp_path,
        mixed_script,
        tools=[multiply],
        reward_funcs=[zero_reward],
        max_steps=1,
        refresh_weights_between_turns=False,
    )
    trainer.train()
    assert logged(trainer, "tools/call_frequency") == pytest.approx([2 / 3])
    keys = set().union(*trainer.state.log_history)
    assert not {"a3po/multi_version_trajectories_frac", "a3po/completion_versions_mean"} & keys


def test_dynamic_sampling_keeps_each_trajectorys_tool_mask_and_versions(tool_tokenizer, tmp_path):
    """Tool-calling groups merged from several draws: each row keeps its own tool mask and token versions."""

    def reward(completions, prompts, **kwargs):  # messages per trajectory for odd prompts; even ones are flat
        numbers = [int(p[0]["content"].split()[0]) for p in prompts]
        return [float(len(c)) if n % 2 else 0.0 for n, c in zip(numbers, completions)]

    def script(text):  # every other row calls the tool, whose result has as many digits as the prompt's number + 1
        if "<tool_response>" in text:
            return DONE
        number = int(text.split(" times 2?")[0].split()[-1])
        row = script.counter = getattr(script, "counter", -1) + 1
        call = CALL.format(name="multiply", arguments=f'{{"a": 1, "b": {10**number}}}')
        return call if row % 2 == 0 else "I don't know any tool<|im_end|>"

    trainer = make_tool_trainer(
        tool_tokenizer,
        tmp_path,
        script,
        tools=[multiply],
        reward_funcs=[reward],
        dynamic_sampling=True,
        per_device_train_batch_size=6,
        max_steps=2,
    )
    seen = record_inputs(trainer)
    trainer.train()
    assert logged(trainer, "frac_reward_zero_std") == [0.0, 0.0]
    assert sum(logged(trainer, "a3po/dynamic_sampling_filtered_groups")) > 0
    for inputs in seen:
        called = 0
        for row in range(6):
            ids = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist()
            mask = inputs["tool_mask"][row][: len(ids)].tolist()
            versions = inputs["token_versions"][row][: len(ids)].tolist()
            if "<tool_response>" in tool_tokenizer.decode(ids):
                called += 1
                tool_text = tool_tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
                assert "<tool_response>" in tool_text and "</tool_response>" in tool_text
                assert "tool_response" not in tool_tokenizer.decode([t for t, m in zip(ids, mask) if m == 1])
                assert all((v == NO_VERSION) == (m == 0) for v, m in zip(versions, mask))
            else:
                assert mask == [1] * len(ids) and NO_VERSION not in versions
        assert called >= 2


def test_a_weight_update_during_a_tool_call_stales_the_trajectory_token_by_token(tool_tokenizer, tmp_path):
    """Batch 1's tool waits until the trainer publishes version 1: its first turn is version 0, its second version 1,
    and at step 1 they train with staleness 1 and 0."""
    calls = {"n": 0}
    holder = {}

    def multiply_after_update(a: int, b: int) -> int:
        """
        Multiply two integers, once the trainer has moved on (for the second batch).

        Args:
            a: The first integer.
            b: The second integer.
        """
        calls["n"] += 1
        if calls["n"] > 3:  # a call of the second batch: wait for version 1 (bounded, so a bug cannot hang)
            deadline = time.monotonic() + 30
            while holder["trainer"]._backend.published_version < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return a * b

    multiply_after_update.__name__ = "multiply"
    script = tool_script()
    trainer = make_tool_trainer(
        tool_tokenizer,
        tmp_path,
        script,
        tools=[multiply_after_update],
        reward_funcs=[zero_reward],
        max_staleness=1,
        max_steps=2,
    )
    holder["trainer"] = trainer
    seen = record_inputs(trainer)
    trainer.train()
    call_length = len(encode(tool_tokenizer, CALL.format(name="multiply", arguments='{"a": 3, "b": 4}')))
    second = seen[1]
    for row in range(3):
        mask = second["tool_mask"][row].bool() & second["completion_mask"][row].bool()
        versions = second["token_versions"][row][mask].tolist()
        assert versions[:call_length] == [0] * call_length
        assert set(versions[call_length:]) == {1}
    assert logged(trainer, "a3po/multi_version_trajectories_frac") == [0.0, 1.0]
    fractions = logged(trainer, "a3po/staleness_frac_1")
    assert 0.0 < fractions[1] < 1.0  # step 1 trains turn-1 tokens at staleness 1 and turn-2 tokens at staleness 0
    # the timeline shows batch 1's tool calls, then the load of version 1 between its turns, inside the batch's span
    spans = [s for s in trainer.timeline.spans() if s.lane == "generation" and s.args.get("batch") == 1]
    batch = next(s for s in spans if s.name == "batch")
    tools = next(s for s in spans if s.name == "tool calls")
    load = next(s for s in spans if s.name == "weight load between turns")
    assert tools.args["calls"] == 3 and load.args["loaded_version"] == 1 and batch.args["version"] == 0
    assert batch.start <= tools.start <= tools.end <= load.start <= load.end <= batch.end


def test_environments_own_the_reward_and_see_their_tool_calls(tool_tokenizer, tmp_path):
    class Counter:
        def reset(self, **kwargs):
            self.count = 0
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: Value to add.
            """
            self.count += step
            return self.count

        def get_reward(self) -> float:
            return float(self.count)

    def script(text):
        if "<tool_response>" in text:
            return DONE
        row = script.counter = getattr(script, "counter", -1) + 1
        return CALL.format(name="increment", arguments='{"step": 1}') if row % 3 == 0 else "No.<|im_end|>"

    trainer = make_tool_trainer(tool_tokenizer, tmp_path, script, env=Counter)
    trainer.train()
    assert logged(trainer, "rewards/Counter/mean") == pytest.approx([1 / 3] * 3)
    assert logged(trainer, "tools/call_frequency") == pytest.approx([1 / 3] * 3)
    assert [e.count for e in trainer.environments] == [1, 0, 0]
    # the generation thread has its own instances: evaluation keeps GRPOTrainer's pool
    assert all(e not in trainer._environment_pool[None] for e in trainer.environments)


def test_an_error_outside_a_tool_reaches_train(tool_tokenizer, tmp_path):
    class Broken:
        def reset(self, **kwargs):
            raise OSError("environment could not start")

        def poke(self) -> int:
            """
            Poke.
            """
            return 0

    trainer = make_tool_trainer(
        tool_tokenizer, tmp_path, tool_script(), env=Broken, reward_funcs=[zero_reward], max_steps=1
    )
    with pytest.raises(OSError, match="environment could not start"):
        trainer.train()


def test_environments_are_refused_with_reward_workers(tool_tokenizer, tmp_path):
    class Lamp:
        def reset(self, **kwargs):
            return None

        def switch(self) -> int:
            """
            Switch the lamp.
            """
            return 1

    with pytest.raises(ValueError, match="reward_num_workers > 0 cannot be combined with environment_factory"):
        make_tool_trainer(
            tool_tokenizer, tmp_path, tool_script(), env=Lamp, reward_funcs=[zero_reward], reward_num_workers=1
        )


def test_slow_and_raising_tools_through_train(tool_tokenizer, tmp_path):
    def flaky(a: int, b: int) -> int:
        """
        A tool that sleeps on odd products and raises on even ones.

        Args:
            a: The first integer.
            b: The second integer.
        """
        if (a * b) % 2:
            time.sleep(20)
        raise ValueError("no")

    flaky.__name__ = "multiply"

    def script(text):
        if "<tool_response>" in text:
            return DONE
        row = script.counter = getattr(script, "counter", -1) + 1
        arguments = '{"a": 3, "b": 5}' if row % 3 == 0 else '{"a": 2, "b": 2}'
        return CALL.format(name="multiply", arguments=arguments)

    trainer = make_tool_trainer(
        tool_tokenizer,
        tmp_path,
        script,
        tools=[flaky],
        reward_funcs=[zero_reward],
        tool_call_timeout=0.5,
        max_steps=2,
    )
    trainer.train()
    assert logged(trainer, "tools/failure_frequency") == [1.0, 1.0]
    assert logged(trainer, "tools/timeout_frequency") == pytest.approx([1 / 3, 1 / 3])


# ---- rollout_func -------------------------------------------------------------------------------------------------
def test_rollout_func_runs_in_the_generation_thread_with_versioned_weights(tokenizer, tmp_path):
    """A custom rollout: generate with the batch's weights, append 'environment feedback' tokens (env_mask 0) and
    continue; the extra field it returns reaches the reward function."""
    threads, feedback = [], encode(tokenizer, " [ok] ")

    def rollout(prompts, trainer):
        threads.append(threading.current_thread().name)
        prompt_ids = [encode(tokenizer, p) for p in prompts]
        first = trainer.generate_completions(prompt_ids)
        second = trainer.generate_completions([p + c + feedback for p, c in zip(prompt_ids, first["completion_ids"])])
        completion_ids, logprobs, env_mask = [], [], []
        for c1, l1, c2, l2 in zip(first["completion_ids"], first["logprobs"], *second.values()):
            completion_ids.append(c1 + feedback + c2)
            logprobs.append(l1 + [0.0] * len(feedback) + l2)
            env_mask.append([1] * len(c1) + [0] * len(feedback) + [1] * len(c2))
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "env_mask": env_mask,
            "turns": [2] * len(prompts),
        }

    seen_turns = []

    def reward(completions, turns, **kwargs):
        seen_turns.extend(turns)
        return [float(len(c)) for c in completions]

    model = make_model(tokenizer)
    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"), **{**TOOL_COMMON, "max_completion_length": 8, "max_steps": 3}
    )
    trainer = AsyncA3POTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"{i} plus one is" for i in range(6)]}),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    seen = record_inputs(trainer)
    trainer.train()
    assert set(threads) == {"a3po-generation"} and len(threads) == 3
    assert seen_turns == [2] * 9
    for inputs in seen:
        tool_mask, mask = inputs["tool_mask"], inputs["completion_mask"].bool()
        versions = inputs["token_versions"]
        assert ((tool_mask == 0) & mask).sum(1).tolist() == [len(feedback)] * 3
        assert (versions[(tool_mask == 0) & mask] == NO_VERSION).all()
        assert (versions[(tool_mask == 1) & mask] >= 0).all()
    with pytest.raises(RuntimeError, match="only be called from a rollout_func"):
        trainer.generate_completions([[1, 2]])


def test_rollout_func_missing_keys_reach_train(tokenizer, tmp_path):
    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"), **{**TOOL_COMMON, "max_completion_length": 8, "max_steps": 3}
    )
    trainer = AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"{i} plus one is" for i in range(6)]}),
        processing_class=tokenizer,
        rollout_func=lambda prompts, trainer: {"prompt_ids": [[1]] * len(prompts)},
    )
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['completion_ids', 'logprobs'\]"):
        trainer.train()
