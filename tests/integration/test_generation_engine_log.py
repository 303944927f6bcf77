"""The log names the generation engine a run uses (``a3po_trl.builders.generation_engine``), once per process when the
backend is built: HF generate, transformers' continuous batching, vLLM colocate or vLLM server."""

import logging
from types import SimpleNamespace

import pytest

from a3po_trl import builders
from tests.helpers import make_trainer


def _trainer(
    use_vllm=False,
    vllm_mode="colocate",
    continuous_batching=False,
    async_generation=True,
    in_flight=False,
    process=False,
):
    args = SimpleNamespace(
        vllm_mode=vllm_mode,
        use_transformers_continuous_batching=continuous_batching,
        async_generation=async_generation,
        in_flight_weight_updates=in_flight,
        generation_process=process,
    )
    return SimpleNamespace(_use_vllm_backend=use_vllm, args=args)


@pytest.mark.parametrize(
    "settings, named",
    [
        ({}, "HF generate, in the generation thread"),
        ({"continuous_batching": True}, "transformers continuous batching, in the generation thread"),
        ({"use_vllm": True}, "vLLM colocate, in the generation thread"),
        ({"use_vllm": True, "vllm_mode": "server", "in_flight": True}, "vLLM server, in the generation thread, "
         "weights loaded mid-batch (in_flight_weight_updates)"),
        ({"async_generation": False}, "HF generate, in the main thread (async_generation=False)"),
        ({"process": True}, "HF generate, in a process of its own (generation_process), coordinated by the generation "
         "thread"),
    ],
)  # fmt: skip
def test_the_engine_is_named_from_the_settings(settings, named):
    assert builders.generation_engine(_trainer(**settings)) == named


@pytest.mark.parametrize(
    "overrides, named",
    [({}, "HF generate"), ({"use_transformers_continuous_batching": True}, "transformers continuous batching")],
)
def test_building_the_backend_logs_its_engine(tokenizer, tmp_path, caplog, overrides, named):
    trainer = make_trainer(tokenizer, tmp_path, bf16=False, **overrides)
    with caplog.at_level(logging.INFO, logger="a3po_trl.builders"):
        builders.build_backend(trainer)
    assert f"Process 0: generation engine: {named}, in the generation thread" in caplog.text
