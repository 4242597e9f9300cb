"""dev.py's choices for pytest: the workers, their threads, the quick tier's ignores."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dev():
    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def args(jobs=None):
    return argparse.Namespace(jobs=jobs, quick=False, site_dir=None)


def test_pytest_runs_one_worker_per_core_each_file_on_one(dev, monkeypatch):
    monkeypatch.setattr(dev, "cores", lambda: 4)
    assert dev.parallel(args(), []) == ["-n", "4", "--dist", "loadfile"]
    assert dev.parallel(args(3), ["-k", "masks"]) == ["-n", "3", "--dist", "loadfile"]


@pytest.mark.parametrize("extra", [["-n", "2"], ["-n2"], ["--numprocesses=2"], ["-p", "no:xdist"]])
def test_the_callers_own_choice_or_one_job_means_no_workers_of_ours(dev, extra):
    assert dev.parallel(args(), extra) == []
    assert dev.parallel(args(1), []) == []


def test_each_worker_gets_its_share_of_the_cores_as_threads_unless_told(dev, monkeypatch):
    monkeypatch.setattr(dev, "cores", lambda: 8)
    assert dev.test_env(args(), [], {})["OMP_NUM_THREADS"] == "1"
    assert dev.test_env(args(2), [], {})["OMP_NUM_THREADS"] == "4"
    assert dev.test_env(args(3), [], {})["OMP_NUM_THREADS"] == "2"
    assert dev.test_env(args(16), [], {})["OMP_NUM_THREADS"] == "1"
    assert dev.test_env(args(), [], {"OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"
    assert "OMP_NUM_THREADS" not in dev.test_env(args(1), [], {})  # one process: torch's own default


def test_the_quick_tier_leaves_out_the_pages_and_the_site_only(dev):
    assert dev.QUICK_IGNORES == ["--ignore=tests/docs", "--ignore=tests/site"]
