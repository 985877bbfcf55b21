"""What waltz-client adds to the command line and the docs (entry point ``waltz_client``):
``waltz client`` and ``waltz perf``, and the table of the client's options
(``ClientConfig``).

Light on purpose: the client is imported when one of its commands is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, OptionSchema, OptionSpec, hookimpl

if TYPE_CHECKING:
    import click


def load_client() -> click.Command:
    from waltz_client.cli.client import client_group

    return client_group


def load_perf() -> click.Command:
    from waltz_client.cli.perf import perf_group

    return perf_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "client", load_client, "A client of a running cluster: append, tail, high-water-mark."
        ),
        CommandDescriptor(
            "perf",
            load_perf,
            "Load a running cluster and measure it (progress bar on stderr, summary on stdout).",
        ),
    ]


CLIENT_MEANINGS = {
    "coordination": "coordination URI (`zk://`, `etcd://`, `local://`) or a started "
    "`Coordination` the caller owns",
    "coordination_options": "coordination plugin options, passed as-is (tables below)",
    "transport": "transport plugin name",
    "transport_options": "transport plugin options, passed as-is (tables below)",
    "partitions": "the partitions to mount (unset: all); submissions to others fail",
    "max_concurrent_transactions": "transactions in flight per partition; `submit` waits beyond it",
    "data_cache_bytes": "bound of the transaction data cache (LRU)",
    "connect_timeout": "seconds to connect to a server",
    "request_timeout": "seconds to wait for an answer (a mount is re-sent after it; a data "
    "request fails after it)",
    "retry_interval": "seconds before mounting or asking again after NOT_READY, a refusal or "
    "a lost connection (doubling up to 1 s, with jitter, while attempts fail)",
    "transaction_timeout": "deadline of a submission in seconds (waiting, retries and its "
    "append in flight): then it is decided (committed, `TransactionExpiredError`, or "
    "`TransactionOutcomeUnknownError` when the server cannot be asked); unset: none",
    "prefetch_data": "fetch the data of feed items before the callbacks ask (those arriving "
    "together pipelined)",
    "apply_retries": "times a transaction `apply_transaction` raised on is offered again "
    "(back-off from `retry_interval` doubling to 10 s) before `poison_policy` decides",
    "poison_policy": "`stop`: the partition stops with `PoisonTransactionError`; `skip`: the "
    "transaction goes to `WaltzClientCallbacks.dead_letter` and the feed goes on",
}
"""The meaning of each ``ClientConfig`` field (documented in ``docs/operators.md``)."""


def client_options() -> Sequence[OptionSpec]:
    """``ClientConfig`` (a constructor, not a file: no environment)."""
    from waltz_api.config import option_specs
    from waltz_client.client import ClientConfig

    return option_specs(ClientConfig, CLIENT_MEANINGS)


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("client-config", client_options)]
