"""Live metrics of one node's ranks for Prometheus (`metrics.port`; docs/metrics.md).

Local rank 0 of each node keeps, for the ranks of its node (torchrun numbers a node's
ranks consecutively: `node_ranks`), the figures `distanom.metrics_server` serves at
/metrics: a histogram of every step's time per rank, the anomalies blamed on each rank by
cause and phase, each rank's straggler score, the hang flag and the tracing cost.

The control thread feeds `NodeMetrics.after_round` once per consensus round with the
gathered round (every rank's step times) and the anomalies the detector judged; nothing
runs on the training thread. The causes come from the anomaly journal's records, judged
by the same evidence rule the report uses (`distanom.analysis.anomalies.judge`): rank 0
listens to its journal, a node leader of another node keeps a journal of its own (no
file) and so decodes each round's evidence too. The server's thread reads `snapshot()`
at each scrape; the state is guarded by one lock held for microseconds on either side.
Any failure here is logged once and switches metrics off; training goes on.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from distanom.analysis.anomalies import judge
from distanom.anomaly_journal import AnomalyJournal
from distanom.config import MetricsConfig
from distanom.consensus import RoundResult
from distanom.detect import AnomalyJudgment
from distanom.metrics_server import BUCKETS_S, MetricsServer, MetricsSnapshot, RankSteps, ServeError
from distanom.records.anomalies import AnomalyRecord
from distanom.stragglers import StragglerScorer

if TYPE_CHECKING:
    from distanom.duty_cycle import DutyCycle
    from distanom.evidence import EvidenceTier
    from distanom.hang import HangWatch
    from distanom.rundir import RunDir
    from distanom.world import WorldInfo

log = logging.getLogger(__name__)

# The causes the evidence rule names; anything else is counted as "unknown", so the
# label's values stay a fixed set whatever a record holds.
CAUSES = (
    "python_gc", "host_busy", "host_stall", "gpu_work", "data_loading", "distanom",
    "slow_collective", "unknown",
)  # fmt: skip
PHASES = ("data", "forward", "backward", "optimizer", "unknown")
NO_CULPRIT = "none"  # the rank label of anomalies no single rank is blamed for
_BOUNDS_MS = tuple(1000.0 * bound for bound in BUCKETS_S)
# The governor's tracing cost is read (under the duty cycle's lock) at most this often.
TRACING_COST_EVERY_S = 5.0


def phase_of(record: AnomalyRecord) -> str:
    """The step phase an anomaly's time went to (one of `PHASES`). The live evidence does
    not carry a step's phases (data, forward, backward, optimizer) yet: "unknown"."""
    del record
    return "unknown"


def node_ranks(world: WorldInfo) -> range:
    """The global ranks of this rank's node: torchrun gives a node's workers consecutive
    ranks, this rank's minus its local rank first."""
    first = world.rank - world.local_rank
    return range(max(0, first), min(world.world_size, first + world.local_world_size))


class MetricsSource(Protocol):
    """What the metrics read from the control loop (attributes, read when needed)."""

    run: RunDir | None
    hang_watch: HangWatch | None
    duty: DutyCycle
    evidence: EvidenceTier


class NodeMetrics:
    """Local rank 0's live figures for its node's ranks (see the module docstring).
    Inactive (every call returns at once) unless `metrics.port` is set and this is
    local rank 0."""

    def __init__(
        self,
        config: MetricsConfig,
        world: WorldInfo,
        source: MetricsSource,
        warn_once: Callable[..., None],
    ) -> None:
        self.config = config
        self.world = world
        self.source = source
        self._warn_once = warn_once
        self.active = config.port is not None and world.local_rank == 0
        self.ranks = node_ranks(world)
        self._lock = threading.Lock()
        self._buckets = [[0] * (len(_BOUNDS_MS) + 1) for _ in self.ranks]
        self._sum_ms = [0.0] * len(self.ranks)
        self._count = [0] * len(self.ranks)
        self._scores = [0.0] * len(self.ranks)
        self._anomalies: dict[tuple[str, str, str, str], int] = {}
        self._tracing_cost: float | None = None
        self._tracing_read_at = -math.inf
        self._previous: AnomalyRecord | None = None  # the last record, for `judge`
        self._server: MetricsServer | None = None
        # rank 0 listens to its journal; another node's leader keeps one of its own
        self._journal: AnomalyJournal | None = None
        if self.active and world.rank != 0:
            self._journal = AnomalyJournal(world.world_size, None)
            self._journal.listener = self._on_record

    @property
    def wants_evidence(self) -> bool:
        """Whether this rank must decode every rank's evidence of each round."""
        return self.active

    # -- the control thread --------------------------------------------------------------

    def after_round(self, result: RoundResult, judged: list[AnomalyJudgment]) -> None:
        """Fold one gathered round in (control thread); starts the server on the first."""
        if not self.active:
            return
        try:
            if self._server is None and not self._start():
                return
            self._fold(result, judged)
        except Exception as err:  # metrics step aside, training and detection go on
            self._warn_once("metrics", "metrics: internal error (%s); no more metrics", err)
            self.close()

    def _start(self) -> bool:
        assert self.config.port is not None
        try:
            self._server = MetricsServer.start(self.config.addr, self.config.port, self.snapshot)
        except ServeError as err:
            self._warn_once("metrics", "metrics: %s; training goes on without them", err)
            self.active = False
            return False
        log.debug("metrics: serving %s:%d/metrics", self.config.addr, self.config.port)
        return True

    def _fold(self, result: RoundResult, judged: list[AnomalyJudgment]) -> None:
        journal = self._journal
        if journal is None:  # rank 0: its journal, once it exists (it may step aside)
            shared = self.source.evidence.journal
            if shared is not None and shared.listener is None:
                shared.listener = self._on_record
        else:
            journal.add_judgments(judged)
            journal.add_times_many((sample.step, sample.times_ms) for sample in result.samples)
            journal.add_evidence(result.evidence)
        first, ranks = self.ranks.start, len(self.ranks)
        bounds, find = _BOUNDS_MS, bisect.bisect_left
        with self._lock:
            buckets, sums, counts = self._buckets, self._sum_ms, self._count
            for sample in result.samples:
                for at, ms in enumerate(sample.times_ms[first : first + ranks]):
                    if ms >= 0.0 and ms != math.inf:  # NaN (no duration) fails both
                        buckets[at][find(bounds, ms)] += 1
                        sums[at] += ms
                        counts[at] += 1
            scorer = self._scorer()
            if scorer is not None:
                self._scores = [scorer.window_score(rank) for rank in self.ranks]
        now = time.monotonic()
        if now - self._tracing_read_at >= TRACING_COST_EVERY_S:
            self._tracing_read_at = now
            report = self.source.duty.report()
            pct = None if report is None else report.get("effective_overhead_pct")
            self._tracing_cost = pct / 100.0 if isinstance(pct, (int, float)) else None

    def _scorer(self) -> StragglerScorer | None:
        journal = self._journal if self._journal is not None else self.source.evidence.journal
        return None if journal is None else journal.scorer

    def _on_record(self, record: AnomalyRecord) -> None:
        """A completed anomaly record (the journal's listener): counted by its verdict."""
        try:
            previous = self._previous
            if previous is not None and previous.step != record.step - 1:
                previous = None
            self._previous = record
            verdict = judge(record, previous)
            culprit = verdict.culprit_rank
            cause = verdict.cause if verdict.cause in CAUSES else "unknown"
            phase = phase_of(record)
            phase = phase if phase in PHASES else "unknown"
            if culprit is None:  # counted once in the job: by the node of rank 0
                if self.ranks.start != 0:
                    return
                key = (NO_CULPRIT, NO_CULPRIT, cause, phase)
            elif culprit in self.ranks:
                key = (str(culprit), str(culprit - self.ranks.start), cause, phase)
            else:
                return  # another node's rank: that node counts it
            with self._lock:
                self._anomalies[key] = self._anomalies.get(key, 0) + 1
        except Exception as err:
            self._warn_once("metrics-cause", "metrics: an anomaly not counted (%s)", err)

    # -- the server's thread -------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """The figures as they are now (read at each scrape, off the control thread)."""
        run = self.source.run
        hang_watch = self.source.hang_watch
        first = self.ranks.start
        with self._lock:
            steps = tuple(
                RankSteps(first + at, at, tuple(self._buckets[at]), self._sum_ms[at] / 1e3, n)
                for at, n in enumerate(self._count)
            )
            scores = tuple((first + at, at, s) for at, s in enumerate(self._scores))
            anomalies = tuple(sorted(self._anomalies.items()))
        return MetricsSnapshot(
            run="" if run is None else run.run_id,
            host=self.world.host,
            steps=steps,
            straggler_scores=scores,
            anomalies=anomalies,
            hang=hang_watch is not None and hang_watch.hung,
            tracing_cost_ratio=self._tracing_cost,
        )

    def close(self) -> None:
        """Stop serving (returns at once; the port is free within half a second)."""
        self.active = False
        server, self._server = self._server, None
        if server is not None:
            server.stop()
