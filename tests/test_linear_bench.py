"""Smoke test of benchmarks/linear_bench.py: a --quick run end to end, and its arithmetic.

The figures of a --quick run mean nothing (toy sizes on a shared machine); what is checked is
that the run writes every field it promises, that its medians, ratios, verdicts and crossover
lengths follow from the raw timings it records, and that the three timed implementations of
the gated delta rule give the same output.
"""

from __future__ import annotations

import json
import math
import statistics

BENCHMARK = "linear_bench"  # the `bench` fixture (tests/conftest.py) loads benchmarks/linear_bench.py


def test_crossover_interpolates_on_the_log_log_scale(bench):
    xs = [100, 200, 400, 800]
    # a = x^2 / 400, b = x: equal at x = 400 exactly, a measured point
    assert math.isclose(bench.crossover(xs, [x * x / 400 for x in xs], xs), 400.0)
    # a = x^2 / 300, b = x: equal at x = 300, between 200 and 400; both are powers, so exact
    assert math.isclose(bench.crossover(xs, [x * x / 300 for x in xs], xs), 300.0)
    assert bench.crossover(xs, [5.0] * 4, [1.0] * 4) == 100.0  # a >= b from the start
    assert bench.crossover(xs, [1.0] * 4, [5.0] * 4) is None  # never


def _check_times(times: dict, names: tuple[str, ...], reps: int) -> dict[str, float]:
    assert set(times) == set(names)
    for t in times.values():
        assert len(t["per_call_s"]) == reps
        assert t["median_s"] == statistics.median(t["per_call_s"]) > 0
        assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["calls_per_measurement"] >= 1
        assert len(t["per_call_cpu_s"]) == reps and t["median_cpu_s"] == statistics.median(t["per_call_cpu_s"])
    return {name: t["median_s"] for name, t in times.items()}


def test_quick_run_writes_consistent_results(bench, tmp_path, capsys):
    out = tmp_path / "linear.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "", "progress goes to stderr"
    assert "headline, 1 thread(s): T = 256" in captured.err and "recurrent_over_chunked" in captured.err
    assert "[1/3] crossover L = 32" in captured.err
    record = json.loads(out.read_text())
    prov = record["provenance"]
    for key in ("date", "git_commit", "torch", "transformers", "device", "torch_threads", "python", "platform"):
        assert key in prov, key
    assert "linear_bench.py --quick" in prov["command"] and prov["device_type"] == "cpu"
    config = record["config"]
    assert config["quick"] is True and config["threads"] == [prov["torch_threads"]] == [1]
    assert (config["T"], config["H"], config["E"], config["reps"]) == (256, 2, 16, 2)
    assert config["chunk_sizes"] == [8, 16]

    head = record["headline"]
    assert head["T"] == 256 and [r["threads"] for r in head["runs"]] == [1]
    assert head["flops"]["recurrent"] == bench.flops(256, 2, 16, 16) == 7 * 16 * 16 * 256 * 2
    (run,) = head["runs"]
    names = ("chunked_8", "chunked_16", "transformers", "recurrent")
    med = _check_times(run["times"], names, config["reps"])
    cpu = {name: t["median_cpu_s"] for name, t in run["times"].items()}
    assert run["peak_matmul_gflops"] > 0
    for C in (8, 16):
        name = f"chunked_{C}"
        ratios = run["ratios"][name]
        assert math.isclose(ratios["recurrent_over_chunked"], med["recurrent"] / med[name])
        assert math.isclose(ratios["chunked_over_transformers"], med[name] / med["transformers"])
        assert math.isclose(run["cpu_time_ratios"][name]["recurrent_over_chunked"], cpu["recurrent"] / cpu[name])
        goals = run["goals"][name]
        assert goals["recurrent_over_chunked"]["met"] == (ratios["recurrent_over_chunked"] >= 5)
        assert goals["chunked_over_transformers"]["met"] == (ratios["chunked_over_transformers"] <= 2)
        assert head["flops"][name] == bench.flops(256, 2, 16, 16, C)
        at_peak = head["flops"][name] / (run["peak_matmul_gflops"] * 1e9)  # seconds, were all of it matmul
        assert math.isclose(run["ceiling"][name], med["recurrent"] / at_peak)
        # the same layer three ways, float32
        assert run["max_abs_diff"][f"{name}_vs_recurrent"] < 1e-5
    assert run["max_abs_diff"]["transformers_vs_recurrent"] < 1e-5

    cross = record["crossover"]
    assert [r["L"] for r in cross["rows"]] == config["lengths"] == [32, 64, 128]
    names = ("gated_delta_rule_chunked", "softmax_sdpa_math")
    for r in cross["rows"]:
        _check_times(r["times"], names, config["reps"])
        assert set(r["peak_bytes"]) == set(names) and all(b > 0 for b in r["peak_bytes"].values())
    Ls = config["lengths"]
    series = {n: [r["times"][n]["median_s"] for r in cross["rows"]] for n in names}
    assert cross["time_L"] == bench.crossover(Ls, series["softmax_sdpa_math"], series["gated_delta_rule_chunked"])
    peaks = {n: [r["peak_bytes"][n] for r in cross["rows"]] for n in names}
    assert cross["memory_L"] == bench.crossover(Ls, peaks["softmax_sdpa_math"], peaks["gated_delta_rule_chunked"])
    assert record["load_before"]["loadavg_1_5_15"] and record["load_after"]["loadavg_1_5_15"]

    kda = record["kda"]
    assert (kda["T"], kda["H"], kda["E"]) == (128, 2, 16) and [r["threads"] for r in kda["runs"]] == [1]
    (run,) = kda["runs"]
    names = ("gated_delta_rule_chunked", "kimi_delta_attention_chunked")
    med = _check_times(run["times"], names, config["reps"])
    assert math.isclose(run["ratio_kda_over_gated_delta_rule"], med[names[1]] / med[names[0]])
    assert run["goal"]["met"] == (run["ratio_kda_over_gated_delta_rule"] <= 2)
    assert run["max_abs_diff"]["kimi_delta_attention_chunked_vs_recurrent"] < 1e-5
    assert "kda, 1 thread(s): T = 128" in captured.err


def test_flops_count_the_forms(bench):
    # one token, one head, E = Ev = 1: the recurrence does 7 operations; a chunk of C = 2
    # tokens: 6*4 + 4*4 + 2*8/3 + 6*2 + 1 for the chunk, i.e. half of it per token
    assert bench.flops(1, 1, 1, 1) == 7
    assert math.isclose(bench.flops(2, 1, 1, 1, 2), 24 + 16 + 16 / 3 + 12 + 1)
    # the state's pass dominates at E = Ev = 128: the chunked form does more arithmetic than the loop
    assert bench.flops(8192, 8, 128, 128, 64) > bench.flops(8192, 8, 128, 128, 32) > bench.flops(8192, 8, 128, 128)


def test_out_may_name_a_directory_and_parts_be_chosen(bench, tmp_path):
    assert bench.main(["--quick", "--parts", "crossover", "--lengths", "16", "--reps", "1",
                       "--out", str(tmp_path)]) == 0
    written = list(tmp_path.glob("linear-*.json"))
    assert len(written) == 1
    record = json.loads(written[0].read_text())
    assert "headline" not in record and [r["L"] for r in record["crossover"]["rows"]] == [16]
