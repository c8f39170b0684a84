"""A process that meters requests into a real ledger, for the SIGTERM and kill -9 tests.

usage: ledger_child.py STATE_DIR COMMIT_WINDOW_S BATCH BATCHES
Meters BATCH requests, prints `metered <total>`, waits 3 commit windows, repeats BATCHES
times, then waits; on SIGTERM it closes the telemetry (as the gateway does) and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from gateway.context import Outcome, Principal, RequestContext, Usage
from policies.policy import Policy
from telemetry import Telemetry, TelemetryConfig
from telemetry.tokens import heuristic_count


async def main(state_dir: Path, window: float, batch: int, batches: int) -> None:
    telemetry = Telemetry(
        TelemetryConfig(state_dir=state_dir, commit_window_s=window, tracing=False, metrics=False),
        Policy.load(),
        env={},
        token_count=heuristic_count,
    )
    await telemetry.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    total = 0
    for b in range(batches):
        for i in range(batch):
            ctx = RequestContext(
                request_id=f"req_{b}_{i}",
                operation="chat",
                body={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
                headers={},
                principal=Principal(tenant="acme", app="web"),
                model="gpt-4o-mini",
                usage=Usage(input_tokens=10, output_tokens=5),
            )
            await telemetry.meter(ctx, Outcome(status=200, response=None, complete=True))
            total += 1
        print(f"metered {total}", flush=True)
        if b + 1 < batches:
            await asyncio.sleep(3 * window)
    await stop.wait()
    await telemetry.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
