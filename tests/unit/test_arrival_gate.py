"""The arrival gate (a3po_trl/runtime/distributed.py): every process passes it together, through the store; a process
that does not arrive (its generation thread stuck, or the process killed) fails every process within the gate's
timeout, with an error naming it and what it was doing. Processes as threads over one store."""

import threading
import time

import pytest
import torch.distributed as dist

from a3po_trl.runtime.activity import Activity, doing, reporting_activity
from a3po_trl.runtime.distributed import ArrivalGate, ProcessDidNotArrive, take_together


def gates(world_size=2, timeout=None):
    store = dist.HashStore()
    return [ArrivalGate(store, index, world_size, 0.01, timeout) for index in range(world_size)]


def in_threads(*targets):
    outcomes = [None] * len(targets)

    def run(index, target):
        try:
            outcomes[index] = target()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcomes[index] = error

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


def test_every_process_passes_each_gate_together():
    first, second = gates(timeout=20.0)

    def passes(gate, delay):
        for _ in range(3):
            time.sleep(delay)
            gate.wait("step")
        return gate.passed

    assert in_threads(lambda: passes(first, 0.0), lambda: passes(second, 0.05)) == [3, 3]


def test_a_process_that_never_arrives_fails_the_others_within_the_timeout_naming_it_and_its_activity():
    """Process 1 published that its generation thread entered a reward function, then stopped (killed, or stuck with
    its main thread): process 0 gives up after the timeout and no later, naming process 1 and the reward function."""
    first, second = gates(timeout=0.5)
    activity = Activity(second.publish_activity)
    with reporting_activity(activity.report), doing("rolling out batch 1"), doing("in the reward function 'f'"):
        start = time.monotonic()  # process 1 stays in the reward function: it never arrives
        with pytest.raises(ProcessDidNotArrive) as raised:
            first.wait("Taking the next generation batch")
        assert 0.5 <= time.monotonic() - start < 5
    message = str(raised.value)
    assert message.startswith("Taking the next generation batch: process 1 did not arrive within 0.5 s")
    assert "process 1 was rolling out batch 1: in the reward function 'f' for the last" in message
    # a process arriving after the others gave up does not pass (it would wait for them in the next collective)
    with pytest.raises(ProcessDidNotArrive, match="process 1 did not arrive"):
        second.wait("Taking the next generation batch")


def test_a_process_that_published_nothing_is_named_too():
    first, _, _ = gates(world_size=3, timeout=0.2)
    with pytest.raises(ProcessDidNotArrive, match="process 1, 2 did not arrive.*process 1 had reported no"):
        first.wait("step")


def test_without_a_timeout_the_gate_waits_as_long_as_a_process_needs():
    first, second = gates(timeout=None)
    assert in_threads(lambda: first.wait("step"), lambda: time.sleep(0.5) or second.wait("step")) == [None, None]


def test_the_late_process_raises_its_own_error_and_the_others_the_gates():
    """take_together: process 1's take fails after the others gave up on it: it raises its own error (which says
    why it is late), the others the gate's, and none waits in the collective that agrees on the outcome."""
    first, second = gates(timeout=0.3)

    def late():
        time.sleep(0.6)
        raise TimeoutError("no batch: the generation thread was in the reward function 'f'")

    outcomes = in_threads(
        lambda: take_together(None, first, lambda: "batch", "take"), lambda: take_together(None, second, late, "take")
    )
    assert isinstance(outcomes[0], ProcessDidNotArrive) and "process 1 did not arrive" in str(outcomes[0])
    assert isinstance(outcomes[1], TimeoutError) and "reward function 'f'" in str(outcomes[1])


def test_activities_nest_and_are_kept_without_a_store():
    activity = Activity()
    with reporting_activity(activity.report):
        with doing("rolling out batch 2"):
            with doing("in the reward function 'f'"):
                assert activity.what == "rolling out batch 2: in the reward function 'f'"
            assert activity.what == "rolling out batch 2"
    with doing("outside any report"):  # a no-op: backends and rollouts used on their own
        pass
    assert activity.what == "rolling out batch 2"
    assert activity.describe().startswith("was rolling out batch 2 for the last")
