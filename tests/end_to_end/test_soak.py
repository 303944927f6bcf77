"""A short soak: many asynchronous steps leak no thread, no file handle, no batch, and little memory."""

import threading

from benchmarks.soak import run_soak


def test_short_soak_has_no_leaks():
    threads_before = {t.ident for t in threading.enumerate()}
    report = run_soak(steps=80, max_staleness=4, every=10, verbose=False)
    assert report["batches_produced"] == report["batches_consumed"] == 80
    assert report["max_queue_depth"] <= report["queue_bound"] == 5
    assert report["open_files_after"] == report["open_files_before"]
    assert report["open_files_during_max"] <= report["open_files_before"] + 2
    leaked = [t for t in threading.enumerate() if t.ident not in threads_before and t.name.startswith("a3po")]
    assert not leaked
    # memory after warm-up stays within a small margin (the full soak reports the slope over hundreds of steps)
    assert report["rss_growth_after_warmup_mb"] < 100, report
