"""Smoke test of benchmarks/kv_cache_bench.py: a --quick run end to end, and its arithmetic.

The figures of a --quick run mean nothing (toy sizes on a shared machine); what is checked is
that the run writes every field it promises, that its medians, ratios, slope and verdicts follow
from the raw timings it records, and that the three timed computations give the same output.
"""

from __future__ import annotations

import json
import math
import statistics

BENCHMARK = "kv_cache_bench"  # the `bench` fixture (tests/conftest.py) loads benchmarks/kv_cache_bench.py


def test_loglog_slope_of_a_power_law(bench):
    xs = [512, 1024, 2048, 4096]
    assert math.isclose(bench.loglog_slope(xs, [3 * x for x in xs]), 1.0)
    assert math.isclose(bench.loglog_slope(xs, [x**2 / 7 for x in xs]), 2.0)
    assert math.isclose(bench.loglog_slope(xs, [5.0] * 4), 0.0, abs_tol=1e-12)


def test_quick_run_writes_consistent_results(bench, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "", "progress goes to stderr"
    assert "[1/3] prefix 16" in captured.err and "slope of recompute/cached" in captured.err
    record = json.loads(out.read_text())
    prov = record["provenance"]
    for key in ("date", "git_commit", "torch", "device", "torch_threads", "python", "platform"):
        assert key in prov, key
    assert "kv_cache_bench.py --quick" in prov["command"] and prov["device_type"] == "cpu"
    config = record["config"]
    assert config["quick"] is True and config["threads"] == prov["torch_threads"] == 1
    assert config["prefixes"] == [16, 32, 64] and config["block_size"] == 16
    assert [r["prefix"] for r in record["results"]] == [16, 32, 64]
    for r in record["results"]:
        assert r["tokens_in_cache"] == r["prefix"] + 1
        for name in ("cached", "paged", "recompute"):
            t = r["times"][name]
            assert len(t["per_call_s"]) == config["reps"] == 3
            assert t["median_s"] == statistics.median(t["per_call_s"]) > 0
            assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["calls_per_measurement"] >= 1
        med = {name: t["median_s"] for name, t in r["times"].items()}
        assert math.isclose(r["ratio_recompute_over_cached"], med["recompute"] / med["cached"])
        assert math.isclose(r["ratio_paged_over_cached"], med["paged"] / med["cached"])
        assert r["max_abs_diff"]["paged_vs_cached"] == 0.0  # the same numbers, gathered from blocks
        assert r["max_abs_diff"]["recompute_vs_cached"] < 1e-5  # float32, another matrix shape
    ratios = [r["ratio_recompute_over_cached"] for r in record["results"]]
    slope = record["slope"]
    assert slope["fit_prefixes"] == [16, 32, 64]
    assert math.isclose(slope["value"], bench.loglog_slope([16, 32, 64], ratios))
    assert slope["met"] == (0.8 <= slope["value"] <= 1.2) and slope["goal"] == [0.8, 1.2]
    worst = max(r["ratio_paged_over_cached"] for r in record["results"])
    assert record["paged"] == {"max_ratio_over_cached": worst, "goal": 1.5, "met": worst <= 1.5}
    assert record["load_before"]["loadavg_1_5_15"] and record["load_after"]["loadavg_1_5_15"]


def test_out_may_name_a_directory(bench, tmp_path):
    assert bench.main(["--quick", "--prefixes", "8", "--reps", "1", "--out", str(tmp_path)]) == 0
    written = list(tmp_path.glob("kv-cache-*.json"))
    assert len(written) == 1
    record = json.loads(written[0].read_text())
    assert record["slope"]["value"] is None and record["slope"]["met"] is False  # one prefix: no slope
