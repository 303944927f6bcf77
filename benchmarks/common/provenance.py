"""Where and when a benchmark record ran: the provenance block every record carries, written by one helper.

The block (a record's ``"provenance"``; in a report with a ``"meta"``, ``meta["provenance"]``, and each of a compare
report's ``runs`` carries its own):

- ``started``: when the run started, ISO-8601 UTC (``2026-12-07T02:44:49Z``; a retrofitted record's minute-precision
  time reads ``2026-12-03T06:58Z``);
- ``commit`` and ``dirty``: the repository's HEAD when it ran, and whether tracked files differed from it;
- ``host``: ``cpu_model``, ``cpu_count``, ``platform``, ``memory_gib`` (:func:`.machine.machine_info`);
- ``foreign_cpu_frac``: the share of all cores other processes took while it ran (``/proc/stat``, its own CPU not
  counted);
- ``threads``: the intra-op threads the run set for each of its threads: ``training`` (the asynchronous trainer's
  training thread), ``generation`` (its generation thread), ``process`` (the process's own: a synchronous trainer's,
  a measurement's, the main thread's); null where the run has no such thread;
- ``omp_wait_policy``: ``OMP_WAIT_POLICY`` as the run saw it, ``"unset"`` where it was not set;
- ``unrecorded``: the keys (``host.platform``, ``threads.process`` for one field) the run did not record, null in the
  block. Empty for a record written by :func:`provenance`.

A record made before the block existed was given one afterwards from what it held itself (``scripts/
retrofit_provenance.py``); what it never recorded is null and listed in ``unrecorded``, and where it has no start time
the block says which commit added the record (``recorded_in_commit``, ``committed_at``: when it was committed, not
when it ran). ``python -m benchmarks.regenerate`` refuses a record without a valid block (:func:`check_records`).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from .machine import machine_info

#: The repository root (the commit is this checkout's HEAD).
ROOT = Path(__file__).resolve().parents[2]
#: Every key of the block.
KEYS = ("started", "commit", "dirty", "host", "foreign_cpu_frac", "threads", "omp_wait_policy", "unrecorded")
HOST_KEYS = ("cpu_model", "cpu_count", "platform", "memory_gib")
ROLES = ("training", "generation", "process")
#: The keys whose value may be null without being unrecorded (a role the run does not have).
NULL_MEANS_ABSENT = tuple(f"threads.{role}" for role in ROLES)
#: The record files of ``benchmarks/results/``, relative glob patterns: each must carry a block.
RECORD_PATTERNS = (
    "**/runs/*@*.json",  # every study's per-run records
    "**/reruns/**/*@*.json",  # the proximal map's reruns of some cells
    "compare-*.json",
    "profile-*.json",
    "launch-bound/*.json",
    "backends-*.json",
    "compiled-decode.json",
    "lora_memory-*.json",
    "timeline_overhead.json",
    "reward_workers-*.json",
    "demo-*.json",
)


def utc_iso(when: float | datetime.datetime | None = None) -> str:
    """``when`` (seconds since the epoch, a datetime, or now) as ISO-8601 UTC to the second: ``...T02:44:49Z``."""
    if when is None:
        when = datetime.datetime.now(datetime.timezone.utc)
    elif not isinstance(when, datetime.datetime):
        when = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_head(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """The checkout's HEAD and whether tracked files differ from it; ``(None, None)`` outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


def thread_roles(training: int | None = None, generation: int | None = None, process: int | None = None) -> dict:
    """The ``threads`` of a block: the intra-op threads of each thread of the run (None: no such thread)."""
    return {"training": training, "generation": generation, "process": process}


def trainer_threads(trainer, process: int) -> dict:
    """The ``threads`` of an ``AsyncA3POTrainer`` run (the trainer after ``train()``, or its config) in a process
    with ``process`` intra-op threads (``torch.get_num_threads()`` before ``train()``): the counts ``train()`` set
    (``trainer.cpu_threads``: the user's, or the library's choice, ``a3po_trl/generation/cpu_threads.py``); from a
    config, as set. An unset training count is the process's; an unset generation count inherits the training
    thread's (PyTorch's process-wide count at the thread's first operation)."""
    chosen = getattr(trainer, "cpu_threads", None)
    if chosen is not None:
        training, generation = chosen.training, chosen.generation
    else:
        args = getattr(trainer, "args", trainer)
        training, generation = args.training_num_threads, args.generation_num_threads
    training = training or process
    return thread_roles(training, generation or training, process)


def omp_wait_policy(env: dict | None = None) -> str:
    """``OMP_WAIT_POLICY`` of ``env`` (this process's environment by default), ``"unset"`` where it is not set."""
    return (os.environ if env is None else env).get("OMP_WAIT_POLICY") or "unset"


def run_settings(threads: dict) -> dict:
    """What a run reports from inside its own process for its block (the runner adds the rest): the threads it set
    (:func:`thread_roles`) and the ``OMP_WAIT_POLICY`` it saw."""
    return {"threads": {role: threads.get(role) for role in ROLES}, "omp_wait_policy": omp_wait_policy()}


def provenance(
    started: float | datetime.datetime | str,
    threads: dict | None,
    foreign_cpu_frac: float | None,
    *,
    wait_policy: str | None = None,
    commit: tuple[str | None, bool | None] | None = None,
    host: dict | None = None,
) -> dict:
    """The block of a run that started at ``started`` (seconds since the epoch, a datetime, or ISO-8601 UTC), set
    ``threads`` (:func:`thread_roles`; None: it did not say) and saw other processes take ``foreign_cpu_frac`` of
    the machine; the ``OMP_WAIT_POLICY`` it ran under (default: this process's), its ``(commit, dirty)`` (default:
    this checkout's HEAD now) and its ``host`` (default: this machine). What could not be measured (no
    ``/proc/stat``, no checkout) is null and listed in ``unrecorded``."""
    sha, dirty = git_head() if commit is None else commit
    host = {key: (host or machine_info()).get(key) for key in HOST_KEYS}
    block = {
        "started": started if isinstance(started, str) else utc_iso(started),
        "commit": sha,
        "dirty": dirty,
        "host": host,
        "foreign_cpu_frac": foreign_cpu_frac,
        "threads": {role: (threads or {}).get(role) for role in ROLES},
        "omp_wait_policy": wait_policy if wait_policy is not None else omp_wait_policy(),
    }
    absent = () if threads is None else NULL_MEANS_ABSENT
    block["unrecorded"] = [name for name in _names(block) if _get(block, name) is None and name not in absent]
    validate(block, "the block being written")
    return block


def _names(block: dict) -> list[str]:
    """Every key of a block, a nested one as ``host.cpu_model``."""
    names = []
    for key in KEYS:
        if key == "host":
            names += [f"host.{k}" for k in HOST_KEYS]
        elif key == "threads":
            names += [f"threads.{k}" for k in ROLES]
        elif key != "unrecorded":
            names.append(key)
    return names


def _get(block: dict, name: str):
    outer, _, inner = name.partition(".")
    value = block.get(outer)
    return value.get(inner) if inner and isinstance(value, dict) else value


def validate(block, where: str) -> dict:
    """``block`` if it is a whole provenance block, else a ValueError naming ``where`` (the record file) and what is
    missing or wrong: a key absent, a null not listed in ``unrecorded``, a start time that is not ISO-8601 UTC, no
    start time and no commit that added the record."""
    if not isinstance(block, dict):
        raise ValueError(f"{where}: no provenance block (benchmarks/common/provenance.py writes it)")
    for key in KEYS:
        if key not in block:
            raise ValueError(f"{where}: the provenance block lacks {key!r}")
    for key, inner in (("host", HOST_KEYS), ("threads", ROLES)):
        if not isinstance(block[key], dict):
            raise ValueError(f"{where}: the provenance block's {key!r} is not a mapping")
        for name in inner:
            if name not in block[key]:
                raise ValueError(f"{where}: the provenance block lacks {key}.{name!r}")
    unrecorded = block["unrecorded"]
    if not isinstance(unrecorded, list) or not all(isinstance(name, str) for name in unrecorded):
        raise ValueError(f"{where}: the provenance block's 'unrecorded' is not a list of key names")
    names = _names(block)
    for name in unrecorded:
        if name not in names:
            raise ValueError(f"{where}: the provenance block lists {name!r} as unrecorded, not one of its keys")
    for name in names:
        if _get(block, name) is None and name not in unrecorded and name not in NULL_MEANS_ABSENT:
            raise ValueError(f"{where}: the provenance block's {name!r} is null but not listed in 'unrecorded'")
    if block["started"] is not None:
        started = str(block["started"])
        if not started.endswith("Z"):
            raise ValueError(f"{where}: the provenance block's 'started' {started!r} is not ISO-8601 UTC")
        try:
            datetime.datetime.fromisoformat(started.removesuffix("Z"))
        except ValueError:
            raise ValueError(f"{where}: the provenance block's 'started' {started!r} is not ISO-8601 UTC") from None
    elif not (block.get("recorded_in_commit") and block.get("committed_at")):
        raise ValueError(f"{where}: the provenance block has no 'started' and no 'recorded_in_commit'/'committed_at'")
    return block


def blocks_of(record: dict) -> Iterable[tuple[str, object]]:
    """The blocks a record file holds, with where in it: its own (``meta.provenance`` in a report with a ``meta``)
    and, in a compare report, each run's."""
    if isinstance(record.get("meta"), dict):
        yield "meta.provenance", record["meta"].get("provenance")
        for index, run in enumerate(record.get("runs") or []):
            yield f"runs[{index}].provenance", run.get("provenance")
    else:
        yield "provenance", record.get("provenance")


def record_files(results: Path) -> list[Path]:
    """Every record file under ``results`` (:data:`RECORD_PATTERNS`)."""
    return sorted({path for pattern in RECORD_PATTERNS for path in Path(results).glob(pattern)})


def check_records(results: Path) -> list[Path]:
    """Every record file under ``results``, each checked to carry a valid provenance block; a ValueError naming each
    bad file and what it lacks otherwise."""
    files, problems = record_files(results), []
    for path in files:
        record = json.loads(path.read_text())
        for inside, block in blocks_of(record):
            try:
                validate(block, f"{path.relative_to(results)} ({inside})")
            except ValueError as error:
                problems.append(str(error))
    if problems:
        raise ValueError(
            f"{len(problems)} records without a valid provenance block (benchmarks/common/provenance.py):\n"
            + "\n".join(problems)
        )
    return files
