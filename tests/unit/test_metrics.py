"""Live Prometheus metrics: what local rank 0 keeps for its node's ranks, what it serves,
and how it steps aside (a port in use, no prometheus_client, an internal error)."""

from __future__ import annotations

import math
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from distanom.anomaly_journal import AnomalyJournal
from distanom.config import Config, ConfigError, MetricsConfig, load_config
from distanom.consensus import RoundResult
from distanom.detect import StepSample
from distanom.metrics import NO_CULPRIT, NodeMetrics, node_ranks
from distanom.records.anomalies import AnomalyRecord, StepEvidence
from distanom.stragglers import StragglerScorer
from distanom.world import WorldInfo

prometheus_parser = pytest.importorskip("prometheus_client.parser")

NAN = math.nan


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class FakeHang:
    hung: bool = False


@dataclass
class FakeDuty:
    pct: float | None = 0.8

    def report(self) -> dict[str, Any] | None:
        return {"effective_overhead_pct": self.pct}


@dataclass
class FakeEvidence:
    journal: AnomalyJournal | None = None


@dataclass
class FakeRun:
    run_id: str = "demo-20250101-000000"


@dataclass
class Source:
    run: Any = field(default_factory=FakeRun)
    hang_watch: Any = field(default_factory=FakeHang)
    duty: Any = field(default_factory=FakeDuty)
    evidence: Any = field(default_factory=FakeEvidence)


class Warnings:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, key: str, fmt: str, *args: object) -> None:
        self.lines.append(fmt % args)


def _world(rank: int, world_size: int = 4, local_world: int = 2) -> WorldInfo:
    local = rank % local_world
    return WorldInfo(rank, world_size, local, local_world, rank // local_world, "node-a",
                     None, None, "job")  # fmt: skip


def _metrics(
    rank: int = 0, port: int | None = None, source: Source | None = None, **world: int
) -> tuple[NodeMetrics, Warnings, Source]:
    warn, source = Warnings(), source or Source()
    config = MetricsConfig(port=port if port is not None else _free_port(), addr="127.0.0.1")
    return NodeMetrics(config, _world(rank, **world), source, warn), warn, source


def _round(times: list[tuple[float, ...]], first: int = 1) -> RoundResult:
    samples = tuple(StepSample(first + i, t, traced=False) for i, t in enumerate(times))
    return RoundResult(samples, (0,) * len(times[0]), None)


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}


def test_a_nodes_ranks_are_consecutive_from_its_local_rank_0() -> None:
    assert node_ranks(_world(5, world_size=8, local_world=4)) == range(4, 8)
    assert node_ranks(_world(1, world_size=2, local_world=2)) == range(0, 2)


def test_off_without_a_port_and_on_every_rank_but_local_rank_0() -> None:
    warn, source = Warnings(), Source()
    off = NodeMetrics(MetricsConfig(), _world(0), source, warn)
    assert not off.active and not off.wants_evidence
    local_1, _, _ = _metrics(rank=1)
    assert not local_1.active
    local_1.after_round(_round([(1.0, 2.0, 3.0, 4.0)]), [])
    assert local_1.snapshot().steps[0].count == 0  # nothing folded, nothing served
    leader, _, _ = _metrics(rank=2)
    assert leader.active and leader.wants_evidence  # another node's leader: own journal


def test_step_times_of_the_nodes_ranks_only_fill_the_histogram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics, warn, _ = _metrics(rank=2)  # node 1: ranks 2 and 3
    monkeypatch.setattr(metrics, "_start", lambda: True)
    # 1 ms falls in the 1 ms bucket (le is inclusive); NaN (no duration) is left out
    metrics.after_round(_round([(5.0, 5.0, 1.0, 700.0), (5.0, 5.0, NAN, 20.0)]), [])
    steps = {s.rank: s for s in metrics.snapshot().steps}
    assert sorted(steps) == [2, 3] and [s.local_rank for s in steps.values()] == [0, 1]
    assert steps[2].count == 1 and steps[2].buckets[0] == 1 and steps[2].sum_s == 0.001
    assert steps[3].count == 2 and steps[3].sum_s == pytest.approx(0.72)
    assert steps[3].buckets[4] == 1 and steps[3].buckets[9] == 1  # le 0.025, le 1
    assert sum(steps[3].buckets) == 2 and warn.lines == []
    assert metrics.snapshot().tracing_cost_ratio == pytest.approx(0.008)


def _record(step: int, evidence: list[StepEvidence]) -> AnomalyRecord:
    n = len(evidence)
    return AnomalyRecord(
        step=step, step_ms=315.0, median_ms=15.0, threshold_ms=22.5, traced=False,
        judged_by="condition", slowest_rank=0, durations_ms=(315.0,) * n,
        evidence=tuple(evidence), arrive_median_ms=(10.0,) * n, cpu_median_ms=(1.0,) * n,
    )  # fmt: skip


ON_TIME = StepEvidence(10.0, 1, 1.0, 0.0)


def test_anomalies_are_counted_on_the_culprits_node_by_cause() -> None:
    gc_on_3 = _record(40, [ON_TIME, ON_TIME, ON_TIME, StepEvidence(300.0, 1, 200.0, 250.0)])
    stall_on_1 = _record(50, [ON_TIME, StepEvidence(310.0, 1, 1.2, 0.0), ON_TIME, ON_TIME])
    collective = _record(60, [ON_TIME, StepEvidence(10.4, 1, 1.0, 0.0), ON_TIME, ON_TIME])
    node0, _, _ = _metrics(rank=0)
    node1, _, _ = _metrics(rank=2)
    for metrics in (node0, node1):
        for record in (gc_on_3, stall_on_1, collective, gc_on_3):
            metrics._on_record(record)
    assert dict(node1.snapshot().anomalies) == {("3", "1", "python_gc", "unknown"): 2}
    assert dict(node0.snapshot().anomalies) == {
        ("1", "1", "host_stall", "unknown"): 1,
        (NO_CULPRIT, NO_CULPRIT, "slow_collective", "unknown"): 1,  # once in the job
    }


def test_a_cause_outside_the_fixed_set_counts_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    from distanom.analysis.anomalies import AnomalyVerdict

    metrics, _, _ = _metrics(rank=0)
    verdict = AnomalyVerdict(0, "something_new", "", "arrival")
    monkeypatch.setattr("distanom.metrics.judge", lambda record, previous: verdict)
    metrics._on_record(_record(40, [ON_TIME] * 4))
    assert dict(metrics.snapshot().anomalies) == {("0", "0", "unknown", "unknown"): 1}


def test_another_nodes_leader_counts_causes_from_a_journal_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from distanom.consensus import EvidenceBlock
    from distanom.detect import AnomalyJudgment

    metrics, _, _ = _metrics(rank=2)
    monkeypatch.setattr(metrics, "_start", lambda: True)
    slow = StepEvidence(300.0, 1, 200.0, 250.0)  # a GC pause on rank 3
    block = EvidenceBlock.from_items(4, [(r, 40, slow if r == 3 else ON_TIME) for r in range(4)])
    result = RoundResult(
        (StepSample(40, (15.0, 15.0, 15.0, 315.0), traced=False),), (0,) * 4, None, (41,) * 4, block
    )
    judged = [AnomalyJudgment(40, 315.0, 15.0, 22.5, False, "condition", 3)]
    metrics.after_round(result, judged)
    assert dict(metrics.snapshot().anomalies) == {("3", "1", "python_gc", "unknown"): 1}


def test_rank_0_listens_to_its_journal_and_reads_straggler_scores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    journal = AnomalyJournal(4, None)
    for step in range(1, 41):  # rank 1 late by 3 of every 10 ms
        journal.scorer.add_late(step, ((1, 3.0),), 10.0)
    metrics, _, _ = _metrics(rank=0, source=Source(evidence=FakeEvidence(journal)))
    monkeypatch.setattr(metrics, "_start", lambda: True)
    metrics.after_round(_round([(10.0,) * 4]), [])
    assert journal.listener is not None
    scores = {rank: score for rank, _, score in metrics.snapshot().straggler_scores}
    assert scores == {0: 0.0, 1: pytest.approx(0.3)}


def test_served_names_types_and_labels_then_stopped() -> None:
    port = _free_port()
    source = Source(hang_watch=FakeHang(hung=True))
    metrics, warn, _ = _metrics(rank=0, port=port, source=source)
    metrics.after_round(_round([(5.0, 7.0, 9.0, 9.0)] * 3), [])
    metrics._on_record(_record(40, [ON_TIME, StepEvidence(310.0, 1, 1.2, 0.0), ON_TIME, ON_TIME]))
    try:
        families = _scrape(port)
    finally:
        metrics.close()
    assert warn.lines == []
    steps = families["distanom_step_seconds"]
    assert steps.type == "histogram"
    counts = {s.labels["rank"]: s.value for s in steps.samples if s.name.endswith("_count")}
    assert counts == {"0": 3, "1": 3}
    labels = steps.samples[0].labels
    assert {"run": "demo-20250101-000000", "host": "node-a"}.items() <= labels.items()
    assert {"rank", "local_rank"} <= set(labels)
    anomalies = families["distanom_anomalies"]
    assert anomalies.type == "counter"
    [sample] = [s for s in anomalies.samples if s.name == "distanom_anomalies_total"]
    assert sample.value == 1 and sample.labels["cause"] == "host_stall"
    assert (sample.labels["rank"], sample.labels["phase"]) == ("1", "unknown")
    assert families["distanom_straggler_score"].type == "gauge"
    assert [s.value for s in families["distanom_hang"].samples] == [1.0]
    assert [s.value for s in families["distanom_tracing_cost_ratio"].samples] == [0.008]
    deadline = time.monotonic() + 5.0  # stopped: the port is refused soon after
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                break
        assert time.monotonic() < deadline, "the metrics server outlived close()"
        time.sleep(0.05)


def test_a_port_in_use_is_one_warning_and_metrics_step_aside() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        metrics, warn, _ = _metrics(rank=0, port=port)
        for _ in range(3):
            metrics.after_round(_round([(5.0,) * 4]), [])
    assert len(warn.lines) == 1 and f"127.0.0.1:{port}" in warn.lines[0]
    assert "in use" in warn.lines[0] and not metrics.active
    assert metrics.snapshot().steps[0].count == 0


def test_without_prometheus_client_one_warning_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    metrics, warn, _ = _metrics(rank=0)
    metrics.after_round(_round([(5.0,) * 4]), [])
    metrics.after_round(_round([(5.0,) * 4]), [])
    assert len(warn.lines) == 1 and "distanom[metrics]" in warn.lines[0]


def test_an_internal_error_is_one_warning_and_stops_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()
    metrics, warn, source = _metrics(rank=0, port=port)
    source.duty = None  # reading the tracing cost fails
    metrics.after_round(_round([(5.0,) * 4]), [])
    metrics.after_round(_round([(5.0,) * 4]), [])
    assert len(warn.lines) == 1 and "internal error" in warn.lines[0]
    assert not metrics.active


def test_config_errors_name_the_key(tmp_path: Any) -> None:
    assert Config().metrics.port is None and Config().metrics.addr == "0.0.0.0"
    bad_values = ["metrics.port=0", "metrics.port=70000", "metrics.addr='a b'", "metrics.addr=''"]
    for bad in bad_values:
        key = bad.split("=")[0]
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    assert load_config(None, ["metrics.port=9400"]).metrics.port == 9400


def test_window_score_is_the_ranks_share_of_the_window() -> None:
    scorer = StragglerScorer(2, window=4)
    assert scorer.window_score(1) == 0.0
    for step in range(1, 7):  # only the last 4 steps count: rank 1 late 2 ms at 4 and 6
        scorer.add_late(step, ((1, 2.0),) if step % 2 == 0 else (), 10.0)
    assert scorer.window_score(1) == pytest.approx(4.0 / 40.0)
    assert scorer.window_score(0) == 0.0


def test_the_journal_tells_its_listener_without_a_file() -> None:
    from distanom.detect import AnomalyJudgment

    journal = AnomalyJournal(2, None)
    heard: list[int] = []
    journal.listener = lambda record: heard.append(record.step)
    journal.add_judgments([AnomalyJudgment(7, 30.0, 10.0, 15.0, False, "condition", 1)])
    journal.flush()
    assert heard == [7]


def test_the_hang_flag_is_up_from_the_record_until_a_step_ends() -> None:
    from tests.unit.test_hang_watch import Steps, _watch

    steps = Steps()
    watch = _watch(None, steps, after_s=0.2)
    watch.start()
    try:
        steps.advance(2)
        deadline = time.monotonic() + 5.0
        while not watch.hung:
            assert time.monotonic() < deadline, "no hang reported"
            time.sleep(0.02)
        steps.advance(1)
        deadline = time.monotonic() + 5.0
        while watch.hung:
            assert time.monotonic() < deadline, "the hang flag stayed up after a step"
            time.sleep(0.02)
    finally:
        watch.stop()
