"""`a3po-trl grpo` trains, as a user runs it: TRL's registry rewards, import-path rewards and a reward model, LoRA
(`--use_peft`), `--resume_from_checkpoint auto` starting a run then resuming it, the console script launching one
process from a YAML file `trl grpo` takes, and two CPU processes (`accelerate launch --multi_gpu --num_processes 2 -m
a3po_trl.cli grpo`, and the same through `a3po-trl grpo`).

Offline: the tiny model, a local `.jsonl` dataset and a reward module, from `helpers.cli_workspace`.
"""

import os
import sys
from pathlib import Path

import pytest
import yaml
from helpers import cli_workspace, free_port, logged, logged_after, run_process_tree

from a3po_trl import AsyncA3POTrainer
from a3po_trl.cli import parse_command_line
from a3po_trl.cli.grpo import prepare, train

ROOT = Path(__file__).resolve().parents[2]
#: What the console script `a3po-trl` runs (pyproject.toml's [project.scripts]).
CONSOLE_SCRIPT = [sys.executable, "-c", "import sys; from a3po_trl.cli import main; sys.exit(main())"]


def train_in_this_process(workspace, monkeypatch, *argv):
    """What `python -m a3po_trl.cli grpo --config workspace/grpo.yaml *argv` does, returning the trainer."""
    monkeypatch.chdir(workspace)
    command_line = parse_command_line(["--config", "grpo.yaml", *argv], launching=False)
    return train(command_line, prepare(command_line))


def test_registry_and_import_path_rewards_and_a_reward_model_train(tmp_path, monkeypatch):
    settings = cli_workspace(tmp_path, reward_model=True)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(settings))
    trainer = train_in_this_process(tmp_path, monkeypatch, "--reward_model_name_or_path", "reward_model")
    assert type(trainer) is AsyncA3POTrainer and trainer.state.global_step == 2
    assert len(logged(trainer, "a3po/staleness_mean")) == 2
    assert [f.__name__ for f in trainer.reward_funcs[1:]] == ["think_format_reward", "length_reward"]
    assert len(logged(trainer, "rewards/reward_model/mean")) == 2
    assert len(logged(trainer, "rewards/think_format_reward/mean")) == 2
    assert min(logged(trainer, "rewards/length_reward/mean")) > 0  # the import-path reward scored every batch
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_use_peft_trains_and_saves_a_lora_adapter(tmp_path, monkeypatch):
    settings = cli_workspace(tmp_path)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({**settings, "max_staleness": 2}))
    trainer = train_in_this_process(
        tmp_path, monkeypatch, "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"
    )
    assert trainer.state.global_step == 2 and trainer.args.max_staleness == 2
    assert (tmp_path / "out" / "adapter_config.json").is_file()
    assert yaml.safe_load((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 4


def test_resume_auto_starts_a_fresh_run_then_resumes_it(tmp_path, monkeypatch):
    """`--resume_from_checkpoint auto`, the same command for every launch of a job a scheduler may requeue: the first
    launch starts from the beginning, the next resumes from the newest checkpoint (here with a larger --max_steps)."""
    settings = cli_workspace(tmp_path)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({**settings, "save_strategy": "steps", "save_steps": 1}))
    first = train_in_this_process(tmp_path, monkeypatch, "--resume_from_checkpoint", "auto")
    assert first.state.global_step == 2 and (tmp_path / "out" / "checkpoint-2").is_dir()
    again = train_in_this_process(tmp_path, monkeypatch, "--resume_from_checkpoint", "auto", "--max_steps", "3")
    assert again.state.global_step == 3 and len(logged_after(again, "loss", 2)) == 1


def run_command(command, workspace, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("A3PO_TRL_LAUNCHED", None)
    result = run_process_tree(command, env=env, timeout=timeout, cwd=workspace)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_a3po_trl_grpo_trains_from_a_trl_grpo_yaml_in_one_process(tmp_path):
    """The console script, as a user types it: the YAML has only keys `trl grpo` takes; the launched program
    trains and saves the model."""
    settings = cli_workspace(tmp_path)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(settings))
    result = run_command([*CONSOLE_SCRIPT, "grpo", "--config", "grpo.yaml"], tmp_path)
    assert "launching: accelerate launch -m a3po_trl.cli grpo" in result.stdout
    assert "Training completed." in result.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("entry", ["accelerate launch -m a3po_trl.cli grpo", "a3po-trl grpo"])
def test_two_processes_train(tmp_path, entry):
    """Two CPU processes (`--multi_gpu` with use_cpu: `--cpu` would start one), each scoring its own batches."""
    settings = cli_workspace(tmp_path)
    reward_funcs = ["cli_rewards.length_reward", "cli_rewards.rank_reward"]
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({**settings, "reward_funcs": reward_funcs}))
    launch_options = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    if entry == "a3po-trl grpo":
        command = [*CONSOLE_SCRIPT, "grpo", "--config", "grpo.yaml", *launch_options]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", *launch_options, "-m", "a3po_trl.cli"]
        command += ["grpo", "--config", "grpo.yaml"]
    result = run_command(command, tmp_path)
    assert "Training completed." in result.stdout
    assert "'epoch': '0.25'" in result.stdout  # 2 of the 8 steps of an epoch of 16 prompts, one per process a step
    for rank in (0, 1):
        batches = (tmp_path / "out" / f"rank{rank}.seen").read_text().split()
        assert len(batches) >= 2 and set(batches) == {"4"}, (rank, batches)
    assert (tmp_path / "out" / "model.safetensors").is_file()
