"""waltz_storage_fs: the file-segment storage engine of Waltz (plugin ``fs``).

The on-disk format is in :mod:`waltz_storage_fs.format`, the engine in
:mod:`waltz_storage_fs.engine`, the offline tools in :mod:`waltz_storage_fs.tools`.
"""

from waltz_storage_fs.engine import FsOptions, FsStorageEngine, FsStoragePartition

__all__ = ["FsOptions", "FsStorageEngine", "FsStoragePartition"]
