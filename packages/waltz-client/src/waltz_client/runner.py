"""Where the application's code runs: :class:`CallbackRunner`.

``async def`` callbacks and ``execute`` methods run on the client's event loop; plain
ones run on one callback thread (or the executor the application gave), one at a time
and in order, so an ``apply_transaction`` never runs between a submission's
``client_high_water_mark`` and its ``execute``. Builds waiting at the same time go to the
thread in one hop, and their outcomes come back to the loop in one call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from waltz_api.errors import ClientError
from waltz_client.api import (
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)

R = TypeVar("R")

CALLBACK_THREAD_PREFIX = "waltz-callbacks"

Built = tuple[TransactionBuilder, bool]
"""A context's builder, and whether ``execute`` wants it sent."""

_Build = tuple[TransactionContext, int, "asyncio.Future[Any]", TransactionBuilder | None]
"""A build waiting for the callback thread: its context, partition and outcome future,
and its builder when the high-water mark was read on the loop already (then only
``execute`` runs there, and the future gets what it returned; else the future gets the
:data:`Built`)."""


def _checked_builder(context: TransactionContext, p: int, hwm: object) -> TransactionBuilder:
    if isinstance(hwm, bool) or not isinstance(hwm, int):
        raise ClientError(f"client_high_water_mark returned {hwm!r}, not an int")
    context.attempts += 1
    return TransactionBuilder(p, hwm)


def _deliver_builds(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, built, exc in outcomes:
        if future.done():
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(built)


@dataclass(slots=True)
class _Queued:
    """A build sent to the callback thread by :meth:`CallbackRunner.build_many`."""

    builder: TransactionBuilder | None
    """Its builder, when the high-water mark was read on the loop (None: on the thread)."""
    future: asyncio.Future[Any]


class CallbackRunner:
    """Runs the application's callbacks and ``execute`` methods (see the module)."""

    def __init__(self, callbacks: WaltzClientCallbacks, executor: Executor | None) -> None:
        self.callbacks = callbacks
        self.hwm_is_async = inspect.iscoroutinefunction(callbacks.client_high_water_mark)
        self.apply_is_async = inspect.iscoroutinefunction(callbacks.apply_transaction)
        self.given_executor = executor
        """Runs the plain callbacks one at a time, in order (None: a thread of the client's
        own). The simulation's runs them on the loop: get_data() then reads the prefetch."""
        self._async_functions: dict[object, bool] = {}
        """function -> is it a coroutine function (``execute`` of each context class)."""
        self._builds: list[_Build] = []
        """Builds waiting for the callback thread (taken there in one hop)."""
        self._executor: Executor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = -1

    def start(self) -> None:
        """On the client's event loop, as the client starts."""
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self._executor = self.given_executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=CALLBACK_THREAD_PREFIX
        )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def is_async(self, fn: Callable[..., Any]) -> bool:
        key = getattr(fn, "__func__", fn)
        known = self._async_functions.get(key)
        if known is None:
            known = inspect.iscoroutinefunction(fn)
            if len(self._async_functions) > 1000:  # contexts made of ever new functions
                self._async_functions.clear()
            self._async_functions[key] = known
        return known

    async def call(self, fn: Callable[..., R | Awaitable[R]], *args: Any) -> R:
        """A callback: awaited on the loop when ``async def``, else on the thread."""
        if self.is_async(fn):
            result: R = await fn(*args)  # type: ignore[misc]
            return result
        value: Any = await self.on_thread(fn, *args)
        if inspect.isawaitable(value):
            value = await value
        done: R = value
        return done

    async def on_thread(self, fn: Callable[..., R], *args: Any) -> R:
        """A plain function on the callback thread."""
        assert self.loop is not None and self._executor is not None
        return await self.loop.run_in_executor(self._executor, fn, *args)

    def apply(self, transaction: Transaction) -> Awaitable[None]:
        """``apply_transaction(transaction)``, to await: the callback's own coroutine when
        it is an ``async def`` (no frame in between), else its run on the callback thread."""
        apply = self.callbacks.apply_transaction
        if self.apply_is_async:
            return apply(transaction)  # type: ignore[return-value]
        return self.call(apply, transaction)

    async def build(self, context: TransactionContext, p: int) -> Built:
        """Read the client high-water mark and execute the context. When both are plain
        methods they run together on the callback thread, so an apply never runs in
        between; the builds waiting at the same time go there in one hop (a plain
        ``execute`` after an async high-water mark too)."""
        execute = context.execute
        if self.hwm_is_async:
            hwm = await self.callbacks.client_high_water_mark(p)  # type: ignore[misc]
            builder = _checked_builder(context, p, hwm)
            if self.is_async(execute):
                return builder, bool(await execute(builder))  # type: ignore[misc]
            value = await self._queue_build(context, p, builder)
            if type(value) is not bool and inspect.isawaitable(value):  # (an ABC check)
                value = await value
            return builder, bool(value)
        if self.is_async(execute):
            builder = _checked_builder(
                context, p, await self.call(self.callbacks.client_high_water_mark, p)
            )
            return builder, bool(await execute(builder))  # type: ignore[misc]
        built: Built = await self._queue_build(context, p, None)
        return built

    async def build_many(
        self, items: list[tuple[TransactionContext, int]]
    ) -> list[Built | BaseException]:
        """:meth:`build` of each (context, partition), in order: every plain ``execute``
        goes to the callback thread in the one hop (after its high-water mark was read
        on the loop when that callback is ``async def``); each gets its :data:`Built` or
        what it raised."""
        pending: list[Built | BaseException | _Queued] = []
        hwm_is_async = self.hwm_is_async
        for context, p in items:
            if self.is_async(context.execute):
                try:
                    pending.append(await self.build(context, p))
                except Exception as exc:
                    pending.append(exc)
                continue
            builder = None
            if hwm_is_async:
                try:
                    hwm = await self.callbacks.client_high_water_mark(p)  # type: ignore[misc]
                    builder = _checked_builder(context, p, hwm)
                except Exception as exc:
                    pending.append(exc)
                    continue
            pending.append(_Queued(builder, self._queue_build(context, p, builder)))
        built: list[Built | BaseException] = []
        for item in pending:
            if not isinstance(item, _Queued):
                built.append(item)
                continue
            builder = item.builder
            try:
                value = await item.future
                if builder is None:
                    built.append(value)  # (the thread read the high-water mark: a Built)
                    continue
                if type(value) is not bool and inspect.isawaitable(value):
                    value = await value
                built.append((builder, bool(value)))
            except Exception as exc:
                built.append(exc)
        return built

    def _queue_build(
        self, context: TransactionContext, p: int, builder: TransactionBuilder | None
    ) -> asyncio.Future[Any]:
        """A build for the callback thread, sent there with the others of this loop turn."""
        loop = self.loop
        assert loop is not None
        future: asyncio.Future[Any] = loop.create_future()
        if not self._builds:
            loop.call_soon(self._send_builds)  # once this turn's builds have joined
        self._builds.append((context, p, future, builder))
        return future

    def _send_builds(self) -> None:
        builds, self._builds = self._builds, []
        assert self._executor is not None
        try:
            self._executor.submit(self._run_builds, builds)
        except RuntimeError as exc:  # the executor is shut down: the client is closing
            for _, _, future, _ in builds:
                if not future.done():
                    future.set_exception(ClientError(f"the Waltz client is closed ({exc})"))

    def _run_builds(self, builds: list[_Build]) -> None:
        """On the callback thread: each build's high-water mark read (unless it was read
        already) and execute, in order; the outcomes go back to the loop in one call."""
        read_hwm = self.callbacks.client_high_water_mark
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        for context, p, future, builder in builds:
            if future.done():
                continue  # the submission was cancelled meanwhile
            try:
                if builder is None:
                    built = _checked_builder(context, p, read_hwm(p))
                    outcomes.append((future, (built, bool(context.execute(built))), None))
                else:
                    outcomes.append((future, context.execute(builder), None))
            except BaseException as exc:
                outcomes.append((future, None, exc))
        assert self.loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_deliver_builds, outcomes)
