"""Waiting for a gateway replica's fleet usage (`state.backend: redis`) to reach the store."""

from __future__ import annotations

from gateway.keys import PIPELINE, SERVICES
from tests.support.background import BackgroundLoop, RunningApp


def settle(bg: BackgroundLoop, gw: RunningApp) -> None:
    """Wait for the meter hooks, the ledger commit and the fleet writes of what was served."""

    async def flush() -> None:
        await gw.app[PIPELINE].drain()
        telemetry = gw.app[SERVICES].telemetry
        await telemetry.usage(telemetry.usage_query({}))  # commits what was appended
        assert telemetry.fleet is not None
        await telemetry.fleet.flush()

    bg.call(flush())
