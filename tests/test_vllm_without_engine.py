"""What the vLLM backends send to vLLM, checked without vLLM: the merged weights the colocate backend pushes for PEFT
configs vLLM cannot serve as adapters.

The engine is replaced by a stand-in that records what it receives and answers as vLLM does, so these run in the main
suite; ``tests/test_vllm.py`` checks the same paths against the real engine and server.
"""

import copy
import sys
import types

import pytest
import torch
from tiny import make_model

from a3po_trl.generation.vllm_common import VLLMSamplingSettings, base_checkpoint_tensors

# ---- colocate: merged versions do not drift -------------------------------------------------------------------------


class FakeLLM:
    """Stands in for ``vllm.LLM``: keeps a copy of the weights of the latest reload."""

    def __init__(self, **kwargs):
        self.llm_engine = None
        self.loaded: dict[str, torch.Tensor] = {}

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.loaded = {name: tensor.clone() for name, tensor in kwargs["weights_iterator"]}

    def reset_prefix_cache(self):
        pass


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
    from a3po_trl.generation.vllm_colocate import VLLMColocateBackend

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

    exact = copy.deepcopy(module)  # the trainer's base never moves: a copy of it now is pristine
    exact.merge_adapter()
    expected = base_checkpoint_tensors(exact)
    assert pushed.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(pushed[name], tensor, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    backend.close()
