"""FSDP2 on two CPU processes (gloo) under `accelerate launch`, with `examples/accelerate_configs/fsdp2.yaml`.

accelerate keeps FSDP off on CPU-only machines; the launched script (tests/scripts/fsdp2_tiny.py) turns it on with
tests/fsdp_cpu.py, so the Trainer really shards the model with ``fully_shard`` (checked: DTensor parameters, a local
shard smaller than the parameter) and takes accelerate's FSDP2 paths for checkpoints. docs/FSDP2.md says why and how.
"""

import json
import os

import pytest
from helpers import launch_fsdp2

from a3po_trl.generation.weights.store import STAGING_ALIGNMENT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "fsdp2_tiny.py")
LOGPS_TOLERANCE = 1e-6
"""Largest difference (nats per token) allowed between the generator's and the training forward's log-probs of the
same completion at the same version: both run in fp32 on the same whole weights (measured here: 0.0)."""


def _launch(tmp_path, *flags, fsdp_config=None, succeed=True, mixed_precision="no"):
    result, out = launch_fsdp2(tmp_path, SCRIPT, *flags, fsdp_config=fsdp_config, mixed_precision=mixed_precision)
    if not succeed:
        assert result.returncode != 0
        return result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "terminate called" not in result.stderr, result.stderr[-6000:]
    if "--full-and-lora" in flags:
        return {run: [json.loads((out / run / f"rank{rank}.json").read_text()) for rank in range(2)] for run in RUNS}
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


RUNS = ("full", "lora")


@pytest.fixture(scope="module")
def full_and_lora(tmp_path_factory):
    """``reports(lora, *flags)``: the reports of the full-weight or the LoRA run of one launch that makes both
    (fsdp2_tiny.py ``--full-and-lora``: two processes and their libraries start once for the two runs); a test's
    ``[full]`` and ``[lora]`` cases read the same launch, made by whichever runs first (its failure fails both)."""
    launches = {}

    def reports(lora, *flags):
        if flags not in launches:
            try:
                launches[flags] = _launch(tmp_path_factory.mktemp("fsdp2"), *flags, "--full-and-lora")
            except Exception as error:  # noqa: BLE001 - kept, and raised by both of its tests
                launches[flags] = error
        if isinstance(launches[flags], Exception):
            raise launches[flags]
        return launches[flags]["lora" if lora else "full"]

    return reports


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_generator_follows_the_sharded_trainer_version_by_version(full_and_lora, lora):
    reports = full_and_lora(lora)
    assert {r["rank"] for r in reports} == {0, 1}
    for r in reports:
        # really FSDP2: the Trainer sharded the parameters (all but 1-2 small ones split over both processes)
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp_enabled"] and r["is_fsdp2"]
        assert r["sharded_parameters"] >= r["parameters"] - 2
        assert r["global_step"] == r["generator_version"] == r["batches_consumed"] == 4
        assert r["generator_matches_trainer"]  # every trainable weight equal to the gathered training weight
        assert 0 <= r["max_staleness_seen"] <= 1
        # the generator's log-probs of a fixed completion, right after it loaded each version (in its thread), and
        # after the last one, equal the training forward's at that version
        diffs = {int(v): d for v, d in r["logps_max_abs_diff"].items()}
        assert 0 in diffs and 4 in diffs and len(diffs) >= 3, diffs
        assert max(diffs.values()) <= LOGPS_TOLERANCE, diffs
        assert r["trainer_logps_change"] > 1e-3  # the versions differ: the comparison is not trivial
        if lora:
            assert r["copied_parameters"] == 896  # the adapter only (q_proj, v_proj at r=4 on 2 layers)
    if lora:
        main = reports[0]
        assert "adapter_model.safetensors" in main["adapter_files"] and "adapter_config.json" in main["adapter_files"]
        assert main["adapter_tensors"] == 8 and main["adapter_equals_generator"]
        assert main["adapter_logps_max_abs_diff"] <= 1e-5  # PeftModel.from_pretrained's own (unfused) forward


@pytest.mark.parametrize(
    "lora, activation_checkpointing", [(False, False), (True, True)], ids=["full", "lora-activation-checkpointing"]
)
def test_under_bf16_mixed_precision_the_generator_holds_bf16_not_the_fp32_master_weights(
    tmp_path, lora, activation_checkpointing
):
    """`mixed_precision: bf16` (the shipped fsdp2.yaml): accelerate upcasts the trainable parameters to float32 master
    weights before sharding them, and the generator's copy and staging buffers must not follow them to float32 (a 7B
    model: 30.5 GB a copy instead of 15.2). With fsdp_activation_checkpointing the parameter names carry
    ``_checkpoint_wrapped_module.``, which the generator's copy (built without the wrapper) and the saved adapter must
    not."""
    flags = [
        "--bf16",
        *(["--lora"] if lora else []),
        *(["--activation-checkpointing"] if activation_checkpointing else []),
    ]
    fsdp_config = {"fsdp_activation_checkpointing": True} if activation_checkpointing else None
    reports = _launch(tmp_path, *flags, fsdp_config=fsdp_config, mixed_precision="bf16")
    for r in reports:
        assert r["mixed_precision"] == "bf16" and r["is_fsdp2"] and r["global_step"] == 4
        assert "torch.float32" in r["trainable_dtypes"]  # the master weights really are fp32
        assert r["generator_copy_dtypes"] == r["staging_dtypes"] == ["torch.bfloat16"]
        assert r["generator_frozen_dtypes"] in ([], ["torch.bfloat16"])  # the whole copy: bf16 too
        assert r["generator_matches_trainer"]  # equal to the gathered training weights, cast to bf16
        # FSDP2 computes with bf16 parameters too: the generator's log-probs are the trainer's
        assert max(r["logps_max_abs_diff"].values()) <= LOGPS_TOLERANCE, r["logps_max_abs_diff"]
        plan = {what: size for what, size, _ in r["memory_plan"]}
        assert r["staged_weight_bytes"] == 2 * r["copied_parameters"]  # bf16: 2 bytes a parameter, as built
        # one buffer a version: the weights' bytes, each view at an aligned offset (less than one alignment a view)
        padding = plan["staging, one version"] - r["staged_weight_bytes"]
        assert 0 <= padding < STAGING_ALIGNMENT * r["staged_weights"], (padding, r["staged_weights"])
        if activation_checkpointing:
            assert r["checkpoint_wrapped_parameters"] > 0  # the names really carry the wrapper
    if lora:
        main = reports[0]
        assert main["adapter_equals_generator"] and main["adapter_tensors"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_reward_model_recompute_and_evaluation_run_sharded(tmp_path, lora):
    """What runs sharded in the main thread of every process: the reference forward (beta > 0: a sharded reference
    model, or the adapter-disabled policy under LoRA), a reward model given as a module (FSDP2 shards it too, so it is
    scored in the main thread, not the generation thread), the recompute forward (prox_logp_method="metrics" trains
    with the training forward's own log-probs at one step per batch: the script runs it after training) and
    GRPOTrainer's evaluation; at max_staleness=0, so the generator's log-probs are compared after every update."""
    reports = _launch(tmp_path, "--extras", *(["--lora"] if lora else []))
    for r in reports:
        assert r["is_fsdp2"] and r["global_step"] == r["generator_version"] == 4
        assert r["generator_matches_trainer"] and r["max_staleness_seen"] == 0
        # at max_staleness=0 the generator loads every version: all five are compared
        assert sorted(map(int, r["logps_max_abs_diff"])) == [0, 1, 2, 3, 4]
        assert max(r["logps_max_abs_diff"].values()) <= LOGPS_TOLERANCE
        assert r["ref_model"] == (None if lora else "FSDPLlamaForCausalLM")
        assert r["reward_model_threads"] == ["MainThread"]
        assert r["recompute_max_abs_diff"] <= LOGPS_TOLERANCE
        for key in ("kl", "a3po/approx_logp_abs_error", "eval_loss", "eval_reward"):
            assert key in r["logged_keys"], key
    if lora:  # TRL's frozen "ref" adapter is saved too, with its own (untrained) weights
        assert reports[0]["ref_adapter_saved"] and reports[0]["adapter_equals_generator"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reproducible_run_resumes_from_a_sharded_checkpoint_bit_for_bit(full_and_lora, lora):
    """reproducible_generation: a run stopped after its checkpoint at step 2 and resumed from it (from other initial
    trainable weights) logs the same losses, rewards and versions after step 2 as the uninterrupted run, and ends with
    the same weights, bit for bit. Full (the cheapest sharded launch that resumes): also with ``loglinear``,
    ``recompute``, ``metrics`` and ``guarded``, a run continued with a larger ``max_steps`` then stopped and resumed
    (fsdp2_tiny.py's ``continue_and_resume``)."""
    reports = full_and_lora(lora, "--resume")
    for r in reports:
        assert "pytorch_model_fsdp_0" in r["checkpoint_files"] and "optimizer_0" in r["checkpoint_files"]
        assert "a3po_generator_versions.pt" in r["checkpoint_files"]
        assert r["loaded_weights_differ_from_init"] and r["loaded_weights_equal_stopped"]
        assert r["resumed"] == r["uninterrupted"]
        assert len(r["resumed"]["loss"]) == 2
        assert r["final_weights_equal"]
    if lora:
        return
    # every method (guarded switched by every check), with batches trained over two optimizer steps: a run
    # ending inside a batch, continued with a larger max_steps, stopped inside a later batch and resumed, trains what
    # the uninterrupted run trains (issue 63: the anchor of the cut batch, the kept weights of the next check)
    for r in reports:
        assert sorted(r["methods"]) == ["guarded", "loglinear", "metrics", "recompute"]
        for method, chain in r["methods"].items():
            assert chain["continued_and_resumed"] == chain["uninterrupted"], method
            assert all(len(values) >= 1 for values in chain["uninterrupted"].values()), method
            assert chain["final_weights_equal"], method


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_in_flight_weight_updates_load_versions_mid_batch_on_every_process(full_and_lora, lora):
    """in_flight_weight_updates under FSDP2: with the switch points fixed by the schedule, every process's batches 1 to
    3 switch from the version they started with to the next one after their third token (a version every process
    published, gathered from the shards), each token tagged with its own; the processes end in agreement."""
    reports = full_and_lora(lora, "--in-flight")
    for r in reports:
        assert r["global_step"] == r["generator_version"] == 4 and r["generator_matches_trainer"]
        assert r["token_versions"] == r["expected_token_versions"]
        for index in range(1, 4):
            assert {v for row in r["token_versions"][index] for v in row if v >= 0} == {index - 1, index}
        assert r["in_flight_weight_loads"] == [0.0, 1.0, 1.0, 1.0]
        assert r["completion_versions_max"] == [1.0, 2.0, 2.0, 2.0]
        assert 0 <= r["max_staleness_seen"] <= 1
    assert reports[0]["generator_checksum"] == pytest.approx(reports[1]["generator_checksum"], rel=1e-9)


def test_fsdp1_is_refused_naming_fsdp_version_2(tmp_path):
    # FSDP1's plugin refuses sync_module_states=True on CPU before the trainer could say anything
    stderr = _launch(tmp_path, fsdp_config={"fsdp_version": 1, "fsdp_sync_module_states": False}, succeed=False)
    assert "NotImplementedError: FSDP1 (fsdp_version: 1) is not supported" in stderr
    assert "Set `fsdp_version: 2` in the accelerate config" in stderr
