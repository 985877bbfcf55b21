"""A cancelled submission stops, whatever moment the cancellation arrives at."""

from __future__ import annotations

import asyncio

import pytest

from waltz_client import AsyncWaltzClient, ClientConfig, Transaction, WaltzClientCallbacks

pytestmark = pytest.mark.timeout(60)


class Callbacks(WaltzClientCallbacks):
    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        pass


async def test_a_wait_before_the_deadline_never_loses_a_cancellation() -> None:
    """The wait of a submission for its partition (mounted, or its retry) is cancelled
    in the loop iteration that completes it: the cancellation must win. (Python 3.11's
    ``asyncio.wait_for`` returns the result instead, and the submission ran on: one
    Ctrl-C could not stop ``waltz perf``.)"""
    client = AsyncWaltzClient(Callbacks(), ClientConfig("local:///unused"))
    loop = asyncio.get_running_loop()
    ran_on = 0
    for _ in range(200):
        event = asyncio.Event()

        async def submission(event: asyncio.Event = event) -> None:
            await client._before_deadline(event.wait(), loop.time() + 60)

        task = loop.create_task(submission())
        await asyncio.sleep(0)  # the task waits for the event
        event.set()  # the wait completes ...
        task.cancel()  # ... as the submission is cancelled
        try:
            await task
            ran_on += 1
        except asyncio.CancelledError:
            pass
    assert ran_on == 0, f"{ran_on} of 200 cancelled submissions ran on"
