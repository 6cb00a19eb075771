"""The kineto backend's window files: only in a private 0700 folder, so a link planted
in the shared temporary folder (torch writes `<name>.tmp` beside each file and follows a
link there) is never written through."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch

from distanom.config import TracerConfig
from distanom.tracers import kineto
from distanom.tracers.base import Availability
from distanom.tracers.kineto import KinetoTracer


def test_window_files_never_land_where_another_user_can_plant_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir(mode=0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    folders: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def attacker_watching(*args: object, **kwargs: object) -> tuple[int, str]:
        fd, path = real_mkstemp(*args, **kwargs)  # type: ignore[call-overload]
        folders.append(os.path.dirname(path))
        if stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o077:
            os.symlink(victim, path + ".tmp")  # the name torch writes next: predictable
        return fd, path

    monkeypatch.setattr(kineto.tempfile, "mkstemp", attacker_watching)
    tracer = KinetoTracer(TracerConfig(kineto_window_steps=2, history_steps=4), use_cuda=False)
    x = torch.randn(32, 32)
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    for step in range(1, 6):
        x = torch.tanh(x @ x)
        tracer.mark_step(step, time.time_ns())
    assert tracer.availability(3) is Availability.READY
    assert tracer.step_trace(3).events
    scratch = tracer._scratch_dir
    tracer.close()
    assert folders and all(folder == scratch for folder in folders)
    assert victim.read_text() == "precious"
    assert scratch is not None and not os.path.exists(scratch)  # removed at close
    assert scratch.startswith(str(shared))  # under the temporary folder, made 0700
