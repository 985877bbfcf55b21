"""The Waltz client: submit transactions, consume the feed, apply each transaction once.

See the package README for an example per concept.
"""

from waltz_api.types import Lock, LockMode
from waltz_client.api import (
    JSON,
    JsonSerializer,
    Serializer,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_client.client import AsyncWaltzClient, ClientConfig
from waltz_client.errors import (
    PoisonTransactionError,
    TransactionExpiredError,
    TransactionOutcomeUnknownError,
    TransactionTooLargeError,
)
from waltz_client.sync import WaltzClient

__all__ = [
    "JSON",
    "AsyncWaltzClient",
    "ClientConfig",
    "JsonSerializer",
    "Lock",
    "LockMode",
    "PoisonTransactionError",
    "Serializer",
    "SubmissionResult",
    "Transaction",
    "TransactionBuilder",
    "TransactionContext",
    "TransactionExpiredError",
    "TransactionOutcomeUnknownError",
    "TransactionTooLargeError",
    "WaltzClient",
    "WaltzClientCallbacks",
]
