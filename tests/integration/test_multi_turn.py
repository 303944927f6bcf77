"""Multi-turn rollouts (tools, environments) in the generation thread: GRPOTrainer's semantics, per-token versions."""

import asyncio
import math
import threading
import time

import pytest
import torch
from datasets import Dataset
from helpers import COMMON, logged
from tiny import CALL, DONE, encode, make_model, make_tool_tokenizer, scripted_generate

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.generation.backend import GenerationBackend
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights
from a3po_trl.rollout.multi_turn import AgentSettings, generate_with_tools
from a3po_trl.rollout.tools import ToolCaller
from a3po_trl.rollout.trajectories import NO_VERSION
from a3po_trl.types import GeneratedCompletions, GenerationStopped


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


@pytest.fixture(scope="module")
def tool_tokenizer():
    return make_tool_tokenizer()


class ScriptedBackend(GenerationBackend):
    """Completions from ``script(prompt_text) -> completion_text``; behavior log-probs ``-(version + 1) / 10`` per
    token, so that a token's log-prob says which version generated it."""

    def __init__(self, tokenizer, script, kept_mass=None):
        super().__init__(VersionedWeights(StagingLayout({}, {}, torch.device("cpu")), ParameterGather()), "cpu")
        self.tokenizer, self.script = tokenizer, script
        self.kept_mass = kept_mass  # a truncating sampler: sampling log-probs are logps - log(kept_mass)
        self.calls = []

    def load_weights(self, weights, version):
        pass

    def generate(self, prompt_ids, should_stop, seed):
        self.calls.append((len(prompt_ids), self.version, seed))
        completions = [encode(self.tokenizer, self.script(self.tokenizer.decode(ids))) for ids in prompt_ids]
        logps = [torch.full((len(ids),), -(self.version + 1) / 10) for ids in completions]
        sampling = None if self.kept_mass is None else [lp - math.log(self.kept_mass) for lp in logps]
        return GeneratedCompletions(completion_ids=completions, logps=logps, sampling_logps=sampling)


def agent(tokenizer, tools, **overrides):
    values = dict(
        tokenizer=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        standalone_tools=tools,
        environment_factories=None,
        environment_tools={},
        multi_environment=False,
        max_tool_calling_iterations=5,
        max_completion_length=512,
        max_model_len=1 << 20,
    )
    return AgentSettings(**{**values, **overrides})


def render(tokenizer, prompts, tools):
    return tokenizer.apply_chat_template(
        prompts, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


# ---- tool calls -------------------------------------------------------------------------------------------------
def test_tool_caller_turns_errors_unknown_tools_and_timeouts_into_messages():
    def fails(x: int) -> int:
        raise RuntimeError("tool exploded")

    def slow(x: int) -> int:
        time.sleep(5)
        return x

    async def slow_async(x: int) -> int:
        await asyncio.sleep(5)
        return x

    async def fine_async(x: int) -> int:
        return x + 1

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        caller = ToolCaller(timeout=0.3, async_loop=loop, should_stop=None)
        sync = {"fails": fails, "slow": slow}
        asynchronous = {"slow_async": slow_async, "fine_async": fine_async}

        def call(name, **arguments):
            return {"type": "function", "function": {"name": name, "arguments": arguments}}

        start = time.monotonic()
        results = caller.run(
            [
                call("fails", x=1),
                call("slow", x=2),
                call("nope", x=3),
                call("slow_async", x=4),
                call("fine_async", x=5),
            ],
            sync,
            asynchronous,
        )
        elapsed = time.monotonic() - start
    finally:
        loop.call_soon_threadsafe(loop.stop)
    names = [name for name, _ in results]
    assert names == ["fails", "slow", "nope", "slow_async", "fine_async"]
    assert results[0][1] == {"error": "tool exploded"}
    assert "tool_call_timeout" in results[1][1]["error"] and "'slow'" in results[1][1]["error"]
    assert results[2][1] == {"error": "Tool nope not found."}
    assert "tool_call_timeout" in results[3][1]["error"]
    assert results[4][1] == 6
    assert (caller.calls, caller.failures, caller.timeouts) == (5, 4, 2)
    assert elapsed < 4.5  # neither 5 s tool was waited for


def test_a_stop_request_ends_the_wait_for_a_slow_tool():
    def hangs() -> int:
        time.sleep(30)
        return 0

    stop = threading.Event()
    caller = ToolCaller(timeout=60, async_loop=None, should_stop=stop.is_set)
    threading.Timer(0.2, stop.set).start()
    start = time.monotonic()
    with pytest.raises(GenerationStopped):
        caller.run([{"type": "function", "function": {"name": "hangs", "arguments": {}}}], {"hangs": hangs}, {})
    assert time.monotonic() - start < 10


# ---- the multi-turn loop ----------------------------------------------------------------------------------------
def tool_script(arguments='{"a": 3, "b": 4}'):
    def script(text):
        return DONE if "<tool_response>" in text else CALL.format(name="multiply", arguments=arguments)

    return script


@pytest.mark.parametrize("refresh", [True, False])
def test_every_token_records_the_version_that_generated_it(tool_tokenizer, refresh):
    """A weight update lands while the tool runs: with refresh the second turn comes from the new version."""
    backend = ScriptedBackend(tool_tokenizer, tool_script())
    backend.restore_weights(0, {})
    backend.refresh()

    def publishing_multiply(a: int, b: int) -> int:
        """
        Multiply, while the trainer publishes version 1.

        Args:
            a: The first integer.
            b: The second integer.
        """
        backend.restore_weights(1, {})  # what the trainer's publish does, from the main thread
        return a * b

    publishing_multiply.__name__ = "multiply"
    settings = agent(tool_tokenizer, [publishing_multiply], refresh_between_turns=refresh)
    prompts = [[{"role": "user", "content": "3 times 4?"}], [{"role": "user", "content": "hi"}]]
    prompt_ids = render(tool_tokenizer, prompts, [publishing_multiply])
    out = generate_with_tools(settings, backend, prompt_ids, None, None, None, seed=7)

    call_ids = encode(tool_tokenizer, CALL.format(name="multiply", arguments='{"a": 3, "b": 4}'))
    done_ids = encode(tool_tokenizer, DONE)
    for row in range(2):
        ids, mask, logps = out.completion_ids[row], out.tool_mask[row], out.logps[row]
        versions = out.token_versions[row]
        assert ids[: len(call_ids)] == call_ids and ids[-len(done_ids) :] == done_ids
        tool_length = len(ids) - len(call_ids) - len(done_ids)
        assert mask == [1] * len(call_ids) + [0] * tool_length + [1] * len(done_ids)
        second = 1 if refresh else 0
        assert versions == [0] * len(call_ids) + [NO_VERSION] * tool_length + [second] * len(done_ids)
        expected = [-0.1] * len(call_ids) + [0.0] * tool_length + [-(second + 1) / 10] * len(done_ids)
        assert logps == pytest.approx(expected)
        tool_text = tool_tokenizer.decode(ids[len(call_ids) : len(call_ids) + tool_length])
        assert "<tool_response>\n12\n</tool_response>" in tool_text
    assert out.turns == [2, 2]
    assert (out.tool_calls, out.tool_failures) == (2, 0)
    assert [m["role"] for m in out.completions[0]] == ["assistant", "tool", "assistant"]
    assert out.completions[0][1]["content"] == "12"
    # one call per turn: both rows, then both rows again; later turns get their own seeds
    assert [(n, v) for n, v, _ in backend.calls] == [(2, 0), (2, 1 if refresh else 0)]
    assert backend.calls[0][2] == 7 and backend.calls[1][2] not in (7, None)


class InFlightScriptedBackend(ScriptedBackend):
    """A backend that, like the generate backend with in-flight weight updates, loads a newer version after the second
    token of every call and reports the version of each token."""

    def generate(self, prompt_ids, should_stop, seed):
        started = self.version
        generated = super().generate(prompt_ids, should_stop, seed)
        self.restore_weights(started + 1, {})  # published mid-call by the trainer ...
        self.refresh()  # ... and loaded between two decode steps
        generated.token_versions = [
            [started] * min(2, len(ids)) + [started + 1] * (len(ids) - 2) for ids in generated.completion_ids
        ]
        return generated


def test_versions_loaded_within_a_turn_are_recorded_token_by_token(tool_tokenizer):
    backend = InFlightScriptedBackend(tool_tokenizer, tool_script())
    backend.restore_weights(0, {})
    backend.refresh()
    prompt_ids = render(tool_tokenizer, [[{"role": "user", "content": "3 times 4?"}]], [multiply])
    out = generate_with_tools(agent(tool_tokenizer, [multiply]), backend, prompt_ids, None, None, None, seed=3)
    call_ids = encode(tool_tokenizer, CALL.format(name="multiply", arguments='{"a": 3, "b": 4}'))
    done_ids = encode(tool_tokenizer, DONE)
    tool_length = len(out.completion_ids[0]) - len(call_ids) - len(done_ids)
    # turn 1 switches from 0 to 1 after its second token, turn 2 (started with 1) from 1 to 2
    assert out.token_versions[0] == (
        [0, 0] + [1] * (len(call_ids) - 2) + [NO_VERSION] * tool_length + [1, 1] + [2] * (len(done_ids) - 2)
    )


def test_a_truncating_sampler_gives_every_turn_its_sampling_log_probs(tool_tokenizer):
    """Every generated token of every turn carries the log-prob of the distribution it was drawn from beside the
    policy's; tool-result tokens carry 0 in both. A sampler that does not truncate gives none."""
    prompts = [[{"role": "user", "content": "3 times 4?"}]]
    prompt_ids = render(tool_tokenizer, prompts, [multiply])
    truncating = ScriptedBackend(tool_tokenizer, tool_script(), kept_mass=0.5)
    out = generate_with_tools(agent(tool_tokenizer, [multiply]), truncating, prompt_ids, None, None, None, seed=1)
    mask, logps, sampling = out.tool_mask[0], out.logps[0], out.sampling_logps[0]
    assert out.turns == [2] and 0 in mask
    assert len(sampling) == len(logps) == len(mask)
    for generated, policy, sampled in zip(mask, logps, sampling):
        assert sampled == pytest.approx(policy + math.log(2) if generated else 0.0)
    plain = ScriptedBackend(tool_tokenizer, tool_script())
    assert (
        generate_with_tools(agent(tool_tokenizer, [multiply]), plain, prompt_ids, None, None, None, 1).sampling_logps
        is None
    )


def test_turn_limit_and_completion_budget_end_a_trajectory(tool_tokenizer):
    backend = ScriptedBackend(tool_tokenizer, lambda text: CALL.format(name="multiply", arguments='{"a": 1, "b": 2}'))
    backend.restore_weights(0, {})
    backend.refresh()
    prompts = [[{"role": "user", "content": "loop"}]]
    prompt_ids = render(tool_tokenizer, prompts, [multiply])
    limited = generate_with_tools(
        agent(tool_tokenizer, [multiply], max_tool_calling_iterations=2),
        backend,
        prompt_ids,
        None,
        None,
        None,
        0,
    )
    assert limited.turns == [3] and limited.tool_calls == 2
    call_length = len(encode(tool_tokenizer, CALL.format(name="multiply", arguments='{"a": 1, "b": 2}')))
    # room for one call and its result, not for a second result: that result is dropped and the row ends
    budget = 2 * call_length + 40
    short = generate_with_tools(
        agent(tool_tokenizer, [multiply], max_completion_length=budget),
        backend,
        prompt_ids,
        None,
        None,
        None,
        0,
    )
    assert len(short.completion_ids[0]) <= budget
    assert short.turns == [2]
    assert [m["role"] for m in short.completions[0]] == ["assistant", "tool", "assistant"]
    lengths = (short.completion_ids[0], short.tool_mask[0], short.token_versions[0], short.logps[0])
    assert len({len(values) for values in lengths}) == 1


# ---- through the trainer ----------------------------------------------------------------------------------------
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
