"""What every suite's harness has in common: a name and declared capabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from waltz_api import capabilities

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Harness:
    """Base of the per-contract harnesses a backend author provides.

    ``capabilities`` are declared, never guessed (names from
    :mod:`waltz_api.capabilities`; an unknown one is a PluginError): a test that needs
    one the backend does not declare is skipped with the reason.
    """

    name: str
    capabilities: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self.capabilities = capabilities.check(
            self.capabilities, where=f"declared by the harness {self.name!r}"
        )


def requires(*names: str) -> Callable[[F], F]:
    """Mark a suite test as needing optional capabilities (names from
    :mod:`waltz_api.capabilities`: an unknown one is a PluginError when the suite is
    defined, never a test skipped forever)."""
    capabilities.check(names, where="required by a conformance test")
    return pytest.mark.waltz_requires(*names)


def skip_unless_capable(request: pytest.FixtureRequest, harness: Harness) -> None:
    """Skip the requesting test, with its reason, when ``harness`` lacks a capability."""
    for marker in request.node.iter_markers("waltz_requires"):
        missing = [c for c in marker.args if c not in harness.capabilities]
        if missing:
            pytest.skip(
                f"{harness.name} does not declare the optional capability "
                f"{', '.join(repr(c) for c in missing)}"
            )
