"""The local plugin: one SQLite file shared by real processes on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from waltz_api.contracts.coordination import SessionState, Versioned
from waltz_api.errors import (
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    SessionLostError,
)
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import PluginRegistry
from waltz_coord_local import LocalCoordination, parse_location

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("local_worker.py")

ClientFactory = Callable[..., Awaitable[LocalCoordination]]


@pytest.fixture
async def new_client(tmp_path: Path) -> AsyncIterator[ClientFactory]:
    clients: list[LocalCoordination] = []

    async def factory(**options: Any) -> LocalCoordination:
        client = LocalCoordination(f"local://{tmp_path}", options)
        await client.start()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


async def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Worker:
    """A worker process, stopped by its pid at the end of the test."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self, timeout: float = 60.0) -> Any:
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not raw:
            assert self.process.stderr is not None
            err = await self.process.stderr.read()
            raise AssertionError(f"worker failed: {err.decode(errors='replace')[-2000:]}")
        return json.loads(raw)

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), 30)


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Worker]]]:
    workers: list[Worker] = []

    async def start(mode: str, *args: str) -> Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            mode,
            f"local://{tmp_path}",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        workers.append(Worker(process))
        return workers[-1]

    yield start
    for worker in workers:
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGCONT)
        await worker.stop()


def test_a_client_that_joins_creates_nothing(tmp_path: Path) -> None:
    """create=False (the `waltz` commands that join a cluster): a location that does not
    exist is refused, naming it, and nothing is made; an existing one opens."""
    mistyped = tmp_path / "no" / "such"
    for location in (f"local://{mistyped}", f"local://{tmp_path}"):
        with pytest.raises(ClusterNotFoundError, match="does not exist") as refused:
            LocalCoordination(location, {"create": False})
        assert location in str(refused.value)
    with pytest.raises(ClusterNotFoundError) as named:
        parse_location(f"local://{mistyped}", create=False)
    assert f"{mistyped} does not exist" in str(named.value)
    assert not (tmp_path / "no").exists() and not (tmp_path / "coordination.sqlite3").exists()
    with pytest.raises(ConfigError, match="create must be true or false"):
        LocalCoordination(f"local://{tmp_path}", {"create": "no"})


async def test_a_client_that_joins_opens_an_existing_store(tmp_path: Path) -> None:
    maker = LocalCoordination(f"local://{tmp_path}")
    await maker.start()
    try:
        await maker.create("/made", b"x")
    finally:
        await maker.close()
    joining = LocalCoordination(f"local://{tmp_path}", {"create": False})
    await joining.start()
    try:
        found = await joining.get("/made")
        assert found is not None and found.value == b"x"
    finally:
        await joining.close()


def test_locations(tmp_path: Path) -> None:
    assert parse_location(f"local://{tmp_path}") == (tmp_path / "coordination.sqlite3", None)
    assert parse_location(f"local://{tmp_path}/new/dir?root=/w") == (
        tmp_path / "new" / "dir" / "coordination.sqlite3",
        "/w",
    )
    assert (tmp_path / "new" / "dir").is_dir()
    assert parse_location(str(tmp_path / "c.sqlite3"))[0] == tmp_path / "c.sqlite3"
    with pytest.raises(ConfigError):
        parse_location("zk://h:1/x")
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot create"):
        parse_location(f"local://{tmp_path}/a-file/below")
    with pytest.raises(ConfigError, match="unknown parameter"):
        parse_location(f"local://{tmp_path}?rot=/x")
    with pytest.raises(ConfigError, match="session_timeout"):
        LocalCoordination(tmp_path, {"session_timeout": -1})
    with pytest.raises(ConfigError, match="root"):
        LocalCoordination(tmp_path, {"root": "relative"})


def test_registered_through_the_waltz_entry_point_group(tmp_path: Path) -> None:
    descriptor = PluginRegistry().resolve(PluginKind.COORDINATION, f"local://{tmp_path}")
    assert descriptor.name == "local"
    assert isinstance(descriptor.factory(f"local://{tmp_path}", {}), LocalCoordination)


async def test_durable_across_reopen_and_a_killed_writer(
    tmp_path: Path, spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    writer = await spawn("write", "20")
    done = await writer.line()
    assert done["counters"] == list(range(1, 21))
    writer.signal(signal.SIGKILL)  # no close: only what was committed remains
    await writer.stop()
    reader = await new_client()
    for i, version in enumerate(done["versions"]):
        assert await reader.get(f"/d/{i}") == Versioned(f"value-{i}".encode(), version)
    assert await reader.increment("/counter") == 21
    await reader.create("/later", b"x")
    await reader.close()
    again = await new_client()
    got = await again.get("/later")
    assert got is not None and got.value == b"x"
    assert await again.increment("/counter") == 22


async def test_two_processes_race_cas_one_linear_history(
    spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    client = await new_client()
    first = await client.create("/fence", b"start")
    workers = [await spawn("cas", "60") for _ in range(2)]
    pairs = [tuple(p) for w in workers for p in (await w.line(90))["won"]]
    # Every write was a CAS: the winners form one chain, each built on the last.
    pairs.sort(key=lambda p: p[1])
    expected = first
    for built_on, new in pairs:
        assert built_on == expected, f"a CAS won on a stale version: {pairs}"
        expected = new
    final = await client.get("/fence")
    assert final is not None and final.version == expected
    assert len({p[0] for p in pairs}) == len(pairs), "two winners from the same version"


async def test_killed_process_ephemeral_expires_within_the_timeout(
    spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    timeout = 2.0
    observer = await new_client(session_timeout=timeout)
    seen: list[list[str]] = []
    await observer.watch_children("/owners", seen.append)
    owner = await spawn("ephemeral", "/owners/w", str(timeout))
    await owner.line()
    await asyncio.sleep(timeout * 1.5)  # heartbeats keep it alive past the timeout
    assert await observer.children("/owners") == ["w"]
    owner.signal(signal.SIGKILL)
    await owner.stop()
    killed = time.monotonic()
    await eventually(lambda: seen[-1] == [], timeout + 10, "the killed owner's entry to expire")
    elapsed = time.monotonic() - killed
    assert seen == [[], ["w"], []]
    # It cannot expire before its last heartbeat's deadline (2/3 of the timeout).
    assert timeout / 2 <= elapsed <= timeout + 10, elapsed


async def test_paused_process_loses_its_session(
    spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    timeout = 1.5
    observer = await new_client(session_timeout=timeout)
    owner = await spawn("ephemeral", "/owners/paused", str(timeout))
    await owner.line()
    owner.signal(signal.SIGSTOP)
    await asyncio.sleep(timeout + 1)
    assert await observer.get("/owners/paused") is None  # reaped while paused
    owner.signal(signal.SIGCONT)
    assert await owner.line() == {"lost": True}


async def test_a_paused_process_never_holds_the_database(
    spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    """A process stopped (SIGSTOP) in the middle of a write stalls nobody: SQLite's
    write lock is never held by a client's own process. Before, a process paused
    inside a write transaction held the lock for its whole pause, and every other
    process of the machine waited (a CI run lost its whole system suite to it)."""
    observer = await new_client(busy_timeout=2.0, session_timeout=30)
    busy = await spawn("busy")
    assert await busy.line() == {"ready": True}
    loop = asyncio.get_running_loop()
    for round_ in range(6):
        # Paused at a random point of its loop: mostly inside a write transaction.
        await asyncio.sleep(0.05 + 0.037 * round_)
        busy.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(0.05)
            started = loop.time()
            await observer.set("/busy", f"observer-{round_}".encode())
            await observer.create(f"/observer/{round_}", b"")
            assert [s for s in await observer.children("/observer")][-1] == str(round_)
            elapsed = loop.time() - started
            assert elapsed < 1.5, f"round {round_}: the observer waited {elapsed:.2f} s"
        finally:
            busy.signal(signal.SIGCONT)
    resumed: list[bool] = []

    async def writer_went_on() -> None:
        for _ in range(500):
            current = await observer.get("/busy")
            if current is not None and current.value.isdigit():
                resumed.append(True)
                return
            await asyncio.sleep(0.02)

    await writer_went_on()
    assert resumed, "the resumed process wrote nothing more"


def writer_pids() -> list[int]:
    """This process's writer processes (children running waltz_coord_local.writer)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"waltz_coord_local.writer" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_killed_writer_process_is_replaced_in_the_same_session(
    new_client: ClientFactory, tmp_path: Path
) -> None:
    assert writer_pids() == []
    client = await new_client()
    other = await new_client()  # the clients of one file in one process share a writer
    [writer] = writer_pids()
    await client.create("/mine", b"1", ephemeral=True)
    os.kill(writer, signal.SIGKILL)
    with pytest.raises(CoordinationUnavailableError, match=r"writer process .* exited"):
        await client.set("/mine", b"2")
    assert await client.set("/mine", b"3") > 0  # a new writer, the same session
    assert client.session_state is SessionState.CONNECTED
    current = await other.get("/mine")
    assert current is not None and current.value == b"3"
    [replacement] = writer_pids()
    assert replacement != writer
    await client.close()
    await other.close()
    await eventually(lambda: writer_pids() == [], 10, "the last close to end the writer")


async def test_watch_sees_another_process_final_state(
    spawn: Callable[..., Awaitable[Worker]], new_client: ClientFactory
) -> None:
    client = await new_client()
    await client.create("/w", b"0")
    seen: list[Versioned | None] = []
    await client.watch("/w", seen.append)
    setter = await spawn("setter", "100")
    assert await setter.line() == {"done": True}
    await eventually(
        lambda: seen[-1] is not None and seen[-1].value == b"100", 20, "the final value"
    )
    values = [int(s.value) for s in seen if s is not None]
    assert values == sorted(values) and len(set(values)) == len(values)


async def test_lost_session_is_final(new_client: ClientFactory) -> None:
    client = await new_client(session_timeout=5)
    admin = await new_client()
    await client.create("/mine", b"", ephemeral=True)
    await client.set("/mine", b"changed")  # a set keeps the entry ephemeral
    states: list[SessionState] = []
    client.add_session_listener(states.append)
    assert await admin.expire_session_of(client.session_id) == 1
    assert await admin.get("/mine") is None
    with pytest.raises(SessionLostError):
        for _ in range(100):  # the next heartbeat (or operation) finds the session gone
            await client.create("/x", b"")
            await client.delete("/x")
            await asyncio.sleep(0.05)
    assert states == [SessionState.LOST]
    with pytest.raises(SessionLostError):
        await client.get("/anything")


async def test_roots_share_one_file_but_not_paths(
    tmp_path: Path, new_client: ClientFactory
) -> None:
    one = await new_client(root="/one")
    two = LocalCoordination(f"local://{tmp_path}?root=/two", {})
    await two.start()
    try:
        await one.create("/a/b", b"1")
        assert await two.get("/a/b") is None
        assert await two.children("/") == []
        await two.create("/a", b"2")
        assert await one.children("/") == ["a"]
        got = await one.get("/a")
        assert got is not None and got.value == b""
        with pytest.raises(CoordinationError, match="starting with '/'"):
            await one.get("a")
    finally:
        await two.close()


async def test_a_writer_that_cannot_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    client = LocalCoordination(f"local://{tmp_path}")
    with pytest.raises(CoordinationError, match="cannot start the writer process"):
        await client.start()
    assert len(os.listdir("/proc/self/fd")) == fds  # no pipe left open
    assert writer_pids() == []
