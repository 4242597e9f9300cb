"""benchmarks/gpu_session.py, the steps of a GPU session, run here under Triton's interpreter.

The GPU steps cannot run on this machine; their code can, at toy sizes, on CPU tensors under
Triton's interpreter (``--device cpu``). What is checked is what a short device call depends
on: each configuration of the sweep computes attention correctly (so a wrong configuration
plumbing would show), the records are written whole under ``--out``, the summary is printed,
and a step that needs CUDA refuses clearly instead of measuring the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _run(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@needs_triton
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_every_swept_configuration_computes_attention(tmp_path, pass_):
    toy = ["--device", "cpu", "--dtype", "float32", "--head-dim", "16", "--length", "48", "--heads", "2",
           "--tokens", "96", "--warps", "4", "--stages", "1"]
    if pass_ == "fwd":
        toy += ["--block-m", "32", "--block-n", "16", "32", "--tma", "0"]
    else:
        toy += ["--block-n1", "16", "32", "--block-m1", "16", "--tma", "0"]
    proc = _run("sweep", "--pass", pass_, *toy, out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / f"sweep-{pass_}.json").read_text())
    assert record["shape"] == {"B": 2, "H": 2, "L": 48, "S": 48, "D": 16, "dtype": "float32"}
    rows = record["rows"]
    assert len(rows) == 2 * 2  # two configurations, causal and not
    swept = {tuple(r["config"][1:2] if pass_ == "fwd" else r["config"][5:6]) for r in rows}
    assert swept == {(16,), (32,)}
    for row in rows:
        assert "error" not in row, row
        assert row["rel_error"] < 1e-5, row  # output (and dq, dk, dv) against float64
        assert row["ms"] > 0 and row["TFLOP_per_s"] > 0
    assert "best causal:" in proc.stdout and "best full:" in proc.stdout


@needs_triton
def test_the_forward_sweep_tries_tensor_descriptor_loads(tmp_path):
    toy = ["--device", "cpu", "--dtype", "float32", "--head-dim", "16", "--length", "40", "--heads", "1",
           "--tokens", "40", "--warps", "4", "--stages", "1", "--block-m", "32", "--block-n", "16", "--causal", "yes"]
    proc = _run("sweep", *toy, out=tmp_path)  # --tma defaults to both
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep-fwd.json").read_text())["rows"]
    assert [r["config"][10] for r in rows] == [False, True]
    assert all(r["rel_error"] < 1e-5 for r in rows), rows
    assert " tma " in proc.stdout
    proc = _run("sweep", "--pass", "bwd", *toy[:-6], "--block-n1", "32", "--block-m1", "16", "--causal", "no",
                out=tmp_path)  # the backward kernels with and without descriptors, gradients checked
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep-bwd.json").read_text())["rows"]
    assert [r["config"][10] for r in rows] == [False, True]
    assert all(r["rel_error"] < 1e-5 for r in rows), rows


@needs_triton
def test_probe_records_versions_and_one_kernel_call(tmp_path):
    proc = _run("probe", "--device", "cpu", out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "probe.json").read_text())
    prov = record["provenance"]
    assert prov["torch"] == torch.__version__ and prov["python"] and prov["git_commit"]
    assert prov["command"].startswith("python benchmarks/gpu_session.py --out ") and " probe --device cpu" in prov["command"]
    assert record["kernel_smoke"]["rel_error_vs_float64"] < 1e-5
    assert "kernel smoke" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("step", [["tests"], ["probe"], ["sweep"]])
def test_steps_that_need_cuda_refuse_without_it(tmp_path, step):
    proc = _run(*step, out=tmp_path)
    assert proc.returncode == 2
    assert "needs CUDA (torch.cuda.is_available() is False)" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written
