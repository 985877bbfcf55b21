"""The client's own errors (in the one hierarchy: :class:`waltz_api.errors.ClientError`)."""

from __future__ import annotations

from waltz_api.errors import ClientError, PermissionDeniedError
from waltz_api.messages import ErrorResponse
from waltz_api.types import ReqId


class TransactionExpiredError(ClientError):
    """A context was not committed by its deadline (``ClientConfig.transaction_timeout``)
    and never will be: nothing of it is pending (it was waiting for its partition or a
    retry, or the server decided that its last append is not in the log). The message
    says why."""


class TransactionTooLargeError(ClientError):
    """A transaction (its data, its locks) does not fit in one frame of the transport
    (``max_frame_size``, 64 MiB by default): ``submit`` fails at once, nothing was sent.
    The message names the sizes and the limit."""


class TransactionOutcomeUnknownError(ClientError):
    """The deadline passed with an append in flight, and the partition's server could
    not be asked for its outcome (unreachable, or unable to decide while its storage
    recovers) within ``request_timeout``. The append may be committed: if it is, the feed
    delivers it like any transaction; the context is not re-executed. ``req_id`` is the
    append's, as the feed would carry it."""

    def __init__(self, message: str, req_id: ReqId) -> None:
        super().__init__(message)
        self.req_id = req_id


class PoisonTransactionError(ClientError):
    """``apply_transaction`` kept failing on one transaction (``ClientConfig.apply_retries``
    + 1 times) and the poison policy is ``"stop"``: the partition stopped, nothing after
    that transaction is applied and submissions to the partition fail with this error.
    Fix ``apply_transaction`` (or what it depends on), then restart the client: it
    resumes from ``client_high_water_mark``. Or skip such transactions:
    ``ClientConfig(poison_policy="skip")`` and ``WaltzClientCallbacks.dead_letter``."""

    def __init__(self, message: str, partition_id: int, transaction_id: int) -> None:
        super().__init__(message)
        self.partition_id = partition_id
        self.transaction_id = transaction_id


def access_denied(
    partition_id: int, permission: str, what: str, refusal: ErrorResponse
) -> PermissionDeniedError:
    """The final error of a request the server refused as ACCESS_DENIED (never retried:
    asking again changes nothing until an operator grants the permission)."""
    return PermissionDeniedError(
        f"{what} on partition {partition_id} refused: this client's key lacks the "
        f"{permission} permission there ({refusal.message})",
        partition_id,
        permission,
    )
