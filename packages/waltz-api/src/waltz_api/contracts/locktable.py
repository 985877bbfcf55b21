"""The LockTable contract: optimistic concurrency control for one partition."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from waltz_api.types import NO_TRANSACTION, LockRequest


class LockTable(ABC):
    """The lock table of one partition (spec: Concurrency Control).

    It estimates, for a lock hash, the id of the last committed transaction
    that held that lock in WRITE or APPEND mode. The estimate may be too high
    (a false positive: a transaction is rejected needlessly) but is never too
    low (a false negative: a real conflict let through). That is the safety
    rule, and the conformance suite checks it against an exact model.

    Semantics of the three modes (see :class:`waltz_api.types.LockMode`):

    - READ locks are checked and never recorded;
    - WRITE locks are checked and recorded;
    - APPEND locks are recorded and never checked.

    A request passes when the maximum estimate over its READ and WRITE locks
    is at most the client's high-water mark (the client had seen the last
    change of every entity it locks). Otherwise it fails, and the failure
    carries that estimate: the client waits until its high-water mark reaches
    it before re-executing.

    ``record`` is called when the server assigns the transaction its id, in
    id order, before the commit is known. So a second transaction on the same
    lock, checked while the first is still in flight, already sees it. If an
    in-flight transaction then fails to commit, the partition runs recovery and
    calls ``reset`` with the recovered high-water mark, which is conservative
    (every lock looks changed at that mark), never unsafe.

    A lock table is used from one task at a time (the partition's append
    path); it need not be thread-safe.
    """

    def __init__(
        self, high_water_mark: int = NO_TRANSACTION, options: Mapping[str, Any] | None = None
    ) -> None:
        self.options: Mapping[str, Any] = dict(options or {})

    @abstractmethod
    def estimate(self, request: LockRequest) -> int:
        """The highest estimated last-change transaction id over the READ and WRITE
        locks of ``request``; ``NO_TRANSACTION`` (-1) when it has none of them.

        Never lower than the true value (no false negative), and never higher
        than the highest id given to :meth:`record` or :meth:`reset` since the
        last reset (a client that has seen everything always passes).
        """

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        """``None`` when ``request`` passes for a client at ``client_high_water_mark``,
        else the conflicting transaction id (the estimate) to report in a LockFailure."""
        if not (request.read or request.write):
            return None
        estimate = self.estimate(request)
        return estimate if estimate > client_high_water_mark else None

    @abstractmethod
    def record(self, request: LockRequest, transaction_id: int) -> None:
        """Record the WRITE and APPEND locks of ``request`` as changed at
        ``transaction_id``. Ids are recorded in increasing order."""

    @abstractmethod
    def reset(self, high_water_mark: int) -> None:
        """Forget the history: every lock now estimates ``high_water_mark``.

        Called when the partition opens and after every recovery."""

    def stats(self) -> Mapping[str, Any]:
        """Implementation figures (size, memory) for metrics; optional."""
        return {}
