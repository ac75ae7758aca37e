import dataclasses
from enum import StrEnum
from pathlib import Path

import pytest

from kvctl.config import CommonSettings, load_section, read_config_file, redacted, register_section
from kvctl.errors import ConfigError


class Mode(StrEnum):
    FAST = "fast"
    SAFE = "safe"


@register_section("demo")
@dataclasses.dataclass(frozen=True)
class DemoSettings:
    root: Path = Path("/")
    block_size: int = dataclasses.field(default=4096, metadata={"unit": "size"})
    timeout_s: float = dataclasses.field(default=1.0, metadata={"unit": "duration"})
    retries: int = 3
    verify: bool = False
    peers: list[str] = dataclasses.field(default_factory=list)
    mode: Mode = Mode.FAST
    label: str | None = None


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvctl.yaml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_given() -> None:
    s = load_section(DemoSettings, env={})
    assert s == DemoSettings()


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg = write(tmp_path, "demo:\n  retries: 5\n  block_size: 64KiB\n  verify: true\n")
    from_file = load_section(DemoSettings, config_file=cfg, env={})
    assert (from_file.retries, from_file.block_size, from_file.verify) == (5, 65536, True)

    env = {"KVCTL_DEMO_RETRIES": "7", "KVCTL_DEMO_PEERS": "a,b"}
    from_env = load_section(DemoSettings, config_file=cfg, env=env)
    assert from_env.retries == 7
    assert from_env.peers == ["a", "b"]
    assert from_env.block_size == 65536  # still from the file

    from_flags = load_section(DemoSettings, config_file=cfg, env=env,
                              flags={"retries": 9, "block_size": None})
    assert from_flags.retries == 9
    assert from_flags.block_size == 65536  # None means "flag not given"


def test_unknown_key_in_file_names_file_and_key(tmp_path: Path) -> None:
    cfg = write(tmp_path, "demo:\n  retrys: 5\n")
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, config_file=cfg, env={})
    assert str(cfg) in info.value.cause
    assert "demo.retrys" in info.value.cause
    assert "retries" in (info.value.hint or "")


def test_unknown_section_is_an_error(tmp_path: Path) -> None:
    cfg = write(tmp_path, "demoo:\n  retries: 5\n")
    with pytest.raises(ConfigError) as info:
        read_config_file(cfg)
    assert "demoo" in info.value.cause
    assert "demo" in (info.value.hint or "")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("demo: [1, 2\n", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        ("demo: 3\n", "must be a mapping"),
        ("demo:\n  retries: many\n", "demo.retries"),
        ("demo:\n  block_size: 4XB\n", "demo.block_size"),
        ("demo:\n  verify: perhaps\n", "demo.verify"),
        ("demo:\n  mode: turbo\n", "demo.mode"),
    ],
)
def test_bad_files_and_values_name_their_source(tmp_path: Path, text: str, needle: str) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, config_file=cfg, env={})
    assert needle in info.value.cause
    assert info.value.hint


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, env={"KVCTL_DEMO_TIMEOUT_S": "forever"})
    assert "KVCTL_DEMO_TIMEOUT_S" in info.value.cause


def test_unknown_env_variable_of_a_section_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, env={"KVCTL_DEMO_RETRYS": "3"})
    assert "KVCTL_DEMO_RETRYS" in info.value.cause


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, env={}, flags={"block_size": "huge"})
    assert "--block-size" in info.value.cause


def test_optional_and_enum_values() -> None:
    s = load_section(DemoSettings, env={"KVCTL_DEMO_LABEL": "none", "KVCTL_DEMO_MODE": "safe"})
    assert s.label is None
    assert s.mode is Mode.SAFE


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_section(DemoSettings, config_file=tmp_path / "nope.yaml", env={})
    assert "nope.yaml" in info.value.cause


def test_token_comes_from_env_and_is_never_rendered() -> None:
    s = load_section(CommonSettings, env={"KVCTL_TOKEN": "s3cret"})
    assert s.token == "s3cret"
    assert "s3cret" not in repr(redacted(s))
    assert redacted(s)["token"] == "***"


def test_secret_never_appears_in_an_error(tmp_path: Path) -> None:
    cfg = write(tmp_path, "common:\n  token: [s3cret]\n")
    with pytest.raises(ConfigError) as info:
        load_section(CommonSettings, config_file=cfg, env={})
    assert "s3cret" not in info.value.cause
    assert "s3cret" not in (info.value.hint or "")


def test_a_config_from_a_pipe_is_read_once_and_checked_like_a_file(tmp_path) -> None:
    """``kvctl -c <(printf ...)``: the root reads the config, then each section reads it
    again; a pipe is empty the second time, so a bad value used to pass unnoticed."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "-c", str(fifo), "store", "serve"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with fifo.open("w") as writer:
        writer.write("store:\n  capacity: 4XB\n")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "unknown unit 'XB'" in err
