"""The live metrics endpoint, scraped while a 2-rank torchrun job trains."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TOY, free_port, job_env, kill_job

parser = pytest.importorskip("prometheus_client.parser")

STALL_STEP = 150


def _scrape(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None  # not serving yet
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _counts(families: dict[str, Any]) -> dict[str, float]:
    steps = families["distanom_step_seconds"]
    return {s.labels["rank"]: s.value for s in steps.samples if s.name.endswith("_count")}


def _host_stalls_on_rank_1(families: dict[str, Any]) -> float:
    samples = families["distanom_anomalies"].samples
    return sum(
        s.value
        for s in samples
        if s.name == "distanom_anomalies_total"
        and (s.labels["rank"], s.labels["cause"]) == ("1", "host_stall")
    )


def test_the_endpoint_is_scraped_during_a_run(tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "distanom.launch", "--run-dir", "runs", "--set", "tracer.backend=none",
        "--set", f"metrics.port={port}", "--set", "metrics.addr=127.0.0.1",
        str(TOY), "--steps", "700", "--step-sleep", "0.01",
        "--stall-rank", "1", "--stall-steps", str(STALL_STEP), "--stall-s", "0.5",
    ]  # fmt: skip
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        job = subprocess.Popen(
            command, cwd=tmp_path, env=job_env(TORCH_FR_BUFFER_SIZE="2000"),
            stdout=subprocess.DEVNULL, stderr=err_file, text=True, start_new_session=True,
        )  # fmt: skip
    scrapes: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 90
        # scrape until two scrapes show the step counts growing and the stall counted
        while time.monotonic() < deadline and job.poll() is None:
            families = _scrape(port)
            if families is not None and min(_counts(families).values(), default=0) > 0:
                scrapes.append(families)
                grew = _counts(scrapes[0])["1"] < _counts(families)["1"]
                if grew and _host_stalls_on_rank_1(families) >= 1:
                    break
            time.sleep(0.5)
        assert job.wait(timeout=90) == 0, stderr.read_text()[-3000:]
    finally:
        if job.poll() is None:
            kill_job(job)
    log = stderr.read_text()
    assert len(scrapes) >= 2, f"endpoint not scraped twice during the run: {log[-3000:]}"
    first, last = scrapes[0], scrapes[-1]
    assert set(_counts(first)) == {"0", "1"}  # the node's ranks, nothing else
    assert all(_counts(first)[r] < _counts(last)[r] for r in ("0", "1"))
    assert _host_stalls_on_rank_1(last) >= 1, "the stalled step was not counted on rank 1"
    run_id = (tmp_path / "runs" / "latest").resolve().name
    for name, kind in (
        ("distanom_step_seconds", "histogram"),
        ("distanom_anomalies", "counter"),
        ("distanom_straggler_score", "gauge"),
        ("distanom_hang", "gauge"),
    ):
        family = last[name]
        assert family.type == kind and family.samples, name
        for sample in family.samples:
            assert sample.labels["run"] == run_id and sample.labels["host"]
    assert [s.value for s in last["distanom_hang"].samples] == [0.0]
    assert "metrics:" not in log  # no warning
