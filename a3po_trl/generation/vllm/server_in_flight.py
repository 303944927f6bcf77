"""In-flight weight updates on a vLLM server (``vllm_mode="server"``, ``in_flight_weight_updates=True``): a version
the trainer publishes while a batch is generated is loaded into the server mid-batch, and the batch's requests
continue with it.

The requests. A batch is generated through vLLM's token route ``POST /inference/v1/generate`` (``stream=true``),
which the server serves when started with ``--enable-scale-out`` (``trl vllm-serve`` adds it): it takes token ids and
vLLM's own ``SamplingParams`` (the same requests, seeds and streams as ``/v1/completions``,
:func:`~.server.completion_requests`), streams each completion's tokens with their log-probs as they are sampled, and
gives, with a completion's last chunk, the label of the weights that sampled each of its tokens (``weight_versions``:
spans of tokens and the label the engine held at the step that sampled them; ``/v1/completions`` returns none).

A load (:class:`InFlightServerLoads`). Between two looks at the streams (every :data:`POLL_SECONDS`), when a newer
version is published and every completion of the batch has streamed a token: ``POST /pause?mode=keep&clear_cache=
false`` (vLLM stops scheduling, keeps every request with its KV cache, and answers once no step runs; ``clear_cache``
must be false: true would preempt the running requests and recompute their cache), the load the backend does between
batches (the file reload through ``/collective_rpc``, or TRL's NCCL weight transfer on a GPU), its label
(``/update_weight_version``), then ``POST /resume``. The requests continue with the new weights over the KV cache of
their earlier tokens as the older weights computed it (as in PipelineRL, and as vLLM colocate does). Each token's
version is the server's label of it; it is checked against what the backend loaded
(:func:`~.weight_versions.check_server_token_versions`): a label of a version it loaded during the batch, never going
back, and every token the backend had received when it paused labelled with the version it replaced or older. Each
token's behavior log-prob is the server's log-prob of it, given by the weights that sampled it.

The prefix cache. vLLM looks a request's blocks up in its prefix cache when it first schedules it. A load waits until
every completion of the batch has streamed a token (so every request was scheduled, its lookups done), and the cache,
which vLLM cannot reset while requests hold blocks, is reset before the next batch's requests are sent (retried until
vLLM reports success): no block computed by older weights serves a new request. A request preempted after a load finds
its own earlier blocks where the cache still holds them and recomputes the others with the weights loaded then.

A server shared by several training processes (:mod:`.shared_server`): a process loads mid-batch the newest version
every process has published, when no process holds the lock they share (never waiting for it), with every process's
requests kept through the pause. The cache is not reset (several processes' requests nearly always hold blocks):
every request is salted with the run, round and version the server holds when it is sent, and a process holds the lock
from reading that version until every request of its batch has streamed a token, so no load falls between a request's
salt and its prefix-cache lookup. The tokens' labels are checked against the versions any process loaded since the
batch started (the store's log), and this process's own loads as above.

What is refused at start (:func:`check_in_flight_server`): a server without the routes (``/weight_info`` and
``/pause`` of vLLM >= 0.32 in dev mode, ``/inference/v1/generate`` with ``--enable-scale-out``); LoRA (a request names
its version's adapter when it is sent and keeps it to its end).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, wait

from ...timeline import record_in_batch_span
from ...types import GenerationStopped
from .errors import VLLMServerError
from .sampling import completions_from_token_logprobs, sampling_fields
from .weight_versions import check_server_token_versions, labels_from_spans

#: Seconds between looks at the streams (for a newer version to load, and ``should_stop``) while a batch runs.
POLL_SECONDS = 0.01

IN_FLIGHT_SERVER_LORA_REFUSAL = (
    "in_flight_weight_updates=True is not supported with vllm_mode='server' and LoRA (peft_config): the server serves "
    "each LoRA version as its own adapter, which a request names when it is sent and keeps to its end (vLLM 0.32 "
    "cannot switch a running request to another adapter), so a version cannot be taken mid-completion. Train full "
    "weights (the server then loads each version mid-batch), set use_vllm=False (the generate backend does it with "
    "LoRA), or set in_flight_weight_updates=False."
)


def check_in_flight_server(backend) -> None:
    """Refuse, naming the server flag to add, a server without the routes in-flight loads need (see the module
    doc). ``backend``: the :class:`~.server.VLLMServerBackend`, with its server reachable."""
    prefix = f"in_flight_weight_updates=True with the vLLM server at {backend.base_url}"
    if not backend._labelled:
        raise VLLMServerError(
            f"{prefix} needs vLLM >= 0.32, which labels each token with the weights that sampled it (GET "
            "/weight_info answered 404). Upgrade the server's vLLM, or set in_flight_weight_updates=False."
        )
    if _status(backend, "GET", "/is_paused") == 404:
        raise VLLMServerError(
            f"{prefix} needs vLLM's /pause and /resume routes (vLLM >= 0.32 in dev mode): start the server with "
            "`trl vllm-serve`, or with VLLM_SERVER_DEV_MODE=1 in its environment; or set in_flight_weight_updates="
            "False."
        )
    status = _status(backend, "POST", "/inference/v1/generate", json={})
    if status in (403, 404):  # 403: vLLM's answer when --enable-scale-out is off; 404: a vLLM without the route
        raise VLLMServerError(
            f"{prefix} generates through /inference/v1/generate, which returns each token's weight version "
            f"(/v1/completions returns none); the server answered {status}: start it with --enable-scale-out "
            "(`trl vllm-serve` adds it from vLLM 0.30), or set in_flight_weight_updates=False."
        )


def _status(backend, method: str, path: str, **kwargs) -> int:
    try:
        return backend._session.request(
            method, backend.base_url + path, timeout=backend.request_timeout, **kwargs
        ).status_code
    except backend._requests.exceptions.RequestException as error:
        message = f"The vLLM server at {backend.base_url}{path} cannot be reached ({error})."
        raise VLLMServerError(message) from error


class _Completion:
    """One completion as it streams: its tokens, their log-probs, and (once finished) the labels' spans."""

    __slots__ = ("tokens", "logps", "spans", "finished")

    def __init__(self):
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.spans: list[tuple[str, int, int]] | None = None
        self.finished = False


class BatchStreams:
    """The completions of one batch's requests as they stream, in row order (request ``r``'s children in order)."""

    def __init__(self, planned):
        self.requests = [[_Completion() for _ in range(n)] for _, n, _ in planned]
        self.completions = [c for children in self.requests for c in children]
        self.stopped = threading.Event()
        """Set when the batch ends early: the streams close (vLLM aborts their requests)."""

    def all_started(self) -> bool:
        """Whether every completion has streamed a token (or finished): every request was scheduled."""
        return all(c.tokens or c.finished for c in self.completions)

    def received(self) -> list[int]:
        """Tokens received so far, per completion."""
        return [len(c.tokens) for c in self.completions]


def stream_request(
    backend, streams: BatchStreams, index: int, prompt: list[int], n: int, seed: int | None, salt: str | None = None
) -> None:
    """Send request ``index`` of the batch (``n`` completions of ``prompt``, child ``j`` from the stream of ``seed +
    j``; ``salt``: its prefix-cache salt) to ``/inference/v1/generate`` and read its stream into ``streams``. Raises
    :class:`~.server.VLLMServerError` on an error or after ``vllm_request_timeout`` seconds; returns early once
    ``streams.stopped`` is set."""
    sampling = {"detokenize": False, **sampling_fields(backend.sampling, n, seed)}
    payload = {"model": backend.model, "token_ids": list(prompt), "sampling_params": sampling, "stream": True}
    if salt is not None:
        payload["cache_salt"] = salt
    url, timeout = f"{backend.base_url}/inference/v1/generate", backend.request_timeout
    deadline = time.monotonic() + timeout
    children = streams.requests[index]
    try:
        with backend._session.post(url, json=payload, stream=True, timeout=timeout) as response:
            if response.status_code != 200:
                raise VLLMServerError(
                    f"The vLLM server at {url} answered {response.status_code}: {response.text[:500]}"
                )
            for line in response.iter_lines():
                if streams.stopped.is_set():
                    return  # closing the stream aborts the request on the server
                if time.monotonic() > deadline:
                    raise VLLMServerError(f"The vLLM server at {url} did not finish a request within {timeout} s.")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    raise VLLMServerError(f"The vLLM server at {url} failed a request: {str(chunk['error'])[:500]}")
                for choice in chunk.get("choices", []):
                    _read_choice(children[choice["index"]], choice, url)
    except backend._requests.exceptions.Timeout as error:
        raise VLLMServerError(f"The vLLM server at {url} did not answer within {timeout} s.") from error
    except backend._requests.exceptions.RequestException as error:
        raise VLLMServerError(f"The vLLM server at {url} cannot be reached ({error}); did it stop?") from error
    if not streams.stopped.is_set() and not all(c.finished for c in children):
        raise VLLMServerError(f"The vLLM server at {url} ended a stream before its completions finished.")


def _read_choice(completion: _Completion, choice: dict, url: str) -> None:
    tokens = choice.get("token_ids") or []
    if tokens:
        content = (choice.get("logprobs") or {}).get("content")
        if content is None or len(content) != len(tokens):
            raise VLLMServerError(f"The vLLM server at {url} streamed tokens without their log-probs.")
        completion.logps.extend(float(entry["logprob"]) for entry in content)
        completion.tokens.extend(tokens)
    reason = choice.get("finish_reason")
    if reason is not None:
        if reason not in ("stop", "length"):
            raise VLLMServerError(f"The vLLM server at {url} ended a completion with finish_reason={reason!r}.")
        spans = choice.get("weight_versions") or []
        completion.spans = [(span["version"], span["start"], span["end"]) for span in spans]
        completion.finished = True


class InFlightServerLoads:
    """Loads newer published weights into the server mid-batch, pausing it with its requests kept (module doc)."""

    def __init__(self, backend):
        self.backend = backend

    def maybe_load(self, streams: BatchStreams, timings: dict[str, float], loads: list) -> bool:
        """Load the newest published version if it is newer and every completion of the batch has streamed a token;
        appends ``(replaced version, tokens received per completion at the pause, loaded version)`` to ``loads`` and
        adds the load's seconds and count to ``timings``. Returns whether it loaded."""
        backend = self.backend
        if backend._shared is not None:
            return self._maybe_load_shared(streams, timings, loads)
        if backend.published_version <= backend.version or not streams.all_started():
            return False
        replaced = backend.version
        start = time.perf_counter()
        backend._post("/pause", backend.sync_timeout, params={"mode": "keep", "clear_cache": "false"})
        try:
            received = streams.received()  # sampled by `replaced` or older: the server runs no step from here
            loaded = backend.refresh()
        finally:
            backend._post("/resume", backend.sync_timeout)
        end = time.perf_counter()
        if not loaded:
            return False
        _count_load(loads, timings, start, end, replaced, received, backend.version, tokens=sum(streams.received()))
        return True

    def _maybe_load_shared(self, streams: BatchStreams, timings: dict[str, float], loads: list) -> bool:
        """A server shared by several processes: load this process's newest version if every process has published
        it and no process holds the lock (:meth:`~.shared_server.SharedServerVersions.try_load_newer`; every
        request any process sent has then been scheduled)."""
        backend, shared = self.backend, self.backend._shared
        target = backend.published_version
        if target <= shared.loaded_version():
            return False
        paused = []  # (the version replaced, tokens received per completion) read while paused, under the lock

        def at_pause():
            paused.append((shared.loaded_version(), streams.received()))

        def load() -> bool:  # pauses the server (every process's requests kept), reloads, labels, resumes
            return backend._switch_server_to(target, at_pause=at_pause)

        start = time.perf_counter()
        if not shared.try_load_newer(target, load):
            return False
        end = time.perf_counter()
        replaced, received = paused[0]
        _count_load(loads, timings, start, end, replaced, received, target, tokens=sum(received))
        return True


def _count_load(loads: list, timings: dict[str, float], start, end, replaced, received, loaded, tokens: int) -> None:
    """Record a load mid-batch: ``(replaced, received, loaded)`` in ``loads``, its seconds and count in ``timings``,
    and its span on the timeline (with ``tokens`` streamed)."""
    loads.append((replaced, received, loaded))
    timings["in_flight_weight_load"] += end - start
    timings["in_flight_weight_loads"] += 1
    record_in_batch_span(
        "in-flight weight load", start, end, tokens=tokens, replaced_version=replaced, loaded_version=loaded
    )


def _versions_loaded_since(shared, first: int) -> list[int]:
    """The versions a shared server held from ``first`` on (loaded by any process), in order."""
    return [first] + [v for v in range(first + 1, shared.loaded_version() + 1) if shared.was_loaded(v)]


def generate_in_flight(backend, planned, should_stop):
    """A batch of the requests ``planned`` (:func:`~.server.completion_requests`) through the streaming route, newer
    versions loaded mid-batch (module doc): the completions, their behavior log-probs and each token's version
    (``token_versions``), in row order."""
    shared = backend._shared
    streams = BatchStreams(planned)
    salt = None
    if shared is None:
        backend._reset_stale_prefix_cache()  # before any request of this batch may look the cache up
        backend._check_label("before")
        first_version = backend.version
    else:  # no load until every request of this batch has been scheduled; salted with the version they start with
        first_version = shared.begin_submission(should_stop)
        salt = shared.cache_salt(first_version)
    loads = []
    timings = {"in_flight_weight_load": 0.0, "in_flight_weight_loads": 0.0}
    try:
        futures = [
            backend._pool.submit(stream_request, backend, streams, index, prompt, n, seed, salt)
            for index, (prompt, n, seed) in enumerate(planned)
        ]
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()  # raises a request's error now, not after the slowest request
                if pending and should_stop is not None and should_stop():
                    raise GenerationStopped
                if shared is not None and streams.all_started():
                    shared.end_submission()
                if pending:
                    backend._in_flight.maybe_load(streams, timings, loads)
        except BaseException:
            streams.stopped.set()
            for future in futures:
                future.cancel()
            raise
    finally:
        if shared is not None:
            shared.end_submission()
    if shared is None:
        backend._check_label("after")
        loaded = [first_version] + [version for _, _, version in loads]
    else:
        loaded = _versions_loaded_since(shared, first_version)
    labels = [
        labels_from_spans(c.spans or [], len(c.tokens), f"{backend.base_url} completion {i}")
        for i, c in enumerate(streams.completions)
    ]
    versions = check_server_token_versions(labels, loaded, [(replaced, received) for replaced, received, _ in loads])
    generated = completions_from_token_logprobs(
        [(c.tokens, c.logps) for c in streams.completions], backend.sampling.stop_token_ids
    )
    generated.token_versions = [row[: len(ids)] for row, ids in zip(versions, generated.completion_ids)]
    generated.timings.update(timings)
    return generated
