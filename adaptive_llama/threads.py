"""How many CPU threads llama.cpp decodes with: a measured default, adapted while it runs.

The default is the physical cores this process may use (CPU affinity, no SMT siblings, a
cgroup CPU quota), as llama.cpp's own tools choose. Measured on 2 cores with SmolLM2-135M
(models.md): 2 threads decode 1.5x faster than 1 on a quiet machine, but with one other busy
process they collapse to 0.43x of 1 thread, because llama.cpp's workers meet at a barrier
after every operation and one of them is always waiting for a time slice. So with the default
(``n_threads=None``) a :class:`ThreadTuner` watches the time of each decode step and, when
the steps get slower than the best it has seen, or now and then, tries one thread fewer or
more for a few steps and keeps whichever is faster. A thread count the user gives is kept.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import llama_cpp

PROBE_STEPS = 6          # steps timed at the other thread count
FIRST_PROBE_AFTER = 128  # steps; doubled after a probe that changes nothing ...
LAST_PROBE_AFTER = 4096  # ... up to this
SLOWER = 1.3             # steps this much slower than the best seen start a probe now
BETTER = 0.9             # a probe wins when its median step is below this fraction


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


class ThreadTuner:
    """Adapts a llama.cpp context's thread count to the time its decode steps take.

    Fed one ``observe`` per decode step (the seconds it took and the batch size: only steps
    of the same size are compared). Not thread-safe: one decoder calls it.
    """

    def __init__(self, ctx, max_threads: int, adaptive: bool):
        self._ctx = ctx
        self.max_threads = max_threads
        self.threads = max_threads
        self.adaptive = adaptive and max_threads > 1
        self._size = None
        self._recent: list[float] = []
        self._best: dict[tuple[int, int], float] = {}  # (threads, size) -> best median
        self._probe: list[float] | None = None
        self._steps = 0
        self._interval = FIRST_PROBE_AFTER
        self._set(max_threads)

    def _set(self, n: int) -> None:
        llama_cpp.llama_set_n_threads(self._ctx, n, n)
        self._current = n

    def observe(self, batch_size: int, seconds: float) -> None:
        if not self.adaptive:
            return
        if batch_size != self._size:  # a new batch size: earlier steps do not compare
            self._size, self._recent, self._probe = batch_size, [], None
            self._set(self.threads)
        if self._probe is not None:
            self._probe.append(seconds)
            if len(self._probe) == PROBE_STEPS:
                self._decide()
            return
        self._recent = (self._recent + [seconds])[-PROBE_STEPS:]
        self._steps += 1
        if len(self._recent) < PROBE_STEPS:
            return
        now = statistics.median(self._recent)
        key = (self.threads, batch_size)
        self._best[key] = min(self._best.get(key, now), now)
        if self._steps >= self._interval or now > SLOWER * self._best[key]:
            self._probe = []
            self._set(self._other())

    def _other(self) -> int:
        if self.threads == self.max_threads:
            return self.threads - 1
        if self.threads == 1:
            return 2
        # In between: try the direction not tried last.
        return self.threads + 1 if self._steps % 2 else self.threads - 1

    def _decide(self) -> None:
        probe, recent = statistics.median(self._probe), statistics.median(self._recent)
        if probe < BETTER * recent:
            self.threads = self._current
            self._interval = FIRST_PROBE_AFTER
            self._best[(self.threads, self._size)] = probe
        else:  # the slower steps are the new normal here: no probe again until they worsen
            self._interval = min(2 * self._interval, LAST_PROBE_AFTER)
            self._best[(self.threads, self._size)] = recent
            self._set(self.threads)
        self._recent, self._probe, self._steps = [], None, 0
