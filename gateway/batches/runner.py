"""The task that answers the jobs' lines, a few at a time, and moves each job through its statuses.

Lines of all jobs share `batches.concurrency` slots (2 by default), taken in turn by the jobs in
progress, so a batch never crowds out interactive requests; filling idle upstream capacity beyond
that is flow control's (priority classes at the upstream members), not the runner's.

Exactly once in the output and the ledger, at least once to the upstream: a line's result is
recorded (with its state, in one transaction) before its context is completed (the metering hook
writes its ledger row), and a recorded line never runs again. A line cut off by a shutdown is
neither recorded nor completed: it runs again after the restart, and its upstream may have seen
it twice. The record-then-complete step is shielded, so a shutdown never separates the two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from gateway.batches.jobs import Job, JobStore, PendingLine
from gateway.batches.lines import Deferred, Done, LineRunner
from gateway.settings import BatchSettings

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often jobs are looked at without a wake-up (expiry, a store written by another process)
SWEEP_S = 600.0  # how often expired files and old jobs are deleted
MAX_DEFER_S = 60.0


class BatchRunner:
    """Started and stopped by the app's cleanup context; `wake()` after a job is created or cancelled."""

    def __init__(self, store: JobStore, lines: LineRunner, settings: BatchSettings) -> None:
        self.store = store
        self.lines = lines
        self.settings = settings
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # (job id, line idx) -> the task answering it
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._reading: dict[str, asyncio.Task[None]] = {}  # job id -> the task reading its next lines
        self._queued: dict[str, deque[PendingLine]] = {}  # lines read ahead, per job
        self._cursor: dict[str, int] = {}  # the last line idx read, per job
        # NOTE: lines started by this process and not given back (deferred, or not recorded): a read that
        # overlaps one (after a cursor was moved back) never queues it again, even once it was recorded
        self._started: dict[str, set[int]] = {}
        self._epoch: dict[str, int] = {}  # bumped when a job's reads are reset: a read begun before is dropped
        self._held_until: dict[str, float] = {}  # job id -> monotonic time its lines wait for (refused admission)
        self._turn = 0  # round robin over the jobs
        self._next_sweep = 0.0
        self.clock: Callable[[], float] = time.time  # the wall clock windows expire by

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="tierlane-batch-runner")

    def wake(self) -> None:
        self._wake.set()

    def running(self, job_id: str) -> list[int]:
        return [idx for (job, idx) in self._running if job == job_id]

    async def close(self) -> None:
        """Stop: lines in flight are cut off (they stay pending and run after a restart)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = [*self._running.values(), *self._reading.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store hiccup: logged, and the next step tries again
                log.exception("the batch runner's step failed")
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass
            self._wake.clear()

    async def step(self) -> None:
        """Move every job on: start it, end what is over, run lines in the free slots, finish what is done."""
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_S
            await self.store.sweep(self.settings.retention_s)
        jobs = await self.store.active()
        runnable: list[Job] = []
        for job in jobs:
            if job.status == "validating":
                await self.store.start(job.id)
                refreshed = await self.store.get(job.tenant, job.id)
                if refreshed is None or refreshed.status != "in_progress":
                    continue
                job = refreshed
            if job.status == "cancelling":
                await self._end_pending(job, "canceled")
            elif job.status == "in_progress" and self.clock() >= job.expires_at:
                await self._end_pending(job, "expired")
            elif job.status == "in_progress":
                runnable.append(job)
            if job.status == "finalizing" or not self.running(job.id):
                await self._maybe_finish(job)
        self._fill(runnable)
        known = {job.id for job in jobs}
        for gone in set(self._queued) - known:
            self._forget(gone)

    async def _end_pending(self, job: Job, state: str) -> None:
        self._forget(job.id)
        await self.store.end_pending(job.id, state, self.running(job.id))

    def _forget(self, job_id: str) -> None:
        self._queued.pop(job_id, None)
        self._cursor.pop(job_id, None)
        self._held_until.pop(job_id, None)
        self._started.pop(job_id, None)
        self._epoch[job_id] = self._epoch.get(job_id, 0) + 1

    async def _maybe_finish(self, job: Job) -> None:
        fresh = await self.store.get(job.tenant, job.id)
        if fresh is None or fresh.pending > 0 or self.running(job.id):
            return
        if fresh.cancelling_at is not None:  # (also after a restart that found it finalizing)
            final = "cancelled"
        else:
            final = "expired" if fresh.n_expired > 0 else "completed"
            if fresh.status != "finalizing":
                await self.store.finalizing(job.id)
        await self.store.finish(job.id, final)
        self._forget(job.id)
        log.info("batch %s of tenant %s ended %s: %d succeeded, %d errored, %d canceled, %d expired", job.id, job.tenant,
                 final, fresh.n_succeeded, fresh.n_errored, fresh.n_canceled, fresh.n_expired)

    def _fill(self, jobs: list[Job]) -> None:
        """Start lines in the free slots, one job after another in turn."""
        if not jobs:
            return
        now = time.monotonic()
        ready = [job for job in jobs if self._held_until.get(job.id, 0.0) <= now]
        idle: set[str] = set()
        while len(self._running) < self.settings.concurrency and len(idle) < len(ready):
            job = ready[self._turn % len(ready)]
            self._turn += 1
            queue = self._queued.get(job.id)
            if not queue:
                idle.add(job.id)
                self._refill(job)
                continue
            line = queue.popleft()
            self._started.setdefault(job.id, set()).add(line.idx)
            task = asyncio.get_running_loop().create_task(self._answer(job, line), name=f"tierlane-batch-{job.id}-{line.idx}")
            self._running[(job.id, line.idx)] = task

    def _refill(self, job: Job) -> None:
        """Read the job's next lines in the background; they start once read."""
        if job.id not in self._reading:
            self._reading[job.id] = asyncio.get_running_loop().create_task(self._read(job), name=f"tierlane-batch-read-{job.id}")

    async def _read(self, job: Job) -> None:
        lines: list[PendingLine] = []
        epoch = self._epoch.get(job.id, 0)
        try:
            lines = await self.store.pending(job.id, self._cursor.get(job.id, -1), 4 * self.settings.concurrency)
            if lines and self._epoch.get(job.id, 0) == epoch:
                started = self._started.get(job.id, set())
                self._cursor[job.id] = lines[-1].idx
                self._queued.setdefault(job.id, deque()).extend(line for line in lines if line.idx not in started)
        finally:
            self._reading.pop(job.id, None)
            if lines:
                self.wake()

    async def _answer(self, job: Job, line: PendingLine) -> None:
        try:
            try:
                done = await self.lines.run(job, line)
            except Deferred as deferred:
                self._retry_later(job, line, deferred.retry_after)
                return
            # NOTE: shielded: once answered, the line is recorded and then completed whole, even when a
            # shutdown cancels this task meanwhile (close() waits for it).
            finishing = asyncio.ensure_future(self._finish(job, line, done))
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                await finishing
                raise
        except asyncio.CancelledError:
            raise
        except Exception:  # the store failed: the line stays pending and is tried again
            log.exception("batch line %s of %s could not be recorded", line.custom_id, job.id)
            self._retry_later(job, line, 5.0)
        finally:
            self._running.pop((job.id, line.idx), None)
            self.wake()

    def _retry_later(self, job: Job, line: PendingLine, seconds: float) -> None:
        """Hold the job's lines for `seconds`, then read them again from this one."""
        wait = min(MAX_DEFER_S, max(0.05, seconds))
        self._held_until[job.id] = time.monotonic() + wait
        self._cursor[job.id] = min(self._cursor.get(job.id, -1), line.idx - 1)
        self._queued.pop(job.id, None)
        self._started.get(job.id, set()).discard(line.idx)
        self._epoch[job.id] = self._epoch.get(job.id, 0) + 1
        asyncio.get_running_loop().call_later(wait, self.wake)

    async def _finish(self, job: Job, line: PendingLine, done: Done) -> None:
        try:
            await self.store.record(job.id, line.idx, done.state, done.result)
        finally:
            # completed even when recording failed: the budget reservation is settled either way
            # (the line, still pending, then runs again: at least once)
            if done.ctx is not None and done.outcome is not None:
                self.lines.pipeline.complete(done.ctx, done.outcome)
