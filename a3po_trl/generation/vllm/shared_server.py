"""One full-weight vLLM server shared by several training processes: which version it holds, agreed through a store.

Each training process has its own generation thread and its own published versions (the same weights on every process:
they are published after the same optimizer step). The server holds one version at a time, so the processes agree,
through a key-value store (the training process group's ``TCPStore``; store calls are not collectives), on which
version it holds and when it may move on:

- ``published/{rank}``: the newest version the process has published (set by its main thread);
- ``needed/{rank}``: the oldest version the process may still generate with. While a batch is generated it is that
  batch's version (all its turns); between batches, the next batch's exact version (``reproducible_generation``) or
  "any" (the newest published, which is never older than what the server holds);
- ``loaded``: the version the server holds; ``switch``: a lock held by the process that loads a new one.

A process about to generate with version ``v`` (:meth:`SharedServerVersions.acquire`) writes ``needed = v``, then
uses the server if it holds ``v`` and nobody is switching. If it holds an older version, the process takes the lock
and, when every process has published ``v`` and none needs an older version any more, loads ``v`` itself (the file +
reload path; every process's copy of ``v`` is the same) and releases the lock. Writing ``needed`` before reading the
lock, and taking the lock before reading ``needed``, is the two-flag handshake that keeps a switch from slipping
between another process's check and its requests. Versions on the server only move forward; every process that
finds the server past the version it loaded has published a newer one (a switch needs every process's publication),
and loads that instead.

With in-flight weight updates (``in_flight_weight_updates=True``) the server also moves on while batches are
generated: any process may load, mid-batch, a version every process has published (:meth:`try_load_newer`: the lock,
never waited for; the load pauses the server with every process's requests kept), and a process between batches
switches the server without waiting for the other processes' batches of older versions to end (``needed`` no longer
holds a switch back: those batches go on with the new version). Two more rules keep the prefix cache
clean without resetting it (which vLLM refuses while any request holds a block, as several processes' requests in
flight nearly always do): every request carries a cache salt naming the run and the version the server holds
(:meth:`cache_salt`), so a block computed by older weights can only serve requests sent before the load; and a
process holds the lock from reading the version it salts its batch's requests with until every one of them has been
scheduled (:meth:`begin_submission`, :meth:`end_submission`), so no load falls between a request's send and its
prefix-cache lookup. Each version loaded is logged (``loaded/{version}``), for every process to check the labels of
its tokens against (:meth:`was_loaded`).

A process waits only for what it needs: the other processes' batches of an older version to finish (their
generation, tool calls and rewards, as with one process the next batch waits for the previous one), and for every
process to publish the version (they publish right after the same optimizer step). Nothing waits on a timer: a
process that failed or closed its backend is reported through the store (``failed``, for the round, and
``closed/{rank}``), and one that
died is noticed by its heartbeat (``alive/{rank}``, advanced every second by a thread) stopping, so the others fail
within ``liveness_timeout`` seconds with an error that names it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from ...types import GenerationStopped

#: ``needed`` of a process that may generate with any version (between batches, when it takes the newest).
ANY_VERSION = 2**62


class SharedServerError(RuntimeError):
    """Another training process sharing the vLLM server failed, stopped, or stopped answering."""


class SharedServerVersions:
    """The version a shared vLLM server holds, agreed among the training processes (see the module doc).

    Args:
        store: a ``torch.distributed.Store`` every process reaches, private to this run (a ``PrefixStore``).
        rank: this process's index; ``world_size``: how many processes share the server.
        poll_interval: seconds between looks at the store while waiting.
        heartbeat_interval: seconds between this process's heartbeats.
        liveness_timeout: seconds without a heartbeat after which a process that is waited for is declared dead.
        in_flight: the processes' batches take newer versions mid-batch (``in_flight_weight_updates``): a switch
            between batches waits for every process to publish the version only, not for the other processes'
            batches of older versions to end (those batches go on with the new version, their tokens labelled).
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        poll_interval: float = 0.01,
        heartbeat_interval: float = 1.0,
        liveness_timeout: float = 15.0,
        in_flight: bool = False,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.poll_interval = poll_interval
        self.liveness_timeout = liveness_timeout
        self.in_flight = in_flight
        self.switches = 0
        """Versions this process loaded into the server."""
        self.wait_seconds = 0.0
        """Seconds this process's generation waited for the server to hold its version (switches included)."""
        self._round = 0
        self._closed = threading.Event()
        self._heartbeat_interval = heartbeat_interval
        self._last_beat: dict[int, tuple[int, float]] = {}
        # the run's name in cache salts (a server outlives runs, whose version numbers start again)
        self.nonce = self.store.compare_set("nonce", "", uuid.uuid4().hex[:12]).decode()
        self._holding = False
        self.store.add(f"alive/{rank}", 1)
        self._heartbeat = threading.Thread(target=self._beat, name=f"a3po-server-heartbeat-{rank}", daemon=True)
        self._heartbeat.start()

    # ---- keys ------------------------------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"round{self._round}/{name}"

    def _get_int(self, name: str, missing: int = -1) -> int:
        key = self._key(name)
        if not self.store.check([key]):
            return missing
        return int(self.store.get(key))

    def _set_int(self, name: str, value: int) -> None:
        self.store.set(self._key(name), str(value))

    # ---- main thread -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new round (every process together, when training starts or resumes: versions may go back): what
        the server holds is unknown, and it is loaded again before the first batch."""
        self._round += 1

    def published(self, version: int) -> None:
        """This process has published ``version`` (its newest)."""
        self._set_int(f"published/{self.rank}", version)

    # ---- generation thread -----------------------------------------------------------------------------------------
    def acquire(
        self,
        version: int,
        load: Callable[[], bool],
        newer: Callable[[], int] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Make the server hold ``version`` for this process's next requests, loading it with ``load()`` if this
        process is the one to switch it (``load`` returns False, having loaded nothing, when this process no longer
        holds ``version``). Returns False, without holding anything, if the server moved past ``version`` or
        (``newer`` given) this process published a newer version meanwhile: the caller loads its newest and asks
        again. Raises :class:`SharedServerError` if a process it waits for failed or died, and
        :class:`GenerationStopped` when ``should_stop()`` turns true while it waits (this process's trainer is
        stopping: its generation thread must not wait for the others)."""
        start = time.perf_counter()
        try:
            while True:
                if should_stop is not None and should_stop():
                    raise GenerationStopped
                self._check_failed()
                self._set_int(f"needed/{self.rank}", version)
                holder = self._lock_holder()
                if holder is not None:
                    self._check_alive([holder], version)  # a process that died while switching holds the lock
                else:
                    loaded = self._get_int("loaded")
                    if loaded == version:
                        return True
                    if loaded > version:
                        self._set_int(f"needed/{self.rank}", loaded)
                        return False
                    if self._try_switch(version, load):
                        return True
                if newer is not None and newer() > version:
                    return False
                time.sleep(self.poll_interval)
        finally:
            self.wait_seconds += time.perf_counter() - start

    def release(self, next_version: int | None) -> None:
        """The batch is done: this process will next generate with exactly ``next_version``, or (None) its newest."""
        self._set_int(f"needed/{self.rank}", ANY_VERSION if next_version is None else next_version)

    def fail(self, reason: str) -> None:
        """Tell the other processes that this one's generation failed in this round (they stop waiting for it and
        fail too); the next round (the next ``train()``) starts clean."""
        key = self._key("failed")
        if not self.store.check([key]):
            self.store.set(key, f"process {self.rank}: {reason}")

    def close(self) -> None:
        """This process no longer uses the server (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.store.set(f"closed/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host may be gone at teardown
            pass

    # ---- generation thread, in-flight weight updates -----------------------------------------------------------
    def cache_salt(self, version: int) -> str:
        """The prefix-cache salt of requests sent while the server holds ``version`` in this round of this run."""
        return f"a3po-{self.nonce}-r{self._round}-v{version}"

    def begin_submission(self, should_stop: Callable[[], bool] | None = None) -> int:
        """Take the lock (waiting while another process loads or submits) and return the version the server holds:
        this process's next requests are salted with it, and no process loads until :meth:`end_submission`.
        Raises :class:`SharedServerError` if the holder failed or died, :class:`GenerationStopped` when
        ``should_stop()`` turns true while it waits."""
        start = time.perf_counter()
        try:
            while True:
                if should_stop is not None and should_stop():
                    raise GenerationStopped
                self._check_failed()
                if self._take_lock():
                    self._holding = True
                    return self._get_int("loaded")
                holder = self._lock_holder()
                if holder is not None:
                    self._check_alive([holder], self._get_int("loaded"))
                time.sleep(self.poll_interval)
        finally:
            self.wait_seconds += time.perf_counter() - start

    def end_submission(self) -> None:
        """Every request sent since :meth:`begin_submission` has been scheduled (or the batch ended): release the
        lock (idempotent)."""
        if self._holding:
            self._holding = False
            self._release_lock()

    def try_load_newer(self, version: int, load: Callable[[], bool]) -> bool:
        """Load ``version`` into the server with ``load()`` now, mid-batch, if it is newer than what it holds, every
        process has published it, and nobody holds the lock (never waits: the batch goes on otherwise). ``load``
        returns False, having loaded nothing, when this process no longer holds ``version``. Returns whether it
        loaded."""
        if self._holding or self._get_int("loaded") >= version:
            return False  # (holding the lock for its own submission, this process is what a load waits for)
        if any(self._get_int(f"published/{rank}") < version for rank in range(self.world_size)):
            return False
        if not self._take_lock():
            return False
        try:
            if self._get_int("loaded") >= version or not load():
                return False
            self._loaded(version)
            return True
        finally:
            self._release_lock()

    def loaded_version(self) -> int:
        """The version the server holds now (-1: none loaded in this round yet)."""
        return self._get_int("loaded")

    def was_loaded(self, version: int) -> bool:
        """Whether the server was loaded with ``version`` in this round (by any process)."""
        return self.store.check([self._key(f"loaded/{version}")])

    # ---- internals -------------------------------------------------------------------------------------------------
    def _lock_holder(self) -> int | None:
        key = self._key("switch")
        if not self.store.check([key]):
            return None
        holder = self.store.get(key).decode()
        return int(holder) if holder else None

    def _try_switch(self, version: int, load: Callable[[], bool]) -> bool:
        """Take the switch lock; if every process has published ``version`` and none needs an older one (with
        in-flight updates: every process has published it), load it."""
        if not self._take_lock():
            return False
        try:
            if self._get_int("loaded") >= version:
                return False
            blockers = [
                rank
                for rank in range(self.world_size)
                if self._get_int(f"published/{rank}") < version
                or (not self.in_flight and rank != self.rank and self._get_int(f"needed/{rank}") < version)
            ]
            if blockers:
                self._check_alive(blockers, version)
                return False
            if not load():
                return False  # this process no longer holds the version (it published a newer one)
            self._loaded(version)
            return True
        finally:
            self._release_lock()

    def _take_lock(self) -> bool:
        """Take the ``switch`` lock if nobody holds it; returns whether this process holds it now."""
        me = str(self.rank)
        return self.store.compare_set(self._key("switch"), "", me).decode() == me

    def _release_lock(self) -> None:
        self.store.set(self._key("switch"), "")

    def _loaded(self, version: int) -> None:
        """This process (holding the lock) loaded ``version`` into the server."""
        self._set_int("loaded", version)
        self._set_int(f"loaded/{version}", 1)
        self.switches += 1

    def _check_failed(self) -> None:
        key = self._key("failed")
        if self.store.check([key]):
            raise SharedServerError(
                f"A training process sharing the vLLM server failed ({self.store.get(key).decode()}); this "
                "process stops generating too."
            )

    def _check_alive(self, ranks: list[int], version: int) -> None:
        """Raise if a process this one waits for (to publish ``version`` or finish with an older one) closed its
        backend or stopped beating."""
        now = time.monotonic()
        for rank in ranks:
            if self.store.check([f"closed/{rank}"]):
                raise SharedServerError(
                    f"Training process {rank} stopped using the vLLM server while this process waits for it to "
                    f"publish or finish with weights older than version {version}; see its log."
                )
            beat = int(self.store.add(f"alive/{rank}", 0))
            last = self._last_beat.get(rank)
            if last is None or last[0] != beat:
                self._last_beat[rank] = (beat, now)
            elif now - last[1] > self.liveness_timeout:
                raise SharedServerError(
                    f"Training process {rank} has not answered for {now - last[1]:.0f} s (no heartbeat) while this "
                    f"process waits for it to publish or finish with weights older than version {version}; it "
                    "probably died: see its log."
                )

    def _beat(self) -> None:
        while not self._closed.wait(self._heartbeat_interval):
            try:
                self.store.add(f"alive/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: the run is ending
                return
