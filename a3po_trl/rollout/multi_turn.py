"""Multi-turn rollouts in the generation thread: the tool-call loop and environments, with GRPOTrainer's semantics.

What GRPOTrainer does in its main thread for ``tools=[...]`` and ``environment_factory`` (``_generate_and_score_
completions``, ``_generate`` and ``_tool_call_loop`` in TRL 1.16), done here for one local batch with a
:class:`~a3po_trl.generation.backend.GenerationBackend`, so it runs in the generation thread with no collective:

1. each row draws an environment instance from the thread's own pool (one per concurrent rollout, constructed once and
   reset for every rollout), ``reset(**row)`` runs and its observation is appended to the last user message;
2. the prompts are rendered with the tools of their environment (plus the standalone tools);
3. the model generates; completions are parsed with the tokenizer's response schema; every tool call is executed
   (:mod:`a3po_trl.rollout.tools`; ``async def`` tools on TRL's event loop), its result rendered with the chat
   template's tool-message suffix and appended, and the rows that called tools continue, until no row calls a tool,
   ``max_tool_calling_iterations`` turns, or the completion budget is spent (a tool result that would overflow it is
   dropped and the row ends).

What is A-3PO's own: every generated token records the weight version that generated it, and the generator may load
newer weights between turns (``refresh_weights_between_turns``) and, with ``in_flight_weight_updates``, between the
decode steps of a turn, so a trajectory whose tokens span an update is staled token by token. Tool-result tokens
carry no version (-1), a behavior log-prob of 0 and a 0 in ``tool_mask``: they are attended to but never enter the
loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from trl import GRPOTrainer

from ..generation.backend import GenerationBackend
from ..runtime.activity import doing
from ..timeline import record_in_batch_span
from .seeds import turn_seed
from .tools import ToolCaller, tool_functions
from .trajectories import NO_VERSION, Trajectories


@dataclass
class AgentSettings:
    """What a multi-turn rollout needs from the trainer, copied once so the thread never reads the trainer."""

    tokenizer: Any
    """The thread's own copy of the processing class (with its response schema, for parsing tool calls)."""
    chat_template: str | None
    chat_template_kwargs: dict
    standalone_tools: list
    """Tools not bound to an environment (GRPOTrainer's ``tools`` argument)."""
    environment_factories: dict | None
    """``{name: factory}`` (``{None: factory}`` for a single environment), or None."""
    environment_tools: dict
    """``{name: tools}``: what the prompts of each environment are rendered with (GRPOTrainer's ``_env_tools``)."""
    multi_environment: bool
    max_tool_calling_iterations: int
    max_completion_length: int
    max_model_len: int
    tool_call_timeout: float | None = None
    refresh_between_turns: bool = True
    async_loop: Any = None
    _pool: dict = field(default_factory=dict)
    _warned_tools: set = field(default_factory=set)

    @property
    def tools(self) -> list:
        """Every tool a prompt may be rendered with (standalone and environment ones)."""
        tools = list(self.standalone_tools)
        for environment_tools in self.environment_tools.values():
            tools += [tool for tool in environment_tools if tool not in tools]
        return tools

    def draw_environments(self, rows: list[dict]) -> tuple[list[Any], list[str | None]]:
        """One environment instance per row from the thread's pool, and each row's environment name. The pool makes
        an instance only when a batch needs more concurrent instances of an environment than it holds."""
        names = [row.get("environment") if self.multi_environment else None for row in rows]
        unknown = sorted({str(name) for name in names if name not in self.environment_factories})
        if unknown:
            raise ValueError(
                f"Example has `environment={unknown[0]!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.environment_factories)}."
            )
        cursor: dict = {}
        environments = []
        for name in names:
            pool = self._pool.setdefault(name, [])
            index = cursor.get(name, 0)
            if index == len(pool):
                pool.append(self.environment_factories[name]())
            cursor[name] = index + 1
            environments.append(pool[index])
        return environments, names


def prepare_agent_prompts(agent: AgentSettings, rows: list[dict]) -> tuple[list, list | None, list | None]:
    """``(prompts, environments, names)``: with environments, one drawn and reset per row, its observation appended
    to the prompt's last message (GRPOTrainer's semantics; a row without ``prompt`` gets an empty user message)."""
    if agent.environment_factories is None:
        return [row["prompt"] for row in rows], None, None
    prompts = [row.get("prompt", [{"role": "user", "content": ""}]) for row in rows]
    environments, names = agent.draw_environments(rows)
    for i, (prompt, environment, row) in enumerate(zip(prompts, environments, rows, strict=True)):
        kwargs = {k: v for k, v in row.items() if k != "environment"} if agent.multi_environment else row
        observation = environment.reset(**kwargs)
        if observation is None:
            continue
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]
    return prompts, environments, names


def prompt_tools(agent: AgentSettings, names: list | None, count: int) -> list[list]:
    """The tools each of ``count`` prompts is rendered (and parsed) with."""
    if names is None:
        return [list(agent.standalone_tools)] * count
    return [agent.environment_tools[name] for name in names]


def tool_suffix_ids(agent: AgentSettings) -> Callable[[list[dict]], list[int]]:
    """GRPOTrainer's ``_get_tool_suffix_ids`` (the tokens the chat template renders for tool messages after an
    assistant turn, up to the next generation prompt), bound to the thread's tokenizer instead of the trainer."""
    owner = SimpleNamespace(
        processing_class=agent.tokenizer,
        _tokenizer=getattr(agent.tokenizer, "tokenizer", agent.tokenizer),
        chat_template=agent.chat_template,
        chat_template_kwargs=agent.chat_template_kwargs,
        _is_vlm=False,
    )
    return lambda tool_messages: GRPOTrainer._get_tool_suffix_ids(owner, tool_messages)


def parse_completion(agent: AgentSettings, ids: list[int], prefix: list[int], tools: list) -> dict:
    """One assistant message from generated ids, with its tool calls parsed (TRL's ``parse_response``)."""
    tokenizer = agent.tokenizer
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        from trl.chat_template_utils import parse_response

        return parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def generate_with_tools(
    agent: AgentSettings,
    backend: GenerationBackend,
    prompt_ids: list[list[int]],
    environments: list | None,
    names: list | None,
    should_stop: Callable[[], bool] | None,
    seed: int | None,
) -> Trajectories:
    """Generate, execute tool calls and continue, for one local batch (see the module doc)."""
    timings = {"weight_load": 0.0, "generation": 0.0}
    batch = len(prompt_ids)
    tools_per_row = prompt_tools(agent, names, batch)
    suffix_ids = tool_suffix_ids(agent)
    caller = ToolCaller(agent.tool_call_timeout, agent.async_loop, should_stop, warned=agent._warned_tools)
    functions = [
        tool_functions(agent.standalone_tools, environments[i] if environments else None) for i in range(batch)
    ]

    def generate(ids_list, turn):
        if turn > 0 and agent.refresh_between_turns:
            start = time.perf_counter()
            backend.refresh(should_stop=should_stop)
            end = time.perf_counter()
            timings["weight_load"] += end - start
            record_in_batch_span("weight load between turns", start, end, turn=turn, loaded_version=backend.version)
        version = backend.version  # before the call: an in-flight update changes it mid-turn
        generated = backend.timed_generate(ids_list, should_stop, turn_seed(seed, turn), timings)
        logps = [[float(x) for x in row.tolist()] for row in generated.logps]
        if generated.sampling_logps is not None:
            sampled[0] = True
        sampling = generated.sampling_logps if generated.sampling_logps is not None else generated.logps
        sampling = [[float(x) for x in row.tolist()] for row in sampling]
        versions = generated.token_versions
        if versions is None:
            versions = [[version] * len(ids) for ids in generated.completion_ids]
        return [list(ids) for ids in generated.completion_ids], logps, sampling, [list(v) for v in versions]

    sampled = [False]  # whether any turn's sampler drew from a processed distribution
    completion_ids, logps, sampling_logps, token_versions = generate(prompt_ids, 0)
    tool_mask = [[1] * len(ids) for ids in completion_ids]
    turns = [1] * batch
    completions = [
        [parse_completion(agent, ids, prompt_ids[i], tools_per_row[i])] for i, ids in enumerate(completion_ids)
    ]
    if not agent.tools:  # environments without tool methods: one turn, as GRPOTrainer (no tool loop, no tool mask)
        timings["tools"] = 0.0
        return Trajectories(
            completion_ids,
            logps,
            token_versions,
            completions,
            None,
            turns,
            timings=timings,
            sampling_logps=sampling_logps if sampled[0] else None,
        )
    active = [i for i in range(batch) if completions[i][0].get("tool_calls")]
    calls = {i: completions[i][0]["tool_calls"] for i in active}
    turn = 0
    while active and turn < agent.max_tool_calling_iterations:
        turn += 1
        extended = {}
        tools_start, calls_before = time.perf_counter(), caller.calls
        for i in active:
            before = len(completions[i])
            with doing(f"running the tool calls of turn {turn}"):
                results = caller.run(calls[i], *functions[i])
            messages = []
            for name, result in results:
                content = result if isinstance(result, list) else str(result)
                messages.append({"role": "tool", "name": name, "content": content})
            completions[i].extend(messages)
            ids = prompt_ids[i] + completion_ids[i] + suffix_ids(messages)
            overlong = len(ids) - len(prompt_ids[i]) > agent.max_completion_length or len(ids) >= agent.max_model_len
            if overlong:  # the tool result does not fit: drop it, the row ends with its completion as it is
                del completions[i][before:]
                continue
            extended[i] = ids
        turn_calls = caller.calls - calls_before
        record_in_batch_span("tool calls", tools_start, time.perf_counter(), turn=turn, calls=turn_calls)
        active = list(extended)
        if not active:
            break
        new_ids, new_logps, new_sampling_logps, new_versions = generate([extended[i] for i in active], turn)
        generated_rows = zip(active, new_ids, new_logps, new_sampling_logps, new_versions, strict=True)
        for i, ids, row_logps, row_sampling, row_versions in generated_rows:
            tool_length = len(extended[i]) - len(prompt_ids[i]) - len(completion_ids[i])
            budget = agent.max_completion_length - (len(extended[i]) - len(prompt_ids[i]))
            ids, row_logps, row_sampling, row_versions = (
                values[: max(budget, 0)] for values in (ids, row_logps, row_sampling, row_versions)
            )
            tool_mask[i] += [0] * tool_length + [1] * len(ids)
            logps[i] += [0.0] * tool_length + row_logps
            sampling_logps[i] += [0.0] * tool_length + row_sampling
            token_versions[i] += [NO_VERSION] * tool_length + row_versions
            completion_ids[i] = extended[i][len(prompt_ids[i]) :] + ids
            turns[i] += 1
            message = parse_completion(agent, ids, extended[i], tools_per_row[i]) if ids else {}
            if message:
                completions[i].append(message)
            calls[i] = message.get("tool_calls")
        active = [i for i in active if calls.get(i)]
    timings["tools"] = caller.seconds
    return Trajectories(
        completion_ids=completion_ids,
        logps=logps,
        token_versions=token_versions,
        completions=completions,
        tool_mask=tool_mask,
        turns=turns,
        tool_calls=caller.calls,
        tool_failures=caller.failures,
        tool_timeouts=caller.timeouts,
        sampling_logps=sampling_logps if sampled[0] else None,
        timings=timings,
    )
