"""The guard's SmolLM2 evaluation (benchmarks/guard_smollm2.py) from made-up records: seeds are paired only where a
seed's three runs share a host, seconds per step are training seconds over steps (checks included), and the default
follows the registered rule over SmolLM2's cell and the map's."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import guard_smollm2
from benchmarks.common.runner import Cell, RunStore


def record(method, seed, final, seconds, cpu="AMD EPYC"):
    log = [{"step": step, "reward": 0.1, "step_time": 10.0} for step in range(1, 41)]
    if method == "guarded":
        log[0].update({"a3po/prox_recompute_fraction": 0.25, "a3po/prox_check_error_relative": 0.5})
    return {
        "config": f"{method}-s4-k4", "method": method, "staleness": 4, "seed": seed, "steps": 40,
        "curve": [{"step": 0, "reward": 0.07}, {"step": 40, "reward": final}],
        "training_log": log, "train_seconds": seconds, "seconds_per_step": 10.0, "foreign_cpu_frac": 0.01,
        "machine": {"cpu_model": cpu, "platform": "Linux"}, "started_at": "2026-12-06 18:00",
    }  # fmt: skip


def test_seeds_pair_on_one_host_and_seconds_per_step_count_the_checks(tmp_path):
    store = RunStore(tmp_path / "runs")
    for seed in (42, 43, 44):
        store.save(Cell("guarded-s4-k4", seed), record("guarded", seed, 0.5 + 0.01 * seed % 3, 440.0))
        store.save(Cell("loglinear-s4-k4", seed), record("loglinear", seed, 0.4, 400.0))
        cpu = "Intel Xeon" if seed == 44 else "AMD EPYC"  # seed 44's recompute ran on another host
        store.save(Cell("recompute-s4-k4", seed), record("recompute", seed, 0.45, 480.0, cpu=cpu))
    options = SimpleNamespace(configs=list(guard_smollm2.CONFIGS), seeds=list(guard_smollm2.SEEDS), out=tmp_path)
    text = guard_smollm2.summarize(store, options)
    payload = json.loads((tmp_path / "summary.json").read_text())
    assert payload["paired_seeds"] == [42, 43]
    assert payload["methods"]["guarded"]["seconds_per_step"] == 11.0  # 440 s over 40 steps, not the 10 s median
    assert payload["methods"]["guarded"]["recomputed"] == 0.25
    assert payload["speed_ratios"] == {"42": 1.1, "43": 1.1}
    assert payload["families"]["guarded - loglinear"]["seeds"] == [42, 43]
    assert payload["decision"] is None and "not decided until all 5 seeds are paired (2 so far)" in text
    assert "several hosts: not paired" in text and "guarded-s4-k4@45" in payload["missing"]


def row(mean, verdict):
    return {"mean": mean, "verdict": verdict}


@pytest.mark.parametrize(
    "smollm2, map_rows, ratio, becomes",
    [
        (row(0.05, "difference"), [row(0.0, "equivalent")], 1.05, True),  # ahead once, behind nowhere, fast enough
        (row(0.05, "difference"), [row(0.0, "equivalent")], 1.12, False),  # too slow
        (row(0.05, "difference"), [row(-0.03, "difference")], 1.0, False),  # behind on a map cell
        (row(0.01, "not resolved"), [row(0.0, "equivalent")], 1.0, False),  # ahead nowhere
        (row(0.0, "equivalent"), [row(0.04, "difference")], 1.0, True),  # ahead on the map counts too
    ],
)
def test_the_default_follows_the_registered_rule(smollm2, map_rows, ratio, becomes):
    map_families = {"guarded - loglinear": [{**r, "cell": f"cell{i}"} for i, r in enumerate(map_rows)]}
    decision = guard_smollm2.default_decision({"guarded - loglinear": smollm2}, {42: ratio}, map_families)
    assert decision["guarded_becomes_default"] is becomes
    assert decision["cells"] == ["SmolLM2 s4-k4", "map cell0"]
