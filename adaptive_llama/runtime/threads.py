"""How many CPU threads llama.cpp decodes with: a measured default, adapted while it runs.

The default is the physical cores this process may use (CPU affinity, no SMT siblings, a
cgroup CPU quota), as llama.cpp's own tools choose. Measured on 2 cores with SmolLM2-135M
(docs/performance.md): 2 threads decode 1.6x faster than 1 on a quiet machine, but beside one
other busy process 6 to 12 times slower than 1: llama.cpp's workers meet at a barrier after
every operation, and one of them is always waiting for a time slice. So with the default
(``n_threads=None``) a :class:`ThreadTuner` looks, twice a second while decoding, at how much
of this process's CPUs other processes used (``/proc/stat`` for our CPUs, minus our own CPU
time) and decodes with the cores they leave: one thread fewer for every core's worth of
foreign load, back up when it goes. Prompt evaluation is covered too: the tuner looks before
each prompt chunk, and in a fresh engine or after a pause (the user typing, the server idle)
it looks afresh for 50 ms first, because the load averaged over the pause says nothing
about now, and a prompt evaluated with one thread too many beside a busy process is where
it costs the most (benchmarks/bench_threads.py). When no other task is runnable at that
instant (``procs_running``), the look is skipped: every core is free. A thread count the
user gives is kept.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import llama_cpp

WINDOW_S = 0.5  # how often the load is looked at (while decoding)
STALE_S = 2.0   # a look this old, spent mostly idle (a pause), says nothing about now
PROBE_S = 0.05  # the fresh look then: a busy core reads 0.8 to 1.2 cores over 50 ms (2 cores)
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


def _runnable() -> int | None:
    """Tasks runnable on the whole machine this instant, this one included (/proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class ThreadTuner:
    """Keeps a llama.cpp context's thread count at the cores other processes leave free.

    ``observe()`` between decodes (each prompt chunk, each token); every :data:`WINDOW_S` it
    measures the foreign load ``others`` (in cores) on this process's CPUs and sets
    ``threads = max_threads - floor(others + SHARE)`` (at least 1). When there is no look
    yet, or the last is older than :data:`STALE_S` and this process spent most of the time
    since idle (a pause, not one long decode of a big model), it looks afresh for
    :data:`PROBE_S` first, unless no other task is runnable at that instant. Adaptation is
    off for a fixed thread count, on one core, without /proc/stat, and under a cgroup CPU
    quota (there the host's load says little about this process's share).
    """

    def __init__(self, ctx, max_threads: int, adaptive: bool,
                 busy_seconds: Callable[[list[int]], float | None] = _busy_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 own_seconds: Callable[[], float] = time.process_time,
                 sleep: Callable[[float], None] = time.sleep,
                 runnable: Callable[[], int | None] = _runnable):
        self._ctx = ctx
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else list(range(os.cpu_count() or 1))
        self._busy, self._clock, self._own = busy_seconds, clock, own_seconds
        self._sleep, self._runnable = sleep, runnable
        quota = _cgroup_cpus()
        self.adaptive = (adaptive and max_threads > 1 and (quota is None or quota >= len(
            self._cpus)) and busy_seconds(self._cpus) is not None)
        self._mark = self._sample()
        self._looked = False  # no load looked at yet: the first decode looks first
        llama_cpp.llama_set_n_threads(ctx, max_threads, max_threads)

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), self._busy(self._cpus) or 0.0, self._own()

    def observe(self) -> None:
        """Between decodes: the thread count for the load of the last window."""
        if not self.adaptive:
            return
        since = self._clock() - self._mark[0]
        if not self._looked or (since > STALE_S and self._own() - self._mark[2] < since / 2):
            # A fresh engine or a pause (the user typing, the server idle): the next decode
            # may be a whole prompt, and the load averaged over the pause says nothing about
            # now. No other task runnable this instant: every core; else a fresh look.
            running = self._runnable()
            if running is not None and running <= 1:
                self._mark, self._looked = self._sample(), True
                self._use(self.max_threads)
                return
            self._mark = self._sample()
            self._sleep(PROBE_S)
        elif since < WINDOW_S:
            return
        sample = self._sample()
        wall = sample[0] - self._mark[0]
        others = max(0.0, ((sample[1] - self._mark[1]) - (sample[2] - self._mark[2])) / wall)
        self._mark, self._looked = sample, True
        self._use(max(1, self.max_threads - math.floor(others + SHARE)))

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self.threads = threads
            llama_cpp.llama_set_n_threads(self._ctx, threads, threads)
