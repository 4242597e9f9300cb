"""fla-core (flash-linear-attention) kept out of this environment: its own folder, a subprocess of its own.

Used by the slow tests that compare attention_ref with fla's plain PyTorch references
(``tests/test_linear_fla.py``, ``tests/test_nsa_fla.py``). Once ``fla`` is importable,
transformers routes Qwen3-Next's and Kimi Linear's linear layers to fla's Triton kernels,
which fail on a CPU ("0 active drivers"), and the model tests of this environment break. So
fla-core is installed with ``pip --target`` into a folder of its own, and a subprocess of this
interpreter with that folder on ``PYTHONPATH`` loads the ``naive.py`` files it needs by path, so
that ``fla/__init__.py`` (which imports the Triton kernels) never runs. The inputs go to the
subprocess and the outputs come back as ``torch.save`` files; the comparison happens here.

``ATTENTION_REF_SLOW_TESTS=1`` turns these tests on; ``ATTENTION_REF_FLA_TARGET=DIR`` reuses a
folder where fla-core ``FLA_VERSION`` is installed (it is installed there if missing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FLA_VERSION = "0.6.0"

slow = pytest.mark.skipif(
    not os.environ.get("ATTENTION_REF_SLOW_TESTS"),
    reason="installs fla-core into a folder of its own and runs a subprocess: set ATTENTION_REF_SLOW_TESTS=1")


def install_fla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding fla-core ``FLA_VERSION`` and einops: ``ATTENTION_REF_FLA_TARGET`` or a new temporary one."""
    given = os.environ.get("ATTENTION_REF_FLA_TARGET")
    target = Path(given) if given else tmp_path_factory.mktemp("fla-core")
    if not (target / f"fla_core-{FLA_VERSION}.dist-info").exists():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
             f"fla-core=={FLA_VERSION}", "einops"], check=False, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"pip install fla-core failed:\n{done.stderr[-2000:]}"
    return target


def run_fla(target: Path, runner: str, inputs: dict, folder: Path) -> dict:
    """Run ``runner`` (Python source) as ``python -c runner TARGET INPUTS OUTPUTS``, fla-core on its path.

    ``inputs`` is saved to ``folder / "inputs.pt"``; the runner saves its results to the
    third argument, which is loaded and returned.
    """
    torch.save(inputs, folder / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", runner, str(target), str(folder / "inputs.pt"),
                           str(folder / "outputs.pt")],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "outputs.pt")
