"""examples/train_gsm8k.py end to end with a tiny local model: `python` and `accelerate launch` (2 CPU processes).

Each run must leave its metrics JSONL, the PNG plot, results.json and a saved model (or LoRA adapter) that loads back
with `from_pretrained`, and exit with return code 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port
from tiny import make_model, make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gsm8k.py"
STEPS = 2
SMALL_RUN = [
    "--max_steps", str(STEPS),
    "--num_train", "16",
    "--num_eval", "4",
    "--per_device_train_batch_size", "4",
    "--num_generations", "4",
    "--max_completion_length", "8",
    "--accuracy_batch_size", "4",
    "--system_prompt", "",
    "--learning_rate", "1e-3",
    "--use_cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """tests/tiny.py's model and tokenizer saved as a local model directory."""
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _run(cmd, timeout=600):
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result.stdout


def _check_outputs(out: Path, steps: int = STEPS) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_logs = [r for r in records if "reward" in r]
    assert [r["step"] for r in train_logs] == list(range(1, steps + 1))
    assert all("a3po/staleness_max" in r and "step_time" in r for r in train_logs)
    evaluations = {r["label"]: r for r in records if "accuracy" in r}
    assert set(evaluations) == {"before", "after"}
    assert evaluations["before"]["step"] == 0 and evaluations["after"]["step"] == steps
    assert all(r["count"] == 4 for r in evaluations.values())
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "results.json").read_text())
    for rank in range(summary["num_processes"]):  # every process writes its own trace
        assert json.loads((out / "timeline" / f"trace-rank{rank}.json").read_text())["traceEvents"]
    assert summary["global_step"] == steps
    assert {"gain", "stderr", "p_value"} <= set(summary["paired_test"])
    AutoTokenizer.from_pretrained(out)
    return summary


def test_python_full_fine_tuning(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    stdout = _run(
        [sys.executable, str(SCRIPT), "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out)]
        + SMALL_RUN
        + ["--use_peft", "false"]
    )  # fmt: skip (the script's default is LoRA)
    assert "[rank 0/1] training done: global_step=2" in stdout
    assert "Held-out accuracy before:" in stdout and "Held-out accuracy after:" in stdout
    assert f"Plot:    {out / 'training.png'}" in stdout
    summary = _check_outputs(out)
    assert summary["lora"] is False and summary["num_processes"] == 1
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    trained = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert trained.state_dict().keys() == original.state_dict().keys()


def test_python_lora_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel

    out = tmp_path / "out"
    lora = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    _run([sys.executable, str(SCRIPT), "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out)]
         + SMALL_RUN + lora)  # fmt: skip
    assert _check_outputs(out)["lora"] is True
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert any("lora_" in name for name, _ in model.named_parameters())


def test_accelerate_launch_two_cpu_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
    ]  # fmt: skip
    stdout = _run(launcher + [str(SCRIPT), "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out)]
                  + SMALL_RUN)  # fmt: skip
    for rank in range(2):
        assert f"[rank {rank}/2] training done: global_step={STEPS}" in stdout, stdout[-3000:]
    assert stdout.count("Held-out accuracy after:") == 1, "only the main process evaluates and reports"
    summary = _check_outputs(out)
    assert summary["num_processes"] == 2
    AutoModelForCausalLM.from_pretrained(out)
