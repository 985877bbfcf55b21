"""The `dist` environment's check of the built wheels: one per distribution, each with
the license file and the metadata (license, author, project URLs, classifiers, the
README as description, siblings pinned to the release). Standard library only."""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

EXPECTED = {
    "waltz_api", "waltz_cli", "waltz_client", "waltz_server", "waltz_storage_fs", "waltz_coord_zk",
    "waltz_coord_etcd", "waltz_coord_local", "waltz_transport_zmq", "waltz_spark",
    "waltz_conformance", "waltz_console", "waltz_sim", "waltz_archive",
    "waltz_chaos", "waltz_storage_node", "waltz_dev",
}  # fmt: skip
CONSOLE_ASSETS = ("index.html", "app.js", "app.css")
"""The console's page works offline only if its assets are in the wheel."""


def check(wheel: Path) -> list[str]:
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(f"{info}/METADATA").decode("utf-8"))
        license_files = [n for n in names if n.startswith(f"{info}/licenses/")]
        if not license_files or b"Apache License" not in archive.read(license_files[0]):
            problems.append("no Apache-2.0 LICENSE in dist-info/licenses/")
    if info.startswith("waltz_console-"):
        for asset in CONSOLE_ASSETS:
            if f"waltz_console/static/{asset}" not in names:
                problems.append(f"the console's asset static/{asset} is not in the wheel")
    version = meta["Version"]
    major_minor = ".".join(version.split(".")[:2])
    if meta["License-Expression"] != "Apache-2.0":
        problems.append(f"License-Expression {meta['License-Expression']!r}")
    for field in ("Author", "Project-URL", "Classifier", "Requires-Python"):
        if not meta.get_all(field):
            problems.append(f"no {field}")
    if len(meta.get_payload() or "") < 500:
        problems.append("no README as long description")
    for requirement in meta.get_all("Requires-Dist") or []:
        if requirement.startswith("waltz-") and f"=={major_minor}.*" not in requirement:
            problems.append(f"{requirement!r} is not pinned to {major_minor}.*")
    return problems


def main() -> int:
    wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
    found = {w.name.split("-")[0] for w in wheels}
    failed = 0
    if found != EXPECTED:
        print(f"wheels built: {sorted(found)}; expected {sorted(EXPECTED)}")
        failed += 1
    for wheel in wheels:
        problems = check(wheel)
        print(f"{wheel.name}: {'ok' if not problems else '; '.join(problems)}")
        failed += bool(problems)
    print(f"wheel metadata: {len(wheels) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
