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
    assert cpu_busy.main(["--out", str(out), "--every", "0.25", "--window", "1", "--", sys.executable, "-c",
                          spin]) == 3
    record = json.loads(out.read_text())
    assert record["exit_status"] == 3 and record["cores"] == os.cpu_count()
    # the first sample is the mean from the start to its time: its window is the first, though it came late
    # (0.5 s instead of 0.25 in a full check, beside the build)
    assert len(record["samples"]) >= 4 and record["samples"][0][0] < 2 and record["windows"][0]["from_s"] == 0.0
    # the whole machine: at least the one core the command keeps busy, at most every core; from 1 s on, when
    # the command spins (its Python starts later than its process: in a full check, beside the build, the
    # tests run at niceness 10, and a sample at 0.5 s once read 0.69)
    busy = [b for t, b in record["samples"][:-1] if t >= 1.0]
    assert len(busy) >= 4, record["samples"]
    assert min(busy) >= 0.8 and max(busy) <= record["cores"] + 0.01, record["samples"]


def test_each_sample_counts_in_the_window_that_holds_the_middle_of_its_interval():
    """Samples at 0.5, 1.0 and 1.6 s, each the mean since the one before: with windows of 0.5 s the first covers
    0-0.5 s, the second 0.5-1.0 s, the third 1.0-1.6 s (its middle, 1.3 s, in the window from 1.0 s)."""
    assert [(w["from_s"], w["busy_cores"]) for w in cpu_busy.windows([(0.5, 1.0), (1.0, 0.0), (1.6, 1.8)], 0.5)] == [
        (0.0, 1.0), (0.5, 0.0), (1.0, 1.8)]
    # samples of 2 s in windows of 30 s: the one at 30 s (28-30 s) is the first window's; 30-32 s the second's
    assert [w["busy_cores"] for w in cpu_busy.windows([(28.0, 1.0), (30.0, 1.0), (32.0, 0.0)], 30)] == [1.0, 0.0]
    with pytest.raises(ValueError, match="window must be > 0 seconds, got 0"):
        cpu_busy.windows([(1.0, 1.0)], 0)


def test_a_missing_command_or_a_window_shorter_than_a_sample_is_refused(tmp_path: Path, capsys):
    for argv, message in [(["--out", str(tmp_path / "x.json")], "give the command to run after --"),
                          (["--out", str(tmp_path / "x.json"), "--every", "2", "--window", "1", "--", "true"],
                           "--every must be > 0 and --window at least --every, got 2.0 and 1.0")]:
        with pytest.raises(SystemExit):
            cpu_busy.main(argv)
        assert message in capsys.readouterr().err
