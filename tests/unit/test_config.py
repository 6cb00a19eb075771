from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from distanom.config import Config, load_config, render_defaults_yaml
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
        ("detect: [\n", "not valid YAML at line"),
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
    else:
        assert isinstance(config, Config)


def test_readme_lists_every_config_key() -> None:
    readme = (REPO / "README.md").read_text()
    for section, fields in Config.model_fields.items():
        model = fields.annotation
        for key in model.model_fields:  # type: ignore[union-attr]
            assert f"`{section}.{key}`" in readme, f"README lacks {section}.{key}"
