"""What a complete checkpoint folder is, read from its files, and what the filesystem under it must offer.

A checkpoint this trainer writes carries a manifest (:data:`MANIFEST_NAME`): every file of the folder, every
process's (RNG states, DeepSpeed and FSDP shards, safetensors shards), with its size, written once the checkpoint is
whole and before the folder gets its final name. :func:`checkpoint_problems` checks a folder against its manifest, or,
for checkpoints written by other trainers or versions (no manifest), the files that say what else must be there
(``trainer_state.json``, ``*.index.json`` shard maps); in both cases every ``torch.save`` and safetensors file is
checked for being cut short, from its header or zip directory. Nothing here raises on a file that vanishes or cannot
be read: it becomes one of the problems, so that the process reading it can still tell the others.

Checkpoints are published by renaming a whole folder (:mod:`a3po_trl.checkpoints.saves`), so the filesystem must
rename a directory atomically: :func:`checkpoint_filesystem_problem` refuses object-store mounts, whose directory
renames copy file by file or are not supported, and probes a rename once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "a3po_checkpoint_manifest.json"
"""The list of a checkpoint's files and sizes, written when it is whole (before its rename)."""
MANIFEST_FORMAT = 1
STAGING_PREFIX = f"tmp-{PREFIX_CHECKPOINT_DIR}"
"""Prefix of the folders a checkpoint lives in before its rename and while it is deleted (never matched by
``get_last_checkpoint``)."""
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"

OBJECT_STORE_FILESYSTEMS = frozenset(
    {
        "fuse.s3fs",
        "fuse.goofys",
        "fuse.geesefs",
        "fuse.mountpoint-s3",
        "fuse.gcsfuse",
        "fuse.blobfuse",
        "fuse.blobfuse2",
        "fuse.rclone",
    }
)
"""Filesystem types (``/proc/self/mountinfo``) of object-store mounts: a directory rename there copies and deletes
object by object (an interruption leaves both folders partial) or is refused."""


# ---- the files of one checkpoint ----------------------------------------------------------------------------------
def list_checkpoint_files(folder: str) -> dict[str, int]:
    """``{path relative to folder (``/``-separated): size}`` of every file below ``folder``, the manifest left out.
    Raises ``OSError`` when a folder or file cannot be read."""

    def fail(error: OSError):
        raise error

    files = {}
    for root, _, names in os.walk(folder, onerror=fail):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative != MANIFEST_NAME:
                files[relative] = os.path.getsize(path)
    return dict(sorted(files.items()))


def write_manifest(folder: str, files: dict[str, int], num_processes: int) -> None:
    """Write ``folder``'s manifest (``files``: its files and sizes, as :func:`list_checkpoint_files` lists them) and
    flush it to disk."""
    path = os.path.join(folder, MANIFEST_NAME)
    manifest = {"format": MANIFEST_FORMAT, "num_processes": num_processes, "files": files}
    with open(path, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


_RNG_STATE_OF_PROCESS = re.compile(r"^rng_state_(\d+)\.pth$")


def written_by_processes(folder: str) -> int | None:
    """The number of processes of the run that wrote checkpoint ``folder``: its manifest's ``num_processes``, or,
    for a checkpoint without a readable manifest (another trainer or an older version), what transformers' RNG
    files say (``rng_state.pth``: one process; ``rng_state_<k>.pth``: one per process). ``None`` when neither does."""
    try:
        with open(os.path.join(folder, MANIFEST_NAME)) as file:
            recorded = json.load(file)["num_processes"]
        if isinstance(recorded, int) and recorded >= 1:
            return recorded
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    ranks = [int(match.group(1)) for match in map(_RNG_STATE_OF_PROCESS.match, names) if match]
    if ranks:
        return max(ranks) + 1
    return 1 if "rng_state.pth" in names else None


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def _manifest_problems(folder: str, found: dict[str, int]) -> list[str]:
    try:
        with open(os.path.join(folder, MANIFEST_NAME)) as file:
            listed = json.load(file)["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{MANIFEST_NAME} cannot be read ({error})"]
    problems = []
    for relative, size in listed.items():
        if relative not in found:
            if relative != TRAINER_STATE_NAME:  # said by the trainer state's own check
                problems.append(f"{relative} is missing (the manifest lists it)")
        elif found[relative] != size:
            problems.append(f"{relative} has {found[relative]} bytes where the manifest says {size}")
    return problems


def _shard_map_problems(folder: str, found: dict[str, int]) -> list[str]:
    """Shards named in ``*.index.json`` files (``model.safetensors.index.json``, ...) that are not there."""
    problems = []
    for relative in found:
        if not relative.endswith(".index.json"):
            continue
        try:
            with open(os.path.join(folder, relative)) as file:
                shards = set(json.load(file)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            problems.append(f"{relative} cannot be read ({error})")
            continue
        directory = os.path.dirname(relative)
        for shard in sorted(shards):
            if f"{directory}/{shard}".lstrip("/") not in found:
                problems.append(f"{f'{directory}/{shard}'.lstrip('/')} is missing (listed in {relative})")
    return problems


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is cut short, from its header (the byte ranges of its tensors), or None."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as file:
            (header_length,) = struct.unpack("<Q", file.read(8))
            if header_length > size - 8:
                return "truncated (header longer than the file)"
            header = json.loads(file.read(header_length))
    except (struct.error, ValueError, UnicodeDecodeError):
        return "unreadable header"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    if 8 + header_length + max(ends, default=0) > size:
        return "truncated (its tensors end past the end of the file)"
    return None


def _torch_file_problem(path: str) -> str | None:
    """Why a ``torch.save`` file is cut short, or None. Since PyTorch 1.6 these are zip archives whose directory is at
    their end, so a cut file has none; files in the legacy format cannot be checked without loading them."""
    if os.path.getsize(path) == 0:
        return "empty"
    with open(path, "rb") as file:
        if file.read(4) != _ZIP_MAGIC:
            return None
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile:
        return "truncated (no zip directory at its end)"


def _file_problem(path: str) -> str | None:
    try:
        if path.endswith(".safetensors"):
            return _safetensors_problem(path)
        if path.endswith(_TORCH_SUFFIXES):
            return _torch_file_problem(path)
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    return None


def checkpoint_problems(folder: str) -> list[str]:
    """Why ``folder`` cannot be resumed from; empty if it is complete. Never raises: a file that vanishes or cannot be
    read while it is checked is a problem.

    Complete means: ``trainer_state.json`` (which transformers writes after the model, optimizer, scheduler and RNG
    states) is present and parses; every file the manifest lists is there with its size (without a manifest, every
    shard an ``*.index.json`` names is there); and no file is cut short: every ``torch.save`` file (``optimizer.pt``,
    ``scheduler.pt``, RNG states, DeepSpeed shards) has its zip directory, every safetensors file holds the bytes its
    header promises. Reads only headers, zip directories and sizes, not the tensors.
    """
    try:
        found = list_checkpoint_files(folder)
    except OSError as error:
        return [f"cannot be listed ({error})"]
    problems = []
    if TRAINER_STATE_NAME not in found:
        problems.append(f"{TRAINER_STATE_NAME} is missing")
    else:
        try:
            with open(os.path.join(folder, TRAINER_STATE_NAME)) as file:
                json.load(file)
        except (ValueError, UnicodeDecodeError):
            problems.append(f"{TRAINER_STATE_NAME} is not valid JSON")
        except OSError as error:
            problems.append(f"{TRAINER_STATE_NAME} is unreadable ({error.strerror or error})")
    if has_manifest(folder):
        problems += _manifest_problems(folder, found)
    else:
        problems += _shard_map_problems(folder, found)
    for relative in found:
        problem = _file_problem(os.path.join(folder, relative))
        if problem:
            problems.append(f"{relative} is {problem}")
    return problems


def whole_with_manifest(folder: str) -> bool:
    """Whether ``folder`` was written whole by this trainer: its manifest is there and it has no problem."""
    return has_manifest(folder) and not checkpoint_problems(folder)


# ---- flushing to disk -----------------------------------------------------------------------------------------------
def fsync_files(folder: str) -> list[str]:
    """Flush every file below ``folder`` and the folders themselves to disk; returns the problems (a file that
    vanished while listed is not one: another process's temporary file)."""
    problems = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as error:
                problems.append(f"{os.path.relpath(path, folder)} cannot be opened to flush it ({error})")
                continue
            try:
                os.fsync(descriptor)
            except OSError as error:
                problems.append(f"{os.path.relpath(path, folder)} cannot be flushed to disk ({error})")
            finally:
                os.close(descriptor)
        fsync_directory(root)
    return problems


def fsync_directory(folder: str) -> None:
    """Flush a directory's entries (a rename in it) to disk, where the platform can."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


# ---- the filesystem -------------------------------------------------------------------------------------------------
def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The filesystem type of the mount holding ``path`` (from ``/proc/self/mountinfo``, or ``mountinfo``'s text),
    or None where that is not known (not Linux)."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as file:
                mountinfo = file.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields or len(fields) < 5:
            continue
        mount_point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fields[fields.index("-") + 1]
    return best_type


def _probe_directory_rename(run_dir: str) -> str | None:
    """Rename a small folder inside ``run_dir`` once; the error, or None."""
    probe = os.path.join(run_dir, f"{STAGING_PREFIX}-probe-{os.getpid()}")
    try:
        os.makedirs(os.path.join(probe, "written"), exist_ok=True)
        with open(os.path.join(probe, "written", "file"), "w") as file:
            file.write("probe")
        os.rename(os.path.join(probe, "written"), os.path.join(probe, "renamed"))
        if not os.path.isfile(os.path.join(probe, "renamed", "file")):
            return "the renamed directory lost its file"
        return None
    except OSError as error:
        return f"renaming a directory failed: {error}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def checkpoint_filesystem_problem(run_dir: str) -> str | None:
    """Why ``run_dir`` cannot hold checkpoints that are published by an atomic directory rename, or None."""
    kind = filesystem_type(run_dir)
    if kind in OBJECT_STORE_FILESYSTEMS:
        reason = f"it is on an object-store mount ({kind}), where renaming a directory copies it file by file"
    else:
        reason = _probe_directory_rename(run_dir)
        if reason is None:
            return None
        reason = f"{reason} (filesystem {kind or 'of unknown type'})"
    return (
        f"Checkpoints cannot be written whole in {run_dir}: {reason}. Each checkpoint is written into "
        f"{STAGING_PREFIX}-N and published by renaming that folder to checkpoint-N, which needs a filesystem that "
        "renames a directory atomically (a local disk, or a shared POSIX filesystem such as NFS or Lustre). Set "
        "output_dir to such a folder and copy finished checkpoint-N folders to the object store afterwards (or use "
        "push_to_hub)."
    )
