"""Smoke test of benchmarks/threads_bench.py at toy sizes: the record's parts and its goal, not its figures."""

from __future__ import annotations

import json

import pytest

BENCHMARK = "threads_bench"  # the `bench` fixture (tests/conftest.py) loads benchmarks/threads_bench.py


def test_a_tiny_run_records_both_parts_and_each_calls_own_choice(bench, tmp_path):
    assert bench.main(["--pairs", "3", "--busy-rounds", "1", "--length", "128", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("threads-*.json")
    record = json.loads(path.read_text())
    quiet = record["quiet"]
    assert set(quiet["threads_per_call"]) == {"all_threads", "adapted", "adapted_before"}
    assert all(len(calls) == 3 for calls in quiet["threads_per_call"].values())
    assert len(quiet["all_over_adapted"]["per_round"]) == 3 and "met" in quiet["goal"]
    busy = record["one_core_busy"]
    assert set(busy["tiled_throughput_vs_sdpa"]) == {"all_threads", "adapted", "adapted_before"}
    assert record["provenance"]["command"].startswith("python benchmarks/threads_bench.py")


def test_a_bad_count_is_named(bench):
    with pytest.raises(SystemExit):
        bench.main(["--pairs", "0"])
