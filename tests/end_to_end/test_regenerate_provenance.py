"""``python -m benchmarks.regenerate`` regenerates nothing from a record that does not say where and when it ran."""

import json
import shutil

import pytest

from benchmarks import regenerate


def test_regenerate_refuses_a_record_without_its_provenance_naming_the_file_and_the_key(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(regenerate.RESULTS / "approximation", results / "approximation")
    runs = sorted((results / "approximation" / "runs").glob("*@*.json"))
    summary = (results / "approximation" / "summary.json").read_text()
    without, partial = (json.loads(path.read_text()) for path in runs[:2])
    del without["provenance"]
    runs[0].write_text(json.dumps(without) + "\n")
    del partial["provenance"]["foreign_cpu_frac"]
    runs[1].write_text(json.dumps(partial) + "\n")
    with pytest.raises(ValueError) as refused:
        regenerate.regenerate(results, documents=())
    message = str(refused.value)
    assert message.startswith("2 records without a valid provenance block")
    assert f"approximation/runs/{runs[0].name} (provenance): no provenance block" in message
    assert f"approximation/runs/{runs[1].name} (provenance): the provenance block lacks 'foreign_cpu_frac'" in message
    assert (results / "approximation" / "summary.json").read_text() == summary  # nothing regenerated


def test_regenerate_refuses_a_compare_run_without_its_block(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    report = json.loads((regenerate.RESULTS / "compare-smollm2-genlogps.json").read_text())
    del report["runs"][1]["provenance"]
    (results / "compare-smollm2-genlogps.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"compare-smollm2-genlogps.json \(runs\[1\].provenance\): no provenance"):
        regenerate.regenerate(results, documents=())
