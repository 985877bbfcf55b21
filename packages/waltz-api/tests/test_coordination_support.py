"""waltz_api.coordination_support: delivery on the loop, in order, coalesced, robust."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from waltz_api.contracts.coordination import SessionState
from waltz_api.coordination_support import DeliveryWatch, LoopDelivery, SessionStateTracker


async def test_values_pushed_from_threads_arrive_on_the_loop_in_order() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    threads: set[int] = set()

    def callback(value: int) -> None:
        threads.add(threading.get_ident())
        seen.append(value)

    delivery: LoopDelivery[int] = LoopDelivery(loop, callback, coalesce=False)

    def producer() -> None:
        for i in range(500):
            delivery.push(i)

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join(10)
    for _ in range(200):
        if len(seen) == 500:
            break
        await asyncio.sleep(0.01)
    assert seen == list(range(500))
    assert threads == {threading.get_ident()}


async def test_coalescing_keeps_the_last_value_and_order() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []

    async def slow(value: int) -> None:
        await asyncio.sleep(0.01)
        seen.append(value)

    delivery: LoopDelivery[int] = LoopDelivery(loop, slow, coalesce=True)
    for i in range(100):
        delivery.push(i)
        if i % 10 == 0:
            await asyncio.sleep(0)
    for _ in range(300):
        if seen and seen[-1] == 99:
            break
        await asyncio.sleep(0.01)
    assert seen[-1] == 99, "the final value is always delivered"
    assert seen == sorted(set(seen)), "values arrive in order, each once"
    assert len(seen) < 100, "consecutive values were coalesced"


async def test_a_failing_callback_is_logged_and_delivery_continues(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[int] = []

    def callback(value: int) -> None:
        seen.append(value)
        if value == 1:
            raise RuntimeError("boom")

    delivery: LoopDelivery[int] = LoopDelivery(asyncio.get_running_loop(), callback, coalesce=False)
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            delivery.push(i)
        for _ in range(100):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.01)
    assert seen == [0, 1, 2]
    assert "boom" in caplog.text


async def test_cancel_stops_delivery_and_runs_the_hook() -> None:
    seen: list[int] = []
    cancelled: list[bool] = []
    delivery: LoopDelivery[int] = LoopDelivery(asyncio.get_running_loop(), seen.append)
    watch = DeliveryWatch(delivery, lambda: cancelled.append(True))
    delivery.push(1)
    await delivery.wait_idle()
    await asyncio.sleep(0.01)
    watch.cancel()
    watch.cancel()
    delivery.push(2)
    await asyncio.sleep(0.05)
    assert seen == [1] and cancelled == [True] and watch.cancelled


async def test_session_tracker_lost_is_final_and_close_silences() -> None:
    tracker = SessionStateTracker(asyncio.get_running_loop())
    states: list[SessionState] = []
    tracker.add_listener(states.append)
    assert not tracker.set_state(SessionState.CONNECTED), "unchanged state is not notified"
    assert tracker.set_state(SessionState.SUSPENDED)
    assert tracker.set_state(SessionState.CONNECTED)
    assert tracker.set_state(SessionState.LOST)
    assert not tracker.set_state(SessionState.CONNECTED), "LOST is final"
    await tracker.wait_idle()
    await asyncio.sleep(0.01)
    assert states == [SessionState.SUSPENDED, SessionState.CONNECTED, SessionState.LOST]
    assert tracker.lost

    other = SessionStateTracker(asyncio.get_running_loop())
    heard: list[SessionState] = []
    other.add_listener(heard.append)
    other.close()
    assert not other.set_state(SessionState.LOST)
    await asyncio.sleep(0.01)
    assert heard == []


async def test_session_tracker_inline_delivers_before_set_state_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The asyncio-native plugins' mode: a tracker created LOST (not started) begins
    once, every listener has run when set_state returns (a listener that raises does not
    stop the others), LOST is final, and close(final=...) changes the state silently."""
    tracker = SessionStateTracker(
        None, SessionState.LOST, inline=True, describe=lambda: "test session 7"
    )
    order: list[str] = []

    def failing(state: SessionState) -> None:
        order.append(f"failing:{state.value}")
        raise RuntimeError("a listener bug")

    tracker.add_listener(failing)
    tracker.add_listener(lambda state: order.append(f"second:{state.value}"))
    assert tracker.lost
    with caplog.at_level(logging.INFO, logger="waltz_api.coordination_support"):
        assert tracker.set_state(SessionState.CONNECTED), "a session not started begins"
        assert order == ["failing:connected", "second:connected"]  # already, no await
        assert tracker.set_state(SessionState.SUSPENDED)
        assert not tracker.set_state(SessionState.SUSPENDED)
        assert tracker.set_state(SessionState.LOST)
        assert not tracker.set_state(SessionState.CONNECTED), "LOST is final once begun"
    assert order[2:] == ["failing:suspended", "second:suspended", "failing:lost", "second:lost"]
    assert "test session 7: connected -> suspended" in caplog.text
    assert "a listener bug" in caplog.text
    await tracker.wait_idle()  # nothing queued: returns at once

    closed = SessionStateTracker(None, SessionState.LOST, inline=True)
    heard: list[SessionState] = []
    closed.add_listener(heard.append)
    assert closed.set_state(SessionState.CONNECTED)
    closed.close(final=SessionState.LOST)
    assert closed.state is SessionState.LOST and heard == [SessionState.CONNECTED]
    assert not closed.set_state(SessionState.CONNECTED)
    with pytest.raises(TypeError, match="needs the loop"):
        SessionStateTracker(None)
