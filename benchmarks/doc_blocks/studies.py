"""The rows of each study's summary that the blocks quote, looked up by what they are."""

from __future__ import annotations

import statistics

from benchmarks.common.intervals import paired_difference

from .sources import Summaries

#: The controlled step-time benchmark's asynchronous configurations the documents quote (loglinear, staleness 1/2/4).
STEP_TIME_CONFIGS = ("loglinear-s1", "loglinear-s2", "loglinear-s4")


def step_time_speedups(s: Summaries, configs=STEP_TIME_CONFIGS) -> dict[str, dict]:
    """Per configuration of ``compare-smollm2.json``: its median step time (mean over its seeds) and its speed-up
    over TRL's ``GRPOTrainer``; ``"trl"`` is the baseline."""
    report = s.json("compare-smollm2.json")
    return {
        name: {
            "seconds": report["configs"][name]["step_time_median"],
            "seeds": report["configs"][name]["seeds"],
            "speedup": report["speedup_vs_trl"][name],
        }
        for name in configs
    }


def map_cell(s: Summaries, method: str, staleness: int, steps_per_batch: int, rate: str, outcome: str = "final"):
    """One cell of the proximal map: the mean over its seeds with its 95% interval."""
    cells = s.json("proximal_map/summary.json")["cells"]
    return cells[f"{method}-s{staleness}-k{steps_per_batch}-lr{rate}"][outcome]


def map_difference(s: Summaries, pair: str, staleness: int, steps_per_batch: int, rate: str) -> dict:
    """One row of a proximal-map family (``pair``: e.g. ``"loglinear - recompute, final"``)."""
    rows = s.json("proximal_map/families.json")["families"][pair]
    return next(
        row
        for row in rows
        if (row["staleness"], row["steps_per_batch"], row["lr"]) == (staleness, steps_per_batch, rate)
    )


def map_family_counts(s: Summaries, family: str) -> dict[str, int]:
    """A proximal-map family's verdicts counted: cells, uncorrected intervals excluding 0, ahead / behind after
    Holm, equivalent after Holm, not resolved."""
    rows = s.json("proximal_map/families.json")["families"][family]
    verdicts = [row["verdict"] for row in rows]
    return {
        "cells": len(rows),
        "uncorrected": sum(row["p"] <= 0.05 for row in rows),
        "ahead": sum(row["verdict"] == "difference" and row["mean"] > 0 for row in rows),
        "behind": sum(row["verdict"] == "difference" and row["mean"] < 0 for row in rows),
        "equivalent": verdicts.count("equivalent"),
        "not resolved": verdicts.count("not resolved"),
    }


def map_margin(s: Summaries) -> float:
    return s.json("proximal_map/families.json")["margin"]


def confirmation_rows(s: Summaries) -> dict[str, dict]:
    """The SmolLM2 confirmation's pre-registered comparisons, by difference (``"loglinear - recompute"``)."""
    return {row["difference"]: row for row in s.json("staleness/confirmation/summary.json")["paired"]}


def confirmation_step_time(s: Summaries) -> dict:
    """``loglinear - recompute`` in seconds per optimizer step (each run's median) over the confirmation's seeds,
    paired by seed, with ``recompute``'s mean: a secondary outcome, described, not registered."""
    configs = s.json("staleness/confirmation/summary.json")["configs"]

    def per_seed(name: str) -> dict[int, float]:
        return dict(zip(configs[name]["seeds"], configs[name]["seconds_per_step"]))

    loglinear, recompute = per_seed("loglinear-s4-k4"), per_seed("recompute-s4-k4")
    seeds = sorted(loglinear.keys() & recompute.keys())
    difference = paired_difference(loglinear, recompute)
    return {
        "seeds": seeds,
        "mean": difference.mean,
        "low": difference.low,
        "high": difference.high,
        "recompute_mean": statistics.fmean(recompute[seed] for seed in seeds),
    }


def in_flight_rows(s: Summaries) -> dict[tuple[str, str], dict]:
    """The in-flight study's paired outcomes, by (setting, outcome)."""
    return {(row["setting"], row["outcome"]): row for row in s.json("in-flight/summary.json")["paired"]}


def oracle_summary(s: Summaries) -> dict:
    """The oracle study's summary (``benchmarks/oracle.py``), with its configurations split by model."""
    summary = s.json("oracle/summary.json")
    configurations = summary["configurations"]
    summary["smollm2"] = {n: c for n, c in configurations.items() if not n.startswith("map-")}
    summary["map"] = {n: c for n, c in configurations.items() if n.startswith("map-")}
    return summary
