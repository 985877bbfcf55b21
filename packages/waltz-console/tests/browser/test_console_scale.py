"""``waltz console`` as its own process (the command an operator runs) in a real headless
Chromium: a clear page while there is no cluster to read, then a cluster of 1,000
partitions paged without the page holding more than one page of rows.

Only coordination (the ``local`` plugin) is real here: no server or storage node runs,
so every partition shows without a live server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_api.cluster import coordination_from_uri
from waltz_server.cluster_admin import ClusterAdmin

PARTITIONS = 1000
DEADLINE = 30.0
STOP_DEADLINE = 10.0
"""Seconds a console has to stop on SIGTERM while a page is open (its event stream is
ended, not waited for: the keep-alive would hold it 15 s)."""
PAGE_DEADLINE = 5.0
"""Seconds a page of the 1,000 partitions has to show after a click (the page never
builds more than one page of rows)."""


class ConsoleProcess:
    """``waltz console --listen 127.0.0.1:0`` (the log says the port), stopped by its pid."""

    def __init__(self, uri: str, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "waltz_cli", "console", "--coordination", uri,
                 "--listen", "127.0.0.1:0", "--interval", "0.5"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")},
            )  # fmt: skip

    def url(self) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            found = re.search(r"console ready on (http://\S+/)", self.log.read_text())
            if found:
                return found.group(1)
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def empty_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ConsoleProcess]]:
    chosen = os.environ.get("WALTZ_CONSOLE_DEV_DIR")  # see conftest.py
    root = Path(chosen + "-scale") if chosen else tmp_path_factory.mktemp("scale")
    (root / "coordination").mkdir(parents=True)
    uri = f"local://{root / 'coordination'}?root=/waltz"
    console = ConsoleProcess(uri, root / "console.log")
    try:
        yield uri, console
    finally:
        started = time.monotonic()
        console.stop()
    # SIGTERM with a page's event stream open: a clean exit, without waiting for the stream
    assert console.process.returncode == 0, console.log.read_text()[-2000:]
    assert time.monotonic() - started < STOP_DEADLINE


async def _create_cluster(uri: str) -> None:
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:
        await ClusterAdmin(coordination).create_cluster(
            num_partitions=PARTITIONS,
            num_replicas=3,
            storage_nodes=[f"127.0.0.1:{port}" for port in (1, 2, 3, 4)],
            cluster_key=uuid.uuid4(),
        )
    finally:
        await coordination.close()


def test_no_cluster_then_a_thousand_partitions(
    empty_root: tuple[str, ConsoleProcess],
    browser: Any,
    screenshot: Callable[[Any, str], Path],
) -> None:
    uri, console = empty_root
    base = console.url()
    # without a token file or WALTZ_CONSOLE_TOKEN, a new token is printed once
    assert re.search(r"actions need the token \S{16,}", console.log.read_text())
    browser.get(base + "#/partitions")
    browser.wait_for(
        lambda: (
            "no Waltz cluster at this coordination root"
            in (browser.text("#coordination-error") or "")
        ),
        "the page saying there is no cluster",
    )
    assert browser.text("#error-page h2") == "The cluster cannot be read"
    screenshot(browser, "no-cluster")

    asyncio.run(_create_cluster(uri))
    # the console retries by itself, and the open page follows
    browser.wait_for(
        lambda: browser.text("#page-info") == f"1\u201350 of {PARTITIONS}",
        "the first page of the partitions",
    )

    def rows() -> list[str]:
        found: list[str] = browser.execute_script(
            "return [...document.querySelectorAll('#partitions-table tbody tr')]"
            ".map(r => r.dataset.partition)"
        )
        return found

    assert rows() == [str(p) for p in range(50)]
    for page in range(1, 4):
        browser.click("#next-page")
        first = page * 50
        browser.wait_for(
            lambda first=first: rows() == [str(p) for p in range(first, first + 50)],
            f"partitions {first}..{first + 49}",
            timeout=PAGE_DEADLINE,
        )
    field = browser.find_element("css selector", "#partition-filter")
    field.send_keys("999\n")
    browser.wait_for(lambda: rows() == ["999"], "partition 999 alone", timeout=PAGE_DEADLINE)
    assert browser.text('#partitions-table tr[data-partition="999"] td.owner') == "none"
    browser.get(base + "#/partitions?offset=950")
    browser.wait_for(
        lambda: rows() == [str(p) for p in range(950, 1000)],
        "the last page",
        timeout=PAGE_DEADLINE,
    )
    assert browser.find_element("css selector", "#next-page").get_attribute("disabled")
