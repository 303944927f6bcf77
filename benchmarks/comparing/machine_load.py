"""Machine load: CPU used by other processes (from ``/proc/stat``) during a run, and waiting for a quiet machine.

On a small shared machine another process taking one core slows a two-thread run many times over, so each run
records ``foreign_cpu_frac`` and waits (at most ``--quiet-wait`` seconds) for a quiet machine before it starts.
"""

from __future__ import annotations

import os
import time


def _proc_stat() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0.0
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _own_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LoadMeter:
    """CPU seconds used by other processes (and stolen by the hypervisor) between start() and stop()."""

    def start(self):
        self._stat, self._own, self._wall = _proc_stat(), _own_cpu(), time.perf_counter()
        return self

    def stop(self) -> dict:
        stat, own, wall = _proc_stat(), _own_cpu(), time.perf_counter()
        seconds = max(wall - self._wall, 1e-9)
        cores = os.cpu_count() or 1
        if stat is None or self._stat is None:
            return {"foreign_cpu_frac": None, "steal_frac": None, "own_cpu_frac": (own - self._own) / seconds / cores}
        busy = stat[0] - self._stat[0]
        foreign = max(0.0, busy - (own - self._own))
        return {
            "foreign_cpu_frac": round(foreign / seconds / cores, 4),
            "steal_frac": round((stat[1] - self._stat[1]) / seconds / cores, 4),
            "own_cpu_frac": round((own - self._own) / seconds / cores, 4),
        }


def wait_for_quiet(max_wait: float, threshold: float, window: float = 2.0) -> dict:
    """Wait until other processes use less than ``threshold`` of the machine over ``window`` s (at most max_wait)."""
    start = time.perf_counter()
    last = None
    while True:
        meter = LoadMeter().start()
        if max_wait <= 0:
            break
        time.sleep(window)
        last = meter.stop()["foreign_cpu_frac"]
        if last is None or last < threshold or time.perf_counter() - start >= max_wait:
            break
    return {"quiet_wait_seconds": round(time.perf_counter() - start, 2), "foreign_cpu_frac_before": last}
