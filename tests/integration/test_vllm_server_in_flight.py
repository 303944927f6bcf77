"""In-flight weight updates with a vLLM server (``vllm_mode="server"``, ``in_flight_weight_updates=True``), for real
on vLLM's CPU build with a `trl vllm-serve` server: a version published while a batch streams is loaded through
vLLM's pause (``keep``) / reload / resume and the batch's requests continue with it; every token carries the server's
label of the weights that sampled it and the log-prob those weights gave it over the KV cache as it was; no
prefix-cache block of older weights serves a later request; training through it logs the in-flight metrics and keeps
the staleness bound per token.
"""

import os
import threading

import pytest
import requests
import torch
from helpers import COMMON as TRAINER_COMMON
from helpers import LOCKSTEP_TIMEOUT, SWITCH_AFTER, Lockstep, free_port, logged
from in_flight_replay import LOGP_TOLERANCE, full_forward, long_prompts, moved, plain_copy, replay
from tiny import length_reward, make_prompts, make_vllm_model
from vllm_launch import start_server, wait_healthy

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import a3po_trl.generation.vllm.server_in_flight as server_in_flight  # noqa: E402
import a3po_trl.trainer  # noqa: E402
from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer  # noqa: E402

pytestmark = pytest.mark.vllm

COMMON = {
    **TRAINER_COMMON,
    "bf16": False,
    "use_vllm": True,
    "vllm_mode": "server",
    "vllm_max_model_length": 256,
    "in_flight_weight_updates": True,
}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tokenizer):
    """One `trl vllm-serve` server for the module (it adds --enable-scale-out and dev mode), on a saved tiny model."""
    import signal

    root = tmp_path_factory.mktemp("vllm-server-in-flight")
    make_vllm_model(tokenizer).save_pretrained(root / "model")
    port = free_port()
    log_path = root / "server.log"
    process = start_server(root / "model", port, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path)
        yield {"url": url, "model": root / "model"}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except Exception:  # noqa: BLE001
                os.killpg(process.pid, signal.SIGKILL)


def make_trainer(tokenizer, tmp_path, server, **overrides):
    from transformers import AutoModelForCausalLM

    settings = {**COMMON, "vllm_server_base_url": server["url"], "max_steps": 4, **overrides}
    return AsyncA3POTrainer(
        model=AutoModelForCausalLM.from_pretrained(server["model"]),
        reward_funcs=[length_reward],
        args=AsyncA3POConfig(output_dir=str(tmp_path / "out"), **settings),
        train_dataset=make_prompts(16),
        processing_class=tokenizer,
    )


class StreamsRecorder:
    """Keeps the :class:`~server_in_flight.BatchStreams` of every batch (what the server streamed, labels included)."""

    def __init__(self, monkeypatch):
        self.batches = []
        original = server_in_flight.BatchStreams

        def recording(planned):
            streams = original(planned)
            self.batches.append(streams)
            return streams

        monkeypatch.setattr(server_in_flight, "BatchStreams", recording)


def server_labels(completion) -> list[int]:
    return [int(label) for label, start, end in completion.spans for _ in range(start, end)]


def test_a_version_published_mid_batch_is_loaded_into_the_server_with_each_tokens_label_and_logprob(
    tokenizer, tmp_path, vllm_server, monkeypatch
):
    trainer = make_trainer(tokenizer, tmp_path, vllm_server, max_completion_length=32)
    backend = trainer._build_backend()
    recorder = StreamsRecorder(monkeypatch)
    try:
        old = plain_copy(trainer)
        new = moved(old)
        backend.publish(old, 0)
        assert backend.refresh() and backend.version == 0
        prompts = long_prompts(tokenizer, 4)
        maybe_load = backend._in_flight.maybe_load
        published = []

        def publish_once_streaming(streams, timings, loads):
            # deterministic: the new version is published once every completion has streamed its first token
            if not published and streams.all_started():
                published.append(streams.received())
                backend.publish(new, 1)
            return maybe_load(streams, timings, loads)

        backend._in_flight.maybe_load = publish_once_streaming
        out = backend.generate(prompts, None, seed=3)
        del backend._in_flight.maybe_load

        assert backend.version == 1
        assert out.timings["in_flight_weight_loads"] == 1 and out.timings["in_flight_weight_load"] > 0
        streams = recorder.batches[-1]
        switched = 0
        for completion, ids, versions, logps, before in zip(
            streams.completions, out.completion_ids, out.token_versions, out.logps, published[0]
        ):
            # each token's version is the server's own label of it: version 0, then version 1 after the load
            assert versions == server_labels(completion)[: len(ids)]
            first_new = versions.index(1) if 1 in versions else len(versions)
            assert versions == [0] * first_new + [1] * (len(versions) - first_new)
            assert first_new >= before >= 1  # what had streamed before the load was sampled by version 0
            switched += first_new < len(versions)
            # each behavior log-prob is the server's own log-prob of the token it sampled
            assert torch.equal(logps, torch.tensor(completion.logps[: len(ids)], dtype=torch.float32))
        assert switched, "some completion must outlive the switch"
        # ... which is what the weights that sampled it gave it over the KV cache as it was: a replay with the server's
        # switch points, each step's forward by its version over one shared cache
        distinct = 0.0
        for prompt, ids, versions, logps in zip(prompts, out.completion_ids, out.token_versions, out.logps):
            replayed = replay({0: old, 1: new}, prompt, ids, versions, trainer.temperature)
            assert (logps - replayed).abs().max().item() < LOGP_TOLERANCE
            if 1 in versions:
                after = versions.index(1)
                alone = full_forward(new, prompt, ids, trainer.temperature)[after:]
                distinct = max(distinct, (logps[after:] - alone).abs().max().item())
        assert distinct > 1e-3  # version 1 over version 0's cache is not version 1 alone

        # the prefix cache could not be reset while the requests held their blocks; it is before the next batch, whose
        # identical prompts then get no block computed by version 0: version 1's log-probs over its own cache
        assert backend._prefix_cache_stale
        again = backend.generate(prompts, None, seed=4)
        assert not backend._prefix_cache_stale
        assert all(versions == [1] * len(versions) for versions in again.token_versions)
        for prompt, ids, logps in zip(prompts, again.completion_ids, again.logps):
            assert (logps - full_forward(new, prompt, ids, trainer.temperature)).abs().max().item() < LOGP_TOLERANCE
    finally:
        backend.close()


def test_weights_put_on_the_server_behind_the_backends_back_fail_the_batch(tokenizer, tmp_path, vllm_server):
    """A label the backend did not load, mid-batch, fails the batch instead of training with the wrong policy."""
    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch

    trainer = make_trainer(tokenizer, tmp_path, vllm_server, max_completion_length=32)
    backend = trainer._build_backend()
    url = vllm_server["url"]
    try:
        backend.publish(plain_copy(trainer), 0)
        backend.refresh()
        maybe_load = backend._in_flight.maybe_load
        done = []

        def relabel_once(streams, timings, loads):
            if not done and streams.all_started():
                done.append(True)
                requests.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=30)
                requests.post(f"{url}/update_weight_version", json={"new_version": "elsewhere"}, timeout=30)
                requests.post(f"{url}/resume", timeout=30)
            return maybe_load(streams, timings, loads)

        backend._in_flight.maybe_load = relabel_once
        with pytest.raises(WeightVersionMismatch, match="'elsewhere'"):
            backend.generate(long_prompts(tokenizer, 2), None, seed=1)
    finally:
        backend.close()


class ServerLockstep(Lockstep):
    """:class:`helpers.Lockstep` for the server: the moment every completion of a batch has streamed a token, the
    stream that saw it pauses the server (``keep``; the tiny model would otherwise finish the batch before the
    generator looks); the generator's next look counts as its third forward (the trainer may go on) and, in a batch
    ``b >= lag``, waits for the next version, which the backend then loads before the server resumes. So batch
    ``b >= lag`` samples the tokens streamed before the pause with version ``b - lag`` and the rest with
    ``b - lag + 1``. So that a batch switches once only, the trainer also takes batch ``j`` only once the generator has
    finished batch ``j + 1`` (as ``EngineLockstep`` of the colocate tests)."""

    def __init__(self, trainer, setattr_fn, lag, num_batches, url):
        self.url = url
        self._paused = None  # the BatchStreams whose server pause is pending
        self._lock = threading.Lock()
        read_choice = server_in_flight._read_choice
        batch_streams = server_in_flight.BatchStreams

        def new_batch(planned):
            self._streams = streams = batch_streams(planned)
            return streams

        def read_and_pause(completion, choice, url):
            read_choice(completion, choice, url)
            streams = self._streams
            with self._lock:
                if not getattr(streams, "paused_once", False) and streams.all_started():
                    streams.paused_once = True
                    requests.post(f"{self.url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60)
                    self._paused = streams

        setattr_fn(server_in_flight, "BatchStreams", new_batch)
        setattr_fn(server_in_flight, "_read_choice", read_and_pause)
        self.finished = [threading.Event() for _ in range(num_batches)]
        super().__init__(trainer, setattr_fn, lag, num_batches)
        gated = a3po_trl.trainer.make_training_batch

        def after_the_next_batch(trainer, scored, *args):
            following = scored.index + 1
            if following < len(self.finished) and not self.finished[following].wait(LOCKSTEP_TIMEOUT):
                raise RuntimeError(f"the generator did not finish batch {following}")
            return gated(trainer, scored, *args)

        setattr_fn(a3po_trl.trainer, "make_training_batch", after_the_next_batch)

    def hook_generator(self, backend) -> None:
        maybe_load = backend._in_flight.maybe_load

        def gated(streams, timings, loads):
            if self._paused is not streams:
                return maybe_load(streams, timings, loads)
            self._paused = None
            try:
                self._forwards = SWITCH_AFTER - 1
                self._generator_forward()
                return maybe_load(streams, timings, loads)
            finally:
                requests.post(f"{self.url}/resume", timeout=60)

        backend._in_flight.maybe_load = gated
        generate = backend.generate

        def generate_and_tell(*args, **kwargs):
            generated = generate(*args, **kwargs)
            self.finished[self._batch].set()
            return generated

        backend.generate = generate_and_tell


def test_training_against_the_server_with_in_flight_loads_tags_every_token_and_logs_the_metrics(
    tokenizer, tmp_path, vllm_server, monkeypatch
):
    trainer = make_trainer(tokenizer, tmp_path, vllm_server, max_steps=4, max_staleness=2, max_completion_length=24)
    lockstep = ServerLockstep(trainer, monkeypatch.setattr, lag=2, num_batches=4, url=vllm_server["url"])
    try:
        trainer.train()
    finally:
        trainer._backend.close()
    assert lockstep.start_versions == {0: 0, 1: 0, 2: 0, 3: 1}
    for index in range(4):
        start, mask = lockstep.start_versions[index], lockstep.masks[index]
        versions = lockstep.token_versions[index]
        assert lockstep.scored_versions[index] == start
        assert (versions[~mask] == -1).all()
        if index < 2:
            assert (versions[mask] == start).all()
            continue
        assert set(versions[mask].tolist()) <= {start, start + 1}
        assert (versions[:, 0] == start).all()  # every completion streamed a token before the load
        for row, row_mask in zip(versions, mask):
            assert (row[row_mask].diff() >= 0).all()
        assert (versions[mask] == start + 1).any(), "some completion must outlive the switch"
    frac = logged(trainer, "a3po/multi_version_trajectories_frac")
    assert frac[:2] == [0.0, 0.0] and all(0 < f <= 1 for f in frac[2:])
    assert logged(trainer, "a3po/completion_versions_max") == [1.0, 1.0, 2.0, 2.0]
    assert all(1.0 < v <= 2.0 for v in logged(trainer, "a3po/completion_versions_mean")[2:])
    assert logged(trainer, "async/in_flight_weight_loads") == [0.0, 0.0, 1.0, 1.0]
    assert all(t > 0 for t in logged(trainer, "async/in_flight_weight_load_time")[2:])
    assert max(logged(trainer, "a3po/staleness_max")) == 2.0  # the bound, on the oldest tokens
    assert all(0 < m < 2 for m in logged(trainer, "a3po/staleness_mean")[2:])  # per token: 2 and 1 mixed
