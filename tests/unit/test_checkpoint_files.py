"""What a complete checkpoint folder is (a3po_trl/checkpoints/files.py): the manifest, shard maps, files that cannot be
read, and the filesystem type under a folder."""

import json
import os

import torch

from a3po_trl.checkpoints import checkpoint_problems
from a3po_trl.checkpoints.files import filesystem_type, list_checkpoint_files, write_manifest, written_by_processes


def _checkpoint(folder, ranks=2):
    """What a two-process save leaves: trainer state, optimizer, one RNG state per process."""
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    torch.save({"state": torch.ones(100)}, folder / "optimizer.pt")
    for rank in range(ranks):
        torch.save({"rng": torch.ones(4)}, folder / f"rng_state_{rank}.pth")
    return folder


def test_a_file_that_vanishes_while_checked_is_a_problem_not_an_error(tmp_path):
    folder = _checkpoint(tmp_path / "checkpoint-1")
    os.remove(folder / "optimizer.pt")
    os.symlink(tmp_path / "gone", folder / "optimizer.pt")  # listed, then gone when read: a file another copy removed
    problems = checkpoint_problems(str(folder))
    assert len(problems) == 1 and "optimizer.pt" in problems[0]


def test_the_manifest_names_a_missing_or_resized_file_of_any_process(tmp_path):
    folder = _checkpoint(tmp_path / "checkpoint-1")
    write_manifest(str(folder), list_checkpoint_files(str(folder)), num_processes=2)
    manifest = json.loads((folder / "a3po_checkpoint_manifest.json").read_text())
    assert set(manifest["files"]) == {"trainer_state.json", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"}
    assert checkpoint_problems(str(folder)) == []

    os.remove(folder / "rng_state_1.pth")  # another process's file, lost (a partial copy, a sync that missed it)
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    assert checkpoint_problems(str(folder)) == [
        "rng_state_1.pth is missing (the manifest lists it)",
        "trainer_state.json has 18 bytes where the manifest says 2",
    ]


def test_the_number_of_processes_that_wrote_a_checkpoint_is_read_from_its_manifest_or_rng_files(tmp_path):
    folder = _checkpoint(tmp_path / "checkpoint-1", ranks=4)
    assert written_by_processes(str(folder)) == 4  # no manifest (another trainer, an older version): the RNG files
    write_manifest(str(folder), list_checkpoint_files(str(folder)), 3)
    assert written_by_processes(str(folder)) == 3  # the manifest says it
    single = _checkpoint(tmp_path / "checkpoint-2", ranks=0)
    assert written_by_processes(str(single)) is None  # nothing says
    torch.save({"rng": torch.ones(4)}, single / "rng_state.pth")
    assert written_by_processes(str(single)) == 1


def test_without_a_manifest_the_shards_an_index_names_must_be_there(tmp_path):
    folder = _checkpoint(tmp_path / "checkpoint-1", ranks=1)
    index = {"metadata": {}, "weight_map": {"a": "model-1-of-2.safetensors", "b": "model-2-of-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-1-of-2.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert checkpoint_problems(str(folder)) == [
        "model-2-of-2.safetensors is missing (listed in model.safetensors.index.json)"
    ]


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:35 / /mnt/bucket rw,nosuid,nodev,relatime shared:20 - fuse.s3fs s3fs rw,user_id=0
41 22 0:36 / /mnt/my\\040data rw,relatime - nfs4 server:/export rw
"""


def test_the_filesystem_type_is_the_one_of_the_innermost_mount():
    assert filesystem_type("/mnt/bucket/run/checkpoints", MOUNTINFO) == "fuse.s3fs"
    assert filesystem_type("/mnt/bucket", MOUNTINFO) == "fuse.s3fs"
    assert filesystem_type("/mnt/bucketful", MOUNTINFO) == "ext4"
    assert filesystem_type("/mnt/my data/out", MOUNTINFO) == "nfs4"
    assert filesystem_type("/home/user/out", MOUNTINFO) == "ext4"
