"""Tests of benchmarks/attention_bench.py: the grid it promises and tiny CPU runs end to end.

The GPU preset cannot run here; its grid is checked against the FlashAttention
benchmark's definition, ``--plan`` (which needs no GPU) is run on it, and the measuring
code runs on CPU at toy sizes (its figures are not looked at, only their consistency).
What a short GPU session relies on is held here: the ``flex`` backend (compiled once,
its block mask built outside the timing), the JSON rewritten after every configuration
and never half-written, ``--max-wall-s`` and SIGTERM stopping between configurations,
and the summary against the kernel's targets, printed last.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# Toy sizes: B = tokens // L = 2, H = 2, L = 48, D = 64 (the custom preset's default D).
TINY = ["--preset", "custom", "--device", "cpu", "--lengths", "48", "--heads", "2", "--tokens", "96",
        "--no-progress"]
# Importing torch's inductor (torch.compile) once per process warns about torch.jit.
INDUCTOR_IMPORT = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


BENCHMARK = "attention_bench"  # the `bench` fixture (tests/conftest.py) loads benchmarks/attention_bench.py


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
    argv = [*TINY, "--impls", "torch-sdpa", "tiled", "sdpa", "matmul-floor", "--repeats", "4", "--warmup", "1",
            "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["complete"] is True and record["configs_total"] == 4
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
        assert r["extra"]["first_call_s"] > 0  # the warmup call, timed alone
        spread = r["extra"]["ratio_per_round"]
        assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
        if r["impl"] == "torch-sdpa":
            assert r["ratio_to_torch_sdpa"] == 1.0 and spread["median"] == 1.0
    printed = capsys.readouterr().out
    assert "rounds q1-q3" in printed
    # One line per finished configuration, in order, with every backend that ran (short names).
    lines = [line for line in printed.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert lines[0].startswith("[1/4] D=64 L=48 noncausal fwd: torch ")
    assert lines[2].startswith("[3/4] D=64 L=48 causal fwd: torch ")
    assert "matmul-floor" in lines[0] and "matmul-floor" not in lines[1] and lines[1].count(" ms") == 3
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_cpu_preset_saves_each_stage(bench, tmp_path, monkeypatch):
    """The cpu preset's three stages at toy lengths (L = 32 for every configuration)."""
    run = bench.run_configs
    saved = []

    def tiny(configs, *args, on_config, **kwargs):
        def save():
            on_config()
            saved.append(sum(len(rows) for rows in json.loads(out.read_text())["cpu"].values()))

        configs = [dataclasses.replace(c, L=32, S=32) for c in configs]
        return run(configs, *args, on_config=save, **kwargs)

    monkeypatch.setattr(bench, "run_configs", tiny)
    out = tmp_path / "cpu.json"
    argv = ["--preset", "cpu", "--device", "cpu", "--modes", "fwd", "--repeats", "1", "--sweep-lengths", "32",
            "--no-progress", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["complete"] is True and "plan_estimate_s" not in record
    assert [len(record["cpu"][k]) for k in ("throughput", "sweep", "memory")] == [2 * 4, 2 * 3, 3]
    assert record["cpu"]["math_requirement"]["L"] == 32768
    # Saved after each configuration: the file grows by one configuration's rows at a time.
    assert saved == [4, 8, 11, 14, 17]


def test_tune_cpu_preset_runs(bench, tmp_path):
    out = tmp_path / "tune.json"
    argv = ["--preset", "tune-cpu", "--device", "cpu", "--tune-length", "32", "--tune-block-q", "16",
            "--tune-block-k", "16", "32", "--repeats", "1", "--no-progress", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["complete"] is True
    assert [(r["impl"], r["config"]["causal"], r["status"]) for r in record["tune"]] == [
        (impl, causal, "ok") for causal in (False, True) for impl in ("torch-sdpa", "tiled-16x16", "tiled-16x32")]


@pytest.mark.filterwarnings(INDUCTOR_IMPORT)
def test_flex_runs_on_cpu_in_custom_and_matches_torch(bench, tmp_path, monkeypatch):
    """flex: one compiled function, its causal block mask built once per configuration before any timed call."""
    from torch.nn.attention import flex_attention as flex_module

    built, seen_by_timer = [], []
    create = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **kw: built.append(a[3:5]) or create(*a, **kw))
    monkeypatch.setattr(bench, "_FLEX_BLOCK_MASKS", {})
    time_once = bench._time_once
    monkeypatch.setattr(bench, "_time_once",
                        lambda fn, device: seen_by_timer.append(len(built)) or time_once(fn, device))
    out = tmp_path / "flex.json"
    argv = [*TINY, "--impls", "torch-sdpa", "flex", "--causal", "yes", "--repeats", "3", "--warmup", "1",
            "--no-memory", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = {(r["impl"], r["config"]["mode"]): r for r in json.loads(out.read_text())["custom"]}
    flex = rows["flex", "fwd"]
    assert flex["status"] == "ok" and len(flex["times_s"]) == 3
    assert flex["extra"]["first_call_s"] > max(flex["times_s"])  # the compile, kept out of the median
    assert rows["flex", "fwd+bwd"]["status"] == "skipped: flex backward needs CUDA"
    assert built == [(48, 48)]  # once, for the causal configuration
    assert seen_by_timer and min(seen_by_timer) == 1  # built before the first timed call
    assert bench._compiled_flex() is bench._compiled_flex() and len(bench._FLEX) == 1

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 64, generator=gen) for _ in range(3))  # the shapes compiled above
    got = bench.IMPLS["flex"](q, k, v, True, None)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
    assert built == [(48, 48)]  # the cached block mask served the same shape again
    # Without causal, no block mask: full attention.
    assert bench._flex_block_mask(False, 48, 48, torch.device("cpu")) is None


def test_flex_skip_rules(bench):
    def reason(D, L, group="grid", mode="fwd", device="cuda", mask="none"):
        cfg = bench.Config(1, 2048 // D, L, L, D, True, mode, "bfloat16", group, mask)
        return bench._static_skip("flex", cfg, device, math.inf)

    assert reason(128, 4096) is None and reason(128, 16384, mode="fwd+bwd") is None
    for D, L in ((64, 8192), (128, 2048)):
        assert reason(D, L) == "skipped: flex only for D=128, L>=4096 in the gpu preset"
        assert reason(D, L, group="custom") is None  # custom runs it where it is named
    assert reason(128, 4096, group="custom", mode="fwd+bwd", device="cpu") == "skipped: flex backward needs CUDA"
    assert reason(128, 4096, mask="dense").startswith("skipped")


def _stop_at_second_config(bench, monkeypatch, out, seen, stop):
    """Patch the input maker: at the 2nd configuration, record the file as it is, then ``stop()``."""
    make = bench._inputs
    calls = []

    def inputs(cfg, device):
        calls.append(cfg)
        if len(calls) == 2:
            seen.append(json.loads(out.read_text()))  # the file between the 1st and 2nd configuration
            stop()
        return make(cfg, device)

    monkeypatch.setattr(bench, "_inputs", inputs)


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("stop", [_raise_keyboard_interrupt, lambda: os.kill(os.getpid(), signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_json_holds_every_finished_config_when_the_run_is_stopped(bench, tmp_path, monkeypatch, capsys, stop):
    out = tmp_path / "run.json"
    seen: list[dict] = []
    _stop_at_second_config(bench, monkeypatch, out, seen, stop)
    # A handler of the test's own while main is not running (instead of the default, which would end pytest).
    ignored = []

    def ours(signum, frame):
        ignored.append(signum)

    before = signal.signal(signal.SIGTERM, ours)
    try:
        argv = [*TINY, "--impls", "torch-sdpa", "tiled", "--modes", "fwd", "--repeats", "2", "--warmup", "0",
                "--no-memory", "--out", str(out)]
        try:
            status = bench.main(argv)
        except KeyboardInterrupt:
            pytest.fail("main let the interrupt through instead of saving and returning 130")
        assert status == 130
        assert ignored == []  # main's handler took the signal
        assert signal.getsignal(signal.SIGTERM) is ours  # and main put the test's back
    finally:
        signal.signal(signal.SIGTERM, before)
    for record in (seen[0], json.loads(out.read_text())):  # during the run, and after the stop
        assert record["complete"] is False and record["configs_total"] == 2
        rows = record["custom"]
        assert [(r["impl"], r["config"]["causal"], r["status"]) for r in rows] == [
            ("torch-sdpa", False, "ok"), ("tiled", False, "ok")]
        assert all(len(r["times_s"]) == 2 for r in rows)
        assert record["provenance"]["device_type"] == "cpu" and "load_after" in record
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left
    printed = capsys.readouterr().out
    assert "[1/2] D=64 L=48 noncausal fwd" in printed and "interrupted" in printed and "INCOMPLETE" in printed


def test_default_out_never_overwrites(bench, tmp_path, monkeypatch):
    """A split grid runs several calls a day: each gets its own default file name."""
    monkeypatch.setattr(bench, "REPO", tmp_path)
    first = bench._default_out(torch.device("cpu"), "custom")
    assert first.parent == tmp_path / "benchmarks" / "results" and first.name.startswith("cpu-custom-")
    first.parent.mkdir(parents=True)
    first.write_text("{}")
    second = bench._default_out(torch.device("cpu"), "custom")
    assert second.name == first.name.replace(".json", "-2.json")


def test_json_write_is_atomic(bench, tmp_path, monkeypatch):
    """A write that fails half way (a kill, a full disk) leaves the previous file whole."""
    out = tmp_path / "run.json"
    bench.write_json_atomic(out, {"custom": [1, 2], "complete": False})
    write_text = Path.write_text

    def half_then_fail(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        bench.write_json_atomic(out, {"custom": [1, 2, 3], "complete": True})
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"custom": [1, 2], "complete": False}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_max_wall_s_stops_before_a_config_that_would_not_fit(bench, tmp_path, monkeypatch, capsys):
    # The estimate says the causal configuration (the 2nd) takes 1e6 s, the other nothing.
    monkeypatch.setattr(bench, "plan_config_s", lambda cfg, *args, **kwargs: 1e6 if cfg.causal else 0.0)
    out = tmp_path / "run.json"
    argv = [*TINY, "--impls", "torch-sdpa", "--modes", "fwd", "--repeats", "2", "--warmup", "0", "--no-memory",
            "--max-wall-s", "100", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["complete"] is False
    assert [r["config"]["causal"] for r in record["custom"]] == [False]
    assert "stopped before [2/2] D=64 L=48 causal fwd" in capsys.readouterr().out


def test_plan_lists_configs_and_estimate_and_runs_nothing(bench, tmp_path, monkeypatch, capsys):
    def no_running(*args, **kwargs):
        raise AssertionError("--plan must not run anything")

    monkeypatch.setattr(bench, "run_configs", no_running)
    monkeypatch.setattr(bench, "_inputs", no_running)
    out = tmp_path / "never.json"
    assert bench.main(["--preset", "gpu", "--plan", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert list(tmp_path.iterdir()) == []
    config_lines = [line for line in printed if line.startswith("[")]
    assert len(config_lines) == 48 and config_lines[-1].startswith("[48/48] D=128 L=16384 causal fwd+bwd B=1 H=16")
    assert "skips flex" in config_lines[0] and "skips" not in config_lines[36]  # D=64 L=512; D=128 L=4096
    total = bench.plan(bench.gpu_configs(bench.argparse.Namespace(
        head_dims=None, lengths=None, tokens=16384, modes=["fwd", "fwd+bwd"], dtype=None, causal="both")),
        bench.GPU_IMPLS, repeats=20, warmup=5, memory=True)["total_s"]
    assert printed[-1].startswith(f"estimate: ~{total:.0f} s") and "rough" in printed[-1]

    # --impls, --causal, --head-dims, --lengths, --modes cut the gpu grid down.
    argv = ["--preset", "gpu", "--plan", "--head-dims", "128", "--lengths", "4096", "8192", "--causal", "yes",
            "--modes", "fwd", "--impls", "triton", "flex"]
    assert bench.main(argv) == 0
    config_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert config_lines == [line for line in config_lines if " causal fwd " in line and ": 2 backends;" in line]
    assert len(config_lines) == 2


def test_plan_model(bench):
    def cfg(L, causal=False, mode="fwd", D=128):
        return bench.Config(max(1, 16384 // L), 2048 // D, L, L, D, causal, mode, "bfloat16")

    def est(c, impls=("torch-sdpa-flash", "triton")):
        return bench.plan_config_s(c, list(impls), repeats=20, warmup=5, memory=True)

    assert est(cfg(4096)) < est(cfg(8192)) < est(cfg(16384))  # more FLOPs per call
    assert est(cfg(8192, causal=True)) < est(cfg(8192)) < est(cfg(8192, mode="fwd+bwd"))
    # flex: its compile is charged where it runs, nothing where the gpu preset skips it.
    assert est(cfg(4096), ["flex"]) - bench.PLAN_CONFIG_S > bench.PLAN_FIRST_CALL_S["flex"][0]
    assert est(cfg(2048), ["flex"]) == bench.PLAN_CONFIG_S
    # Per call: FLOPs over the assumed rate plus the fixed cost, 26 calls.
    c = cfg(8192)
    per_call = c.flops() / (bench.PLAN_TFLOPS["torch-sdpa-flash"][0] * 1e12) + bench.PLAN_CALL_S
    assert math.isclose(bench.plan_impl_s("torch-sdpa-flash", c, repeats=20, warmup=5, memory=True), 26 * per_call)
    # The whole: the start-up of the process plus each configuration.
    configs = [cfg(4096), cfg(8192, causal=True)]
    p = bench.plan(configs, ["triton", "flex"], repeats=20, warmup=5, memory=True)
    assert math.isclose(p["total_s"], bench.PLAN_STARTUP_S + sum(est(c, ["triton", "flex"]) for c in configs))
    assert math.isclose(sum(p["by_impl_s"].values()), p["total_s"] - bench.PLAN_STARTUP_S - 2 * bench.PLAN_CONFIG_S)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_preset_refuses_without_cuda(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--preset", "gpu", "--out", str(tmp_path / "x.json")])
    assert "needs a CUDA device" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def _row(bench, impl, ms, D=128, L=4096, mode="fwd", causal=False, dtype="bfloat16"):
    cfg = bench.Config(max(1, 16384 // L), 2048 // D, L, L, D, causal, mode, dtype)
    return bench.Result(cfg, impl, time_s=None if ms is None else ms / 1e3)


def test_target_summary_on_hand_made_rows(bench, tmp_path, capsys):
    rows = [
        # D=128 L=4096 fwd: triton 1.1x flash (met) but 0.7x cuDNN (the fastest: not met).
        *(_row(bench, impl, ms) for impl, ms in (("triton", 1.0), ("torch-sdpa-flash", 1.1), ("torch-sdpa-cudnn", 0.7),
                                                 ("torch-sdpa-efficient", 2.0), ("torch-sdpa", 0.8))),
        # D=128 L=8192 causal fwd+bwd: 0.85x flash, met (that mode has no goal against the fastest).
        _row(bench, "triton", 10.0, L=8192, causal=True, mode="fwd+bwd"),
        _row(bench, "torch-sdpa-flash", 8.5, L=8192, causal=True, mode="fwd+bwd"),
        _row(bench, "torch-sdpa-cudnn", 5.0, L=8192, causal=True, mode="fwd+bwd"),
        # Not target rows: D=64, L=2048, float16.
        _row(bench, "triton", 1.0, D=64), _row(bench, "torch-sdpa-flash", 2.0, D=64),
        _row(bench, "triton", 1.0, L=2048), _row(bench, "triton", 1.0, L=16384, dtype="float16"),
        # A target row without flash: not measured.
        _row(bench, "triton", 3.0, L=16384), _row(bench, "torch-sdpa", 3.0, L=16384),
        # No triton row: no summary row.
        _row(bench, "torch-sdpa-flash", 1.0, L=16384, causal=True),
    ]
    summary = bench.target_summary(rows)
    by = {(r["D"], r["L"], r["causal"], r["mode"], r["dtype"]): r for r in summary["rows"]}
    assert len(by) == 6
    fwd = by[128, 4096, False, "fwd", "bfloat16"]
    assert math.isclose(fwd["vs_flash"], 1.1) and math.isclose(fwd["vs_fastest"], 0.7)
    assert fwd["fastest"] == "torch-sdpa-cudnn" and math.isclose(fwd["fastest_ms"], 0.7)
    assert fwd["target"] and fwd["goals"] == {"vs_flash": True, "vs_fastest": False} and fwd["verdict"] == "not met"
    bwd = by[128, 8192, True, "fwd+bwd", "bfloat16"]
    assert math.isclose(bwd["vs_flash"], 0.85) and bwd["goals"] == {"vs_flash": True} and bwd["verdict"] == "met"
    for key in ((64, 4096, False, "fwd", "bfloat16"), (128, 2048, False, "fwd", "bfloat16"),
                (128, 16384, False, "fwd", "float16")):
        assert not by[key]["target"] and by[key]["verdict"] == "-" and by[key]["goals"] == {}
    assert math.isclose(by[64, 4096, False, "fwd", "bfloat16"]["vs_flash"], 2.0)
    missing = by[128, 16384, False, "fwd", "bfloat16"]
    assert missing["vs_flash"] is None and missing["goals"] == {"vs_flash": None, "vs_fastest": True}
    assert missing["verdict"] == "not measured"
    assert (summary["target_rows"], summary["met"], summary["not_met"], summary["not_measured"]) == (3, 1, 1, 1)
    assert summary["targets"] == {"fwd": {"vs_flash": 1.0, "vs_fastest": 0.8}, "fwd+bwd": {"vs_flash": 0.8}}
    text = bench.format_targets(summary).splitlines()
    # --summarize: the same table from result files, here the rows split over two (two calls of a split grid).
    for i, part in enumerate((rows[:5], rows[5:])):
        bench.write_json_atomic(tmp_path / f"part{i}.json", {"grid": part})
    assert bench.main(["--summarize", str(tmp_path / "part0.json"), str(tmp_path / "part1.json")]) == 0
    assert capsys.readouterr().out.splitlines() == text
    assert ">= 1.0x flash, >= 0.8x fastest" in text[0] and "fwd+bwd: triton >= 0.8x flash" in text[0]
    assert any(line.startswith(" 128   4096 no") and line.endswith("not met (fastest)") for line in text)
    assert text[-1] == "targets: 1 of 3 target rows met (1 not met, 1 not measured)"


def test_targets_printed_last_and_stored(bench, tmp_path, monkeypatch, capsys):
    """Through main on CPU, with stand-ins for the CUDA-only backends (triton: ours, flash: torch's default)."""
    monkeypatch.setitem(bench.IMPLS, "triton", bench.IMPLS["sdpa"])
    monkeypatch.setitem(bench.IMPLS, "torch-sdpa-flash", bench.IMPLS["torch-sdpa"])
    monkeypatch.setattr(bench, "GPU_ONLY", set())
    monkeypatch.setattr("attention_ref.triton_flash.is_available", lambda device: True)
    out = tmp_path / "run.json"
    argv = [*TINY, "--impls", "torch-sdpa", "torch-sdpa-flash", "triton", "--modes", "fwd", "--repeats", "2",
            "--warmup", "0", "--no-memory", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    record = json.loads(out.read_text())
    times = {(r["impl"], r["config"]["causal"]): r["time_s"] for r in record["custom"]}
    rows = record["targets"]["rows"]
    assert [r["causal"] for r in rows] == [False, True] and record["targets"]["target_rows"] == 0
    for r in rows:
        assert math.isclose(r["vs_flash"], times["torch-sdpa-flash", r["causal"]] / times["triton", r["causal"]])
        fastest = min(times["torch-sdpa-flash", r["causal"]], times["torch-sdpa", r["causal"]])
        assert math.isclose(r["vs_fastest"], fastest / times["triton", r["causal"]])
    assert printed[-1] == "targets: no target rows in these results"
    assert printed[-5].startswith("targets (bfloat16, D=128, L>=4096)") and printed[-6].startswith("wrote ")
    # --summarize reads the file back and prints the same table.
    assert bench.main(["--summarize", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == printed[-5:]


def test_a_fast_but_wrong_backend_is_flagged(bench, tmp_path, capsys, monkeypatch):
    """Forward configs check every backend's output against torch's; a wrong one is named in the line."""
    right = bench.IMPLS["tiled"]
    monkeypatch.setitem(bench.IMPLS, "tiled", lambda q, k, v, causal, mask: right(q, k, v, causal, mask) * 1.1)
    out = tmp_path / "run.json"
    argv = [*TINY, "--impls", "torch-sdpa", "tiled", "sdpa", "--modes", "fwd", "--repeats", "2", "--warmup", "1",
            "--no-memory", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["custom"]
    assert rows and all(r["config"]["mode"] == "fwd" for r in rows)
    for r in rows:
        check = r["extra"]["output_check"]
        assert check["against"] == "torch-sdpa"
        if r["impl"] == "tiled":
            assert math.isclose(check["rel_error"], 0.1, rel_tol=1e-3)
        else:
            assert check["rel_error"] < 1e-5
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert lines and all("tiled" in line and "WRONG OUTPUT" in line and line.count("WRONG") == 1 for line in lines)


def test_the_commit_comes_from_the_caller_where_the_tree_has_no_git(bench, monkeypatch):
    """The device machine gets a copy of the working tree, with no .git or a stale one: the caller's
    ATTENTION_REF_GIT_COMMIT wins over git when set."""
    monkeypatch.delenv("ATTENTION_REF_GIT_COMMIT", raising=False)
    assert bench._commit()["git_commit_from"] == "git" and len(bench._commit()["git_commit"]) == 40
    monkeypatch.setenv("ATTENTION_REF_GIT_COMMIT", "0123abc")
    head = bench._commit()["git_head_in_copy"]  # a stale .git in the copy is recorded, not believed
    assert len(head) == 40 and bench._commit()["git_commit"] == "0123abc"
    monkeypatch.setattr(bench, "_git", lambda *cmd: None)
    assert bench._commit() == {"git_commit": "0123abc", "git_dirty": None, "git_commit_from": "ATTENTION_REF_GIT_COMMIT",
                               "git_head_in_copy": None}
    monkeypatch.delenv("ATTENTION_REF_GIT_COMMIT")
    assert bench._commit()["git_commit"] is None and "unknown" in bench._commit()["git_commit_from"]
