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
import urllib.request
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


def open_view(driver: Any, dev: DevProcess, fragment: str) -> None:
    base = dev.info["console"]
    if not driver.current_url.startswith(base):
        driver.get(base + fragment)
    else:
        driver.execute_script("location.hash = arguments[0]", fragment)
    driver.wait_for(lambda: driver.text("#live") == "live", "the page is live")


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
    browser.wait_for(lambda: browser.text("#card-servers-alive .value") == "2", "2 servers")
    browser.wait_for(
        lambda: browser.text("#card-storage-up .value") == "4 / 4", "4 storage nodes up"
    )
    assert browser.text("#card-partition-count .value") == "4"
    assert browser.text("#card-coordination .value") == dev.info["coordination"]
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#storage-table tbody tr')].map(r => r.dataset.node)"
    )
    assert sorted(rows) == sorted(e.removeprefix("tcp://") for e in dev.info["storage_nodes"])
    assert "leader" in (browser.text("#servers-table tbody") or "")
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
        return {p: browser.text(f'tr[data-partition="{p}"] td.owner') for p in expected}

    browser.wait_for(
        lambda: shown() == {p: f"server {s}" for p, s in expected.items()},
        f"the owners {expected}",
    )
    for p in expected:
        assert browser.text(f'tr[data-partition="{p}"] td.state') == "writable"


def test_a_commit_shows_within_two_seconds(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    open_view(browser, dev, "#/partitions")
    hwm_cell = 'tr[data-partition="1"] td.hwm'
    before = browser.wait_for(
        lambda: browser.text(hwm_cell) not in (None, NOTHING) and browser.text(hwm_cell),
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
    browser.wait_for(
        lambda: browser.text(hwm_cell) == str(transaction_id),
        f"high-water mark {transaction_id} on the open page",
        timeout=LIVE_BOUND,
    )
    assert time.monotonic() - committed <= LIVE_BOUND
    # the commit latency percentiles come from the server's histogram (read every 5 s)
    browser.wait_for(
        lambda: browser.text('tr[data-partition="1"] td.p99') not in (None, NOTHING),
        "partition 1's commit latency",
    )
    screenshot(browser, "partitions")


def _chart(browser: Any, key: str) -> dict[str, Any]:
    """The chart ``key`` on the page: its known points and its drawn lines and dots."""
    found: dict[str, Any] = browser.execute_script(
        "const c = document.getElementById('chart-' + arguments[0]);"
        "if (!c) return {points: -1, drawn: 0};"
        "return {points: Number(c.dataset.points),"
        " drawn: c.querySelectorAll('svg polyline.series, svg circle.series').length,"
        " lines: [...c.querySelectorAll('svg polyline.series')]"
        "   .map(l => l.getAttribute('points').split(' ').length)};",
        key,
    )
    return found


def test_charts_on_the_cluster_and_partition_pages(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    """After the commits above: the commit rate, commit latency and replica lag over the
    last minutes, drawn as SVG (no script or style from elsewhere); a chart with nothing
    to draw says so."""
    for _ in range(3):
        dev.run("client", "append", "--coordination", dev.info["coordination"],
                "--partition", "1", "--data", "charted")  # fmt: skip
    open_view(browser, dev, "#/partition/1")
    browser.wait_for(
        lambda: (
            _chart(browser, "commit-latency")["points"] >= 1
            and _chart(browser, "commit-latency")["drawn"] >= 1
        ),
        "partition 1's commit latency charted",
    )
    for key in ("commit-rate", "replica-lag"):  # feed lag: with the client below
        browser.wait_for(
            lambda key=key: max(_chart(browser, key).get("lines") or [0]) >= 2,
            f"partition 1's {key} chart with a line of 2 points or more",
        )
    open_view(browser, dev, "#/cluster")
    browser.wait_for(
        lambda: (
            _chart(browser, "commit-rate")["points"] >= 2
            and _chart(browser, "commit-latency")["points"] >= 1
        ),
        "the cluster's charts",
    )
    assert "rate" in (browser.text("#chart-commit-rate figcaption") or "")
    if _chart(browser, "feed-lag")["points"] == 0:  # no client now
        assert "No client" in (browser.text("#chart-feed-lag") or "")
    screenshot(browser, "cluster")
    assert severe_logs(browser) == []


def _console_version(dev: DevProcess) -> int:
    """The console's refresh count now (read as any HTTP client would)."""
    with urllib.request.urlopen(dev.info["console"] + "api/overview", timeout=10) as answer:
        version: int = json.load(answer)["version"]
    return version


NAVIGATIONS: list[tuple[str, str, str]] = [
    # (how, where, the view element that shows the page's live data); "load": a new
    # document (another query string: the browser keeps the page it leaves in its
    # back/forward cache), "route": the same document, another route
    ("load", "?n=1#/cluster", "#view-cluster #servers-table tbody tr"),
    ("load", "?n=2#/partitions", "#view-partitions #partitions-table tbody tr"),
    ("load", "?n=3#/events", "#view-events"),
    ("back", "", "#view-partitions #partitions-table tbody tr"),
    ("back", "", "#view-cluster #servers-table tbody tr"),
    ("forward", "", "#view-partitions #partitions-table tbody tr"),
    ("load", "?n=4#/clients", "#view-clients"),
    ("route", "#/partition/1", "#view-partition #replicas-table tbody tr"),
    ("load", "?n=5#/partition/2", "#view-partition #replicas-table tbody tr"),
    ("back", "", "#view-partition #replicas-table tbody tr"),
    ("load", "?n=6#/cluster", "#view-cluster #servers-table tbody tr"),
    ("load", "?n=7#/partitions", "#view-partitions #partitions-table tbody tr"),
    ("back", "", "#view-cluster #servers-table tbody tr"),
    ("forward", "", "#view-partitions #partitions-table tbody tr"),
    ("load", "?n=8#/events", "#view-events"),
    ("route", "#/cluster", "#view-cluster #servers-table tbody tr"),
    ("load", "?n=9#/transactions/1?follow=1", "#view-transactions #tx-summary"),
    ("load", "?n=10#/partition/3", "#view-partition #replicas-table tbody tr"),
    ("back", "", "#view-transactions #tx-summary"),
    ("load", "?n=11#/partitions", "#view-partitions #partitions-table tbody tr"),
]


def test_twenty_navigations_in_one_tab_each_live(dev: DevProcess, browser: Any) -> None:
    """Pages left in the back/forward cache close their live-update connection (and a
    page shown again from it reopens one), so navigating never exhausts the browser's
    six connections per host: each page shows its live data within 2 s."""
    assert len(NAVIGATIONS) == 20
    base = dev.info["console"]
    for step, (how, where, shows) in enumerate(NAVIGATIONS, 1):
        version = _console_version(dev)
        started = time.monotonic()
        if how == "load":
            browser.get(base + where)
        elif how == "route":
            browser.execute_script("location.hash = arguments[0]", where)
        elif how == "back":
            browser.back()
        else:
            browser.forward()

        def live(shows: str = shows, version: int = version) -> bool:
            return bool(
                browser.execute_script(
                    "const main = document.getElementById('main');"
                    "return document.getElementById('live').textContent === 'live'"
                    " && !main.textContent.includes('Loading')"
                    " && Number(main.dataset.version) >= arguments[1]"
                    " && document.querySelector(arguments[0]) !== null",
                    shows,
                    version,
                )
            )

        browser.wait_for(
            live,
            f"navigation {step} ({how} {where}) live, with data as new as version {version}",
            timeout=max(0.0, LIVE_BOUND - (time.monotonic() - started)),
        )
    assert severe_logs(browser) == []


def test_empty_tables_say_why(dev: DevProcess, browser: Any) -> None:
    """A table without rows says why, not bare headers (no client is connected now: the
    commits before were made by short-lived `waltz client append` processes)."""

    def empty(table: str) -> str:
        return browser.text(f"{table} tfoot tr.empty") or ""

    for fragment, table, says in (
        ("#/clients", "#clients-table", "No client is connected to this cluster"),
        ("#/clients?q=nobody", "#clients-table", "No client matches \u201cnobody\u201d"),
        ("#/partitions?q=nothing", "#partitions-table", "No partition matches \u201cnothing\u201d"),
        ("#/events?kind=no_such_kind", "#events-table", "No no_such_kind event since the console"),
        ("#/partition/3", "#clients-table", "No client is connected to partition 3 now."),
    ):
        open_view(browser, dev, fragment)
        browser.wait_for(lambda table=table, says=says: says in empty(table), f"{fragment}: {says}")
        assert (
            browser.execute_script(
                "return document.querySelectorAll(arguments[0] + ' tbody tr').length", table
            )
            == 0
        )


def test_browses_a_transaction_s_data(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    dev.run(
        "client", "append", "--coordination", dev.info["coordination"], "--partition", "1",
        "--data", "plain text, not JSON",
    )  # fmt: skip
    open_view(browser, dev, "#/transactions/1?latest=1")
    browser.wait_for(lambda: browser.text("#tx-summary"), "the range read")
    json_tx = browser.wait_for(
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
    browser.wait_for(
        lambda: "transactions 0\u20130" in (browser.text("#tx-summary") or ""),
        "the range of transaction 0 alone",
    )
    assert browser.execute_script(
        "return [...document.querySelectorAll('.tx')].map(t => t.dataset.transaction)"
    ) == ["0"]
    open_view(browser, dev, "#/transactions/abc?start=0")
    browser.wait_for(
        lambda: "partition must be a whole number, got 'abc'" in (browser.text("#tx-error") or ""),
        "the error about the partition",
    )
    open_view(browser, dev, "#/transactions/1?start=-5")
    browser.wait_for(
        lambda: "start must be at least 0" in (browser.text("#tx-error") or ""),
        "the error about the start",
    )


def test_clients_and_a_followed_partition(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    """A connected client (``waltz client tail --follow``) shows with its feed position
    and lag; a transactions view that follows live shows a new commit by itself."""
    tail = subprocess.Popen(
        [sys.executable, "-m", "waltz_cli", "client", "tail", "--follow", "--no-data",
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
        browser.wait_for(
            lambda: [r for r in rows() if r[0] == "1" and r[3] == "0"],
            "the connected client, caught up",
        )
        screenshot(browser, "clients")
        # the client's feed lag is charted on its partition's page
        open_view(browser, dev, "#/partition/1")
        browser.wait_for(
            lambda: _chart(browser, "feed-lag")["points"] >= 1,
            "partition 1's feed lag charted",
        )

        open_view(browser, dev, "#/transactions/1?follow=1")
        browser.wait_for(lambda: browser.text("#tx-summary"), "the newest transactions")
        dev.run(
            "client", "append", "--coordination", dev.info["coordination"], "--partition", "1",
            "--data", "followed",
        )  # fmt: skip
        browser.wait_for(
            lambda: (browser.text(".tx pre") or "") == "followed",
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
    browser.wait_for(lambda: browser.text("#login-form") is not None, "the login form")
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
    browser.click("#login-button")
    browser.wait_for(
        lambda: "wrong token" in (browser.text("#login-message") or ""),
        "the wrong token refused",
    )
    assert browser.find_elements("css selector", "#form-add-replica") == []


def _confirm_dialog(browser: Any, button: str) -> str:
    browser.wait_for(
        lambda: browser.execute_script("return document.getElementById('confirm').open"),
        "the confirmation dialog",
    )
    question = browser.text("#confirm-text") or ""
    browser.click(f"#confirm-{button}")
    return question


def test_a_replica_add_asks_for_confirmation(
    dev: DevProcess, browser: Any, screenshot: Callable[[Any, str], Path]
) -> None:
    token = Path(dev.info["console_token_file"]).read_text().strip()
    before = dev.metadata()["storage"]
    node = next(n for n, parts in sorted(before.items()) if 2 not in parts)
    open_view(browser, dev, "#/actions")
    login = browser.wait_for(
        lambda: browser.find_elements("css selector", "#login-token"), "the login form"
    )[0]
    login.clear()
    login.send_keys(token)
    browser.click("#login-button")
    browser.wait_for(lambda: browser.find_elements("css selector", "#form-add-replica"), "forms")
    assert browser.text("#who") == "logged in"

    def submit() -> str:
        for key, value in (("partition", "2"), ("storage_node", node)):
            field = browser.find_element("css selector", f"#add-replica-{key}")
            field.clear()
            field.send_keys(value)
        browser.click("#add-replica-submit")
        return _confirm_dialog(browser, "cancel" if not confirmed else "ok")

    confirmed = False
    question = submit()
    assert question.startswith(f"Add a replica of partition 2 on {node}?")
    browser.wait_for(lambda: "Cancelled" in (browser.text("#action-result") or ""), "cancel")
    assert dev.metadata()["storage"] == before  # nothing changed

    confirmed = True
    submit()
    browser.wait_for(
        lambda: (
            browser.text("#action-message")
            == f"partition 2: replica added on {node}; it catches up now"
        ),
        "the replica added",
    )
    assert 2 in dev.metadata()["storage"][node]
    screenshot(browser, "actions")

    # verify, with its findings in place
    browser.click("#verify-submit")
    _confirm_dialog(browser, "ok")
    browser.wait_for(
        lambda: re.fullmatch(
            r"OK: no problem found|\d+ problem\(s\) found", browser.text("#action-message") or ""
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
    browser.wait_for(
        lambda: browser.text(f'#replicas-table tr[data-node="{node}"]'),
        "the new replica on the partition page",
    )
    screenshot(browser, "partition")
    open_view(browser, dev, "#/events")
    browser.wait_for(
        lambda: f"partition 2: replica added on {node}" in (browser.text("#events-table") or ""),
        "the membership change in the time line",
    )


def test_the_time_line_shows_sessions_clients_and_acl_changes(
    dev: DevProcess, browser: Any
) -> None:
    """Issue 29: the Events page listed only the coordination connect. After the replica
    added above (a new store session), the client that followed partition 1 and an ACL
    grant and revoke (the ACL stays unenforced: clients are not refused), the time line
    names each."""
    import zmq

    public, _secret = zmq.curve_keypair()
    key = public.decode()
    coordination = ("--coordination", dev.info["coordination"])
    dev.run("acl", "grant", *coordination, "--key", key, "--partition", "3",
            "--permission", "write", "--name", "console-test")  # fmt: skip
    dev.run("acl", "revoke", *coordination, "--key", "console-test", "--partition", "3")
    open_view(browser, dev, "#/events")
    wanted = [
        f"ACL: key console-test ({key[:8]}...) granted write on partition 3",
        f"ACL: key console-test ({key[:8]}...) no longer holds write on partition 3",
        "partition 2: new store session",
        "connected to partition 1",
        "left partition 1",
    ]
    browser.wait_for(
        lambda: all(w in (browser.text("#events-table") or "") for w in wanted),
        f"the time line naming {wanted}",
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
    browser.wait_for(
        lambda: all(
            browser.text(f'tr[data-partition="{p}"] td.owner') == f"server {survivor}"
            for p in moved
        ),
        f"partitions {moved} moved to server {survivor}",
    )
    browser.wait_for(
        lambda: browser.text('tr[data-partition="0"] td.state') == "writable",
        "partition 0 writable again",
    )
    open_view(browser, dev, "#/events")
    browser.wait_for(
        lambda: (
            f"partition 0 failed over from server {victim} to server {survivor}"
            in (browser.text("#events-table") or "")
        ),
        "the failover in the time line",
    )
    events = browser.text("#events-table") or ""
    assert f"server {victim} stopped answering" in events
    browser.wait_for(
        lambda: f"server {victim} left" in (browser.text("#events-table") or ""),
        "the server's registration expired",
    )
    screenshot(browser, "events")
    open_view(browser, dev, "#/cluster")
    browser.wait_for(lambda: browser.text("#card-servers-alive .value") == "1", "1 server alive")
    assert severe_logs(browser) == []
