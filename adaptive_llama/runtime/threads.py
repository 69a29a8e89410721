"""How many CPU threads llama.cpp decodes with: a measured default, adapted while it runs.

The default is the physical cores this process may use (CPU affinity, no SMT siblings, a
cgroup CPU quota), as llama.cpp's own tools choose. Measured on 2 cores with SmolLM2-135M
(models.md): 2 threads decode 1.5x faster than 1 on a quiet machine, but beside one other
busy process they collapse to 0.43x of 1 thread: llama.cpp's workers meet at a barrier after
every operation, and one of them is always waiting for a time slice. So with the default
(``n_threads=None``) a :class:`ThreadTuner` looks, twice a second while decoding, at how much
of this process's CPUs other processes used (``/proc/stat`` for our CPUs, minus our own CPU
time) and decodes with the cores they leave: one thread fewer for every core's worth of
foreign load, back up when it goes. A thread count the user gives is kept.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import llama_cpp

WINDOW_S = 0.5  # how often the load is looked at (while decoding)
SHARE = 0.4     # a core counts as taken once others use more than 1 - SHARE of it


def default_threads() -> int:
    """Physical cores available to this process: affinity, minus SMT siblings, cgroup quota."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(
        os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
                      .read_text().strip())
        except OSError:
            cores.add(str(cpu))
    quota = _cgroup_cpus()
    return max(1, min(len(cores), math.floor(quota) if quota else len(cores)))


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 cpu.max or v1 cfs), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent busy (not idle or iowait) on ``cpus`` since boot, from /proc/stat."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            values = [int(v) for v in fields]
            ticks += sum(values) - values[3] - values[4]  # minus idle and iowait
    return ticks / os.sysconf("SC_CLK_TCK") if ticks else None


class ThreadTuner:
    """Keeps a llama.cpp context's thread count at the cores other processes leave free.

    ``observe()`` after each decode step; every :data:`WINDOW_S` it measures the foreign
    load ``others`` (in cores) on this process's CPUs and sets
    ``threads = max_threads - floor(others + SHARE)`` (at least 1). Adaptation is off for a
    fixed thread count, on one core, without /proc/stat, and under a cgroup CPU quota
    (there the host's load says little about this process's share).
    """

    def __init__(self, ctx, max_threads: int, adaptive: bool,
                 busy_seconds: Callable[[list[int]], float | None] = _busy_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 own_seconds: Callable[[], float] = time.process_time):
        self._ctx = ctx
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else list(range(os.cpu_count() or 1))
        self._busy, self._clock, self._own = busy_seconds, clock, own_seconds
        quota = _cgroup_cpus()
        self.adaptive = (adaptive and max_threads > 1 and (quota is None or quota >= len(
            self._cpus)) and busy_seconds(self._cpus) is not None)
        self._mark = self._sample()
        llama_cpp.llama_set_n_threads(ctx, max_threads, max_threads)

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), self._busy(self._cpus) or 0.0, self._own()

    def observe(self) -> None:
        if not self.adaptive or self._clock() - self._mark[0] < WINDOW_S:
            return
        now = self._sample()
        wall = now[0] - self._mark[0]
        others = max(0.0, ((now[1] - self._mark[1]) - (now[2] - self._mark[2])) / wall)
        self._mark = now
        want = max(1, self.max_threads - math.floor(others + SHARE))
        if want != self.threads:
            self.threads = want
            llama_cpp.llama_set_n_threads(self._ctx, want, want)
