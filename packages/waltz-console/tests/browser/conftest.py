"""A real ``waltz dev`` cluster (with its console) and a real headless Chromium.

Chromium is Debian's (``/usr/bin/chromium``), driven through Debian's chromedriver by
Selenium: nothing is downloaded. The browser starts with a fresh profile and every
background service off (the machine has no network, and the console needs none).

``WALTZ_CONSOLE_SCREENSHOTS=DIR`` keeps the screenshots the tests take in DIR (the
ones in docs/images/ are made that way); otherwise they go to a temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_dev.dev import DevCluster

CHROMIUM = os.environ.get("WALTZ_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("WALTZ_CHROMEDRIVER", "/usr/bin/chromedriver")
START_DEADLINE = 150.0
WAIT_DEADLINE = 30.0
"""Seconds a page has to show what the cluster did (unless a test bounds it tighter)."""


class DevProcess:
    """A ``waltz dev`` cluster (``waltz_dev.dev.DevCluster``, what the command runs:
    storage nodes, servers and the console as child processes), started in the test's
    process so that a test can kill one server without the supervisor stopping the
    rest as ``waltz dev`` does; every child is stopped by its pid at the end."""

    def __init__(self, data_dir: Path, **options: Any) -> None:
        self.cluster = DevCluster(data_dir, console=True, start_timeout=START_DEADLINE, **options)
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        asyncio.run(self.cluster.start())
        self.info = self.cluster.info()
        return self.info

    def stop(self) -> None:
        asyncio.run(self.cluster.stop())
        for pid in self.info.get("child_pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def server_pid(self, endpoint: str) -> int:
        """The pid of the server at ``endpoint`` (children: servers, storage nodes, console)."""
        pid: int = self.info["child_pids"][self.info["servers"].index(endpoint)]
        return pid

    def run(self, *args: str) -> str:
        """A ``waltz`` command against this cluster; its output."""
        done = subprocess.run(
            [sys.executable, "-m", "waltz_cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def metadata(self) -> dict[str, Any]:
        """``waltz cluster show --json``."""
        shown: dict[str, Any] = json.loads(
            self.run("cluster", "show", "--json", "--coordination", self.info["coordination"])
        )
        return shown


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
        pytest.fail(
            f"the browser tests need {CHROMIUM} and {CHROMEDRIVER} (Debian packages chromium "
            "and chromium-driver; .ci/run installs them)"
        )
    # WALTZ_CONSOLE_DEV_DIR: where the cluster lives (a fresh directory; the docs'
    # screenshots show its coordination URI), else a temporary directory
    chosen = os.environ.get("WALTZ_CONSOLE_DEV_DIR")
    data_dir = Path(chosen) if chosen else tmp_path_factory.mktemp("console") / "dev"
    process = DevProcess(data_dir, servers=2, partitions=4, storage_nodes=4)
    try:
        info = process.start()
        assert info["console"], "waltz dev started no console"
        yield process
    finally:
        process.stop()


class Browser:
    """The WebDriver (its attributes pass through) with the waits the tests share."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self.driver, name)

    def text(self, selector: str) -> str | None:
        """The text of the first element matching ``selector`` now (None when there is
        none); read in the page, so a re-render between finding and reading cannot
        interfere."""
        found: str | None = self.driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
            selector,
        )
        return found

    def click(self, selector: str, timeout: float = WAIT_DEADLINE) -> None:
        """Click the element matching ``selector``, finding it again when the page
        replaced it between finding and clicking (it re-renders as the cluster changes)."""
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + timeout
        while True:
            try:
                self.driver.find_element("css selector", selector).click()
                return
            except StaleElementReferenceException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_for(self, check: Callable[[], Any], what: str, timeout: float = WAIT_DEADLINE) -> Any:
        """``check()``'s first true value, polled until ``timeout`` seconds; AssertionError
        naming ``what`` and showing the page's text after that."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                body = self.driver.execute_script("return document.body.innerText")
                raise AssertionError(f"not within {timeout} s: {what}\npage:\n{body[:3000]}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--window-size=1400,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(CHROMEDRIVER, log_output=str(profile / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    try:
        yield Browser(driver)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def screenshot(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any, str], Path]:
    target = os.environ.get("WALTZ_CONSOLE_SCREENSHOTS")
    directory = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    directory.mkdir(parents=True, exist_ok=True)

    def take(driver: Any, name: str) -> Path:
        path = directory / f"console-{name}.png"
        assert driver.save_screenshot(str(path)), f"no screenshot {path}"
        return path

    return take


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)
