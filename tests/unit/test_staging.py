"""The staging store (:mod:`a3po_trl.generation.weights.store`) and the host-memory side of the memory plan
(:mod:`a3po_trl.generation.weights.memory_plan`), on the CPU.

- one allocation per version: a flat buffer with one aligned view per weight, bit-identical to the weights; pinned
  host memory registered with CUDA once per version (the registration is faked here: pinning needs CUDA) and
  unregistered when the buffer goes;
- the store's lock is held only for its bookkeeping: a publication whose gather blocks (a collective waiting for
  another process) and a load that blocks (a file write, an engine reload) never keep the other thread from the lock;
- the memory plan: pinned staging x processes on the node x versions against the host memory available (a fake
  ``/proc/meminfo``), torch's cached device memory counted as free (fake CUDA statistics), and colocated vLLM staging
  on the GPU when the copy fits there, else in pinned host memory (1.5B and 7B on the meta device).

``pytest -k "staging or host_memory"`` selects these (and the staging tests of test_weights.py)."""

import gc
import threading
import types

import pytest
import torch
from tiny import make_meta_qwen25, make_model

from a3po_trl.generation.vllm.weight_loading import vllm_staging_layout
from a3po_trl.generation.weights import ParameterGather, StagingLayout, VersionedWeights
from a3po_trl.generation.weights import store as store_module
from a3po_trl.generation.weights.memory_plan import (
    DEVICE_STAGING_RESERVE,
    GIB,
    GeneratorMemoryError,
    GeneratorSetup,
    available_host_memory,
    free_device_memory,
    plan_generator_memory,
    plan_generator_memory_choosing_staging,
    processes_on_node,
)
from a3po_trl.generation.weights.store import STAGING_ALIGNMENT

BF16, FP32 = torch.bfloat16, torch.float32
CPU, GPU = torch.device("cpu"), torch.device("cuda:0")
TIMEOUT = 10.0


def mixed_model(tokenizer):
    """The tiny model with a tied head, one weight in bf16, and an integer buffer-like parameter (odd sizes)."""
    model = make_model(tokenizer, tie_word_embeddings=True)
    model.model.norm.weight.data = model.model.norm.weight.data.to(BF16)
    model.register_parameter("steps", torch.nn.Parameter(torch.tensor([3, 1, 4], dtype=torch.int64), False))
    model.register_parameter("odd", torch.nn.Parameter(torch.randn(3, 5, dtype=FP32)))
    return model


def every_name(model):
    """The staged names: each parameter once (a tied head is its embedding's tensor, staged once)."""
    return [name for name, _ in model.named_parameters()]


class CountingEmpty:
    """``torch.empty``, counting the calls."""

    def __init__(self):
        self.calls, self.original = [], torch.empty

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.original(*args, **kwargs)


# ---- one allocation per version ------------------------------------------------------------------------------------
def test_staging_is_one_allocation_per_version_with_views_bit_identical_to_the_weights(tokenizer, monkeypatch):
    model = mixed_model(tokenizer)
    names = every_name(model)
    assert "lm_head.weight" not in names and model.lm_head.weight is model.model.embed_tokens.weight
    weights = VersionedWeights(StagingLayout.of(model, names, CPU), ParameterGather())
    weights.keep_versions = True
    empty = CountingEmpty()
    monkeypatch.setattr(torch, "empty", empty)
    for version in range(3):
        with torch.no_grad():
            model.odd.add_(1.0)
        weights.publish(model, version)
        assert len(empty.calls) == version + 1 and weights.allocated_sets == version + 1
        held = {}
        weights.load_newer(version - 1, version, lambda buffers, v, state, held=held: held.update(buffers))
        params = dict(model.named_parameters())
        storages = {t.untyped_storage().data_ptr() for t in held.values()}
        assert len(storages) == 1  # every view in the one buffer
        assert next(iter(held.values())).untyped_storage().nbytes() == weights.layout.bytes_per_version
        assert sorted(held) == sorted(names)  # the tied weight once, as the model holds it once
        for name, view in held.items():
            assert view.dtype == params[name].dtype and view.shape == params[name].shape, name
            assert torch.equal(view, params[name].detach()), name  # bit for bit (same dtype)
            offset = view.data_ptr() - min(t.data_ptr() for t in held.values())
            assert offset % STAGING_ALIGNMENT == 0 and view.data_ptr() % view.element_size() == 0, name
    weights.release_before(2)
    weights.publish(model, 3)
    assert len(empty.calls) == 3  # a released set is reused, not allocated again


def test_staging_bytes_are_the_weights_bytes_at_7b_not_the_power_of_two_rounding():
    """Qwen2.5-7B in bf16: one version is its 15.2 GB, where one pinned allocation per weight (rounded up to a power of
    two by the caching host allocator) would take 1.9x (the issue's arithmetic)."""
    model = make_meta_qwen25("7b")
    layout = vllm_staging_layout(model, BF16, GPU)
    weight_bytes = [layout.weight_bytes(name) for name in layout.shapes]
    assert layout.pin_memory and layout.bytes_per_version == sum(weight_bytes) == 2 * sum(
        p.numel() for p in model.parameters()
    )
    per_weight_rounded = sum(1 << (size - 1).bit_length() for size in weight_bytes)
    assert per_weight_rounded / layout.bytes_per_version > 1.8


def test_pinned_staging_registers_one_buffer_per_version_and_unregisters_it_when_freed(tokenizer, monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setattr(store_module, "_host_register", lambda pointer, nbytes: registered.append((pointer, nbytes)))
    monkeypatch.setattr(store_module, "_host_unregister", lambda storage, pointer: unregistered.append(pointer))
    model = mixed_model(tokenizer)
    layout = StagingLayout.of(model, every_name(model), CPU, BF16, pin_memory=True)
    weights = VersionedWeights(layout, ParameterGather())
    weights.keep_versions = True
    weights.publish(model, 0)
    weights.publish(model, 1)
    weights.publish(model, 1)  # the same version again: a free set, no new registration
    assert [nbytes for _, nbytes in registered] == [layout.bytes_per_version] * 2
    assert weights.allocated_bytes == 2 * layout.bytes_per_version
    with weights.holding(1) as (buffers, _):
        for name, param in model.named_parameters():
            expected = param.detach().to(BF16) if param.is_floating_point() else param.detach()
            assert buffers[name].dtype == expected.dtype and torch.equal(buffers[name], expected), name
    del weights, buffers
    gc.collect()
    assert sorted(unregistered) == sorted(pointer for pointer, _ in registered)


# ---- the lock: bookkeeping only ------------------------------------------------------------------------------------
class BlockingGather(ParameterGather):
    """A gather that stops before its first tensor until ``release`` is set (a collective waiting for another
    process)."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def full_tensors(self, named_params):
        self.started.set()
        assert self.release.wait(TIMEOUT), "the test never released the gather"
        yield from super().full_tensors(named_params)


def in_thread(fn):
    errors = []

    def run():
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_staging_publish_does_not_hold_the_lock_while_it_gathers(tokenizer):
    model = make_model(tokenizer)
    names = every_name(model)
    weights = VersionedWeights(StagingLayout.of(model, names, CPU), ParameterGather())
    weights.keep_versions = True
    weights.publish(model, 0)
    weights.gather = gather = BlockingGather()
    publisher, errors = in_thread(lambda: weights.publish(model, 1))
    try:
        assert gather.started.wait(TIMEOUT)
        # the generation thread's bookkeeping and a whole load of the held version, while the gather blocks
        done = threading.Event()
        reader, reader_errors = in_thread(
            lambda: (weights.newest, weights.versions, weights.load_newer(-1, 0, lambda *a: None), done.set())
        )
        assert done.wait(TIMEOUT), "a reader waited for the lock while the main thread gathered"
        reader.join(TIMEOUT)
        assert not reader_errors and weights.versions == [0] and weights.newest == 0
        with weights.holding(0) as held:  # the shared-server switcher's hold: immediate too
            assert held is not None
    finally:
        gather.release.set()
        publisher.join(TIMEOUT)
    assert not publisher.is_alive() and not errors
    assert weights.versions == [0, 1] and weights.newest == 1


def test_staging_a_load_in_progress_keeps_neither_the_lock_nor_another_sets_publication_waiting(tokenizer):
    model = make_model(tokenizer)
    weights = VersionedWeights(StagingLayout.of(model, every_name(model), CPU), ParameterGather())
    weights.keep_versions = True
    weights.publish(model, 0)
    loading, finish = threading.Event(), threading.Event()

    def slow_load(buffers, version, state):  # a file write, an engine reload
        loading.set()
        assert finish.wait(TIMEOUT)

    reader, errors = in_thread(lambda: weights.load_newer(-1, None, slow_load))
    try:
        assert loading.wait(TIMEOUT)
        published, publish_errors = in_thread(lambda: weights.publish(model, 1))
        published.join(TIMEOUT)
        assert not published.is_alive(), "the publication waited for a load of another version"
        assert not publish_errors and weights.versions == [0, 1]
    finally:
        finish.set()
        reader.join(TIMEOUT)
    assert not errors


def test_staging_with_one_set_a_publication_waits_for_its_reader_and_never_overwrites_what_it_loads(tokenizer):
    model = make_model(tokenizer)
    weights = VersionedWeights(StagingLayout.of(model, every_name(model), CPU), ParameterGather())
    weights.publish(model, 0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loading, finish, seen = threading.Event(), threading.Event(), {}

    def slow_load(buffers, version, state):
        loading.set()
        assert finish.wait(TIMEOUT)
        seen.update({name: t.clone() for name, t in buffers.items()})

    reader, errors = in_thread(lambda: weights.load_newer(-1, None, slow_load))
    try:
        assert loading.wait(TIMEOUT)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        publisher, publish_errors = in_thread(lambda: weights.publish(model, 1))
        publisher.join(0.3)
        assert publisher.is_alive()  # waiting for the reader of the only set (on a condition, not the lock)
        assert weights.newest == 0 and weights.versions == []  # bookkeeping answers meanwhile
    finally:
        finish.set()
        reader.join(TIMEOUT)
        publisher.join(TIMEOUT)
    assert not errors and not publish_errors and not publisher.is_alive()
    assert all(torch.equal(seen[name], before[name]) for name in before)  # version 0, whole, while it loaded
    assert weights.versions == [1] and weights.allocated_sets == 1
    # the generation thread asking for the newest while a publication is in flight waits for it, then loads it
    weights.gather = gather = BlockingGather()
    publisher, publish_errors = in_thread(lambda: weights.publish(model, 2))
    assert gather.started.wait(TIMEOUT)
    loaded = []
    reader, errors = in_thread(lambda: loaded.append(weights.load_newer(1, None, lambda *a: None)))
    reader.join(0.3)
    assert reader.is_alive() and not loaded
    gather.release.set()
    publisher.join(TIMEOUT)
    reader.join(TIMEOUT)
    assert loaded == [2] and not errors and not publish_errors


def test_staging_the_shared_server_switcher_writes_its_file_without_the_lock(tokenizer, tmp_path):
    """The generation thread of the process that switches a shared vLLM server writes the version file from the
    staging buffers (``VLLMServerBackend._switch_server_to``); the main thread's bookkeeping and its publication of
    the next version (kept versions) go on meanwhile, and the file holds the version whole (views of one buffer)."""
    from safetensors.torch import load_file

    from a3po_trl.generation.vllm.server import VLLMServerBackend

    model = make_model(tokenizer)
    weights = VersionedWeights(StagingLayout.of(model, every_name(model), CPU, BF16), ParameterGather())
    weights.keep_versions = True
    weights.publish(model, 0)
    writing, finish = threading.Event(), threading.Event()
    switcher = types.SimpleNamespace(
        weights=weights, _tied_head=False, _weights_dir=str(tmp_path / "weights"), _in_flight=None
    )

    def slow_write(buffers):  # the real file write, made slow
        writing.set()
        assert finish.wait(TIMEOUT)
        VLLMServerBackend._write_weights_file(switcher, buffers)

    switcher._write_weights_file = slow_write
    switcher._reload_from_file = lambda: None
    switcher._set_label = lambda label: None  # no server to label
    switched = []
    thread, errors = in_thread(lambda: switched.append(VLLMServerBackend._switch_server_to(switcher, 0)))
    try:
        assert writing.wait(TIMEOUT)
        publisher, publish_errors = in_thread(lambda: weights.publish(model, 1))
        publisher.join(TIMEOUT)
        assert not publisher.is_alive() and not publish_errors and weights.newest == 1
    finally:
        finish.set()
        thread.join(TIMEOUT)
    assert switched == [True] and not errors
    written = load_file(str(tmp_path / "weights" / "model.safetensors"))
    for name, param in model.named_parameters():
        assert torch.equal(written[name], param.detach().to(BF16)), name


# ---- host memory in the plan ---------------------------------------------------------------------------------------
def fake_meminfo(tmp_path, available_gib: float) -> str:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       2113567744 kB\nMemFree:         1048576 kB\n"
        f"MemAvailable:   {int(available_gib * 2**20)} kB\nBuffers:          524288 kB\n"
    )
    return str(path)


def test_host_memory_available_is_read_from_meminfo(tmp_path, monkeypatch):
    assert available_host_memory(fake_meminfo(tmp_path, 12.5)) == int(12.5 * 2**20) * 1024
    assert available_host_memory(str(tmp_path / "missing")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert processes_on_node() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert processes_on_node() == 1


def server_setup(**changes):
    setup = dict(
        backend="vllm-server", generation_device=GPU, training_device=GPU, dtype=BF16, sharded=True,
        gradient_shards=8, optimizer_shards=8, processes_on_node=8,
    )  # fmt: skip
    return GeneratorSetup(**{**setup, **changes})


def test_host_memory_plan_refuses_pinned_staging_beyond_available_ram_and_names_the_fix(tmp_path):
    """Qwen2.5-7B, full weights, 8 processes on a node, each staging bf16 versions in pinned host memory."""
    model = make_meta_qwen25("7b")
    version = 2 * sum(p.numel() for p in model.parameters())  # 15.2 GB
    one = plan_generator_memory(model, server_setup())
    assert one.staging_location == "pinned host memory" and one.pinned_host_bytes == version
    assert one.pinned_host_bytes_on_node == 8 * version  # 122 GB
    one.check({}, available_host_memory(fake_meminfo(tmp_path, 200)))  # fits 200 GiB
    kept = plan_generator_memory(model, server_setup(staging_sets=4))  # reproducible_generation, max_staleness=2
    assert kept.pinned_host_bytes_on_node == 8 * 4 * version  # 487 GB
    with pytest.raises(GeneratorMemoryError) as refused:
        kept.check({}, available_host_memory(fake_meminfo(tmp_path, 200)))
    message = str(refused.value)
    for words in ("x 4 version(s) x 8 process(es)", "LOCAL_WORLD_SIZE", "200.0 GiB", "MemAvailable",
                  "reproducible_generation=False or a smaller max_staleness", "LoRA (peft_config)",
                  "fewer training processes on this machine"):  # fmt: skip
        assert words in message, words
    kept.check({}, None)  # host memory unknown: not checked
    figures = kept.figures()
    assert (
        figures["pinned_host_bytes_on_node"] == 8 * 4 * version and figures["staging_location"] == "pinned host memory"
    )


def test_host_memory_of_the_generate_backend_is_not_pinned():
    plan = plan_generator_memory(make_meta_qwen25("1.5b"), server_setup(backend="generate"))
    assert plan.pinned_host_bytes == 0 and plan.staging_location == "device cuda:0"
    plan.check({}, 0)  # nothing pinned: never refused for host memory


def test_staging_plan_counts_torchs_cached_device_memory_as_free(monkeypatch):
    """A GPU whose memory torch has cached (reserved, not allocated) is not full: the plan must not refuse a run
    that fits in it."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12 * GIB)
    free = free_device_memory([GPU, CPU])
    assert free == {"cuda:0": 38 * GIB}
    plan = plan_generator_memory(
        make_meta_qwen25("7b"), server_setup(backend="generate", training_state_allocated=True)
    )
    assert 28 * GIB < plan.device_bytes < 29 * GIB  # the generator's copy and one staged version, bf16
    plan.check(free)
    with pytest.raises(GeneratorMemoryError, match="10.0 GiB are free"):
        plan.check({"cuda:0": 10 * GIB})  # the driver's figure alone


# ---- colocated vLLM: staging on the GPU when it fits ---------------------------------------------------------------
def colocate_setup(**changes):
    setup = dict(
        backend="vllm-colocate", generation_device=GPU, training_device=GPU, dtype=BF16, sharded=True,
        gradient_shards=8, optimizer_shards=8, vllm_gpu_memory_utilization=0.3, device_total_bytes=140 * GIB,
        processes_on_node=8,
    )  # fmt: skip
    return GeneratorSetup(**{**setup, **changes})


@pytest.mark.parametrize("size", ["1.5b", "7b"])
def test_colocate_staging_on_the_gpu_when_it_fits_else_in_pinned_host_memory(size, tmp_path):
    model = make_meta_qwen25(size)
    version = 2 * sum(p.numel() for p in model.parameters())  # 3.1 GB at 1.5B, 15.2 GB at 7B
    setup = colocate_setup()
    roomy = plan_generator_memory_choosing_staging(model, setup, {"cuda:0": 130 * GIB})
    assert roomy.staging_device == GPU and roomy.staging_location == "device cuda:0"
    assert roomy.pinned_host_bytes == 0 and roomy.bytes_on(CPU) == 0
    host = plan_generator_memory(model, GeneratorSetup(**{**setup.__dict__, "staging_device": CPU}))
    assert roomy.device_bytes == host.device_bytes + version
    assert "staging in device cuda:0: fits beside the engine" in roomy.describe()
    roomy.check({"cuda:0": 130 * GIB}, available_host_memory(fake_meminfo(tmp_path, 1)))  # nothing pinned
    # just too little room: what the GPU staging would leave is under the reserve for activations
    tight_free = host.device_bytes + version + int(DEVICE_STAGING_RESERVE * setup.device_total_bytes) - 1
    tight = plan_generator_memory_choosing_staging(model, setup, {"cuda:0": tight_free})
    assert tight.staging_device == CPU and tight.staging_location == "pinned host memory"
    assert tight.pinned_host_bytes == version and tight.device_bytes == host.device_bytes
    assert "kept for activations" in tight.staging_reason
    unknown = plan_generator_memory_choosing_staging(model, setup, {})
    assert unknown.staging_location == "pinned host memory"
    assert plan_generator_memory_choosing_staging(model, setup, {"cuda:0": tight_free + 1}).staging_device == GPU
    # the backend stages where the plan chose
    on_gpu = vllm_staging_layout(model, BF16, GPU, roomy.staging_device)
    assert on_gpu.device == GPU and not on_gpu.pin_memory and on_gpu.bytes_per_version == version
    on_host = vllm_staging_layout(model, BF16, GPU, tight.staging_device)
    assert on_host.device == CPU and on_host.pin_memory and on_host.where == "pinned host memory"


def test_colocate_staging_on_a_cpu_engine_or_for_other_backends_is_not_chosen():
    model = make_meta_qwen25("1.5b")
    cpu_engine = plan_generator_memory_choosing_staging(
        model, colocate_setup(generation_device=CPU, training_device=CPU, device_total_bytes=None), {}
    )
    assert cpu_engine.staging_location == "host memory" and cpu_engine.pinned_host_bytes == 0
    server = plan_generator_memory_choosing_staging(model, server_setup(), {"cuda:0": 130 * GIB})
    assert server.staging_location == "pinned host memory"  # the server loads from the host
