"""What `python -m distanom.launch` says of bad input before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_launcher_input_errors_are_one_line_saying_distanom_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distanom.launch import main

    monkeypatch.chdir(tmp_path)
    for env in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(env, raising=False)
    cases = {
        (
            "--bogus",
            "x.py",
        ): "unrecognized arguments: --bogus (see python -m distanom.launch --help)",
        ("nope.py",): "training script nope.py: no such file",
        (): "no training script given (see python -m distanom.launch --help)",
        ("-m", "no_such_module_here"): "module no_such_module_here: not found",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2
        assert capsys.readouterr().err == f"distanom: {message}\n"
