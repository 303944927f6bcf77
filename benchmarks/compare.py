"""TRL's GRPOTrainer vs AsyncA3POTrainer (recompute / loglinear at several staleness bounds), in one invocation.

    python benchmarks/compare.py --quick                          # tiny random Llama, a few minutes on 2 CPU cores
    python benchmarks/compare.py --model smollm2 --steps 16       # SmolLM2-135M-Instruct, offline
    python benchmarks/compare.py --model smollm2 --device cuda    # the same on a GPU (generator on cuda:1 if present)

Every configuration runs on the same model, data, seed, batch shape and step count, one after another, each in its
own fresh subprocess (``--isolation process``, the default) so that peak memory and thread settings never leak from
one configuration into the next:

- ``trl``: TRL's synchronous ``GRPOTrainer`` (the baseline);
- ``recompute-s{d}`` / ``loglinear-s{d}``: ``AsyncA3POTrainer`` with ``prox_logp_method`` recompute or loglinear and
  ``max_staleness=d`` for every ``d`` of ``--staleness`` (default 0, 1, 2, 4);
- ``pieces-{method}``: ``AsyncA3POTrainer`` with ``async_generation=False`` (generation in the main thread, on the
  training thread's thread count): per step, generation alone (``async/trainer_wait_time``: rollout, behavior
  log-probs, rewards) and training alone (step time minus that), so the ideal pipelined step time
  ``max(generation, training)`` can be compared with what the asynchronous trainer achieved;
- ``microbench``: one ``loglinear`` proximal computation (``a3po_trl.approximate_proximal_logps`` on a ``(B, T)``
  batch) vs one ``recompute`` forward (the trainer's own no-grad ``_get_per_token_logps_and_entropies``) on the same
  batch, median over repetitions.

It writes ``<out>/<name>.json`` (every run, raw per-step series and summaries, the targets and whether they were
met), ``<out>/<name>.md`` (tables) and ``<out>/<name>.png``. Timings are measured, never asserted.

While a configuration runs, the CPU time used by *other* processes is measured from ``/proc/stat`` and reported
(``foreign_cpu_frac``); before each configuration the benchmark waits (at most ``--quiet-wait`` seconds) until the
machine is quiet, because on a small shared machine another process taking one core slows a two-thread run many
times over.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # loaded by file path (the tests) rather than run as a script: make ``comparing`` importable
    sys.path.insert(0, HERE)

from comparing.markdown import write_markdown  # noqa: E402
from comparing.plan import DEFAULT_STALENESS, build_plan, common_settings, resolve_options  # noqa: E402
from comparing.plot import write_plot  # noqa: E402
from comparing.report import build_report, check_mergeable, merge_previous  # noqa: E402
from comparing.runner import partial_path, run_plan  # noqa: E402
from comparing.worker import run_worker  # noqa: E402

# The configurations, the runs and the report are in the ``comparing`` package next to this file (one module per
# concern, listed in its docstring); this file is the command line and ``main``.


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="tiny, smollm2, or any HF id / local path (default: tiny)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps, one seed, every configuration")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 3, quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed; seed i is seed + i")
    parser.add_argument(
        "--extra-seeds-for",
        default="all",
        help="configurations repeated on the seeds after the first (comma list of names or prefixes; 'all')",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of timings (default 2, 1)")
    parser.add_argument("--final-window", type=int, default=None, help="last steps averaged for the final reward")
    parser.add_argument("--staleness", default=",".join(map(str, DEFAULT_STALENESS)), help="max_staleness values")
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list of configurations to run, by name or prefix: trl, recompute, loglinear, recompute-s1, "
        "pieces, pieces-loglinear, microbench, ... (default: all)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="per_device_train_batch_size")
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--num-prompts", type=int, default=256, help="size of the generated math dataset")
    parser.add_argument("--difficulty", default="easy", help="difficulty of the generated math problems")
    parser.add_argument(
        "--sync-threads",
        type=int,
        default=None,
        help="CPU intra-op threads of the synchronous baseline (default: all cores)",
    )
    parser.add_argument("--generation-threads", type=int, default=1, help="CPU: generation_num_threads")
    parser.add_argument("--training-threads", type=int, default=1, help="CPU: training_num_threads")
    parser.add_argument("--bf16", choices=["auto", "on", "off"], default="auto", help="auto: off on CPU")
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the workers on CPU ('default': leave it unset). PASSIVE keeps a multi-thread run "
        "from collapsing when another process holds a core (measured here: 2-thread matmuls 20-40x slower with the "
        "default spinning policy, 1.2x with PASSIVE)",
    )
    parser.add_argument("--microbench-reps", type=int, default=None, help="recompute repetitions (default 10, 3)")
    parser.add_argument(
        "--isolation",
        choices=["process", "shared"],
        default="process",
        help="process: a fresh subprocess per configuration (clean peak RSS); shared: one subprocess runs them all "
        "(peak RSS from VmHWM, reset between configurations; faster start-up, for tests)",
    )
    parser.add_argument("--quiet-wait", type=float, default=None, help="max seconds to wait for a quiet machine")
    parser.add_argument("--quiet-threshold", type=float, default=0.15, help="foreign CPU fraction counted as quiet")
    parser.add_argument("--config-timeout", type=float, default=3600.0, help="seconds per configuration subprocess")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=None,
        help="rerun a configuration (up to --retries times) when other processes used more than this share of the "
        "machine during it (default 0.2; quick: never)",
    )
    parser.add_argument("--retries", type=int, default=1, help="reruns of a configuration disturbed by other load")
    parser.add_argument(
        "--budget-minutes", type=float, default=None, help="no more reruns once the benchmark has run this long"
    )
    parser.add_argument("--profile", default="", help="comma list of configuration names to profile (py-spy)")
    parser.add_argument("--py-spy", default=None, help="py-spy executable (default: from PATH)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory")
    parser.add_argument("--name", default=None, help="file name stem of the outputs (default compare-<model>)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs under <out>/logs")
    parser.add_argument(
        "--merge-from",
        default=None,
        help="a previous report JSON of the same settings: its runs that this invocation does not run again are "
        "merged into this report (to resume, or to rerun only the runs another process disturbed)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        return options
    return resolve_options(options)


def main(argv=None) -> dict | None:
    options = parse_args(argv)
    if options.worker:
        run_worker(options.worker, options.worker_out)
        return None
    os.makedirs(options.out, exist_ok=True)
    common = common_settings(options)
    plan = build_plan(options)
    if not plan:
        raise SystemExit(f"--configs {options.configs!r} selects no configuration")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    if options.merge_from:  # fail before running anything; resume: skip the runs the previous report already has
        with open(options.merge_from) as f:
            previous = json.load(f)
        check_mergeable(previous["meta"], build_report([], options, common, started, started)["meta"])
        done = {r["config"]["run_id"] for r in previous.get("records", []) if "error" not in r}
        plan = [config for config in plan if config["run_id"] not in done]
    print(f"[compare] {len(plan)} runs: model={options.model} device={options.device} steps={options.steps}")
    if options.keep_logs:
        log_dir = os.path.join(options.out, "logs", options.name)
        os.makedirs(log_dir, exist_ok=True)
        records = run_plan(plan, common, options, log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="a3po-compare-logs-") as log_dir:
            records = run_plan(plan, common, options, log_dir)
    finished = datetime.datetime.now().isoformat(timespec="seconds")
    merged_commands = []
    if options.merge_from:
        records, merged_commands = merge_previous(records, plan, options)
    report = build_report(records, options, common, started, finished)
    if options.merge_from:
        report["meta"]["merged_commands"] = merged_commands
    stem = os.path.join(options.out, options.name)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, stem + ".md")
    write_plot(report, stem + ".png")
    report["files"] = {"json": stem + ".json", "markdown": stem + ".md", "png": stem + ".png"}
    if os.path.exists(partial_path(options)):
        os.remove(partial_path(options))
    print(f"[compare] wrote {stem}.json, .md, .png", flush=True)
    for error in report["errors"]:
        print(f"[compare] ERROR in {error['run_id']}: {error['error'][:2000]}", flush=True)
    return report


if __name__ == "__main__":
    main()
