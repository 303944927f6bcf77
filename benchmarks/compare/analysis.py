"""What the aggregated configurations say: ideal vs achieved pipelining, final reward loglinear vs recompute, and
the targets with whether they were met."""

from __future__ import annotations

import math

from .plan import METHODS


def pipeline_analysis(configs: dict, staleness) -> dict:
    """Ideal pipelined step time max(generation, training) from the pieces runs vs the async step times. With
    several pieces runs of a method (thread variants, ``pieces-loglinear-t1``), the fastest one gives the ideal."""
    out = {}
    for method in METHODS:
        candidates = [
            run
            for name, run in configs.items()
            if (name == f"pieces-{method}" or name.startswith(f"pieces-{method}-"))
            and run.get("generation_piece") is not None
            and run.get("training_piece") is not None
        ]
        if not candidates:
            continue
        pieces = min(candidates, key=lambda run: run["generation_piece"] + run["training_piece"])
        generation, training = pieces["generation_piece"], pieces["training_piece"]
        ideal = max(generation, training)
        entry = {
            "pieces_config": pieces.get("name"),
            "generation_alone": generation,
            "training_alone": training,
            "sequential": generation + training,
            "sequential_measured": pieces["step_time_median"],
            "ideal_pipelined": ideal,
            "bottleneck": "generation" if generation >= training else "training",
            "achieved": {},
        }
        for d in staleness:
            run = configs.get(f"{method}-s{d}")
            if run and run.get("step_time_median"):
                entry["achieved"][str(d)] = {
                    "step_time_median": run["step_time_median"],
                    "ratio_to_ideal": run["step_time_median"] / ideal,
                    "generation_time_side_by_side": run.get("generation_time"),
                    "slowdown_of_generation_side_by_side": (run["generation_time"] or 0) / generation
                    if run.get("generation_time")
                    else None,
                }
        out[method] = entry
    return out


def evaluate_targets(report) -> list[dict]:
    configs, targets = report["configs"], []
    staleness = report["meta"]["staleness"]
    is_smollm2 = report["meta"]["model_key"] == "smollm2"
    micro = report.get("microbench")
    if micro and micro.get("by_threads"):
        for row in micro["by_threads"]:
            targets.append(
                {
                    "target": f"loglinear >= 1000x cheaper than a recompute forward (threads={row['threads']})",
                    "measured": row["ratio"],
                    "met": row["ratio"] is not None and row["ratio"] >= 1000,
                    "note": None if is_smollm2 else "the target is defined for SmolLM2-135M; this model differs",
                }
            )
    trl = configs.get(report["baseline"]) if report.get("baseline") else None
    for d in staleness:
        loglinear, recompute = configs.get(f"loglinear-s{d}"), configs.get(f"recompute-s{d}")
        if d >= 1 and trl and loglinear and loglinear["step_time_median"]:
            speedup = trl["step_time_median"] / loglinear["step_time_median"]
            targets.append(
                {
                    "target": f"loglinear-s{d} >= 1.5x faster per optimizer step than TRL GRPOTrainer "
                    f"(fastest baseline: {trl['name']})",
                    "measured": speedup,
                    "met": speedup >= 1.5,
                    "note": None if speedup >= 1.5 else f"short by {1.5 / speedup:.2f}x",
                }
            )
        if loglinear and recompute and loglinear["step_time_median"]:
            speedup = recompute["step_time_median"] / loglinear["step_time_median"]
            targets.append(
                {
                    "target": f"loglinear-s{d} faster per step than recompute-s{d}",
                    "measured": speedup,
                    "met": speedup > 1.0,
                    "note": None,
                }
            )
    for method, entry in report.get("pipeline", {}).items():
        for d, achieved in entry["achieved"].items():
            if int(d) >= 1:
                ratio = achieved["ratio_to_ideal"]
                targets.append(
                    {
                        "target": f"{method}-s{d} step time within 15% of the ideal pipelined max(gen, train)",
                        "measured": ratio,
                        "met": ratio <= 1.15,
                        "note": None if ratio <= 1.15 else f"{(ratio - 1) * 100:.0f}% above the ideal",
                    }
                )
    for d in staleness:
        comparison = report["reward_comparison"].get(str(d))
        if comparison:
            targets.append(
                {
                    "target": f"final reward of loglinear-s{d} within run-to-run noise of recompute-s{d}",
                    "measured": comparison["difference"],
                    "met": comparison["within_noise"],
                    "note": comparison["note"],
                }
            )
    return targets


def reward_comparison(configs, staleness) -> dict:
    out = {}
    for d in staleness:
        a, b = configs.get(f"loglinear-s{d}"), configs.get(f"recompute-s{d}")
        if not a or not b or a["reward_final_mean"] is None or b["reward_final_mean"] is None:
            continue
        diff = a["reward_final_mean"] - b["reward_final_mean"]
        na, nb = len(a["reward_final_values"]), len(b["reward_final_values"])
        entry = {
            "loglinear_mean": a["reward_final_mean"],
            "loglinear_std": a["reward_final_std"],
            "recompute_mean": b["reward_final_mean"],
            "recompute_std": b["reward_final_std"],
            "n_seeds": [na, nb],
            "difference": diff,
        }
        if na >= 2 and nb >= 2:
            se = math.sqrt((a["reward_final_std"] ** 2) / na + (b["reward_final_std"] ** 2) / nb)
            entry["standard_error"] = se
            entry["within_noise"] = abs(diff) <= 2 * se if se > 0 else diff == 0
            entry["note"] = f"|difference| {abs(diff):.3f} vs 2 x standard error {2 * se:.3f}"
        else:
            entry["within_noise"] = None
            entry["note"] = "one seed: run-to-run noise unknown (use --seeds >= 2)"
        out[str(d)] = entry
    return out
