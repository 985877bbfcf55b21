"""The pytest plugin (entry point ``pytest11``) of the conformance suite."""

from __future__ import annotations

import pytest

# Session-scoped fixtures of real servers (ZooKeeper, etcd), shared by every package's tests.
from waltz_conformance.servers.fixtures import etcd_cluster, zookeeper_server  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("waltz", "Waltz conformance suite")
    group.addoption(
        "--waltz-damage-variants",
        type=int,
        default=None,
        help="variants of the storage suite's damage sweep (default: the suite's, 1000)",
    )
    group.addoption(
        "--waltz-damage-seed",
        type=int,
        default=None,
        help="the damage sweep's first seed (default 0; a failing seed replays exactly)",
    )
    group.addoption(
        "--waltz-fuzz-iterations",
        type=int,
        default=None,
        help="inputs per fuzzer (default: the CI figure of each; or WALTZ_FUZZ_ITERATIONS)",
    )
    group.addoption(
        "--waltz-fuzz-seed",
        type=int,
        default=None,
        help="seed of the fuzzers (default fixed; or WALTZ_FUZZ_SEED); a failure names it",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "waltz_requires(*capabilities): the test needs optional backend capabilities; "
        "it is skipped with the reason for a backend that does not declare them",
    )
