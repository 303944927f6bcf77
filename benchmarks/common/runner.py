"""The one resumable configuration x seed runner of the benchmark studies.

A study is a grid of cells, configuration x seed (:class:`Cell`, named ``<configuration>@<seed>``); each cell is one
run in a fresh subprocess, kept as one JSON file. Running a study again skips the cells already kept, so a study of
hundreds of runs is made in as many sittings as it takes, ``--max-runs`` at a time. The protocol, whole:

- launch: the study's own command line is run again as ``python -m <module> <its arguments> --run-one <cells>``
  (:func:`child_command`, :func:`child_environment`), one cell per subprocess (or, for fast tests, all cells in one),
  one subprocess at a time, after waiting at most ``--quiet-wait`` seconds for a quiet machine;
- report: the subprocess runs its cells (:func:`serve_cells`) and prints the record of each (a JSON-able dict) as one
  stdout line ``A3PO_RESULT {"cell": ..., "record": ...}``; everything else it prints passes through (or into a log);
- store: the runner adds to each record how the machine was during the run (:data:`RUN_FIELDS`) and writes it to
  ``<runs>/<configuration>@<seed>.json`` (:class:`RunStore`, whole or not at all); a run during which other
  processes took more than ``--max-foreign`` of the machine runs again (``--retries``);
- resume: a cell with a file is done; a cell whose subprocess reported nothing is a failure, kept nowhere, and runs
  again next time.

What a study provides: its command line (:func:`study_parser`: its configurations, seeds and output folder, the
runner's options, then its own), and to :func:`run_study` its cells (:func:`plan`), the function that runs one cell
inside the subprocess and returns its record, and a summary that reads the records back (``RunStore.records``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .machine import LoadMeter, load_average, machine_info, wait_for_quiet
from .provenance import git_head, provenance

#: The repository root: what the subprocesses find ``benchmarks`` (and ``a3po_trl``) in.
ROOT = Path(__file__).resolve().parents[2]
#: The start of the stdout line that carries a cell's record from the subprocess.
RESULT_PREFIX = "A3PO_RESULT "
#: What the runner adds to every record (a study's record must not use these names for anything else).
RUN_FIELDS = {
    "started_at": "UTC time the subprocess was started, 'YYYY-MM-DD HH:MM'",
    "quiet_wait_seconds": "seconds waited for a quiet machine before it",
    "foreign_cpu_frac_before": "other processes' share of all cores when the waiting ended (None: no wait)",
    "load_average_start": "the 1-, 5- and 15-minute load averages when it started",
    "load_average_end": "the same when it ended",
    "run_seconds": "wall-clock seconds of the subprocess",
    "foreign_cpu_frac_run": "other processes' share of all cores while it ran (its own CPU left out)",
    "machine": "platform, cores, CPU model and memory of the machine",
    "discarded_attempts": "earlier attempts run again because the machine was busy (their load and seconds)",
    "git_commit": "the repository's commit when it ran, '-dirty' appended where tracked files differed from it",
    "command": "the command that ran it (the study's module, its arguments and the cell)",
    "provenance": "where and when it ran (benchmarks/common/provenance.py): from these fields and the threads and "
    "OMP_WAIT_POLICY the run reported as its own 'provenance' (provenance.run_settings)",
}


@dataclass(frozen=True, order=True)
class Cell:
    """One run of a study: a configuration on a seed."""

    config: str
    seed: int

    def __str__(self) -> str:
        return f"{self.config}@{self.seed}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        """``"loglinear-s4@42"`` -> ``Cell("loglinear-s4", 42)``."""
        config, _, seed = name.rpartition("@")
        if not config or not seed.lstrip("-").isdigit():
            raise ValueError(f"{name!r} is not <configuration>@<seed>")
        return cls(config, int(seed))


def plan(configs: Iterable[str], seeds: Iterable[int], by_seed: bool = True) -> list[Cell]:
    """Every configuration on every seed, in the order they run: seed by seed (an unfinished study then holds whole
    seeds of every configuration), or with ``by_seed=False`` configuration by configuration."""
    configs, seeds = list(configs), list(seeds)
    if by_seed:
        return [Cell(config, seed) for seed in seeds for config in configs]
    return [Cell(config, seed) for config in configs for seed in seeds]


class RunStore:
    """The finished runs of a study: one JSON file per cell, ``<directory>/<configuration>@<seed>.json``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, cell: Cell) -> Path:
        return self.directory / f"{cell}.json"

    def __contains__(self, cell: Cell) -> bool:
        return self.path(cell).exists()

    def missing(self, cells: Iterable[Cell]) -> list[Cell]:
        return [cell for cell in cells if cell not in self]

    def save(self, cell: Cell, record: dict) -> None:
        """Write ``record`` whole or not at all: a run interrupted while being saved is not taken for finished."""
        self.directory.mkdir(parents=True, exist_ok=True)
        unfinished = self.path(cell).with_suffix(".json.partial")
        unfinished.write_text(json.dumps(record) + "\n")
        unfinished.replace(self.path(cell))

    def load(self, cell: Cell) -> dict:
        return json.loads(self.path(cell).read_text())

    def records(self) -> dict[Cell, dict]:
        """Every finished run, by cell, in the order of the file names."""
        paths = sorted(self.directory.glob("*@*.json"))
        return {Cell.parse(path.stem): json.loads(path.read_text()) for path in paths}

    def check_settings(self, settings: dict) -> None:
        """Refuse to mix runs made with different settings: the first call keeps ``settings`` beside the runs
        (``settings.json``), every later one must pass the same."""
        path = self.directory / "settings.json"
        settings = json.loads(json.dumps(settings))  # as it reads back: tuples are lists
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
            return
        kept = json.loads(path.read_text())
        different = sorted(key for key in kept.keys() | settings.keys() if kept.get(key) != settings.get(key))
        if different:
            raise SystemExit(
                f"{self.directory} holds runs made with other settings ({', '.join(different)} differ): use the same "
                "settings, another output, or remove it"
            )


def study_parser(
    description: str, *, configs: Iterable[str], seeds: Iterable[int], out: Path
) -> argparse.ArgumentParser:
    """A study's command line: ``--configs`` and ``--seeds`` (comma lists, read as lists) with their defaults,
    ``--out`` (the folder of ``runs/`` and the summary) and the runner's options; the study adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=_comma_list, default=list(configs), help="comma list of configurations")
    seed_list = functools.partial(_comma_list, convert=int)
    parser.add_argument("--seeds", type=seed_list, default=list(seeds), help="comma list of seeds")
    parser.add_argument("--out", default=str(out), help="folder of the runs (runs/, a JSON file each) and the summary")
    parser.add_argument("--summary-only", "--summary", action="store_true", help="run nothing, only the summary")
    add_runner_arguments(parser)
    return parser


def _comma_list(text: str, convert: Callable = str) -> list:
    return [convert(item) for item in text.split(",") if item]


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options, the same in every study (a study changes a default with ``parser.set_defaults``)."""
    group = parser.add_argument_group("runs")
    group.add_argument("--max-runs", type=int, default=None, help="run at most this many of the missing runs now")
    group.add_argument(
        "--quiet-wait", type=float, default=0.0, help="seconds to wait at most, before each run, for a quiet machine"
    )
    group.add_argument(
        "--quiet-threshold", type=float, default=0.1, help="other processes' share of the machine that counts as quiet"
    )
    group.add_argument(
        "--retries",
        type=int,
        default=0,
        help="times a run is run again when other processes used more than --max-foreign of the machine during it",
    )
    group.add_argument(
        "--max-foreign", type=float, default=1.0, help="other processes' share of the machine a run may see"
    )
    group.add_argument("--budget-minutes", type=float, default=None, help="no more reruns once this much has passed")
    group.add_argument("--run-timeout", type=float, default=None, help="seconds before a run is stopped as failed")
    group.add_argument(
        "--cells-per-launch",
        type=int,
        default=1,
        help="runs per subprocess (short runs: the interpreter and library start once for several; each run still "
        "sets every seed itself, and shares its launch's load record)",
    )
    group.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # the subprocess's cells (comma list)


def run_study(
    argv: list[str],
    options: argparse.Namespace,
    *,
    module: str,
    cells: list[Cell],
    run: Callable[[Cell], dict],
    summarize: Callable[[RunStore], str],
) -> None:
    """A study's ``main`` once its command line ``argv`` is parsed into ``options``. In the subprocess (``--run-one``):
    ``run`` each of its cells. Otherwise: run the ``cells`` missing from ``<options.out>/runs`` (but with
    ``--summary-only``), print ``summarize(store)``, and exit with an error naming the runs that failed, if any. The
    subprocesses are ``python -m <module> <argv>``."""
    store = RunStore(Path(options.out) / "runs")
    if options.run_one:
        serve_cells(options.run_one, run)
        return
    Path(options.out).mkdir(parents=True, exist_ok=True)
    failures = {}
    if not options.summary_only:
        label = module.rpartition(".")[2]
        command = functools.partial(child_command, module, argv)
        failures = run_missing(cells, store, command, options, label=label)
    print(summarize(store))
    if failures:
        raise SystemExit(f"{len(failures)} runs failed: {', '.join(map(str, failures))}; their output is above")


def child_command(module: str, argv: list[str], cells: list[Cell]) -> list[str]:
    """The subprocess that runs ``cells``: the study's module on the study's own arguments, plus its cells."""
    return [sys.executable, "-m", module, *argv, "--run-one", ",".join(map(str, cells))]


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with the repository on ``PYTHONPATH``, offline, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return {**env, **(extra or {})}


def serve_cells(cells: str, run: Callable[[Cell], dict]) -> None:
    """The subprocess's side: run each cell of ``cells`` (``--run-one``'s comma list) and report its record. A cell
    that raises prints its traceback, the next cell still runs, and the subprocess then exits with status 1."""
    failed = False
    for cell in map(Cell.parse, cells.split(",")):
        try:
            record = run(cell)
        except Exception:  # noqa: BLE001 - reported by its absence; the other cells still run
            traceback.print_exc()
            failed = True
            continue
        print(RESULT_PREFIX + json.dumps({"cell": str(cell), "record": record}), flush=True)
    if failed:
        raise SystemExit(1)


def run_missing(
    cells: list[Cell],
    store: RunStore,
    command: Callable[[list[Cell]], list[str]],
    options: argparse.Namespace,
    *,
    label: str,
    together: bool = False,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> dict[Cell, str]:
    """Run the ``cells`` that ``store`` lacks (at most ``options.max_runs``), in order, one subprocess each (or
    ``options.cells_per_launch`` in each; with ``together``, all in one), and keep each record. ``options`` holds
    :func:`add_runner_arguments`' values;
    ``command`` gives the subprocess of some cells (e.g. ``functools.partial(child_command, module, argv)``); with
    ``log_dir`` the subprocesses' output goes to ``<log_dir>/<first cell>.log`` rather than to this process's.
    Returns the failures: the cells that were run and reported nothing, with why."""
    todo = store.missing(cells)[: options.max_runs]
    size = len(todo) if together else max(1, getattr(options, "cells_per_launch", 1))
    launches = [todo[start : start + size] for start in range(0, len(todo), size)]
    began, failures = time.perf_counter(), {}
    for index, launch in enumerate(launches, 1):
        names = ",".join(map(str, launch))
        discarded = []
        for attempt in range(options.retries + 1):
            print(f"[{label}] {names} ({index} of {len(launches)} now, attempt {attempt + 1}) ...", flush=True)
            log_path = None if log_dir is None else Path(log_dir) / f"{launch[0]}.log"
            records, error, fields = _launch(command(launch), child_environment(env), options, log_path)
            launched = fields.pop("_started"), fields.pop("_commit")  # the provenance block's, kept apart
            foreign = fields["foreign_cpu_frac_run"]
            budget = options.budget_minutes
            over_budget = budget is not None and time.perf_counter() - began > 60 * budget
            if foreign is None or foreign <= options.max_foreign or attempt == options.retries or over_budget:
                break
            print(f"[{label}] {names}: other processes used {foreign:.0%} of the machine, again", flush=True)
            discarded.append({"foreign_cpu_frac_run": foreign, "run_seconds": fields["run_seconds"]})
        for cell in launch:
            if cell in records:
                record = {**records[cell], **fields, "discarded_attempts": discarded}
                record["provenance"] = _block(records[cell].get("provenance"), fields, *launched)
                store.save(cell, record)
                print(f"[{label}] {cell} done in {fields['run_seconds'] / 60:.1f} min", flush=True)
            else:
                failures[cell] = error or "the subprocess reported no record for it"
                print(f"[{label}] {cell} FAILED: {failures[cell].splitlines()[0]}", flush=True)
    return failures


def _launch(command, env, options, log_path: Path | None) -> tuple[dict[Cell, dict], str | None, dict]:
    """Run one subprocess: its records by cell, why some are missing (None when it exited cleanly), and the run
    fields (:data:`RUN_FIELDS`, but the discarded attempts)."""
    quiet = wait_for_quiet(options.quiet_wait, options.quiet_threshold)
    started = time.time()
    fields = {"started_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)), **quiet}
    commit = git_head(ROOT)  # the record's git_commit: '-dirty' appended where tracked files differed
    fields["git_commit"] = None if commit[0] is None else commit[0] + ("-dirty" if commit[1] else "")
    fields["command"] = shlex.join(["python", *command[1:]])
    fields["load_average_start"] = load_average()
    meter, began = LoadMeter(children=True).start(), time.perf_counter()
    log = open(log_path, "w") if log_path is not None else None
    records, tail = {}, collections.deque(maxlen=40)
    # its own session, so that a timeout stops its children too (py-spy's, accelerate's); stopped with this one
    child = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if log else None,
        text=True,
        start_new_session=True,
    )
    timed_out = threading.Event()
    timer = threading.Timer(options.run_timeout or 0, lambda: (timed_out.set(), _stop(child)))
    try:
        if options.run_timeout:
            timer.start()
        for line in child.stdout:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line.removeprefix(RESULT_PREFIX))
                records[Cell.parse(result["cell"])] = result["record"]
                continue
            tail.append(line)
            _echo(line, log)
        status = child.wait()
    finally:
        timer.cancel()
        _stop(child)
        if log:
            log.close()
    fields.update(
        run_seconds=round(time.perf_counter() - began, 2),
        load_average_end=load_average(),
        foreign_cpu_frac_run=meter.stop()["foreign_cpu_frac"],
        machine=machine_info(),
    )
    fields["_started"], fields["_commit"] = started, commit
    error = None
    if status != 0:
        why = f"timed out after {options.run_timeout} s" if timed_out.is_set() else f"exited with status {status}"
        where = f"log {log_path}" if log_path else "stderr above"
        error = f"the subprocess {why}; the end of its output ({where}):\n{''.join(tail)}"
    return records, error, fields


def _block(reported: dict | None, fields: dict, started: float, commit: tuple) -> dict:
    """A run's provenance block: the launch's ``started`` time and ``commit``, its machine and foreign CPU
    (``fields``), and the threads and ``OMP_WAIT_POLICY`` the run ``reported``
    (:func:`~benchmarks.common.provenance.run_settings`; a run that reported none has its threads unrecorded)."""
    reported = reported or {}
    return provenance(
        started,
        reported.get("threads"),
        fields["foreign_cpu_frac_run"],
        wait_policy=reported.get("omp_wait_policy"),
        commit=commit,
        host=fields["machine"],
    )


def _echo(line: str, log: IO[str] | None) -> None:
    (log or sys.stdout).write(line)
    (log or sys.stdout).flush()


def _stop(child: subprocess.Popen) -> None:
    """End ``child`` and its process group, if still running."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
