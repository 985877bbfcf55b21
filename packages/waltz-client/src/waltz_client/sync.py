"""The synchronous facade: the asyncio client on its own thread, for threaded applications."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterable
from types import TracebackType
from typing import Any, Self, TypeVar

from waltz_api.errors import ClientError
from waltz_api.types import Record
from waltz_client.api import SubmissionResult, TransactionContext, WaltzClientCallbacks
from waltz_client.client import CALLBACK_THREAD_PREFIX, AsyncWaltzClient, ClientConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


class WaltzClient:
    """A Waltz client for threaded code; every method is thread-safe.

    ::

        with WaltzClient(callbacks, ClientConfig("zk://127.0.0.1:2181/waltz")) as client:
            future = client.submit(Deposit(account=7, amount=100))
            assert future.result(timeout=10)

    ``submit`` blocks while the partition has ``max_concurrent_transactions`` in
    flight (back pressure), then returns a :class:`concurrent.futures.Future`.
    """

    def __init__(
        self,
        callbacks: WaltzClientCallbacks,
        config: ClientConfig,
        *,
        start_timeout: float = 60.0,
    ) -> None:
        self._client = AsyncWaltzClient(callbacks, config)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="waltz-client", daemon=True)
        self._closed = False
        self._thread.start()
        self._ready.wait()
        try:
            self._call(self._client.start(), start_timeout)
        except BaseException:
            self._stop_loop()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()
        # drain callbacks scheduled by the shutdown
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if self._closed:
            coro.close()
            raise ClientError("the Waltz client is closed")
        if self._on_own_thread():
            coro.close()
            raise self._own_thread_error()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _wait(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        if self._on_own_thread():
            future.cancel()
            raise self._own_thread_error()
        return future.result(timeout)

    def _on_own_thread(self) -> bool:
        current = threading.current_thread()
        return current is self._thread or current.name.startswith(CALLBACK_THREAD_PREFIX)

    @staticmethod
    def _own_thread_error() -> ClientError:
        return ClientError(
            "a blocking WaltzClient method was called from the client's own threads (a "
            "callback or hook): it would wait for the feed that thread is processing; "
            "call it from another thread"
        )

    @property
    def client_id(self) -> int:
        return self._client.client_id

    @property
    def num_partitions(self) -> int:
        return self._client.num_partitions

    @property
    def async_client(self) -> AsyncWaltzClient:
        """The asyncio client underneath (use it only on its loop)."""
        return self._client

    def submit(
        self, context: TransactionContext, *, timeout: float | None = None
    ) -> concurrent.futures.Future[SubmissionResult]:
        """Start ``context``; the future resolves to a :class:`SubmissionResult` (true
        when committed, with its transaction id; false when ``execute`` declined), or
        raises what failed it. Blocks (up to ``timeout``, then TimeoutError and nothing
        is submitted) while the partition is at its concurrency limit. Cancelling the
        future gives up the submission and frees its slot."""
        if self._closed:
            raise ClientError("the Waltz client is closed")
        result: concurrent.futures.Future[SubmissionResult] = concurrent.futures.Future()
        started: list[asyncio.Task[SubmissionResult]] = []

        def cancel_started() -> None:
            for task in started:
                task.cancel()

        def abandoned(future: concurrent.futures.Future[SubmissionResult]) -> None:
            if future.cancelled() and not self._closed:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nothing runs
                    self._loop.call_soon_threadsafe(cancel_started)

        async def start() -> None:
            task = await self._client.enqueue(context)
            started.append(task)
            if result.cancelled():  # given up while waiting for the slot
                task.cancel()
                return

            def done(t: asyncio.Task[SubmissionResult]) -> None:
                if t.cancelled():
                    result.cancel()
                elif (exc := t.exception()) is not None:
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        result.set_exception(exc)
                else:
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        result.set_result(t.result())

            task.add_done_callback(done)

        result.add_done_callback(abandoned)
        starting = asyncio.run_coroutine_threadsafe(start(), self._loop)
        try:
            self._wait(starting, timeout)
        except BaseException:
            result.cancel()  # whatever start() got to, it is given up
            starting.cancel()
            raise
        return result

    def submit_many(
        self, contexts: Iterable[TransactionContext]
    ) -> list[SubmissionResult | BaseException]:
        """See :meth:`AsyncWaltzClient.submit_many`: blocks until every one is decided
        (each within ``transaction_timeout``, when set)."""
        return self._call(self._client.submit_many(list(contexts)), None)

    def submit_nowait(
        self, context: TransactionContext
    ) -> concurrent.futures.Future[SubmissionResult]:
        """See :meth:`AsyncWaltzClient.submit_nowait`: never blocks (no back pressure
        here: a submission beyond the free slots waits in its batch); one hop to the
        client's loop, no task of its own. The submissions of every thread that reach
        the loop together run as one batch. Cancelling the future gives it up (when it is
        not in flight)."""
        if self._closed:
            raise ClientError("the Waltz client is closed")
        result: concurrent.futures.Future[SubmissionResult] = concurrent.futures.Future()
        started: list[asyncio.Future[SubmissionResult]] = []

        def deliver(inner: asyncio.Future[SubmissionResult]) -> None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if inner.cancelled():
                    result.cancel()
                elif (exc := inner.exception()) is not None:
                    result.set_exception(exc)
                else:
                    result.set_result(inner.result())

        def start() -> None:
            if result.cancelled():
                return
            try:
                inner = self._client.submit_nowait(context)
            except BaseException as exc:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    result.set_exception(exc)
                return
            started.append(inner)
            inner.add_done_callback(deliver)

        def cancel_started() -> None:
            for inner in started:
                inner.cancel()

        def abandoned(future: concurrent.futures.Future[SubmissionResult]) -> None:
            if future.cancelled() and not self._closed:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(cancel_started)

        result.add_done_callback(abandoned)
        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed
            raise ClientError("the Waltz client is closed") from None
        return result

    def flush(self, partition_id: int, timeout: float | None = None) -> int:
        """See :meth:`AsyncWaltzClient.flush`."""
        return self._call(self._client.flush(partition_id, timeout), None)

    def high_water_mark(self, partition_id: int, timeout: float | None = None) -> int:
        """See :meth:`AsyncWaltzClient.high_water_mark`."""
        return self._call(self._client.high_water_mark(partition_id, timeout), None)

    def range_read(
        self,
        partition_id: int,
        start_transaction_id: int,
        *,
        max_records: int = 1000,
        max_bytes: int = 16 * 1024 * 1024,
    ) -> tuple[int, tuple[Record, ...]]:
        """See :meth:`AsyncWaltzClient.range_read`: committed records with their data
        from ``start_transaction_id``, and the partition's high-water mark."""
        return self._call(
            self._client.range_read(
                partition_id, start_transaction_id, max_records=max_records, max_bytes=max_bytes
            ),
            None,
        )

    def feed_position(self, partition_id: int) -> int:
        async def read() -> int:
            return self._client.feed_position(partition_id)

        return self._call(read(), None)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the client and its thread (idempotent)."""
        if self._closed:
            return
        try:
            self._call(self._client.close(), timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
