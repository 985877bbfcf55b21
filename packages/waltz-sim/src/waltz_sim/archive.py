"""The simulated object store of the archive (``simarchive://<world>/<root>``).

The servers of an archive seed (``SimConfig.archive``) run the real archive: the
``waltz_archive`` archiver writing Parquet ranges and manifests, advancing the archive
mark and pruning the replicas, the server's archive reads (a range read, a mount or a
data fetch below what the replicas hold), the recovery's fast-forward to the mark.
Only the location is simulated, through the store seam of ``waltz_archive.store``
(:func:`~waltz_archive.store.register_scheme`): :class:`SimArchiveStore` keeps the
objects in the world's :class:`ObjectStore`, which outlives every server, and runs each
call on the loop after a latency drawn from the seed (no thread), so a slow call meets
the archive's deadline in virtual time. Object names end with tokens drawn from the
seed too: a seed replays its archive name for name.

An object store's PUT is atomic and durable when it returns, so a crash of the server
never leaves half an object: the window the protocol must survive is between an
object's upload and its manifest (the ``archive.object_uploaded`` protocol point, where
the ``points`` profile strikes), and between the mark and the pruning
(``archive.mark_advanced``). The faults (:class:`ArchiveFaults`, the nemesis's, on the
:class:`ObjectStore`'s knobs): calls slowed, some past the deadline, calls refused (a
503), and uploads whose answer is lost although the object landed (an orphan the next
round must adopt or set aside).
"""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from waltz_api.errors import ArchiveError, ConfigError
from waltz_archive.store import ArchiveStore, register_scheme
from waltz_sim.fault_kit import ActiveFault
from waltz_sim.loop import current_incarnation

T = TypeVar("T")

SCHEME = "simarchive"
LATENCY = (0.002, 0.03)
"""Seconds a call to the object store takes (drawn per call), before the faults."""


class ObjectStore:
    """A world's object store: every object by path, and its faults."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.objects: dict[str, bytes] = {}
        self.extra = 0.0
        """Seconds added to every call (``archive_slow``)."""
        self.refuse_until = 0.0
        """Calls before this virtual time fail (``archive_outage``)."""
        self.lost_answers = 0
        """The next uploads land, but their callers hear a failure."""
        self.calls = 0
        self.failures = 0

    def latency(self) -> float:
        return self.rng.uniform(*LATENCY) + self.extra

    def token(self) -> str:
        return f"{self.rng.getrandbits(32):08x}"


class ArchiveWorld(Protocol):
    """What the simulated archive needs of its world (``waltz_sim.world.World``)."""

    @property
    def name(self) -> str: ...

    @property
    def object_store(self) -> ObjectStore: ...


class SimArchiveStore(ArchiveStore):
    """:class:`~waltz_archive.store.ArchiveStore` over the world's :class:`ObjectStore`."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != SCHEME or not parts.netloc:
            raise ConfigError(f"the simulated archive takes {SCHEME}://<world>/<root>, got {url!r}")
        world: ArchiveWorld = current_incarnation().process.world
        if parts.netloc != world.name:
            raise ConfigError(f"{url!r} names world {parts.netloc!r}, not {world.name!r}")
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.root = parts.path.rstrip("/") or "/archive"
        self.local = False
        self.backing = world.object_store

    # -- the seam -------------------------------------------------------------------------

    async def call(self, fn: Callable[[], T], timeout: float) -> T:
        return await asyncio.wait_for(self._call(fn), timeout)

    async def _call(self, fn: Callable[[], T]) -> T:
        backing = self.backing
        await asyncio.sleep(backing.latency())
        backing.calls += 1
        if asyncio.get_running_loop().time() < backing.refuse_until:
            backing.failures += 1
            raise ArchiveError(f"archive {self.url}: 503 Slow Down (simulated)")
        return fn()

    def new_token(self) -> str:
        return self.backing.token()

    # -- the calls ------------------------------------------------------------------------

    def _put(self, path: str, data: bytes) -> None:
        backing = self.backing
        backing.objects[path] = data
        if backing.lost_answers > 0:
            backing.lost_answers -= 1
            backing.failures += 1
            raise ArchiveError(
                f"archive {self.url}: writing {self.where(path)}: the answer was lost"
            )

    def write_bytes(self, path: str, data: bytes) -> None:
        self._put(path, bytes(data))

    def put_file(self, local_path: str, path: str) -> None:
        with open(local_path, "rb") as source:
            self._put(path, source.read())

    def move(self, path: str, target: str) -> None:
        objects = self.backing.objects
        if target in objects:
            raise ArchiveError(f"archive object {self.where(target)} exists already")
        objects[target] = self._get(path, "moving")
        del objects[path]

    def _get(self, path: str, what: str) -> bytes:
        data = self.backing.objects.get(path)
        if data is None:
            raise ArchiveError(f"archive object {self.where(path)} does not exist ({what})")
        return data

    def read_bytes(self, path: str) -> bytes:
        return self._get(path, "reading")

    def open(self, path: str) -> IO[bytes]:
        return io.BytesIO(self._get(path, "opening"))

    def size(self, path: str) -> int:
        return len(self._get(path, "asking the size of"))

    def list(self, directory: str) -> list[str]:
        prefix = directory.rstrip("/") + "/"
        names = {
            p[len(prefix) :].split("/", 1)[0] for p in self.backing.objects if p.startswith(prefix)
        }
        return sorted(names)

    def exists(self, path: str) -> bool:
        return path in self.backing.objects or any(
            p.startswith(path.rstrip("/") + "/") for p in self.backing.objects
        )


ARCHIVE_WEIGHTS = {"archive_slow": 1.0, "archive_outage": 1.0, "archive_lost_answer": 1.0}
"""The object store's faults, added to a profile's weights in ``archive`` seeds."""


class ArchiveFaults:
    """The object store's faults, for the nemesis (mixed into it). None impairs a
    process: the archive is off the write path, so appends go on while it fails (the
    mark stands still and nothing is deleted)."""

    rng: random.Random
    object_store: ObjectStore

    def _inject_archive_slow(self, duration: float) -> ActiveFault:
        """Every call slowed, past the servers' 2 s deadline one time in three."""
        store = self.object_store
        extra = (
            self.rng.uniform(2.0, 4.0) if self.rng.random() < 1 / 3 else self.rng.uniform(0.05, 1.0)
        )
        store.extra += extra

        def heal() -> None:
            store.extra = max(0.0, store.extra - extra)

        return ActiveFault(
            "archive_slow",
            f"slow archive (+{extra * 1000:.0f} ms a call) for {duration:.1f}s",
            heal,
        )

    def _inject_archive_outage(self, duration: float) -> ActiveFault:
        """Every call refused (503) for a while."""
        store = self.object_store
        loop = asyncio.get_running_loop()
        store.refuse_until = max(store.refuse_until, loop.time() + duration)

        def heal() -> None:
            store.refuse_until = min(store.refuse_until, loop.time())

        return ActiveFault("archive_outage", f"archive refuses calls for {duration:.1f}s", heal)

    def _inject_archive_lost_answer(self, duration: float) -> ActiveFault:
        """The next one to three uploads land, but their callers hear a failure."""
        store = self.object_store
        count = self.rng.randint(1, 3)
        store.lost_answers += count

        def heal() -> None:
            store.lost_answers = 0

        return ActiveFault(
            "archive_lost_answer", f"the next {count} archive uploads' answers lost", heal
        )


def server_section(world_name: str) -> dict[str, Any]:
    """The servers' ``[server.archive]`` in an archive seed: small ranges, often.

    Ranges of a few dozen records (6 to 24 KiB: the workload's records are small), one
    row group each, rounds 2 s apart, the newest ``KEEP`` transactions kept local, and
    sealed segments beyond the newest 4 KiB archived (the ``fs`` engine's segments are
    small in the simulation); no retention by age (it reads the wall clock). A call past
    2 s fails (the ``slow`` fault reaches it). (Ranges of 2 KiB and row groups of 1 KiB,
    a round a second, cost 40% more CPU per seed than none; these 19%.)"""
    return {
        "url": f"{SCHEME}://{world_name}/archive",
        "min_range_bytes": 6144,
        "max_range_bytes": 24576,
        "max_local_bytes": 4096,
        "max_local_age": 0.0,
        "keep_local_transactions": KEEP,
        "row_group_bytes": 8192,
        "interval": 2.0,
        "timeout": 2.0,
        "cache_bytes": 65536,
    }


KEEP = 24
"""Transactions an archive seed keeps below the high-water mark before archiving them."""


async def read_archive(coordination: Any, url: str, partition_id: int) -> list[Any]:
    """Every record of the partition's archive, ids 0 to its mark, read with the real
    reader from the manifest the mark names (ArchiveError when it cannot be)."""
    from waltz_api.cluster import ClusterMetadata
    from waltz_archive import layout
    from waltz_archive.manifest import Manifest
    from waltz_archive.reader import ArchiveReader

    mark = (await ClusterMetadata(coordination).archive_mark(partition_id)).value
    if mark.mark < 0:
        return []
    store = SimArchiveStore(url)
    path = store.path(layout.partition_dir(partition_id), mark.manifest)
    manifest = Manifest.decode(store.read_bytes(path), store.where(path), partition_id)
    reader = ArchiveReader(store, partition_id, 1 << 20)
    reader.set_manifest(manifest)
    records: list[Any] = []
    try:
        while len(records) <= mark.mark:
            batch = reader.read(len(records), mark.mark + 1 - len(records), 1 << 20)
            if not batch:
                raise ArchiveError(
                    f"partition {partition_id}: the archive ends at {len(records) - 1}, its "
                    f"mark says {mark.mark}"
                )
            records.extend(batch)
    finally:
        reader.close()
    return records


def register() -> None:
    """Make ``simarchive://`` URLs open a :class:`SimArchiveStore` (idempotent)."""
    register_scheme(SCHEME, SimArchiveStore)


__all__ = [
    "ARCHIVE_WEIGHTS",
    "KEEP",
    "SCHEME",
    "ArchiveFaults",
    "ObjectStore",
    "SimArchiveStore",
    "read_archive",
    "register",
    "server_section",
]
