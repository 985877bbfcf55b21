"""Waltz as a PySpark 4 Python data source (format ``waltz``): batch and streaming
reads of committed transactions, and appends.

::

    import waltz_spark
    waltz_spark.register(spark)
    df = spark.read.format("waltz").option("coordination", uri).load()
"""

from waltz_spark.datasource import (
    SCHEMA,
    RowsRejectedError,
    WaltzDataSource,
    register,
)
from waltz_spark.reader import LogReader

__all__ = ["SCHEMA", "LogReader", "RowsRejectedError", "WaltzDataSource", "register"]
