"""The agreement of several training processes on the version a shared vLLM server holds
(:mod:`a3po_trl.generation.vllm.shared_server`), with threads standing for the processes and a ``HashStore`` for the
process group's store."""

import random
import threading
import time

import pytest
import torch.distributed as dist

from a3po_trl.generation.vllm.shared_server import SharedServerError, SharedServerVersions
from a3po_trl.types import GenerationStopped


class FakeServer:
    """Records every load; a request checks that the server still holds the version it was sent for."""

    def __init__(self):
        self.version = -1
        self.loads: list[int] = []
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def loader(self, version):
        def load():
            time.sleep(random.uniform(0, 0.004))  # a reload takes time, during which nobody may generate
            with self.lock:
                self.version = version
                self.loads.append(version)
            return True

        return load

    def generate(self, rank, version):
        for _ in range(3):  # several requests (or turns), all of which must see the version
            if self.version != version:
                self.violations.append(f"rank {rank} generated with {self.version}, holding {version}")
            time.sleep(random.uniform(0, 0.003))


def run_processes(world_size, num_batches, min_version, exact, publish_delay=0.004, seed=0):
    """Every process generates ``num_batches`` batches, batch ``i`` with at least ``min_version(i)`` (exactly, when
    ``exact``); the processes publish version ``v`` at about ``v * publish_delay`` seconds, each with its own skew."""
    random.seed(seed)
    store, server = dist.HashStore(), FakeServer()
    coordinators = [SharedServerVersions(store, rank, world_size, poll_interval=0.0005) for rank in range(world_size)]
    published = [-1] * world_size
    used: dict[int, list[int]] = {rank: [] for rank in range(world_size)}
    errors: list[BaseException] = []
    last_version = min_version(num_batches - 1)

    def trainer(rank):
        for version in range(last_version + 1):
            time.sleep(random.uniform(0, 2 * publish_delay))
            published[rank] = version
            coordinators[rank].published(version)

    def generator(rank):
        coordinator = coordinators[rank]
        try:
            for index in range(num_batches):
                needed = min_version(index)
                while published[rank] < needed:
                    time.sleep(0.0005)
                version = needed if exact else published[rank]
                newer = None if exact else (lambda: published[rank])
                while not coordinator.acquire(version, server.loader(version), newer):
                    assert not exact
                    version = published[rank]
                server.generate(rank, version)
                used[rank].append(version)
                following = min_version(index + 1) if exact and index + 1 < num_batches else None
                coordinator.release(following)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(world_size)]
    threads += [threading.Thread(target=generator, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a process is still waiting: deadlock"
    for coordinator in coordinators:
        coordinator.close()
    assert not errors, errors
    return server, used


def processes_between_batches(version, world_size=2, **settings):
    """Processes that have all published ``version`` and are between batches (they will take the newest)."""
    store, server = dist.HashStore(), FakeServer()
    coordinators = [SharedServerVersions(store, rank, world_size, **settings) for rank in range(world_size)]
    for coordinator in coordinators:
        coordinator.published(version)
        coordinator.release(None)
    return server, coordinators


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_batch_of_every_process_is_generated_by_the_version_it_holds(world_size, seed):
    """Newest-version mode: the server switches only forward, never under another process's requests, and each
    version is loaded at most once however the processes interleave."""
    server, used = run_processes(world_size, 12, lambda i: max(0, i - 1), exact=False, seed=seed)
    assert not server.violations, server.violations[:3]
    assert server.loads == sorted(set(server.loads))  # forward only, each version once
    for versions in used.values():
        assert versions == sorted(versions)
        assert all(v >= max(0, i - 1) for i, v in enumerate(versions))  # within the staleness bound


@pytest.mark.parametrize("seed", range(4))
def test_reproducible_runs_generate_every_batch_with_exactly_its_scheduled_version(seed):
    schedule = [0, 0, 1, 1, 2, 3, 3, 4, 5, 5]
    server, used = run_processes(2, len(schedule), lambda i: schedule[i], exact=True, seed=seed)
    assert not server.violations, server.violations[:3]
    assert used == {0: schedule, 1: schedule}
    assert server.loads == sorted(set(schedule))


def test_a_process_past_a_version_is_not_switched_back_to_it():
    """A process that loaded an old version while the others moved the server on loads its newest instead."""
    server, (a, b) = processes_between_batches(0)
    assert a.acquire(0, server.loader(0))
    a.release(None)
    for coordinator in (a, b):
        coordinator.published(1)
    assert b.acquire(1, server.loader(1))
    assert not a.acquire(0, server.loader(0))  # the server holds 1: a must load 1
    assert a.acquire(1, server.loader(1))
    assert server.loads == [0, 1]


def wait_in_thread(coordinator, version, load, should_stop=None):
    outcome = {}

    def run():
        start = time.monotonic()
        try:
            coordinator.acquire(version, load, should_stop=should_stop)
        except BaseException as error:  # noqa: BLE001
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def blocked_pair(liveness_timeout=15.0):
    """Process 0 waits to switch to version 1 while process 1, which published only version 0, holds version 0."""
    server, (waiting, holding) = processes_between_batches(
        0, liveness_timeout=liveness_timeout, heartbeat_interval=0.1
    )
    assert holding.acquire(0, server.loader(0))
    waiting.published(1)
    return waiting, holding, server


@pytest.mark.parametrize("in_flight", [False, True], ids=["between-batches", "in-flight"])
def test_a_switch_waits_for_another_process_batch_of_an_older_version_only_without_in_flight_updates(in_flight):
    """Process b generates a batch with version 0 while a, between batches, wants version 1 (both published it).
    Without in-flight updates b's batch must end with version 0, so a waits; with them b's batch takes version 1 mid
    batch (its tokens labelled), so a switches the server at once."""
    server, (a, b) = processes_between_batches(0, in_flight=in_flight)
    assert a.acquire(0, server.loader(0)) and b.acquire(0, server.loader(0))  # b's batch: version 0, not released
    a.release(None)
    for coordinator in (a, b):
        coordinator.published(1)
    deadline = time.monotonic() + 0.3  # a's stand-in trainer stops waiting then
    if in_flight:
        assert a.acquire(1, server.loader(1), should_stop=lambda: time.monotonic() > deadline)
        assert server.loads == [0, 1]
    else:
        with pytest.raises(GenerationStopped):  # still waiting for b's batch
            a.acquire(1, server.loader(1), should_stop=lambda: time.monotonic() > deadline)
        assert server.loads == [0]
        b.release(None)
        assert a.acquire(1, server.loader(1)) and server.loads == [0, 1]
    for coordinator in (a, b):
        coordinator.close()


def test_a_failure_in_the_process_waited_for_fails_the_waiting_process_naming_it():
    waiting, holding, server = blocked_pair()
    thread, outcome = wait_in_thread(waiting, 1, server.loader(1))
    time.sleep(0.3)
    assert thread.is_alive()  # waits for process 1 to finish with version 0
    holding.fail("RuntimeError: engine failure")
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], SharedServerError)
    assert "process 1: RuntimeError: engine failure" in str(outcome["error"])
    assert server.loads == [0]


def test_a_process_that_closed_or_died_fails_the_waiting_one_within_seconds():
    waiting, holding, server = blocked_pair()
    thread, outcome = wait_in_thread(waiting, 1, server.loader(1))
    holding.close()
    thread.join(5)
    assert "Training process 1 stopped using the vLLM server" in str(outcome["error"])

    waiting, holding, server = blocked_pair(liveness_timeout=1.0)
    holding._closed.set()  # its heartbeat stops, as when the process is killed, without saying it closed
    thread, outcome = wait_in_thread(waiting, 1, server.loader(1))
    thread.join(10)
    assert "Training process 1 has not answered" in str(outcome["error"])
    assert 1.0 <= outcome["seconds"] < 5


def test_a_process_whose_trainer_stops_ends_its_wait_for_the_others_at_once():
    """A stopping trainer's generation thread must not wait for the other processes (they may be waiting for it)."""
    waiting, holding, server = blocked_pair()
    stop = threading.Event()
    thread, outcome = wait_in_thread(waiting, 1, server.loader(1), should_stop=stop.is_set)
    time.sleep(0.3)
    assert thread.is_alive()  # process 1 still holds version 0
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), GenerationStopped)
    assert server.loads == [0]  # nothing was switched


def test_a_new_round_loads_the_server_again_and_may_go_back_in_versions():
    """A resumed run (every process resets together) may start from an older version than the server holds."""
    server, (a, b) = processes_between_batches(5)
    assert a.acquire(5, server.loader(5))
    a.release(None)
    for coordinator in (a, b):
        coordinator.reset()
        coordinator.published(2)
        coordinator.release(None)
    assert b.acquire(2, server.loader(2)) and a.acquire(2, server.loader(2))
    assert server.loads == [5, 2]


def test_a_failure_fails_its_round_only_not_the_next_train_call():
    """One failed ``train()`` must not fail every later ``train()`` of the same trainers: a new round (every process
    resets together when training starts) starts without the failure."""
    waiting, holding, server = blocked_pair()
    holding.fail("RuntimeError: engine failure")
    with pytest.raises(SharedServerError, match="engine failure"):
        waiting.acquire(1, server.loader(1))
    for coordinator in (waiting, holding):
        coordinator.reset()
        coordinator.published(3)
        coordinator.release(None)
    assert waiting.acquire(3, server.loader(3)) and holding.acquire(3, server.loader(3))
    assert server.loads == [0, 3]


def test_a_switch_whose_version_is_no_longer_held_loads_nothing():
    """The process that would switch the server no longer holds the version (its trainer published a newer one over
    it): nothing is loaded, the server keeps what it holds, and the caller is told to take its newest."""
    server, (a, b) = processes_between_batches(0)
    assert a.acquire(0, server.loader(0))
    a.release(None)
    for coordinator in (a, b):
        coordinator.published(1)
    assert not a.acquire(1, lambda: False, newer=lambda: 2)
    assert server.loads == [0]
    assert b.acquire(1, server.loader(1)) and server.loads == [0, 1]


def test_a_process_does_not_use_the_held_version_while_another_switches_the_server_away_from_it():
    """The race the two-flag handshake closes: process 1 (between batches, so it blocked nobody) loaded version 0,
    which the server holds, while process 0 already switches the server to version 1; process 1 must not send
    requests for version 0, and takes version 1 once the switch is done."""
    server, (a, b) = processes_between_batches(0)
    assert a.acquire(0, server.loader(0))
    a.release(None)
    for coordinator in (a, b):
        coordinator.published(1)
    loading, finish = threading.Event(), threading.Event()

    def slow_load():
        loading.set()
        finish.wait(10)
        return server.loader(1)()

    switcher, _ = wait_in_thread(a, 1, slow_load)
    assert loading.wait(5)  # process 0 holds the lock and loads version 1
    outcome = {}
    late = threading.Thread(target=lambda: outcome.update(held=b.acquire(0, server.loader(0), newer=lambda: 1)))
    late.start()
    late.join(5)
    assert outcome == {"held": False}  # not version 0 under the switch: the caller loads its newest, version 1
    finish.set()
    switcher.join(5)
    assert b.acquire(1, server.loader(1)) and server.loads == [0, 1]


# ---- in-flight weight updates: loads mid-batch, salted requests ---------------------------------------------------


class SaltedServer:
    """A server whose requests look the prefix cache up some time after they are sent: records, for every request,
    the version its salt names and the version the server holds when it looks up."""

    def __init__(self):
        self.version = 0
        self.loads: list[int] = []
        self.lookups: list[tuple[int, int]] = []  # (salt version, server version at the lookup)
        self.lock = threading.Lock()

    def loader(self, version):
        def load():
            time.sleep(random.uniform(0, 0.002))
            with self.lock:
                self.version = version
                self.loads.append(version)
            return True

        return load

    def submit(self, salt_version, requests):
        """Send ``requests`` requests; each is scheduled (looks up) after a short delay; returns once all were."""
        for _ in range(requests):
            time.sleep(random.uniform(0, 0.001))
            self.lookups.append((salt_version, self.version))


def run_in_flight_processes(world_size, num_batches, seed):
    """Every process publishes a version after each of its batches and generates ``num_batches`` batches: each sends
    its requests salted with the version :meth:`begin_submission` returned, releases the lock once they are all
    scheduled, then, while its batch decodes, tries to load the newest version every process published."""
    random.seed(seed)
    store, server = dist.HashStore(), SaltedServer()
    coordinators = [
        SharedServerVersions(store, rank, world_size, poll_interval=0.0005, in_flight=True)
        for rank in range(world_size)
    ]
    for coordinator in coordinators:
        coordinator.reset()
        coordinator.published(0)
        coordinator.release(None)  # between batches: any version will do
    assert coordinators[0].acquire(0, server.loader(0))
    errors, seen = [], {rank: [] for rank in range(world_size)}

    def process(rank):
        coordinator = coordinators[rank]
        try:
            for index in range(num_batches):
                start = coordinator.begin_submission()
                server.submit(start, random.randint(1, 4))
                coordinator.end_submission()
                for _ in range(3):  # decode steps, with a look for a newer version between them
                    time.sleep(random.uniform(0, 0.002))
                    coordinator.try_load_newer(index, server.loader(index))
                seen[rank].append((start, coordinator.loaded_version()))
                coordinator.published(index + 1)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a process is still waiting: deadlock"
    assert not errors, errors
    return server, coordinators, seen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_flight_loads_never_fall_between_a_requests_salt_and_its_prefix_lookup(world_size, seed):
    """Loads mid-batch by any process: the server moves forward only, each version once and only once every process
    published it, and every request looks the cache up while the server holds the version its salt names (so a block
    older weights computed never serves a request sent after the load)."""
    server, coordinators, seen = run_in_flight_processes(world_size, 8, seed)
    assert server.lookups and all(salt == held for salt, held in server.lookups), server.lookups[:5]
    assert server.loads == sorted(set(server.loads)) and len(server.loads) > 2
    assert all(coordinators[0].was_loaded(v) for v in server.loads)
    for versions in seen.values():
        assert all(start <= end for start, end in versions)


def test_a_load_mid_batch_waits_for_every_process_to_publish_and_for_the_lock():
    server, (a, b) = processes_between_batches(0)
    assert a.acquire(0, server.loader(0))
    a.published(1)
    assert not a.try_load_newer(1, server.loader(1))  # b has not published 1
    b.published(1)
    assert b.begin_submission() == 0  # b's requests are being scheduled: no load until they all are
    assert not a.try_load_newer(1, server.loader(1))
    b.end_submission()
    assert not a.was_loaded(1)
    assert a.try_load_newer(1, server.loader(1)) and server.loads == [0, 1]
    assert a.loaded_version() == 1 and b.was_loaded(1) and b.was_loaded(0)
    assert not b.try_load_newer(1, server.loader(1))  # already held: nothing loaded twice
    assert b.begin_submission() == 1
    b.end_submission()


def test_a_submission_waits_for_a_load_and_salts_name_the_run_round_and_version():
    server, (a, b) = processes_between_batches(0)
    assert a.acquire(0, server.loader(0))
    for coordinator in (a, b):
        coordinator.published(1)
    loading = threading.Event()

    def slow_load():
        loading.set()
        time.sleep(0.05)
        return server.loader(1)()

    loader = threading.Thread(target=lambda: a.try_load_newer(1, slow_load))
    loader.start()
    loading.wait(5)
    assert b.begin_submission() == 1  # waited for the load in progress
    b.end_submission()
    loader.join(5)
    assert a.cache_salt(1) == b.cache_salt(1) != b.cache_salt(0)
    other_run, _ = processes_between_batches(0)[1]
    assert other_run.cache_salt(1) != a.cache_salt(1)  # another run's version 1 is other weights
    a.reset()
    assert a.cache_salt(1) != b.cache_salt(1)  # a new round (train() again, a resume) may go back in versions


def test_a_submission_wait_ends_when_the_trainer_stops_or_the_holder_dies():
    server, (a, b) = processes_between_batches(0, liveness_timeout=0.3, heartbeat_interval=0.05)
    assert a.begin_submission() == -1
    with pytest.raises(GenerationStopped):
        b.begin_submission(should_stop=lambda: True)
    a.close()
    a._closed.set()  # its heartbeat stops too: it died holding the lock
    with pytest.raises(SharedServerError, match="Training process 0"):
        b.begin_submission()
