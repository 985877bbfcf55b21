"""What a run does at its end (the drain of the open submissions) and what it runs (the
seed's mix of configurations, plain-callback clients on the callback thread's stand-in)."""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable
from typing import Any

import pytest
from sim_support import idle_process, in_world

from waltz_client import AsyncWaltzClient
from waltz_sim import SimConfig, run_seed
from waltz_sim.loop import START_TIME, CallbackThread
from waltz_sim.runner import (
    EXACT_SHARE,
    FIVE_NODES_SHARE,
    PLAIN_SHARE,
    REPLACE_SHARE,
    mixed,
    replay_command,
)
from waltz_sim.world import CATCH_UP, World

DURATION = 20.0
SUBMISSIONS_END = START_TIME + DURATION - CATCH_UP


def _late_answers(monkeypatch: pytest.MonkeyPatch, delay: float | None) -> None:
    """Ops submitted in the last second before the submissions end are answered
    ``delay`` seconds late (None: never)."""
    submit = AsyncWaltzClient.submit

    async def late(self: AsyncWaltzClient, context: Any) -> Any:
        loop = asyncio.get_running_loop()
        late = loop.time() > SUBMISSIONS_END - 1.0
        result = await submit(self, context)
        if late:
            await (asyncio.sleep(delay) if delay is not None else loop.create_future())
        return result

    monkeypatch.setattr(AsyncWaltzClient, "submit", late)


def _config(seed: int = 2) -> SimConfig:
    return SimConfig(seed=seed, faults="none", duration=DURATION)


def test_the_run_waits_for_the_open_submissions_before_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_answers(monkeypatch, 6.0)
    result = run_seed(_config(), keep_trace=True)
    assert result.ok, [str(v) for v in result.violations]
    assert "pending" not in result.outcomes
    # the drain waited for the late answers (6 s), then the feeds caught up
    assert "drain: every op is answered" in result.trace_text
    assert result.sim_seconds > DURATION + 3.0


def test_a_submission_never_answered_is_undecided_whenever_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_answers(monkeypatch, None)
    result = run_seed(_config(), keep_trace=True)
    undecided = [v for v in result.violations if v.invariant == "undecided"]
    assert undecided and {v.invariant for v in result.violations} == {"undecided"}
    assert all("waited for every open submission" in v.message for v in undecided)
    assert result.outcomes["pending"] == len(undecided)
    assert re.search(r"drain: \d+ ops still open", result.trace_text)
    # the drain gave them the decision deadline after the submissions ended, and a second
    deadline = _config().liveness.decision_deadline
    assert result.sim_seconds == pytest.approx(
        DURATION - CATCH_UP + deadline + 1.0 + CATCH_UP - 1.0, abs=0.5
    )


def test_every_committed_op_reports_its_id() -> None:
    result = run_seed(_config(), keep_trace=True)
    ids = [int(m) for m in re.findall(r" ok \S+ p\d -> (-?\d+)", result.trace_text)]
    assert len(ids) == result.outcomes["ok"] > 50
    assert min(ids) >= 0


def test_a_seed_chooses_its_configuration_and_the_replay_pins_it() -> None:
    chosen = [mixed(SimConfig(seed=seed)) for seed in range(600)]
    assert chosen == [mixed(SimConfig(seed=seed)) for seed in range(600)]
    shares = collections.Counter()
    for config in chosen:
        shares["exact"] += config.lock_table == "exact"
        shares["five"] += config.storage_nodes == 5
        shares["plain"] += config.callbacks == "plain"
        shares["replace"] += config.membership == "replace"
    assert shares["exact"] / 600 == pytest.approx(EXACT_SHARE, abs=0.06)
    assert shares["five"] / 600 == pytest.approx(FIVE_NODES_SHARE, abs=0.06)
    assert shares["plain"] / 600 == pytest.approx(PLAIN_SHARE, abs=0.06)
    assert shares["replace"] / 600 == pytest.approx(REPLACE_SHARE, abs=0.06)
    # what is given stays; the rest is what the seed chooses anyway
    both = next(c for c in chosen if c.lock_table == "exact" and c.callbacks == "plain")
    pinned = mixed(SimConfig(seed=both.seed, lock_table="hwm-array"), {"lock_table"})
    assert (pinned.lock_table, pinned.callbacks) == ("hwm-array", "plain")
    # the replay names every chosen field, so it replays the run even where a seed
    # would choose otherwise
    command = replay_command(both)
    assert f"--lock-table exact --callbacks plain --seed {both.seed}" not in command
    for flag in (
        "--lock-table exact",
        "--callbacks plain",
        f"--storage-nodes {both.storage_nodes}",
        f"--membership {both.membership}",
    ):
        assert flag in command


def test_plain_callback_clients_run_on_the_callback_threads_stand_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: collections.Counter[str] = collections.Counter()
    submit = CallbackThread.submit

    def counted(self: CallbackThread, fn: Callable[..., Any], /, *args: Any) -> Any:
        calls[getattr(fn, "__name__", repr(fn))] += 1
        return submit(self, fn, *args)

    monkeypatch.setattr(CallbackThread, "submit", counted)
    result = run_seed(SimConfig(seed=1, faults="mild", duration=DURATION, callbacks="plain"))
    assert result.ok, [str(v) for v in result.violations]
    assert result.outcomes["ok"] > 50
    # the builds (high-water mark and execute together), the applies in runs, the mounts
    assert calls["_run_builds"] > 50
    assert calls["apply_all"] > 50
    assert calls["client_high_water_mark"] >= 8  # a mount of each partition by each client


def test_the_callback_threads_stand_in_runs_calls_in_order_and_dies_with_its_process() -> None:
    async def scenario(world: World) -> list[str]:
        process = idle_process(world, "app")
        thread = CallbackThread(world.loop)
        ran: list[str] = []

        def submit(*names: str) -> None:  # from the process, as its client code would
            for name in names:
                thread.submit(ran.append, name)

        context = process.incarnation.context
        world.loop.call_soon(submit, "a", "b", "c", context=context)
        await asyncio.sleep(0.1)
        assert ran == ["a", "b", "c"]
        # awaited from the loop: SimLoop.run_in_executor takes the stand-in
        assert await world.loop.run_in_executor(thread, str.upper, "d") == "D"
        process.pause()
        world.loop.call_soon(submit, "while paused", context=context)
        await asyncio.sleep(1.0)
        assert ran == ["a", "b", "c"]  # parked with its process
        process.resume()
        await asyncio.sleep(0.1)
        assert ran == ["a", "b", "c", "while paused"]

        def submit_and_die() -> None:
            thread.submit(ran.append, "never")
            process.crash()

        world.loop.call_soon(submit_and_die, context=context)
        await asyncio.sleep(1.0)
        thread.shutdown()
        with pytest.raises(RuntimeError, match="after shutdown"):
            thread.submit(ran.append, "after shutdown")
        return ran

    assert in_world(scenario) == ["a", "b", "c", "while paused"]
