"""One replay end to end: drive the workload, ask the gateway for its usage, build the report."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from gateway.replay.driver import Driver, RequestResult, fetch_usage
from gateway.replay.report import build_report
from gateway.replay.workload import WorkItem


async def replay(
    items: Sequence[WorkItem],
    url: str,
    *,
    concurrency: int = 8,
    api_key: str | None = None,
    stream: bool = True,
    timeout_s: float = 300.0,
    time_scale: float = 1.0,
    usage_wait_s: float = 10.0,
    show_progress: bool = True,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay `items` against the gateway at `url` and return the report (see `build_report`)."""
    driver = Driver(
        url, concurrency=concurrency, api_key=api_key, stream=stream, timeout_s=timeout_s, time_scale=time_scale
    )
    with tqdm(total=len(items), desc="replay", unit="req", disable=not show_progress) as bar:

        errors = 0

        def tick(result: RequestResult) -> None:
            nonlocal errors
            errors += not result.ok
            if errors:
                bar.set_postfix_str(f"errors {errors}", refresh=False)
            bar.update(1)

        start = time.time()
        results = await driver.run(items, progress=tick)
        end = time.time()
    # The ledger stamps a request with its start; the window is widened a little for clock
    # rounding. Requests that got an HTTP answer are the ones the gateway metered.
    answered = sum(1 for r in results if r.status != 0)
    usage, missing = await fetch_usage(
        url, start - 0.5, end + 0.5, api_key, expect=answered, wait_s=usage_wait_s
    )
    info = {
        "url": driver.root,
        "concurrency": concurrency,
        "stream": stream,
        "time_scale": time_scale,
        **(meta or {}),
    }
    return build_report(results, start=start, end=end, meta=info, usage=usage, usage_missing=missing)
