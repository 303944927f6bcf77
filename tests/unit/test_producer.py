"""The batch producer (a3po_trl/generation/producer.py) and its queue on their own, with a stand-in backend: admission
control, exact versions, the schedule-miss escape, errors and stopping. No model, no trainer."""

import threading
import time

import pytest
import torch
from torch import nn

from a3po_trl.generation import BatchProducer, GenerationBackend, GenerationStopped, ScoredBatch
from a3po_trl.generation.queue import VersionedSampleQueue
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights


def batch(index=0):
    return ScoredBatch(
        index=index,
        version=-1,
        tensors={},
        rewards_per_func=torch.zeros(1, 1),
        is_truncated=torch.zeros(1, dtype=torch.bool),
        completion_lengths=torch.ones(1, dtype=torch.long),
    )


# ---- the queue ----------------------------------------------------------------------------------------------------
def test_queue_is_a_bounded_fifo():
    queue = VersionedSampleQueue(2)
    queue.put(batch(0), should_stop=lambda: False)
    queue.put(batch(1), should_stop=lambda: False)
    assert len(queue) == 2 and queue.max_depth_seen == 2
    assert [queue.get(0.1).index, queue.get(0.1).index] == [0, 1]
    assert queue.get(0.05) is None


def test_a_full_queue_blocks_put_until_a_get_and_a_stop_ends_the_wait():
    queue = VersionedSampleQueue(1)
    queue.put(batch(0), should_stop=lambda: False)
    done = threading.Event()

    def producer():
        queue.put(batch(1), should_stop=lambda: False, poll=0.01)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.2)
    assert not done.is_set() and len(queue) == 1  # waits for room
    assert queue.get(1.0).index == 0
    thread.join(5)
    assert done.is_set() and queue.get(1.0).index == 1
    queue.put(batch(2), should_stop=lambda: False)
    with pytest.raises(GenerationStopped):
        queue.put(batch(3), should_stop=lambda: True, poll=0.01)


def test_queue_size_must_be_positive():
    with pytest.raises(ValueError, match="queue size must be >= 1"):
        VersionedSampleQueue(0)


# ---- the producer ---------------------------------------------------------------------------------------------------
class RecordingBackend(GenerationBackend):
    """Versions of one weight ``w``; ``generate`` is not used (the rollout stand-in reads :attr:`loaded`)."""

    def __init__(self):
        layout = StagingLayout({"w": torch.Size([1])}, {"w": torch.float32}, torch.device("cpu"))
        super().__init__(VersionedWeights(layout, ParameterGather()), torch.device("cpu"))
        self.loaded = []

    def load_weights(self, weights, version):
        assert float(weights["w"]) == version  # the buffer holds the weights published as this version
        self.loaded.append(version)

    def generate(self, prompt_ids, should_stop, seed):
        raise NotImplementedError


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def make_producer(min_version, num_batches=4, rollout=None, **kwargs):
    backend = RecordingBackend()

    def default_rollout(backend, rows, should_stop, info, index):
        return batch()

    prompts = iter([[{"prompt": str(i)}] for i in range(num_batches)])
    producer = BatchProducer(
        backend, prompts, rollout or default_rollout, min_version, num_batches, queue_size=8, poll_interval=0.01,
        **kwargs,
    )  # fmt: skip
    return producer, backend


def publish(producer, module, version):
    with torch.no_grad():
        module.w.fill_(version)
    producer.publish(module, version)


def test_each_batch_waits_for_its_oldest_allowed_version_and_carries_the_version_it_used():
    module = Policy()
    producer, backend = make_producer(min_version=lambda i: i, num_batches=3)
    producer.start(module, 0)
    try:
        first, _ = producer.get()
        assert (first.index, first.version) == (0, 0)
        time.sleep(0.2)
        assert producer.produced == 1  # batch 1 needs version 1, not published yet: the generator waits
        publish(producer, module, 1)
        second, _ = producer.get()
        assert (second.index, second.version) == (1, 1)
        publish(producer, module, 2)
        third, _ = producer.get()
        assert third.version == 2 and producer.schedule_misses == 0
        assert third.timings["generator_wait_for_staleness_bound"] >= 0.0
    finally:
        assert producer.stop()


def test_exact_versions_generate_with_the_assigned_version_not_the_newest():
    module = Policy()
    producer, backend = make_producer(min_version=lambda i: 0 if i < 2 else 1, num_batches=3, exact_versions=True)
    producer.start(module, 0)
    try:
        publish(producer, module, 1)
        publish(producer, module, 2)  # newer than any batch is assigned
        versions = [producer.get()[0].version for _ in range(3)]
    finally:
        producer.stop()
    assert versions == [0, 0, 1]
    assert backend.loaded == [0, 1]
    # version 0 released once no batch still needs it; version 2 was never published (no batch is assigned it)
    assert backend.kept_versions == [1]


def test_exact_versions_skip_a_publication_by_the_schedule_alone():
    """Under ZeRO-3 and FSDP2 a publication is a collective on every process: whether it is skipped must not depend
    on how far this process's generation thread has got, only on the schedule all processes share."""
    module = Policy()
    producer, backend = make_producer(min_version=lambda i: i, num_batches=3, exact_versions=True, asynchronous=False)
    published, original = [], backend.publish
    backend.publish = lambda module, version, state=None: published.append(version) or original(module, version, state)
    producer.start(module, 0)
    producer.produced = producer.num_batches  # as if this process's thread had generated every batch already
    for version in (1, 2, 3):
        publish(producer, module, version)
    assert published == [0, 1, 2]  # version 3 is newer than any batch is assigned: skipped, on every process alike


def test_a_trainer_waiting_for_a_batch_gets_it_with_the_newest_weights_instead_of_a_deadlock():
    """The loop did not follow the predicted schedule: batch 1 asks for version 5, which the trainer cannot publish
    before it has batch 1."""
    module = Policy()
    producer, _ = make_producer(min_version=lambda i: 5 * i, num_batches=2)
    producer.start(module, 0)
    try:
        producer.get()
        second, _ = producer.get()
    finally:
        producer.stop()
    assert second.version == 0 and producer.schedule_misses == 1


def test_a_rollout_error_reaches_get_with_its_traceback_and_a_note():
    def failing(backend, rows, should_stop, info, index):
        raise KeyError("reward column")

    producer, _ = make_producer(min_version=lambda i: 0, rollout=failing)
    producer.start(Policy(), 0)
    with pytest.raises(KeyError, match="reward column") as info:
        producer.get()
    assert "(raised in the a3po-trl generation thread)" in info.value.__notes__
    assert producer.stop()


def test_a_batch_later_than_the_timeout_fails_get_saying_where_the_generation_thread_is_stuck():
    """A reward function that never returns: ``get`` raises after ``timeout`` seconds, not never, with what the
    generation thread was doing, which it also published (for the other processes' errors)."""
    from a3po_trl.generation.producer import GenerationTimedOut
    from a3po_trl.rollout.scoring import score_completions

    released, published = threading.Event(), []

    def stuck(prompts, completions, **kwargs):
        released.wait()
        return [0.0] * len(prompts)

    def scoring_rollout(backend, rows, should_stop, info, index):
        score_completions([stuck], ["judge"], [None], rows, ["p"], ["c"], [[1]])
        return batch()

    producer, _ = make_producer(
        min_version=lambda i: 0, rollout=scoring_rollout, timeout=0.5, process_index=3,
        publish_activity=lambda what, since: published.append(what),
    )  # fmt: skip
    producer.start(Policy(), 0)
    start = time.monotonic()
    try:
        with pytest.raises(GenerationTimedOut) as raised:
            producer.get()
        assert 0.5 <= time.monotonic() - start < 5
    finally:
        released.set()
        assert producer.stop(timeout=5)
    message = str(raised.value)
    assert message.startswith("Process 3 had no generation batch 0 after 0.5 s (generation_batch_timeout)")
    assert "its generation thread was rolling out batch 0: in the reward function 'judge' for the last" in message
    assert published[:3] == [
        "waiting for the weights of version 0 for batch 0",
        "loading weights for batch 0",
        "rolling out batch 0",
    ]
    assert published[3] == "rolling out batch 0: in the reward function 'judge'"


def test_stop_ends_a_generator_waiting_for_weights():
    producer, _ = make_producer(min_version=lambda i: 10)  # never published
    producer.start(Policy(), 0)
    time.sleep(0.1)
    start = time.monotonic()
    assert producer.stop(timeout=5)
    assert time.monotonic() - start < 2 and not producer.thread.is_alive()


def test_inline_producer_generates_in_get_and_refuses_a_batch_past_the_last():
    producer, backend = make_producer(min_version=lambda i: 0, num_batches=2, asynchronous=False)
    producer.start(Policy(), 0)
    assert producer.thread is None and producer.produced == 0
    producer.get()
    assert producer.produced == 1
    producer.get()
    with pytest.raises(RuntimeError, match="All 2 generation batches"):
        producer.get()
