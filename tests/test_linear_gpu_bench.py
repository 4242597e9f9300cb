"""Smoke test of benchmarks/linear_gpu.py: a --quick run on the CPU, without fla, end to end.

The GPU run happens once, on a lent machine with fla-core installed; here the script's own
parts run at toy sizes: attention_ref's chunked forms are judged (and pass) and timed, fla's rows
say it is not installed, and the JSON and the summary are written.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

BENCHMARK = "linear_gpu"  # the `bench` fixture (tests/conftest.py) loads benchmarks/linear_gpu.py


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed: its rows would run")
def test_quick_cpu_run_judges_our_chunked_forms_and_marks_fla_not_installed(bench, tmp_path, capsys):
    out = tmp_path / "x.json"
    assert bench.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "correctness, T = 64" in captured.err and "timing, T = 64" in captured.err
    assert "attention_ref.kimi_delta_attention   passed" in captured.out
    record = json.loads(out.read_text())
    prov = record["provenance"]
    assert "linear_gpu.py --quick --device cpu" in prov["command"] and prov["device_type"] == "cpu"
    assert prov["fla_status"] == "not installed" and "git_commit" in prov and "date" in prov
    assert (record["config"]["check_length"], record["config"]["dtype"]) == (64, "float32")
    for name in bench.OURS:
        row = record["correctness"][name]
        assert row["status"] == "passed", row
        assert row["message"] == "passed (output, final_state; bound='row')"
    timing = record["timing"]["64"]
    for name in bench.FLA:
        assert record["correctness"][name] == {"status": "not installed"}
        assert timing[name] == {"status": "not installed"}
    for name in bench.OURS:
        assert timing[name]["ms"] > 0 and timing[name]["tokens_per_s"] == pytest.approx(64 / (timing[name]["ms"] / 1e3))
        assert 1 <= len(timing[name]["warm_calls_ms"]) <= record["config"]["reps"]
    assert timing["ours_over_fla"] == {}


def test_worst_ratios_read_the_failure_message(bench):
    message = ("assert_linear_attention_close: 1 of 2 quantities out of bounds\n  output:\n"
               "    max|actual - reference|        = 3.0e-01\n"
               "    allowed: 2 * 5e-02 + 1e-06 = 1.5e-01 (5e-02: ...)\n"
               "  config: gated_delta_rule, q (1, 64, 2, 16)")
    assert bench.worst_ratios(message) == {"output": pytest.approx(2.0)}
