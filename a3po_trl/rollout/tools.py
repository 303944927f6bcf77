"""Tool calls of a multi-turn rollout, executed with GRPOTrainer's semantics: the functions a rollout may call (its
standalone tools and its environment's public methods) and :class:`ToolCaller`, which runs them, each within
``tool_call_timeout``, and turns every failure into the ``{"error": ...}`` message the model sees."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..types import GenerationStopped

logger = logging.getLogger(__name__)


def tool_functions(standalone_tools: list, environment: Any) -> tuple[dict, dict]:
    """``(sync, async)`` name -> callable for one rollout: the standalone tools and its environment's public methods
    (``reset`` and ``get_reward`` excluded), as GRPOTrainer builds them."""
    methods = []
    if environment is not None:
        methods = [
            getattr(environment, name)
            for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
    sync, asynchronous = {}, {}
    for tool in list(standalone_tools) + methods:
        (asynchronous if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
    return sync, asynchronous


class ToolCaller:
    """Executes one rollout's tool calls with GRPOTrainer's semantics: a tool that raises, an unknown tool or an
    unsupported call type gives the model ``{"error": ...}`` and counts as a failure. With ``timeout``, a call still
    running after it gives a timeout error (synchronous tools then run in a daemon worker thread). A stop request
    (``should_stop``) ends the wait."""

    def __init__(
        self,
        timeout: float | None,
        async_loop,
        should_stop: Callable[[], bool] | None,
        poll: float = 0.05,
        warned: set[str] | None = None,
    ):
        self.timeout = timeout
        self.async_loop = async_loop
        self.should_stop = should_stop or (lambda: False)
        self.poll = poll
        self.calls = 0
        self.failures = 0
        self.timeouts = 0
        self.seconds = 0.0
        self._warned = warned if warned is not None else set()
        """Tools whose failure was already logged (shared by the callers of one run: one warning per tool)."""

    def run(self, tool_calls: list[dict], sync_tools: dict, async_tools: dict) -> list[tuple[str, Any]]:
        """``(name, result)`` for every call, the synchronous ones first, then the ``async def`` ones (TRL's order)."""
        start = time.perf_counter()
        results, pending = [], []
        for tool_call in tool_calls:
            self.calls += 1
            if self.should_stop():
                raise GenerationStopped
            if tool_call.get("type", "function") != "function":
                self.failures += 1
                name = tool_call.get("name", "unknown")
                results.append((name, {"error": f"Unsupported tool call type: {tool_call['type']}"}))
                continue
            function = tool_call["function"]
            name, arguments = function["name"], function.get("arguments") or {}
            if name in async_tools:
                try:  # calling with wrong arguments fails here, before any await (as in GRPOTrainer)
                    pending.append((name, async_tools[name](**arguments)))
                except Exception as error:  # noqa: BLE001 - the model sees the error
                    results.append((name, self._failed(name, error)))
            elif name in sync_tools:
                results.append((name, self._call_sync(name, sync_tools[name], arguments)))
            else:
                self.failures += 1
                results.append((name, {"error": f"Tool {name} not found."}))
        if pending:
            results.extend(self._call_async(pending))
        self.seconds += time.perf_counter() - start
        return results

    def _failed(self, name: str, error: BaseException) -> dict:
        self.failures += 1
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("Tool %r failed (the model sees the error message): %r", name, error)
        return {"error": str(error)}

    def _timed_out(self, name: str) -> dict:
        self.failures += 1
        self.timeouts += 1
        message = f"Tool {name!r} did not return within {self.timeout} s (tool_call_timeout)."
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("%s The model sees this as the tool's error message; the call is left running.", message)
        return {"error": message}

    def _call_sync(self, name: str, function: Callable, arguments: dict) -> Any:
        if self.timeout is None:
            try:
                return function(**arguments)
            except Exception as error:  # noqa: BLE001 - the model sees the error, as in GRPOTrainer
                return self._failed(name, error)
        box: dict[str, Any] = {}
        done = threading.Event()

        def target():
            try:
                box["result"] = function(**arguments)
            except BaseException as error:  # noqa: BLE001 - handed to the generation thread
                box["error"] = error
            finally:
                done.set()

        threading.Thread(target=target, name=f"a3po-tool-{name}", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not done.wait(min(self.poll, max(deadline - time.monotonic(), 0.0))):
            if self.should_stop():
                raise GenerationStopped
            if time.monotonic() >= deadline:
                return self._timed_out(name)
        if "error" in box:
            if not isinstance(box["error"], Exception):
                raise box["error"]
            return self._failed(name, box["error"])
        return box["result"]

    def _call_async(self, pending: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Await ``(name, coroutine)`` pairs together on TRL's event loop, each within the timeout."""
        timeout = self.timeout

        async def gather():
            awaited = [c if timeout is None else asyncio.wait_for(c, timeout) for _, c in pending]
            return await asyncio.gather(*awaited, return_exceptions=True)

        future = asyncio.run_coroutine_threadsafe(gather(), self.async_loop)
        while True:
            try:
                outcomes = future.result(timeout=self.poll)
                break
            except TimeoutError:
                if self.should_stop():
                    future.cancel()
                    raise GenerationStopped from None
        results = []
        for (name, _), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, TimeoutError):
                results.append((name, self._timed_out(name)))
            elif isinstance(outcome, Exception):
                results.append((name, self._failed(name, outcome)))
            else:
                results.append((name, outcome))
        return results
