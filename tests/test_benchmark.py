"""Tests of benchmarks/attention_bench.py: the grid it promises and a tiny CPU run end to end.

The GPU preset cannot run here; its grid is checked against the FlashAttention
benchmark's definition, and the measuring code runs on CPU at toy sizes (its
figures are not looked at, only their consistency).
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("attention_bench", ROOT / "benchmarks" / "attention_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_gpu_grid_is_the_flash_attention_grid(bench):
    args = bench.argparse.Namespace(head_dims=None, lengths=None, tokens=16384, modes=["fwd", "fwd+bwd"], dtype=None)
    configs = bench.gpu_configs(args)
    assert {c.D for c in configs} == {64, 128}
    assert {c.L for c in configs} == {512, 1024, 2048, 4096, 8192, 16384}
    for c in configs:
        assert c.H * c.D == 2048 and c.B * c.L == 16384 and c.S == c.L and c.dtype == "bfloat16"
    assert len(configs) == 2 * 6 * 2 * 2  # D x L x causal x mode, each once
    assert {(c.causal, c.mode) for c in configs} == {(a, m) for a in (False, True) for m in ("fwd", "fwd+bwd")}


def test_flop_formula(bench):
    cfg = bench.Config(B=2, H=3, L=5, S=7, D=11, causal=False, mode="fwd", dtype="float32")
    assert cfg.flops() == 4 * 2 * 3 * 5 * 7 * 11
    causal_bwd = bench.Config(B=2, H=3, L=5, S=7, D=11, causal=True, mode="fwd+bwd", dtype="float32")
    assert causal_bwd.flops() == cfg.flops() / 2 * 3.5  # causal halves; backward is 2.5x forward


def test_tiny_cpu_run_writes_consistent_results(bench, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--preset", "custom", "--device", "cpu", "--lengths", "48", "--heads", "2", "--tokens", "96",
            "--impls", "torch-sdpa", "tiled", "sdpa", "matmul-floor", "--repeats", "4", "--warmup", "1",
            "--no-progress", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    prov = record["provenance"]
    assert prov["device_type"] == "cpu" and prov["torch"] and prov["date"] and "attention_bench" in prov["command"]
    rows = record["custom"]
    assert len(rows) == 4 * 2 * 2  # impls x causal x mode
    for r in rows:
        c = r["config"]
        assert (c["B"], c["H"], c["L"], c["D"]) == (2, 2, 48, 64)
        if r["impl"] == "matmul-floor" and c["mode"] == "fwd+bwd":
            assert r["status"].startswith("skipped") and r["time_s"] is None
            continue
        assert r["status"] == "ok", r
        assert len(r["times_s"]) == 4 and r["time_s"] == statistics.median(r["times_s"])
        flops = 4 * 2 * 2 * 48 * 48 * 64 / (2 if c["causal"] else 1) * (3.5 if c["mode"] == "fwd+bwd" else 1)
        assert math.isclose(r["tflops"], flops / r["time_s"] / 1e12)
        assert r["peak_bytes"] > 0
        spread = r["extra"]["ratio_per_round"]
        assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
        if r["impl"] == "torch-sdpa":
            assert r["ratio_to_torch_sdpa"] == 1.0 and spread["median"] == 1.0
    assert "rounds q1-q3" in capsys.readouterr().out
