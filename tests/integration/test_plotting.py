"""plot_training: a PNG from a log history or a JSONL file (4 panels, 3 without a held-out accuracy); matplotlib stays
optional at import time."""

import json
import subprocess
import sys

from tiny import length_reward, make_model, make_prompts

from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.tasks import plot_training
from a3po_trl.tasks.plotting import _eval_points, load_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

LOGS = [
    {"step": 1, "reward": 0.1, "a3po/staleness_mean": 0.0, "a3po/staleness_max": 0.0, "step_time": 2.0},
    {"step": 2, "reward": 0.3, "a3po/staleness_mean": 1.0, "a3po/staleness_max": 1.0, "step_time": 1.5},
    {"step": 2, "train_runtime": 3.5},
]


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_plot_from_log_history_with_eval_points(tmp_path):
    out = plot_training(LOGS, tmp_path / "sub" / "plot.png", eval_points={0: 0.1, 2: 0.4}, title="t")
    assert out == tmp_path / "sub" / "plot.png"
    assert _is_png(out)


def test_plot_from_jsonl_with_before_after_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "label": "before", "accuracy": 0.2, "stderr": 0.03}, *LOGS]
    records.append({"step": 2, "label": "after", "accuracy": 0.35, "stderr": 0.03})
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    assert load_metrics(path) == records
    points = _eval_points(load_metrics(path), None)
    assert [(p[0], p[1], p[3]) for p in points] == [(0, 0.2, "before"), (2, 0.35, "after")]
    assert _is_png(plot_training(path, tmp_path / "plot.png"))


def test_periodic_eval_keys_and_missing_data(tmp_path):
    logs = [{"step": 5, "eval_rewards/correctness_reward/mean": 0.5}]
    assert [(p[0], p[1]) for p in _eval_points(logs, [(0, 0.25)])] == [(0, 0.25), (5, 0.5)]
    assert _is_png(plot_training([], tmp_path / "empty.png"))


def test_a_run_without_an_evaluation_has_no_held_out_panel(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def recording_savefig(figure, *args, **kwargs):
        saved.append(figure)
        return savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    assert _is_png(plot_training(LOGS, tmp_path / "no_eval.png"))
    assert _is_png(plot_training(LOGS, tmp_path / "eval.png", eval_points={0: 0.1, 2: 0.4}))
    training = ["Reward (train)", "Staleness (optimizer steps)", "Step time (s)"]
    assert [ax.get_title() for ax in saved[0].axes] == training
    assert [ax.get_title() for ax in saved[1].axes] == [training[0], "Held-out accuracy (greedy)", *training[1:]]
    assert not [text for ax in saved[0].axes for text in ax.texts if text.get_text() == "no data"]


def test_plot_a_real_training_log(tokenizer, tmp_path):
    args = AsyncA3POConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        max_staleness=1,
    )
    trainer = AsyncA3POTrainer(
        model=make_model(tokenizer),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=make_prompts(8),
        processing_class=tokenizer,
    )
    trainer.train()
    history = trainer.state.log_history
    assert all(key in history[0] for key in ("reward", "a3po/staleness_mean", "a3po/staleness_max", "step_time"))
    assert _is_png(plot_training(history, tmp_path / "run.png"))


def test_package_import_does_not_need_matplotlib():
    code = "import sys, a3po_trl; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
