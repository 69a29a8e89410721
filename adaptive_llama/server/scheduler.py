"""The server's scheduler: one engine, one worker thread, jobs in arrival order.

A :class:`Job` carries one generation's request; its events (text pieces, then the result
or an error) flow back to the asyncio loop that waits for them. At most ``max_queue`` jobs
wait besides the running one; one more is refused with :class:`QueueFull`. A job whose
``cancelled`` event is set stops at the next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..engine import Engine
from ..samplers import SamplerSpec

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is taken: the running job and ``max_queue`` waiting ones."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


@dataclass
class Job:
    """A generation waiting for, or holding, the model; events flow back to the event loop."""

    prompt_tokens: list[int]
    sampler: SamplerSpec
    max_tokens: int
    seed: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Scheduler:
    """Runs jobs on the engine one at a time, in arrival order, on one worker thread."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.accepted = 0  # waiting or running
        self.running = False
        self.counts = {"completed": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._work, name="adaptive-llama-worker",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            # Counted from submission to the end of the run, so that a burst arriving before
            # the worker wakes up still gets one running slot plus max_queue waiting ones.
            if self.accepted >= self.max_queue + 1:
                raise QueueFull(self.waiting)
            self.accepted += 1
        self._jobs.put(job)

    @property
    def waiting(self) -> int:
        return self.accepted - self.running

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.running = True
            try:
                self._run(job)
            finally:
                with self._lock:
                    self.running = False
                    self.accepted -= 1

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while waiting
            self.counts["cancelled"] += 1
            return
        try:
            stream = self.engine.stream(job.prompt_tokens, sampler=job.sampler,
                                        max_tokens=job.max_tokens, seed=job.seed,
                                        stop=job.stop)
            for piece in stream:
                if job.cancelled.is_set():
                    stream.cancel()  # the engine keeps its state consistent
                    break
                job.emit("piece", piece)
        except Exception as exc:  # reported to the client; the worker keeps serving
            log.exception("generation failed")
            job.emit("error", exc)
            return
        key = "cancelled" if stream.result.finish_reason == "interrupted" else "completed"
        self.counts[key] += 1
        job.emit("done", stream.result)
