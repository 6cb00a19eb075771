from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError, field_validator

from distanom.config import Config, _format_validation_error, load_config, render_defaults_yaml
from distanom.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_default_yaml_file_matches_the_model() -> None:
    text = (REPO / "configs" / "default.yaml").read_text()
    assert text == render_defaults_yaml(), "regenerate with: distanom config --defaults"
    assert load_config(REPO / "configs" / "default.yaml") == Config()
    data = yaml.safe_load(text)
    for section, fields in Config.model_fields.items():
        model = fields.annotation
        assert set(data[section]) == set(model.model_fields), section  # type: ignore[union-attr]
    for line in text.splitlines():
        if line.startswith("  ") and ":" in line:
            assert "  # " in line, f"key without a comment: {line}"


def test_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("detect:\n  multiplier: 2.0\ntracer:\n  backend: kineto\n")
    config = load_config(path, ["detect.multiplier=3", "capture.max_captures=7"])
    assert config.detect.multiplier == 3.0
    assert config.capture.max_captures == 7
    assert config.tracer.backend == "kineto"
    assert config.detect.window_steps == Config().detect.window_steps


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("detect:\n  multplier: 2\n", "unknown key 'detect.multplier'"),
        ("detect:\n  multiplier: fast\n", "detect.multiplier"),
        ("detect:\n  multiplier: 0.5\n", "detect.multiplier: Input should be greater than 1"),
        ("capture:\n  max_disk_mb: -5\n", "capture.max_disk_mb"),
        ("capture:\n  max_captures: -1\n", "capture.max_captures"),
        ("run:\n  name: ../escape\n", "run.name"),
        ("run:\n  name: a/b\n", "run.name"),
        ("tracer:\n  backend: nsight\n", "tracer.backend"),
        ("- just\n- a list\n", "expected a mapping"),
        ("detect: [\n", "not valid YAML at the end of the file (line 1)"),
        ("detect:\n  multiplier: [\n\n\n", "at the end of the file (line 2): expected the"),
        ("detect: {a: b\n  c: d}\n", "not valid YAML at line 2: expected ',' or '}'"),
        ("tracer:\n  backend: yes\n", "(got True: YAML reads yes/no/on/off as true/false"),
        ("bogus: 1\n", "unknown key 'bogus'"),
        ("analysis:\n  on_capture: maybe\n", "analysis.on_capture"),
        ("analysis:\n  on_capture: true\n", "analysis.on_capture"),
        ("detect:\n  min_steps: 500\n  window_steps: 100\n", "must not exceed"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_key(
    tmp_path: Path, content: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert needle in message


@pytest.mark.parametrize("name", ["../escape", "a/b", "-dash", "x" * 65])
def test_validator_error_reads_cleanly(tmp_path: Path, name: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": name}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: run.name: must be 1-64 letters, digits, '.', '_' or '-', start with a "
        f"letter or digit, and contain no '..' (got {name!r})"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"run.name={name}"])
    assert str(info.value).startswith("--set: run.name: must be 1-64 letters")


class _Checked(BaseModel):
    by_value: int = 0
    by_assert: int = 0

    @field_validator("by_value")
    @classmethod
    def _value(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must not be negative,\n  really")
        return value

    @field_validator("by_assert")
    @classmethod
    def _assert(cls, value: int) -> int:
        if value >= 10:  # raised, not `assert`ed: pytest rewrites asserts in this module
            raise AssertionError("must be below 10")
        return value


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"by_value": -1}, "src: by_value: must not be negative, really (got -1)"),
        ({"by_assert": 12}, "src: by_assert: must be below 10 (got 12)"),
    ],
)
def test_pydantic_prefixes_are_stripped_from_any_validator(data: dict, expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        _Checked.model_validate(data)
    assert _format_validation_error("src", info.value) == expected


def test_missing_binary_and_directory_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(binary)


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["detect.multiplier"])
    with pytest.raises(ConfigError, match="malformed key"):
        load_config(None, ["detect..multiplier=2"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["detect.multiplier=2", "detect.multiplier.x=1"])


def test_yaml_aliases_and_tags_are_not_executed(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["run", "detect", "tracer", "capture", "zzz"]),
        st.one_of(
            st.none(),
            st.integers(),
            st.text(max_size=5),
            st.dictionaries(
                st.sampled_from(["multiplier", "name", "backend", "max_captures", "x"]),
                st.one_of(st.none(), st.integers(-5, 5), st.floats(allow_nan=True), st.text()),
                max_size=3,
            ),
        ),
        max_size=4,
    )
)
def test_any_mapping_either_loads_or_fails_with_a_config_error(data: dict) -> None:
    from distanom.config import config_from_mapping

    try:
        config = config_from_mapping(data, "prop.yaml")
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).startswith("prop.yaml")
        assert "Value error," not in str(err) and "Assertion failed," not in str(err)
    else:
        assert isinstance(config, Config)


def test_readme_lists_every_config_key() -> None:
    readme = (REPO / "README.md").read_text()
    for section, fields in Config.model_fields.items():
        model = fields.annotation
        for key in model.model_fields:  # type: ignore[union-attr]
            assert f"`{section}.{key}`" in readme, f"README lacks {section}.{key}"


def test_an_error_names_the_file_or_the_set_values_that_caused_it(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("detect:\n  multiplier: 2\n")
    with pytest.raises(ConfigError, match=r"^--set: detect\.multiplier: "):
        load_config(good, ["detect.multiplier=0.5"])  # the file is fine: --set broke it
    bad = tmp_path / "bad.yaml"
    bad.write_text("detect:\n  multiplier: -3\ntracer:\n  backend: foo\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)  # every wrong key is named, the first with its reason
    assert str(info.value) == (
        f"{bad}: detect.multiplier: Input should be greater than 1 (got -3) "
        "(also wrong: tracer.backend)"
    )
    with pytest.raises(ConfigError, match=r"with --set: tracer\.backend: "):
        load_config(bad, ["detect.multiplier=2"])  # what is still wrong once --set applied
    assert load_config(bad, ["detect.multiplier=2", "tracer.backend=none"]).detect.multiplier == 2
    with pytest.raises(ConfigError, match=r"^--set: detect: must be a section of keys"):
        load_config(None, ["detect=2"])
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("detect: 2\n")  # the file's mistake, though --set reaches into it
    with pytest.raises(ConfigError, match=rf"^{scalar}: detect: must be a section of keys"):
        load_config(scalar, ["detect.multiplier=3"])
    typo = tmp_path / "typo.yaml"
    typo.write_text("run:\n  nme: x\ntracer:\n  backend: foo\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'run.nme' .*\(also wrong: tracer.backend\)$"
    ):
        load_config(typo)


def test_cli_usage_errors_say_distanom_once(capsys: pytest.CaptureFixture[str]) -> None:
    from distanom.cli import main

    assert main([]) == 2
    assert capsys.readouterr().err == "distanom: the following arguments are required: command\n"
    assert main(["analyze"]) == 2
    assert capsys.readouterr().err.startswith("distanom: analyze: the following arguments")


def test_config_set_prints_the_resolved_config_as_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from distanom.cli import main

    assert main(["config", "--set", "detect.multiplier=2", "--set", "run.name=a\nb"]) != 0
    capsys.readouterr()  # a run name with a line break is refused
    assert main(["config", "--set", "detect.multiplier=2", "--set", "tracer.backend=none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "# distanom configuration: every key, with --set detect.multiplier=2 "
        "--set tracer.backend=none.\n"
    )
    assert "  multiplier: 2.0  #" in out and "  backend: none  #" in out
    path = tmp_path / "resolved.yaml"
    path.write_text(out)  # what it prints is a config file that gives the same config
    assert load_config(path) == load_config(None, ["detect.multiplier=2", "tracer.backend=none"])
