"""The test suite's device switch (tests/conftest.py): ``--device`` and ``ATTENTION_REF_TEST_DEVICE``.

On a machine without CUDA, asking for cuda must stop the run with a usage error, never
fall back to the CPU quietly (a GPU run that tested the CPU would report a pass it never
earned). The GPU run itself is part of the GPU session (issue 12): ``--device cuda``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_tiled.py", "-k", "hand_computable",
         *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, **(env or {})),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: asking for it is fine")
@pytest.mark.parametrize("how", ["option", "environment"])
def test_asking_for_cuda_without_it_stops_the_run(how):
    proc = _pytest("--device", "cuda") if how == "option" else _pytest(env={"ATTENTION_REF_TEST_DEVICE": "cuda"})
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "--device cuda: torch.cuda.is_available() is False here" in proc.stderr


def test_an_unknown_device_is_named():
    proc = _pytest("--device", "tpu")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--device must be one of ('cpu', 'cuda'), got 'tpu'" in proc.stderr


def test_cpu_is_accepted_explicitly():
    proc = _pytest("--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
