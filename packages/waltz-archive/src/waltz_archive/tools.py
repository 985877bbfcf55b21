"""What ``waltz archive status|verify|restore`` do with an archive (blocking calls).

- :func:`load_manifest`: a partition's manifest by name.
- :func:`verify_manifest`: every range of a manifest read back and checked (footer, ids,
  data checksums, digest); the problems, each naming the range and the object.
- :func:`best_manifest`: from the archive alone (no cluster metadata: a whole new
  cluster is being restored), the manifest with the highest mark whose ranges verify.
  Every range ever archived holds committed records only, so any manifest whose ranges
  verify is a prefix of the partition's committed log; the highest is the most of it.
- :func:`orphans`: objects no manifest names (left by rounds that crashed or lost a race).
- :func:`set_aside_above`: what a restore moves out of the way: every range object and
  manifest above the restored mark (the dead cluster's history past it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from waltz_api.errors import ArchiveError
from waltz_archive import layout
from waltz_archive.manifest import Manifest
from waltz_archive.objects import RangeFile, verify_object
from waltz_archive.store import ArchiveStore

log = logging.getLogger(__name__)


def load_manifest(store: ArchiveStore, partition_id: int, name: str) -> Manifest:
    path = store.path(layout.partition_dir(partition_id), name)
    return Manifest.decode(store.read_bytes(path), store.where(path), partition_id)


@dataclass
class Verification:
    """The outcome of checking a manifest's ranges."""

    partition_id: int
    mark: int
    ranges: int = 0
    records: int = 0
    data_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_manifest(
    store: ArchiveStore,
    manifest: Manifest,
    *,
    full: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Verification:
    """Every range of ``manifest`` read back whole (``full``) or its footer only."""
    result = Verification(manifest.partition_id, manifest.mark)
    for archived in manifest.ranges:
        try:
            if full:
                records, data_bytes = verify_object(store, manifest.partition_id, archived)
            else:
                reader = RangeFile(store, manifest.partition_id, archived)
                try:
                    reader.check_footer()
                finally:
                    reader.close()
                records, data_bytes = archived.records, archived.data_bytes
        except ArchiveError as exc:
            result.problems.append(str(exc))
            continue
        result.ranges += 1
        result.records += records
        result.data_bytes += data_bytes
        if progress is not None:
            progress(f"partition {manifest.partition_id}: {archived.first}..{archived.last} ok")
    return result


def manifest_names(store: ArchiveStore, partition_id: int) -> list[layout.ManifestName]:
    """The partition's manifests in the archive, highest mark first."""
    directory = store.path(layout.partition_dir(partition_id), layout.MANIFEST_DIR)
    names = [layout.ManifestName.parse(name) for name in store.list(directory)]
    return sorted((n for n in names if n is not None), key=lambda n: n.mark, reverse=True)


def best_manifest(
    store: ArchiveStore, partition_id: int, *, full: bool = True
) -> tuple[Manifest, str, list[str]] | None:
    """The manifest with the highest mark whose ranges all verify, its name, and why
    higher ones were passed over; None when the partition has no usable manifest."""
    passed_over: list[str] = []
    for name in manifest_names(store, partition_id):
        try:
            manifest = load_manifest(store, partition_id, name.name)
        except ArchiveError as exc:
            passed_over.append(f"{name.name}: {exc}")
            continue
        verification = verify_manifest(store, manifest, full=full)
        if verification.ok:
            return manifest, name.name, passed_over
        passed_over.append(f"{name.name}: {verification.problems[0]}")
    return None


def orphans(store: ArchiveStore, manifest: Manifest) -> list[str]:
    """Range objects of the partition that ``manifest`` does not name."""
    named = {r.name for r in manifest.ranges}
    directory = store.path(layout.partition_dir(manifest.partition_id))
    return [
        name
        for name in store.list(directory)
        if layout.RangeName.parse(name) is not None and name not in named
    ]


def set_aside_above(store: ArchiveStore, partition_id: int, mark: int) -> list[str]:
    """Move under ``set-aside/`` every range object of the partition that starts above
    ``mark`` and every manifest whose mark is above it; their names (relative to the
    partition's directory).

    What `waltz archive restore --url` does before a new cluster continues the log from
    ``mark``: what lies above it is the history of the cluster that wrote the archive,
    which the new one does not continue (its records above ``mark`` are other records).
    Left in place, an orphan of that history could be taken for the new cluster's own by
    an archiver, and a manifest of it by a later restore (docs/archive.md,
    "Incarnations")."""
    directory = layout.partition_dir(partition_id)
    moving: list[str] = []
    for name in store.list(store.path(directory)):
        parsed = layout.RangeName.parse(name)
        if parsed is not None and parsed.first > mark:
            moving.append(parsed.name)
    moving.extend(found.name for found in manifest_names(store, partition_id) if found.mark > mark)
    for name in moving:
        store.move(store.path(directory, name), store.path(directory, layout.set_aside(name)))
        log.warning(
            "partition %d: %s is above the restored archive mark %d: set aside",
            partition_id,
            store.where(store.path(directory, name)),
            mark,
        )
    return moving
