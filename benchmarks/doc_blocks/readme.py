"""README.md's block: "What you get, what it costs", a row per question a user asks first, every number from the
summaries (the statistics behind each row are in docs/BENCHMARKS.md)."""

from __future__ import annotations

from .sources import Summaries, interval, percent, pinned_versions, seconds, signed, span
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

BENCHMARKS = "docs/BENCHMARKS.md"
TIME_TO_ACCURACY = "time-to-accuracy-on-the-main-job-benchmarkstime_to_accuracypy"


def _both(first: str, second: str) -> str:
    """Two verdicts in one phrase."""
    return f"both {first}" if first == second else f"{first} and {second}"


def _link(text: str, anchor: str) -> str:
    return f"[{text}]({BENCHMARKS}#{anchor})"


def speed_row(s: Summaries) -> tuple[str, str, str]:
    steps = step_time_speedups(s)
    ratios = [row["speedup"] for row in steps.values()]
    tta = s.json("time-to-accuracy/summary.json")["configs"]["loglinear-s1"]["speedup_vs_trl"]
    per_seed = " / ".join(f"{r:.2f}x" for r in tta["ratios"])
    includes_one = "includes" if tta["low"] <= 1.0 <= tta["high"] else "excludes"
    return (
        "**Speed** against TRL's `GRPOTrainer`",
        f"step time {span(ratios)}x TRL's with `loglinear` at staleness "
        f"{' / '.join(name.rpartition('-s')[2] for name in steps)} (the controlled step-time benchmark); the main "
        f"job's 60 steps (the demo's settings) on seeds {', '.join(map(str, tta['seeds']))}: {per_seed} TRL's "
        f"training time, geometric mean {tta['geometric_mean']:.2f}x [{tta['low']:.2f}, {tta['high']:.2f}] over the "
        f"seeds, an interval that {includes_one} 1; each ratio also carries its runs' own completion lengths",
        "SmolLM2-135M, 2 CPU cores; the 1.5x target is not reached there "
        f"({_link('why', 'two-regimes-short-and-generation-length-completions')})",
    )


def launch_bound_row(s: Summaries) -> tuple[str, str, str]:
    from .benchmarks_page import paired_steps

    report = "launch-bound/defaults"
    rows = {row["baseline"]: row for row in paired_steps(s, report, "loglinear-s1", ("trl", "trl-t1"))}
    trl = rows["trl"]
    verdict = "a difference" if trl["holm_p"] <= 0.05 else "not resolved"
    ideal = s.json(f"{report}.json")["pipeline"]["loglinear"]["achieved"]["1"]["ratio_to_ideal"]
    return (
        "**Speed where Python bounds the step**",
        f"at the library's defaults (no thread settings, `OMP_WAIT_POLICY` unset) the asynchronous step "
        f"{trl['config_step']:.2f} s against `GRPOTrainer`'s {trl['baseline_step']:.2f} s at its default threads "
        f"({trl['ratio_low']:.2f}-{trl['ratio_high']:.2f}x per seed, {signed(trl['mean'], 3)} "
        f"[{signed(trl['low'], 3)}, {signed(trl['high'], 3)}] s, Holm p {trl['holm_p']:.3f}: {verdict}) and "
        f"{rows['trl-t1']['baseline_step']:.2f} s at one thread; {ideal:.2f}x the ideal pipelined step. The same "
        f"defaults on SmolLM2 (the rule keeps PyTorch's threads there): {_smollm2_defaults(s)}",
        f"a random tiny model on 2 CPU cores, {len(trl['seeds'])} seeds "
        f"({_link('the defaults', 'the-launch-bound-proxy-at-the-librarys-defaults')}); SmolLM2-135M, "
        f"{_smollm2_seeds(s)} seeds ({_link('SmolLM2', 'smollm2-at-the-librarys-defaults')})",
    )


_SMOLLM2_DEFAULTS = ("launch-bound/defaults-smollm2", "loglinear-s1", ("trl", "trl-t1", "loglinear-s1-t1g1"))


def _smollm2_defaults(s: Summaries) -> str:
    from .benchmarks_page import paired_steps

    rows = {row["baseline"]: row for row in paired_steps(s, *_SMOLLM2_DEFAULTS)}

    def against(name: str, what: str) -> str:
        row = rows[name]
        verdict = "resolved" if row["holm_p"] <= 0.05 else "not resolved"
        difference = f"{signed(row['mean'], 1)} s, Holm p {row['holm_p']:.3f}: {verdict}"
        return f"{row['baseline_step']:.1f} s {what} ({difference})"

    return (
        f"{rows['trl']['config_step']:.1f} s per step against `GRPOTrainer`'s "
        f"{against('trl', 'at its default threads')}, {against('trl-t1', 'at one thread')}, and "
        f"{against('loglinear-s1-t1g1', 'pinned to one thread each')}"
    )


def _smollm2_seeds(s: Summaries) -> int:
    from .benchmarks_page import paired_steps

    return len(paired_steps(s, *_SMOLLM2_DEFAULTS)[0]["seeds"])


def accuracy_row(s: Summaries) -> tuple[str, str, str]:
    demo = s.json("demo-smollm2.json")
    test = demo["paired_test"]
    tta = s.json("time-to-accuracy/summary.json")["configs"]
    trl = tta["trl"]["per_seed"][str(demo["seed"])]
    asynchronous = [entry["gain_mean"] for name, entry in tta.items() if name != "trl"]
    widest = max((entry["after_spread"][1] - entry["after_spread"][0]) for entry in tta.values())
    return (
        "**Accuracy**",
        f"the demo (LoRA, 60 steps, seed {demo['seed']}, {demo['total_seconds'] / 60:.1f} min): held-out "
        f"{percent(demo['before']['accuracy'])} -> {percent(demo['after']['accuracy'])}, "
        f"{signed(test['gain'], 1, 100)} points ± {test['stderr'] * 100:.1f} (McNemar p {test['p_value']:.3f}); "
        f"stock `GRPOTrainer` on that seed {signed(trl['gain'], 1, 100)} (p {trl['p_value']:.3f}). Over "
        f"{tta['trl']['runs']} seeds, mean gains of {min(asynchronous) * 100:+.1f} to {max(asynchronous) * 100:+.1f} "
        f"points for the asynchronous configurations against TRL's {tta['trl']['gain_mean'] * 100:+.1f}, one "
        f"configuration's seeds {widest * 100:.0f} points apart: not distinguishable",
        f"one 135M model, one task ({_link('time to accuracy', TIME_TO_ACCURACY)})",
    )


def staleness_row(s: Summaries) -> tuple[str, str, str]:
    synchronous, behavior, loglinear = (
        map_cell(s, "behavior", 0, 1, "hi"),
        map_cell(s, "behavior", 8, 1, "hi"),
        map_cell(s, "loglinear", 8, 1, "hi"),
    )
    return (
        "**What staleness costs**",
        f"final reward {synchronous['mean']:.3f} synchronous; at staleness 8 (one optimizer step per batch, learning "
        "rate 3e-2), "
        f"{loglinear['mean']:.3f} with `loglinear` and {behavior['mean']:.3f} without a proximal policy "
        "(`behavior`); keep `max_staleness` small",
        "a random 2-layer model on a synthetic task, 16 seeds per cell "
        f"({_link('the proximal map', 'the-proximal-map-benchmarksproximal_mappy')})",
    )


def proximal_row(s: Summaries) -> tuple[str, str, str]:
    counts = map_family_counts(s, "loglinear - recompute, final")
    primary = confirmation_rows(s)["loglinear - recompute"]
    verdict = "resolved" if primary["resolved"] else "not resolved"
    leaning = "`loglinear`" if primary["mean"] > 0 else "`recompute`"
    return (
        "**`loglinear` against `recompute`**",
        f"tiny-model map, Holm within its {counts['cells']} cells (differences and equivalence): `loglinear` ahead in "
        f"{counts['ahead']}, behind in {counts['behind'] or 'none'}, equivalent within ±{map_margin(s)} in "
        f"{counts['equivalent']}, not resolved in {counts['not resolved']}; SmolLM2 with four optimizer steps per "
        f"batch, {len(primary['seeds'])} seeds: {interval(primary)}, {verdict}, leaning towards {leaning}",
        "the map on the tiny model; SmolLM2 pre-registered "
        f"({_link('confirmation', 'smollm2-with-four-optimizer-steps-per-generation-batch-pre-registered')})",
    )


def guard_map_sentence(s: Summaries) -> str:
    """The guard's registered map cells, in one clause."""
    families = s.json("guard/map/summary.json")["families"]
    counts = {}
    for name, rows in families.items():
        verdicts = [row["verdict"] if row["verdict"] != "difference" else ("ahead" if row["mean"] > 0 else "behind")
                    for row in rows]  # fmt: skip
        counts[name] = ", ".join(f"{verdict} in {verdicts.count(verdict)}" for verdict in dict.fromkeys(verdicts))
    cells = len(families["guarded - loglinear"])
    return (
        f"on {cells} proximal-map cells (16 seeds, Holm), against `loglinear` {counts['guarded - loglinear']}, "
        f"against `recompute` {counts['guarded - recompute']}; {guard_smollm2_clause(s)}"
    )


def guard_smollm2_clause(s: Summaries) -> str:
    """The guard's SmolLM2 evaluation, in one clause: its verdicts and the default once all seeds are in, else how
    far it has got."""
    if not (s.results / "guard" / "smollm2" / "summary.json").exists():
        return "the SmolLM2 part of its evaluation is not yet run"
    summary = s.json("guard/smollm2/summary.json")
    decision = summary["decision"]
    if decision is None:
        return f"its SmolLM2 part has {len(summary['paired_seeds'])} of 5 seeds so far, deciding nothing yet"
    verdicts = ", ".join(f"against `{name.split(' - ')[1]}` {row['verdict']} ({row['mean']:+.3f})"
                         for name, row in summary["families"].items())  # fmt: skip
    default = "`guarded` becomes the default" if decision["guarded_becomes_default"] else "`loglinear` stays default"
    return (
        f"on SmolLM2 (4 optimizer steps per batch, 5 seeds) {verdicts}, at {decision['speed_ratio']:.2f}x "
        f"`loglinear`'s seconds per step: {default}"
    )


def oracle_row(s: Summaries) -> tuple[str, str, str]:
    summary = oracle_summary(s)
    smollm2 = [c["relative"]["fixed"] for c in summary["smollm2"].values()]
    tiny = [c["relative"]["fixed"] for c in summary["map"].values()]
    reductions = [c["reduction"]["fitted_d"]["pooled"] * 100 for c in summary["configurations"].values()]
    defaults = summary["guard_defaults"]
    built = "built" if summary["decision"]["build_fitted_weight"] else "not built"
    link = _link("the oracle study", "the-oracle-study-benchmarksoraclepy")
    fitted = f"from {max(reductions):.0f}% lower to {-min(reductions):.0f}% higher"
    return (
        "**How far A-3PO's interpolation is from its target**",
        "mean error of the interpolated anchor against the exact log-probs of the version it targets, over one "
        f"optimizer step's drift: {span(smollm2, '.2f')} on SmolLM2, {span(tiny, '.2f')} on the tiny map (1.0: as "
        f"far as the trained weights); a weight fitted per staleness leaves it {fitted}: "
        f'{built}. `prox_logp_method="guarded"` checks it every {defaults["interval"]} batch(es) and trains with '
        f"`recompute`'s anchor while it exceeds {defaults['budget']:g}: {guard_map_sentence(s)}",
        f"{len(summary['configurations'])} configurations, every trained token ({link})",
    )


def proximal_cost_row(s: Summaries) -> tuple[str, str, str]:
    micro = s.json("compare-smollm2.json")["microbench"]
    one_thread = next(row for row in micro["by_threads"] if row["threads"] == 1)
    shape = "x".join(map(str, micro["batch_shape"]))
    step = confirmation_step_time(s)
    return (
        "**What the proximal policy costs**",
        f"`loglinear` {seconds(one_thread['loglinear_seconds'])} against a `recompute` forward of "
        f"{seconds(one_thread['recompute_seconds'])} on one ({shape}) batch: a micro-operation. End to end, at four "
        f"optimizer steps per batch (one forward per batch), `loglinear - recompute` step time "
        f"{interval(step, 2)} s against `recompute`'s {step['recompute_mean']:.2f} s, {len(step['seeds'])} seeds: "
        "within noise",
        "SmolLM2-135M, 1 thread; the end-to-end runs on a shared machine",
    )


def in_flight_row(s: Summaries) -> tuple[str, str, str]:
    rows = in_flight_rows(s)
    staleness = [rows[(setting, "mean token staleness")] for setting in ("main", "long")]
    differ = sum(row["verdict"] == "difference" for row in rows.values())
    return (
        "**In-flight weight updates** (off by default)",
        f"mean token staleness {' and '.join(signed(r['mean'], 3) for r in staleness)} versions per token (Holm p "
        f"{span([r['holm_p'] for r in staleness], '.3f')}: not a difference); {differ or 'none'} of the {len(rows)} "
        "registered outcomes (step time, generator idle time, staleness, accuracy at equal wall-clock, in two "
        "settings) differs",
        "3 seeds, 2 settings, pre-registered ([when to turn it on](docs/USAGE.md#when-to-turn-each-option-on))",
    )


def dynamic_sampling_row(s: Summaries) -> tuple[str, str, str]:
    summary = s.json("dynamic-sampling/summary.json")
    rows = {row["outcome"]: row for row in summary["paired"]}
    step, steps, clock = (
        rows["s per optimizer step"],
        rows["held-out accuracy, equal steps"],
        rows["subset accuracy, equal wall-clock"],
    )
    dropped = [run["filtered_frac"] for run in summary["runs"]["on"].values()]
    return (
        "**Dynamic sampling** (off by default)",
        f"dropped {span([d * 100 for d in dropped], '.0f', '%')} of the groups drawn; step "
        f"{step['off_mean']:.1f} -> {step['on_mean']:.1f} s ({interval(step, 1)}); held-out accuracy at equal steps "
        f"{interval(steps, 1, 100)} points, at equal wall-clock {interval(clock, 1, 100)}: "
        f"{_both(steps['verdict'], clock['verdict'])}",
        "3 seeds, generation the bottleneck on 2 cores",
    )


def backends_row(s: Summaries) -> tuple[str, str, str]:
    ratios = {}
    for weights in ("full", "lora"):
        results = {row["backend"]: row for row in s.json(f"backends-smollm2-{weights}.json")["results"]}
        baseline = results["generate"]["generation_tokens_per_second"]
        ratios[weights] = [
            results[name]["generation_tokens_per_second"] / baseline for name in ("vllm-colocate", "vllm-server")
        ]
    return (
        "**vLLM against `generate`**",
        f"generation tokens/s {span(ratios['full'])}x with full weights, {span(ratios['lora'])}x with LoRA (vLLM's "
        "CPU LoRA kernels); the step does not move where training is the longer half",
        "CPU only (vLLM's CPU build)",
    )


def lora_memory_row(s: Summaries) -> tuple[str, str, str]:
    setups = {row["setup"].split(" ")[0]: row for row in s.json("lora_memory-smollm2.json")["results"]}
    lora, full = setups["LoRA"], setups["full"]
    mib = 2**20
    return (
        "**LoRA memory**",
        f"the generator adds {lora['extra_bytes'] / mib:.0f} MiB (its adapter copy and a staging buffer), "
        f"{lora['extra_bytes'] / full['extra_bytes']:.1%} of full fine-tuning's "
        f"{full['generator_weights_bytes'] / mib:.0f} + {full['staging_bytes'] / mib:.0f} MiB",
        "SmolLM2-135M, r=16 on all linear layers",
    )


def unproven_row(s: Summaries) -> tuple[str, str, str]:
    return (
        "**GPUs**",
        "unproven: nothing has run on a GPU; the CUDA paths are written from the libraries' sources",
        "`scripts/gpu_check.py` is the check to run ([GPU](docs/GPU.md))",
    )


def versions_row(s: Summaries) -> tuple[str, str, str]:
    return (
        "**Versions**",
        "pinned to what was tested: " + ", ".join(f"`{spec}`" for spec in pinned_versions()),
        "[INSTALLING](docs/INSTALLING.md): what ran against each",
    )


ROWS = (
    speed_row,
    launch_bound_row,
    accuracy_row,
    staleness_row,
    proximal_row,
    oracle_row,
    proximal_cost_row,
    in_flight_row,
    dynamic_sampling_row,
    backends_row,
    lora_memory_row,
    unproven_row,
    versions_row,
)


def what_you_get(s: Summaries) -> str:
    """README's table: what you get, what it costs, and where it was measured."""
    lines = ["| | measured | on what, how sure |", "|---|---|---|"]
    lines += ["| " + " | ".join(row(s)) + " |" for row in ROWS]
    return "\n".join(lines)


BLOCKS = {"readme-what-you-get": what_you_get}
