"""``waltz spark``: pipeline jobs on Apache Spark (needs the waltz-spark package)::

waltz spark bank-report --coordination URI --out DIR [--master local[*]]
"""

from __future__ import annotations

import json
import os
import sys

import click


@click.group("spark")
def spark_group() -> None:
    """Pipeline jobs on Apache Spark (pip install waltz-spark)."""


@spark_group.command("bank-report")
@click.option(
    "--coordination",
    "uri",
    required=True,
    envvar="WALTZ_COORDINATION",
    help="Coordination service URI of the bank's cluster.",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
def bank_report_command(uri: str, out: str, master: str) -> None:
    """Per-account balances and an operation summary of the bank demo, as Parquet."""
    try:
        from pyspark.sql import SparkSession

        from waltz_spark.jobs import bank_report
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: install the Spark integration first (pip install -e packages/waltz-spark)"
        ) from exc
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName("waltz-bank-report")
    if master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    spark = builder.config("spark.ui.enabled", "false").getOrCreate()
    try:
        figures = bank_report(spark, uri, out)
    finally:
        spark.stop()
    click.echo(json.dumps(figures, sort_keys=True))
    click.echo(f"written: {out}/balances, {out}/summary, {out}/positions (Parquet)")
