"""The bounded queue of scored batches between the generation thread and the trainer."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ..types import GenerationStopped, ScoredBatch


class VersionedSampleQueue:
    """A bounded FIFO of :class:`ScoredBatch` with a close flag; ``get`` and ``put`` wait with a timeout."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"queue size must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[ScoredBatch] = deque()
        self._cond = threading.Condition()
        self.max_depth_seen = 0

    def put(self, item: ScoredBatch, should_stop: Callable[[], bool], poll: float = 0.1) -> None:
        with self._cond:
            while len(self._items) >= self.maxsize:
                if should_stop():
                    raise GenerationStopped
                self._cond.wait(poll)
            self._items.append(item)
            self.max_depth_seen = max(self.max_depth_seen, len(self._items))
            self._cond.notify_all()

    def get(self, timeout: float) -> ScoredBatch | None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
