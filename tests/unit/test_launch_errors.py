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


def test_a_nodes_other_ranks_wait_so_its_first_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun a rank's exit makes torchrun stop the others: a rank that is not
    its node's first says nothing and waits before exiting, so the first is not stopped
    before its one line (CI saw none once); a one-process run does not wait."""
    import distanom.launch as launch

    monkeypatch.chdir(tmp_path)
    waits: list[float] = []
    monkeypatch.setattr(launch.time, "sleep", waits.append)
    bad = ["--set", "tracer.backend=magic", "x.py"]
    for local_rank, world_size, said, waited in (
        ("1", "2", "", [launch.QUIET_RANK_EXIT_DELAY_S]),
        ("0", "2", "tracer.backend", []),
        ("0", "1", "tracer.backend", []),
    ):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("RANK", local_rank)
        monkeypatch.setenv("WORLD_SIZE", world_size)
        waits.clear()
        assert launch.main(bad) == 2
        err = capsys.readouterr().err
        assert (said in err and err.startswith("distanom: ")) if said else err == ""
        assert waits == waited
