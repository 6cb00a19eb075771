"""The agent's control thread (`distanom-control`): everything that can block.

Forms distanom's group, joins the run directory (`run_join`) and writes run.json, then
loops: takes the `StepRecord`s the training thread queued (with a deferred event clock,
made at the take), appends them to this rank's steps file (`step_log`), gathers rounds
of step times across ranks, feeds the duty cycle, decides captures and hands them to
the capture worker, polls and answers on-demand requests and rewrites status.json (rank
0). Without consensus (setup failed, a rank gone) it keeps draining the queue so the
training thread never fills memory. State it shares with the training thread lives in
`Health` and `DutyCycle`.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from pathlib import Path

from distanom.boundary import FINAL, StepBoundaries
from distanom.capture import CaptureWorker
from distanom.config import Config
from distanom.consensus import (
    FLAG_CAPTURE_OFF,
    FLAG_FINAL,
    FLAG_MORE_EVIDENCE,
    REQUEST_LEAD_STEPS,
    SMALL_WORLD,
    LocalRound,
    RoundResult,
    decide,
    decode_round,
    decode_rows,
    encode_round,
    encode_row,
    lead_steps,
)
from distanom.control_status import agent_cost, status_body, tracer_report
from distanom.detect import CaptureDecision, Detector, StepSample, floor_threshold
from distanom.duty_cycle import DutyCycle
from distanom.errors import RunDirError
from distanom.evidence import EvidenceTier
from distanom.hang import HangWatch
from distanom.health import Health
from distanom.inbox import StepInbox
from distanom.log_lines import HEADLINE
from distanom.metrics import NodeMetrics
from distanom.pacing import RoundPacer
from distanom.records.run_info import build_run_info, runtime_versions, write_run_info
from distanom.records.status import TracerReport, write_status
from distanom.request_desk import RequestDesk
from distanom.rounds import RoundBuilder, RoundSizer
from distanom.run_join import Place, join_run, read_places
from distanom.run_median import RunMedian
from distanom.rundir import RunDir
from distanom.side_link import SideSteps
from distanom.world import AgentGroup, GroupUnavailableError, WorldInfo

log = logging.getLogger(__name__)

RECENT_STEPS = 64
STEPS_FLUSH_S = 1.0  # the steps file is flushed at most this often while training runs
# The control thread wakes once its part of the next round is in, and otherwise when the
# next periodic task is due (steps-file flush, rank 0's request poll and status write, a
# Flight Recorder read), at most this long apart and at least WAKE_MIN_S apart.
WAKE_EVERY_S = 1.0
WAKE_MIN_S = 0.05
# A Flight Recorder read due sooner than this does not wake the thread on its own: the
# old fixed 0.2 s wake-up, so at most 5 reads a second between rounds (each converts the
# whole buffer).
EVIDENCE_WAKE_MIN_S = 0.2
DRAIN_WAKE_AT = 256  # without consensus: steps queued before the drain wakes early
# ranks that ended first are announced once this rank trains past them, or after this
# long without ending itself (ranks ending together, a moment apart, are not news)
PEERS_ENDED_QUIET_S = 5.0
FINAL_ROUND_TIMEOUT_S = 10.0
# After the final round, rounds that carry only the evidence left (every rank runs one
# more while any rank said it has more): at most this many.
MAX_EVIDENCE_ROUNDS = 64


class ControlLoop:
    """One per rank; see the module docstring. `start` runs it on its own thread."""

    def __init__(
        self,
        config: Config,
        world: WorldInfo,
        run_base: Path,
        argv: list[str],
        *,
        health: Health,
        duty: DutyCycle,
        boundaries: StepBoundaries,
        inbox: StepInbox,
    ) -> None:
        self.config = config
        self.world = world
        self.run_base = run_base
        self.argv = argv
        self.health = health
        self.duty = duty
        self.boundaries = boundaries  # read only: the step in progress, the tracer
        self.inbox = inbox
        self.detector = Detector(config.detect, config.capture)
        self.run_steps = RunMedian()  # the base of the own-cost figure (`own_cost`)
        self.run: RunDir | None = None
        self.group: AgentGroup | None = None
        self._warn_once = health.warn_once
        self._outcome = ("finished", 0)  # how the script ended: the run's last state
        self._recent: collections.deque[StepSample] = collections.deque(maxlen=RECENT_STEPS)
        self._gathered_step = -1
        self.requests = RequestDesk(world.world_size, health.warn_write_failed)  # used on rank 0
        # steps/rank<R>.csv, once the run directory is known: written by the side process
        self.step_log = SideSteps(health, world.label, use_side=config.control.side_process)
        self._started_at = time.time()
        self._round_began = time.monotonic()  # when the latest round started waiting
        self.evidence = EvidenceTier(boundaries.evidence_marks, world.world_size, health)
        self._thread = threading.Thread(target=self._main, name="distanom-control", daemon=True)
        self.hang_watch: HangWatch | None = None  # told when a round fails
        self.rounds = 0  # rounds run
        # pauses between a round's phases, where they are needed; the work since the
        # last pause is charged to the step it stalled, as the next pause begins
        self.pacer = RoundPacer(charge=self._charge)
        self._cpu_ns = 0  # this (control) thread's CPU time, as last read on it
        self._cpu_setup_ns = 0  # of which forming the group and the run directory
        self.phases_charged = 0  # control work heavy enough to be charged to a training step
        # rounds some rank ended early (its steps slowed down): counted from the gathered
        # flags, so every rank's count is the job's, whichever rank's slowdown woke first
        self.early_rounds = 0
        self._peers_last_step: int | None = None  # ranks ended first: their last step
        self._peers_ended_at = 0.0
        self._sizer = RoundSizer(config.consensus, config.tracer)
        # with a tracer, a slowdown ends a long round early: it is traced a few steps in
        self._end_rounds_early = config.tracer.backend != "none"
        self.metrics = NodeMetrics(config.metrics, world, self, health.warn_once)  # local rank 0

    # -- life cycle (called from the training thread) ----------------------------------

    def start(self) -> None:
        """Start the control thread."""
        self._thread.start()

    def is_alive(self) -> bool:
        """Whether the control thread is still running."""
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the control thread to finish."""
        self._thread.join(timeout_s)

    def set_outcome(self, state: str, exit_code: int) -> None:
        """How the script ended (finished, failed, interrupted), for the last status."""
        self._outcome = (state, exit_code)

    def close(self) -> None:
        """Release the group (only once the thread has finished), the steps file, metrics."""
        self.metrics.close()
        if self.group is not None and not self._thread.is_alive():
            self.group.close()
        self.step_log.close()

    # -- the thread --------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._setup()
        except (GroupUnavailableError, RunDirError, OSError, RuntimeError) as err:
            self.health.consensus_error = f"setup failed: {err}"
            self._warn_once(
                "setup", "distanom: %s; capture steps aside", self.health.consensus_error
            )
            self._drain_until_final()
            return
        self._cpu_ns = self._cpu_setup_ns = time.thread_time_ns()
        finished = False
        try:
            finished = self._round_loop()  # False: other ranks ended first
        except GroupUnavailableError as err:
            self.health.consensus_error = str(err)
            if self.hang_watch is not None:
                self.hang_watch.round_timed_out(str(err), time.monotonic() - self._round_began)
            self._warn_once(
                "consensus",
                "consensus: %s (a rank gone or too slow); capture steps aside",
                err,
            )
        except Exception as err:
            self.health.consensus_error = f"internal error: {err}"
            log.exception("consensus: internal error; capture steps aside")
        if not finished:
            self._drain_until_final()
        capture = self.health.capture
        if capture is not None:
            ended = self.boundaries.current_step - 1  # no boundary comes after this
            capture.close(self.config.analysis.exit_timeout_s, last_ended_step=ended)
        if self.world.rank == 0:
            self.evidence.close(self.run)
            self._write_status(self._outcome[0])

    def _drain_until_final(self) -> None:
        """Without consensus: keep consuming the inbox (the training thread must never fill
        memory) and keep the status fresh until training ends."""
        next_status = 0.0
        self.inbox.wake_at = DRAIN_WAKE_AT
        while True:
            # training's end may be taken already, by a round loop that failed after it
            items = [] if self.inbox.ended else self.inbox.take(1.0)
            ended = self.inbox.ended
            self.step_log.write([item for item in items if item is not FINAL])
            self._say_peers_ended(ended)
            if ended:
                return
            self._cpu_ns = time.thread_time_ns()
            now = time.monotonic()
            if self.world.rank == 0 and now >= next_status:
                next_status = now + self.config.control.status_interval_s
                self.step_log.flush()
                self._write_status("running")

    def _setup(self) -> None:
        config, world = self.config, self.world
        self.group = AgentGroup(
            world,
            setup_timeout_s=config.consensus.setup_timeout_s,
            op_timeout_s=config.consensus.timeout_s,
        )
        run_id, run = join_run(self.group, world, self.run_base, config.run.name, self.health)
        self.duty.seed_probes(run_id)  # the same on every rank, whatever its own run dir
        if run is None:
            return
        try:
            self.step_log.open(run.steps_csv(world.rank))
        except OSError as err:
            self.health.capture_off(f"{run.path}: not writable ({err.strerror})")
            return
        self.run = run
        self.health.run_dir = run.path
        if world.rank == 0:
            self._write_run_json(read_places(self.group, world.world_size))
            self.evidence.open_journal(run)

    def _write_run_json(self, places: list[Place]) -> None:
        if self.run is None:
            return
        info = build_run_info(
            run_id=self.run.run_id,
            versions=runtime_versions(),
            world_size=self.world.world_size,
            started_at=self._started_at,
            argv=self.argv,
            config=self.config.model_dump(mode="json"),
            hosts=[place.host for place in places],
            node_ranks=[place.node_rank for place in places],
        )
        try:
            write_run_info(self.run, info)
        except OSError as err:
            self.health.capture_off(f"{self.run.run_json}: cannot write ({err.strerror})")

    def _round_loop(self) -> bool:
        """Rounds until this rank's training ends (True) or another rank's (False)."""
        builder = RoundBuilder(self._sizer.batch_steps)
        control = self.config.control
        next_poll = next_status = next_flush = 0.0
        final = False
        while not final:
            # sleep until this rank's part of the next round is in (or a poll is due):
            # one wake-up per round, not per step
            self.inbox.wake_at = max(1, builder.missing(self._round_steps(builder)))
            due = [next_flush]
            if self.world.rank == 0:
                due += [next_poll, next_status]
            items = self.inbox.take(self._sleep_s(due))
            records = [item for item in items if item is not FINAL]
            final = final or len(records) != len(items)
            gathered_before = self._gathered_step
            self.pacer.begin(self.detector.median_ms, self._round_steps(builder), final=final)
            if records:  # by columns: no tuple made per step (zip reuses its result)
                steps, durations, flags, own, gc_ms, *_ = zip(*records, strict=True)
                builder.add_many(zip(steps, durations, flags, own, strict=True))
                self.run_steps.add_many(durations)
                self.evidence.add_gc_many(zip(steps, gc_ms, strict=True))
            self.step_log.write(records)
            self.pacer.pause()
            builder.add_evidence(self.evidence.poll(final))  # a Flight Recorder read: a phase
            self.pacer.mark()
            now = time.monotonic()
            if now >= next_flush or final:  # a write per second, not per round
                next_flush = now + STEPS_FLUSH_S
                self.step_log.flush()
            if self.world.rank == 0 and now >= next_poll:
                next_poll = now + control.poll_interval_s
                self.requests.poll(self.run)
            # a slowdown on this rank: what it has goes now, not a long round late
            early = self.inbox.took_urgent and not final and builder.pending_steps() > 0
            # the round size follows the median, which each round may move
            while early or builder.ready(self._round_steps(builder)):
                n = self._round_steps(builder)
                local = builder.take(n, early=early and not builder.ready(n))
                early = False
                result = self._run_round(local, final=False, builder=builder)
                ended = result.ranks_with(FLAG_FINAL)
                if ended:  # another rank's training is over: it joins no round after these
                    self._last_rounds(builder, result)
                    last = max(result.host_steps[r] for r in ended)
                    self._peers_ended(ended, max(result.last_step, self._gathered_step), last)
                    self.pacer.end(steps=0)  # charges the pass's last work
                    return False
            if final:
                # every rank runs one final round, so the others learn this one is done;
                # the last steps' evidence rides in it and the rounds after it
                result = self._run_round(
                    builder.take(self._round_steps(builder), final=True),
                    final=True,
                    builder=builder,
                )
                self._last_rounds(builder, result)
            self._cpu_ns = time.thread_time_ns()
            if self.world.rank == 0 and (now >= next_status or final):
                next_status = now + control.status_interval_s
                self.pacer.mark()  # the status write is a phase of its own
                self._write_status("running")
            self.pacer.end(steps=self._gathered_step - gathered_before)
        return True

    def _sleep_s(self, due: list[float]) -> float:
        """How long the round loop may sleep: until the soonest of `due` (monotonic
        times) or of the next Flight Recorder read, within WAKE_MIN_S..WAKE_EVERY_S."""
        now = time.monotonic()
        soonest = min(due, default=math.inf)
        evidence = self.evidence.next_read_at()
        soonest = min(soonest, max(evidence, now + EVIDENCE_WAKE_MIN_S))
        return min(WAKE_EVERY_S, max(WAKE_MIN_S, soonest - now))

    def _last_rounds(self, builder: RoundBuilder, result: RoundResult) -> None:
        """After a round some rank sent as its final one: the rounds that carry the
        evidence left, as long as any rank says it has more (every rank runs the same
        number, decided from the same gathered flags)."""
        self.pacer.stop()  # training is over somewhere: nothing to pace for, exit soon
        for _ in range(MAX_EVIDENCE_ROUNDS):
            if not result.ranks_with(FLAG_MORE_EVIDENCE):
                return
            round_ = builder.take(self._round_steps(builder), final=True)
            result = self._run_round(round_, final=True, builder=builder)

    def _peers_ended(self, ranks: list[int], step: int, their_last: int) -> None:
        """Ranks ended their training before this one: consensus ends here, training
        goes on (capture steps aside: no rank could join a capture decision). Said at
        INFO later (`_say_peers_ended`)."""
        who = ", ".join(str(rank) for rank in ranks[:8]) + (" ..." if len(ranks) > 8 else "")
        self.health.consensus_error = (
            f"consensus ended: rank {who} ended its training first (steps gathered up to {step})"
        )
        log.debug("%s (their last step %d)", self.health.consensus_error, their_last)
        self._peers_last_step = their_last
        self._peers_ended_at = time.monotonic()

    def _say_peers_ended(self, ending: bool) -> None:
        """The line `_peers_ended` held back, once this rank has trained past the ended
        ranks' last step, or has not ended for PEERS_ENDED_QUIET_S (it may be stuck in a
        collective they left: the line is then what explains the hang). A rank ending
        first at the same step ended with this one: then nothing is said, and the final
        status has no consensus error."""
        last = self._peers_last_step
        if last is None:
            return
        waited = time.monotonic() - self._peers_ended_at > PEERS_ENDED_QUIET_S
        if self.boundaries.current_step > last + 1 or (waited and not ending):
            self._peers_last_step = None
            log.info(
                "%s; this rank trains on without detection",
                self.health.consensus_error,
                extra=HEADLINE,
            )
        elif ending:  # the ranks ended together: no consensus error in the final status
            self._peers_last_step = None
            self.health.consensus_error = None

    def own_cost(self) -> dict[str, object]:
        """What distanom itself costs this rank per step, measured live (`agent_cost`)."""
        cpu_ns = max(0, self._cpu_ns - self._cpu_setup_ns)
        # the run's median, not the detector's window's: the figures are the run's means
        median = self.run_steps.median_ms() or self.detector.median_ms
        return agent_cost(
            self.boundaries, cpu_ns, median, self.pacer, self.early_rounds, self.step_log
        )

    def _round_steps(self, builder: RoundBuilder | None = None) -> int:
        """Steps the next round covers (the same on every rank: `RoundSizer`)."""
        first = None if builder is None else builder.next_first
        return self._sizer.steps(first, self.detector.median_ms, self.duty)

    def _run_round(
        self, local: LocalRound, *, final: bool, builder: RoundBuilder | None = None
    ) -> RoundResult:
        """One round, gathered from every rank and acted on."""
        assert self.group is not None
        self.rounds += 1
        flags = (FLAG_FINAL if final else 0) | local.flags  # FLAG_EARLY from `take`
        if final and builder is not None and builder.evidence_backlog():
            flags |= FLAG_MORE_EVIDENCE
        if self.health.capture_stepped_aside():
            flags |= FLAG_CAPTURE_OFF
        offered = self.requests.offered if self.world.rank == 0 else None
        local = LocalRound(
            local.first_step,
            local.durations_ms,
            local.step_flags,
            flags,
            offered[0] if offered else None,
            local.self_ms,
            host_step=self.boundaries.current_step,
            evidence=local.evidence,
            room=local.room,
        )
        # the row holds the round's agreed length: a 16-step round next to a traced step
        # gathers 16 steps' room from every rank, not batch_steps'
        batch = local.room
        timeout = None
        if final:
            timeout = min(self.config.consensus.timeout_s, FINAL_ROUND_TIMEOUT_S)
        with_evidence = self.world.rank == 0 or self.metrics.wants_evidence
        if self.world.world_size <= SMALL_WORLD:  # as lists: no torch call per round at one rank
            row = encode_row(local, batch)
            self._round_began = time.monotonic()
            rows = self.group.all_gather_rows(row, timeout_s=timeout)
            result = decode_rows(rows, batch, with_evidence=with_evidence)
        else:
            row_tensor = encode_round(local, batch)
            self._round_began = time.monotonic()
            matrix = self.group.all_gather(row_tensor, timeout_s=timeout)
            result = decode_round(matrix, batch, with_evidence=with_evidence)
        if offered is not None:
            self.requests.carried()
        if builder is not None and not final:  # a rank may have ended the round early
            builder.settle(local, len(result.samples), bool(result.ranks_with(FLAG_FINAL)))
        if result.cut_early:
            self.early_rounds += 1
        self._after_round(result)  # its phases are charged by the pacer
        return result

    def _charge(self, spent_ns: int) -> None:
        """Charge heavy control work done since the pacer's last pause (the steps file's
        rows, a Flight Recorder read, a round's gather and decisions, the evidence fold, a
        status write; its CPU time, not wall time: waiting for the gather or for the GIL
        takes nothing from the training thread) to the step it overlapped, like capture
        work: holding the GIL, it slowed the training thread about as long, and such a
        step must not be judged on it. Heavy: a quarter of the median step (a step is
        anomalous from at least half of it over the median at the default multiplier),
        or 1 ms before a median exists."""
        median = self.detector.median_ms
        heavy_ms = median / 4 if median is not None and math.isfinite(median) else 1.0
        if spent_ns >= heavy_ms * 1e6:
            self.health.control_busy_ns += spent_ns
            self.phases_charged += 1

    def _after_round(self, result: RoundResult) -> None:
        self._recent.extend(result.samples)
        self._feed_governor(result)
        self._gathered_step = max(self._gathered_step, result.last_step)
        decisions = decide(result, self.detector, self.world.world_size)
        median = self.detector.median_ms
        if self._end_rounds_early and median is not None and math.isfinite(median):
            # steps over this, several in a row, end a round early (`StepInbox.put_step`)
            detect = self.config.detect  # the threshold without its fence
            self.inbox.slow_ms = floor_threshold(detect, median, detect.multiplier)
        self.duty.request([d.step for d in decisions if d.kind == "requested"])
        if result.request is not None and self.world.rank == 0:
            self.requests.answer(self.run, result.request, decisions)
        self._submit_captures(decisions)
        # paused only after the decisions are out: a captured step must still be in the
        # tracer's history when the capture worker looks for it
        self.pacer.pause()
        self._fold_evidence(result)
        self.pacer.pause()

    def _submit_captures(self, decisions: list[CaptureDecision]) -> None:
        if not decisions or self.run is None or self.health.capture_off_reason is not None:
            return
        capture = self.health.capture
        if capture is None:
            tracer = self.boundaries.tracer
            if tracer is None:
                self.health.capture_off("no tracer is running")
                return
            capture = CaptureWorker(
                self.run,
                self.world,
                tracer,
                self.config,
                tracer_name=tracer.name,
                warn=self.health.warn_write_failed,
            )
            self.health.capture = capture
        capture.submit(decisions)

    def _feed_governor(self, result: RoundResult) -> None:
        try:
            self.duty.record(result.samples)
        except ValueError as err:
            self._warn_once("governor", "governor: %s; tracing stays as it is", err)
            self.duty.disable()

    # -- evidence (rank 0 keeps the anomaly journal) -----------------------------------

    def _fold_evidence(self, result: RoundResult) -> None:
        may_trace = not self.requests.busy() and self.boundaries.tracer is not None
        judged = self.detector.take_anomalies()
        furthest = max((result.last_step, *result.host_steps))
        # the planner leads by REQUEST_LEAD_STEPS itself; on short steps, lead by more
        extra = lead_steps(self.detector.median_ms) - REQUEST_LEAD_STEPS
        self.duty.plan(judged, result.last_step, furthest + extra)
        straggler = self.evidence.fold(judged, result, may_trace=may_trace)
        self.metrics.after_round(result, judged)  # after the journal's fold: its records
        if straggler is not None:  # worth one trace on every rank: it is late then too
            number = self.requests.offer_own(1, f"straggler-{straggler.rank}")
            log.info(
                "straggler: rank %d since step %d; tracing one step on every rank (request %d)",
                straggler.rank,
                straggler.since_step,
                number,
                extra=HEADLINE,  # as worth a line as a capture
            )

    # -- status (rank 0) ---------------------------------------------------------------

    def tracer_report(self) -> TracerReport:
        """Backend, duty cycle and measured overhead, for the status file."""
        return tracer_report(self.boundaries, self.duty)

    def _write_status(self, state: str) -> None:
        if self.run is None or self.health.run_dir_gone:
            return
        stragglers = self.evidence.write_stragglers(self.run)  # scores for the file and here
        try:
            body = status_body(
                state,
                run=self.run,
                world_size=self.world.world_size,
                config=self.config,
                boundaries=self.boundaries,
                duty=self.duty,
                detector=self.detector,
                health=self.health,
                stragglers=stragglers,
                recent_samples=list(self._recent),
                gathered_step=self._gathered_step,
                exit_code=self._outcome[1],
                own_cost=self.own_cost(),
            )
            write_status(self.run, body)
        except (OSError, ValueError) as err:
            self.health.warn_write_failed("status", "status file not written (%s)", err)
