"""Shared fixtures for the core tests: PyTorch's reference call, per-dtype tolerances, the device.

Sizes in the tests are distinct primes (3, 5, 7, 11, 13) wherever the API allows,
so a swapped axis changes a shape and fails loudly instead of passing by accident.

The device switch: tests that take the ``device`` fixture (the backend, tiled and
log-sum-exp tests) put their inputs on it. It is ``cpu`` unless ``--device cuda`` is
given (or ``ATTENTION_REF_TEST_DEVICE=cuda`` is set), so the same tests check every
path on a GPU::

    python -m pytest tests/test_backends.py tests/test_tiled.py --device cuda

The inputs are still drawn on the CPU from seeded generators and then moved, so a
test sees the same numbers on either device. A test about CPU behaviour (torch's CPU
kernel choice, say) is marked ``@pytest.mark.cpu_only("why")`` and skipped on cuda.
Asking for cuda where ``torch.cuda.is_available()`` is False stops the run at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import serving  # tests/serving.py

# On a machine without CUDA, Triton kernels can only run under Triton's interpreter, and
# TRITON_INTERPRET=1 must be set before triton is first imported in the process (the docs
# blocks collected by tests/docs call the kernel in this process). torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import triton now, with the interpreter on: Triton defines its own library functions at
    # its first import, in the mode of that moment, and a test that removes the variable (to
    # check the error message) would otherwise make that first import a compiled-mode one for
    # every later test and page block of the process.
    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401
import torch.nn.functional as F

# Hub kernels never replace what a test compares. transformers 5.25 turned them on by default in
# from_pretrained (use_kernels=None means on; 5.23 defaults to off): a loaded model's layers may then run
# kernels fetched from the Hub in place of the code its eager path runs. The variable turns them off on every
# release that knows it (5.23 reads it when transformers is first imported, after this file; 5.25 at each
# load), for every from_pretrained of the tests, of the pages they execute and of the processes they start.
# A keyword at each call (use_kernels=False, accepted by both) would leave the pages and any new call open.
os.environ["USE_HUB_KERNELS"] = "NO"

DEVICES = ("cpu", "cuda")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help="device for the tests that take the `device` fixture: cpu (default) or cuda; "
        "the environment variable ATTENTION_REF_TEST_DEVICE sets it too",
    )


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process hands tests to pytest-xdist workers (``-n N``, N > 0)."""
    return (config.pluginmanager.hasplugin("xdist") and bool(getattr(config.option, "numprocesses", None))
            and not hasattr(config, "workerinput"))


def _serve_for_the_workers(config: pytest.Config) -> None:
    """Under pytest-xdist, serve a given built site once, here, for every worker's browser tests.

    It must be served on the one port it was built for, so the workers cannot each serve it.
    (``python3 dev.py check`` runs pytest-xdist with ``--dist loadfile``: each test file, and
    each page's blocks, on one worker, so module fixtures run once and a page's blocks run in
    order in one namespace. Its ``loadgroup`` cannot group tests under pytest 9: xdist 3.8
    renames nodes through an attribute pytest 9 no longer reads.)
    """
    site = os.environ.get("ATTENTION_REF_BUILT_SITE")
    if not site or not _xdist_controller(config) or os.environ.get(serving.SERVED_AT):
        return
    url, stop = serving.serve(Path(site))
    os.environ[serving.SERVED_AT] = url  # the workers start after this and inherit it

    def cleanup() -> None:
        stop()
        os.environ.pop(serving.SERVED_AT, None)

    config.add_cleanup(cleanup)


def pytest_configure(config: pytest.Config) -> None:
    _serve_for_the_workers(config)
    config.addinivalue_line(
        "markers", "cpu_only(reason): a test of CPU behaviour, skipped when --device is cuda"
    )
    config.addinivalue_line(
        "markers", f"{UPSTREAM}: the test runs another library's behaviour (every test outside "
        "tests/conftest.py's OWN_TESTS, or marked own); the newest tier runs these"
    )
    config.addinivalue_line(
        "markers", f"{OWN}(why): a test in a file of upstream tests whose verdict is the package's own: "
        "the newest tier leaves it out"
    )
    config.addinivalue_line(
        "markers", "sweep: a heavy sweep of another library (every model type of the installed transformers; "
        "torch's and transformers' FlexAttention through the quick conformance matrix, and compiled; the checker's "
        "seed sweeps over right and wrong kernels in tests/test_testing.py); with "
        "`dev.py check --newest` it runs in the newest tier only (dev.py's SWEEP_MARKER)"
    )
    config.addinivalue_line(
        "markers", "triton_kernel: runs this package's Triton kernel (under Triton's interpreter on a CPU); with "
        "`dev.py check --newest` the newest tier runs it only when its Triton is another release than the "
        "pinned tier's (dev.py's TRITON_MARKER)"
    )
    name = config.getoption("--device") or os.environ.get("ATTENTION_REF_TEST_DEVICE") or "cpu"
    if name not in DEVICES:
        raise pytest.UsageError(f"--device must be one of {DEVICES}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device cuda: torch.cuda.is_available() is False here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); run without --device to test on the CPU"
        )
    config.stash[_DEVICE] = name


_DEVICE = pytest.StashKey[str]()


#: The longest test files (each a few minutes of one core), run first under pytest-xdist (`_FilesAndPages`
#: hands out whole files in collection order): a long file collected last kept one worker busy alone at the
#: end (measured on 2 cores: the last 2 minutes of a 6-minute run). The fresh-environment notebooks first:
#: one file that installs an environment and then runs eleven notebooks (236 s in a check on 2 cores).
LONGEST_FIRST = ("tests/site/test_fresh_notebooks.py", "tests/site/test_browser.py", "tests/site/test_explorer.py",
                 "tests/docs/test_shown_code.py", "tests/test_conformance.py", "tests/test_gpu_session.py",
                 "tests/test_lm.py")

#: Test files whose tests pytest-xdist may hand to different workers, each test on its own: each runs
#: one page from its start (tests/docs/test_shown_code.py: 315 s summed over 40 pages in a check on 2
#: cores, all on one worker while whole files were the unit).
SPREAD_FILES = ("tests/docs/test_shown_code.py",)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (what ``dev.py check`` runs) with two changes: the tests of `SPREAD_FILES`
    go to workers one by one, and the files go in collection order (`LONGEST_FIRST`) instead of
    xdist's default, most tests first, which put a file of 3 long tests after one of 300 short ones."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _FilesAndPages(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith(SPREAD_FILES) else super()._split_scope(nodeid)

        def schedule(self) -> None:
            self.config.option.loadscopereorder = False  # the collection's order, longest first
            super().schedule()

    return _FilesAndPages(config, log)


#: The test files whose verdict depends only on this package's own files and arithmetic, with why: the
#: newest tier (``dev.py check --newest``, ``-m upstream``) leaves them out. Every other test, the
#: doctests included, is marked ``upstream``: it runs another library's behaviour (torch's kernels and
#: dispatch, FlexAttention, autograd's gradcheck, torch.distributed, Triton, transformers, fla, NumPy)
#: as an oracle or through an adapter, so a new release of that library can change its verdict. A new
#: test file is upstream until it is named here. tests/test_structure.py holds these names to files.
OWN_TESTS: dict[str, str] = {
    "tests/test_block_diagram.py": "the block diagram's SVG is drawn from the package's own module tree",
    "tests/test_cpu_busy.py": "benchmarks/cpu_busy.py's samples of /proc/stat: standard library only",
    "tests/test_complexity.py": "cost formulas against FLOP counts of the package's own reference path",
    "tests/test_dev.py": "dev.py's command line, environments and summary: standard library only",
    "tests/test_device_switch.py": "the test suite's own --device switch",
    "tests/test_diagrams.py": "SVG diagrams drawn by the package, read back as XML",
    "tests/test_gpu_session.py": "the GPU session script's plan and records, run on the CPU",
    "tests/test_lm.py": "page 11's model against an independent float64 forward and its own shipped record",
    "tests/test_measured.py": "the committed measurement files against their provenance",
    "tests/test_one_message_per_mistake.py": "the package's own argument checks and their messages",
    "tests/test_properties.py": "hypothesis properties of the package's functions against each other",
    "tests/test_recall.py": "the MQAR task and mixers against float64 formulas, the shipped models' records",
    "tests/test_structure.py": "the project's layout and import direction",
    "tests/test_viz.py": "matplotlib figures of the package's data, read back",
    "tests/test_benchmark.py": "the benchmark scripts' arithmetic and records",
    "tests/test_kv_cache_bench.py": "the KV-cache benchmark's arithmetic and records",
    "tests/test_linear_bench.py": "the linear-attention benchmark's arithmetic and records",
    "tests/test_linear_gpu_bench.py": "the GPU linear-attention benchmark's records (no GPU here)",
    "tests/test_threads_bench.py": "the threads benchmark's arithmetic and records",
}

#: The marker of the tests that exercise another library's behaviour: every test outside `OWN_TESTS`,
#: except those marked `OWN` one by one.
UPSTREAM = "upstream"
#: ``@pytest.mark.own("why")``: a test in a file of upstream tests whose verdict is the package's own
#: (the newest tier leaves it out, as the files of `OWN_TESTS`).
OWN = "own"


def _mark_upstream(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    for item in items:
        try:
            path = item.path.resolve().relative_to(root).as_posix()
        except ValueError:
            path = str(item.path)
        if path not in OWN_TESTS and item.get_closest_marker(OWN) is None:
            item.add_marker(UPSTREAM)


def _recorded_page_seconds() -> dict[str, float]:
    """Each page's seconds in the strict build (docs/hooks/build_record.py), keyed by its path under
    the checkout; empty without a record (``ATTENTION_REF_BUILD_RECORD``)."""
    record = os.environ.get("ATTENTION_REF_BUILD_RECORD")
    if not record or not Path(record).is_file():
        return {}
    pages = json.loads(Path(record).read_text(encoding="utf-8"))["pages"]
    return {f"docs/{page}": float(data["seconds"]) for page, data in pages.items()}


def _longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of `LONGEST_FIRST` first, in that order, each file's tests as
    they were, except the pages of tests/docs/test_shown_code.py: the longest first, by the build's record."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    seconds = _recorded_page_seconds()

    def page_seconds(item: pytest.Item) -> float:
        spec = getattr(item, "callspec", None)
        if spec is None or not item.nodeid.startswith(SPREAD_FILES):
            return 0.0
        return -seconds.get(spec.params.get("page", ""), 0.0)

    # stable: the rest keep their order
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), page_seconds(item)))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_upstream(items)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker sorts alike
        _longest_first(items)
    if config.stash[_DEVICE] == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "a test of CPU behaviour"
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {reason}"))


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device the inputs go to: ``--device`` / ``ATTENTION_REF_TEST_DEVICE``, else cpu.

    On CUDA it carries the current index (``cuda:0``), as tensors made there report it:
    ``torch.device("cuda") != torch.device("cuda", 0)``, so a bare ``cuda`` would fail every
    ``out.device == device`` check (seen on an H100).
    """
    name = pytestconfig.stash[_DEVICE]
    return torch.device(name, torch.cuda.current_device()) if name == "cuda" else torch.device(name)

# (atol, rtol) for comparing attention_ref with PyTorch in each dtype. float64 is
# tight: the two compute the same formula, only the order of the roundings differs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype=None)`` with the tolerance of ``dtype``."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        atol, rtol = TOLERANCES[dtype or expected.dtype]
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)

    return check


def _torch_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; a causal mask is folded into ``attn_mask``.

    PyTorch refuses ``is_causal=True`` together with ``attn_mask``, while
    attention_ref applies both. Folding the top-left causal mask into the given
    mask (AND for bool, ``-inf`` added for float) is the same computation.
    """
    if is_causal and attn_mask is not None:
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()  # (L, S), j <= i
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & causal
        else:
            blocked = torch.zeros(L, S, dtype=attn_mask.dtype, device=query.device)
            attn_mask = attn_mask + blocked.masked_fill(~causal, float("-inf"))  # broadcasts
        is_causal = False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


@pytest.fixture
def torch_sdpa() -> Callable[..., torch.Tensor]:
    """PyTorch's SDPA with attention_ref's call signature (causal + mask allowed)."""
    return _torch_sdpa


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fixed seed, for tests that need one stream of random numbers."""
    return torch.Generator().manual_seed(20240607)


@pytest.fixture
def score_blocks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """``(i0, j0, j1)`` of every block of scores the tiled path computes, forward and backward.

    Records the calls of ``attention_ref.tiled._scores_block`` (query rows from ``i0``, keys
    ``j0:j1``): how the tests prove that blocks a mask empties are never computed.
    """
    from attention_ref import tiled

    calls: list[tuple[int, int, int]] = []
    original = tiled._scores_block

    def recording(q_blk, kT_blk, *args, **kwargs):
        calls.append((args[3], args[5], args[6]))  # (i0, j0, j1) after mask, is_causal, batch
        return original(q_blk, kT_blk, *args, **kwargs)

    monkeypatch.setattr(tiled, "_scores_block", recording)
    return calls


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest):
    """The script ``benchmarks/<BENCHMARK>.py`` loaded as a module, ``BENCHMARK`` set by the test module.

    The scripts are files, not a package. The module is registered in ``sys.modules`` while
    it loads and is used (dataclasses look their module up while a class is made) and
    removed after the test module.
    """
    name = request.module.BENCHMARK
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
