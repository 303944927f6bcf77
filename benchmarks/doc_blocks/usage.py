"""docs/USAGE.md's block: when to turn each option on, with what its benchmark measured."""

from __future__ import annotations

from .sources import Summaries, interval, span
from .studies import in_flight_rows

BENCHMARKS = "BENCHMARKS.md"
DYNAMIC_SAMPLING = "dynamic-sampling-on-the-main-job-benchmarksdynamic_samplingpy"


def in_flight_measured(s: Summaries) -> str:
    rows = in_flight_rows(s)
    staleness = [rows[(setting, "mean token staleness")] for setting in ("main", "long")]
    steps = [rows[(setting, "s per optimizer step")] for setting in ("main", "long")]
    differ = sum(row["verdict"] == "difference" for row in rows.values())
    return (
        f"the main job, and completions of up to 256 tokens, 3 seeds, pre-registered: mean token staleness "
        f"{' and '.join(interval(r) for r in staleness)} versions per token (Holm p "
        f"{span([r['holm_p'] for r in staleness], '.3f')}, not a difference); step time "
        f"{' and '.join(interval(r, 2) for r in steps)} s; {differ or 'none'} of the {len(rows)} outcomes differs "
        f"([benchmark]({BENCHMARKS}#in-flight-weight-updates-benchmarksin_flightpy))"
    )


def dynamic_sampling_measured(s: Summaries) -> str:
    summary = s.json("dynamic-sampling/summary.json")
    rows = {row["outcome"]: row for row in summary["paired"]}
    step, steps, clock = (
        rows["s per optimizer step"],
        rows["held-out accuracy, equal steps"],
        rows["subset accuracy, equal wall-clock"],
    )
    dropped = [run["filtered_frac"] * 100 for run in summary["runs"]["on"].values()]
    return (
        f"main job, 3 seeds: {span(dropped, '.0f', '%')} of the groups dropped; s per optimizer step "
        f"{step['off_mean']:.1f} -> {step['on_mean']:.1f} s ({step['verdict']}); held-out accuracy at equal steps "
        f"{interval(steps, 1, 100)} points ({steps['verdict']}), at equal wall-clock {interval(clock, 1, 100)} "
        f"({clock['verdict']}) ([benchmark]({BENCHMARKS}#{DYNAMIC_SAMPLING}))"
    )


def continuous_batching_measured(s: Summaries) -> str:
    report = s.json("backends-smollm2-continuous-batching.json")
    rates: dict[str, list[float]] = {}
    for row in report["results"]:
        rates.setdefault(row["backend"], []).append(row["generation_tokens_per_second"])
    pairs = " and ".join(
        f"{cb:.1f} against {hf:.1f}" for cb, hf in zip(rates["continuous-batching"], rates["generate"])
    )
    return (
        f"against `generate`, {len(rates['generate'])} interleaved pairs on a loaded machine (load average "
        f"{report['meta']['load']:.0f} on 2 cores): generation tokens/s {pairs}; not slower, no speed-up claimed "
        f"([benchmark]({BENCHMARKS}#continuous-batching-against-generate))"
    )


def when_to_turn_on(s: Summaries) -> str:
    """The three options off by default: when to turn each on, what was measured, what it refuses."""
    rows = [
        (
            "`in_flight_weight_updates=True`",
            "completions are long and of varied length, so a publication lands while a batch generates and the "
            "generator would finish it on the old weights (or wait for the load between batches); fresher tokens "
            "matter more to you than two runs repeating bit for bit",
            in_flight_measured(s),
            'refuses `reproducible_generation`, LoRA on vLLM, `behavior_logps_source="forward"`, '
            "`async_generation=False`, a `rollout_func`, continuous batching",
        ),
        (
            "`dynamic_sampling=True`",
            "many groups are flat (`frac_reward_zero_std` high) and training, not generation, is the slower half: the "
            "refills then hide behind training; you are short of optimizer steps with a signal, not of generation",
            dynamic_sampling_measured(s),
            "every group dropped is generated for nothing",
        ),
        (
            "`use_transformers_continuous_batching=True`",
            "no vLLM, and completions of very different lengths (paged attention, no padding)",
            continuous_batching_measured(s),
            "refuses truncated or penalised sampling and in-flight updates",
        ),
    ]
    lines = ["| option | turn it on when | what was measured (2 CPU cores, SmolLM2-135M) | refuses, costs |"]
    lines.append("|---|---|---|---|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


BLOCKS = {"usage-when-to-turn-on": when_to_turn_on}
