"""``prox_logp_method="guarded"`` on two processes (gloo: DDP, ZeRO-2, ZeRO-3, FSDP2): one check over every
process's tokens, one decision for all, even when the processes' own tokens would decide differently; the exact
reference computed from the kept weights however the parameters are held (ZeRO-3 steps its optimizer inside the
backward, so a copy taken after it would make the reference the trained weights' own: no drift, an infinite error)."""

import json
import os
import sys

import pytest
from helpers import accelerate_config, free_port, launch_fsdp2, run_process_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "guarded_tiny.py")


def _launch(tmp_path, name, lora):
    flags = [*(["--lora"] if lora else []), "--invariant", "full,lora"]
    if name == "fsdp2":
        return launch_fsdp2(tmp_path, SCRIPT, *flags, "--fsdp2", timeout=900)
    config = tmp_path / f"{name}.yaml"
    config.write_text(accelerate_config(name, free_port()))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), SCRIPT, str(out)]
    return run_process_tree([*command, *flags], env=env, timeout=900, cwd=ROOT), out


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, lora", [("ddp", False), ("zero2", True), ("zero3", True), ("fsdp2", False)], ids=lambda v: str(v)
)
def test_two_processes_switch_together_on_their_pooled_check(tmp_path, name, lora):
    """Then, in the same launch, the outcome invariant (docs/RELIABILITY.md): with a budget no check reaches, guarded
    trains what loglinear trains, bit for bit, with gradient accumulation 2 and the default interval, every weight and
    LoRA (under FSDP2 the root, kept gathered after the check's forward, must train with the trained weights; under
    ZeRO-3 each process keeps and exchanges its partition, and the next gather sees it)."""
    result, out = _launch(tmp_path, name, lora)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2))
    # process 1's interpolation was wrong while batch 1 trained (steps 2-3): both trained batch 2 with recompute
    assert first["recompute"] == second["recompute"] == [0, 0, 0, 0, 1, 1, 0, 0]
    assert first["relative"] == second["relative"] and first["relative"][0] > 3.0 > first["relative"][1]
    assert (
        (first["checks"], first["switches"]) == (second["checks"], second["switches"]) == (2, 2)
    )  # batch 3's check settles only with a batch 4
    if name == "ddp":  # whole parameters on each process (sharded ones differ by construction)
        assert first["weights"] == second["weights"]
    for report in (first, second):
        assert sorted(report["invariant"]) == ["full", "lora"]
        for model, outcome in report["invariant"].items():
            assert outcome["checks"] >= 1 and outcome["trained"], (model, outcome)
            assert outcome["equal"] and outcome["losses_equal"], (name, model, outcome)
            # every micro-step of the checked batch 1 (steps 2 and 3, two micro-steps each) took a reference equal
            # to the forward of the version before the trained weights, bit for bit
            assert outcome["reference_steps"] == [2, 2, 3, 3], outcome
            assert outcome["reference_max_abs_diff"] == 0.0, (name, model, outcome)
            # what each process keeps: its shard (FSDP2) or partition (ZeRO-3), about half the model (uneven splits)
            kept, whole = outcome["kept_bytes"], outcome["trainable_bytes"]
            assert (0.45 * whole < kept < 0.55 * whole) if name in ("zero3", "fsdp2") else kept == whole, outcome
