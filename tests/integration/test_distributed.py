"""Two CPU processes (gloo) under `accelerate launch`: DDP, DeepSpeed ZeRO-2 and ZeRO-3, with and without LoRA.

Each process runs its own generation thread on its own prompts; after training both processes must agree on the
step count, the generator's version and its weights, and the launcher must exit cleanly.
"""

import json
import os
import sys

import pytest
from helpers import accelerate_config, free_port, run_process_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "distributed_tiny.py")


def _launch(tmp_path, name, lora, port, *extra, check=True, timeout=900):
    config = tmp_path / f"{name}.yaml"
    config.write_text(accelerate_config(name, port))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), SCRIPT, str(out)]
    if lora:
        cmd.append("--lora")
    cmd.extend(extra)
    result = run_process_tree(cmd, env=env, timeout=timeout, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        assert "terminate called" not in result.stderr, result.stderr[-6000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return reports if check else (result, reports)


@pytest.mark.parametrize(
    "name, lora",
    [("ddp", False), ("ddp", True), ("zero2", False), ("zero2", True), ("zero3", False), ("zero3", True)],
)
def test_two_processes_train_and_agree(tmp_path, name, lora):
    port = 29600 + hash((name, lora)) % 300
    reports = _launch(tmp_path, name, lora, port)
    first, second = reports
    assert {r["rank"] for r in reports} == {0, 1}
    assert all(r["world_size"] == 2 for r in reports)
    if name != "ddp":
        assert first["zero_stage"] == second["zero_stage"] == int(name[-1])
    for r in reports:
        assert r["global_step"] == 4
        assert r["generator_version"] == 4
        assert r["batches_consumed"] == 4
        assert r["generator_matches_trainer"]
        assert 0 <= r["max_staleness_seen"] <= 1
        assert not [t for t in r["threads_alive"] if t.startswith("a3po")]
        assert r["process_group_teardown_registered"]  # gloo is destroyed before interpreter exit, not during it
    assert first["generator_checksum"] == pytest.approx(second["generator_checksum"], rel=1e-9)
    if lora:
        assert first["copied_parameters"] < 0.05 * (first["copied_parameters"] + first["shared_parameters"] + 35168)
        if name != "zero3":  # ZeRO-3 shards the base, so the generator holds its own unsharded copy of it
            assert first["shared_parameters"] > 0


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_two_processes_load_versions_mid_batch_each_token_tagged(tmp_path, name):
    """In-flight weight updates on two processes (each generator loads from its own staging buffer, which every
    process's publication filled): with the switch points fixed by the schedule, every process's batches 1 to 3
    switch versions after their third token, and the processes end in agreement."""
    reports = _launch(tmp_path, name, False, 29950 + hash(name) % 40, "--in-flight")
    for r in reports:
        assert r["global_step"] == 4 and r["generator_matches_trainer"]
        assert r["token_versions"] == r["expected_token_versions"]
        assert r["in_flight_weight_loads"] == [0.0, 1.0, 1.0, 1.0]
        for index in range(1, 4):
            generated = {v for row in r["token_versions"][index] for v in row if v >= 0}
            assert generated == {index - 1, index}
        assert 0 <= r["max_staleness_seen"] <= 1
    assert reports[0]["generator_checksum"] == pytest.approx(reports[1]["generator_checksum"], rel=1e-9)


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_reward_models_and_batch_normalised_advantages_use_every_process(tmp_path, name):
    """A reward model partitioned by ZeRO-3 runs collectives: it is scored in the main thread there (in the
    generation thread otherwise). Advantages normalised by the batch's std use the std of every process's rewards,
    as GRPOTrainer computes it."""
    import torch

    from a3po_trl.functional import group_advantages

    port = 29950 + hash(name) % 40
    reports = _launch(tmp_path, name, False, port, "--reward-model")
    for r in reports:
        expected_thread = "MainThread" if name == "zero3" else "a3po-generation"
        assert r["reward_model_threads"] == [expected_thread]
        assert r["global_step"] == 4 and r["batches_consumed"] == 4
    for step in range(4):
        calls = [r["advantage_calls"][step] for r in reports]
        assert calls[0]["rewards"] == calls[1]["rewards"]  # both processes see all rewards
        rewards = torch.tensor(calls[0]["rewards"])
        assert rewards.shape == (8, 2)  # 2 processes x 4 completions, 2 reward functions
        expected, _, _ = group_advantages(rewards, torch.ones(2), 4, scale_rewards="batch")
        local = reports[0]["local_advantages"][step] + reports[1]["local_advantages"][step]
        assert torch.allclose(torch.tensor(sorted(local)), torch.sort(expected).values, atol=1e-6)


def test_two_processes_run_multi_turn_rollouts_in_their_own_generation_threads(tmp_path):
    """DDP with an environment and a tool: each process executes its own rollouts' tool calls in its generation
    thread (no collective), and the tool statistics and environment rewards are reduced over both processes."""
    reports = _launch(tmp_path, "ddp", False, 29910, "--tools")
    for r in reports:
        assert r["global_step"] == 4 and r["batches_consumed"] == 4
        assert r["tool_threads"] == ["a3po-generation"]
        assert r["generator_matches_trainer"]
    # 8 rows per step over both processes ("What is i + ..." for i in the batch): the calls come from the rows
    # whose number is a multiple of 3, whichever process generated them; both processes log the same reduced values
    assert reports[0]["tool_call_frequency"] == reports[1]["tool_call_frequency"]
    assert reports[0]["environment_rewards"] == reports[1]["environment_rewards"]
    assert reports[0]["tool_call_frequency"] == pytest.approx(reports[0]["environment_rewards"])
    assert 0 < sum(reports[0]["tool_call_frequency"]) < 4
    counts = reports[0]["environment_counts"] + reports[1]["environment_counts"]
    assert len(counts) == 8 and set(counts) <= {0, 1}


def test_two_processes_fill_their_batches_by_dynamic_sampling_from_disjoint_prompts(tmp_path):
    """DDP with dynamic sampling and a reward that is flat for every other prompt: each process draws as many
    generation batches as it needs (a different number on each), from its own slice of the prompt stream, and both
    train the same full batches and micro-steps."""
    reports = _launch(tmp_path, "ddp", False, 29890, "--dynamic-sampling")
    for r in reports:
        assert r["global_step"] == 4 and r["batches_consumed"] == 4 and r["micro_steps"] == 4
        assert [len(a) for a in r["local_advantages"]] == [4] * 4  # every batch full: one group of 4
        assert r["frac_reward_zero_std"] == [0.0] * 4
        assert len(r["drawn_prompts"]) > 4  # refills were needed
    # logged values are reduced over both processes: the same on each
    assert reports[0]["extra_batches"] == reports[1]["extra_batches"]
    drawn = len(reports[0]["drawn_prompts"]) + len(reports[1]["drawn_prompts"])
    assert sum(reports[0]["extra_batches"]) == drawn / 2 - 4  # the mean over the processes, per batch
    # 32 prompts, one per process per draw: 16 draws per epoch of the stream, each process's prompts its own
    for epoch in range(2):
        slices = [r["drawn_prompts"][16 * epoch : 16 * (epoch + 1)] for r in reports]
        assert all(len(set(drawn)) == len(drawn) for drawn in slices)
        assert not set(slices[0]) & set(slices[1])


def test_two_processes_with_generation_processes_train_the_threads_weights_bit_for_bit(tmp_path):
    """``generation_process=True`` under DDP: each training process starts a generation process of its own (its own
    shared staging buffers), and the run trains what the same run with the generation thread trains, bit for bit
    (reproducible generation); no generation process outlives ``train()``."""
    runs = {}
    for variant in ("--thread", "--generation-process"):
        run_dir = tmp_path / variant.strip("-")
        run_dir.mkdir()
        runs[variant] = _launch(run_dir, "ddp", False, 29890 + len(runs), variant)
    for thread, process in zip(runs["--thread"], runs["--generation-process"], strict=True):
        assert thread["rank"] == process["rank"] and process["world_size"] == 2 and process["global_step"] == 4
        assert process["weights"] == thread["weights"] and process["weights_before"] == thread["weights_before"]
        assert all(process["weights"][name] != value for name, value in process["weights_before"].items())  # trained
        assert process["generator_versions"] == thread["generator_versions"]
        assert set(thread["generation_pids"]) == {None}  # the thread backend has no process
        pids = set(process["generation_pids"])
        assert len(pids) == 1 and None not in pids and process["pid"] not in pids
        assert process["children_alive"] == [] and not [t for t in process["threads_alive"] if t.startswith("a3po")]
    first, second = runs["--generation-process"]
    assert first["weights"] == second["weights"]  # DDP: one model on both processes
    assert set(first["generation_pids"]).isdisjoint(second["generation_pids"])  # a generation process each


def test_a_process_generating_past_the_process_group_timeout_keeps_the_other_waiting_without_failing(tmp_path):
    """DDP with dynamic sampling, a process group timeout of 10 s (what ``ddp_timeout`` sets),
    ``generation_batch_timeout`` 200 s, and one of process 1's generations 30 s longer: process 0 waits for process 1
    to take its batch through the process group's store, not in the collective that agrees on the batch (where it
    failed with gloo's "Timed out waiting 10000ms"), and both train every batch."""
    reports = _launch(tmp_path, "ddp", False, free_port(), "--dynamic-sampling", "--slow-rank", "1")
    for r in reports:
        assert r["global_step"] == 4 and r["batches_consumed"] == 4 and r["micro_steps"] == 4
        assert [len(a) for a in r["local_advantages"]] == [4] * 4


def test_a_generation_failing_in_one_process_ends_both_naming_its_error(tmp_path):
    """Process 1's generation raises on its second batch while process 0 has its own: process 1's train() raises that
    error, and process 0's, instead of going on to the batch's collectives (where it waited for process 1 until it
    exited, then failed with gloo's "connection closed by peer"), raises one naming process 1 and its error."""
    result, (first, second) = _launch(tmp_path, "ddp", False, 29950, "--fail-rank", "1", check=False)
    assert result.returncode != 0
    assert second["error"] == "RuntimeError: generation failure injected in process 1", second["error"]
    assert first["error"] == (
        "PeerProcessFailed: Taking the next generation batch failed on process 1: "
        "RuntimeError: generation failure injected in process 1"
    ), first["error"]
    for report in (first, second):
        assert "a3po-generation" not in report["threads_alive"]


def test_a_process_whose_reward_function_never_returns_ends_every_process_naming_it(tmp_path):
    """Process 1's reward function never returns from its second call, under a process group timeout of 10 s and
    ``generation_batch_timeout`` left None (so 10 s bounds the wait): every process's ``train()`` raises an error
    naming process 1 and where its generation thread is stuck, within the bound, and both exit (before: process 0
    waited for process 1 at the arrival gate, and process 1 for its batch, for ever)."""
    result, reports = _launch(tmp_path, "ddp", False, free_port(), "--stuck-rank", "1", check=False, timeout=400)
    assert result.returncode != 0
    stuck_since = reports[1]["stuck_since"][0]
    for report in reports:
        error = report["error"].lower()
        assert "process 1" in error and ("after 10 s" in error or "within 10 s" in error), error
        assert "rolling out batch 1: in the reward function 'stuck_reward'" in error, error
        assert report["raised_at"] - stuck_since < 120  # 10 s and the time to notice: far from for ever
