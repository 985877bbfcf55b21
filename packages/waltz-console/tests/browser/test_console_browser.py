"""The console in a real headless Chromium against a real ``waltz dev`` cluster (2
servers, 4 storage nodes, 4 partitions of 3 replicas, the console it starts).

The tests run in this order on one cluster: they look, commit, browse, act, and
last kill a server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DevProcess = Any  # the `dev` fixture (conftest.DevProcess)

DEADLINE = 30.0
"""Seconds a page has to show what the cluster did (a failover: the server's session
timeout of 5 s, then the move)."""
NOTHING = "\u2013"
"""What the page shows for a value it does not know (an en dash)."""
LIVE_BOUND = 2.0
"""Seconds within which a commit must show on an open page (the issue's bound)."""


def text(driver: Any, selector: str) -> str | None:
    """The text of the first element matching ``selector`` now (None when there is none);
    read in the page, so a re-render between finding and reading cannot interfere."""
    found: str | None = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
        selector,
    )
    return found


def click(driver: Any, selector: str, timeout: float = DEADLINE) -> None:
    """Click the element matching ``selector``, finding it again when the page replaced
    it between finding and clicking (it re-renders as the cluster changes)."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            driver.find_element("css selector", selector).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_for(driver: Any, check: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            body = driver.execute_script("return document.body.innerText")
            raise AssertionError(f"not within {timeout} s: {what}\npage:\n{body[:3000]}")
        time.sleep(0.05)


def open_view(driver: Any, dev: DevProcess, fragment: str) -> None:
    base = dev.info["console"]
    if not driver.current_url.startswith(base):
        driver.get(base + fragment)
    else:
        driver.execute_script("location.hash = arguments[0]", fragment)
    wait_for(driver, lambda: text(driver, "#live") == "live", "the page is live")


def severe_logs(driver: Any) -> list[str]:
    """The browser's errors (scripts, loads, Content-Security-Policy refusals), less the
    API's 4xx answers to the bad input and unauthenticated requests the tests send."""
    return [
        e["message"]
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE"
        and not re.search(r"/api/\S+ - Failed to load resource: .* status of 4\d\d", e["message"])
    ]


def owners(dev: DevProcess) -> dict[int, int]:
    return {p["partition"]: p["server_id"] for p in dev.metadata()["partition_state"]}


def test_the_page_loads_and_shows_the_cluster(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    open_view(browser, dev, "#/cluster")
    wait_for(browser, lambda: text(browser, "#card-servers-alive .value") == "2", "2 servers")
    wait_for(
        browser, lambda: text(browser, "#card-storage-up .value") == "4 / 4", "4 storage nodes up"
    )
    assert text(browser, "#card-partition-count .value") == "4"
    assert text(browser, "#card-coordination .value") == dev.info["coordination"]
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#storage-table tbody tr')].map(r => r.dataset.node)"
    )
    assert sorted(rows) == sorted(e.removeprefix("tcp://") for e in dev.info["storage_nodes"])
    assert "leader" in (text(browser, "#servers-table tbody") or "")
    screenshot(browser, "cluster")
    # nothing failed to load, nothing was refused by the Content-Security-Policy
    assert severe_logs(browser) == []


def test_partitions_show_their_owners(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    expected = owners(dev)
    assert len(expected) == 4
    open_view(browser, dev, "#/partitions")

    def shown() -> dict[int, str | None]:
        return {p: text(browser, f'tr[data-partition="{p}"] td.owner') for p in expected}

    wait_for(
        browser,
        lambda: shown() == {p: f"server {s}" for p, s in expected.items()},
        f"the owners {expected}",
    )
    for p in expected:
        assert text(browser, f'tr[data-partition="{p}"] td.state') == "writable"


def test_a_commit_shows_within_two_seconds(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    open_view(browser, dev, "#/partitions")
    hwm_cell = 'tr[data-partition="1"] td.hwm'
    before = wait_for(
        browser,
        lambda: text(browser, hwm_cell) not in (None, NOTHING) and text(browser, hwm_cell),
        "a high-water mark",
    )
    data = json.dumps({"account": 7, "amount": 100, "memo": "café"})
    output = dev.run(
        "client", "append", "--coordination", dev.info["coordination"], "--partition", "1",
        "--header", "42", "--data", data,
    )  # fmt: skip
    committed = time.monotonic()
    transaction_id = int(output.split("appended transaction ")[1].split()[0])
    assert transaction_id == int(before) + 1
    wait_for(
        browser,
        lambda: text(browser, hwm_cell) == str(transaction_id),
        f"high-water mark {transaction_id} on the open page",
        timeout=LIVE_BOUND,
    )
    assert time.monotonic() - committed <= LIVE_BOUND
    screenshot(browser, "partitions")


def test_browses_a_transaction_s_data(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    dev.run(
        "client", "append", "--coordination", dev.info["coordination"], "--partition", "1",
        "--data", "plain text, not JSON",
    )  # fmt: skip
    open_view(browser, dev, "#/transactions/1?latest=1")
    wait_for(browser, lambda: text(browser, "#tx-summary"), "the range read")
    json_tx = wait_for(
        browser,
        lambda: browser.execute_script(
            "return [...document.querySelectorAll('.tx')]"
            ".find(t => t.textContent.includes('header 42'))"
        ),
        "the JSON transaction",
    )
    assert '"amount": 100' in json_tx.find_element("css selector", "pre").text
    assert '"memo": "café"' in json_tx.find_element("css selector", "pre").text
    json_tx.find_element("css selector", 'button[data-mode="hex"]').click()
    assert json_tx.find_element("css selector", "pre").text.startswith("7b 22 61 63")
    json_tx.find_element("css selector", 'button[data-mode="text"]').click()
    assert json_tx.find_element("css selector", "pre").text.startswith('{"account": 7')
    newest = browser.find_elements("css selector", ".tx")[0]
    assert newest.find_element("css selector", "pre").text == "plain text, not JSON"
    assert newest.find_elements("css selector", 'button[data-mode="json"]') == []
    screenshot(browser, "transactions")
    # a range from an id, and bad input answered with a clear error
    open_view(browser, dev, "#/transactions/1?start=0&count=1")
    wait_for(
        browser,
        lambda: "transactions 0\u20130" in (text(browser, "#tx-summary") or ""),
        "the range of transaction 0 alone",
    )
    assert browser.execute_script(
        "return [...document.querySelectorAll('.tx')].map(t => t.dataset.transaction)"
    ) == ["0"]
    open_view(browser, dev, "#/transactions/abc?start=0")
    wait_for(
        browser,
        lambda: "partition must be a whole number, got 'abc'" in (text(browser, "#tx-error") or ""),
        "the error about the partition",
    )
    open_view(browser, dev, "#/transactions/1?start=-5")
    wait_for(
        browser,
        lambda: "start must be at least 0" in (text(browser, "#tx-error") or ""),
        "the error about the start",
    )


def test_clients_and_a_followed_partition(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    """A connected client (``waltz client tail --follow``) shows with its feed position
    and lag; a transactions view that follows live shows a new commit by itself."""
    tail = subprocess.Popen(
        [sys.executable, "-m", "waltz_server.cli", "client", "tail", "--follow", "--no-data",
         "--coordination", dev.info["coordination"], "--partition", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")},
    )  # fmt: skip
    try:
        open_view(browser, dev, "#/clients")

        def rows() -> list[list[str]]:
            found: list[list[str]] = browser.execute_script(
                "return [...document.querySelectorAll('#clients-table tbody tr')]"
                ".map(r => [...r.cells].map(c => c.textContent))"
            )
            return found

        # partition, client, feed position, lag, server: caught up, so no lag
        wait_for(
            browser,
            lambda: [r for r in rows() if r[0] == "1" and r[3] == "0"],
            "the connected client, caught up",
        )
        screenshot(browser, "clients")

        open_view(browser, dev, "#/transactions/1?follow=1")
        wait_for(browser, lambda: text(browser, "#tx-summary"), "the newest transactions")
        dev.run(
            "client", "append", "--coordination", dev.info["coordination"], "--partition", "1",
            "--data", "followed",
        )  # fmt: skip
        wait_for(
            browser,
            lambda: (text(browser, ".tx pre") or "") == "followed",
            "the new transaction on the followed page",
        )
    finally:
        tail.send_signal(signal.SIGINT)
        try:
            tail.wait(timeout=30)
        except subprocess.TimeoutExpired:
            tail.kill()
            tail.wait(timeout=30)


def test_actions_are_refused_without_login(dev: DevProcess, browser: Any) -> None:
    open_view(browser, dev, "#/actions")
    wait_for(browser, lambda: text(browser, "#login-form") is not None, "the login form")
    assert browser.find_elements("css selector", "#form-add-replica") == []
    answer = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        fetch('/api/actions/add-replica', {method: 'POST',
              headers: {'Content-Type': 'application/json', 'X-Waltz-Console': '1'},
              body: JSON.stringify({confirm: true, partition: 0, storage_node: '127.0.0.1:1'})})
          .then(async r => done([r.status, (await r.json()).error]));
        """
    )
    assert answer == [401, "log in first: actions need the console's token"]
    browser.find_element("css selector", "#login-token").send_keys("not-the-token-at-all")
    click(browser, "#login-button")
    wait_for(
        browser,
        lambda: "wrong token" in (text(browser, "#login-message") or ""),
        "the wrong token refused",
    )
    assert browser.find_elements("css selector", "#form-add-replica") == []


def _confirm_dialog(browser: Any, button: str) -> str:
    wait_for(
        browser,
        lambda: browser.execute_script("return document.getElementById('confirm').open"),
        "the confirmation dialog",
    )
    question = text(browser, "#confirm-text") or ""
    click(browser, f"#confirm-{button}")
    return question


def test_a_replica_add_asks_for_confirmation(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    token = Path(dev.info["console_token_file"]).read_text().strip()
    before = dev.metadata()["storage"]
    node = next(n for n, parts in sorted(before.items()) if 2 not in parts)
    open_view(browser, dev, "#/actions")
    login = wait_for(
        browser, lambda: browser.find_elements("css selector", "#login-token"), "the login form"
    )[0]
    login.clear()
    login.send_keys(token)
    click(browser, "#login-button")
    wait_for(browser, lambda: browser.find_elements("css selector", "#form-add-replica"), "forms")
    assert text(browser, "#who") == "logged in"

    def submit() -> str:
        for key, value in (("partition", "2"), ("storage_node", node)):
            field = browser.find_element("css selector", f"#add-replica-{key}")
            field.clear()
            field.send_keys(value)
        click(browser, "#add-replica-submit")
        return _confirm_dialog(browser, "cancel" if not confirmed else "ok")

    confirmed = False
    question = submit()
    assert question.startswith(f"Add a replica of partition 2 on {node}?")
    wait_for(browser, lambda: "Cancelled" in (text(browser, "#action-result") or ""), "cancel")
    assert dev.metadata()["storage"] == before  # nothing changed

    confirmed = True
    submit()
    wait_for(
        browser,
        lambda: (
            text(browser, "#action-message")
            == f"partition 2: replica added on {node}; it catches up now"
        ),
        "the replica added",
    )
    assert 2 in dev.metadata()["storage"][node]
    screenshot(browser, "actions")

    # verify, with its findings in place
    click(browser, "#verify-submit")
    _confirm_dialog(browser, "ok")
    wait_for(
        browser,
        lambda: re.fullmatch(
            r"OK: no problem found|\d+ problem\(s\) found", text(browser, "#action-message") or ""
        ),
        "verify's answer",
        timeout=60,
    )
    findings = browser.execute_script(
        "return [...document.querySelectorAll('#findings-table tbody tr')].length"
    )
    assert findings == len(browser.find_elements("css selector", "#findings-table tr.finding"))
    # the page follows: partition 2 shows the new replica, the time line the change
    open_view(browser, dev, "#/partition/2")
    wait_for(
        browser,
        lambda: text(browser, f'#replicas-table tr[data-node="{node}"]'),
        "the new replica on the partition page",
    )
    open_view(browser, dev, "#/events")
    wait_for(
        browser,
        lambda: f"partition 2: replica added on {node}" in (text(browser, "#events-table") or ""),
        "the membership change in the time line",
    )


def test_a_killed_server_shows_as_a_failover(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    before = owners(dev)
    victim = before[0]
    survivor = next(s for s in set(before.values()) | {None} if s not in (victim, None))
    endpoint = next(p["endpoint"] for p in dev.metadata()["partition_state"] if p["partition"] == 0)
    moved = sorted(p for p, s in before.items() if s == victim)
    open_view(browser, dev, "#/partitions")
    os.kill(dev.server_pid(endpoint), signal.SIGKILL)
    # at once: the dead server's partitions have no live owner; then they move
    wait_for(
        browser,
        lambda: all(
            text(browser, f'tr[data-partition="{p}"] td.owner') == f"server {survivor}"
            for p in moved
        ),
        f"partitions {moved} moved to server {survivor}",
    )
    wait_for(
        browser,
        lambda: text(browser, 'tr[data-partition="0"] td.state') == "writable",
        "partition 0 writable again",
    )
    open_view(browser, dev, "#/events")
    wait_for(
        browser,
        lambda: (
            f"partition 0 failed over from server {victim} to server {survivor}"
            in (text(browser, "#events-table") or "")
        ),
        "the failover in the time line",
    )
    events = text(browser, "#events-table") or ""
    assert f"server {victim} stopped answering" in events
    wait_for(
        browser,
        lambda: f"server {victim} left" in (text(browser, "#events-table") or ""),
        "the server's registration expired",
    )
    screenshot(browser, "events")
    open_view(browser, dev, "#/cluster")
    wait_for(browser, lambda: text(browser, "#card-servers-alive .value") == "1", "1 server alive")
    assert severe_logs(browser) == []
