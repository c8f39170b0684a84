"""Stopping a background task for good, even when one cancellation is lost on the way."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

_AGAIN_S = 0.1  # a cancellation that has not ended the task by then is sent again


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and return once it has ended (its result or error is dropped).

    NOTE: one cancel() is not always enough on Python 3.11: asyncio.wait_for, which redis-py
    uses to send every command, drops a cancellation that arrives just as the send completes
    (CPython gh-86296, fixed in 3.12). A stream follower cancelled at that moment went on
    reading forever and the close that awaited it never returned; so the cancellation is sent
    again until the task has ended.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=_AGAIN_S)
    with contextlib.suppress(BaseException):
        task.result()  # retrieved, so the loop does not log it as never retrieved
