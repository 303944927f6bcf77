"""The report as a PNG (``<out>/<name>.png``): step times, where the time goes, final rewards, micro-benchmark."""

from __future__ import annotations

from .report import ordered_configs


def write_plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in ordered_configs(report["configs"]) if c["kind"] in ("trl", "a3po")]
    names = [c["name"] for c in configs]
    colors = {"trl": "tab:gray", "recompute": "tab:orange", "loglinear": "tab:blue"}
    bar_colors = [colors["trl"] if c["kind"] == "trl" else colors[c["method"]] for c in configs]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))

    ax = axes[0][0]
    ax.bar(names, [c["step_time_median"] or 0 for c in configs], color=bar_colors)
    for method, entry in report["pipeline"].items():
        ax.axhline(entry["ideal_pipelined"], color=colors[method], linestyle="--", label=f"ideal pipelined ({method})")
        ax.axhline(entry["sequential"], color=colors[method], linestyle=":", label=f"sequential 1 thread ({method})")
    ax.set_ylabel("median s / optimizer step")
    ax.set_title("Step time")
    ax.tick_params(axis="x", rotation=45)
    if report["pipeline"]:
        ax.legend(fontsize=7)

    ax = axes[0][1]
    parts = [("generation_time", "generation"), ("prox_time", "prox log-probs"), ("trainer_wait_time", "trainer wait")]
    parts += [("generator_wait_time", "generator wait")]
    width = 0.2
    for k, (key, label) in enumerate(parts):
        ax.bar(
            [i + (k - 1.5) * width for i in range(len(configs))],
            [c.get(key) or 0 for c in configs],
            width=width,
            label=label,
        )
    ax.set_xticks(range(len(configs)), names, rotation=45)
    ax.set_ylabel("s / step")
    ax.set_title("Where the time goes (per step)")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    means = [c["reward_final_mean"] or 0 for c in configs]
    errs = [c["reward_final_std"] or 0 for c in configs]
    ax.bar(names, means, yerr=errs, color=bar_colors, capsize=3)
    ax.set_ylabel(f"final reward (last {report['meta']['final_window']} steps)")
    ax.set_title("Final reward (mean ± sd over seeds)")
    ax.tick_params(axis="x", rotation=45)

    ax = axes[1][1]
    micro = report.get("microbench")
    if micro:
        labels = [f"{r['threads']} thr" for r in micro["by_threads"]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [r["recompute_seconds"] for r in micro["by_threads"]], 0.4, label="recompute")
        ax.bar([x + 0.2 for x in xs], [r["loglinear_seconds"] for r in micro["by_threads"]], 0.4, label="loglinear")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("seconds per proximal computation")
        ax.set_title(f"Proximal log-probs on a {tuple(micro['batch_shape'])} batch")
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    meta = report["meta"]
    fig.suptitle(f"{meta['model_name'] or meta['model']} on {meta['device']}: TRL GRPOTrainer vs AsyncA3POTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
