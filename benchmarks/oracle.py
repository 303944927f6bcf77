"""The oracle study: how far A-3PO's interpolated anchor is from the policy it targets, and whether a fitted weight
would bring it closer.

A-3PO's anchor for a token of staleness ``d`` trained by the weights of version ``v`` is ``w b + (1 - w) c`` with
``w = 1/d`` (``b``, ``c``: the behavior and current log-probs): exact for the log-probs of version ``v - 1`` were
they linear in the version. Every run here trains with ``prox_logp_method="loglinear"`` (the method whose error is
measured, on its own trajectory) and, before every micro-step's training forward, computes per token the exact target
``t`` (one no-grad forward with the trainable weights of version ``v - 1`` exchanged in,
:class:`a3po_trl.proximal.previous_weights.PreviousVersionWeights`) and ``c`` (one with the weights being
trained), and keeps them with ``b``, the staleness, the batch and the anchor's age (optimizer steps since the
batch's first) in the run's record (a compressed array, ``tokens_npz``). The summary scores every estimator of
:mod:`benchmarks.common.anchor_estimators` against ``t`` on the tokens of staleness >= 2 outside the first batch:
the fixed ``1/d``, a weight per staleness fitted causally (on earlier batches only), one per staleness and age, the
interpolation in probability space, the two ends, and the in-sample best weight per staleness (a bound).

Configurations:

- ``k4-lr<hi|lo>``, ``iter2-lr<hi|lo>``: the approximation study's four (``benchmarks/approximation.py``: SmolLM2-135M
  with LoRA r=16 on the word-choice task, 4 optimizer steps per generation batch or every batch trained twice,
  learning rate 1e-3 or 2e-4, ``max_staleness`` the batch's span with ``reproducible_generation``), seed 42;
- ``map-s<d>-k<k>-lrhi``: the proximal map's cells (``benchmarks/proximal_map.py``: a tiny random Llama on the
  token-preference task, learning rate 3e-2, exact staleness ``d`` at a batch's first step, ``k`` optimizer steps
  per batch) at staleness 4 and 8, with 1 and 4 steps per batch, seeds 0-3.

The decision it serves and its rule are registered in ``results/oracle/PREREGISTRATION.md``::

    python -m benchmarks.oracle                                # every run, resumable (one JSON per run)
    python -m benchmarks.oracle --summary-only
    python -m benchmarks.oracle --quick --model <dir> --out /tmp/oracle   # a smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks.approximation import approximation_trainer, parse_config
from benchmarks.common.anchor_estimators import TOKEN_FIELDS, encode_tokens
from benchmarks.common.machine import kernel_info
from benchmarks.common.provenance import run_settings, trainer_threads
from benchmarks.common.runner import Cell, RunStore, run_study, study_parser

HERE = Path(__file__).resolve().parent
SMOLLM2_CONFIGS = ("k4-lrhi", "k4-lrlo", "iter2-lrhi", "iter2-lrlo")
MAP_CONFIGS = tuple(f"map-s{d}-k{k}-lrhi" for k in (4, 1) for d in (4, 8))
CONFIGS = SMOLLM2_CONFIGS + MAP_CONFIGS
SMOLLM2_SEEDS = (42,)
MAP_SEEDS = (0, 1, 2, 3)


def _parser():
    parser = study_parser(__doc__, configs=CONFIGS, seeds=(), out=HERE / "results" / "oracle")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the offline SmolLM2, or a model path")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 24 SmolLM2, 48 the map)")
    parser.add_argument("--quick", action="store_true", help="8 steps, tiny batches (a smoke run)")
    return parser


def cells(options) -> list[Cell]:
    """Each configuration on its own seeds (``--seeds`` replaces both lists)."""
    chosen = []
    for config in options.configs:
        seeds = options.seeds or (MAP_SEEDS if config.startswith("map-") else SMOLLM2_SEEDS)
        chosen += [Cell(config, seed) for seed in seeds]
    return chosen


# ---- the recorder (in the subprocess) ---------------------------------------------------------------------------
class ExactAnchorRecorder:
    """Installed on a trainer: keeps the trainable weights of every version (before the optimizer step that ends it)
    and, before each training micro-step, computes the exact target and the current log-probs of its tokens."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        from a3po_trl.proximal.previous_weights import PreviousVersionWeights

        self.trainer = trainer
        self.previous = PreviousVersionWeights()
        self.rows: dict[str, list[np.ndarray]] = {name: [] for name in TOKEN_FIELDS}
        self.first_step_of_batch: dict[int, int] = {}
        recorder = self

        class KeepEveryVersion(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                # the weights are still those of version global_step: the step about to run makes the next one
                recorder.previous.keep(trainer._unwrapped_model(), state.global_step)

        trainer.add_callback(KeepEveryVersion())
        original = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            if model.training and "behavior_logps" in inputs:
                self.record(model, inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss

    def record(self, model, inputs) -> None:
        import torch

        from a3po_trl.functional import token_staleness

        trainer, step = self.trainer, self.trainer.state.global_step
        batch = int(inputs["batch_index"])
        first = self.first_step_of_batch.setdefault(batch, step)
        if self.previous.version != step - 1:
            return  # version 0: nothing before it
        exact = self.previous.logps(trainer, model, inputs, trainer._unwrapped_model())
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            current = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )[0]
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask &= inputs["tool_mask"].bool()
        staleness = token_staleness(step, inputs["token_versions"]).expand_as(mask)
        values = {
            "step": torch.full_like(staleness, step),
            "batch": torch.full_like(staleness, batch),
            "age": torch.full_like(staleness, step - first),
            "staleness": staleness,
            "behavior": inputs["behavior_logps"],
            "current": current,
            "exact": exact,
        }
        finite = mask & torch.isfinite(inputs["behavior_logps"])
        for name, dtype in TOKEN_FIELDS.items():
            self.rows[name].append(values[name][finite].detach().cpu().numpy().astype(dtype))

    def tokens(self) -> dict[str, np.ndarray]:
        return {
            name: np.concatenate(parts) if parts else np.zeros(0, TOKEN_FIELDS[name])
            for name, parts in self.rows.items()
        }


def _run_one(options, name: str, seed: int) -> dict:
    import torch

    if name.startswith("map-"):
        trainer, settings = _map_trainer(options, name, seed)
    else:
        trainer, settings = _smollm2_trainer(options, name, seed)
    recorder = ExactAnchorRecorder(trainer)
    process_threads = torch.get_num_threads()
    trainer.train()
    tokens = recorder.tokens()
    steps = [
        {key: h.get(key) for key in ("step", "reward", "a3po/staleness_mean", "a3po/behavior_drift_per_version_mean")}
        for h in trainer.state.log_history
        if "loss" in h
    ]
    return {
        "config": name,
        "seed": seed,
        **settings,
        "prox_logp_method": trainer.args.prox_logp_method,
        "tokens": int(tokens["step"].size),
        "steps": steps,
        "tokens_npz": encode_tokens(tokens),
        "kernels": kernel_info(),
        "provenance": run_settings(trainer_threads(trainer, process_threads)),  # the runner adds the rest
    }


def _smollm2_trainer(options, name: str, seed: int):
    steps = options.steps or (8 if options.quick else 24)
    return approximation_trainer(
        options.model, name, seed, method="loglinear", steps=steps, quick=options.quick, prefix="a3po-oracle-"
    )


def parse_map_config(name: str) -> tuple[int, int]:
    """``"map-s4-k1-lrhi"`` -> ``(4, 1)``: the staleness of a batch's first step, optimizer steps per batch."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != "map" or parts[3] != "lrhi" or not parts[1][1:].isdigit():
        raise SystemExit(f"configuration {name!r} is not map-s<d>-k<k>-lrhi")
    return int(parts[1][1:]), int(parts[2][1:])


def _map_trainer(options, name: str, seed: int):
    from benchmarks.proximal_map import map_trainer

    staleness, steps_per_batch = parse_map_config(name)
    steps = options.steps or (8 if options.quick else 48)
    prompts_per_step = 2 if options.quick else 8
    trainer, _, _ = map_trainer(
        "loglinear", staleness, steps_per_batch, 3e-2, seed, steps=steps, prompts_per_step=prompts_per_step,
        temperature=1.0, prefix="a3po-oracle-",
    )  # fmt: skip
    settings = {
        "staleness": staleness,
        "steps_per_batch": steps_per_batch,
        "learning_rate": trainer.args.learning_rate,
    }
    return trainer, settings


# ---- the summary ----------------------------------------------------------------------------------------------
def summarize(store: RunStore, options) -> str:
    from benchmarks.common.oracle_summary import write_summary

    records = store.records()
    missing = [str(cell) for cell in cells(options) if cell not in records]
    return write_summary(records, Path(options.out), missing)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    for name in options.configs:
        if name.startswith("map-"):
            parse_map_config(name)
        else:
            parse_config(name)
    run_study(
        argv,
        options,
        module="benchmarks.oracle",
        cells=cells(options),
        run=lambda cell: _run_one(options, cell.config, cell.seed),
        summarize=lambda store: summarize(store, options),
    )


if __name__ == "__main__":
    main()
