"""The client's configuration: :class:`ClientConfig`, checked when it is made."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import ClientError
from waltz_client.state import ApplyFailures, ConcurrencyLimit, TransactionDataCache

POISON_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class ClientConfig:
    """How a client finds and talks to a cluster.

    - ``coordination``: a URI (``zk://127.0.0.1:2181/waltz``, ``local:///var/lib/waltz``)
      or a started :class:`~waltz_api.contracts.coordination.Coordination` the caller owns.
    - ``transport``: the transport plugin name (``zmq``) and its options.
    - ``partitions``: the partitions to mount (None: all); submissions to others fail.
    - ``max_concurrent_transactions``: per partition; ``submit`` waits beyond it.
    - ``data_cache_bytes``: the bound of the transaction data cache.
    """

    coordination: str | Coordination
    coordination_options: Mapping[str, Any] = field(default_factory=dict)
    transport: str = "zmq"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    partitions: Sequence[int] | None = None
    max_concurrent_transactions: int = 100
    data_cache_bytes: int = 64 * 1024 * 1024
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    retry_interval: float = 0.2
    """Pause before mounting or asking again after NOT_READY, a refusal or a lost
    connection (doubling up to 1 s, with jitter, while attempts fail)."""
    transaction_timeout: float | None = 120.0
    """The deadline of a submission, in seconds from its start (once it holds a slot):
    waiting for its partition, re-executions and its append in flight. When it passes,
    an append in flight is decided by asking the server (a flush): committed (the
    result), or not (:class:`TransactionExpiredError`); unknown only when the server
    cannot be asked within ``request_timeout`` more (:class:`TransactionOutcomeUnknownError`).
    None: no deadline."""
    prefetch_data: bool = False
    """Fetch the data of feed items before the callbacks ask, those that arrive together
    concurrently (for applications that read the data of most transactions)."""
    apply_retries: int = 8
    """How many times a transaction whose ``apply_transaction`` raised is offered again
    (the feed restarts from ``client_high_water_mark`` after a back-off: from
    ``retry_interval`` doubling up to 10 s, about half a minute in all by default)
    before ``poison_policy`` decides."""
    poison_policy: str = "stop"
    """What to do with a transaction ``apply_transaction`` still fails on after
    ``apply_retries``: ``"stop"`` the partition (:class:`PoisonTransactionError`), or
    ``"skip"`` it: hand it to :meth:`WaltzClientCallbacks.dead_letter` and go on."""

    def __post_init__(self) -> None:
        if self.transaction_timeout is not None and (
            not isinstance(self.transaction_timeout, int | float) or self.transaction_timeout <= 0
        ):
            raise ClientError(
                "ClientConfig.transaction_timeout must be a positive number or None, "
                f"got {self.transaction_timeout!r}"
            )
        for name in ("connect_timeout", "request_timeout", "retry_interval"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ClientError(f"ClientConfig.{name} must be a positive number, got {value!r}")
        ConcurrencyLimit[object](self.max_concurrent_transactions)
        TransactionDataCache[object](self.data_cache_bytes)
        ApplyFailures(self.apply_retries)
        if self.poison_policy not in POISON_POLICIES:
            raise ClientError(
                f"ClientConfig.poison_policy must be one of {', '.join(POISON_POLICIES)}, "
                f"got {self.poison_policy!r}"
            )
