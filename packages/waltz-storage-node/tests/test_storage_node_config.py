"""The storage node's config: validation names the bad key; plugins resolved by name."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from waltz_api.errors import ConfigError
from waltz_storage_node.config import load_storage_config
from waltz_storage_node.main import create_transport, open_engine

KEY = "5b1c3d7e-0a4f-4c1e-9a51-3d2b8f6e7c90"

GOOD = f"""
log_level = "DEBUG"
[storage]
data_dir = "DATA"
engine = "fs"
cluster_key = "{KEY}"
num_partitions = 4
partitions = [0, 2]
[storage.options]
segment_size = 1048576
[transport]
plugin = "zmq"
endpoint = "tcp://127.0.0.1:5599"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(text.replace("DATA", str(tmp_path / "data")))
    return path


def test_a_good_config_loads(tmp_path: Path) -> None:
    cfg = load_storage_config(_write(tmp_path, GOOD), env={})
    assert cfg.storage.data_dir == str(tmp_path / "data")
    assert cfg.storage.cluster_uuid == uuid.UUID(KEY)
    assert cfg.storage.num_partitions == 4
    assert cfg.storage.partitions == [0, 2]
    assert cfg.storage.options == {"segment_size": 1048576}
    assert cfg.transport.endpoint == "tcp://127.0.0.1:5599"
    assert cfg.log_level == "DEBUG"
    assert cfg.http.enabled is False


def test_environment_overrides(tmp_path: Path) -> None:
    cfg = load_storage_config(
        _write(tmp_path, GOOD),
        env={
            "WALTZ_TRANSPORT__ENDPOINT": "tcp://127.0.0.1:6000",
            "WALTZ_STORAGE__QUEUE_SIZE": "17",
            "WALTZ_LOG_LEVEL": "ERROR",
        },
    )
    assert cfg.transport.endpoint == "tcp://127.0.0.1:6000"
    assert cfg.storage.queue_size == 17
    assert cfg.log_level == "ERROR"


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        (
            ('cluster_key = "' + KEY + '"', 'cluster_key = "not-a-uuid"'),
            "storage.cluster_key",
            "UUID",
        ),
        (("num_partitions = 4", "num_partitions = 0"), "storage.num_partitions", "at least 1"),
        (("partitions = [0, 2]", "partitions = [0, 9]"), "storage.partitions[1]", "below 4"),
        (('endpoint = "tcp://127.0.0.1:5599"', ""), "transport.endpoint", "missing"),
        (('endpoint = "tcp://127.0.0.1:5599"', 'endpoint = ""'), "transport.endpoint", "empty"),
        (('data_dir = "DATA"', "data_dir = 5"), "storage.data_dir", "must be str"),
        (('log_level = "DEBUG"', 'log_level = "LOUD"'), "log_level", "must be one of"),
        (
            ("[storage.options]", "queue_size = 0\n[storage.options]"),
            "storage.queue_size",
            "at least",
        ),
        (("num_partitions = 4", "num_partitons = 4"), "storage.num_partitons", "did you mean"),
    ],
)
def test_bad_config_names_the_key(
    tmp_path: Path, change: tuple[str, str], key: str, words: str
) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        load_storage_config(_write(tmp_path, GOOD.replace(old, new)), env={})
    assert err.value.key == key
    assert key.rsplit(".", maxsplit=1)[-1].split("[", maxsplit=1)[0] in str(err.value)
    assert words in str(err.value)


def test_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_storage_config(_write(tmp_path, GOOD), env={"WALTZ_STORAGE__QUEUE_SIZE": "many"})
    assert err.value.key == "storage.queue_size"
    assert "WALTZ_STORAGE__QUEUE_SIZE" in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_storage_config(tmp_path / "nope.toml", env={})


async def test_unknown_plugins_name_the_key(tmp_path: Path) -> None:
    cfg = load_storage_config(
        _write(tmp_path, GOOD.replace('engine = "fs"', 'engine = "nosuch"')), env={}
    )
    with pytest.raises(ConfigError) as err:
        await open_engine(cfg)
    assert err.value.key == "storage.engine" and "valid choices" in str(err.value)
    cfg2 = load_storage_config(
        _write(tmp_path, GOOD.replace('plugin = "zmq"', 'plugin = "carrier-pigeon"')), env={}
    )
    with pytest.raises(ConfigError) as err2:
        create_transport(cfg2)
    assert err2.value.key == "transport.plugin" and "carrier-pigeon" in str(err2.value)


async def test_a_new_storage_needs_the_cluster_key(tmp_path: Path) -> None:
    text = GOOD.replace('cluster_key = "' + KEY + '"\n', "")
    cfg = load_storage_config(_write(tmp_path, text), env={})
    with pytest.raises(ConfigError) as err:
        await open_engine(cfg)
    assert err.value.key == "storage.cluster_key"
    assert "storage.num_partitions" in str(err.value)
