"""The Coordination conformance suite.

(Above 800 lines on purpose: the harness and one suite class whose tests follow the
Coordination contract clause by clause; a plugin author reads and imports one module.)

A backend subclasses :class:`CoordinationSuite` and provides a ``harness``
fixture returning a :class:`CoordinationHarness` for its implementation::

    class TestMyCoordination(CoordinationSuite):
        @pytest.fixture
        def harness(self, my_server) -> CoordinationHarness:
            return MyHarness(name="mine", server=my_server)

The harness makes clients on a fresh root (unique per harness instance, so
per test) and can expire a client's session the way the real service does.
Optional capabilities:

- ``server_restart``: :meth:`CoordinationHarness.kill_server` kills the
  service (SIGKILL) and :meth:`CoordinationHarness.restart_server` brings it
  back on the same address with its data; sessions survive a restart shorter
  than the session timeout.
- ``cross_process``: :meth:`CoordinationHarness.client_uri` gives a URI that
  another process opens through the plugin registry (the suite starts worker
  processes: an owner of an ephemeral entry that is killed with SIGKILL, and
  processes racing counters and CAS).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from waltz_api.capabilities import CROSS_PROCESS as CROSS_PROCESS  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import SERVER_RESTART as SERVER_RESTART  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.contracts.coordination import Coordination, SessionState, Versioned
from waltz_api.errors import (
    BadVersionError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionLostError,
    WaltzError,
)
from waltz_conformance.harness import Harness, requires, skip_unless_capable


@dataclass
class CoordinationHarness(Harness):
    """Makes clients of one coordination backend for the suite.

    Subclasses implement :meth:`connect` and :meth:`expire_session` (and, with
    the ``server_restart`` capability, :meth:`kill_server` and
    :meth:`restart_server`). ``session_timeout`` is the backend's session
    timeout in seconds: the suite expects the ephemeral entries of a lost
    session to be gone within it (plus a margin for a loaded machine).
    """

    session_timeout: float = 10.0
    root: str = field(default_factory=lambda: f"/waltz-conformance/{uuid.uuid4().hex[:12]}")
    _clients: list[Coordination] = field(default_factory=list, repr=False)

    async def connect(self, root: str) -> Coordination:
        """A new, NOT yet started client of the backend rooted at ``root``."""
        raise NotImplementedError(f"{type(self).__name__} must implement connect()")

    async def expire_session(self, client: Coordination) -> None:
        """Make the service expire ``client``'s session, as it does when the
        client stops heartbeating (ZooKeeper: a real session expiry; etcd:
        revoke the lease). Returns once the service has expired it; the
        client learns it (LOST) on its own, soon after."""
        raise NotImplementedError(f"{type(self).__name__} must implement expire_session()")

    async def kill_server(self) -> None:
        """Kill the service (SIGKILL), keeping its data (capability ``server_restart``)."""
        raise NotImplementedError(f"{self.name} does not support kill_server()")

    async def restart_server(self) -> None:
        """Start the killed service again on the same address (capability ``server_restart``)."""
        raise NotImplementedError(f"{self.name} does not support restart_server()")

    def client_uri(self, root: str) -> str:
        """A URI another process can open (through the plugin registry) to reach the same
        service under ``root`` (capability ``cross_process``)."""
        raise NotImplementedError(f"{self.name} does not support client_uri()")

    async def new_client(self, root: str | None = None) -> Coordination:
        """A started client on this harness's root (or ``root``); closed by :meth:`aclose`."""
        client = await self.connect(root or self.root)
        self._clients.append(client)
        await client.start()
        return client

    async def aclose(self) -> None:
        """Close every client this harness made (errors of lost clients are ignored)."""
        clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(WaltzError, TimeoutError):
                await asyncio.wait_for(client.close(), timeout=30)


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], timeout: float, what: str, interval: float = 0.02
) -> None:
    """Wait until ``check()`` is true, failing the test with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.1f}s waiting for: {what}")
        await asyncio.sleep(interval)


class Recorder:
    """Collects what a watch delivers."""

    def __init__(self) -> None:
        self.values: list[Versioned | None] = []
        self.children: list[list[str]] = []

    def on_data(self, value: Versioned | None) -> None:
        self.values.append(value)

    async def on_data_async(self, value: Versioned | None) -> None:
        await asyncio.sleep(0)
        self.values.append(value)

    def on_children(self, children: list[str]) -> None:
        self.children.append(list(children))

    @property
    def last(self) -> Versioned | None:
        return self.values[-1] if self.values else None


def _versions(values: list[Versioned | None]) -> list[int]:
    return [v.version for v in values if v is not None]


class CoordinationSuite:
    """The shared tests of the Coordination contract."""

    # Margin on top of the session timeout, for a loaded test machine.
    SLACK = 15.0

    RESTART_SESSION_TIMEOUT = 30.0
    """The session timeout of the clients that must ride out a kill and restart of the
    service: a restart (a JVM's start, on a loaded machine) can take longer than the
    harness's usual timeout, and a session may then be lost, rightly."""

    @pytest.fixture(autouse=True)
    async def _coordination_harness_lifecycle(
        self, request: pytest.FixtureRequest, harness: CoordinationHarness
    ) -> AsyncIterator[None]:
        skip_unless_capable(request, harness)
        yield
        await harness.aclose()

    # -- values, versions, CAS ----------------------------------------------------------

    async def test_create_get_exists(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        assert await client.get("/a") is None
        assert not await client.exists("/a")
        version = await client.create("/a", b"one")
        got = await client.get("/a")
        assert got == Versioned(b"one", version)
        assert await client.exists("/a")
        with pytest.raises(NodeExistsError):
            await client.create("/a", b"two")
        assert await client.get("/a") == Versioned(b"one", version)

    async def test_create_makes_parents_or_refuses(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.create("/p/q/r", b"deep")
        assert (await client.get("/p/q/r")) is not None
        assert await client.exists("/p/q")
        with pytest.raises(NoNodeError):
            await client.create("/x/y", b"", make_parents=False)
        assert not await client.exists("/x")

    async def test_set_increases_version_and_cas_checks_it(
        self, harness: CoordinationHarness
    ) -> None:
        client = await harness.new_client()
        v0 = await client.create("/v", b"0")
        v1 = await client.set("/v", b"1")
        assert v1 > v0
        v2 = await client.set("/v", b"2", expected_version=v1)
        assert v2 > v1
        with pytest.raises(BadVersionError):
            await client.set("/v", b"stale", expected_version=v1)
        assert await client.get("/v") == Versioned(b"2", v2)
        with pytest.raises(NoNodeError):
            await client.set("/missing", b"x")
        with pytest.raises(NoNodeError):
            await client.set("/missing", b"x", expected_version=0)

    async def test_cas_race_exactly_one_wins(self, harness: CoordinationHarness) -> None:
        clients = [await harness.new_client() for _ in range(3)]
        version = await clients[0].create("/race", b"start")
        rounds = 25
        for round_no in range(rounds):

            async def attempt(
                index: int, client: Coordination, expected: int, round_no: int = round_no
            ) -> int | None:
                try:
                    return await client.set(
                        "/race", f"{round_no}:{index}".encode(), expected_version=expected
                    )
                except BadVersionError:
                    return None

            results = await asyncio.gather(*(attempt(i, c, version) for i, c in enumerate(clients)))
            winners = [i for i, r in enumerate(results) if r is not None]
            assert len(winners) == 1, f"round {round_no}: winners {winners} (exactly one expected)"
            new_version = results[winners[0]]
            assert new_version is not None and new_version > version
            current = await clients[1].get("/race")
            assert current == Versioned(f"{round_no}:{winners[0]}".encode(), new_version)
            version = new_version

    async def test_cas_contention_loses_no_update(self, harness: CoordinationHarness) -> None:
        """Read-modify-CAS loops from several clients: every increment lands once."""
        clients = [await harness.new_client() for _ in range(3)]
        await clients[0].create("/sum", b"0")
        per_client = 15

        async def add_one(client: Coordination) -> int:
            retries = 0
            for _ in range(per_client):
                for _attempt in range(1000):
                    current = await client.get("/sum")
                    assert current is not None
                    try:
                        await client.set(
                            "/sum",
                            str(int(current.value) + 1).encode(),
                            expected_version=current.version,
                        )
                        break
                    except BadVersionError:
                        retries += 1
                else:
                    pytest.fail("a CAS never succeeded in 1000 attempts")
            return retries

        await asyncio.gather(*(add_one(c) for c in clients))
        final = await clients[0].get("/sum")
        assert final is not None and int(final.value) == per_client * len(clients)

    async def test_create_race_exactly_one_wins(self, harness: CoordinationHarness) -> None:
        clients = [await harness.new_client() for _ in range(3)]
        for round_no in range(10):
            path = f"/claim/{round_no}"

            async def claim(index: int, client: Coordination, path: str = path) -> bool:
                try:
                    await client.create(path, str(index).encode())
                    return True
                except NodeExistsError:
                    return False

            won = await asyncio.gather(*(claim(i, c) for i, c in enumerate(clients)))
            assert sum(won) == 1, f"round {round_no}: {won} (exactly one create wins)"
            got = await clients[0].get(path)
            assert got is not None and got.value == str(won.index(True)).encode()

    async def test_versioned_delete_race(self, harness: CoordinationHarness) -> None:
        clients = [await harness.new_client() for _ in range(3)]
        version = await clients[0].create("/doomed", b"x")

        async def remove(client: Coordination) -> bool:
            try:
                await client.delete("/doomed", expected_version=version)
                return True
            except (NoNodeError, BadVersionError):
                return False

        results = await asyncio.gather(*(remove(c) for c in clients))
        assert sum(results) == 1, results
        assert not await clients[1].exists("/doomed")

    # -- delete, children -------------------------------------------------------------------

    async def test_delete(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.delete("/never-existed")  # a no-op
        with pytest.raises(NoNodeError):
            await client.delete("/never-existed", expected_version=0)
        version = await client.create("/d", b"x")
        newer = await client.set("/d", b"y")
        with pytest.raises(BadVersionError):
            await client.delete("/d", expected_version=version)
        assert await client.exists("/d")
        await client.delete("/d", expected_version=newer)
        assert await client.get("/d") is None

    async def test_delete_with_children(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.create("/tree/a/b", b"1")
        await client.create("/tree/c", b"2")
        with pytest.raises(NotEmptyError):
            await client.delete("/tree")
        assert await client.exists("/tree/a/b")
        await client.delete("/tree", recursive=True)
        for path in ("/tree", "/tree/a", "/tree/a/b", "/tree/c"):
            assert not await client.exists(path), path
        assert await client.children("/tree") == []

    async def test_children_sorted(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        names = ["10", "9", "b", "a", "0000000002", "0000000010", "z-y"]
        shuffled = list(names)
        random.Random(4).shuffle(shuffled)
        for name in shuffled:
            await client.create(f"/kids/{name}", name.encode())
        await client.create("/kids/a/grandchild", b"")
        assert await client.children("/kids") == sorted(names)
        assert await client.children("/kids/a") == ["grandchild"]
        assert await client.children("/no-such-parent") == []
        other = await harness.new_client()
        assert await other.children("/kids") == sorted(names)

    async def test_roots_are_isolated(self, harness: CoordinationHarness) -> None:
        first = await harness.new_client()
        second = await harness.new_client(root=f"{harness.root}-other")
        await first.create("/only-here", b"1")
        assert await second.get("/only-here") is None
        await second.create("/only-here", b"2")
        got = await first.get("/only-here")
        assert got is not None and got.value == b"1"

    async def test_values_are_bytes_kept_exactly(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        blob = bytes(range(256)) * 16
        await client.create("/blob", blob)
        got = await client.get("/blob")
        assert got is not None and got.value == blob
        await client.set("/blob", b"")
        got = await client.get("/blob")
        assert got is not None and got.value == b""

    # -- ephemeral entries and sessions ------------------------------------------------------

    async def test_ephemeral_removed_on_close(self, harness: CoordinationHarness) -> None:
        owner = await harness.new_client()
        observer = await harness.new_client()
        await owner.create("/members/owner", b"alive", ephemeral=True)
        await observer.create("/members/persistent", b"stays")
        assert await observer.get("/members/owner") is not None
        await owner.close()

        async def gone() -> bool:
            return await observer.get("/members/owner") is None

        await eventually(gone, harness.session_timeout, "ephemeral entry removed after close")
        assert await observer.children("/members") == ["persistent"]

    async def test_ephemeral_removed_after_session_loss(self, harness: CoordinationHarness) -> None:
        owner = await harness.new_client()
        observer = await harness.new_client()
        states: list[SessionState] = []
        threads: set[int] = set()

        def listener(state: SessionState) -> None:
            threads.add(threading.get_ident())
            states.append(state)

        owner.add_session_listener(listener)
        await owner.create("/members/owner", b"alive", ephemeral=True)
        await harness.expire_session(owner)

        async def gone() -> bool:
            return await observer.get("/members/owner") is None

        await eventually(
            gone, harness.session_timeout + self.SLACK, "ephemeral entry removed after expiry"
        )
        await eventually(
            lambda: SessionState.LOST in states,
            harness.session_timeout + self.SLACK,
            "LOST notified to the session listener",
        )
        assert owner.session_state is SessionState.LOST
        assert states[-1] is SessionState.LOST
        assert threads == {threading.get_ident()}, "listeners run on the event loop's thread"

    async def test_ephemeral_cannot_have_children(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.create("/eph", b"", ephemeral=True)
        with pytest.raises(CoordinationError):
            await client.create("/eph/child", b"")
        assert await client.children("/eph") == []

    async def test_operations_on_lost_session_raise(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.create("/x", b"1")
        lost = asyncio.Event()
        client.add_session_listener(lambda s: lost.set() if s is SessionState.LOST else None)
        await harness.expire_session(client)
        await asyncio.wait_for(lost.wait(), harness.session_timeout + self.SLACK)
        operations: list[Callable[[], Awaitable[object]]] = [
            lambda: client.get("/x"),
            lambda: client.set("/x", b"2"),
            lambda: client.set("/x", b"2", expected_version=0),
            lambda: client.create("/y", b""),
            lambda: client.delete("/x"),
            lambda: client.children("/"),
            lambda: client.increment("/counter"),
        ]
        for operation in operations:
            with pytest.raises(SessionLostError):
                await asyncio.wait_for(operation(), harness.session_timeout + self.SLACK)
        other = await harness.new_client()
        got = await other.get("/x")
        assert got is not None and got.value == b"1", "a lost session must change nothing"
        assert other.session_id != client.session_id

    async def test_closed_client_raises(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        await client.close()
        await client.close()  # idempotent
        with pytest.raises(CoordinationError):
            await client.get("/anything")

    async def test_sessions_are_distinct(self, harness: CoordinationHarness) -> None:
        first = await harness.new_client()
        second = await harness.new_client()
        assert first.session_state is SessionState.CONNECTED
        assert first.session_id != second.session_id

    # -- watches ------------------------------------------------------------------------------

    async def test_watch_delivers_current_value_then_changes(
        self, harness: CoordinationHarness
    ) -> None:
        watcher = await harness.new_client()
        writer = await harness.new_client()
        v0 = await writer.create("/w", b"initial")
        rec = Recorder()
        threads: set[int] = set()

        def on_data(value: Versioned | None) -> None:
            threads.add(threading.get_ident())
            rec.on_data(value)

        watch = await watcher.watch("/w", on_data)
        await eventually(lambda: rec.values != [], 10, "the initial value")
        assert rec.values[0] == Versioned(b"initial", v0)
        v1 = await writer.set("/w", b"changed")
        await eventually(lambda: rec.last == Versioned(b"changed", v1), 10, "the change")
        watch.cancel()
        assert threads == {threading.get_ident()}, "callbacks run on the event loop's thread"

    async def test_watch_absent_created_deleted(self, harness: CoordinationHarness) -> None:
        watcher = await harness.new_client()
        writer = await harness.new_client()
        rec = Recorder()
        await watcher.watch("/later", rec.on_data_async)
        await eventually(lambda: rec.values == [None], 10, "None for an absent path")
        await writer.create("/later", b"born")
        await eventually(
            lambda: rec.last is not None and rec.last.value == b"born", 10, "the creation"
        )
        await writer.delete("/later")
        await eventually(lambda: rec.last is None and len(rec.values) >= 3, 10, "the deletion")
        await writer.create("/later", b"again")
        await eventually(
            lambda: rec.last is not None and rec.last.value == b"again", 10, "the re-creation"
        )

    async def test_watch_never_misses_final_state(self, harness: CoordinationHarness) -> None:
        watcher = await harness.new_client()
        writer = await harness.new_client()
        await writer.create("/fast", b"0")
        rec = Recorder()
        watch = await watcher.watch("/fast", rec.on_data)
        await eventually(lambda: rec.values != [], 10, "the initial value")
        writes = 200
        last_version = 0
        for i in range(1, writes + 1):
            last_version = await writer.set("/fast", str(i).encode())
        final = Versioned(str(writes).encode(), last_version)
        await eventually(lambda: rec.last == final, 20, f"the final value {final}")
        versions = _versions(rec.values)
        assert versions == sorted(versions) and len(set(versions)) == len(versions), (
            f"watch versions must strictly increase, got {versions}"
        )
        for value in rec.values:
            assert value is not None
            assert int(value.value) <= writes
        values = [int(v.value) for v in rec.values if v is not None]
        assert values == sorted(values), "values must arrive in the order they were written"
        # Nothing more arrives after the final state, and cancel stops delivery.
        watch.cancel()
        delivered = len(rec.values)
        await writer.set("/fast", b"after-cancel")
        await asyncio.sleep(0.5)
        assert len(rec.values) == delivered, "no delivery after cancel()"

    async def test_watches_from_many_clients_converge(self, harness: CoordinationHarness) -> None:
        writer = await harness.new_client()
        await writer.create("/shared", b"-1")
        watchers = [await harness.new_client() for _ in range(3)]
        recorders = [Recorder() for _ in watchers]
        for client, rec in zip(watchers, recorders, strict=True):
            await client.watch("/shared", rec.on_data)
        for i in range(30):
            await writer.set("/shared", str(i).encode())
        final = await writer.get("/shared")
        for rec in recorders:

            def converged(rec: Recorder = rec) -> bool:
                return rec.last == final

            await eventually(converged, 20, "every watcher converges")

    async def test_child_watch(self, harness: CoordinationHarness) -> None:
        watcher = await harness.new_client()
        writer = await harness.new_client()
        rec = Recorder()
        watch = await watcher.watch_children("/group", rec.on_children)
        await eventually(lambda: rec.children != [], 10, "the initial (empty) children")
        assert rec.children[0] == []
        names = [f"m{i:02d}" for i in range(12)]
        for name in reversed(names):
            await writer.create(f"/group/{name}", b"")
        await eventually(lambda: rec.children[-1] == names, 20, "every child, sorted")
        for snapshot in rec.children:
            assert snapshot == sorted(snapshot)
        await writer.delete("/group/m03")
        await eventually(
            lambda: rec.children[-1] == [n for n in names if n != "m03"], 20, "a removed child"
        )
        ephemeral_owner = await harness.new_client()
        await ephemeral_owner.create("/group/zz-ephemeral", b"", ephemeral=True)
        await eventually(lambda: "zz-ephemeral" in rec.children[-1], 20, "an ephemeral child")
        await ephemeral_owner.close()
        await eventually(
            lambda: "zz-ephemeral" not in rec.children[-1],
            harness.session_timeout + self.SLACK,
            "the ephemeral child gone after its owner closed",
        )
        watch.cancel()

    async def test_watch_callback_errors_do_not_stop_the_watch(
        self, harness: CoordinationHarness
    ) -> None:
        client = await harness.new_client()
        await client.create("/flaky", b"0")
        seen: list[bytes] = []

        def callback(value: Versioned | None) -> None:
            assert value is not None
            seen.append(value.value)
            if value.value == b"1":
                raise RuntimeError("a buggy watcher")

        await client.watch("/flaky", callback)
        await eventually(lambda: seen != [], 10, "initial value")
        await client.set("/flaky", b"1")
        await eventually(lambda: seen[-1] == b"1", 10, "the value whose callback fails")
        await client.set("/flaky", b"2")
        await eventually(lambda: seen[-1] == b"2", 10, "delivery after a failing callback")

    # -- counters -----------------------------------------------------------------------------

    async def test_counter_sequential(self, harness: CoordinationHarness) -> None:
        client = await harness.new_client()
        values = [await client.increment("/ids/client") for _ in range(20)]
        assert values[0] >= 1
        assert all(b > a for a, b in itertools.pairwise(values)), values
        other = await harness.new_client()
        assert await other.increment("/ids/client") > values[-1]
        # Counters are independent of each other.
        assert await client.increment("/ids/server") >= 1

    async def test_counter_concurrent_unique_and_increasing(
        self, harness: CoordinationHarness
    ) -> None:
        clients = [await harness.new_client() for _ in range(4)]
        per_client = 40

        async def take(client: Coordination) -> list[int]:
            return [await client.increment("/ids/shared") for _ in range(per_client)]

        # Two concurrent streams per client, so a client races itself too.
        results = await asyncio.gather(*(take(c) for c in clients for _ in range(2)))
        everything = [v for values in results for v in values]
        assert len(set(everything)) == len(everything), "a counter value was handed out twice"
        for values in results:
            assert all(b > a for a, b in itertools.pairwise(values)), values
        assert min(everything) >= 1
        after = await clients[0].increment("/ids/shared")
        assert after > max(everything)

    # -- server restart (optional) ----------------------------------------------------------------

    @requires(SERVER_RESTART)
    async def test_session_survives_server_restart(self, harness: CoordinationHarness) -> None:
        harness.session_timeout = max(harness.session_timeout, self.RESTART_SESSION_TIMEOUT)
        client = await harness.new_client()
        states: list[SessionState] = []
        client.add_session_listener(states.append)
        await client.create("/persistent", b"kept")
        await client.create("/ephemeral", b"mine", ephemeral=True)
        rec = Recorder()
        await client.watch("/persistent", rec.on_data)
        await eventually(lambda: rec.values != [], 10, "the watch's initial value")
        session = client.session_id
        await harness.kill_server()
        await eventually(
            lambda: SessionState.SUSPENDED in states, harness.session_timeout, "SUSPENDED"
        )
        # An operation issued during the outage waits for the service (bounded).
        pending = asyncio.ensure_future(client.get("/persistent"))
        await asyncio.sleep(0.2)
        await harness.restart_server()
        await eventually(
            lambda: states[-1] is SessionState.CONNECTED,
            harness.session_timeout + self.SLACK,
            "CONNECTED again after the restart",
        )
        assert SessionState.LOST not in states
        assert client.session_id == session
        during = await asyncio.wait_for(pending, harness.session_timeout + self.SLACK)
        assert during is not None and during.value == b"kept"
        got = await client.get("/persistent")
        assert got is not None and got.value == b"kept"
        eph = await client.get("/ephemeral")
        assert eph is not None and eph.value == b"mine", "the session (and its ephemeral) survived"
        version = await client.set("/persistent", b"after", expected_version=got.version)
        assert version > got.version
        await eventually(
            lambda: rec.last == Versioned(b"after", version),
            harness.session_timeout + self.SLACK,
            "a watch registered before the restart sees a change made after it",
        )

    @requires(SERVER_RESTART)
    async def test_outage_longer_than_session_timeout_is_lost(
        self, harness: CoordinationHarness
    ) -> None:
        """SUSPENDED for longer than the session timeout turns LOST by itself; after the
        service is back, the ephemeral entries of that session expire too."""
        client = await harness.new_client()
        states: list[SessionState] = []
        client.add_session_listener(states.append)
        await client.create("/outage/ephemeral", b"", ephemeral=True)
        await harness.kill_server()
        try:
            await eventually(
                lambda: SessionState.LOST in states,
                harness.session_timeout + self.SLACK,
                "LOST after an outage longer than the session timeout",
            )
            assert states[0] is SessionState.SUSPENDED, states
            with pytest.raises(SessionLostError):
                await client.get("/outage/ephemeral")
        finally:
            await harness.restart_server()
        observer = await harness.new_client()

        async def gone() -> bool:
            return not await observer.exists("/outage/ephemeral")

        await eventually(
            gone, harness.session_timeout + self.SLACK, "the lost session's ephemeral expires"
        )

    @requires(SERVER_RESTART)
    async def test_cas_updates_survive_a_server_restart(self, harness: CoordinationHarness) -> None:
        """Clients keep CAS-incrementing a value while the service is killed (-9) and
        restarted: no acknowledged update is lost, and an update whose outcome was
        unknown (CoordinationUnavailableError) was applied at most once."""
        harness.session_timeout = max(harness.session_timeout, self.RESTART_SESSION_TIMEOUT)
        clients = [await harness.new_client() for _ in range(3)]
        await clients[0].create("/restart-sum", b"0")
        per_client = 15
        acked = [0] * len(clients)
        unknown = [0] * len(clients)

        async def work(index: int, client: Coordination) -> None:
            for _ in range(10_000):
                if acked[index] >= per_client:
                    return
                try:
                    current = await client.get("/restart-sum")
                    assert current is not None
                    await client.set(
                        "/restart-sum",
                        str(int(current.value) + 1).encode(),
                        expected_version=current.version,
                    )
                    acked[index] += 1
                except BadVersionError:
                    continue
                except CoordinationUnavailableError:
                    unknown[index] += 1
                    await asyncio.sleep(0.05)
            pytest.fail("a client made no progress in 10000 attempts")

        workers = asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
        try:
            await eventually(lambda: sum(acked) >= 10, 30, "updates before the kill")
            await harness.kill_server()
            await asyncio.sleep(0.3)
            await harness.restart_server()
            await asyncio.wait_for(workers, harness.session_timeout + 3 * self.SLACK)
        finally:
            if not workers.done():
                workers.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await workers
        for client in clients:
            assert client.session_state is not SessionState.LOST
        final = await clients[0].get("/restart-sum")
        assert final is not None
        total = int(final.value)
        assert sum(acked) <= total <= sum(acked) + sum(unknown), (
            f"value {total}, acknowledged {sum(acked)}, unknown outcomes {sum(unknown)}"
        )

    # -- other processes (optional) ---------------------------------------------------------------

    async def _spawn_worker(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "waltz_conformance.suites.coordination_worker",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @staticmethod
    async def _reap(process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 30)

    @requires(CROSS_PROCESS)
    async def test_ephemeral_of_killed_process_expires(self, harness: CoordinationHarness) -> None:
        """An owner process killed with SIGKILL stops heartbeating: its ephemeral entry
        stays while it lives and is gone within the session timeout after."""
        observer = await harness.new_client()
        uri = harness.client_uri(harness.root)
        worker = await self._spawn_worker(
            "ephemeral", uri, "/owners/worker", str(harness.session_timeout)
        )
        try:
            assert worker.stdout is not None and worker.stderr is not None
            try:
                line = await asyncio.wait_for(worker.stdout.readline(), 60)
            except TimeoutError:
                pytest.fail("the worker process did not create its ephemeral entry in 60s")
            if not line:
                err = await worker.stderr.read()
                pytest.fail(f"the worker failed: {err.decode(errors='replace')[-2000:]}")
            assert json.loads(line)["ready"] is True
            assert await observer.exists("/owners/worker")
            await asyncio.sleep(min(harness.session_timeout * 0.8, 2.0))
            assert await observer.exists("/owners/worker"), "expired while its owner lived"
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.wait_for(worker.wait(), 30)
            killed_at = time.monotonic()

            async def gone() -> bool:
                return not await observer.exists("/owners/worker")

            await eventually(
                gone,
                harness.session_timeout + self.SLACK,
                "the killed owner's ephemeral entry to expire",
            )
            elapsed = time.monotonic() - killed_at
            assert elapsed <= harness.session_timeout + self.SLACK, elapsed
        finally:
            await self._reap(worker)

    @requires(CROSS_PROCESS)
    async def test_processes_race_counters_and_cas(self, harness: CoordinationHarness) -> None:
        uri = harness.client_uri(harness.root)
        increments, cas_updates, processes = 25, 10, 3
        workers = [
            await self._spawn_worker(
                "race", uri, str(increments), str(cas_updates), str(harness.session_timeout)
            )
            for _ in range(processes)
        ]
        try:
            outputs = await asyncio.wait_for(
                asyncio.gather(*(w.communicate() for w in workers)), 120
            )
        finally:
            for worker in workers:
                await self._reap(worker)
        results = []
        for worker, (out, err) in zip(workers, outputs, strict=True):
            assert worker.returncode == 0, err.decode(errors="replace")[-2000:]
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
        values = [v for r in results for v in r["values"]]
        assert len(values) == increments * processes
        assert len(set(values)) == len(values), "a counter value was handed out twice"
        for r in results:
            assert all(b > a for a, b in itertools.pairwise(r["values"]))
        client = await harness.new_client()
        total = await client.get("/race/sum")
        assert total is not None
        assert int(total.value) == cas_updates * processes, "a CAS update was lost"
