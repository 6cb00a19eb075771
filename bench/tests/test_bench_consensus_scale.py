"""bench/consensus_scale.py on a small world: a round's parts are timed, the row stays
O(1) per rank, and the planted late rank is found by the straggler scoring."""

from __future__ import annotations

from bench.tests.scripts import load_bench_script


def test_simulated_rounds_find_the_late_rank() -> None:
    script = load_bench_script("consensus_scale")
    small = script.simulate(world=16, batch=2, rounds=30)
    large = script.simulate(world=64, batch=2, rounds=30)
    assert small["row_floats"] == large["row_floats"]  # O(1) per rank
    assert large["gathered_bytes_per_rank"] == 64 * large["row_bytes"]
    assert set(large["median_ms_per_round"]) == {
        "encode", "gather", "decode", "decode_rank0", "decide", "journal"
    }  # fmt: skip
    assert large["straggler_found"][:1] == [63]
