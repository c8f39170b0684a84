"""cancel_and_wait ends a task that drops a cancellation, as asyncio.wait_for does on Python 3.11."""

from __future__ import annotations

import asyncio

from policies.task_stop import cancel_and_wait


async def test_a_task_that_drops_the_first_cancellation_still_ends() -> None:
    dropped = 0

    async def follower() -> None:
        nonlocal dropped
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped += 1  # what wait_for does when the cancel meets a completed send

    task = asyncio.ensure_future(follower())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait(task)
    assert task.cancelled() and dropped == 1


async def test_a_finished_or_failed_task_is_left_as_it_ended() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)  # the error is retrieved, not raised
    assert isinstance(task.exception(), ValueError)
