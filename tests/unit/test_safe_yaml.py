"""Hostile config files: alias bombs, deep nesting, duplicate keys and huge integers are
refused in bounded time with one line naming the file, never a traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from distanom import safe_yaml
from distanom.cli import main as cli_main
from distanom.config import load_config
from distanom.errors import ConfigError


def alias_bomb(levels: int = 9) -> str:
    """The classic billion-laughs document: a few hundred bytes, 9**levels strings."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias bomb": (alias_bomb(), "aliases"),
    "one alias": ("detect: &d {multiplier: 2.0}\ncapture: *d\n", "aliases"),
    "deep flow": ("[" * 100_000, "nested deeper"),
    "deep block": ("".join(" " * i + f"k{i}:\n" for i in range(200)), "nested deeper"),
    "duplicate section": ("detect:\n  multiplier: 2.0\ndetect:\n  multiplier: 3.0\n", "duplicate"),
    "duplicate key": ("detect:\n  multiplier: 2.0\n  multiplier: 3.0\n", "duplicate key"),
    "huge integer": ("detect:\n  min_steps: " + "9" * 5000 + "\n", "digits"),
    "mapping as key": ("? {a: 1}\n: 2\n", "not a plain value"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_config_is_refused_fast_with_one_line(tmp_path: Path, name: str) -> None:
    content, needle = HOSTILE[name]
    path = tmp_path / "hostile.yaml"
    path.write_text(content)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.monotonic() - started < 2.0
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)) and needle in message


def test_config_check_answers_a_bomb_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert cli_main(["config", "--check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bomb.yaml" in err and "aliases" in err


def test_a_hostile_set_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--set .*digits"):
        load_config(None, ["detect.min_steps=" + "9" * 5000])


def test_ordinary_yaml_still_loads() -> None:
    text = "run:\n  name: demo\ndetect:\n  multiplier: 2.0\n  min_steps: 1_000\nlist: [1, [2, 3]]\n"
    assert safe_yaml.load(text) == yaml.safe_load(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_loads_or_fails_with_a_yaml_error(text: str) -> None:
    try:
        safe_yaml.load(text)
    except (safe_yaml.YamlRefused, yaml.YAMLError) as err:
        assert str(err)  # a refusal always says what it refused


def test_config_check_names_the_overrides_it_checked_with_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "my.yaml"
    path.write_text("detect:\n  multiplier: 2\n")
    assert cli_main(["config", "--check", str(path), "--set", "detect.multiplier=3"]) == 0
    assert capsys.readouterr().out == f"{path} --set detect.multiplier=3: valid\n"
    assert cli_main(["config", "--check", str(path), "--set", "detect.multiplier=x"]) == 2
    assert "--set: detect.multiplier" in capsys.readouterr().err
