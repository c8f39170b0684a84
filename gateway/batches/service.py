"""The Batch API's stores and runner, opened and closed with the app (after the pipeline, before it closes).

Local only: jobs and files are kept in state_dir/batches.sqlite3, which one gateway owns. With
`state.backend: redis` (replicas sharing state) the Batch API answers every call with a 501 that
says so, rather than keep jobs one replica alone would see and run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from gateway.batches.database import Database
from gateway.batches.files import FileStore
from gateway.batches.jobs import JobStore, Limits
from gateway.batches.lines import LineRunner
from gateway.batches.runner import BatchRunner
from gateway.errors import GatewayError
from gateway.keys import PIPELINE, SETTINGS
from gateway.settings import BatchSettings, Settings


class BatchesUnavailable(GatewayError):
    status = 501
    type = "invalid_request_error"
    code = "batches_unavailable"


@dataclass(slots=True)
class Batches:
    """What the Batch API's routes use."""

    settings: BatchSettings
    files: FileStore
    jobs: JobStore
    runner: BatchRunner

    @property
    def limits(self) -> Limits:
        return Limits(jobs=self.settings.max_active_jobs_per_tenant, lines=self.settings.max_queued_lines_per_tenant)


BATCHES = web.AppKey("batches", Batches)


def unavailable(settings: Settings) -> str | None:
    """Why the Batch API is off in this gateway, or None when it runs."""
    if not settings.batches.enabled:
        return "the Batch API is switched off on this gateway (batches.enabled: false)"
    if settings.state.backend == "redis":
        return ("the Batch API keeps its jobs in this gateway's state_dir (batches.sqlite3), which replicas sharing state "
                "(state.backend: redis) would not see; run batches on a gateway with the embedded state backend")
    return None


def batches_of(app: web.Application) -> Batches:
    """The running Batch API, or a 501 saying why there is none."""
    found = app.get(BATCHES)
    if found is None:
        raise BatchesUnavailable(unavailable(app[SETTINGS]) or "the Batch API has not started")
    return found


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Open the store and start the runner; on shutdown stop the runner first (lines in flight stay pending)."""
    settings = app[SETTINGS]
    if unavailable(settings) is not None:
        yield
        return
    database = Database(settings.state_dir / "batches.sqlite3")
    await database.open()
    config = settings.batches
    runner = BatchRunner(JobStore(database, config.retention_s), LineRunner(app[PIPELINE], settings), config)
    app[BATCHES] = Batches(config, FileStore(database, config.retention_s), runner.store, runner)
    runner.start()
    try:
        yield
    finally:
        try:
            await runner.close()
        finally:
            await database.close()
