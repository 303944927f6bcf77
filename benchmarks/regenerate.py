"""Every summary and table of ``benchmarks/results/`` regenerated from the committed records, in one command.

    python -m benchmarks.regenerate            # rewrite them in place (and the studies' plots)
    python -m benchmarks.regenerate --check    # regenerate into a scratch copy; list what differs from the committed

What is regenerated, and from what:

- the studies with per-run records (``<study>/runs/<config>@<seed>.json``): the staleness study, its pre-registered
  confirmation, time to accuracy, dynamic sampling, in-flight updates, the proximal map, the approximation study,
  the oracle study, the guard's map cells and its SmolLM2 evaluation once their runs are committed (the last from
  its seeds so far: its summary says what is missing and decides nothing until they are in); each study's own
  ``--summary-only`` (``summary.md``, ``summary.json``, its plot);
- the proximal map while its runs are not committed: ``families.{md,json}`` (Holm within each family, equivalence
  against the margin), read back from the committed ``summary.json``'s means and intervals;
- ``compare-*.md``, ``profile-*.md`` and ``launch-bound/*.md`` from their JSON reports (``benchmarks/compare``),
  ``backends-*.md`` from theirs (``benchmarks/backends.py``), ``compiled-decode.md`` from its
  (``benchmarks/compiled_decode.py``, its decision too);
- then the marked blocks of ``README.md``, ``docs/BENCHMARKS.md`` and ``docs/USAGE.md`` (``<!-- regenerate:NAME -->``
  ... ``<!-- /regenerate:NAME -->``), from those summaries, by :mod:`benchmarks.doc_blocks`: the numbers the README's
  table and BENCHMARKS' headline tables quote are never copied by hand.

Regenerated numbers compare with the committed ones within a stated tolerance, not as bytes
(:mod:`benchmarks.common.equivalence`: 1e-9 relative; a shown digit may round the other way only where its summary's
JSON carries host noise): the same records give other last bits on another host's BLAS, and a file that says what the
committed one says is left as committed, by ``--check`` and by a rewrite alike. The documents' blocks are written from
the committed summaries, so they compare exactly.

Not regenerable, and why (:data:`NOT_REGENERABLE`): the summaries whose runs were never committed (none today). A
study being rerun (:data:`RERUNS`) keeps its old summary until every run of the rerun is committed: a part of the
rerun (the runner resumes it) never replaces a whole summary.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
#: The documents whose marked blocks are written from the summaries (:mod:`benchmarks.doc_blocks`).
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md", ROOT / "docs" / "USAGE.md")
#: Summaries that cannot be regenerated while their study's runs/ is empty, with why.
NOT_REGENERABLE: dict[str, str] = {}
#: The proximal map's families, when read back from its summary rather than from its runs.
FROM_SUMMARY = (
    "read back from summary.json's means and 95% intervals: the runs behind it are not in its runs/ folder "
    "(python -m benchmarks.proximal_map --cells-per-launch 16 makes them)"
)


#: The studies being rerun whole (their first records were never committed), with the runs a complete rerun has:
#: until every one is committed, the old summary stays and is not regenerated from a part of the rerun.
RERUNS = {"proximal_map": 768, "approximation": 4}


def _has_runs(folder: Path) -> bool:
    """Whether ``folder``'s summary is made from its committed runs (for a study being rerun: all of them)."""
    runs = len(list((folder / "runs").glob("*@*.json")))
    return runs >= RERUNS.get(folder.name, 1)


def rerun_progress(folder: Path) -> str:
    """``"<kept> of <planned> runs"`` of a study being rerun."""
    return f"{len(list((folder / 'runs').glob('*@*.json')))} of {RERUNS[folder.name]} runs"


def regenerate(results: Path = RESULTS, documents: Sequence[Path] = DOCUMENTS) -> list[str]:
    """Regenerate every summary and table under ``results`` (the committed folder, or a copy of it), then the marked
    blocks of ``documents`` from them; returns what was regenerated, relative to ``results`` (a document: its
    name)."""
    from benchmarks.common.provenance import check_records

    check_records(results)  # every record says where and when it ran, or nothing is regenerated
    from benchmarks import dynamic_sampling, in_flight, proximal_map, staleness, time_to_accuracy

    done = []
    committed = _snapshot(results)
    studies = [
        ("staleness", staleness.main, []),
        ("staleness/confirmation", staleness.main, ["--confirmation"]),
        ("time-to-accuracy", time_to_accuracy.main, []),
        ("dynamic-sampling", dynamic_sampling.main, []),
        ("in-flight", in_flight.main, []),
        ("proximal_map", proximal_map.main, []),
    ]
    if _has_runs(results / "approximation"):
        from benchmarks import approximation  # builds trainers: imported only where it has records to read

        studies.append(("approximation", approximation.main, []))
    if _has_runs(results / "oracle"):
        from benchmarks import oracle

        studies.append(("oracle", oracle.main, []))
    if _has_runs(results / "guard" / "map"):
        from benchmarks import guard_map

        studies.append(("guard/map", guard_map.main, []))
    if _has_runs(results / "guard" / "smollm2"):
        from benchmarks import guard_smollm2

        studies.append(("guard/smollm2", guard_smollm2.main, []))
    for folder, main, extra in studies:
        if _has_runs(results / folder):
            with contextlib.redirect_stdout(io.StringIO()):  # each study prints its summary
                main([*extra, "--summary-only", "--out", str(results / folder)])
            done += [f"{folder}/summary.md", f"{folder}/summary.json"]
    committed_summary = results / "proximal_map" / "summary.json"
    if not _has_runs(results / "proximal_map") and committed_summary.exists():
        proximal_map.write_families(json.loads(committed_summary.read_text()), committed_summary.parent, FROM_SUMMARY)
    if (results / "proximal_map" / "families.md").exists():
        done += ["proximal_map/families.md", "proximal_map/families.json"]
    done += _tables(results)
    keep_equivalent(results, committed, done)
    done += write_documents(results, documents)
    return done


def _snapshot(results: Path) -> dict[str, str]:
    """The text of every summary and table under ``results`` (not the per-run records), by name relative to it."""
    return {
        str(path.relative_to(results)): path.read_text()
        for pattern in ("*.json", "*.md")
        for path in results.rglob(pattern)
        if not {"runs", "work"} & set(path.relative_to(results).parts[:-1])
        and not any(part.endswith(".runs") for part in path.relative_to(results).parts)
    }


def keep_equivalent(results: Path, committed: dict[str, str], regenerated: Sequence[str]) -> list[str]:
    """Put back the committed text of every regenerated file that says what it says (numbers within the tolerance of
    :mod:`benchmarks.common.equivalence`), so that regenerating on another host rewrites no file for host noise;
    returns the files put back. JSON first: a Markdown file may differ by one unit in a shown digit only where a
    JSON file of its folder was regenerated with noise."""
    from benchmarks.common.equivalence import differences

    kept, noisy_folders = [], set()
    for name in sorted(regenerated, key=lambda name: not name.endswith(".json")):
        path = results / name
        old = committed.get(name)
        if old is None or not path.exists():
            continue
        new = path.read_text()
        if new == old:
            continue
        folder = str(Path(name).parent)
        if not differences(name, old, new, noisy=folder in noisy_folders):
            path.write_text(old)
            kept.append(name)
            if name.endswith(".json"):
                noisy_folders.add(folder)
    return kept


def write_documents(results: Path, documents: Sequence[Path]) -> list[str]:
    """Rewrite the marked blocks of each document from the summaries under ``results``; returns the documents as
    :func:`document_name` names them."""
    from benchmarks.doc_blocks import rewrite

    done = []
    for document in documents:
        document.write_text(rewrite(document.read_text(), results, document_name(document)))
        done.append(document_name(document))
    return done


def document_name(document: Path) -> str:
    """A document relative to the repository (``README.md``, ``docs/BENCHMARKS.md``), or its name elsewhere."""
    return str(document.relative_to(ROOT)) if document.is_relative_to(ROOT) else document.name


def _tables(results: Path) -> list[str]:
    """The Markdown tables that their JSON reports hold everything of."""
    from benchmarks.backends import _table
    from benchmarks.compare.markdown import write_markdown

    done = []
    reports = [*results.glob("compare-*.json"), *results.glob("profile-*.json"), *results.glob("launch-bound/*.json")]
    for path in sorted(reports):
        write_markdown(json.loads(path.read_text()), str(path.with_suffix(".md")))
        done.append(str(path.with_suffix(".md").relative_to(results)))
    for path in sorted(results.glob("backends-*.json")):
        report = json.loads(path.read_text())
        path.with_suffix(".md").write_text(_table(report["results"], report["meta"]))
        done.append(path.with_suffix(".md").name)
    decode = results / "compiled-decode.json"
    if decode.exists():
        from benchmarks.compiled_decode import decide, markdown

        report = json.loads(decode.read_text())
        report["decision"] = decide(report["results"])  # the rule, applied again to the measurements
        decode.with_suffix(".md").write_text(markdown(report))
        done.append(decode.with_suffix(".md").name)
    return done


def check(results: Path = RESULTS, documents: Sequence[Path] = DOCUMENTS) -> dict[str, str]:
    """Regenerate into a scratch copy of ``results`` and of ``documents`` and compare every regenerated JSON and
    Markdown file, and every document, with the committed one (images are left out: a plot's bytes depend on the
    matplotlib build). Numbers compare within :mod:`benchmarks.common.equivalence`'s tolerance, so host noise in the
    last bits passes and a hand edit of a shown digit does not. Returns what differs: the first number or line that
    differs, with the committed and the regenerated line."""
    from benchmarks.common import equivalence

    differences = {}
    with tempfile.TemporaryDirectory(prefix="a3po-regenerate-") as scratch:
        copy = Path(scratch) / "results"
        shutil.copytree(results, copy, ignore=shutil.ignore_patterns("work", "*.png"))
        pairs = {name: (results / name, copy / name) for name in regenerate(copy, documents=())}
        for document in documents:
            scratch_copy = Path(scratch) / "documents" / document_name(document)
            scratch_copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(document, scratch_copy)
            write_documents(copy, [scratch_copy])
            pairs[document_name(document)] = (document, scratch_copy)
        for name, (committed, regenerated) in pairs.items():
            if not committed.exists():
                differences[name] = "not committed"
                continue
            found = equivalence.differences(name, committed.read_text(), regenerated.read_text())
            if found:
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                differences[name] = found[0] + more
    return differences


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="regenerate into a scratch copy and compare")
    options = parser.parse_args(argv)
    if options.check:
        differences = check()
        for name, why in differences.items():
            print(f"[regenerate] {name} differs from what its records give: {why}")
        _not_regenerable()
        if differences:
            raise SystemExit(
                f"{len(differences)} committed summaries or documents differ: python -m benchmarks.regenerate"
            )
        print(
            "[regenerate] every regenerable summary, and every marked block of the documents, "
            "equals what the records give"
        )
        return
    for name in regenerate():
        print(f"[regenerate] wrote {name}")
    _not_regenerable()


def _not_regenerable() -> None:
    for name, why in NOT_REGENERABLE.items():
        folder = RESULTS / name.split("/")[0]
        if not _has_runs(folder):
            print(f"[regenerate] {name} not regenerable: {why} (rerun so far: {rerun_progress(folder)})")


if __name__ == "__main__":
    main(sys.argv[1:])
