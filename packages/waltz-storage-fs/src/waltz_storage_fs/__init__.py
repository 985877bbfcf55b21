"""waltz_storage_fs: the file-segment storage engine of Waltz (plugin ``fs``).

The on-disk format is in :mod:`waltz_storage_fs.format`, the engine in
:mod:`waltz_storage_fs.engine`, the offline tools in :mod:`waltz_storage_fs.tools`.

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_storage_fs.engine import FsOptions, FsStorageEngine, FsStoragePartition

__all__ = ["FsOptions", "FsStorageEngine", "FsStoragePartition"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"FsOptions": ".engine", "FsStorageEngine": ".engine", "FsStoragePartition": ".engine"},
)
