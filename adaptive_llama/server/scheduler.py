"""The server's scheduler: one engine, one worker thread, continuous batching over its slots.

A :class:`Job` carries one generation's checked request; its events (text pieces, each with the
log-probabilities of the tokens that made it, then the result or an error) flow back to the
asyncio loop that waits for them. The engine's ``parallel``
slots decode together; at most ``max_queue`` jobs wait besides them; one more is refused
with :class:`QueueFull`. A job whose ``cancelled`` event is set stops at the next token.
Every job ends with one INFO line on the ``adaptive_llama.server`` log: its route and model,
how it ended, its tokens and speed, the sampler and adaptive's mean k.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..runtime.batching import Generation, GenerationResult
from ..runtime.engine import Engine
from ..runtime.request import Request

log = logging.getLogger("adaptive_llama.server")


class QueueFull(Exception):
    """Every slot is taken: the running job and ``max_queue`` waiting ones."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


@dataclass
class Job:
    """A generation waiting for, or holding, the model; events flow back to the event loop."""

    request: Request
    stream: bool  # the client wants the pieces as they come (otherwise only the result)
    loop: asyncio.AbstractEventLoop
    label: str = ""  # "/api/chat smollm2": what its log line starts with
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens_sent: int = 0  # tokens whose log-probabilities and figures went out with a piece
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Scheduler:
    """Runs jobs on the engine's slots, on one worker thread (continuous batching).

    Up to ``engine.parallel`` jobs decode together, one token each per step; a job that
    arrives takes a free slot between two steps; at most ``max_queue`` more wait, in arrival
    order. A job whose ``cancelled`` is set stops at the next step and frees its slot.
    """

    OUTCOMES = ("completed", "cancelled", "failed")  # how jobs end, counted

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.accepted = 0  # waiting or running
        self.running = 0
        self.counts = dict.fromkeys(self.OUTCOMES, 0)
        # what the jobs that ran did, for /metrics: tokens and the seconds they took
        self.totals = {"prompt_tokens": 0, "prompt_s": 0.0, "predicted_tokens": 0,
                       "predicted_s": 0.0}
        self.last_done = time.monotonic()  # when the latest job ended (idle since then)
        self._active: dict[Generation, Job] = {}  # the jobs in slots (the worker's)
        self._thread = threading.Thread(target=self._work, name="adaptive-llama-worker",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            # Counted from submission to the end of the run, so that a burst arriving before
            # the worker wakes up still gets every slot plus max_queue waiting places.
            if self.accepted >= self.max_queue + self.engine.parallel:
                raise QueueFull(self.waiting)
            self.accepted += 1
        self._jobs.put(job)

    @property
    def waiting(self) -> int:
        return self.accepted - self.running

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def fail_all(self, error: Exception) -> None:
        """Tell every running and waiting job that it failed with ``error``: the process is
        about to end (llama.cpp lost an RPC worker while the worker thread is inside a
        decode, which never returns)."""
        jobs = list(self._active.values())
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in filter(None, jobs):
            job.emit("error", error)

    def _work(self) -> None:
        engine = self.engine
        active = self._active
        while True:
            # Take new jobs into free slots; sleep on the queue only when nothing runs.
            while engine.free_slots:
                try:
                    job = self._jobs.get(block=not active)
                except queue.Empty:
                    break
                if job is None:
                    return
                generation = self._start(job)
                if generation is not None:
                    active[generation] = job
            for generation, job in active.items():
                if job.cancelled.is_set():  # the client left: free the slot now
                    engine.cancel(generation)
            try:
                engine.step()
            except Exception as exc:  # every running job is told; the worker keeps serving
                log.exception("decoding failed")
                for generation, job in active.items():
                    job.emit("error", exc)
                    self._done(job, "failed", generation.result)
                active.clear()
                continue
            for generation, job in list(active.items()):
                pieces = generation.take()
                if job.stream:
                    for piece in pieces:  # the tokens since the last piece go with this one
                        job.emit("piece", (piece, *self._new_tokens(job, generation.result)))
                if generation.done:
                    result = generation.result
                    job.emit("done", result)
                    self._done(job, "cancelled" if result.finish_reason == "interrupted"
                               else "completed", result)
                    del active[generation]

    @staticmethod
    def _new_tokens(job: Job, result: GenerationResult) -> tuple[list, list]:
        """The log-probabilities and the adaptive figures (each empty when not made) of the
        tokens since the job's last piece, copied here: the worker goes on appending."""
        start, end = job.tokens_sent, len(result.tokens)
        job.tokens_sent = end
        return result.logprobs[start:end], result.token_stats[start:end]

    def _start(self, job: Job) -> Generation | None:
        """The job's generation in a slot, or None when it ends before (left, or failed)."""
        if not job.cancelled.is_set():
            try:
                generation = self.engine.begin(job.request)
            except Exception as exc:  # reported to the client
                log.exception("could not start a generation")
                job.emit("error", exc)
                self._count_out(job, "failed")
                return None
            with self._lock:
                self.running += 1
            return generation
        self._count_out(job, "cancelled")  # the client left while waiting
        return None

    def _done(self, job: Job, outcome: str, result: GenerationResult) -> None:
        with self._lock:
            self.running -= 1
        self._count_out(job, outcome, result)

    def _count_out(self, job: Job, outcome: str, result: GenerationResult | None = None
                   ) -> None:
        with self._lock:
            self.accepted -= 1
            self.counts[outcome] += 1
            self.last_done = time.monotonic()
            if result is not None:
                self.totals["prompt_tokens"] += result.prompt_tokens
                self.totals["prompt_s"] += result.prompt_eval_s
                self.totals["predicted_tokens"] += result.completion_tokens
                self.totals["predicted_s"] += result.decode_s
        log.info("%s", _log_line(job, outcome, result))


def _log_line(job: Job, outcome: str, result: GenerationResult | None) -> str:
    """``/v1/chat/completions smollm2: completed (stop), 25 + 12 tokens, 41.3 tok/s,
    adaptive:eps=0.0005, mean k 4.2`` (and with speculation ``, drafts kept 9/12 (75%)``)."""
    request = job.request
    if result is None:  # it never ran
        return f"{job.label}: {outcome}, {len(request.prompt_tokens)} prompt tokens"
    mean_k = f", mean k {result.mean_k:.1f}" if result.mean_k is not None else ""
    drafts = f", {result.drafts_kept}" if result.drafts_kept else ""
    return (f"{job.label}: {outcome} ({result.finish_reason}), {result.prompt_tokens} + "
            f"{result.completion_tokens} tokens, {result.decode_tokens_per_s:.1f} tok/s, "
            f"{result.sampler}{mean_k}{drafts}")
