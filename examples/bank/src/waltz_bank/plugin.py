"""What the bank demo adds to the ``waltz`` command line (entry point ``waltz_bank``):
``waltz spark bank-report`` and ``waltz spark bank-stream``, its pipeline jobs on
Apache Spark (they need the ``spark`` extra: waltz-spark and PySpark).

Light on purpose: the commands' module is imported when ``waltz spark`` is chosen,
Spark when a job runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_spark() -> click.Command:
    from waltz_bank.spark_cli import spark_group

    return spark_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "spark",
            load_spark,
            "The bank demo's pipeline jobs on Apache Spark (pip install "
            "'waltz-example-bank[spark]').",
        )
    ]
