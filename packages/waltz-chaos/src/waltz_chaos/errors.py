"""The chaos run's own error (in the one hierarchy: :class:`waltz_api.errors.WaltzError`)."""

from __future__ import annotations

from waltz_api.errors import WaltzError


class ChaosError(WaltzError):
    """The chaos run cannot go on: a cluster process did not start, a namespace or a
    mount could not be made, a schedule file does not fit the cluster. The message
    says what and what to do."""


__all__ = ["ChaosError"]
