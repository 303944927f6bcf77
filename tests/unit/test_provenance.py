"""``benchmarks/common/provenance.py``: every benchmark record says where and when it ran, in one block, written by
one helper; a block that lacks a key, or holds a null it does not declare unrecorded, is refused by name."""

import copy
import importlib.util
import json
import re
import statistics
import time
from pathlib import Path

import pytest

from benchmarks.common import provenance
from benchmarks.common.provenance import HOST_KEYS, KEYS, ROLES, thread_roles, validate

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _retrofit_script():
    spec = importlib.util.spec_from_file_location("retrofit_provenance", ROOT / "scripts" / "retrofit_provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_block_has_every_key_and_records_everything_on_this_machine():
    block = provenance.provenance(time.time(), thread_roles(training=1, generation=1, process=2), 0.0123)
    assert list(block) == list(KEYS)
    assert set(block["host"]) == set(HOST_KEYS) and set(block["threads"]) == set(ROLES)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", block["started"])
    assert re.fullmatch(r"[0-9a-f]{40}", block["commit"]) and isinstance(block["dirty"], bool)
    assert block["host"]["cpu_count"] >= 1 and block["host"]["cpu_model"]
    assert block["threads"] == {"training": 1, "generation": 1, "process": 2} and block["foreign_cpu_frac"] == 0.0123
    assert block["omp_wait_policy"] in {"unset", "PASSIVE", "ACTIVE"} or block["omp_wait_policy"]
    assert block["unrecorded"] == []  # a new record records every key
    json.dumps(block)  # it goes into a JSON record as is


def test_what_a_run_could_not_measure_is_listed_unrecorded_and_a_role_it_lacks_is_not():
    block = provenance.provenance(
        time.time(), thread_roles(process=1), None, commit=(None, None), wait_policy="PASSIVE"
    )
    assert block["unrecorded"] == ["commit", "dirty", "foreign_cpu_frac"]
    assert block["threads"] == {"training": None, "generation": None, "process": 1}
    # a run that reported no threads has them unrecorded, not absent
    assert provenance.provenance(time.time(), None, 0.0)["unrecorded"] == [f"threads.{role}" for role in ROLES]


@pytest.mark.parametrize("key", [*KEYS, "host.cpu_model", "threads.process"])
def test_a_block_without_a_key_is_refused_naming_the_record_and_the_key(key):
    block = provenance.provenance(time.time(), thread_roles(process=1), 0.0)
    outer, _, inner = key.partition(".")
    holder = block[outer] if inner else block
    del holder[inner or outer]
    with pytest.raises(ValueError, match=rf"runs/x@1\.json: the provenance block lacks .*{inner or outer}"):
        validate(block, "runs/x@1.json")


def test_a_null_not_declared_unrecorded_and_a_start_time_not_in_utc_are_refused():
    block = provenance.provenance(time.time(), thread_roles(process=1), 0.0)
    with pytest.raises(ValueError, match="report.json: no provenance block"):
        validate(None, "report.json")
    silent = {**block, "foreign_cpu_frac": None}
    with pytest.raises(ValueError, match="'foreign_cpu_frac' is null but not listed in 'unrecorded'"):
        validate(silent, "report.json")
    assert validate({**silent, "unrecorded": ["foreign_cpu_frac"]}, "report.json")
    with pytest.raises(ValueError, match="'started' '2026-12-07T02:44:49' is not ISO-8601 UTC"):
        validate({**block, "started": "2026-12-07T02:44:49"}, "report.json")
    unknown = {**block, "started": None, "unrecorded": ["started"]}
    with pytest.raises(ValueError, match="no 'started' and no 'recorded_in_commit'"):
        validate(unknown, "report.json")
    assert validate({**unknown, "recorded_in_commit": "a" * 40, "committed_at": "2026-12-01T00:00:00+00:00"}, "r")


def test_every_committed_record_carries_a_valid_block():
    files = provenance.check_records(RESULTS)
    assert len(files) > 1000  # the studies' runs and every report
    names = {str(path.relative_to(RESULTS)) for path in files}
    for report in ("compiled-decode.json", "demo-smollm2.json", "timeline_overhead.json", "compare-smollm2.json"):
        assert report in names


def test_a_retrofitted_record_lists_what_it_never_recorded():
    # time to accuracy's first records held only their load average: everything else is unrecorded
    record = json.loads((RESULTS / "time-to-accuracy" / "runs" / "trl@42.json").read_text())
    block = validate(record["provenance"], "trl@42")
    assert {"started", "commit", "foreign_cpu_frac", "host.cpu_model", "threads.process", "omp_wait_policy"} <= set(
        block["unrecorded"]
    )
    assert block["started"] is None and block["foreign_cpu_frac"] is None
    assert "threads.training" not in block["unrecorded"]  # GRPOTrainer has no training thread of its own
    assert re.fullmatch(r"[0-9a-f]{40}", block["recorded_in_commit"]) and block["committed_at"].startswith("2026-")
    # the retrofit takes what a runner's record holds, names where from, and lists the rest
    script = _retrofit_script()
    old = {k: v for k, v in json.loads((RESULTS / "guard/smollm2/runs/guarded-s4-k4@42.json").read_text()).items()}
    del old["provenance"]
    block = script._block(*script.run_values(old, Path("guarded-s4-k4@42.json")))
    assert block["started"] == old["started_at"].replace(" ", "T") + "Z" and block["commit"] == old["git_commit"]
    assert block["foreign_cpu_frac"] == old["foreign_cpu_frac_run"] and block["host"] == old["machine"]
    assert block["unrecorded"] == ["omp_wait_policy"] and block["sources"]["threads.process"].startswith("torch_")
    bare = script._block(*script.run_values({"config": "loglinear-s1", "seed": 1}, Path("loglinear-s1@1.json")))
    assert bare["unrecorded"] == provenance._names(bare)  # nothing held, nothing invented


def test_the_compiled_decode_writer_keeps_each_repetition_and_its_provenance(tmp_path, monkeypatch):
    from benchmarks import compiled_decode

    def eager_only(tokenizer, new_tokens, device, real=compiled_decode.configs):
        eager = real(tokenizer, new_tokens, device)["eager"]  # no compilation: the test's seconds
        return {"eager": eager, "static": copy.deepcopy(eager), "compiled": copy.deepcopy(eager)}

    monkeypatch.setattr(compiled_decode, "configs", eager_only)
    compiled_decode.main(
        ["--models", "tiny", "--reps", "3", "--rows", "2", "--new-tokens", "3", "--out", str(tmp_path)]
    )
    report = json.loads((tmp_path / "compiled-decode.json").read_text())
    for path in report["results"]["tiny"]["paths"].values():
        for figures in (path["cpu_per_token"], path["wall_per_token"]):
            assert len(figures["all"]) == 3 and figures["median"] == statistics.median(figures["all"])
            assert figures["min"] == min(figures["all"]) and figures["max"] == max(figures["all"])
    block = validate(report["provenance"], "compiled-decode.json")
    assert block["threads"] == {"training": None, "generation": None, "process": 1} and block["unrecorded"] == []


def test_a_compare_reports_block_has_the_counts_train_chose_where_the_options_left_them_to_the_library():
    """``--generation-threads 0 --training-threads 0``: the report's block says what the asynchronous runs at those
    options recorded (not 0), and that it does not know where they disagree."""
    from benchmarks.compare.report import report_provenance

    def run(name, kind, training, generation):
        block = provenance.provenance(0.0, thread_roles(training, generation, 2), 0.0, commit=("abc", False))
        return {"name": name, "kind": kind, "foreign_cpu_frac": 0.0, "provenance": block}

    meta = {"threads": {"a3po_training": 0, "a3po_generation": 0, "trl": 2}}
    runs = [run("trl", "trl", None, None), run("loglinear-s1", "a3po", 1, 1), run("loglinear-s1-t2g2", "a3po", 2, 2)]
    block = report_provenance("2026-12-07T03:39:08", runs, meta, {})
    assert block["threads"] == {"training": 1, "generation": 1, "process": 2}
    runs.append(run("recompute-s1", "a3po", 2, 2))
    block = report_provenance("2026-12-07T03:39:08", runs, meta, {})
    assert block["threads"]["training"] is None and {"threads.training", "threads.generation"} <= set(
        block["unrecorded"]
    )
    meta["threads"].update(a3po_training=1, a3po_generation=1)  # counts the options set are as set
    assert report_provenance("2026-12-07T03:39:08", runs, meta, {})["threads"]["training"] == 1
