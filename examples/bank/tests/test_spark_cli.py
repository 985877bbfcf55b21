"""``waltz spark bank-report`` prints the paths it wrote as they are (the Spark job is
stood in for: this checks the command's own output, Spark's is tested in waltz-spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_bank import spark_cli


class _Jobs:
    """The jobs module's two functions the command calls."""

    def spark_session(self, app: str, master: str) -> tuple[object, bool]:
        return object(), False

    def bank_report(self, spark: Any, uri: str, out: str, chart: str | None) -> dict[str, Any]:
        return {"accounts": 3, "chart": str(Path(out) / "daily_volume.svg")}


@pytest.mark.parametrize("out", ["report/", "report", "report//"])
def test_the_written_paths_have_one_slash(out: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spark_cli, "_jobs", _Jobs)
    result = CliRunner().invoke(
        spark_cli.spark_group, ["bank-report", "--coordination", "local:///x", "--out", out]
    )
    assert result.exit_code == 0, result.output
    assert "//" not in result.output.replace("local:///", ""), result.output
    written = result.output.splitlines()[-1]
    assert written == (
        "written: report/balances, report/summary, report/daily, report/positions (Parquet), "
        "report/daily_volume.svg"
    ), written
