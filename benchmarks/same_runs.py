"""Do two folders of a study's runs agree bit for bit? The runs they share, compared step by step.

A study's run records its per-step training log (``logged`` in ``benchmarks/proximal_map.py``, ``training_log`` in
``benchmarks/staleness.py``) and the kernels that decide its rounding (``kernels``: torch's CPU capability, BLAS,
oneDNN, CPU model and flags). Runs of the same configuration and seed made under other conditions (another machine,
another load, ``ATEN_CPU_CAPABILITY=avx2``, other thread counts) either repeat each other exactly or part at some step;
this prints, for every run both folders hold, whether every logged number is equal, the first step where one differs,
and what differs in the recorded kernels::

    python -m benchmarks.same_runs benchmarks/results/proximal_map/runs /tmp/rerun/runs
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

#: Fields of a record that differ between identical computations (when and how fast they ran).
TIMING_KEYS = {"step_time", "train_seconds", "seconds_per_step", "a3po/prox_time"}


def step_rows(record: dict) -> list[dict]:
    """The per-step numbers of a run, one dict per optimizer step, timings left out."""
    if "logged" in record:  # {metric: [value per step]}
        logged = {key: values for key, values in record["logged"].items() if key not in TIMING_KEYS}
        steps = max((len(values) for values in logged.values()), default=0)
        return [{key: values[i] for key, values in logged.items() if i < len(values)} for i in range(steps)]
    return [{k: v for k, v in entry.items() if k not in TIMING_KEYS} for entry in record.get("training_log", [])]


def first_difference(a: dict, b: dict) -> tuple[int, str, float, float] | None:
    """``(step, metric, value in a, value in b)`` of the first logged number that differs, or None."""
    for step, (row_a, row_b) in enumerate(zip(step_rows(a), step_rows(b)), start=1):
        for key in sorted(row_a.keys() | row_b.keys()):
            x, y = row_a.get(key), row_b.get(key)
            if not (x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))):
                return step, key, x, y
    return None


def compare(folder_a: Path, folder_b: Path) -> list[str]:
    lines = []
    names = sorted({p.stem for p in folder_a.glob("*@*.json")} & {p.stem for p in folder_b.glob("*@*.json")})
    for name in names:
        a = json.loads((folder_a / f"{name}.json").read_text())
        b = json.loads((folder_b / f"{name}.json").read_text())
        kernels = {
            key: (a.get("kernels", {}).get(key), b.get("kernels", {}).get(key))
            for key in sorted(a.get("kernels", {}).keys() | b.get("kernels", {}).keys())
            if a.get("kernels", {}).get(key) != b.get("kernels", {}).get(key)
        }
        difference = first_difference(a, b)
        steps = min(len(step_rows(a)), len(step_rows(b)))
        if difference is None:
            verdict = f"identical over {steps} steps"
        else:
            step, key, x, y = difference
            verdict = f"parts at step {step} ({key}: {x!r} against {y!r})"
        lines.append(f"{name}: {verdict}" + (f"; kernels differ: {kernels}" if kernels else ""))
    return lines or ["no run in common"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_a", type=Path)
    parser.add_argument("runs_b", type=Path)
    options = parser.parse_args(argv)
    print("\n".join(compare(options.runs_a, options.runs_b)))


if __name__ == "__main__":
    main()
