"""``waltz spark``: the bank's pipeline jobs on Apache Spark (:mod:`waltz_bank.spark_jobs`;
they need waltz-spark: ``pip install 'waltz-example-bank[spark]'``), contributed to the
``waltz`` command line by :mod:`waltz_bank.plugin`::

waltz spark bank-report --coordination URI --out DIR [--master local[*]]
waltz spark bank-stream --coordination URI --database FILE --checkpoint DIR [--once]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

_COORDINATION = click.option(
    "--coordination",
    "uri",
    required=True,
    envvar="WALTZ_COORDINATION",
    show_envvar=True,
    help="Coordination service URI of the bank's cluster.",
)
_MASTER = click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")


@click.group("spark")
def spark_group() -> None:
    """The bank demo's pipeline jobs on Apache Spark (pip install 'waltz-example-bank[spark]')."""


def _jobs() -> Any:
    try:
        import pyspark  # noqa: F401

        from waltz_bank import spark_jobs as jobs
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: install the Spark integration first "
            "(pip install 'waltz-example-bank[spark]', or -e packages/waltz-spark)"
        ) from exc
    return jobs


@contextmanager
def _session(jobs: Any, app: str, master: str) -> Iterator[Any]:
    """A SparkSession for the command: the active one when there is one (kept running),
    else a new one on ``master`` (stopped at the end)."""
    spark, created = jobs.spark_session(app, master)
    try:
        yield spark
    finally:
        if created:
            spark.stop()


def _run(job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    from waltz_api.errors import WaltzError

    try:
        return job()
    except WaltzError as exc:
        raise click.ClickException(str(exc)) from exc


@spark_group.command("bank-report")
@_COORDINATION
@click.option(
    "--out",
    required=True,
    help="Output folder: a local path or any Hadoop path (hdfs://, s3a://).",
)
@click.option(
    "--chart",
    type=click.Path(dir_okay=False),
    default=None,
    help="The chart's SVG file (default: OUT/daily_volume.svg when OUT is local).",
)
@_MASTER
def bank_report_command(uri: str, out: str, chart: str | None, master: str) -> None:
    """Per-account balances, per-operation and daily summaries (Parquet) and a chart of
    the daily volume (SVG) of the bank demo's log."""
    jobs = _jobs()
    with _session(jobs, "waltz-bank-report", master) as spark:
        figures = _run(lambda: jobs.bank_report(spark, uri, out, chart))
    click.echo(json.dumps(figures, sort_keys=True, default=str))
    drawn = figures["chart"] or "no chart (OUT is not local: give --chart)"
    base = out.rstrip("/") or out  # --out report/ writes report/balances, not report//balances
    click.echo(
        f"written: {base}/balances, {base}/summary, {base}/daily, {base}/positions (Parquet), "
        f"{drawn}"
    )


@spark_group.command("bank-stream")
@_COORDINATION
@click.option(
    "--database",
    required=True,
    type=click.Path(dir_okay=False),
    help="SQLite file holding the balances, summary and positions (created if missing).",
)
@click.option(
    "--checkpoint",
    required=True,
    help="Spark checkpoint location of the query (a restart continues from it).",
)
@click.option("--once", is_flag=True, help="Apply what the log holds, then stop.")
@click.option(
    "--duration", type=float, default=None, help="Seconds to run (default: until Ctrl-C)."
)
@click.option(
    "--trigger-seconds",
    type=float,
    default=1.0,
    show_default=True,
    help="Interval between micro-batches (processing-time trigger).",
)
@click.option(
    "--max-transactions-per-trigger",
    type=click.IntRange(min=1),
    default=None,
    help="At most this many transactions per micro-batch (default: all available).",
)
@_MASTER
def bank_stream_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    database: str,
    checkpoint: str,
    once: bool,
    duration: float | None,
    trigger_seconds: float,
    max_transactions_per_trigger: int | None,
    master: str,
) -> None:
    """Keep the bank's per-account balances and summary current in SQLite, from a Spark
    structured streaming query on the log (exactly once across restarts)."""
    jobs = _jobs()
    with _session(jobs, "waltz-bank-stream", master) as spark:
        state = _run(
            lambda: jobs.run_bank_stream(
                spark,
                uri,
                database,
                checkpoint,
                once=once,
                duration=duration,
                trigger_seconds=trigger_seconds,
                max_transactions_per_trigger=max_transactions_per_trigger,
            )
        )
    click.echo(json.dumps(jobs.stream_figures(state), sort_keys=True, default=str))
    click.echo(f"state: {database} (tables balances, summary, positions, batches)")
