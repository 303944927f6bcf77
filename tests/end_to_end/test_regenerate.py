"""``python -m benchmarks.regenerate``: the committed summaries and tables are what the committed records give."""

import json
import re
import shutil

from benchmarks import regenerate


def test_committed_summaries_equal_what_their_records_regenerate():
    assert regenerate.check() == {}


def test_check_names_a_summary_edited_by_hand_and_regenerate_restores_it(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(regenerate.RESULTS / "staleness" / "confirmation", results / "staleness" / "confirmation")
    (results / "proximal_map").mkdir()
    shutil.copy(regenerate.RESULTS / "proximal_map" / "summary.json", results / "proximal_map")
    assert regenerate.check(results) == {"proximal_map/families.md": "not committed",
                                         "proximal_map/families.json": "not committed"}  # fmt: skip
    made = regenerate.regenerate(results)
    assert set(made) == {"staleness/confirmation/summary.md", "staleness/confirmation/summary.json",
                         "proximal_map/families.md", "proximal_map/families.json"}  # fmt: skip
    assert regenerate.check(results) == {}
    summary = results / "staleness" / "confirmation" / "summary.md"
    committed = summary.read_text()
    # the pre-registered comparison's interval, edited by hand: the check names the file and the interval it gives
    row = next(line for line in committed.splitlines() if "| loglinear - recompute |" in line)
    interval = re.search(r"[-+]\d\.\d{3} \[[-+]\d\.\d{3}, [-+]\d\.\d{3}\]", row).group(0)
    summary.write_text(committed.replace(interval, "+9.999 [+9.000, +9.999]"))
    differences = regenerate.check(results)
    assert list(differences) == ["staleness/confirmation/summary.md"]
    assert interval in differences["staleness/confirmation/summary.md"]
    families = json.loads((results / "proximal_map" / "families.json").read_text())
    cells = families["families"]["loglinear - recompute, final"]
    assert len(cells) == 16 and sum(c["verdict"] == "difference" for c in cells) == 5
    # read back from the summary's intervals, the verdicts are those the committed runs give
    from_runs = json.loads((regenerate.RESULTS / "proximal_map" / "families.json").read_text())
    assert [c["verdict"] for c in cells] == [
        c["verdict"] for c in from_runs["families"]["loglinear - recompute, final"]
    ]
    regenerate.regenerate(results)
    assert summary.read_text() == committed


def test_a_rerun_in_progress_does_not_replace_the_summary_it_reruns(tmp_path):
    """The proximal map is rerun whole: until its 768 runs are all committed, its summary stays the committed one
    (read back), not one made from the part of the rerun that is done."""
    results = tmp_path / "results"
    (results / "proximal_map" / "runs").mkdir(parents=True)
    shutil.copy(regenerate.RESULTS / "proximal_map" / "summary.json", results / "proximal_map")
    committed = (results / "proximal_map" / "summary.json").read_text()
    (results / "proximal_map" / "runs" / "loglinear-s0-k1-lrhi@0.json").write_text("{}")  # one run of 768
    made = regenerate.regenerate(results)
    assert "proximal_map/summary.json" not in made and "proximal_map/families.md" in made
    assert (results / "proximal_map" / "summary.json").read_text() == committed
    assert regenerate.rerun_progress(results / "proximal_map") == "1 of 768 runs"
