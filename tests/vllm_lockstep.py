"""Deterministic switch points for in-flight weight updates with the colocated vLLM engine, shared by
test_vllm_in_flight.py and tests/scripts/distributed_vllm.py (``--in-flight``): :class:`StepHook` counts a batch's
engine steps, :class:`EngineLockstep` is :class:`helpers.Lockstep` with an engine step as the generator's forward,
:func:`check_lockstep_reports` what a 4-step ``distributed_vllm.py --in-flight`` run reports on every process."""

from helpers import Lockstep


class StepHook:
    """Wraps the engine's ``step``: counts the engine steps of a batch, calls ``after(step)`` after each, and keeps
    the finished ``RequestOutput``s by request id."""

    def __init__(self, backend, after):
        self.engine = backend.llm.llm_engine
        self.steps, self.finished, self.after = 0, {}, after
        step = self.engine.step

        def stepping():
            outputs = step()
            self.steps += 1
            for output in outputs:
                if output.finished:
                    self.finished[output.request_id] = output
            self.after(self.steps)
            return outputs

        self.engine.step = stepping

    def remove(self):
        del self.engine.step

    def in_order(self):
        """The finished outputs in the order of the batch's prompts (request ids end with the prompt's index)."""
        return [self.finished[r] for r in sorted(self.finished, key=lambda r: int(r.rsplit("-", 1)[1]))]


class EngineLockstep(Lockstep):
    """:class:`helpers.Lockstep` for the colocated engine: a batch's "forward" is an engine step, counted after it
    ran, so the generator waits for the next version after the third step and loads it before the fourth. The engine
    steps fast, so that a batch switches once only rests on :class:`helpers.Lockstep`'s gate: the trainer takes batch
    ``j`` only once the generator has finished batch ``j + lag - 1`` (with lag 2, ``j + 1``: the version it publishes
    after batch ``j`` cannot reach batch ``j + 1`` mid-way)."""

    def hook_generator(self, backend) -> None:
        StepHook(backend, lambda step: self._generator_forward())


def check_lockstep_reports(reports) -> None:
    """Every process of a 4-step ``tests/scripts/distributed_vllm.py colocate --in-flight`` run (lag 2): batches 2
    and 3 start with version ``b - 2`` and switch, between two engine steps, to ``b - 1`` (published by every
    process), each token tagged with vLLM's own label and the staleness bound held on the oldest tokens."""
    for r in reports:
        assert r["global_step"] == 4
        assert r["start_versions"] == {"0": 0, "1": 0, "2": 0, "3": 1}
        assert r["token_versions"] == r["expected_token_versions"]
        for index in (2, 3):
            assert {v for row in r["token_versions"][index] for v in row if v >= 0} == {index - 2, index - 1}
        assert r["in_flight_weight_loads"] == [0.0, 0.0, 1.0, 1.0]
        assert r["completion_versions_max"] == [1.0, 1.0, 2.0, 2.0]
        assert r["max_staleness_seen"] == 2  # the bound, on the oldest tokens
