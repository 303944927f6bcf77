"""Give the benchmark records made before the provenance block existed (issue 61) a block, from what each holds.

    python scripts/retrofit_provenance.py            # a block for every record of benchmarks/results/ lacking one
    python scripts/retrofit_provenance.py --dry-run  # say what it would add, write nothing

A value is taken only from the record itself (the runner's ``started_at``, ``git_commit`` and ``machine``, a study's
``settings`` and ``torch_threads``, ``kernels.threads``, a compare report's ``meta``); ``sources`` says which field
gave each. What the record never held is null and listed in ``unrecorded``. Every retrofitted block also names the
commit that first added the record file (``recorded_in_commit``, ``committed_at``: when it was committed, not when it
ran). Only the block is added: every other byte of a record stays as it was (the script checks that each file reads
back and writes out unchanged before it adds anything), so no summary changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a script run from anywhere: the checkout's benchmarks package

from benchmarks.common.provenance import HOST_KEYS, ROLES, _names, blocks_of, record_files, validate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: What a report's "started" (the writer's naive local time) may precede its commit by, to be read as UTC.
AT_MOST_BEFORE_COMMIT = datetime.timedelta(hours=3)


def first_added() -> dict[str, tuple[str, str]]:
    """Each file under ``benchmarks/results`` -> ``(commit, author date)`` of the commit that first added it."""
    log = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=COMMIT %H%x09%aI", "--name-only", "--", "benchmarks/results"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    added, commit = {}, None
    for line in log.splitlines():
        if line.startswith("COMMIT "):
            commit = tuple(line.removeprefix("COMMIT ").split("\t"))
        elif line.strip():
            added[line.strip()] = commit  # newest first: the last seen is the first add
    return added


def _block(values: dict, sources: dict, absent: tuple[str, ...] = ()) -> dict:
    """A block of ``values`` (keys as in :func:`_names`; missing: null), null keys but the thread roles in
    ``absent`` listed as unrecorded."""
    block = {
        "started": values.get("started"),
        "commit": values.get("commit"),
        "dirty": values.get("dirty"),
        "host": {key: values.get(f"host.{key}") for key in HOST_KEYS},
        "foreign_cpu_frac": values.get("foreign_cpu_frac"),
        "threads": {role: values.get(f"threads.{role}") for role in ROLES},
        "omp_wait_policy": values.get("omp_wait_policy"),
    }
    absent_names = {f"threads.{role}" for role in absent}
    block["unrecorded"] = [n for n in _names(block) if values.get(n) is None and n not in absent_names]
    block["sources"] = sources
    return block


def run_values(record: dict, path: Path) -> tuple[dict, dict, tuple]:
    """A per-run record's values, their sources and the thread roles its run did not have."""
    values, sources = {}, {}

    def take(name, value, source):
        if value is not None:
            values[name], sources[name] = value, source

    if record.get("started_at"):
        take("started", record["started_at"].replace(" ", "T") + "Z", "started_at (the runner's, UTC, to the minute)")
    if record.get("git_commit"):
        sha = record["git_commit"]
        take("commit", sha.removesuffix("-dirty"), "git_commit")
        take("dirty", sha.endswith("-dirty"), "git_commit ('-dirty' suffix)")
    machine, kernels = record.get("machine") or {}, record.get("kernels") or {}
    for key in HOST_KEYS:
        take(f"host.{key}", machine.get(key), f"machine.{key}")
    if "host.cpu_model" not in values:
        take("host.cpu_model", kernels.get("cpu_model"), "kernels.cpu_model")
    if "host.cpu_count" not in values:
        take("host.cpu_count", record.get("cpu_count"), "cpu_count")
    if record.get("foreign_cpu_frac_run") is not None:
        take("foreign_cpu_frac", record["foreign_cpu_frac_run"], "foreign_cpu_frac_run (the runner's, the whole run)")
    else:
        take("foreign_cpu_frac", record.get("foreign_cpu_frac"), "foreign_cpu_frac (the study's, during training)")
    settings = record.get("settings") or {}
    take("threads.training", settings.get("training_num_threads"), "settings.training_num_threads")
    take("threads.generation", settings.get("generation_num_threads"), "settings.generation_num_threads")
    if record.get("torch_threads") is not None:
        take("threads.process", record["torch_threads"], "torch_threads (the process's, after training)")
    else:
        take("threads.process", kernels.get("threads"), "kernels.threads (the process's, after training)")
    # TRL's GRPOTrainer has no training or generation thread of its own: the process's does both
    absent = ("training", "generation") if record.get("config") == "trl" else ()
    return values, sources, absent


def _utc(started: str | None, committed_at: str) -> str | None:
    """A report's naive local ``started`` read as UTC where the commit that added it came soon after (the machine's
    zone was UTC), else None."""
    if not started:
        return None
    when = datetime.datetime.fromisoformat(started).replace(tzinfo=datetime.timezone.utc)
    lag = datetime.datetime.fromisoformat(committed_at) - when
    return when.strftime("%Y-%m-%dT%H:%M:%SZ") if datetime.timedelta(0) <= lag <= AT_MOST_BEFORE_COMMIT else None


def compare_blocks(report: dict, committed_at: str) -> tuple[dict, list[dict]]:
    """A compare report's own block and each run's."""
    meta = report["meta"]
    machine, env = meta.get("machine") or {}, (meta.get("software") or {}).get("env")
    omp = None if env is None else (env.get("OMP_WAIT_POLICY") or "unset")
    values, sources = {}, {}
    started = _utc(meta.get("started"), committed_at)
    if started:
        values["started"] = started
        sources["started"] = "meta.started (the writer's local time, read as UTC: the commit came minutes later)"
    for key in HOST_KEYS:
        if machine.get(key) is not None:
            values[f"host.{key}"], sources[f"host.{key}"] = machine[key], f"meta.machine.{key}"
    foreign = [run["foreign_cpu_frac"] for run in report["runs"] if run.get("foreign_cpu_frac") is not None]
    if foreign:
        values["foreign_cpu_frac"] = max(foreign)
        sources["foreign_cpu_frac"] = "the largest of its runs' foreign_cpu_frac (during training)"
    threads = meta.get("threads") or {}
    for role, key in (("training", "a3po_training"), ("generation", "a3po_generation"), ("process", "trl")):
        if threads.get(key) is not None:
            values[f"threads.{role}"], sources[f"threads.{role}"] = threads[key], f"meta.threads.{key}"
    if omp is not None:
        values["omp_wait_policy"], sources["omp_wait_policy"] = omp, "meta.software.env.OMP_WAIT_POLICY"
    runs = []
    for run in report["runs"]:
        here = run.get("reused_from") is None  # a run merged from another report ran where that one did
        run_values_, run_sources = {}, {}
        if here:
            for key in HOST_KEYS:
                if machine.get(key) is not None:
                    run_values_[f"host.{key}"], run_sources[f"host.{key}"] = machine[key], f"meta.machine.{key}"
            if omp is not None:
                run_values_["omp_wait_policy"] = omp
                run_sources["omp_wait_policy"] = "meta.software.env.OMP_WAIT_POLICY (every run's environment)"
        if run.get("foreign_cpu_frac") is not None:
            run_values_["foreign_cpu_frac"] = run["foreign_cpu_frac"]
            run_sources["foreign_cpu_frac"] = "foreign_cpu_frac (during training)"
        kind = run.get("kind")
        roles = {"trl": ("process",), "pieces": ("training", "process")}.get(kind, ROLES)
        for role in roles:
            value = (run.get("threads") or {}).get(role)
            if value is not None:
                run_values_[f"threads.{role}"], run_sources[f"threads.{role}"] = value, f"threads.{role}"
        runs.append((run_values_, run_sources, tuple(r for r in ROLES if r not in roles)))
    return (values, sources, ()), runs


def report_values(record: dict, path: Path) -> tuple[dict, dict, tuple]:
    """The values of a report without a ``meta`` machine: backends, compiled decode, LoRA memory, timeline overhead,
    the demo."""
    name = path.name
    if name.startswith("backends-"):
        threads = record["meta"].get("threads")
        # each process ran on OMP_NUM_THREADS=threads; its trainer's two threads' settings were not recorded
        return {"threads.process": threads}, {"threads.process": "meta.threads (per process)"}, ()
    if name == "compiled-decode.json":
        # every path decodes on the calling thread: no training or generation thread
        return {"threads.process": record.get("threads")}, {"threads.process": "threads"}, ("training", "generation")
    if name.startswith("lora_memory-"):
        return {}, {}, ("training", "generation")  # memory measured in the process's own thread
    return {}, {}, ()


def retrofit(path: Path, added: dict, write: bool) -> list[str]:
    """Add the missing blocks to the record at ``path``; returns the unrecorded keys of each block added."""
    text = path.read_text()
    record = json.loads(text)
    if all(block is not None for _, block in blocks_of(record)):
        return []
    indent = None if text.count("\n") <= 1 else len(text.splitlines()[1]) - len(text.splitlines()[1].lstrip())
    if json.dumps(record, indent=indent) + ("\n" if text.endswith("\n") else "") != text:
        raise SystemExit(f"{path}: does not write out unchanged; not retrofitted")
    relative = str(path.relative_to(ROOT))
    commit, committed_at = added[relative]
    found = []
    if "runs" in record and "meta" in record and "configs" in record:  # a compare report
        (values, sources, absent), runs = compare_blocks(record, committed_at)
        blocks = [(record["meta"], _block(values, sources, absent))]
        blocks += [(run, _block(*run_block)) for run, run_block in zip(record["runs"], runs)]
    elif "/runs/" in relative or "/reruns/" in relative:
        blocks = [(record, _block(*run_values(record, path)))]
    else:
        blocks = [(record.get("meta", record), _block(*report_values(record, path)))]
    for holder, block in blocks:
        if "provenance" in holder:
            continue
        block["recorded_in_commit"], block["committed_at"] = commit, committed_at
        holder["provenance"] = validate(block, relative)
        found.append(block["unrecorded"])
    if write:
        path.write_text(json.dumps(record, indent=indent) + ("\n" if text.endswith("\n") else ""))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="say what would be added, write nothing")
    options = parser.parse_args(argv)
    added = first_added()
    by_folder: dict[str, dict[tuple, int]] = {}
    for path in record_files(RESULTS):
        for unrecorded in retrofit(path, added, write=not options.dry_run):
            folder = str(path.parent.relative_to(RESULTS)).removesuffix("/runs")
            if path.parent == RESULTS:
                folder = path.name.split("-")[0].split("_")[0].removesuffix(".json")
            counts = by_folder.setdefault(folder, {})
            counts[tuple(unrecorded)] = counts.get(tuple(unrecorded), 0) + 1
    for folder, counts in sorted(by_folder.items()):
        for unrecorded, count in counts.items():
            print(f"{folder}: {count} blocks, unrecorded: {', '.join(unrecorded) or 'nothing'}")


if __name__ == "__main__":
    main()
