"""The simulated network keeps the Transport contract under its faults: frames in order,
each once, or the connection breaks, within the failure-detection bound."""

from __future__ import annotations

import asyncio

import pytest
from sim_support import elapsed, idle_process, in_world

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConnectError, ConnectionClosedError
from waltz_sim.net import SimTransport
from waltz_sim.world import SimProcess, World

BOUND = 3.0


async def _echo_server(world: World, name: str = "server") -> tuple[SimProcess, list[Connection]]:
    process = idle_process(world, name)
    accepted: list[Connection] = []

    async def handler(conn: Connection) -> None:
        accepted.append(conn)
        while True:
            await conn.send(await conn.recv())

    async def listen() -> None:
        await SimTransport().listen(f"sim://{name}", handler)

    await world._in(process, listen())
    return process, accepted


async def _client(world: World, name: str = "client") -> tuple[SimProcess, SimTransport]:
    process = idle_process(world, name)

    async def make() -> SimTransport:
        return SimTransport()

    return process, await world._in(process, make())


def test_frames_arrive_in_order_each_once() -> None:
    async def scenario(world: World) -> list[bytes]:
        await _echo_server(world)
        process, transport = await _client(world)

        async def talk() -> list[bytes]:
            conn = await transport.connect("sim://server")
            for i in range(300):
                await conn.send(b"%d" % i)
            return [await conn.recv() for _ in range(300)]

        return await world._in(process, talk())

    assert in_world(scenario) == [b"%d" % i for i in range(300)]


def test_a_short_cut_delays_frames_and_breaks_nothing() -> None:
    async def scenario(world: World) -> tuple[list[bytes], float]:
        await _echo_server(world)
        process, transport = await _client(world)

        async def talk() -> tuple[list[bytes], float]:
            conn = await transport.connect("sim://server")
            world.network.cut("client", "server")
            for i in range(5):
                await conn.send(b"%d" % i)
            world.loop.call_later(BOUND * 0.4, world.network.heal, "client", "server")
            got = [await conn.recv() for _ in range(5)]
            return got, elapsed(world)

        return await world._in(process, talk())

    got, at = in_world(scenario)
    assert got == [b"0", b"1", b"2", b"3", b"4"]
    assert at >= BOUND * 0.4


@pytest.mark.parametrize("direction", [("client", "server"), ("server", "client")])
def test_a_cut_in_either_direction_breaks_both_ends_within_the_bound(
    direction: tuple[str, str],
) -> None:
    async def scenario(world: World) -> tuple[float, bool]:
        _, accepted = await _echo_server(world)
        process, transport = await _client(world)

        async def talk() -> tuple[float, bool]:
            conn = await transport.connect("sim://server")
            await conn.send(b"hello")
            assert await conn.recv() == b"hello"
            cut_at = elapsed(world)
            world.network.cut(*direction)
            with pytest.raises(ConnectionClosedError):
                await conn.recv()
            broke_after = elapsed(world) - cut_at
            await asyncio.sleep(BOUND)
            return broke_after, accepted[0].closed

        return await world._in(process, talk())

    broke_after, server_end_closed = in_world(scenario)
    assert BOUND * 0.5 <= broke_after <= BOUND
    assert server_end_closed


def test_a_crashed_peer_is_noticed_at_once_a_paused_one_within_the_bound() -> None:
    async def scenario(world: World) -> tuple[float, float, bool]:
        server, _ = await _echo_server(world)
        other, _ = await _echo_server(world, "other")
        process, transport = await _client(world)

        async def talk() -> tuple[float, float, bool]:
            crashed = await transport.connect("sim://server")
            paused = await transport.connect("sim://other")
            start = elapsed(world)
            server.crash()
            other.pause()
            with pytest.raises(ConnectionClosedError):
                await crashed.recv()
            crash_seen = elapsed(world) - start
            with pytest.raises(ConnectionClosedError):
                await paused.recv()
            pause_seen = elapsed(world) - start
            other.resume()
            return crash_seen, pause_seen, paused.closed

        return await world._in(process, talk())

    crash_seen, pause_seen, closed = in_world(scenario)
    assert crash_seen < 0.01
    assert BOUND * 0.5 <= pause_seen <= BOUND
    assert closed


def test_connecting_across_a_cut_times_out_and_to_nothing_is_refused() -> None:
    async def scenario(world: World) -> tuple[float, float]:
        await _echo_server(world)
        process, transport = await _client(world)

        async def talk() -> tuple[float, float]:
            world.network.cut("server", "client")
            start = elapsed(world)
            with pytest.raises(ConnectError, match="timed out"):
                await transport.connect("sim://server", timeout=2.0)
            timed_out = elapsed(world) - start
            start = elapsed(world)
            with pytest.raises(ConnectError, match="refused"):
                await transport.connect("sim://nobody", timeout=2.0)
            return timed_out, elapsed(world) - start

        return await world._in(process, talk())

    timed_out, refused = in_world(scenario)
    assert timed_out == pytest.approx(2.0, abs=0.3)
    assert refused < 0.01


def test_a_replacement_closes_the_replaced_connection() -> None:
    async def scenario(world: World) -> tuple[bool, bool, bytes]:
        await _echo_server(world)
        process, transport = await _client(world)

        async def talk() -> tuple[bool, bool, bytes]:
            old = await transport.connect("sim://server", replace_key="k")
            new = await transport.connect("sim://server", replace_key="k")
            await new.send(b"x")
            return old.closed, new.closed, await new.recv()

        return await world._in(process, talk())

    assert in_world(scenario) == (True, False, b"x")


def test_a_sender_waits_while_the_receiver_does_not_read() -> None:
    async def scenario(world: World) -> tuple[int, int]:
        server = idle_process(world, "sink")
        held: list[Connection] = []

        async def handler(conn: Connection) -> None:
            held.append(conn)
            await asyncio.get_running_loop().create_future()  # never reads

        async def listen() -> None:
            await SimTransport().listen("sim://sink", handler)

        await world._in(server, listen())
        process, transport = await _client(world)

        async def flood() -> tuple[int, int]:
            conn = await transport.connect("sim://sink")
            sent = 0
            frame = b"x" * 64 * 1024

            async def send_all() -> None:
                nonlocal sent
                for _ in range(100):
                    await conn.send(frame)
                    sent += 1

            task = asyncio.get_running_loop().create_task(send_all())
            await asyncio.sleep(5.0)
            blocked_at = sent
            task.cancel()
            return blocked_at, world.network.config.buffer_bytes // len(frame)

        return await world._in(process, flood())

    blocked_at, fits = in_world(scenario)
    assert blocked_at == fits  # the bounded buffer is full; nothing more goes
