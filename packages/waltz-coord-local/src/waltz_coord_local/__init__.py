"""Waltz coordination embedded in a SQLite file, shared by the processes of one machine.

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_coord_local.coordination import LocalCoordination, parse_location, resolve_location

__all__ = ["LocalCoordination", "parse_location", "resolve_location"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "LocalCoordination": ".coordination",
        "parse_location": ".coordination",
        "resolve_location": ".coordination",
    },
)
