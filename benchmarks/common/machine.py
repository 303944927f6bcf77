"""The machine a run ran on: CPU used by other processes (from ``/proc/stat``) during a run, waiting for a quiet
machine, and what the machine is.

On a small shared machine another process taking one core slows a two-thread run many times over, so every run
records the share of the machine other processes took (``foreign_cpu_frac``) and waits (at most ``--quiet-wait``
seconds) for a quiet machine before it starts.
"""

from __future__ import annotations

import os
import platform
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


def _own_cpu(children: bool) -> float:
    """CPU seconds of this process, and with ``children`` of its finished (waited-for) child processes too."""
    import resource

    who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if children else [])
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, who))


class LoadMeter:
    """CPU seconds used by other processes (and stolen by the hypervisor) between start() and stop(), as shares of all
    cores. ``children=True`` counts the CPU of this process's child processes as its own (stop() after they ended)."""

    def __init__(self, children: bool = False):
        self.children = children

    def start(self):
        self._stat, self._own, self._wall = _proc_stat(), _own_cpu(self.children), time.perf_counter()
        return self

    def stop(self) -> dict:
        stat, own, wall = _proc_stat(), _own_cpu(self.children), time.perf_counter()
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


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the system has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info() -> dict:
    """The platform, the number of cores, the CPU model and the memory (GiB) of this machine."""
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu_model": None, "memory_gib": None}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


#: The CPU features that decide which kernels torch, MKL and oneDNN run (and so how floating-point sums round).
KERNEL_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


def kernel_info() -> dict:
    """What decides the floating-point results of a run besides its inputs, in this process: torch's version and
    the CPU capability its kernels dispatch to (``ATEN_CPU_CAPABILITY`` overrides it), the BLAS and oneDNN builds, the
    thread counts, the CPU model and its vector-instruction flags. Two runs with the same seeds reproduce each other
    bit for bit only where these agree (a different CPU generation picks other kernels, which round differently)."""
    import torch

    build = torch.__config__.show()
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": next((line.strip(" -") for line in build.splitlines() if "Math Kernel Library" in line), None),
        "onednn": next((line.strip(" -") for line in build.splitlines() if "MKL-DNN" in line), None),
        "threads": torch.get_num_threads(),
        "cpu_model": machine_info()["cpu_model"],
        "cpu_flags": sorted(flags & set(KERNEL_CPU_FLAGS)),
    }
