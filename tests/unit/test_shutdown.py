"""Process-group teardown at exit (a3po_trl/runtime/distributed.py), in a one-process gloo group."""

import atexit
import threading
import time

import pytest
import torch.distributed as dist
from helpers import free_port

from a3po_trl.runtime import distributed


@pytest.fixture
def gloo_group(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn) or fn)
    monkeypatch.setattr(distributed, "_registered", False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield registered
    if dist.is_initialized():
        dist.destroy_process_group()


def test_registers_once_and_destroys_the_group(gloo_group):
    registered = gloo_group
    assert distributed.destroy_process_group_at_exit()
    assert distributed.destroy_process_group_at_exit()  # idempotent: one handler, however many trainers
    assert registered == [distributed.destroy_process_group_if_initialized]
    assert distributed.teardown_registered()
    assert registered[0]() is True  # what atexit will run
    assert not dist.is_initialized()
    assert registered[0]() is False  # already gone (end_training or the user's own call): a no-op


def test_other_backends_are_left_alone(gloo_group):
    assert not distributed.destroy_process_group_at_exit(backends=("nccl",))
    assert gloo_group == []


def test_without_a_process_group_nothing_is_registered(monkeypatch):
    monkeypatch.setattr(distributed, "_registered", False)
    assert not dist.is_initialized()
    assert not distributed.destroy_process_group_at_exit()
    assert distributed.destroy_process_group_if_initialized() is False


def test_the_process_groups_timeout_is_read_from_the_group_and_defaults_without_one():
    """What bounds the arrival gate by default (``generation_batch_timeout=None``): the timeout the process group was
    made with, whoever set it (``ddp_timeout``, accelerate, the script); ``ddp_timeout`` itself without a group."""
    import datetime

    assert distributed.process_group_timeout(1800.0) == 1800.0
    timeout = datetime.timedelta(seconds=17)
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1, timeout=timeout)
    try:
        assert distributed.process_group_timeout(1800.0) == 17.0
    finally:
        dist.destroy_process_group()


def test_the_exit_barrier_waits_for_every_process_and_is_bounded_for_each():
    """Through the store, not a collective: two processes arriving pass it; one alone (the other failed, or is left in
    a collective) waits the timeout and no longer, whatever its rank."""
    store = dist.HashStore()
    passed = []
    threads = [
        threading.Thread(target=lambda: passed.append(distributed.exit_barrier(store, 2, 10.0))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert passed == [None, None]
    alone = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="1 of 2 processes reached the exit within 0.3 s"):
        distributed.exit_barrier(alone, 2, 0.3)
    assert time.monotonic() - start < 5


def test_the_drain_returns_only_once_the_work_queued_before_it_is_done():
    """The exit's gloo barrier: process 0 queues an all-reduce nobody waits for, process 1 joins it 0.5 s later; the
    drain on process 0 returns only after the all-reduce finished (gloo runs a barrier after the work queued before
    it), so no collective is left to gloo's threads during finalization. Two processes as two threads, each with its
    own gloo group over one store."""
    import torch

    groups = two_gloo_groups()
    tensors = [torch.ones(1_000_000), torch.ones(1_000_000)]
    unwaited = groups[0].allreduce([tensors[0]])  # its handle is never waited for, as at the end of a ZeRO-3 run
    seen = {}

    def process_0():
        distributed.drain_pending_work([groups[0]], 10.0)
        seen["completed when the drain returned"] = unwaited.is_completed()

    def process_1():
        time.sleep(0.5)
        groups[1].allreduce([tensors[1]])
        distributed.drain_pending_work([groups[1]], 10.0)

    run_in_threads(process_0, process_1)
    assert seen == {"completed when the drain returned": True}
    assert tensors[0][0].item() == 2.0


def test_the_drain_is_bounded_when_a_process_never_joins():
    groups = two_gloo_groups()
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        distributed.drain_pending_work([groups[0]], 0.5)
    assert time.monotonic() - start < 5
    distributed.drain_pending_work([groups[1]], 10.0)  # the late one meets the barrier still queued on process 0


def test_the_default_group_is_drained_at_exit(gloo_group, monkeypatch):
    world = dist.group.WORLD
    assert distributed.gloo_groups() == [world]
    distributed.drain_pending_work([world], 5.0)  # the group object torch keeps has the barrier the drain calls
    drained = []
    monkeypatch.setattr(distributed, "drain_pending_work", lambda groups, timeout: drained.append(groups))
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)  # one process, presented as two
    monkeypatch.setattr(distributed, "exit_barrier", lambda *args: None)
    assert distributed.destroy_process_group_if_initialized() is True
    assert drained == [[world]]


# One of two processes in a gloo group whose timeout is 60 s, with the trainer's exit handler and a drain bound of 2 s.
# Process 1 reaches the exit but its group never meets the drain's barrier (a wedged group, a collective nobody
# joined): process 0's drain times out. Each prints when its exit starts (a handler registered after the trainer's
# runs before it).
EXIT_WITH_A_WEDGED_PEER = """
import atexit, datetime, sys, time
import torch.distributed as dist
from a3po_trl.runtime import distributed

rank, port = int(sys.argv[1]), sys.argv[2]
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
distributed.EXIT_BARRIER_TIMEOUT_SECONDS = 2.0
distributed.destroy_process_group_at_exit()
if rank == 1:
    distributed.drain_pending_work = lambda groups, seconds: time.sleep(300)
atexit.register(lambda: print(f"exit starts at {time.time()}", flush=True))
print("ready", flush=True)
"""


def test_the_exit_is_bounded_by_the_drain_not_by_the_process_groups_timeout():
    """When the exit's drain times out, its barrier stays queued on gloo's threads, which destroy_process_group (and
    the interpreter's finalization) waited for until the process group's timeout (58 s of 60 here; 30 min by
    default): the process now ends with status 1 within about the drain's 2 s. The bound asserted, 30 s, is a
    correctness bound, half the group's timeout, not a speed target."""
    import subprocess
    import sys

    port = free_port()
    command = [sys.executable, "-c", EXIT_WITH_A_WEDGED_PEER]
    processes = [
        subprocess.Popen([*command, str(rank), str(port)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)
    ]
    try:
        first = processes[0]
        status = first.wait(timeout=240)
        ended = time.time()
        output = first.stdout.read()
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert "ready" in output, output
    exit_started = float(output.split("exit starts at ")[1].split()[0])
    assert ended - exit_started < 30.0, f"the exit took {ended - exit_started:.1f} s"
    assert status == 1


def two_gloo_groups():
    """Process groups of two gloo processes over one store, one per rank, made (together) in two threads."""
    import datetime

    store, groups = dist.HashStore(), [None, None]

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))

    run_in_threads(lambda: make(0), lambda: make(1))
    return groups


def run_in_threads(*targets):
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
