"""The Waltz client: submit transactions, consume the feed, apply each transaction once.

See the package README for an example per concept.

The names below are imported on first use: the package's entry point
(:mod:`waltz_client.plugin`, the ``waltz client`` and ``waltz perf`` commands) imports
this package in every ``waltz`` run, which must not cost the whole client.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
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
    from waltz_client.client import AsyncWaltzClient
    from waltz_client.config import ClientConfig
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
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Lock": "waltz_api.types",
        "LockMode": "waltz_api.types",
        **dict.fromkeys(
            [
                "JSON",
                "JsonSerializer",
                "Serializer",
                "SubmissionResult",
                "Transaction",
                "TransactionBuilder",
                "TransactionContext",
                "WaltzClientCallbacks",
            ],
            ".api",
        ),
        "AsyncWaltzClient": ".client",
        "ClientConfig": ".config",
        **dict.fromkeys(
            [
                "PoisonTransactionError",
                "TransactionExpiredError",
                "TransactionOutcomeUnknownError",
                "TransactionTooLargeError",
            ],
            ".errors",
        ),
        "WaltzClient": ".sync",
    },
)
