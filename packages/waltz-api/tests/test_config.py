"""Config loading: TOML, WALTZ_* environment overrides, validation with the bad key named."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from waltz_api.config import config_from_mapping, describe, load_config
from waltz_api.errors import ConfigError, WaltzError


@dataclass(frozen=True)
class StorageSection:
    segment_size: int = field(
        default=1024, metadata={"min": 1, "max": 2**30, "help": "bytes per segment"}
    )
    directory: Path = Path("/var/lib/waltz")
    durability: str = field(default="fsync", metadata={"choices": ("fsync", "none")})


@dataclass(frozen=True)
class Limits:
    max_frame: int = 1 << 20


@dataclass(frozen=True)
class ServerSection:
    port: int = 0
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class Config:
    cluster_name: str = "waltz"
    partitions: int = field(default=1, metadata={"min": 1})
    ratio: float = 0.5
    debug: bool = False
    hosts: list[str] = field(default_factory=list)
    ports: tuple[int, ...] = ()
    level: Literal["info", "debug"] = "info"
    timeout: float | None = None
    label: str | None = None
    storage: StorageSection = field(default_factory=StorageSection)
    server: ServerSection = field(default_factory=ServerSection)
    lock_table_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Required:
    name: str


@dataclass(frozen=True)
class Checked:
    low: int = 0
    high: int = 10

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "waltz.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_file_or_environment() -> None:
    assert load_config(Config, env={}) == Config()


def test_file_values_and_nested_sections(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        cluster_name = "prod"
        partitions = 8
        ratio = 2
        hosts = ["a", "b"]
        ports = [1, 2]
        level = "debug"
        timeout = 1.5

        [storage]
        segment_size = 4096
        directory = "~/waltz"

        [server.limits]
        max_frame = 65536

        [lock_table_options]
        size = 100
        """,
    )
    config = load_config(Config, path, env={})
    assert config.cluster_name == "prod"
    assert config.partitions == 8
    assert config.ratio == 2.0
    assert isinstance(config.ratio, float)
    assert config.hosts == ["a", "b"]
    assert config.ports == (1, 2)
    assert config.level == "debug"
    assert config.timeout == 1.5
    assert config.storage.segment_size == 4096
    assert config.storage.directory == Path("~/waltz").expanduser()
    assert config.storage.durability == "fsync"
    assert config.server.limits.max_frame == 65536
    assert config.server.port == 0
    assert config.lock_table_options == {"size": 100}


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "partitions = 4\n[storage]\nsegment_size = 4096\n")
    env = {
        "WALTZ_PARTITIONS": "16",
        "WALTZ_STORAGE__SEGMENT_SIZE": "8192",
        "WALTZ_SERVER__LIMITS__MAX_FRAME": "1_000",
        "WALTZ_DEBUG": "yes",
        "WALTZ_RATIO": "0.25",
        "WALTZ_CLUSTER_NAME": "from env",
        "WALTZ_HOSTS": "x, y,z",
        "WALTZ_PORTS": "7, 8",
        "WALTZ_LEVEL": "debug",
        "WALTZ_LOCK_TABLE_OPTIONS__SIZE": "64",
        "WALTZ_DISABLE_PLUGIN_AUTOLOAD": "1",  # another component's variable: ignored here
        "OTHER_PARTITIONS": "99",
    }
    config = load_config(Config, path, env=env)
    assert config.partitions == 16
    assert config.storage.segment_size == 8192
    assert config.server.limits.max_frame == 1000
    assert config.debug is True
    assert config.ratio == 0.25
    assert config.cluster_name == "from env"
    assert config.hosts == ["x", "y", "z"]
    assert config.ports == (7, 8)
    assert config.level == "debug"
    assert config.lock_table_options == {"size": 64}


def test_environment_is_read_from_os_environ_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WALTZ_STORAGE__SEGMENT_SIZE", "2048")
    assert load_config(Config).storage.segment_size == 2048


def test_environment_text_is_read_as_the_field_type() -> None:
    env = {"WALTZ_LABEL": "123", "WALTZ_TIMEOUT": "3", "WALTZ_PORTS": "[1, 2]"}
    config = load_config(Config, env=env)
    assert config.label == "123", "a str | None key keeps digits as text"
    assert config.timeout == 3.0
    assert config.ports == (1, 2)


def test_list_key_accepts_a_comma_separated_string(tmp_path: Path) -> None:
    config = load_config(Config, write(tmp_path, "hosts = 'a, b'\nports = '3,4'"), env={})
    assert config.hosts == ["a", "b"]
    assert config.ports == (3, 4)


def test_overrides_beat_the_environment() -> None:
    config = load_config(
        Config,
        env={"WALTZ_STORAGE__SEGMENT_SIZE": "8192"},
        overrides={"storage": {"segment_size": 512}, "debug": True},
    )
    assert config.storage.segment_size == 512
    assert config.storage.durability == "fsync"
    assert config.debug is True


def test_unknown_key_in_file_is_named_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "[storage]\nsegmnt_size = 3\n")
    with pytest.raises(ConfigError, match=r"'storage\.segmnt_size'; did you mean 'segment_size'"):
        load_config(Config, path, env={})
    with pytest.raises(ConfigError) as info:
        load_config(Config, path, env={})
    assert info.value.key == "storage.segmnt_size"


def test_unknown_key_without_close_match_lists_the_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[server.limits]\nzzz = 1\n")
    with pytest.raises(ConfigError, match=r"'server\.limits\.zzz'; valid keys: max_frame") as info:
        load_config(Config, path, env={})
    assert info.value.key == "server.limits.zzz"


def test_unknown_key_in_environment_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"WALTZ_STORAGE__SEGMNT_SIZE.*did you mean") as info:
        load_config(Config, env={"WALTZ_STORAGE__SEGMNT_SIZE": "5"})
    assert info.value.key == "storage.segmnt_size"


def test_environment_naming_a_section_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"names the section 'storage'.*WALTZ_STORAGE__") as info:
        load_config(Config, env={"WALTZ_STORAGE": "5"})
    assert info.value.key == "storage"


def test_environment_sub_key_of_a_plain_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="has no sub-keys") as info:
        load_config(Config, env={"WALTZ_PARTITIONS__X": "5"})
    assert info.value.key == "partitions"


@pytest.mark.parametrize(
    ("toml", "key", "message"),
    [
        ('partitions = "four"', "partitions", "must be int, got 'four'"),
        ("partitions = 1.5", "partitions", "must be int"),
        ("partitions = true", "partitions", "must be int"),
        ("debug = 1", "debug", "must be bool"),
        ("ratio = 'x'", "ratio", "must be float"),
        ("cluster_name = 5", "cluster_name", "must be str"),
        ("hosts = 5", "hosts", "must be list"),
        ("hosts = [1]", "hosts[0]", "must be str"),
        ("ports = ['a']", "ports[0]", "must be int"),
        ("level = 'loud'", "level", "must be one of 'info', 'debug'"),
        ("timeout = 'soon'", "timeout", r"must be float \| None, got 'soon'"),
        ("storage = 5", "storage", "must be a table"),
        ("[storage]\ndirectory = 3", "storage.directory", "must be Path"),
        ("lock_table_options = 3", "lock_table_options", "must be"),
    ],
)
def test_bad_value_type_is_named(tmp_path: Path, toml: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(Config, write(tmp_path, toml), env={})
    assert info.value.key == key
    assert isinstance(info.value, WaltzError)


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"'partitions' must be int.*\(from WALTZ_PARTITIONS\)"):
        load_config(Config, env={"WALTZ_PARTITIONS": "many"})
    with pytest.raises(ConfigError, match=r"'debug' must be bool.*WALTZ_DEBUG"):
        load_config(Config, env={"WALTZ_DEBUG": "maybe"})
    with pytest.raises(ConfigError, match=r"'ports\[1\]' must be int.*WALTZ_PORTS"):
        load_config(Config, env={"WALTZ_PORTS": "1,x"})
    with pytest.raises(ConfigError, match=r"'timeout' must be float \| None.*WALTZ_TIMEOUT"):
        load_config(Config, env={"WALTZ_TIMEOUT": "soon"})


@pytest.mark.parametrize(
    ("raw", "key", "message"),
    [
        ({"partitions": 0}, "partitions", "must be at least 1, got 0"),
        ({"storage": {"segment_size": 0}}, "storage.segment_size", "at least 1"),
        ({"storage": {"segment_size": 2**31}}, "storage.segment_size", "at most 1073741824"),
        ({"storage": {"durability": "maybe"}}, "storage.durability", "must be one of fsync, none"),
    ],
)
def test_constraints_min_max_choices(raw: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_from_mapping(Config, raw)
    assert info.value.key == key


def test_constraint_bounds_are_inclusive() -> None:
    config = config_from_mapping(Config, {"storage": {"segment_size": 2**30}, "partitions": 1})
    assert config.storage.segment_size == 2**30


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Config, tmp_path / "nope.toml", env={})


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(Config, tmp_path, env={})


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "partitions = = 3\n")
    with pytest.raises(ConfigError, match=r"is not valid TOML: .*line 1"):
        load_config(Config, path, env={})


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "waltz.toml"
    path.write_bytes(b"cluster_name = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match="not valid TOML: it is not UTF-8"):
        load_config(Config, path, env={})


def test_missing_required_key() -> None:
    with pytest.raises(ConfigError, match="missing required config key 'name'") as info:
        load_config(Required, env={})
    assert info.value.key == "name"
    assert load_config(Required, env={"WALTZ_NAME": "x"}).name == "x"


def test_schema_validation_error_becomes_config_error() -> None:
    with pytest.raises(ConfigError, match=r"invalid config: low \(5\) must not exceed high"):
        config_from_mapping(Checked, {"low": 5, "high": 1})


def test_describe_lists_every_key_with_help() -> None:
    rows = {
        key: (type_name, default, help_text)
        for key, type_name, default, help_text in describe(Config)
    }
    assert rows["storage.segment_size"] == ("int", 1024, "bytes per segment")
    assert rows["server.limits.max_frame"][1] == 1 << 20
    assert rows["hosts"][1] == []
    assert "storage" not in rows
