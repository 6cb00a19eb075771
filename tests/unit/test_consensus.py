from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distanom.config import CaptureConfig, DetectConfig
from distanom.consensus import (
    FLAG_CAPTURE_OFF,
    CaptureRequest,
    LocalRound,
    decide,
    decode_round,
    encode_round,
)
from distanom.control_status import recent_times
from distanom.detect import Detector, StepSample
from distanom.rounds import RoundBuilder


def gathered(rows: list[LocalRound], batch: int) -> torch.Tensor:
    return torch.stack([encode_round(row, batch) for row in rows])


def test_round_trip_of_a_gathered_matrix() -> None:
    request = CaptureRequest(3, 2, ((1, 1), (3, 4)))
    rows = [
        LocalRound(5, (10.0, 11.0, 12.0), (1, 1 | 2, 0), 0, request),
        LocalRound(5, (10.5, math.nan, 30.0), (1, 1, 1 | 4), FLAG_CAPTURE_OFF),
    ]
    result = decode_round(gathered(rows, 4), 4)
    assert [s.step for s in result.samples] == [5, 6, 7]
    assert result.samples[0].times_ms == (10.0, 10.5)
    assert math.isnan(result.samples[1].times_ms[1])
    assert [s.traced for s in result.samples] == [True, True, False]  # AND across ranks
    assert [s.after_flush for s in result.samples] == [False, True, False]  # OR across ranks
    assert [s.disturbed for s in result.samples] == [False, False, True]
    assert [s.self_ms for s in result.samples] == [0.0, 0.0, 0.0]
    assert result.request == request
    assert result.ranks_with(FLAG_CAPTURE_OFF) == [1]
    assert request.ranks(4) == (1, 3)  # rank 4 does not exist in a 4-rank job


def test_malformed_rows_are_refused() -> None:
    matrix = gathered([LocalRound(1, (1.0,), (1,))], 2)
    with pytest.raises(ValueError, match="shape"):
        decode_round(matrix, 3)
    matrix[0, 0] = 1.0
    with pytest.raises(ValueError, match="malformed"):
        decode_round(matrix, 2)
    with pytest.raises(ValueError):
        encode_round(LocalRound(1, (1.0, 2.0, 3.0), (1, 1, 1)), 2)


def test_requests_schedule_the_steps_after_the_round() -> None:
    detector = Detector(DetectConfig(min_steps=3, window_steps=10), CaptureConfig())
    request = CaptureRequest(9, 2, ((0, 0),))
    rows = [
        LocalRound(10, (5.0, 5.0), (1, 1), 0, request),
        LocalRound(10, (5.0, 5.0), (1, 1)),
    ]
    decisions = decide(decode_round(gathered(rows, 2), 2), detector, world_size=2)
    assert [(d.step, d.kind, d.ranks, d.request_id) for d in decisions] == [
        (16, "requested", (0,), "9"),
        (17, "requested", (0,), "9"),
    ]


def test_requests_start_after_the_furthest_training_loop() -> None:
    # The gathered steps lag the training loops (GPU-paced timing, slow rounds): a
    # request must not be scheduled for steps a rank has already passed.
    detector = Detector(DetectConfig(min_steps=3, window_steps=10), CaptureConfig())
    request = CaptureRequest(4, 1, ((0, 1),))
    rows = [
        LocalRound(10, (5.0, 5.0), (1, 1), 0, request, host_step=13),
        LocalRound(10, (5.0, 5.0), (1, 1), host_step=30),
    ]
    result = decode_round(gathered(rows, 2), 2)
    assert result.host_steps == (13, 30)
    decisions = decide(result, detector, world_size=2)
    assert [d.step for d in decisions] == [35]  # 30 + 1 + REQUEST_LEAD_STEPS


def test_round_builder_fills_gaps_with_nan_and_keeps_order() -> None:
    builder = RoundBuilder(batch_steps=3)
    builder.add(1, 10.0, 1)
    builder.add(2, 11.0, 1)
    assert not builder.ready()
    builder.add(4, 13.0, 0)  # step 3's boundary was lost
    assert builder.ready()
    first = builder.take()
    assert first.first_step == 1 and first.durations_ms[:2] == (10.0, 11.0)
    assert math.isnan(first.durations_ms[2])
    assert not builder.ready() and builder.pending_steps() == 1
    last = builder.take(final=True)
    assert last.first_step == 4 and last.durations_ms == (13.0,) and last.step_flags == (0,)
    builder.add(7, 9.0, 4, 3.5)
    assert builder.take(final=True).self_ms == (3.5,)


def test_recent_times_per_rank() -> None:
    rows = [LocalRound(1, (1.0, 2.0), (1, 1)), LocalRound(1, (3.0, math.nan), (1, 1))]
    samples = decode_round(gathered(rows, 2), 2).samples
    assert recent_times(samples, 1) == {0: [2.0], 1: [None]}


def test_evidence_rides_in_the_round_per_rank_and_lagging() -> None:
    from distanom.consensus import evidence_slots
    from distanom.records.anomalies import StepEvidence

    builder = RoundBuilder(2)
    builder.add_evidence([(s, StepEvidence(float(s), 1, 0.5, 0.0)) for s in range(1, 9)])
    builder.add(1, 10.0, 0)
    builder.add(2, 10.0, 0)
    first = builder.take()
    assert [s for s, _ in first.evidence] == list(range(1, 1 + evidence_slots(2)))
    sent = StepEvidence(7.0, 2, 1.0, 0.25, 9.0)
    other = LocalRound(1, (10.0, 11.0), (0, 0), evidence=((3, sent),))
    result = decode_round(gathered([first, other], 2), 2)
    assert result.evidence is not None
    items = result.evidence.items()
    by_rank = {(rank, step): ev for rank, step, ev in items}
    assert by_rank[(0, 5)].arrive_ms == 5.0 and by_rank[(1, 3)] == sent
    assert len(items) == evidence_slots(2) + 1
    assert [s for s, _ in builder.take().evidence] == [6, 7, 8]
    with pytest.raises(ValueError):
        encode_round(
            LocalRound(1, (1.0,), (0,), evidence=((1, StepEvidence()), (3, StepEvidence()))), 2
        )


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 6),
    ranks=st.lists(
        st.tuples(
            st.integers(0, 6),  # steps this rank sent (cut to the batch)
            st.lists(st.one_of(st.floats(0.1, 1e4), st.just(math.nan)), min_size=6, max_size=6),
            st.lists(st.integers(0, 7), min_size=6, max_size=6),  # STEP_* bits
            st.lists(st.floats(0.0, 50.0), min_size=6, max_size=6),  # self_ms
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_small_worlds_decode_from_lists_exactly_as_from_tensor_columns(
    batch: int, ranks: list[tuple[int, list[float], list[int], list[float]]]
) -> None:
    from distanom import consensus

    rows = [
        LocalRound(40, tuple(times[: min(n, batch)]), tuple(bits[: min(n, batch)]),
                   self_ms=tuple(own[: min(n, batch)]))
        for n, times, bits, own in ranks
    ]  # fmt: skip
    matrix = gathered(rows, batch)
    start = consensus.HEADER + consensus.RANGE_SLOTS
    small = consensus._samples_of_rows(
        matrix[:, start : start + 3 * batch].tolist(), matrix[:, 2].tolist(), 40, batch
    )
    wide = consensus._samples_of_matrix(matrix, 40, batch)
    assert_same_samples(small, wide)
    assert_same_samples(list(decode_round(matrix, batch).samples), small)


def assert_same_samples(first: list, second: list) -> None:
    assert [s.step for s in first] == [s.step for s in second]
    for a, b in zip(first, second, strict=True):
        assert all(_same(x, y) for x, y in zip(a.times_ms, b.times_ms, strict=True))
        assert (a.traced, a.after_flush, a.disturbed) == (b.traced, b.after_flush, b.disturbed)
        assert a.self_ms == pytest.approx(b.self_ms)


def test_requests_lead_by_time_on_short_steps() -> None:
    from distanom.consensus import REQUEST_LEAD_MS, REQUEST_LEAD_STEPS, lead_steps

    assert lead_steps(None) == lead_steps(float("nan")) == REQUEST_LEAD_STEPS
    assert lead_steps(100.0) == REQUEST_LEAD_STEPS  # long steps: 4 steps are 400 ms
    assert lead_steps(0.5) == REQUEST_LEAD_MS / 0.5  # 100 steps of 0.5 ms: 50 ms
    detector = Detector(DetectConfig(min_steps=3, window_steps=10, warmup_steps=0), CaptureConfig())
    rows = [LocalRound(1, (0.5,) * 8, (1,) * 8), LocalRound(1, (0.5,) * 8, (1,) * 8)]
    decide(decode_round(gathered(rows, 8), 8), detector, world_size=2)
    assert detector.median_ms == 0.5
    request = CaptureRequest(4, 1)
    rows = [
        LocalRound(9, (0.5,), (1,), 0, request, host_step=20),
        LocalRound(9, (0.5,), (1,), host_step=30),
    ]
    decisions = decide(decode_round(gathered(rows, 8), 8), detector, world_size=2)
    assert [d.step for d in decisions if d.kind == "requested"] == [30 + 1 + 100]


@given(
    batch=st.integers(1, 6),
    ranks=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 6), st.just(math.nan)),  # count as sent
            st.lists(st.one_of(st.floats(0.1, 1e4), st.just(math.nan)), min_size=18, max_size=18),
            st.lists(st.one_of(st.integers(0, 15), st.just(math.nan)), min_size=6, max_size=6),
            st.lists(
                st.one_of(st.floats(-5.0, 50.0), st.sampled_from([math.nan, math.inf, -0.0])),
                min_size=6,
                max_size=6,
            ),
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_samples_of_rows_by_columns_match_the_per_step_path(
    batch: int, ranks: list[tuple[float, list[float], list[float], list[float]]]
) -> None:
    """The column-wise decode gives exactly (repr-equal) the samples of the step-by-step
    loop, for any counts within the round, flags and own work (NaN, inf, -0.0)."""
    from distanom import consensus

    rows = [
        times[:batch] + [float(b) for b in bits[:batch]] + own[:batch]
        for _, times, bits, own in ranks
    ]
    counts_f = [float(min(n, batch)) if not math.isnan(n) else n for n, *_ in ranks]
    counts = [int(c) if math.isfinite(c) else 0 for c in counts_f]
    got = consensus._samples_of_rows(rows, counts_f, 40, batch)
    expected = consensus._samples_of_rows_per_step(rows, counts, 40, batch)
    assert repr(got) == repr(expected)


def test_step_sample_of_fields_is_the_constructed_sample() -> None:
    made = StepSample.of_fields(3, (1.0, math.nan), True, False, True, 0.5)
    built = StepSample(3, (1.0, math.nan), traced=True, after_flush=False, disturbed=True,
                       self_ms=0.5)  # fmt: skip
    assert repr(made) == repr(built) and vars(made) == vars(built)
    assert list(vars(made)) == list(vars(built))  # same field order
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.step = 4  # type: ignore[misc]


def test_round_builder_add_many_is_add_per_step() -> None:
    """Steps out of order, repeated, already sent or ahead: the same rounds either way."""
    steps = [(3, 3.0, 1, 0.0), (1, 1.0, 0, 0.5), (2, 2.0, 2, 0.0), (2, 2.5, 3, 0.1),
             (9, 9.0, 1, 0.0), (5, math.nan, 0, 0.0), (1, 7.0, 1, 0.0)]  # fmt: skip
    one, many = RoundBuilder(4), RoundBuilder(4)
    for batch in (steps[:3], steps[3:], [(0, 1.0, 0, 0.0), (12, 1.0, 1, 0.0)]):
        for step in batch:
            one.add(*step)
        many.add_many(batch)
        assert (many.missing(3), many.pending_steps()) == (one.missing(3), one.pending_steps())
        assert repr(many.take(3)) == repr(one.take(3))


def _encode_round_as_lists(local: LocalRound, batch: int) -> list[float]:
    """The row as `encode_round` built it from a plain list (before its `array` rows)."""
    from distanom.consensus import HEADER, RANGE_SLOTS, evidence_slots, row_length

    n = len(local.durations_ms)
    row = [math.nan] * row_length(batch)
    request = local.request
    ranges = request.ranges if request is not None else ()
    row[:HEADER] = [
        7011.0,
        float(local.first_step),
        float(n),
        float(local.flags),
        float(request.number) if request else 0.0,
        float(local.host_step),
        float(request.n_steps) if request else 0.0,
        float(len(ranges)),
    ]
    for slot, (lo, hi) in enumerate(ranges):
        row[HEADER + 2 * slot : HEADER + 2 * slot + 2] = [float(lo), float(hi)]
    start = HEADER + RANGE_SLOTS
    if n:
        row[start : start + n] = [float(d) for d in local.durations_ms]
        row[start + batch : start + batch + n] = [float(f) for f in local.step_flags]
        own = local.self_ms or (0.0,) * n
        row[start + 2 * batch : start + 2 * batch + n] = [float(o) for o in own]
    items = local.evidence
    assert len(items) <= evidence_slots(batch)
    base = start + 3 * batch
    row[base : base + 2] = [float(items[0][0]) if items else -1.0, float(len(items))]
    values = [float(v) for _, ev in items for v in ev.as_fields()]
    row[base + 2 : base + 2 + len(values)] = values
    return row


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 6),
    n=st.integers(0, 6),
    first=st.integers(1, 10**9),
    durations=st.lists(st.one_of(st.floats(0.1, 1e4), st.just(math.nan)), min_size=6, max_size=6),
    bits=st.lists(st.integers(0, 7), min_size=6, max_size=6),
    own=st.one_of(st.just(()), st.lists(st.floats(0.0, 50.0), min_size=6, max_size=6)),
    flags=st.integers(0, 7),
    host=st.integers(-1, 10**9),
    request=st.one_of(
        st.none(),
        st.builds(
            CaptureRequest,
            st.integers(1, 1000),
            st.integers(0, 50),
            st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=8).map(tuple),
        ),
    ),
    evidence=st.tuples(st.integers(0, 9), st.integers(1, 10**6), st.floats(0.0, 1e3)),
    gap=st.booleans(),
)
def test_encode_round_writes_the_row_the_list_form_did(
    batch: int,
    n: int,
    first: int,
    durations: list[float],
    bits: list[int],
    own: tuple[float, ...] | list[float],
    flags: int,
    host: int,
    request: CaptureRequest | None,
    evidence: tuple[int, int, float],
    gap: bool,
) -> None:
    from distanom.records.anomalies import StepEvidence

    n = min(n, batch)
    count, ev_first, value = evidence
    last = count - 1 if gap and count > 1 else count  # a gap before the last step
    steps = [ev_first + k + (k >= last) for k in range(count)]
    items = tuple(
        (s, StepEvidence(value + k, k - 1, math.nan if k % 3 else value, 0, value * 2))
        for k, s in enumerate(steps)
    )
    local = LocalRound(
        first, tuple(durations[:n]), tuple(bits[:n]), flags, request,
        tuple(own[:n]), host_step=host, evidence=items,
    )  # fmt: skip
    if (gap and count > 1) or count > batch + 3:
        with pytest.raises(ValueError):
            encode_round(local, batch)
        return
    row = encode_round(local, batch)
    assert row.dtype == torch.float64 and row.shape == (len(_encode_round_as_lists(local, batch)),)
    want = _encode_round_as_lists(local, batch)
    assert all(_same(a, b) for a, b in zip(row.tolist(), want, strict=True))


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 6),
    ranks=st.lists(
        st.tuples(
            st.integers(0, 6),  # steps this rank sent (cut to the batch)
            st.lists(st.one_of(st.floats(0.1, 1e4), st.just(math.nan)), min_size=6, max_size=6),
            st.lists(st.integers(0, 7), min_size=6, max_size=6),  # STEP_* bits
            st.integers(-1, 10**6),  # host step
            st.integers(0, 9),  # evidence steps sent
        ),
        min_size=1,
        max_size=4,
    ),
    request=st.one_of(st.none(), st.builds(CaptureRequest, st.integers(1, 9), st.integers(0, 3))),
    with_evidence=st.booleans(),
)
def test_rows_as_lists_decode_as_the_gathered_matrix(
    batch: int,
    ranks: list[tuple[int, list[float], list[int], int, int]],
    request: CaptureRequest | None,
    with_evidence: bool,
) -> None:
    """A small world's round gathered as lists (`encode_row`, `all_gather_rows`) decodes
    to the same result as the tensor matrix (`encode_round`, `all_gather`)."""
    from distanom.consensus import decode_rows, encode_row
    from distanom.records.anomalies import StepEvidence

    rows = []
    for rank, (n, times, bits, host, sent) in enumerate(ranks):
        n = min(n, batch)
        evidence = tuple(
            (7 + k, StepEvidence(1.0 + k, k, math.nan, 0.5, 2.0))
            for k in range(min(sent, batch + 3))
        )
        rows.append(
            LocalRound(3, tuple(times[:n]), tuple(bits[:n]), rank, request if rank == 0 else None,
                       tuple(times[:n]), host_step=host, evidence=evidence)
        )  # fmt: skip
    as_lists = [encode_row(row, batch).tolist() for row in rows]
    assert repr(as_lists) == repr([encode_round(row, batch).tolist() for row in rows])
    want = decode_round(gathered(rows, batch), batch, with_evidence=with_evidence)
    got = decode_rows(as_lists, batch, with_evidence=with_evidence)
    assert repr(got) == repr(want)
    with pytest.raises(ValueError):
        decode_rows([*as_lists, as_lists[0][:-1]], batch, with_evidence=with_evidence)
