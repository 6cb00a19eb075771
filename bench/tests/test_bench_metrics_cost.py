"""bench/metrics_cost.py on a small node: both roles are timed and count what they must
(the planted anomalies are blamed on rank 1, so on rank 0's node alone)."""

from __future__ import annotations

from bench.tests.scripts import load_bench_script


def test_both_roles_are_timed_and_count_the_planted_anomalies() -> None:
    script = load_bench_script("metrics_cost")
    rank0 = script._time_role(world=4, local=2, rank=0, steps=10, rounds=20)
    other = script._time_role(world=4, local=2, rank=2, steps=10, rounds=20)
    assert rank0["median_us_per_round"] > 0 and other["median_us_per_round"] > 0
    assert rank0["anomalies_counted"] >= 3  # steps 50..200: rank 1's, on node 0
    assert other["anomalies_counted"] == 0
    scrape = script._time_scrape(local=2, repeats=3)
    assert scrape["bytes"] > 0
