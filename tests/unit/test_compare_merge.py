"""benchmarks/compare's --merge-from: a previous report under other settings is refused before anything runs; other
thread variants merge (a variant only adds configurations, each run carrying its own counts)."""

import pytest

from benchmarks.compare.report import check_mergeable

META = {
    "model": "smollm2",
    "device": "cpu",
    "bf16": False,
    "steps": 8,
    "warmup_steps": 2,
    "batch": 8,
    "learning_rate": 1e-5,
    "staleness": [1],
    "threads": {"trl": 2, "a3po_training": 0, "a3po_generation": 0, "pieces": 0},
}


def test_other_thread_variants_merge_and_other_settings_are_refused_naming_them():
    check_mergeable(META, {**META, "threads": {**META["threads"], "variants": "t1g1"}})
    with pytest.raises(SystemExit, match=r"differs in \['threads'\]"):
        check_mergeable(META, {**META, "threads": {**META["threads"], "a3po_training": 1, "variants": "t1g1"}})
    with pytest.raises(SystemExit, match=r"differs in \['steps', 'learning_rate'\]"):
        check_mergeable(META, {**META, "steps": 16, "learning_rate": 1e-4})
