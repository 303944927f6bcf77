"""Devices without an index: accelerate gives a one-process CUDA run ``torch.device("cuda")``, which
``torch.cuda.set_device`` refuses. The generator normalises every device it is given, once; these tests stand in for
CUDA with the calls torch would make, so they catch the crash on a CPU machine."""

import contextlib

import torch

from a3po_trl.generation import BatchProducer, GenerationBackend
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights
from a3po_trl.runtime.devices import explicit_device, same_device, wait_for_copies
from a3po_trl.types import ScoredBatch


def test_explicit_device_gives_cuda_the_current_index_and_leaves_indexed_and_host_devices_alone():
    assert explicit_device("cuda", current_index=lambda: 3) == torch.device("cuda:3")
    assert explicit_device(torch.device("cuda", 1), current_index=lambda: 3) == torch.device("cuda:1")
    assert explicit_device("cpu") == torch.device("cpu")
    assert explicit_device("meta") == torch.device("meta")


def test_same_device_compares_memory_not_spelling(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda"), torch.device("cuda:1"))
    assert same_device(torch.device("cpu"), torch.device("cpu:0"))
    assert not same_device(torch.device("cpu"), torch.device("cuda:0"))


class FakeCuda:
    """What the generation thread asks of CUDA, with torch's own refusal of a device without an index."""

    def __init__(self):
        self.set_devices, self.synchronized = [], []

    def set_device(self, device):
        device = torch.device(device)
        if device.index is None:  # torch: "Expected a torch.device with a specified index or an integer"
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.set_devices.append(device)

    def install(self, monkeypatch):
        fake = self

        class Stream:  # torch.cuda.Stream's signature: (device=None, priority=0)
            def __init__(self, device=None, priority=0):
                if torch.device(device).index is None:
                    raise ValueError("Expected a torch.device with a specified index")

            def synchronize(self):
                fake.synchronized.append("stream")

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


class OneWeightBackend(GenerationBackend):
    def __init__(self, device):
        layout = StagingLayout({"w": torch.Size([1])}, {"w": torch.float32}, torch.device("cpu"))
        super().__init__(VersionedWeights(layout, ParameterGather()), device)

    def load_weights(self, weights, version):
        pass

    def generate(self, prompt_ids, should_stop, seed):
        raise NotImplementedError


def test_a_backend_given_cuda_without_an_index_generates_on_the_current_device(monkeypatch):
    """The one-GPU crash: the producer's thread sets its device and makes its stream from the backend's device."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    backend = OneWeightBackend(torch.device("cuda"))  # what accelerate gives a one-process run
    assert backend.device == torch.device("cuda:0")

    def rollout(backend, rows, should_stop, state, index):
        return ScoredBatch(
            index=index,
            version=-1,
            tensors={},
            rewards_per_func=torch.zeros(1, 1),
            is_truncated=torch.zeros(1, dtype=torch.bool),
            completion_lengths=torch.ones(1, dtype=torch.long),
        )

    producer = BatchProducer(
        backend, iter([[{"prompt": "a"}]]), rollout, lambda i: 0, num_batches=1, queue_size=1, poll_interval=0.01
    )
    producer.start(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(1))}), 0)
    try:
        batch, _ = producer.get()
    finally:
        producer.stop()
    assert batch.index == 0
    assert fake.set_devices == [torch.device("cuda:0")]


def test_waiting_for_copies_waits_on_every_cuda_device_named_and_ignores_the_host(monkeypatch):
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waited.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    wait_for_copies([torch.device("cpu"), torch.device("cuda"), torch.device("cuda:2"), torch.device("cuda:1")])
    assert sorted(str(d) for d in waited) == ["cuda:1", "cuda:2"]  # "cuda" is cuda:2: waited for once


def test_the_generation_stream_is_requested_at_high_priority(monkeypatch):
    """On CUDA the generation thread's stream outranks the training stream (priority 0): its decode kernels do not
    queue behind training's. What a CPU machine can show: the stream is asked for at that priority, on that device."""
    from a3po_trl.runtime import devices

    requested = []
    monkeypatch.setattr(devices.torch.cuda, "Stream", lambda device, priority=0: requested.append((device, priority)))
    devices.generation_stream(torch.device("cuda", 1))
    assert requested == [(torch.device("cuda", 1), devices.GENERATION_STREAM_PRIORITY)]
    assert devices.GENERATION_STREAM_PRIORITY < 0  # CUDA runs a lower number first; the default stream is 0


class FakeEvents:
    """torch.cuda's events and current streams, logging what is recorded, waited for on a stream, and on the host."""

    def __init__(self, monkeypatch):
        self.log = []
        fake = self

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.name = f"event{Event.count}"

            def record(self, stream):
                fake.log.append(("record", self.name, stream.device))

            def synchronize(self):
                fake.log.append(("host waits", self.name))

        class Stream:
            def __init__(self, device):
                self.device = str(device)

            def wait_event(self, event):
                fake.log.append(("stream waits", event.name, self.device))

            def synchronize(self):
                fake.log.append(("host waits", "stream", self.device))

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(explicit_device(device)))


def test_a_stream_fence_records_on_the_current_streams_and_is_waited_for_by_a_stream_or_by_the_host(monkeypatch):
    from a3po_trl.runtime.devices import StreamFence

    fake = FakeEvents(monkeypatch)
    fence = StreamFence.record([torch.device("cpu"), torch.device("cuda"), torch.device("cuda:0")])
    assert fake.log == [("record", "event1", "cuda:0")]  # "cuda" is cuda:0: one event; the host has none
    fake.log.clear()
    fence.wait_on_device([torch.device("cuda:1"), torch.device("cpu")])
    assert fake.log == [("stream waits", "event1", "cuda:1")]  # another device's stream; the host does not wait
    fake.log.clear()
    fence.wait_on_host()
    assert fake.log == [("host waits", "event1")]
    fake.log.clear()
    empty = StreamFence.record([torch.device("cpu")])  # work the host ran itself: nothing to wait for
    empty.wait_on_device([torch.device("cuda:0")])
    empty.wait_on_host()
    assert not empty and fake.log == []
