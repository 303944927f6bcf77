"""Multi-turn rollouts (tools, environments) in the generation thread: GRPOTrainer's semantics, per-token versions."""

import asyncio
import math
import threading
import time

import pytest
import torch
from tiny import CALL, DONE, encode, multiply, tool_script

from a3po_trl.generation.backend import GenerationBackend
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights
from a3po_trl.rollout.multi_turn import AgentSettings, generate_with_tools
from a3po_trl.rollout.tools import ToolCaller
from a3po_trl.rollout.trajectories import NO_VERSION
from a3po_trl.types import GeneratedCompletions, GenerationStopped


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
