"""Rollouts, run in the generation thread with whatever backend generates: the prompt batches each process draws
(:mod:`.prompt_batches`), one rollout of a local batch (:mod:`.run`: single-turn, or :mod:`.multi_turn` with
environments and the tool calls of :mod:`.tools`, or a user's ``rollout_func`` in :mod:`.rollout_func`), what it
produces token by token (:mod:`.trajectories`), the seeds of its random streams (:mod:`.seeds`) and its rewards
(:mod:`.scoring`, in worker processes with :mod:`.reward_workers`); with dynamic sampling, the group filter and the
batch made of the groups kept over several draws (:mod:`.dynamic_sampling`), and where each process's prompt stream
stands in a checkpoint (:mod:`.prompt_draws`). Nothing here runs a collective or reads the trainer."""

from .run import RolloutSettings, decode_completions, run_rollout

__all__ = ["RolloutSettings", "decode_completions", "run_rollout"]
