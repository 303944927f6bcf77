"""The staging store orders the two threads' copies by events, with no host wait on the training thread (issue 57,
item 6). On CPU the fences are logged by a stand-in for :class:`~a3po_trl.runtime.devices.StreamFence` (the real one is
tested against fake CUDA events in ``test_devices.py``): what is recorded, and who waits for it, on a stream or on
the host, in which order against the copies and the loads."""

import threading

import torch

from a3po_trl.generation.backend import GenerationBackend
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights, store


class LoggedFences:
    """Stands in for StreamFence in the store; every record and wait goes to ``log`` with the thread that made it."""

    def __init__(self, monkeypatch):
        log, count = [], [0]
        self.log = log

        def who():
            return "main" if threading.current_thread() is threading.main_thread() else "reader"

        class Fence:
            def __init__(self, events=None):
                self.name = events

            @classmethod
            def record(cls, devices):
                count[0] += 1
                fence = cls(f"fence{count[0]}")
                log.append((who(), "record", fence.name))
                return fence

            def wait_on_device(self, devices):
                if self.name:
                    log.append((who(), "stream waits", self.name))

            def wait_on_host(self):
                if self.name:
                    log.append((who(), "host waits", self.name))

            def __bool__(self):
                return self.name is not None

        monkeypatch.setattr(store, "StreamFence", Fence)


class LoggedWeights(dict):
    """A version's weights that log when the store copies each one."""

    def __init__(self, log, value):
        super().__init__(w=torch.full((2,), float(value)))
        self.log = log

    def __getitem__(self, name):
        self.log.append(("main", "copy", name))
        return super().__getitem__(name)


class StreamBackend(GenerationBackend):
    """A backend that says its loads run on the generation thread's stream (as ``generate`` on a GPU)."""

    on_host = False

    @property
    def reads_staging_on_host(self):
        return self.on_host

    def load_weights(self, weights, version):
        self.weights_log.append(("reader", "load", version))

    def generate(self, prompt_ids, should_stop, seed):
        raise NotImplementedError


def _in_reader_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


def test_publishing_never_waits_on_the_host_and_each_side_waits_for_the_other_on_its_stream(monkeypatch):
    fences = LoggedFences(monkeypatch)
    log = fences.log
    layout = StagingLayout({"w": torch.Size([2])}, {"w": torch.float32}, torch.device("cpu"))
    backend = StreamBackend(VersionedWeights(layout, ParameterGather()), "cpu")
    backend.weights_log = log

    backend.restore_weights(0, LoggedWeights(log, 0))
    assert log == [("main", "copy", "w"), ("main", "record", "fence1")]
    log.clear()

    assert _in_reader_thread(backend.refresh)  # the generation thread loads on its stream, after the fill's event
    assert log == [("reader", "stream waits", "fence1"), ("reader", "load", 0), ("reader", "record", "fence2")]
    log.clear()

    backend.restore_weights(1, LoggedWeights(log, 1))  # the same buffers (one set): overwritten after the reads
    assert log == [("main", "stream waits", "fence2"), ("main", "copy", "w"), ("main", "record", "fence3")]
    log.clear()

    backend.on_host = True  # a reader on the host (a server's file, an engine's own streams) waits there instead
    assert _in_reader_thread(backend.refresh)
    assert log == [("reader", "host waits", "fence3"), ("reader", "load", 1)]
    log.clear()

    backend.restore_weights(2, LoggedWeights(log, 2))  # nothing left queued by the host reader: no wait
    assert log == [("main", "copy", "w"), ("main", "record", "fence4")]
    log.clear()

    kept = backend.kept_weights(3)  # a checkpoint's copy reads the buffers on the host, after the fill
    assert log == [("main", "host waits", "fence4")] and torch.equal(kept[2][0]["w"], torch.full((2,), 2.0))


def test_a_server_reading_a_held_version_on_the_host_waits_for_its_fill(monkeypatch):
    fences = LoggedFences(monkeypatch)
    layout = StagingLayout({"w": torch.Size([2])}, {"w": torch.float32}, torch.device("cpu"))
    weights = VersionedWeights(layout, ParameterGather())
    weights.restore(0, LoggedWeights(fences.log, 0))
    fences.log.clear()
    with weights.holding(0) as held:
        assert fences.log == [("main", "host waits", "fence1")] and held is not None


def test_a_publication_returns_its_seconds_and_on_cuda_reads_them_from_events_at_log_time(tokenizer):
    from tiny import make_model

    from a3po_trl.runtime.timing import DeferredSeconds

    model = make_model(tokenizer)
    names = [name for name, _ in model.named_parameters()]
    weights = VersionedWeights(StagingLayout.of(model, names, torch.device("cpu")), ParameterGather())
    seconds = weights.publish(model, 0)
    assert isinstance(seconds, float) and seconds > 0  # on the host: the wall-clock time of the copies
    total = 0.0 + DeferredSeconds(0.5, []) + seconds + DeferredSeconds(0.25, [])  # summed over publications
    assert isinstance(total, DeferredSeconds) and abs(total.seconds() - (0.75 + seconds)) < 1e-12
