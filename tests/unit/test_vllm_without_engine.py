"""What the vLLM backends send to vLLM, checked without vLLM: the seeds of the server backend's completion requests,
and the merged weights the colocate backend pushes for PEFT configs vLLM cannot serve as adapters.

The engine is replaced by a stand-in that records what it receives and answers as vLLM does, so these run in the main
suite; ``tests/integration/test_vllm.py`` checks the same paths against the real engine and server.
"""

import copy
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from tiny import make_model

from a3po_trl.generation.vllm.sampling import VLLMSamplingSettings, row_seeds, sampling_fields
from a3po_trl.generation.vllm.weight_loading import base_checkpoint_tensors

# ---- server: one random stream per row ------------------------------------------------------------------------------


class FakeCompletionsEndpoint:
    """``/v1/completions`` as vLLM 0.32 serves it: one engine request per prompt of the request, all with the request's
    seed, and child ``j`` of a request with ``n > 1`` sampling from the stream of ``seed + j``
    (``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest._get_child_sampling_params``). Each completion is the
    seed of the stream that sampled it (``-1``: unseeded), so a test reads off which stream every row got."""

    def __init__(self):
        self.payloads = []
        self.label = "default"  # the server's weight label (vLLM's dev-mode /update_weight_version, /weight_info)

    def get(self, path):
        return {"weight_version": self.label} if path == "/weight_info" else {"data": [{"id": "tiny"}]}

    def __call__(self, path, timeout, json):
        if path == "/update_weight_version":
            self.label = json["new_version"]
            return {"success": True}
        assert path == "/v1/completions"
        self.payloads.append(json)
        prompts = json["prompt"] if isinstance(json["prompt"][0], list) else [json["prompt"]]
        seed = json.get("seed")
        streams = [-1 if seed is None else seed + j for _ in prompts for j in range(json["n"])]
        choices = [
            {"index": i, "token_ids": [stream], "logprobs": {"token_logprobs": [-1.0]}}
            for i, stream in enumerate(streams)
        ]
        return {"choices": choices[::-1]}  # the order of choices is their index's, not the list's


@pytest.fixture
def server_backend(monkeypatch, tokenizer):
    """A server backend whose HTTP calls reach a :class:`FakeCompletionsEndpoint` instead of a server."""
    from a3po_trl.generation.vllm.server import VLLMServerBackend

    monkeypatch.setattr(VLLMServerBackend, "_wait_for_server", lambda self, timeout: None)
    monkeypatch.setattr(VLLMServerBackend, "_check_server_config", lambda self: None)
    endpoint = FakeCompletionsEndpoint()
    monkeypatch.setattr(VLLMServerBackend, "_get", lambda self, path, timeout, **kwargs: endpoint.get(path))
    monkeypatch.setattr(
        VLLMServerBackend, "_post", lambda self, path, timeout, json=None: endpoint(path, timeout, json)
    )
    args = SimpleNamespace(
        vllm_server_base_url="http://127.0.0.1:1",
        weight_sync_timeout=5.0,
        vllm_request_timeout=5.0,
        vllm_group_port=51216,
        vllm_server_timeout=1.0,
    )
    backend = VLLMServerBackend(make_model(tokenizer), args, VLLMSamplingSettings(max_tokens=4), torch.device("cpu"))
    backend._post = endpoint
    yield backend
    backend.close()


A, B = [5, 6, 7], [8, 9]


@pytest.mark.parametrize(
    "prompts, seed",
    [
        ([A, A, B, B], 1000),  # groups of num_generations rows
        ([A, B, A, B], 1000),  # a later turn or a rollout_func call: rows of one history need not be adjacent
        ([A, A, A, B], 1000),  # groups of different sizes
        ([A, A, A, A], 2**63 - 3),  # a batch seed near the top: row seeds wrap as the colocate backend's do
    ],
    ids=["groups", "rows", "unequal-groups", "wrapping-seed"],
)
def test_server_samples_every_row_from_its_own_stream_the_colocate_backends(server_backend, prompts, seed):
    out = server_backend.generate(prompts, None, seed=seed)
    streams = [ids[0] for ids in out.completion_ids]  # one completion per row, in row order
    assert streams == row_seeds(seed, len(prompts))  # distinct per row, as colocate mode seeds its rows

    server_backend._post.payloads.clear()
    out = server_backend.generate(prompts, None, seed=None)
    assert len(out.completion_ids) == len(prompts)
    assert all("seed" not in payload for payload in server_backend._post.payloads)  # unseeded: no stream is shared


def test_every_vllm_path_samples_with_grpo_configs_fields_and_generation_kwargs_over_them(server_backend):
    """The colocate engine, the server's /v1/completions and its streaming route all take one set of sampling fields:
    vLLM's spellings of GRPOConfig's neutral values, the seed only where given, ``generation_kwargs`` last."""
    settings = VLLMSamplingSettings(
        max_tokens=7, temperature=0.7, top_k=0, min_p=None, stop_token_ids=[2], generation_kwargs={"max_tokens": 9}
    )
    fields = sampling_fields(settings, n=3, seed=5)
    assert fields == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,  # vLLM's "no top-k"
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 9,  # generation_kwargs win
        "logprobs": 0,
        "stop_token_ids": [2],
        "seed": 5,
    }
    assert "seed" not in sampling_fields(settings, n=1, seed=None)
    server_backend._post.payloads.clear()
    server_backend.generate([[1, 2, 3]], None, seed=11)
    (payload,) = server_backend._post.payloads
    assert {k: payload[k] for k in sampling_fields(server_backend.sampling, 1, 11)} == sampling_fields(
        server_backend.sampling, 1, 11
    )


def test_a_stopping_trainer_ends_a_server_batch_without_waiting_for_its_requests(server_backend):
    """``should_stop`` ends the batch while its requests are still on the server (they may take up to
    ``vllm_request_timeout``); the answers that come later are dropped."""
    import threading

    from a3po_trl.types import GenerationStopped

    answered, release = threading.Event(), threading.Event()
    endpoint = server_backend._post

    def slow_endpoint(path, timeout, json):
        release.wait(10)
        answered.set()
        return endpoint(path, timeout, json)

    server_backend._post = slow_endpoint
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(GenerationStopped):
        server_backend.generate([A, A, B], stop.is_set, seed=1)
    assert not answered.is_set()  # stopped while the requests were in flight, not after they answered
    release.set()

    slow = threading.Event()  # a request that fails fails the batch at once, not after the slowest request

    def one_failing(path, timeout, json):
        if json["prompt"] == B:
            raise RuntimeError("server error")
        slow.wait(10)
        return endpoint(path, timeout, json)

    server_backend._post = one_failing
    with pytest.raises(RuntimeError, match="server error"):
        server_backend.generate([A, B], lambda: False, seed=1)
    assert not slow.is_set()
    slow.set()


# ---- the weight version vLLM reports ------------------------------------------------------------------------------


def test_a_server_batch_fails_unless_the_server_holds_its_version_before_and_after(server_backend):
    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch

    endpoint = server_backend._post
    assert endpoint.label == "-1"  # labelled at start: the weights the backend's version -1 stands for
    server_backend.generate([A, B], None, seed=1)
    endpoint.label = "3"  # another client put other weights on the server
    with pytest.raises(WeightVersionMismatch, match="'3' before a batch tagged with version '-1'"):
        server_backend.generate([A, B], None, seed=1)

    def relabelled_while_generating(path, timeout, json):
        endpoint.label = "4"  # ... while this batch's requests were in flight
        return endpoint(path, timeout, json)

    endpoint.label = "-1"
    server_backend._post = relabelled_while_generating
    with pytest.raises(WeightVersionMismatch, match="'4' after"):
        server_backend.generate([A, B], None, seed=1)


def test_colocated_tokens_must_be_labelled_with_the_version_loaded_at_the_step_that_sampled_them():
    from a3po_trl.generation.vllm.weight_versions import WeightVersionMismatch, check_token_versions

    def output(count, *spans):
        spans = None if spans == (None,) else [SimpleNamespace(version=v, start=a, end=b) for v, a, b in spans]
        return SimpleNamespace(
            request_id="r", outputs=[SimpleNamespace(weight_versions=spans, token_ids=list(range(count)))]
        )

    # one version throughout, and (in-flight) a load between two steps: each token's version is vLLM's label of it
    assert check_token_versions([output(5, ("2", 0, 5)), output(1, ("2", 0, 1))], [[2] * 5, [2]]) == [[2] * 5, [2]]
    split = output(5, ("2", 0, 3), ("3", 3, 5))
    assert check_token_versions([split], [[2, 2, 2, 3, 3]]) == [[2, 2, 2, 3, 3]]
    with pytest.raises(WeightVersionMismatch, match=r"tokens \[3, 5\) by '3' \(loaded: '2'\)"):  # a load unrecorded
        check_token_versions([split], [[2] * 5])
    with pytest.raises(WeightVersionMismatch, match=r"tokens \[2, 3\) by '2' \(loaded: '3'\)"):  # a late label
        check_token_versions([split], [[2, 2, 3, 3, 3]])
    with pytest.raises(WeightVersionMismatch, match=r"tokens \[0, 2\) by 'elsewhere'"):
        check_token_versions([output(2, ("elsewhere", 0, 2))], [[2, 2]])
    with pytest.raises(WeightVersionMismatch, match="no weight version"):
        check_token_versions([output(2, None)], [[2, 2]])
    with pytest.raises(WeightVersionMismatch, match="recorded the engine steps of 3 tokens"):
        check_token_versions([output(2, ("2", 0, 2))], [[2, 2, 2]])
    old_vllm = SimpleNamespace(request_id="r", outputs=[SimpleNamespace(token_ids=[1, 2])])  # vLLM < 0.32
    assert check_token_versions([old_vllm], [[4, 5]]) == [[4, 5]]


# ---- a full-weight server shared by two processes: one file per version --------------------------------------------


class FakeReloadingServer:
    """The endpoints a shared full-weight server is loaded through: ``/collective_rpc`` reloads the weights file a
    process wrote (recorded with the version the file holds), ``/reset_prefix_cache`` does nothing."""

    def __init__(self):
        self.reloads = []
        self.labels = []

    def endpoint(self, backend):
        def post(path, timeout, json=None):
            if path == "/update_weight_version":
                self.labels.append(json["new_version"])
            if path == "/collective_rpc" and json["method"] == "reload_weights":
                from safetensors.torch import load_file

                weights = load_file(os.path.join(json["kwargs"]["weights_path"], "model.safetensors"))
                self.reloads.append((backend.rank, float(weights["lm_head.weight"].flatten()[0])))
            return {}

        return post


def test_a_shared_server_is_loaded_from_one_file_per_version_written_by_the_process_that_switches(
    monkeypatch, tokenizer, tmp_path
):
    """With full weights, every process used to write every version it loaded to a file (a 7B fp32 model from 7
    processes: 213 GB per version) though only the switching process's file is read. Two processes (threads here),
    three versions: each version is written once, in the staging dtype, and loaded once."""
    import threading

    import torch.distributed as dist

    from a3po_trl.generation.vllm.server import VLLMServerBackend
    from a3po_trl.generation.vllm.shared_server import SharedServerVersions

    monkeypatch.setattr(VLLMServerBackend, "_wait_for_server", lambda self, timeout: None)
    monkeypatch.setattr(VLLMServerBackend, "_check_server_config", lambda self: torch.bfloat16)  # a bf16 server
    monkeypatch.setattr(VLLMServerBackend, "_get", lambda self, path, timeout, **kwargs: {"data": [{"id": "tiny"}]})
    written = []
    write = VLLMServerBackend._write_weights_file
    monkeypatch.setattr(
        VLLMServerBackend,
        "_write_weights_file",
        lambda self, weights: written.append({t.dtype for t in weights.values()}) or write(self, weights),
    )
    args = SimpleNamespace(
        vllm_server_base_url="http://127.0.0.1:1",
        weight_sync_timeout=5.0,
        vllm_request_timeout=5.0,
        vllm_group_port=51216,
        vllm_server_timeout=1.0,
    )
    store, server = dist.HashStore(), FakeReloadingServer()
    model = make_model(tokenizer)
    backends = []
    for rank in range(2):
        shared = SharedServerVersions(store, rank, 2, poll_interval=0.001)
        backend = VLLMServerBackend(
            model, args, VLLMSamplingSettings(max_tokens=4), torch.device("cpu"), shared=shared
        )
        backend.rank = rank
        backend._post = server.endpoint(backend)
        backends.append(backend)
    for version in range(3):
        with torch.no_grad():
            model.lm_head.weight.fill_(version)
        for backend in backends:
            backend.publish(model, version)
        threads = [threading.Thread(target=lambda b=b: (b.refresh(), b.finish_batch(None))) for b in backends]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert [b.version for b in backends] == [version, version]
    assert [version for _, version in server.reloads] == [0.0, 1.0, 2.0]  # each version loaded once
    assert server.labels == ["0", "1", "2"]  # ... and labelled by the process that loaded it
    assert written == [{torch.bfloat16}] * 3  # ... from one file, written by one process, in the server's dtype
    for backend in backends:
        backend.close()


# ---- colocate: merged versions do not drift -------------------------------------------------------------------------


class FakeLLM:
    """Stands in for ``vllm.LLM``: keeps a copy of the weights of the latest reload."""

    def __init__(self, **kwargs):
        self.llm_engine = None
        self.loaded: dict[str, torch.Tensor] = {}
        self.labels: list[str] = []

    def update_weight_version(self, label):
        self.labels.append(label)

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.loaded = {name: tensor.clone() for name, tensor in kwargs["weights_iterator"]}

    def reset_prefix_cache(self):
        return True  # as vLLM's when no request holds a cache block


def lora_model(tokenizer, **config):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", **config)
    return get_peft_model(make_model(tokenizer), lora)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "config", [{"modules_to_save": ["lm_head"]}, {"use_dora": True}], ids=["lora-modules-to-save", "dora"]
)
def test_the_thousandth_merged_version_is_an_exact_merge_of_the_untouched_base(monkeypatch, tokenizer, config, dtype):
    """The colocate backend's merge fallback, 1,000 versions through publish / refresh: the last version's pushed
    weights are, bit for bit, a fresh merge of the trainer's base with that version's trainable weights.

    Exact, not within a tolerance: both are the same PEFT merge of the same tensors. Merging and unmerging one copy
    in place drifts by a few fp32 ulps over 1,000 versions (1.7e-7 at most on this model, under any 1e-6 tolerance),
    by 1e-2 in bf16, and turns bf16 DoRA weights into NaN within ten versions."""
    from a3po_trl.generation.vllm.colocate import VLLMColocateBackend

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    module = lora_model(tokenizer, **config).to(dtype)
    trainable = {name: param for name, param in module.named_parameters() if param.requires_grad}
    initial = {name: param.detach().clone() for name, param in trainable.items()}
    backend = VLLMColocateBackend(module, "unused", VLLMSamplingSettings(max_tokens=4), {}, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for version in range(1000):
            for name, param in trainable.items():  # a trained version: the start plus some drift
                param.copy_(initial[name] + 0.05 * torch.randn(param.shape, generator=generator).to(dtype))
            backend.publish(module, version)
            assert backend.refresh()
    pushed = backend.llm.loaded
    assert backend.llm.labels == ["-1", *map(str, range(1000))]  # the engine's label: the start, then every load

    exact = copy.deepcopy(module)  # the trainer's base never moves: a copy of it now is pristine
    exact.merge_adapter()
    expected = base_checkpoint_tensors(exact)
    assert pushed.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(pushed[name], tensor, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    backend.close()
