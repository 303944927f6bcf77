"""``python -m benchmarks.regenerate``: the committed summaries and tables are what the committed records give, and
the marked blocks of README.md, docs/BENCHMARKS.md and docs/USAGE.md are what the summaries give."""

import json
import math
import re
import shutil

import pytest

from benchmarks import doc_blocks, regenerate
from benchmarks.common.equivalence import json_differences


def test_committed_summaries_and_documents_equal_what_their_records_regenerate():
    assert regenerate.check() == {}
    # every document has its blocks, and every block has a generator
    readme, benchmarks_page, usage = (document.read_text() for document in regenerate.DOCUMENTS)
    assert doc_blocks.blocks_in(readme) == ["readme-what-you-get"]
    assert {"step-time", "time-to-accuracy", "proximal-map-families", "confirmation", "in-flight"} <= set(
        doc_blocks.blocks_in(benchmarks_page)
    )
    assert doc_blocks.blocks_in(usage) == ["usage-when-to-turn-on"]
    assert set(doc_blocks.GENERATORS) == set(doc_blocks.blocks_in(readme + benchmarks_page + usage))


def test_check_names_a_number_edited_by_hand_in_the_readme_and_regenerate_restores_it(tmp_path):
    readme = tmp_path / "README.md"
    committed = regenerate.DOCUMENTS[0].read_text()
    readme.write_text(committed)
    assert regenerate.check(documents=[readme]) == {}
    # the demo configuration's interval over seeds, copied by hand with another upper end
    block = committed[committed.index("<!-- regenerate:readme-what-you-get -->") :]
    interval = re.search(r"geometric mean (\d\.\d\dx \[\d\.\d\d, \d\.\d\d\])", block).group(1)
    readme.write_text(committed.replace(interval, interval[:-5] + "1.28]"))
    differences = regenerate.check(documents=[readme])
    assert list(differences) == ["README.md"] and interval in differences["README.md"]
    # text outside the blocks is the document's own: an edit there is kept, the block is restored
    readme.write_text(readme.read_text().replace("## Usage", "## Usage, edited"))
    regenerate.write_documents(regenerate.RESULTS, [readme])
    assert readme.read_text() == committed.replace("## Usage", "## Usage, edited")


#: A float written with all its digits (as json.dumps writes one): host noise moves its last ones.
FULL_FLOAT = re.compile(r"-?\d+\.\d{12,}(?:e[-+]?\d+)?")


def _with_host_noise(text: str) -> str:
    """``text`` with every full-precision float moved by three units in its last place, as another host's BLAS and
    CPU features move them."""
    return FULL_FLOAT.sub(lambda m: repr(math.nextafter(math.nextafter(math.nextafter(float(m[0]), 1), 1), 1)), text)


def _one_unit_in_the_last_digit(text: str, number: str) -> str:
    """``text`` with ``number`` (as shown) one unit higher in its last digit: a value on a rounding boundary that
    another host rounds the other way."""
    decimals = len(number.partition(".")[2])
    return text.replace(number, f"{float(number) + 10.0**-decimals:.{decimals}f}", 1)


def test_host_noise_in_the_committed_summaries_cannot_fail_the_check(tmp_path):
    """The suite passes on a machine that did not write the summaries: summaries (and the documents' blocks written
    from them) as a host with other rounding wrote them, every full-precision number moved in its last bits and a
    shown digit rounded the other way, pass the check here."""
    results = tmp_path / "results"
    shutil.copytree(regenerate.RESULTS, results, ignore=shutil.ignore_patterns("work", "*.png"))
    perturbed = 0
    for summary in [*results.rglob("summary.json"), *results.rglob("families.json")]:
        noisy = _with_host_noise(summary.read_text())
        perturbed += noisy != summary.read_text()
        summary.write_text(noisy)
    assert perturbed >= 8
    oracle_md = results / "oracle" / "summary.md"
    oracle_md.write_text(_one_unit_in_the_last_digit(oracle_md.read_text(), "0.0861"))
    documents = []
    for document in regenerate.DOCUMENTS:
        documents.append(tmp_path / "documents" / document.name)
        documents[-1].parent.mkdir(exist_ok=True)
        shutil.copy(document, documents[-1])
    regenerate.write_documents(results, documents)  # the other host wrote its documents from its summaries
    assert "| k4-lrhi | 42 | 2200 | 0.0862 |" in documents[1].read_text()
    assert regenerate.check(results, documents) == {}


def test_a_summary_number_edited_in_its_third_digit_is_named_and_host_noise_rewrites_nothing(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(regenerate.RESULTS / "oracle", results / "oracle", ignore=shutil.ignore_patterns("*.png"))
    summary, table = results / "oracle" / "summary.json", results / "oracle" / "summary.md"
    committed_summary, committed_table = summary.read_text(), table.read_text()
    # regenerating with host noise in the committed numbers rewrites neither file
    summary.write_text(_with_host_noise(committed_summary))
    table.write_text(_one_unit_in_the_last_digit(committed_table, "0.0861"))
    noisy_summary, noisy_table = summary.read_text(), table.read_text()
    assert noisy_summary != committed_summary and noisy_table != committed_table
    regenerate.regenerate(results, documents=())
    assert (summary.read_text(), table.read_text()) == (noisy_summary, noisy_table)
    # this host's own summary (nothing committed to keep): no host noise, so a shown digit one unit off is an edit
    summary.unlink()
    table.unlink()
    regenerate.regenerate(results, documents=())
    own_summary = summary.read_text()
    assert json_differences(committed_summary, own_summary) == []  # equivalent, whatever its last bits here
    table.write_text(_one_unit_in_the_last_digit(committed_table, "0.0861"))
    assert list(regenerate.check(results, documents=())) == ["oracle/summary.md"]
    assert "number 0.0862 (regenerated 0.0861)" in regenerate.check(results, documents=())["oracle/summary.md"]
    # the interval's upper end edited in its third significant digit: named with its place in the summary
    table.write_text(committed_table)
    edited = re.sub(r"0\.0705(39099674357\d+)", r"0.0706\1", own_summary)
    summary.write_text(edited)
    differences = regenerate.check(results, documents=())
    assert list(differences) == ["oracle/summary.json"]
    assert differences["oracle/summary.json"].startswith(
        "$.configurations.k4-lrhi.reduction.probability.interval[1]: committed 0.07063909967435"
    )
    assert " regenerated 0.0705390996743" in differences["oracle/summary.json"]
    regenerate.regenerate(results, documents=())
    assert summary.read_text() == own_summary
    assert regenerate.check(results, documents=()) == {}


def test_a_block_without_a_generator_or_an_end_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="block 'readme-speed' has no generator"):
        doc_blocks.rewrite("<!-- regenerate:readme-speed -->\n<!-- /regenerate:readme-speed -->\n", tmp_path)
    with pytest.raises(ValueError, match="block 'in-flight' .* has no <!-- /regenerate:in-flight -->"):
        doc_blocks.rewrite("<!-- regenerate:in-flight -->\n| a table |\n", tmp_path)
    with pytest.raises(FileNotFoundError, match="in-flight/summary.json is missing"):  # no summaries under tmp_path
        doc_blocks.rewrite("<!-- regenerate:in-flight -->\n<!-- /regenerate:in-flight -->\n", tmp_path)


def test_check_names_a_summary_edited_by_hand_and_regenerate_restores_it(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(regenerate.RESULTS / "staleness" / "confirmation", results / "staleness" / "confirmation")
    (results / "proximal_map").mkdir()
    shutil.copy(regenerate.RESULTS / "proximal_map" / "summary.json", results / "proximal_map")
    assert regenerate.check(results, documents=()) == {"proximal_map/families.md": "not committed",
                                                       "proximal_map/families.json": "not committed"}  # fmt: skip
    made = regenerate.regenerate(results, documents=())
    assert set(made) == {"staleness/confirmation/summary.md", "staleness/confirmation/summary.json",
                         "proximal_map/families.md", "proximal_map/families.json"}  # fmt: skip
    assert regenerate.check(results, documents=()) == {}
    summary = results / "staleness" / "confirmation" / "summary.md"
    committed = summary.read_text()
    # the pre-registered comparison's interval, edited by hand: the check names the file and the interval it gives
    row = next(line for line in committed.splitlines() if "| loglinear - recompute |" in line)
    interval = re.search(r"[-+]\d\.\d{3} \[[-+]\d\.\d{3}, [-+]\d\.\d{3}\]", row).group(0)
    summary.write_text(committed.replace(interval, "+9.999 [+9.000, +9.999]"))
    differences = regenerate.check(results, documents=())
    assert list(differences) == ["staleness/confirmation/summary.md"]
    assert interval in differences["staleness/confirmation/summary.md"]
    families = json.loads((results / "proximal_map" / "families.json").read_text())
    cells = families["families"]["loglinear - recompute, final"]
    assert len(cells) == 16 and sum(c["verdict"] == "difference" for c in cells) == 5
    # Holm within the family for the equivalence tests too: of the 4 cells equivalent by their own test, 2 remain
    assert sum(c["equivalence_p"] <= 0.05 for c in cells) == 4
    assert sum(c["verdict"] == "equivalent" for c in cells) == 2
    # read back from the summary's intervals, the verdicts are those the committed runs give
    from_runs = json.loads((regenerate.RESULTS / "proximal_map" / "families.json").read_text())
    assert [c["verdict"] for c in cells] == [
        c["verdict"] for c in from_runs["families"]["loglinear - recompute, final"]
    ]
    regenerate.regenerate(results, documents=())
    assert summary.read_text() == committed


def test_a_rerun_in_progress_does_not_replace_the_summary_it_reruns(tmp_path):
    """The proximal map is rerun whole: until its 768 runs are all committed, its summary stays the committed one
    (read back), not one made from the part of the rerun that is done."""
    results = tmp_path / "results"
    (results / "proximal_map" / "runs").mkdir(parents=True)
    shutil.copy(regenerate.RESULTS / "proximal_map" / "summary.json", results / "proximal_map")
    committed = (results / "proximal_map" / "summary.json").read_text()
    shutil.copy(
        regenerate.RESULTS / "proximal_map" / "runs" / "loglinear-s0-k1-lrhi@0.json", results / "proximal_map" / "runs"
    )  # one run of 768 (a record with its provenance block)
    made = regenerate.regenerate(results, documents=())
    assert "proximal_map/summary.json" not in made and "proximal_map/families.md" in made
    assert (results / "proximal_map" / "summary.json").read_text() == committed
    assert regenerate.rerun_progress(results / "proximal_map") == "1 of 768 runs"
