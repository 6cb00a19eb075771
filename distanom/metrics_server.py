"""The /metrics HTTP endpoint of `distanom.metrics`, through prometheus_client (the
`metrics` extra, imported here alone and only when `metrics.port` is set).

`MetricsSnapshot` is what one scrape shows (`NodeMetrics.snapshot()` makes it).
`MetricsServer.start` serves a private registry (never the script's own
prometheus_client registry) holding one collector that turns `NodeMetrics.snapshot()`
into metric families at each scrape, on prometheus_client's daemon threads: a scrape
costs the control and training threads nothing but the GIL while the text is built.
`stop` shuts the server down from a daemon thread of its own, so a rank's exit never
waits for it, and the daemon threads end with the process. The names, types and labels
are docs/metrics.md's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Upper bounds of the step-time histogram's buckets, in seconds: a launch-bound step of
# a millisecond to a minute-long one, about 2.5x apart (and +Inf).
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10, 30, 60)


@dataclass(frozen=True)
class RankSteps:
    """One rank's step-time histogram: counts per bucket (not cumulative; the last one
    past the largest bound), their sum in seconds."""

    rank: int
    local_rank: int
    buckets: tuple[int, ...]
    sum_s: float
    count: int


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything one scrape shows, copied under the lock."""

    run: str
    host: str
    steps: tuple[RankSteps, ...]
    straggler_scores: tuple[tuple[int, int, float], ...]  # (rank, local rank, score)
    # (rank or NO_CULPRIT, local rank or NO_CULPRIT, cause, phase) -> count
    anomalies: tuple[tuple[tuple[str, str, str, str], int], ...]
    hang: bool
    tracing_cost_ratio: float | None


class ServeError(Exception):
    """The endpoint cannot be served (no prometheus_client, the port taken, ...): the
    message is the one warning line's."""


def metric_families(snapshot: MetricsSnapshot) -> list[Any]:
    """The snapshot as prometheus_client metric families (names: docs/metrics.md)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    node = [snapshot.run, snapshot.host]
    rank_labels = ["run", "host", "rank", "local_rank"]
    steps = HistogramMetricFamily(
        "distanom_step_seconds",
        "Training step time per rank, as distanom's consensus rounds gathered it.",
        labels=rank_labels,
        unit="seconds",
    )
    bounds = [*(format(bound, "g") for bound in BUCKETS_S), "+Inf"]
    for hist in snapshot.steps:
        cumulative, running = [], 0
        for bound, count in zip(bounds, hist.buckets, strict=True):
            running += count
            cumulative.append((bound, running))
        steps.add_metric([*node, str(hist.rank), str(hist.local_rank)], cumulative, hist.sum_s)
    anomalies = CounterMetricFamily(
        "distanom_anomalies",
        "Anomalous steps by the rank blamed (rank 'none': no single rank, counted on rank "
        "0's node), the cause its evidence names and the step phase.",
        labels=[*rank_labels, "cause", "phase"],
    )
    for (blamed, blamed_local, cause, phase), times in snapshot.anomalies:
        anomalies.add_metric([*node, blamed, blamed_local, cause, phase], times)
    scores = GaugeMetricFamily(
        "distanom_straggler_score",
        "Share of step time the typical rank waited for this rank over the last window.",
        labels=rank_labels,
    )
    for rank, local_rank, score in snapshot.straggler_scores:
        scores.add_metric([*node, str(rank), str(local_rank)], score)
    hang = GaugeMetricFamily(
        "distanom_hang",
        "1 while this node's local rank 0 counts as hung (no step ended for hang.after_s).",
        labels=["run", "host"],
    )
    hang.add_metric(node, 1.0 if snapshot.hang else 0.0)
    families = [steps, anomalies, scores, hang]
    if snapshot.tracing_cost_ratio is not None:
        cost = GaugeMetricFamily(
            "distanom_tracing_cost_ratio",
            "Tracing's measured cost added to the run's time, as a ratio (0.01 = 1%).",
            labels=["run", "host"],
        )
        cost.add_metric(node, snapshot.tracing_cost_ratio)
        families.append(cost)
    return families


class _Collector:
    """A prometheus_client collector over a snapshot function."""

    def __init__(self, snapshot: Callable[[], MetricsSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        """Nothing to describe ahead: registering must not take a snapshot."""
        return []

    def collect(self) -> Iterator[Any]:
        """The families of a snapshot taken now."""
        yield from metric_families(self._snapshot())


class MetricsServer:
    """The running endpoint; `start` it, `stop` it once."""

    def __init__(self, httpd: Any) -> None:
        self._httpd = httpd

    @classmethod
    def start(cls, addr: str, port: int, snapshot: Callable[[], MetricsSnapshot]) -> MetricsServer:
        """Serve `snapshot` at http://addr:port/metrics; `ServeError` when it cannot."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as err:
            raise ServeError(
                "metrics.port is set but prometheus_client is not installed "
                "(pip install 'distanom[metrics]')"
            ) from err
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(snapshot))
        try:
            started = start_http_server(port, addr=addr, registry=registry)
        except OSError as err:  # the port taken, an address not of this host, ...
            reason = err.strerror or str(err)
            raise ServeError(f"cannot serve metrics on {addr}:{port} ({reason})") from err
        return cls(started[0] if isinstance(started, tuple) else started)

    def stop(self) -> None:
        """Shut the server down without waiting (it polls every half second)."""
        httpd = self._httpd

        def shut() -> None:
            httpd.shutdown()
            httpd.server_close()

        threading.Thread(target=shut, name="distanom-metrics-stop", daemon=True).start()
