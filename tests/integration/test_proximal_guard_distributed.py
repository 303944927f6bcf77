"""``prox_logp_method="guarded"`` on two processes (gloo, DDP): one check over every process's tokens, one decision
for all, even when the processes' own tokens would decide differently."""

import json
import os
import sys
import textwrap

import pytest
from helpers import free_port, run_process_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "guarded_tiny.py")
CONFIG = """
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
gpu_ids: all
mixed_precision: "no"
num_machines: 1
machine_rank: 0
main_process_port: {port}
"""


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_processes_switch_together_on_their_pooled_check(tmp_path, lora):
    config = tmp_path / "ddp.yaml"
    config.write_text(textwrap.dedent(CONFIG.format(port=free_port())))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), SCRIPT, str(out)]
    result = run_process_tree([*command, *(["--lora"] if lora else [])], env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2))
    # process 1's interpolation was wrong while batch 1 trained (steps 2-3): both trained batch 2 with recompute
    assert first["recompute"] == second["recompute"] == [0, 0, 0, 0, 1, 1, 0, 0]
    assert first["relative"] == second["relative"] and first["relative"][0] > 3.0 > first["relative"][1]
    assert (
        (first["checks"], first["switches"]) == (second["checks"], second["switches"]) == (2, 2)
    )  # batch 3's check settles only with a batch 4
    assert first["weights"] == second["weights"]
