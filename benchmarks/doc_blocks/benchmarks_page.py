"""docs/BENCHMARKS.md's blocks: each study's headline table or sentence, from its summary."""

from __future__ import annotations

import re

from benchmarks.common.intervals import holm

from .sources import Summaries, interval, percent, seconds, signed, span
from .studies import (
    confirmation_rows,
    confirmation_step_time,
    in_flight_rows,
    map_cell,
    map_family_counts,
    map_margin,
    oracle_summary,
    step_time_speedups,
)


# ---- step time against TRL (benchmarks/compare) ----------------------------------------------------------------
def step_time_table(s: Summaries) -> str:
    """The controlled step-time benchmark: loglinear and recompute at staleness 1 / 2 / 4 against TRL."""
    report = s.json("compare-smollm2.json")
    configs, speedup = report["configs"], report["speedup_vs_trl"]
    micro = next(row for row in report["microbench"]["by_threads"] if row["threads"] == 1)
    shape = ", ".join(map(str, report["microbench"]["batch_shape"]))
    lines = [
        f"| | s/step | vs TRL `GRPOTrainer` (2 threads, {configs['trl']['step_time_median']:.2f} s) | proximal "
        "log-probs |",
        "|---|---:|---:|---:|",
    ]
    for method in ("loglinear", "recompute"):
        names = [f"{method}-s{d}" for d in (1, 2, 4)]
        prox = [configs[name]["prox_time"] for name in names]
        prox_text = f"{span([p * 1e3 for p in prox], '.1f')} ms" if max(prox) < 1.0 else f"{span(prox, '.1f')} s"
        step_seconds = " / ".join(f"{configs[name]['step_time_median']:.2f}" for name in names)
        lines.append(
            f"| `AsyncA3POTrainer`, {method}, staleness 1 / 2 / 4 | {step_seconds} | "
            f"{' / '.join(f'{speedup[n]:.2f}x' for n in names)} | {prox_text} per step |"
        )
    lines.append(
        f"| one proximal computation, ({shape}) batch, one thread | | | loglinear "
        f"{seconds(micro['loglinear_seconds'])} vs a recompute forward {seconds(micro['recompute_seconds'])}: "
        f"{micro['ratio']:,.0f}x |"
    )
    return "\n".join(lines)


def micro_operation(s: Summaries) -> str:
    """What the micro-benchmark's ratio means end to end."""
    step = confirmation_step_time(s)
    return (
        "The last row is a micro-operation: one proximal computation, not a training step. End to end the forward is "
        "paid once per generation batch; at four optimizer steps per batch on SmolLM2 (the pre-registered "
        f"confirmation below, {len(step['seeds'])} seeds) `loglinear - recompute` in seconds per optimizer step was "
        f"{interval(step, 2)} s of {step['recompute_mean']:.2f} s, paired by seed: a difference within noise (the "
        "later seeds ran beside other work)."
    )


# ---- time to accuracy ------------------------------------------------------------------------------------------
def time_to_accuracy_tables(s: Summaries) -> str:
    """The study's summary.md: its configuration table, the same-seed training-time ratios, the per-run table."""
    text = s.text("time-to-accuracy/summary.md")
    kept = "\n".join(line for line in text.splitlines() if not line.startswith("Missing runs:"))
    return re.sub(r"\n{3,}", "\n\n", kept).strip()


def time_to_accuracy_speed(s: Summaries) -> str:
    """The speed sentence: the demo configuration's same-seed ratios, their interval, the controlled benchmark's."""
    tta = s.json("time-to-accuracy/summary.json")["configs"]["loglinear-s1"]["speedup_vs_trl"]
    controlled = [row["speedup"] for row in step_time_speedups(s).values()]
    includes_one = "includes" if tta["low"] <= 1.0 <= tta["high"] else "excludes"
    return (
        f"- Speed: `loglinear` at staleness 1 (the demo's configuration) trained the 60 steps "
        f"{' / '.join(f'{r:.2f}x' for r in tta['ratios'])} as fast as TRL on seeds "
        f"{' / '.join(map(str, tta['seeds']))} (same data order): a geometric mean of {tta['geometric_mean']:.2f}x "
        f"[{tta['low']:.2f}, {tta['high']:.2f}] over the {len(tta['seeds'])} seeds, an interval that {includes_one} "
        f"1. The controlled step-time benchmark above measured {span(controlled)}x."
    )


# ---- the proximal map ------------------------------------------------------------------------------------------
def proximal_map_table(s: Summaries) -> str:
    """Final reward per cell, mean over the seeds."""
    lines = [
        "| steps per batch, lr | method | staleness 0 | 2 | 4 | 8 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for k in (1, 4):
        for rate in ("hi", "lo"):
            for method in ("behavior", "recompute", "loglinear"):
                means = [f"{map_cell(s, method, d, k, rate)['mean']:.3f}" for d in (0, 2, 4, 8)]
                lines.append(f"| {k}, {rate} | {method} | {' | '.join(means)} |")
    return "\n".join(lines)


def _cells(rows: list[dict]) -> str:
    """Cells named by steps per batch and learning rate, then their staleness."""
    groups: dict[tuple[int, str], list[int]] = {}
    for row in rows:
        groups.setdefault((row["steps_per_batch"], row["lr"]), []).append(row["staleness"])
    return "; ".join(
        f"{k} step{'s' if k > 1 else ''} per batch at `{rate}`, staleness {', '.join(map(str, stale))}"
        for (k, rate), stale in groups.items()
    )


def proximal_map_families(s: Summaries) -> str:
    """The multiple-comparisons bullet: the loglinear - recompute families' verdicts, counted and named."""
    families = s.json("proximal_map/families.json")["families"]
    final = families["loglinear - recompute, final"]
    counts, auc = (
        map_family_counts(s, "loglinear - recompute, final"),
        map_family_counts(s, "loglinear - recompute, auc"),
    )
    ahead = [row for row in final if row["verdict"] == "difference" and row["mean"] > 0]
    equivalent = [row for row in final if row["verdict"] == "equivalent"]
    uncorrected_only = [row for row in final if row["equivalence_p"] <= 0.05 < row["holm_equivalence_p"]]
    margin = map_margin(s)
    lost = "; ".join(
        f"{_cells([row])}: {interval(row)}, TOST p {row['equivalence_p']:.3f}" for row in uncorrected_only
    )
    return (
        f"- **Multiple comparisons.** A family here is one pair of methods on one outcome across the map's "
        f"{counts['cells']} cells (4 staleness x 2 steps per batch x 2 learning rates); Holm's correction applies "
        f"within it to the differences and to the equivalence tests (two one-sided tests against ±{margin}, a margin "
        "taken over from the SmolLM2 confirmation after the map's first run: it was not registered for the map). "
        f"`loglinear - recompute` in final reward: {counts['uncorrected']} uncorrected intervals exclude 0; after "
        f"Holm, `loglinear` is ahead in **{counts['ahead']}** ({_cells(ahead)}) and behind in "
        f"{counts['behind'] or 'none'}; equivalent in {counts['equivalent']} ({_cells(equivalent)}), not resolved in "
        f"{counts['not resolved']}. Equivalent by their own tests but not within the family: {lost or 'none'}. In "
        f"the area under the curve: ahead in {auc['ahead']}, behind in {auc['behind'] or 'none'}, equivalent in "
        f"{auc['equivalent']}, not resolved in {auc['not resolved']}."
    )


# ---- the approximation and the SmolLM2 staleness study: their summaries' first tables ---------------------------
def approximation_table(s: Summaries) -> str:
    """The log-linear anchor's difference from the recomputed one, by anchor age (one run per configuration)."""
    return s.table("approximation/summary.md")


def staleness_table(s: Summaries) -> str:
    """The retired SmolLM2 staleness study, per configuration."""
    return s.table("staleness/summary.md")


# ---- the SmolLM2 confirmation ----------------------------------------------------------------------------------
def confirmation_table(s: Summaries) -> str:
    """The pre-registered primary comparison."""
    lines = [
        "| difference | seeds | mean [95% interval] | TOST p | verdict |",
        "|---|---|---|---:|---|",
    ]
    for name, row in confirmation_rows(s).items():
        verdict = "difference" if row["holm_p"] <= 0.05 else "equivalent" if row["equivalent"] else "not resolved"
        lines.append(
            f"| `{name}` | {min(row['seeds'])}-{max(row['seeds'])} | {interval(row)} | {row['equivalence_p']:.3f} | "
            f"{verdict} |"
        )
    return "\n".join(lines)


# ---- the arm studies -------------------------------------------------------------------------------------------
def _arm_values(row: dict, unit: str) -> tuple[str, str, str, str]:
    """A paired row's off, on, difference and 90% TOST interval, printed in its unit."""
    if unit == "points":
        return (percent(row["off_mean"]), percent(row["on_mean"]), f"{interval(row, 1, 100)} points",
                f"[{signed(row['equivalence_low'], 1, 100)}, {signed(row['equivalence_high'], 1, 100)}]")  # fmt: skip
    digits = 3 if unit == "versions" else 2
    return (
        f"{row['off_mean']:.{digits}f}",
        f"{row['on_mean']:.{digits}f}",
        interval(row, digits),
        f"[{signed(row['equivalence_low'], digits)}, {signed(row['equivalence_high'], digits)}]",
    )


def _unit(outcome: str) -> str:
    return "points" if "accuracy" in outcome else "versions" if "staleness" in outcome else "seconds"


def _margin(row: dict, unit: str) -> str:
    margin = row["equivalence_margin"]
    return f"±{margin * 100:.0f} points" if unit == "points" else f"±{margin:.2f}"


def in_flight_table(s: Summaries) -> str:
    """Every registered outcome of both settings: the difference and its Holm p, the margin, the two one-sided tests'
    p and their 90% interval (what decides equivalence), the verdict."""
    lines = [
        "| setting, outcome | off | on | on - off [95% interval] | Holm p | margin | TOST p [90% interval] "
        "| verdict |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for (setting, outcome), row in in_flight_rows(s).items():
        unit = _unit(outcome)
        off, on, difference, tost = _arm_values(row, unit)
        lines.append(
            f"| {setting}: {outcome} | {off} | {on} | {difference} | {row['holm_p']:.3f} | {_margin(row, unit)} | "
            f"{row['equivalence_p']:.3f} {tost} | {row['verdict']} |"
        )
    return "\n".join(lines)


def in_flight_equivalence(s: Summaries) -> str:
    """How equivalence is decided here, and what Holm over the two settings would change."""
    rows = in_flight_rows(s)
    families: dict[str, list[dict]] = {}
    for row in rows.values():
        families.setdefault(row["family"], []).append(row)
    changed = []
    for family in families.values():
        for row, adjusted in zip(family, holm([r["equivalence_p"] for r in family])):
            if row["verdict"] == "equivalent" and adjusted > 0.05:
                changed.append(f"{row['setting']}: {row['outcome']} (TOST p {adjusted:.3f} after Holm)")
    step = rows[("main", "s per optimizer step")]
    return (
        "Equivalence is decided by two one-sided tests at level 0.05, that is by the 90% interval lying inside the "
        "margin; the 95% interval beside it may cross the margin (main's step time: "
        f"{interval(step, 2)} s against ±{step['equivalence_margin']:.2f} s, its 90% interval "
        f"[{signed(step['equivalence_low'], 2)}, {signed(step['equivalence_high'], 2)}]). As registered, Holm's "
        "correction applies to the differences within each outcome's family, not to the equivalence tests; with it, "
        f"these would not be shown equivalent: {'; '.join(changed) if changed else 'none'}."
    )


def dynamic_sampling_table(s: Summaries) -> str:
    """The registered outcomes, each its own family."""
    lines = [
        "| outcome (on - off) | off | on | on - off [95% interval] | p | margin | TOST p [90% interval] | verdict |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for row in s.json("dynamic-sampling/summary.json")["paired"]:
        unit = _unit(row["outcome"])
        off, on, difference, tost = _arm_values(row, unit)
        lines.append(
            f"| {row['outcome']} | {off} | {on} | {difference} | {row['p']:.3f} | {_margin(row, unit)} | "
            f"{row['equivalence_p']:.3f} {tost} | {row['verdict']} |"
        )
    return "\n".join(lines)


# ---- the main job ----------------------------------------------------------------------------------------------
def main_job_table(s: Summaries) -> str:
    """The demo's accuracy before and after, its paired gain, and stock GRPOTrainer on the same seed."""
    demo = s.json("demo-smollm2.json")
    before, after, test = demo["before"], demo["after"], demo["paired_test"]
    trl = s.json("time-to-accuracy/summary.json")["configs"]["trl"]["per_seed"][str(demo["seed"])]
    return "\n".join(
        [
            "| | accuracy | |",
            "|---|---:|---|",
            f"| before training | {percent(before['accuracy'])} +- {percent(before['stderr'])} | "
            f"{before['num_correct']} / {before['count']} |",
            f"| after {demo['global_step']} steps | **{percent(after['accuracy'])} +- {percent(after['stderr'])}** | "
            f"{after['num_correct']} / {after['count']} |",
            f"| gain (paired) | **{test['gain']:+.1%} +- {percent(test['stderr'])}** | {test['improved']} problems "
            f"fixed, {test['regressed']} broken, McNemar p = {test['p_value']:.3f} |",
            f"| stock `GRPOTrainer`, same seed | {percent(trl['before'])} -> {percent(trl['after'])}, "
            f"{trl['gain']:+.1%} +- {percent(trl['gain_stderr'])} | `trl@{demo['seed']}` of the time-to-accuracy "
            f"study, p = {trl['p_value']:.3f} |",
            "",
            f"Mean completion length of the held-out greedy answers: {before['mean_completion_tokens']:.1f} tokens "
            f"before training, {after['mean_completion_tokens']:.1f} after. Run time "
            f"{demo['total_seconds'] / 60:.1f} min ({demo['train_seconds'] / 60:.1f} min training, "
            f"{before['seconds'] / 60:.1f} + {after['seconds'] / 60:.1f} min for the two evaluations).",
        ]
    )


# ---- the oracle study (benchmarks/oracle.py) ----------------------------------------------------------------------
def oracle_tables(s: Summaries) -> str:
    """The estimators' errors, the fitted weights' reductions and the guard defaults' evidence, as the summary
    writes them."""
    name = "oracle/summary.md"
    return "\n\n".join(s.table(name, index) for index in (0, 1, 4))


def oracle_decision(s: Summaries) -> str:
    """The registered decisions: the fitted weight, and the guard's defaults."""
    summary = oracle_summary(s)
    verdict, defaults = summary["decision"], summary["guard_defaults"]
    meeting = ", ".join(f"`{n}`" for n in verdict["meeting"]) or "none"
    pooled = defaults["pooled_agreement"]
    agreement = ", ".join(f"{pooled[str(lag)]:.0%} at L={lag}" for lag in (1, 2, 4, 8) if pooled[str(lag)] is not None)
    built = "build it" if verdict["build_fitted_weight"] else "do not build it: the guard is built alone"
    return (
        f"**Decision, by the registered rule** (a fitted weight iff it cuts the error by 25% on more than half of the "
        f"configurations): {built}. Configurations meeting the threshold: {len(verdict['meeting'])} of "
        f"{verdict['configurations']} ({meeting}). **The guard's defaults, by the addendum's rules**: "
        f"`prox_error_budget={defaults['budget']:g}`, `prox_check_interval={defaults['interval']}` (a check of batch "
        f"i - L decides for batch i as batch i's own check does: {agreement}, pooled over the configurations)."
    )


def guard_map_tables(s: Summaries) -> str:
    """The guard's registered map cells: the cells' table and the two families, as the summary writes them."""
    return "\n\n".join(s.table("guard/map/summary.md", index) for index in (0, 1, 2))


def guard_smollm2_tables(s: Summaries) -> str:
    """The guard's SmolLM2 evaluation: its tables and its decision (or why it decides nothing yet), as the summary
    writes them."""
    text = s.text("guard/smollm2/summary.md")
    tables = sum(1 for block in text.split("\n\n") if block.startswith("|"))
    closing = [
        line
        for line in text.splitlines()
        if line.startswith(("**The default", "The default is not decided", "Seconds per step, guarded", "Missing"))
    ]
    return "\n\n".join([*(s.table("guard/smollm2/summary.md", index) for index in range(tables)), *closing])


def compiled_decode_tables(s: Summaries) -> str:
    """Eager against compiled decoding: the per-path table, the ratios and the decision, as the report writes them."""
    text = s.text("compiled-decode.md")
    decision = next(line for line in text.splitlines() if line.startswith("**Decision**"))
    return "\n\n".join([s.table("compiled-decode.md", 0), s.table("compiled-decode.md", 1), decision])


def launch_bound_tables(s: Summaries) -> str:
    """The launch-bound proxy: per configuration the step and each thread's CPU time, and the asynchronous step
    against the synchronous ones paired by seed (one family of two differences, Holm)."""
    return _paired_steps(s, "launch-bound/launch-bound", "loglinear-s1", ("trl-t1", "pieces-loglinear"))


def launch_bound_defaults_tables(s: Summaries) -> str:
    """The launch-bound proxy at the library's defaults (OMP_WAIT_POLICY unset): the defaults' asynchronous step
    against GRPOTrainer at its default and at one thread, and against PyTorch's count in both threads (one family of
    three differences, Holm)."""
    return _paired_steps(s, "launch-bound/defaults", "loglinear-s1", ("trl", "trl-t1", "loglinear-s1-t2g2"))


def smollm2_defaults_tables(s: Summaries) -> str:
    """SmolLM2 at the library's defaults (OMP_WAIT_POLICY unset): the defaults' asynchronous step against GRPOTrainer
    at its default and at one thread, and against one intra-op thread each (one family of three differences, Holm)."""
    baselines = ("trl", "trl-t1", "loglinear-s1-t1g1")
    return _paired_steps(s, "launch-bound/defaults-smollm2", "loglinear-s1", baselines, thread_table=1)


#: Generation in a process of its own against the thread, each pair at the same thread settings (launch-bound proxy).
GENERATION_PROCESS_PAIRS = (("loglinear-s1-proc-t1g1", "loglinear-s1-t1g1"), ("loglinear-s1-proc", "loglinear-s1"))


def generation_process_tables(s: Summaries) -> str:
    """Generation in a process of its own on the launch-bound proxy: per configuration the step and each thread's CPU
    time; the process's mean step against the thread's at the same settings, paired by seed (one family of two
    differences, Holm); and the share of the thread's distance to the ideal pipelined step the process closed (the
    rule to keep it: at least half, at the thread's best settings)."""
    from benchmarks.common.intervals import holm

    report_name = "launch-bound/generation-process"
    report = s.json(f"{report_name}.json")
    rows = []
    for process, thread in GENERATION_PROCESS_PAIRS:
        rows += [{**row, "config": process} for row in paired_steps(s, report_name, process, (thread,))]
    for row, adjusted in zip(rows, holm([row["p"] for row in rows])):
        row["holm_p"] = adjusted
    lines = [
        "| process | against the thread | seeds | step difference, s [95% interval] | Holm p | step ratio, per seed |",
        "|---|---|---:|---|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['config']} | {row['baseline']} | {len(row['seeds'])} | {row['mean']:+.4f} [{row['low']:+.4f}, "
            f"{row['high']:+.4f}] | {row['holm_p']:.3f} | {row['ratio_low']:.2f}-{row['ratio_high']:.2f} |"
        )
    pipeline = report["pipeline"]["loglinear"]
    ideal = pipeline["ideal_pipelined"]
    closed = [
        "| process | thread | thread step, s | process step, s | ideal, s | distance closed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for process, thread in GENERATION_PROCESS_PAIRS:
        thread_step = report["configs"][thread]["step_time_median"]
        process_step = report["configs"][process]["step_time_median"]
        share = (thread_step - process_step) / (thread_step - ideal)
        closed.append(f"| {process} | {thread} | {thread_step:.3f} | {process_step:.3f} | {ideal:.3f} | {share:.0%} |")
    note = (
        f"Steps are medians over seeds of each run's median step; the ideal is the longer of generation and training "
        f"alone, from `{pipeline['pieces_config']}`. Distance closed: (thread - process) / (thread - ideal)."
    )
    return "\n\n".join([s.table(f"{report_name}.md", 2), "\n".join(lines), "\n".join(closed), note])


def generation_process_smollm2_tables(s: Summaries) -> str:
    """Generation in a process of its own on SmolLM2 at the library's defaults: each configuration's step and thread
    CPU time, and the process's mean step against the thread's, paired by seed (no ideal measured here)."""
    report_name = "launch-bound/generation-process-smollm2"
    tables = _paired_steps(s, report_name, "loglinear-s1-proc", ("loglinear-s1",), thread_table=1)
    memory = {}
    for record in s.json(f"{report_name}.json")["records"]:
        trainer, child = record["peak_rss_mb"], record["result"].get("generation_process_peak_rss_mb")
        memory.setdefault(record["config"]["name"], []).append((trainer, child or 0.0))
    lines = [
        "| config | trainer process peak RSS, MB | generation process peak RSS, MB | together, MB |",
        "|---|---:|---:|---:|",
    ]
    for name, peaks in memory.items():
        trainer, child = (sum(values) / len(values) for values in zip(*peaks))
        shown = f"{child:,.0f}" if child else "–"
        lines.append(f"| {name} | {trainer:,.0f} | {shown} | {trainer + child:,.0f} |")
    return tables + "\n\n" + "\n".join(lines) + "\n\nPeak resident memory, mean over seeds."


def generation_process_before_split_table(s: Summaries) -> str:
    """The SmolLM2 runs that led to splitting the cores for the generation process, run by run from their records:
    each run's intra-op threads (training, generation) as its provenance recorded them, its mean step, and whether
    the working tree differed from its commit (the rule changed while the runs went)."""
    report = s.json("generation-process-smollm2-before-split.json")
    steps = {(run["name"], run["seed"]): run["step_time_mean"] for run in report["runs"]}
    lines = [
        "| config | seed | intra-op threads (training, generation) | s/step mean | tree differed from its commit |",
        "|---|---:|---|---:|---|",
    ]
    for record in report["records"]:
        config, block = record["config"], record["provenance"]
        threads = block["threads"]
        where = "process" if config.get("generation_process") else "thread"
        lines.append(
            f"| {config['name']} | {config['seed']} | {threads['training']}, {threads['generation']} ({where}) | "
            f"{steps[(config['name'], config['seed'])]:.2f} | {'yes' if block['dirty'] else 'no'} |"
        )
    return "\n".join(lines)


#: The reward workers' records (``benchmarks/reward_workers.py``), lightest reward first.
REWARD_WORKERS_RECORDS = (
    "reward_workers-tiny.json",
    "reward_workers-tiny-rounds100.json",
    "reward_workers-tiny-rounds400.json",
    "reward_workers-smollm2-rounds400.json",
)


def reward_workers_tables(s: Summaries) -> str:
    """Rewards in worker processes, one record per model and reward cost: each arm's medians over seeds, and the arms
    paired seed by seed (mean difference, 95% t interval, Holm within step time and within stall)."""
    arms = [
        "| model | reward (s per batch) | arm | step, s (median) | training thread's stall, s | stall share | "
        "train(), s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    pairs = [
        "| model | reward (s per batch) | quantity | difference | seeds | mean [95% interval] | Holm p |",
        "|---|---|---|---|---:|---|---:|",
    ]
    for name in REWARD_WORKERS_RECORDS:
        record = s.json(name)
        model = record["meta"].get("model_key", "tiny")  # the first records ran the tiny model only
        cost = f"{model} | {record['meta']['reward_seconds_per_batch']:.3f}"
        summary = record["summary"]
        for arm in ("grpo", "thread", "workers"):
            a = summary[arm]
            arms.append(
                f"| {cost} | {arm} | {a['step_time_median']:.3f} | {a['stall_median']:.4f} | "
                f"{a['stall_fraction']:.1%} | {a['train_seconds']:.1f} |"
            )
        for row in summary["paired"]:
            quantity = "step" if row["quantity"] == "step_time_median" else "stall"
            low, high = row["interval"]
            pairs.append(
                f"| {cost} | {quantity} | {row['comparison']} | {len(row['seeds'])} | {row['mean']:+.4f} "
                f"[{low:+.4f}, {high:+.4f}] | {row['holm_p']:.3f} |"
            )
    return "\n".join(arms) + "\n\n" + "\n".join(pairs)


def paired_steps(s: Summaries, report_name: str, config: str, baselines: tuple[str, ...]) -> list[dict]:
    """``config``'s mean step in a compare report against each baseline's, paired by seed, Holm within the family:
    per baseline its seeds, mean difference and 95% interval, Holm p, the per-seed ratios' range and both means."""
    from benchmarks.common.intervals import holm, p_value, paired_difference, paired_values

    steps = {}
    for run in s.json(f"{report_name}.json")["runs"]:
        steps.setdefault(run["name"], {})[run["seed"]] = run["step_time_mean"]
    rows = []
    for baseline in baselines:
        a, b = steps[config], steps[baseline]
        interval = paired_difference(a, b)
        seeds = sorted(a.keys() & b.keys())
        ratios = [a[seed] / b[seed] for seed in seeds]
        rows.append(
            {
                "baseline": baseline,
                "seeds": seeds,
                "mean": interval.mean,
                "low": interval.low,
                "high": interval.high,
                "p": p_value(paired_values(a, b)),
                "ratio_low": min(ratios),
                "ratio_high": max(ratios),
                "config_step": sum(a[seed] for seed in seeds) / len(seeds),
                "baseline_step": sum(b[seed] for seed in seeds) / len(seeds),
            }
        )
    for row, adjusted in zip(rows, holm([row["p"] for row in rows])):
        row["holm_p"] = adjusted
    return rows


def _paired_steps(
    s: Summaries, report_name: str, config: str, baselines: tuple[str, ...], thread_table: int = 2
) -> str:
    """A compare report's thread table (the report's table number ``thread_table``: the third after the pipelining
    table, the second in a report without ``pieces-*`` runs), ``config``'s mean step against each baseline's paired
    by seed (Holm within the family), and its distance to the ideal pipelined step where the report measured it."""
    lines = [
        f"| {config} against | seeds | step difference, s [95% interval] | Holm p | step ratio, per seed |",
        "|---|---:|---|---:|---|",
    ]
    for row in paired_steps(s, report_name, config, baselines):
        lines.append(
            f"| {row['baseline']} | {len(row['seeds'])} | {row['mean']:+.4f} [{row['low']:+.4f}, "
            f"{row['high']:+.4f}] | {row['holm_p']:.3f} | {row['ratio_low']:.2f}-{row['ratio_high']:.2f} |"
        )
    ideal = ideal_line(s, report_name, config)
    table = s.table(f"{report_name}.md", thread_table)
    return "\n\n".join([table, "\n".join(lines), *([ideal] if ideal else [])])


def ideal_line(s: Summaries, report_name: str, config: str) -> str | None:
    """``config``'s step against the ideal pipelined step, or None where the report ran no ``pieces-*``
    configuration (no ideal measured)."""
    pipeline = (s.json(f"{report_name}.json").get("pipeline") or {}).get("loglinear") or {}
    if pipeline.get("ideal_pipelined") is None:
        return None
    pieces = pipeline.get("pieces_config", "pieces-loglinear")
    return (
        f"Ideal (max of generation and training alone, from `{pieces}`): {pipeline['ideal_pipelined']:.3f} s; "
        f"`{config}` took {pipeline['achieved']['1']['step_time_median']:.3f} s, "
        f"{pipeline['achieved']['1']['ratio_to_ideal']:.2f}x the ideal."
    )


BLOCKS = {
    "launch-bound": launch_bound_tables,
    "launch-bound-defaults": launch_bound_defaults_tables,
    "smollm2-defaults": smollm2_defaults_tables,
    "generation-process": generation_process_tables,
    "generation-process-smollm2": generation_process_smollm2_tables,
    "generation-process-before-split": generation_process_before_split_table,
    "reward-workers": reward_workers_tables,
    "compiled-decode": compiled_decode_tables,
    "guard-map": guard_map_tables,
    "guard-smollm2": guard_smollm2_tables,
    "oracle": oracle_tables,
    "oracle-decision": oracle_decision,
    "step-time": step_time_table,
    "step-time-micro-operation": micro_operation,
    "time-to-accuracy": time_to_accuracy_tables,
    "time-to-accuracy-speed": time_to_accuracy_speed,
    "proximal-map-final-reward": proximal_map_table,
    "proximal-map-families": proximal_map_families,
    "approximation": approximation_table,
    "staleness": staleness_table,
    "confirmation": confirmation_table,
    "in-flight": in_flight_table,
    "in-flight-equivalence": in_flight_equivalence,
    "dynamic-sampling": dynamic_sampling_table,
    "main-job": main_job_table,
}
