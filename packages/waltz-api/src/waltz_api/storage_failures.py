"""Error <-> FailureResponse code mapping, shared by the storage node and its clients.

The node turns a :class:`~waltz_api.errors.WaltzError` into a FailureResponse
``code``; a client turns the code back into the same error class, so a caller
handles a refusal exactly as it would handle a local error.
"""

from __future__ import annotations

from waltz_api.errors import (
    ChecksumError,
    ClusterKeyMismatchError,
    CorruptionError,
    PartitionClosedError,
    PartitionNotFoundError,
    ProtocolError,
    SessionFencedError,
    StorageAppendError,
    StorageError,
    WaltzError,
)
from waltz_api.messages import ErrorCode, FailureResponse


class StorageNotOpenError(StorageError):
    """A request arrived on a storage connection before a successful StorageOpenRequest."""


class StorageRequestError(StorageError):
    """A storage node refused a request as invalid (bad arguments, unknown message)."""


# Order matters: subclasses before their bases.
_CODE_FOR_ERROR: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (SessionFencedError, ErrorCode.FENCED),
    (ClusterKeyMismatchError, ErrorCode.CLUSTER_KEY_MISMATCH),
    (PartitionNotFoundError, ErrorCode.PARTITION_NOT_FOUND),
    (PartitionClosedError, ErrorCode.PARTITION_CLOSED),
    (StorageAppendError, ErrorCode.APPEND_REFUSED),
    (ChecksumError, ErrorCode.CHECKSUM),
    (CorruptionError, ErrorCode.CORRUPTION),
    (StorageNotOpenError, ErrorCode.NOT_OPEN),
    (StorageRequestError, ErrorCode.BAD_REQUEST),
    (ProtocolError, ErrorCode.BAD_REQUEST),
)

_ERROR_FOR_CODE: dict[ErrorCode, type[StorageError] | type[ProtocolError]] = {
    ErrorCode.CLUSTER_KEY_MISMATCH: ClusterKeyMismatchError,
    ErrorCode.PARTITION_NOT_FOUND: PartitionNotFoundError,
    ErrorCode.PARTITION_CLOSED: PartitionClosedError,
    ErrorCode.APPEND_REFUSED: StorageAppendError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.CORRUPTION: CorruptionError,
    ErrorCode.NOT_OPEN: StorageNotOpenError,
    ErrorCode.BAD_REQUEST: StorageRequestError,
}


def code_for(exc: BaseException) -> ErrorCode:
    """The FailureResponse code of an error raised while serving a request."""
    for error_class, code in _CODE_FOR_ERROR:
        if isinstance(exc, error_class):
            return code
    return ErrorCode.GENERIC


def error_from_failure(failure: FailureResponse) -> WaltzError:
    """The error a client raises for a storage node's FailureResponse."""
    message = f"storage node refused the request ({failure.code.name}): {failure.message}"
    if failure.code is ErrorCode.FENCED:
        return SessionFencedError(message, failure.highest_session_id)
    error_class = _ERROR_FOR_CODE.get(failure.code, StorageError)
    return error_class(message)
