"""Process-group teardown at exit (a3po_trl/distributed.py), in a one-process gloo group."""

import atexit
import threading
import time

import pytest
import torch.distributed as dist
from helpers import free_port

from a3po_trl import distributed


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
