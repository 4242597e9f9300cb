"""benchmarks/cpu_busy.py: the busy cores of the machine while a command runs, from /proc/stat."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_busy  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")


def test_a_spinning_command_keeps_a_core_busy_and_its_status_comes_back(tmp_path: Path):
    out = tmp_path / "busy.json"
    spin = "import sys, time\nend = time.time() + 3\nwhile time.time() < end: pass\nsys.exit(3)"
    assert cpu_busy.main(["--out", str(out), "--every", "0.25", "--window", "0.5", "--", sys.executable, "-c",
                          spin]) == 3
    record = json.loads(out.read_text())
    assert record["exit_status"] == 3 and record["cores"] == os.cpu_count()
    assert len(record["samples"]) >= 4 and record["windows"][0]["from_s"] == 0.0
    # the whole machine: at least the one core the command keeps busy, at most every core; from 1 s on, when
    # the command spins (its Python starts later than its process: in a full check, beside the build, the
    # tests run at niceness 10, and a sample at 0.5 s once read 0.69)
    busy = [b for t, b in record["samples"][:-1] if t >= 1.0]
    assert len(busy) >= 4, record["samples"]
    assert min(busy) >= 0.8 and max(busy) <= record["cores"] + 0.01, record["samples"]


def test_a_missing_command_or_a_window_shorter_than_a_sample_is_refused(tmp_path: Path, capsys):
    for argv, message in [(["--out", str(tmp_path / "x.json")], "give the command to run after --"),
                          (["--out", str(tmp_path / "x.json"), "--every", "2", "--window", "1", "--", "true"],
                           "--every must be > 0 and --window at least --every, got 2.0 and 1.0")]:
        with pytest.raises(SystemExit):
            cpu_busy.main(argv)
        assert message in capsys.readouterr().err
