"""The one error hierarchy of Waltz.

Every error raised by Waltz code derives from :class:`WaltzError`. A message
says what was wrong and, where the caller can act, what to do about it.

A bad argument raises :class:`InvalidArgumentError` (also a ``ValueError``) or
:class:`ArgumentTypeError` (also a ``TypeError``), so code that catches what Python
raises for bad arguments keeps working. Two exceptions to the rule, both defects
rather than errors to handle: an import-time check of Waltz's own definitions (a wire
schema that does not match its message) raises ``TypeError``, and the conformance
suites fail a test with ``AssertionError``.
"""

from __future__ import annotations


class WaltzError(Exception):
    """Base class of every error Waltz raises."""


class UnavailableError(WaltzError):
    """What the caller waited for (the coordination service, a server, a storage node)
    did not answer within its deadline, or refused the connection: it is down,
    unreachable or overloaded, and asking again later may succeed. The ``waltz``
    command line ends with exit code 4 on it."""


class InvalidArgumentError(WaltzError, ValueError):
    """An argument has a value the call cannot take (a lock without a name, a URL that is
    not http://host:port/, ...)."""


class ArgumentTypeError(WaltzError, TypeError):
    """An argument has a type the call cannot take."""


# -- configuration and plugins -------------------------------------------------


class ConfigError(WaltzError):
    """A configuration file or environment override is invalid.

    ``key`` names the offending key (dotted, e.g. ``storage.segment_size``)
    when one is known.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class PluginError(WaltzError):
    """A plugin could not be found, loaded or chosen."""


class UnknownPluginError(PluginError):
    """No plugin of that kind has that name; the message lists the valid ones."""


class DuplicatePluginError(PluginError):
    """Two plugins registered the same name for the same kind."""


class ProcessStartError(WaltzError):
    """A child process (``waltz_api.supervised``) exited while starting, or was not
    ready by its deadline; the message ends with the end of its log. ``returncode`` is
    its exit code (None: still running, late)."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


# -- wire protocol --------------------------------------------------------------


class ProtocolError(WaltzError):
    """Bytes received from a peer are not a valid Waltz message.

    The connection that delivered them should be closed; nothing that was
    committed is affected.
    """


class ChecksumError(ProtocolError):
    """Transaction data did not match its CRC-32C checksum."""


class FrameTooLargeError(ProtocolError):
    """A frame is larger than the configured maximum frame size."""


class VersionMismatchError(ProtocolError):
    """The peers share no protocol version."""


# -- storage ------------------------------------------------------------------------


class StorageError(WaltzError):
    """A storage engine or storage node operation failed."""


class CorruptionError(StorageError):
    """Data on disk failed a checksum or structural check."""


class ClusterKeyMismatchError(StorageError):
    """A request carried a cluster key other than the one the storage belongs to."""


class SessionFencedError(StorageError):
    """A request carried a store session id older than one already seen.

    A newer store session owns the partition; the older writer must stop.
    """

    def __init__(self, message: str, highest_session_id: int = -1) -> None:
        super().__init__(message)
        self.highest_session_id = highest_session_id


class PartitionNotFoundError(StorageError):
    """The partition is not hosted (or not open) here."""


class PartitionClosedError(StorageError):
    """The partition could not be opened, or has been closed."""


class StorageAppendError(StorageError):
    """An append was refused (for example: its ids do not follow the last record)."""


class RecordsArchivedError(StorageError):
    """A read asked for records below the local log's start: they were archived and
    deleted from this storage (``StoragePartition.drop_prefix``); read them from the
    archive (a Waltz server does so by itself)."""


class ArchiveError(WaltzError):
    """The archive (tiered storage) could not be read or written, or an archived object
    failed its checks; the message names the partition, the range and the object."""


# -- coordination ---------------------------------------------------------------


class CoordinationError(WaltzError):
    """A coordination service operation failed."""


class NodeExistsError(CoordinationError):
    """``create`` of a path that already exists."""


class NoNodeError(CoordinationError):
    """The path does not exist."""


class BadVersionError(CoordinationError):
    """A compare-and-set (or versioned delete) lost: the version had changed."""


class NotEmptyError(CoordinationError):
    """Delete of a path that still has children."""


class SessionLostError(CoordinationError):
    """The coordination session expired; every ephemeral entry it owned is gone."""


class CoordinationUnavailableError(CoordinationError, UnavailableError):
    """The coordination service could not be reached in time."""


class ClusterExistsError(CoordinationError):
    """``cluster create`` against a root that already holds a cluster."""


class ClusterNotFoundError(CoordinationError):
    """No cluster metadata at the configured root; run ``waltz cluster create``."""


# -- transport ------------------------------------------------------------------


class TransportError(WaltzError):
    """A transport operation failed."""


class ConnectionClosedError(TransportError):
    """The connection is closed (by either side, or because the peer died)."""


class ConnectError(TransportError, UnavailableError):
    """A connection to an endpoint could not be established."""


class AuthenticationError(TransportError):
    """The peer could not be authenticated."""


# -- server and client --------------------------------------------------------------


class ServerError(WaltzError):
    """A server refused or failed a request."""


class PartitionNotReadyError(ServerError):
    """The partition is not (yet) served by the server asked."""


class ClientAheadError(ServerError):
    """The client's high-water mark is beyond the partition's.

    This is a configuration error: the client's database belongs to another
    cluster, or the log lost data. Check the client's database and cluster.
    """


class StaleGenerationError(ServerError):
    """A newer generation of the partition exists: it moved to another server.

    The holder of the older generation must stop serving the partition; a
    client re-reads the partition assignment and mounts on the new owner."""

    def __init__(self, message: str, current_generation: int = -1) -> None:
        super().__init__(message)
        self.current_generation = current_generation


class PermissionDeniedError(ServerError):
    """The cluster's access control does not grant this client's key ``permission``
    (``read``, ``write`` or ``admin``) on partition ``partition_id``: the server refused
    the request (ErrorCode.ACCESS_DENIED) and did nothing. Never retried: a refused
    append, data fetch, range read, flush or high-water-mark request fails alone (the
    next one is asked again); a refused mount stops the partition in that client
    (every submission to it fails with this error) until the client is restarted,
    once an operator granted the permission (``waltz acl grant``)."""

    def __init__(self, message: str, partition_id: int = -1, permission: str = "") -> None:
        super().__init__(message)
        self.partition_id = partition_id
        self.permission = permission


class StoreSessionClosedError(ServerError):
    """The store session ended (a replica failed, a newer session fenced it, or the
    partition closed) before the append was acknowledged by a quorum.

    The outcome is unknown, not failed: recovery may still commit the
    transaction. A client learns the outcome from the feed."""


class LockFailureError(WaltzError):
    """A transaction was rejected by the optimistic lock check."""

    def __init__(self, message: str, transaction_id: int) -> None:
        super().__init__(message)
        self.transaction_id = transaction_id


class ClientError(WaltzError):
    """Misuse of the client API, or a client-side failure."""
