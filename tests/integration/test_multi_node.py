"""Two machines on the loopback: two `accelerate launch` commands with examples/accelerate_configs/multi_node.yaml,
its FILL fields given as flags (`--num_machines 2 --machine_rank {0,1} --main_process_ip 127.0.0.1
--main_process_port P --num_processes 2`, one gloo process per machine on CPU), started together, as
docs/SCALE_OUT.md tells a user to start them on each machine. Both machines share `output_dir` here (one
filesystem), as on a cluster with a shared filesystem."""

import json
import os
import sys

import pytest
from helpers import free_port, run_process_trees

from a3po_trl.checkpoints.files import MANIFEST_NAME, checkpoint_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "multi_node_tiny.py")
CONFIG = os.path.join(ROOT, "examples", "accelerate_configs", "multi_node.yaml")


def _launch_two_machines(out, *script_args):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    commands = [
        [
            *(sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG),
            *("--num_machines", "2", "--machine_rank", str(machine), "--num_processes", "2"),
            *("--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no"),
            *(SCRIPT, str(out), *script_args),
        ]
        for machine in range(2)
    ]
    return run_process_trees(commands, env=env, timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_two_machines_train_to_the_same_weights_and_write_one_set_of_checkpoints(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for machine, result in enumerate(_launch_two_machines(out)):
        assert result.returncode == 0, f"machine {machine}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2))

    assert [(r["rank"], r["machine"], r["local_rank"], r["world_size"]) for r in (first, second)] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert first["global_step"] == second["global_step"] == 4
    assert first["weights"] == second["weights"]  # DDP over the two machines: bit for bit
    assert first["last_checkpoint_holds_these_weights"] and second["last_checkpoint_holds_these_weights"]
    # save_on_each_node=False (the default): only process 0 of the run saves; the other machine's process writes its
    # RNG state into the same folder, which a shared output_dir makes visible to process 0
    assert (first["should_save"], second["should_save"]) == (True, False)
    run = out / "run"
    assert sorted(name for name in os.listdir(run) if "checkpoint" in name) == ["checkpoint-2", "checkpoint-4"]
    for step in (2, 4):
        checkpoint = run / f"checkpoint-{step}"
        assert checkpoint_problems(str(checkpoint)) == []
        files = json.loads((checkpoint / MANIFEST_NAME).read_text())["files"]
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(files)


@pytest.mark.slow
def test_save_on_each_node_into_an_output_dir_the_machines_share_is_refused_at_the_first_save(tmp_path):
    """save_on_each_node=True makes each machine's main process write its own copy: into one shared directory both
    would stage, publish and rotate the same folders, a race (before the refusal, one of two runs here failed at the
    second rename, its step's checkpoint gone; the other trained). Every process raises at the first save, naming
    the setting and the fix, and leaves nothing behind."""
    out = tmp_path / "out"
    out.mkdir()
    results = _launch_two_machines(out, "--save-on-each-node")
    for machine, result in enumerate(results):
        assert result.returncode != 0, f"machine {machine} trained:\n{result.stderr[-3000:]}"
        assert "Set save_on_each_node=False" in result.stderr, f"machine {machine}:\n{result.stderr[-6000:]}"
    assert "sees the files process 1 of another machine wrote" in results[0].stderr
    leftovers = [name for name in os.listdir(out / "run") if "checkpoint" in name or name.startswith(".a3po")]
    assert leftovers == []
