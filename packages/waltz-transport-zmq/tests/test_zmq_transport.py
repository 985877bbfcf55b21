"""The zmq transport's own promises beyond the shared suite: endpoints, options,
coalescing on the wire, and a clean shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConfigError, ConnectionClosedError
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_transport_zmq import ServerConnection, ZmqTransport
from waltz_transport_zmq.options import ZmqOptions, is_local_endpoint


async def echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        return


def test_plugin_is_registered_with_its_capabilities() -> None:
    descriptor = get_registry().get(PluginKind.TRANSPORT, "zmq")
    assert {"processes", "peer_faults", "malformed_input"} <= descriptor.capabilities
    transport = descriptor.factory({"heartbeat_timeout": 1.0})
    assert isinstance(transport, ZmqTransport)
    assert transport.failure_detection_bound == pytest.approx(1.5)
    assert get_registry().resolve(PluginKind.TRANSPORT, "tcp://127.0.0.1:1").name == "zmq"


@pytest.mark.parametrize("requested", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])
async def test_port_zero_resolves_to_the_bound_port(requested: str) -> None:
    server, client = ZmqTransport(), ZmqTransport()
    try:
        listener = await server.listen(requested, echo)
        host, port = listener.endpoint.rsplit(":", 1)
        assert host == "tcp://127.0.0.1" and int(port) > 0
        conn = await client.connect(listener.endpoint, timeout=5)
        await conn.send(b"ping")
        assert await asyncio.wait_for(conn.recv(), 10) == b"ping"
    finally:
        await client.close()
        await server.close()


async def test_ipc_endpoint(tmp_path: Path) -> None:
    server, client = ZmqTransport(), ZmqTransport()
    try:
        listener = await server.listen(f"ipc://{tmp_path}/w.sock", echo)
        assert listener.endpoint == f"ipc://{tmp_path}/w.sock"
        conn = await client.connect(listener.endpoint, timeout=5)
        await conn.send(b"ipc")
        assert await asyncio.wait_for(conn.recv(), 10) == b"ipc"
    finally:
        await client.close()
        await server.close()


async def test_small_frames_are_coalesced_into_few_messages() -> None:
    accepted: asyncio.Queue[ServerConnection] = asyncio.Queue()
    got: list[bytes] = []
    done = asyncio.Event()
    count = 5000

    async def collect(conn: Connection) -> None:
        assert isinstance(conn, ServerConnection)
        await accepted.put(conn)
        while len(got) < count:
            got.append(await conn.recv())
        done.set()

    for coalesce in (True, False):
        got.clear()
        done.clear()
        server, client = ZmqTransport(), ZmqTransport({"coalesce": coalesce})
        try:
            listener = await server.listen("tcp://127.0.0.1:*", collect)
            conn = await client.connect(listener.endpoint, timeout=5)
            for i in range(count):
                await conn.send(i.to_bytes(4, "big") * 25)
            await asyncio.wait_for(done.wait(), 20)
            server_side = await accepted.get()
            assert [int.from_bytes(f[:4], "big") for f in got] == list(range(count))
            messages = server_side._seq_in
            if coalesce:
                assert messages < count / 10, f"{messages} zmq messages for {count} frames"
            else:
                assert messages == count
        finally:
            await client.close()
            await server.close()


async def test_close_leaves_no_task_behind() -> None:
    before = asyncio.all_tasks()
    server, client = ZmqTransport(), ZmqTransport()
    listener = await server.listen("tcp://127.0.0.1:*", echo)
    conns = [await client.connect(listener.endpoint, timeout=5) for _ in range(3)]
    for conn in conns:
        await conn.send(b"x")
        assert await asyncio.wait_for(conn.recv(), 10) == b"x"
    await client.close()
    await server.close()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()
    assert all(conn.closed for conn in conns)
    with pytest.raises(ConnectionClosedError):
        await conns[0].send(b"after close")


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown zmq transport option") as info:
        ZmqTransport({"heartbeat_intreval": 1})
    assert info.value.key == "heartbeat_intreval"
    with pytest.raises(ConfigError, match="heartbeat_timeout must be larger"):
        ZmqTransport({"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0})
    with pytest.raises(ConfigError, match="max_frame_size"):
        ZmqTransport({"max_frame_size": 0})
    with pytest.raises(ConfigError, match="coalesce"):
        ZmqTransport({"coalesce": "sometimes"})
    with pytest.raises(ConfigError, match="security"):
        ZmqTransport({"security": "tls"})
    with pytest.raises(ConfigError, match="high_water_mark"):
        ZmqTransport({"window_frames": 100, "high_water_mark": 150})
    # text, as environment overrides give it, is read as what it says
    text = ZmqOptions.from_mapping(
        {"heartbeat_timeout": "1.5", "coalesce": "false", "window_frames": "64"}
    )
    assert (text.heartbeat_timeout, text.coalesce, text.window_frames) == (1.5, False, 64)
    with pytest.raises(ConfigError, match="window_frames"):
        ZmqTransport({"window_frames": "many"})
    opts = ZmqOptions.from_mapping({})
    assert opts.failure_detection_bound <= 3.0
    assert opts.hwm > 2 * opts.window_frames


async def test_bad_endpoints_are_refused() -> None:
    transport = ZmqTransport()
    try:
        with pytest.raises(ConfigError, match="invalid"):
            await transport.listen("udp://127.0.0.1:1", echo)
        with pytest.raises(ConfigError, match="invalid"):
            await transport.connect("127.0.0.1:5555")
        # plaintext beyond loopback needs saying so (refused before any socket exists)
        with pytest.raises(ConfigError, match="security = 'plaintext'"):
            await transport.listen("tcp://0.0.0.0:*", echo)
    finally:
        await transport.close()


def test_local_endpoints() -> None:
    assert is_local_endpoint("tcp://127.0.0.1:5")
    assert is_local_endpoint("tcp://127.3.4.5:5")
    assert is_local_endpoint("tcp://localhost:5")
    assert is_local_endpoint("tcp://[::1]:5")
    assert is_local_endpoint("ipc:///tmp/x")
    assert not is_local_endpoint("tcp://0.0.0.0:5")
    assert not is_local_endpoint("tcp://*:5")
    assert not is_local_endpoint("tcp://example.com:5")


async def test_frame_beyond_zmq_maxmsgsize_closes_only_that_connection() -> None:
    """A frame far above the receiver's limit is dropped by libzmq itself (ZMQ_MAXMSGSIZE
    cuts the TCP link); the sequence check turns the loss into a closed connection. (A
    sender refuses such a frame at ``send``, knowing the receiver's limit from the
    handshake; this one ignores it, as a hostile or broken peer would.)"""
    server = ZmqTransport(
        {"max_frame_size": 64 * 1024, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    )
    client = ZmqTransport({"max_frame_size": 4 * 1024 * 1024})
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        victim = await client.connect(listener.endpoint, timeout=5)
        bystander = await client.connect(listener.endpoint, timeout=5)
        for conn in (victim, bystander):
            await conn.send(b"hi")
            assert await asyncio.wait_for(conn.recv(), 10) == b"hi"
        victim._send_max = victim._max  # type: ignore[attr-defined]
        await victim.send(b"z" * (1024 * 1024))
        await victim.send(b"after the big one")
        with pytest.raises(ConnectionClosedError):
            async with asyncio.timeout(client.failure_detection_bound + 3):
                got = await victim.recv()
                pytest.fail(f"a frame arrived after a lost one: {got[:20]!r}")
        for i in range(20):
            await bystander.send(b"%d" % i)
            assert await asyncio.wait_for(bystander.recv(), 10) == b"%d" % i
    finally:
        await client.close()
        await server.close()


async def test_a_listener_whose_readiness_signal_was_lost_still_accepts() -> None:
    """A socket's readiness is an edge that any operation on it may consume; a listener
    with no connection sends nothing that would make it look again, so a lost edge left a
    peer's hello unread for ever (connects to an idle, just-resumed peer timed out under
    load). The watchdog reads every socket once per heartbeat interval: here the
    listener's reader is taken away altogether, and a connect still succeeds in time."""
    server, client = ZmqTransport({"heartbeat_interval": 0.2}), ZmqTransport()
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        pump = listener._pump  # type: ignore[attr-defined]
        asyncio.get_running_loop().remove_reader(pump._fd)  # every edge from now on is lost
        conn = await client.connect(listener.endpoint, timeout=5.0)
        await conn.send(b"hello")
        assert await asyncio.wait_for(conn.recv(), 5.0) == b"hello"
    finally:
        await client.close()
        await server.close()
