"""TRL's GRPOTrainer vs AsyncA3POTrainer (recompute / loglinear at several staleness bounds), in one invocation.

    python -m benchmarks.compare --quick                          # tiny random Llama, a few minutes on 2 CPU cores
    python -m benchmarks.compare --model smollm2 --steps 16       # SmolLM2-135M-Instruct, offline
    python -m benchmarks.compare --model smollm2 --device cuda    # the same on a GPU (generator on cuda:1 if present)

Every configuration runs on the same model, data, seed, batch shape and step count, one after another, each in its
own fresh subprocess (``--isolation process``, the default; :mod:`benchmarks.common.runner`) so that peak memory and
thread settings never leak from one configuration into the next:

- ``trl``: TRL's synchronous ``GRPOTrainer`` (the baseline);
- ``recompute-s{d}`` / ``loglinear-s{d}``: ``AsyncA3POTrainer`` with ``prox_logp_method`` recompute or loglinear and
  ``max_staleness=d`` for every ``d`` of ``--staleness`` (default 0, 1, 2, 4); with ``--generation-process``, also
  ``{method}-s{d}-proc``: the same with generation in a process of its own (``generation_process=True``);
- ``pieces-{method}``: ``AsyncA3POTrainer`` with ``async_generation=False`` (generation in the main thread, on the
  training thread's thread count): per step, generation alone (``async/trainer_wait_time``: rollout, behavior
  log-probs, rewards) and training alone (step time minus that), so the ideal pipelined step time
  ``max(generation, training)`` can be compared with what the asynchronous trainer achieved;
- ``microbench``: one ``loglinear`` proximal computation (``a3po_trl.approximate_proximal_logps`` on a ``(B, T)``
  batch) vs one ``recompute`` forward (the trainer's own no-grad ``_get_per_token_logps_and_entropies``) on the same
  batch, median over repetitions.

It writes ``<out>/<name>.json`` (every run, raw per-step series and summaries, the targets and whether they were
met), ``<out>/<name>.md`` (tables) and ``<out>/<name>.png``. Timings are measured, never asserted. Each finished run
is kept in ``<out>/<name>.runs/`` until the report is whole: an interrupted or partly failed invocation, run again,
runs only what is missing; ``--merge-from`` adds the runs of an earlier report.

While a configuration runs, the CPU time used by *other* processes is measured from ``/proc/stat`` and reported
(``foreign_cpu_frac``); before each configuration the benchmark waits (at most ``--quiet-wait`` seconds) until the
machine is quiet, because on a small shared machine another process taking one core slows a two-thread run many
times over, and a run that other processes disturbed runs again (``--retries``, ``--max-foreign``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common.runner import Cell, RunStore, add_runner_arguments, child_command, run_missing, serve_cells

from .markdown import write_markdown
from .plan import DEFAULT_STALENESS, build_plan, common_settings, config_for, resolve_options, run_settings
from .plot import write_plot
from .report import build_report, check_mergeable, import_previous, ordered_records
from .worker import run_cell

HERE = Path(__file__).resolve().parent
MODULE = "benchmarks.compare"

# The configurations, the runs and the report are in the modules of this package (one per concern, listed in its
# docstring); this one is the command line and ``main``.


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    parser.add_argument(
        "--generation-threads", type=int, default=1, help="CPU: generation_num_threads (0: the library's default)"
    )
    parser.add_argument(
        "--training-threads", type=int, default=1, help="CPU: training_num_threads (0: the library's default)"
    )
    parser.add_argument(
        "--thread-variants",
        default="",
        help="comma list of extra thread settings of the pieces and asynchronous configurations: t<training>[g<gen>] "
        "(t2g2: both at 2 intra-op threads, as configuration loglinear-s1-t2g2; t1: pieces-loglinear-t1)",
    )
    parser.add_argument(
        "--generation-process",
        action="store_true",
        help="also run each asynchronous configuration with generation in a process of its own "
        "(generation_process=True), as <config>-proc (with its thread variants: loglinear-s1-proc-t1g1)",
    )
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
    parser.add_argument("--profile", default="", help="comma list of configuration names to profile (py-spy)")
    parser.add_argument("--py-spy", default=None, help="py-spy executable (default: from PATH)")
    parser.add_argument("--out", default=str(HERE.parent / "results"), help="output directory")
    parser.add_argument("--name", default=None, help="file name stem of the outputs (default compare-<model>)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs under <out>/logs")
    parser.add_argument(
        "--merge-from",
        default=None,
        help="a previous report JSON of the same settings: its runs are merged into this report and not run again "
        "(to add configurations to a report, or to rerun only the runs another process disturbed)",
    )
    add_runner_arguments(parser)
    # quiet wait and reruns: by run mode (quick or full, plan.RUN_DEFAULTS) unless given
    parser.set_defaults(quiet_wait=None, quiet_threshold=0.15, max_foreign=None, retries=1, run_timeout=3600.0)
    return resolve_options(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parse_args(argv)
    if options.run_one:  # a worker subprocess: its cells' configurations, as the plan built them
        import warnings

        warnings.filterwarnings("ignore")
        common = common_settings(options)
        serve_cells(options.run_one, lambda cell: run_cell(config_for(cell.config, cell.seed, options), common))
        return None
    os.makedirs(options.out, exist_ok=True)
    common = common_settings(options)
    plan = build_plan(options)
    if not plan:
        raise SystemExit(f"--configs {options.configs!r} selects no configuration")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    store = RunStore(os.path.join(options.out, options.name + ".runs"))
    store.check_settings(run_settings(options))
    merged_commands = []
    if options.merge_from:  # fail before running anything; its runs are kept like this invocation's, not run again
        with open(options.merge_from) as f:
            previous = json.load(f)
        check_mergeable(previous["meta"], build_report([], options, common, started, started)["meta"])
        merged_commands = import_previous(previous, os.path.basename(options.merge_from), store)
    cells = [Cell(config["name"], config["seed"]) for config in plan]
    missing = len(store.missing(cells))
    print(f"[compare] {missing} runs: model={options.model} device={options.device} steps={options.steps}")
    env = None
    if options.device == "cpu" and options.omp_wait_policy.lower() != "default":
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", options.omp_wait_policy)}
    with tempfile.TemporaryDirectory(prefix="a3po-compare-logs-") as scratch:
        log_dir = os.path.join(options.out, "logs", options.name) if options.keep_logs else scratch
        os.makedirs(log_dir, exist_ok=True)
        failures = run_missing(
            cells,
            store,
            functools.partial(_command, options, argv),
            options,
            label="compare",
            together=options.isolation == "shared",
            env=env,
            log_dir=Path(log_dir),
        )
    records = [_with_profile(record, options) for record in store.records().values()]
    records += [
        {"config": config_for(cell.config, cell.seed, options), "error": why} for cell, why in failures.items()
    ]
    finished = datetime.datetime.now().isoformat(timespec="seconds")
    report = build_report(ordered_records(records), options, common, started, finished)
    if options.merge_from:
        report["meta"]["merged_commands"] = merged_commands
    stem = os.path.join(options.out, options.name)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, stem + ".md")
    write_plot(report, stem + ".png")
    report["files"] = {"json": stem + ".json", "markdown": stem + ".md", "png": stem + ".png"}
    print(f"[compare] wrote {stem}.json, .md, .png", flush=True)
    if store.missing(cells):
        print(f"[compare] {len(store.missing(cells))} runs missing: the same command runs them", flush=True)
    else:  # the report holds every run
        shutil.rmtree(store.directory)
    for error in report["errors"]:
        print(f"[compare] ERROR in {error['run_id']}: {error['error'][:2000]}", flush=True)
    return report


def _profile_path(options, cells: list[Cell]) -> str | None:
    """Where the profile of a launch goes: a run of a ``--profile`` configuration on the first seed, alone."""
    profiled = {name.strip() for name in options.profile.split(",") if name.strip()}
    if len(cells) != 1 or cells[0].config not in profiled or cells[0].seed != options.seed:
        return None
    return os.path.join(options.out, f"{options.name}-profile-{cells[0].config}.txt")


def _command(options, argv: list[str], cells: list[Cell]) -> list[str]:
    """The worker subprocess of ``cells``, under py-spy (or cProfile, without py-spy) when profiled."""
    command = child_command(MODULE, argv, cells)
    path = _profile_path(options, cells)
    if path is None:
        return command
    candidates = [options.py_spy, shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")]
    py_spy = next((c for c in candidates if c and os.path.exists(c)), None)
    if py_spy:
        record = [py_spy, "record", "--threads", "--nonblocking", "--rate", "20", "--format", "raw", "-o", path]
        return [*record, "--", *command]
    print("[compare] py-spy not found: profiling the main thread with cProfile", flush=True)
    return command[:1] + ["-m", "cProfile", "-o", path + ".pstats"] + command[1:]


def _with_profile(record: dict, options) -> dict:
    """``record`` with the file its profile went to, if it was profiled."""
    path = _profile_path(options, [Cell(record["config"]["name"], record["config"]["seed"])])
    if path is None or record.get("reused_from"):
        return record
    return {**record, "profile_file": path if os.path.exists(path) else path + ".pstats"}
