"""What a partition is told by its client: :class:`PartitionHost`.

The client's core has one direction. :class:`~waltz_client.client.AsyncWaltzClient`
makes its partitions (:mod:`waltz_client.partition`, with their part
:mod:`waltz_client.decisions`) and its channels (:mod:`waltz_client.channel`), and
gives each what it needs: a partition a :class:`PartitionHost`, a channel a
:class:`~waltz_client.channel.ChannelHost`. Neither imports the client nor touches its
private state, so each can be read, and tested, on its own.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from waltz_api.backoff import Backoff
from waltz_api.cluster import ClusterMetadata
from waltz_api.types import ReqId
from waltz_client.api import Transaction, WaltzClientCallbacks
from waltz_client.channel import Channel
from waltz_client.config import ClientConfig

R = TypeVar("R")


class PartitionHost(Protocol):
    """The client's services a partition uses: its configuration and callbacks, request
    ids, connections, the callback thread, the data cache and fetches, error reports."""

    @property
    def config(self) -> ClientConfig: ...

    @property
    def callbacks(self) -> WaltzClientCallbacks: ...

    @property
    def rng(self) -> random.Random:
        """The jitter of every back-off (seeded to replay a run)."""
        ...

    @property
    def apply_is_async(self) -> bool:
        """``apply_transaction`` is an ``async def`` (it runs on the loop, one by one)."""
        ...

    @property
    def closing(self) -> bool: ...

    @property
    def metadata(self) -> ClusterMetadata:
        """The cluster metadata (a new one after the coordination session is renewed)."""
        ...

    def next_req_id(self, partition_id: int, generation: int) -> ReqId:
        """A new request id of this client for the partition's assignment."""
        ...

    async def connect(self, endpoint: str) -> Channel:
        """The channel to the server at ``endpoint`` (shared by its partitions)."""
        ...

    async def call_callback(self, fn: Callable[..., R | Awaitable[R]], *args: Any) -> R:
        """An application callback: on the loop when it is ``async def``, else on the
        callback thread, in order with the others."""
        ...

    async def on_callback_thread(self, fn: Callable[..., R], *args: Any) -> R:
        """A plain function on the callback thread (a run of callbacks in one hop)."""
        ...

    def apply(self, transaction: Transaction) -> Awaitable[None]:
        """``apply_transaction(transaction)``, to await."""
        ...

    def report(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        """The application's ``uncaught_exception`` (its own exception only logged)."""
        ...

    def fetch_data(self, partition_id: int, transaction_id: int) -> Awaitable[bytes]:
        """A transaction's data: from the cache, else from the server (and cached)."""
        ...

    def blocking_fetch(self, partition_id: int, transaction_id: int) -> bytes:
        """:meth:`fetch_data` for a callback on the callback thread."""
        ...

    def cache_put(self, partition_id: int, transaction_id: int, data: bytes) -> None:
        """A committed transaction's data, known here (one of ours): into the cache."""
        ...

    def count_seen(self, count: int) -> None:
        """``count`` more feed transactions were processed (applied or skipped)."""
        ...

    def retry_backoff(self) -> Backoff:
        """The pacing of one request's retries."""
        ...
