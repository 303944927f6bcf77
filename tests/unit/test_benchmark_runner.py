"""``benchmarks/common/runner.py``, the benchmarks' one configuration x seed runner: what it runs, skips, keeps and
records, with a stand-in study whose subprocess takes a fraction of a second (its cells say how it behaves)."""

import argparse
import json
import sys

import pytest

from benchmarks.common.provenance import validate
from benchmarks.common.runner import RUN_FIELDS, Cell, RunStore, add_runner_arguments, plan, run_missing

#: The stand-in study's subprocess: a cell ``ok`` reports its seed and process id, ``raise`` raises, ``silent`` exits
#: without a word, ``hang`` sleeps, ``threads`` reports the threads it set.
CHILD = """
import os, sys, time
from benchmarks.common.runner import serve_cells

def run(cell):
    print("working on", cell, flush=True)
    if cell.config == "raise":
        raise RuntimeError("this cell breaks")
    if cell.config == "silent":
        os._exit(3)
    if cell.config == "hang":
        time.sleep(60)
    if cell.config == "threads":  # a study's run reports the threads it set, for its provenance block
        from benchmarks.common.provenance import run_settings, thread_roles

        return {"provenance": run_settings(thread_roles(training=1, generation=1, process=2))}
    return {"seed_twice": 2 * cell.seed, "pid": os.getpid()}

serve_cells(sys.argv[1], run)
"""


def options(*argv):
    parser = argparse.ArgumentParser()
    add_runner_arguments(parser)
    return parser.parse_args(list(argv))


class Study:
    """The stand-in study's command: counts the subprocesses and the cells each was given."""

    def __init__(self):
        self.launches = []

    def __call__(self, cells):
        self.launches.append([str(cell) for cell in cells])
        return [sys.executable, "-c", CHILD, ",".join(map(str, cells))]


def run(cells, store, *argv, together=False):
    study = Study()
    failures = run_missing(cells, store, study, options(*argv), label="test", together=together)
    return study.launches, failures


def test_the_plan_goes_seed_by_seed_or_configuration_by_configuration():
    assert [str(c) for c in plan(["a", "b"], [1, 2])] == ["a@1", "b@1", "a@2", "b@2"]
    assert [str(c) for c in plan(["a", "b"], [1, 2], by_seed=False)] == ["a@1", "a@2", "b@1", "b@2"]
    assert Cell.parse("loglinear-s4@42") == Cell("loglinear-s4", 42) and str(Cell("x@y", 3)) == "x@y@3"
    for bad in ("trl", "trl@", "@3", "trl@seed0"):
        with pytest.raises(ValueError):
            Cell.parse(bad)


def test_runs_each_missing_cell_in_its_own_subprocess_and_keeps_its_record_with_the_machine_load(tmp_path):
    store = RunStore(tmp_path / "runs")
    cells = plan(["ok"], [1, 2])
    launches, failures = run(cells, store)
    assert failures == {} and launches == [["ok@1"], ["ok@2"]]
    records = store.records()
    assert list(records) == cells
    assert [r["seed_twice"] for r in records.values()] == [2, 4]
    assert records[cells[0]]["pid"] != records[cells[1]]["pid"]  # a fresh process each
    for record in records.values():
        assert set(RUN_FIELDS) <= set(record)
        assert record["run_seconds"] > 0 and record["quiet_wait_seconds"] >= 0
        assert 0 <= record["foreign_cpu_frac_run"] <= 1 and len(record["load_average_start"]) == 3
        assert record["machine"]["cpu_count"] >= 1 and record["discarded_attempts"] == []
        assert len(record["git_commit"].removesuffix("-dirty")) == 40  # the commit it ran at
        command = record["command"]
        assert command.startswith("python -c ") and command.endswith(f" ok@{record['seed_twice'] // 2}")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ok@1.json", "ok@2.json"]  # nothing half-made


def test_every_record_gets_its_provenance_block_with_the_threads_its_run_reported(tmp_path):
    store = RunStore(tmp_path / "runs")
    ok, threads = Cell("ok", 1), Cell("threads", 1)
    assert run([ok, threads], store)[1] == {}
    reported = validate(store.load(threads)["provenance"], "threads@1")
    assert reported["threads"] == {"training": 1, "generation": 1, "process": 2} and reported["unrecorded"] == []
    record = store.load(ok)
    block = validate(record["provenance"], "ok@1")
    assert block["started"].startswith(record["started_at"].replace(" ", "T"))
    assert block["commit"] == record["git_commit"].removesuffix("-dirty") and block["host"] == record["machine"]
    assert block["foreign_cpu_frac"] == record["foreign_cpu_frac_run"] and block["omp_wait_policy"]
    # a run that reported no threads has them unrecorded, not taken for absent
    assert block["unrecorded"] == ["threads.training", "threads.generation", "threads.process"]


def test_resumes_runs_only_what_is_missing_and_at_most_max_runs(tmp_path):
    store = RunStore(tmp_path / "runs")
    cells = plan(["ok"], [1, 2, 3])
    launches, _ = run(cells, store, "--max-runs", "2")
    assert launches == [["ok@1"], ["ok@2"]] and store.missing(cells) == [Cell("ok", 3)]
    first = store.path(cells[0]).read_text()
    launches, _ = run(cells, store)
    assert launches == [["ok@3"]] and store.missing(cells) == []
    assert store.path(cells[0]).read_text() == first  # a finished run is never run or written again
    launches, failures = run(cells, store)
    assert launches == [] and failures == {}


def test_a_cell_that_fails_is_kept_nowhere_the_others_are_and_it_runs_again_next_time(tmp_path):
    store = RunStore(tmp_path / "runs")
    cells = [Cell("ok", 1), Cell("raise", 1), Cell("ok", 2)]
    launches, failures = run(cells, store, together=True)  # one subprocess: the cell after the broken one still runs
    assert launches == [["ok@1", "raise@1", "ok@2"]]
    assert list(failures) == [Cell("raise", 1)] and "exited with status 1" in failures[Cell("raise", 1)]
    assert store.missing(cells) == [Cell("raise", 1)]
    launches, _ = run(cells, store)
    assert launches == [["raise@1"]]


def test_a_silent_subprocess_and_a_hanging_one_are_failures_with_the_end_of_their_output(tmp_path):
    store = RunStore(tmp_path / "runs")
    _, failures = run([Cell("silent", 1)], store)
    why = failures[Cell("silent", 1)]
    assert "exited with status 3" in why and "working on silent@1" in why
    _, failures = run([Cell("hang", 1)], store, "--run-timeout", "1.5")
    assert "timed out after 1.5 s" in failures[Cell("hang", 1)]
    assert store.records() == {}


def test_a_run_on_a_busy_machine_runs_again_up_to_retries_and_within_the_budget(tmp_path):
    store = RunStore(tmp_path / "runs")
    # a negative bound: every attempt counts as disturbed
    launches, _ = run([Cell("ok", 1)], store, "--retries", "2", "--max-foreign", "-1")
    assert len(launches) == 3
    discarded = store.load(Cell("ok", 1))["discarded_attempts"]
    assert len(discarded) == 2 and all(a["run_seconds"] > 0 for a in discarded)
    launches, _ = run([Cell("ok", 2)], store, "--retries", "2", "--max-foreign", "-1", "--budget-minutes", "0")
    assert len(launches) == 1 and store.load(Cell("ok", 2))["discarded_attempts"] == []


def test_the_subprocesses_output_goes_to_a_log_per_launch_when_asked(tmp_path, capsys):
    store = RunStore(tmp_path / "runs")
    run_missing([Cell("ok", 1)], store, Study(), options(), label="test", log_dir=tmp_path)
    assert "working on ok@1" in (tmp_path / "ok@1.log").read_text()
    assert "working on" not in capsys.readouterr().out


def test_a_store_refuses_runs_of_other_settings(tmp_path):
    store = RunStore(tmp_path / "runs")
    store.check_settings({"steps": 4, "shape": (8, 16)})
    store.check_settings({"steps": 4, "shape": [8, 16]})
    with pytest.raises(SystemExit, match="steps differ"):
        store.check_settings({"steps": 5, "shape": [8, 16]})
    store.save(Cell("ok", 1), {"a": 1})
    assert list(store.records()) == [Cell("ok", 1)]  # settings.json is not a run
    assert json.loads(store.path(Cell("ok", 1)).read_text()) == {"a": 1}


def test_every_study_shares_the_runner_options():
    parsed = options()
    assert (parsed.max_runs, parsed.quiet_wait, parsed.retries, parsed.run_one) == (None, 0.0, 0, None)
    with pytest.raises(SystemExit):
        options("--max-runs", "two")
