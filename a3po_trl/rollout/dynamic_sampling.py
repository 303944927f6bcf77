"""Dynamic sampling (DAPO's, verl's ``filter_groups``): a training batch made only of groups that carry a signal.

A group whose completions all get the same reward has zero advantage on every token: training on it costs a forward
and a backward and moves nothing. With ``dynamic_sampling=True`` the generation thread filters each generation batch
it draws, group by group, and draws further batches (new prompts, the newest published weights) until it holds a full
local batch of groups that pass the filter, at most ``dynamic_sampling_max_gen_batches`` draws per training batch.
At that bound the batch is completed with the flat groups drawn last, so a dataset on which every group is flat
still trains (with a warning and the ``a3po/dynamic_sampling_bound_reached`` metric) instead of looping forever.

Everything here is local to one process (groups are whole on each process) and pure: :func:`keep_groups` decides,
:class:`GroupAccumulator` chooses which drawn groups make the batch, :func:`merge_groups` builds it from the scored
draws, and :class:`DynamicSampler` ties them together for the batch producer.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..functional import groups_without_signal
from ..types import ScoredBatch, ToolStats
from .trajectories import NO_VERSION

logger = logging.getLogger(__name__)

GroupFilter = Callable[[torch.Tensor], bool]
"""``keep(rewards) -> bool``: whether a group is trained, from its ``(num_generations, num_reward_funcs)`` raw
rewards (NaN where a reward function returned None)."""


# ---- the filter -----------------------------------------------------------------------------------------------------
def resolve_group_filter(setting) -> GroupFilter | None:
    """``dynamic_sampling_filter`` as a function: ``None`` (the default filter, :func:`keep_groups`'s), a callable as
    it is, or a dotted import path (``my_module.keep_group``, the working directory on ``sys.path`` as for reward
    functions). Anything else, or a path that does not import, is refused naming the setting."""
    if setting is None or callable(setting):
        return setting
    if not isinstance(setting, str) or "." not in setting:
        raise ValueError(
            f"dynamic_sampling_filter={setting!r} must be None (drop groups whose rewards all agree), a function "
            "keep(rewards) -> bool of a group's (num_generations, num_reward_funcs) rewards, or the dotted import "
            "path of one (my_module.keep_group)."
        )
    module_path, attribute = setting.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except Exception as error:
        raise ValueError(
            f"dynamic_sampling_filter={setting!r}: importing {module_path} failed ({error!r}). Check the spelling, "
            "run from the folder that holds the module, or install the package that provides it."
        ) from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(
            f"dynamic_sampling_filter={setting!r}: module {module_path} has no function {attribute!r}; name a "
            "function keep(rewards) -> bool."
        )
    return function


def keep_groups(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: torch.Tensor,
    group_filter: GroupFilter | None = None,
    aggregation: str = "sum_then_normalize",
) -> list[bool]:
    """Per group of ``num_generations`` consecutive rows, whether it is trained: ``group_filter(group's rewards)``,
    or by default whether it carries a signal: not every advantage of it is 0 as the trainer computes them
    (:func:`~a3po_trl.functional.groups_without_signal`, for ``aggregation``, TRL's ``multi_objective_aggregation``:
    the weighted reward sum, or the weighted sum of the per-function normalised rewards, varies within the group)."""
    if rewards_per_func.size(0) % num_generations:
        raise ValueError(f"{rewards_per_func.size(0)} rows do not form whole groups of {num_generations}.")
    groups = rewards_per_func.size(0) // num_generations
    if group_filter is not None:
        per_group = rewards_per_func.view(groups, num_generations, -1)
        return [bool(group_filter(per_group[g].clone())) for g in range(groups)]
    flat = groups_without_signal(rewards_per_func, reward_weights, num_generations, aggregation)
    return [not value for value in flat.tolist()]


# ---- which groups make the batch ------------------------------------------------------------------------------------
@dataclass
class GroupAccumulator:
    """The groups kept from each draw of one training batch, and the choice of the batch's groups.

    ``add`` one draw's keep-mask after another while :attr:`wants_more`; :meth:`selection` is then the batch's groups
    as ``(draw, group)`` pairs: the kept groups in the order they were drawn, the surplus of the last draw left out
    (as verl does); at the bound (``max_draws`` draws, still short) the flat groups of the last draw complete it, in
    their order (the last draw alone has enough of them: it holds a whole batch of groups, and fewer than a batch
    were kept over all draws)."""

    groups_needed: int
    max_draws: int
    draws: list[list[bool]] = field(default_factory=list)

    def add(self, keep: list[bool]) -> None:
        if len(keep) != self.groups_needed:
            raise ValueError(f"A draw has {len(keep)} groups; a local batch holds {self.groups_needed}.")
        self.draws.append(list(keep))

    @property
    def kept(self) -> int:
        return sum(sum(keep) for keep in self.draws)

    @property
    def full(self) -> bool:
        return self.kept >= self.groups_needed

    @property
    def wants_more(self) -> bool:
        return not self.full and len(self.draws) < self.max_draws

    @property
    def bound_reached(self) -> bool:
        return bool(self.draws) and not self.full

    def selection(self) -> list[tuple[int, int]]:
        if not self.draws:
            raise RuntimeError("No draw was added.")
        chosen = [(d, g) for d, keep in enumerate(self.draws) for g, kept in enumerate(keep) if kept]
        chosen = chosen[: self.groups_needed]
        if len(chosen) < self.groups_needed:
            last = len(self.draws) - 1
            flat = [(last, g) for g, kept in enumerate(self.draws[last]) if not kept]
            chosen += flat[: self.groups_needed - len(chosen)]
        return chosen

    def filtered_groups(self) -> int:
        """Groups the filter dropped that the batch does not train (flat groups used to complete it excluded)."""
        rejected = sum(len(keep) - sum(keep) for keep in self.draws)
        filler = self.groups_needed - min(self.kept, self.groups_needed)
        return rejected - filler


# ---- the batch, from the chosen groups of the scored draws ----------------------------------------------------------
#: How each tensor of a scored batch is padded: ``(side, value)``; ``None`` for the pad token id.
_PADDING = {
    "prompt_ids": ("left", None),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", None),
    "completion_mask": ("right", 0),
    "behavior_logps": ("right", 0.0),
    "token_versions": ("right", NO_VERSION),
    "sampling_logps": ("right", 0.0),
    "tool_mask": ("right", 1),
}


def _pad_width(tensor: torch.Tensor, width: int, side: str, value) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing == 0:
        return tensor
    return F.pad(tensor, (missing, 0) if side == "left" else (0, missing), value=value)


def _tensor_or_default(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A draw's tensor ``name``, or what its absence means: no ``tool_mask`` is every token trained, no
    ``sampling_logps`` is sampling from the distribution the behavior log-probs score."""
    if name in tensors:
        return tensors[name]
    if name == "tool_mask":
        return torch.ones_like(tensors["completion_mask"])
    if name == "sampling_logps":
        return tensors["behavior_logps"]
    raise ValueError(f"A generation batch drawn for dynamic sampling has no {name!r}, another one has.")


def merge_groups(
    draws: list[ScoredBatch], selection: list[tuple[int, int]], num_generations: int, pad_token_id: int
) -> ScoredBatch:
    """One scored batch of the ``(draw, group)`` pairs of ``selection``, in that order: every row keeps its tokens,
    behavior log-probs and per-token versions, re-padded to the widest draw; the timings and what reward functions
    logged are summed / kept over every draw (all of them were paid for); the tool statistics' counts are those of
    every drawn trajectory, scaled to the rows kept. ``index`` and ``version`` are the first draw's."""
    order = [(d, r) for d, g in selection for r in range(g * num_generations, (g + 1) * num_generations)]
    used = sorted({d for d, _ in order})
    kept_rows = {d: sum(1 for dd, _ in order if dd == d) for d in range(len(draws))}

    def gather_tensors(get) -> torch.Tensor:
        return torch.stack([get(draws[d])[r] for d, r in order])

    def gather_lists(get) -> list:
        return [get(draws[d])[r] for d, r in order]

    first = draws[0]
    tensors = {}
    for name in dict.fromkeys(name for d in used for name in draws[d].tensors):
        side, value = _PADDING.get(name, ("right", 0))
        value = pad_token_id if value is None else value
        parts = {d: _tensor_or_default(draws[d].tensors, name) for d in used}
        width = max(part.size(1) for part in parts.values())
        padded = {d: _pad_width(part, width, side, value) for d, part in parts.items()}
        tensors[name] = torch.stack([padded[d][r] for d, r in order])
    rows = len(order)
    tool_stats = None
    if first.tool_stats is not None:
        scale = [kept_rows[d] / max(draws[d].is_truncated.numel(), 1) for d in range(len(draws))]
        tool_stats = ToolStats(
            turns=gather_tensors(lambda b: b.tool_stats.turns),
            tool_result_lengths=gather_tensors(lambda b: b.tool_stats.tool_result_lengths),
            calls=sum(b.tool_stats.calls * s for b, s in zip(draws, scale)),
            failures=sum(b.tool_stats.failures * s for b, s in zip(draws, scale)),
            timeouts=sum(b.tool_stats.timeouts * s for b, s in zip(draws, scale)),
        )
    timings: dict[str, float] = {}
    extra_logs: dict[str, list] = {}
    logged_metrics: dict[str, list[float]] = {}
    for batch in draws:
        for key, seconds in batch.timings.items():
            timings[key] = timings.get(key, 0.0) + seconds
        for name, values in batch.logged_metrics.items():
            logged_metrics.setdefault(name, []).extend(values)
    for column in {column for batch in draws for column in batch.extra_logs}:
        per_row = all(len(draws[d].extra_logs.get(column, ())) == draws[d].is_truncated.numel() for d in used)
        if per_row:
            extra_logs[column] = gather_lists(lambda b, column=column: b.extra_logs[column])
        else:  # not one value per completion: kept as logged
            extra_logs[column] = [v for d in used for v in draws[d].extra_logs.get(column, [])]
    merged = ScoredBatch(
        index=first.index,
        version=first.version,
        tensors=tensors,
        rewards_per_func=gather_tensors(lambda b: b.rewards_per_func),
        is_truncated=gather_tensors(lambda b: b.is_truncated),
        completion_lengths=gather_tensors(lambda b: b.completion_lengths),
        tool_stats=tool_stats,
        texts={key: gather_lists(lambda b, key=key: b.texts[key]) for key in first.texts},
        timings=timings,
        rows=gather_lists(lambda b: b.rows),
        extra_logs=extra_logs,
        logged_metrics=logged_metrics,
        environments=gather_lists(lambda b: b.environments) if first.environments is not None else None,
    )
    assert merged.rewards_per_func.size(0) == rows
    return merged


# ---- for the batch producer ----------------------------------------------------------------------------------------
@dataclass
class DynamicSampler:
    """Fills one training batch from draws: :meth:`fill` takes the first scored draw and ``draw_more()``, which draws,
    generates and scores the next generation batch, and returns the batch to train with its ``sampling_stats``."""

    groups_needed: int
    """Groups of one local generation batch."""
    num_generations: int
    max_draws: int
    reward_weights: torch.Tensor
    pad_token_id: int
    group_filter: GroupFilter | None = None
    aggregation: str = "sum_then_normalize"
    """TRL's ``multi_objective_aggregation``: how the default filter combines the reward functions, as the
    advantages do."""
    bound_warnings: int = 0

    def keep(self, batch: ScoredBatch) -> list[bool]:
        return keep_groups(
            batch.rewards_per_func, self.num_generations, self.reward_weights, self.group_filter, self.aggregation
        )

    def fill(self, first: ScoredBatch, draw_more: Callable[[], ScoredBatch]) -> ScoredBatch:
        accumulator = GroupAccumulator(self.groups_needed, self.max_draws)
        draws = [first]
        accumulator.add(self.keep(first))
        while accumulator.wants_more:
            batch = draw_more()
            draws.append(batch)
            accumulator.add(self.keep(batch))
        selection = accumulator.selection()
        merged = merge_groups(draws, selection, self.num_generations, self.pad_token_id)
        bound = accumulator.bound_reached
        if bound:
            self.bound_warnings += 1
            count = self.bound_warnings
            if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... time
                logger.warning(
                    "Dynamic sampling: only %d of the %d groups of a training batch carry a reward signal after "
                    "dynamic_sampling_max_gen_batches=%d generation batches; the batch is completed with flat groups "
                    "(zero advantage) drawn last (%d time(s) so far). Most groups have the same reward for every "
                    "completion: check the reward functions, or raise dynamic_sampling_max_gen_batches.",
                    accumulator.kept,
                    self.groups_needed,
                    self.max_draws,
                    count,
                )
        merged.sampling_stats = {
            "draws": float(len(draws)),
            "filtered_groups": float(accumulator.filtered_groups()),
            "bound_reached": float(bound),
            "prompts_drawn": float(len(draws) * self.groups_needed),
        }
        return merged
