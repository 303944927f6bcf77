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
from helpers import SWITCH_AFTER, free_port, logged
from in_flight_replay import LOGP_TOLERANCE, full_forward, long_prompts, moved, plain_copy, replay
from tiny import length_reward, make_prompts, make_vllm_model
from vllm_launch import launch_two_processes, start_server, stop_server, wait_healthy
from vllm_lockstep import EngineLockstep

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import a3po_trl.generation.vllm.server_in_flight as server_in_flight  # noqa: E402
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
    """One `trl vllm-serve` server for the module (it adds --enable-scale-out and dev mode), on a saved tiny model,
    with room for prompts longer than a KV-cache block and long completions after them."""
    root = tmp_path_factory.mktemp("vllm-server-in-flight")
    make_vllm_model(tokenizer).save_pretrained(root / "model")
    port = free_port()
    log_path = root / "server.log"
    process = start_server(root / "model", port, log_path, max_model_len=512, slow_steps=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path)
        # every engine step of this server sleeps first (tests/vllm_slow_steps.py), so a pause lands mid-batch
        slow = requests.post(f"{url}/collective_rpc", json={"method": "a3po_test_slow_steps"}, timeout=60)
        assert slow.status_code == 200, slow.text[:200]
        (answer,) = slow.json()["results"]
        assert answer["wrapped"] and answer["step_seconds"] > 0, answer
        yield {"url": url, "model": root / "model"}
    finally:
        stop_server(process)


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


#: Long completions, each sampled to its full length (``ignore_eos``): none can end between the moment the last
#: completion of a batch streams its first token and the moment the server, paused from that stream, stops scheduling.
LONG_COMPLETIONS = {
    "max_completion_length": 160,
    "generation_kwargs": {"ignore_eos": True},
}


class PauseWhenEveryCompletionStarted:
    """Pauses the server (mode ``keep``) from the stream that reads the last first token of each batch, and keeps every
    batch's :class:`~server_in_flight.BatchStreams` (``batches``). From the pause the server samples nothing until it
    is resumed, so what a test does at the generator's next look at the streams (``take``) happens mid-batch: a
    function of the tokens streamed, not of timing. The pause itself travels (an HTTP request, then a call answered by
    the engine between two steps): the module's server sleeps before each engine step (`vllm_slow_steps`), so the pause
    lands within a few tokens, where the tiny model on a quiet machine would otherwise sample the whole batch first."""

    def __init__(self, url: str, setattr_fn):
        self.url = url
        self.armed = True  # pause the batches started from now (a test disarms it for batches that must run through)
        self.batches = []
        self.pending = None  # the streams whose pause no look has taken yet
        self._lock = threading.Lock()
        read_choice, batch_streams = server_in_flight._read_choice, server_in_flight.BatchStreams

        def new_batch(planned):
            streams = batch_streams(planned)
            self.batches.append(streams)
            return streams

        def read_and_pause(completion, choice, url):
            read_choice(completion, choice, url)
            streams = self.batches[-1]
            with self._lock:
                if self.armed and not getattr(streams, "paused_once", False) and streams.all_started():
                    streams.paused_once = True
                    post(f"{self.url}/pause", params={"mode": "keep", "clear_cache": "false"})
                    self.pending = streams

        setattr_fn(server_in_flight, "BatchStreams", new_batch)
        setattr_fn(server_in_flight, "_read_choice", read_and_pause)

    def take(self, streams) -> bool:
        """Whether the server is paused for ``streams`` and no look has taken that pause yet (it is taken now)."""
        with self._lock:
            if self.pending is not streams:
                return False
            self.pending = None
            return True

    def resume(self) -> None:
        post(f"{self.url}/resume")

    def check_taken(self, streams) -> None:
        """After a batch: fail (the server resumed) where it ended while paused, before any look took the pause."""
        if self.take(streams):
            self.resume()
            raise AssertionError("the batch ended before the pause landed: its completions are too short")


def post(url: str, **kwargs) -> None:
    response = requests.post(url, timeout=60, **kwargs)
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:200]}"


def server_labels(completion) -> list[int]:
    return [int(label) for label, start, end in completion.spans for _ in range(start, end)]


def test_a_version_published_mid_batch_is_loaded_into_the_server_with_each_tokens_label_and_logprob(
    tokenizer, tmp_path, vllm_server, monkeypatch
):
    trainer = make_trainer(tokenizer, tmp_path, vllm_server, **LONG_COMPLETIONS)
    backend = trainer._build_backend()
    pause = PauseWhenEveryCompletionStarted(vllm_server["url"], monkeypatch.setattr)
    try:
        old = plain_copy(trainer)
        new = moved(old)
        backend.publish(old, 0)
        assert backend.refresh() and backend.version == 0
        prompts = long_prompts(tokenizer, 4)
        maybe_load = backend._in_flight.maybe_load
        published = []

        def publish_while_paused(streams, timings, loads):
            # the new version is published while the server is paused, once every completion has streamed a token
            if not pause.take(streams):
                return maybe_load(streams, timings, loads)
            try:
                published.append(streams.received())
                backend.publish(new, 1)
                return maybe_load(streams, timings, loads)
            finally:
                pause.resume()

        backend._in_flight.maybe_load = publish_while_paused
        out = backend.generate(prompts, None, seed=3)
        del backend._in_flight.maybe_load
        streams = pause.batches[-1]
        pause.check_taken(streams)
        pause.armed = False

        assert backend.version == 1
        assert out.timings["in_flight_weight_loads"] == 1 and out.timings["in_flight_weight_load"] > 0
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


def test_weights_put_on_the_server_behind_the_backends_back_fail_the_batch(
    tokenizer, tmp_path, vllm_server, monkeypatch
):
    """A label the backend did not load, mid-batch, fails the batch instead of training with the wrong policy."""
    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch

    trainer = make_trainer(tokenizer, tmp_path, vllm_server, **LONG_COMPLETIONS)
    backend = trainer._build_backend()
    url = vllm_server["url"]
    pause = PauseWhenEveryCompletionStarted(url, monkeypatch.setattr)
    try:
        backend.publish(plain_copy(trainer), 0)
        backend.refresh()
        maybe_load = backend._in_flight.maybe_load

        def relabel_while_paused(streams, timings, loads):
            if pause.take(streams):
                try:
                    post(f"{url}/update_weight_version", json={"new_version": "elsewhere"})
                finally:
                    pause.resume()
            return maybe_load(streams, timings, loads)

        backend._in_flight.maybe_load = relabel_while_paused
        with pytest.raises(WeightVersionMismatch, match="'elsewhere'"):
            backend.generate(long_prompts(tokenizer, 2), None, seed=1)
        assert pause.pending is None  # the relabel happened mid-batch
    finally:
        backend.close()


class ServerLockstep(EngineLockstep):
    """:class:`helpers.Lockstep` for the server: the moment every completion of a batch has streamed a token, the
    stream that saw it pauses the server (:class:`PauseWhenEveryCompletionStarted`); the generator's next look counts
    as its third forward (the trainer may go on) and, in a batch ``b >= lag``, waits for the next version, which the
    backend then loads before the server resumes. So batch ``b >= lag`` samples the tokens streamed before the pause
    with version ``b - lag`` and the rest with ``b - lag + 1``. So that a batch switches once only, the trainer also
    takes batch ``j`` only once the generator has finished batch ``j + 1`` (:class:`helpers.Lockstep`'s gate, at lag
    2; the hook on the generator is the server's)."""

    def __init__(self, trainer, setattr_fn, lag, num_batches, url):
        self.pause = PauseWhenEveryCompletionStarted(url, setattr_fn)
        super().__init__(trainer, setattr_fn, lag, num_batches)

    def hook_generator(self, backend) -> None:
        maybe_load = backend._in_flight.maybe_load

        def gated(streams, timings, loads):
            if not self.pause.take(streams):
                return maybe_load(streams, timings, loads)
            try:
                self._forwards = SWITCH_AFTER - 1
                self._generator_forward()
                return maybe_load(streams, timings, loads)
            finally:
                self.pause.resume()

        backend._in_flight.maybe_load = gated
        generate = backend.generate

        def generate_and_check(*args, **kwargs):
            generated = generate(*args, **kwargs)
            self.pause.check_taken(self.pause.batches[-1])
            return generated

        backend.generate = generate_and_check


def test_training_against_the_server_with_in_flight_loads_tags_every_token_and_logs_the_metrics(
    tokenizer, tmp_path, vllm_server, monkeypatch
):
    settings = {"max_completion_length": 96, "generation_kwargs": {"ignore_eos": True}}
    trainer = make_trainer(tokenizer, tmp_path, vllm_server, max_steps=4, max_staleness=2, **settings)
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


def test_two_training_processes_share_the_server_and_load_versions_into_it_mid_batch(tmp_path, vllm_server):
    """A server shared by two training processes (.shared_server): whichever process finds a version both published
    loads it mid-batch, with every request of both kept; each process's tokens carry the server's labels (versions
    loaded by either process), never going back within a completion, within the staleness bound."""
    url = vllm_server["url"]
    result, _, reports = launch_two_processes(tmp_path, vllm_server["model"], "server", "--url", url, "--in-flight")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert sorted(reports) == [0, 1]
    for r in reports.values():
        assert "error" not in r, r.get("traceback")
        assert r["global_step"] == 3 and r["max_staleness_seen"] <= 2
        for batch, (_, version, oldest, _) in zip(r["batch_token_versions"], r["batches"]):
            for row in batch:
                tagged = [v for v in row if v >= 0]
                assert tagged and tagged == sorted(tagged) and tagged[0] >= version >= oldest, row
    # the server is slowed to 20 ms a step and completions run 96 tokens: versions are published mid-batch
    assert sum(sum(r["in_flight_weight_loads"]) for r in reports.values()) >= 1
    assert max(max(r["completion_versions_max"]) for r in reports.values()) == 2
    assert sum(r["shared_switches"] for r in reports.values()) <= 4  # versions 0-3 at most, each once
