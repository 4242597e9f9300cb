"""The conformance suite as pytest tests, one per case (see `attention_ref.conformance.plugin`).

    pytest --pyargs attention_ref.conformance --attention-impl=package.module:adapter
"""

from __future__ import annotations

import pytest

from attention_ref.conformance import Adapter, Case, check, load_adapter, matrix
from attention_ref.conformance.runner import expected_failure, judge_skip_reason

_ADAPTER = pytest.StashKey[Adapter]()


def _adapter(config: pytest.Config) -> Adapter:
    if _ADAPTER not in config.stash:
        spec = config.getoption("attention_impl", None)
        if not spec:
            pytest.skip("give the kernel to check: --attention-impl=package.module:adapter "
                        "(e.g. attention_ref.conformance.shipped:torch_sdpa_math)", allow_module_level=True)
        try:
            config.stash[_ADAPTER] = load_adapter(spec)
        except (ImportError, AttributeError, ValueError) as error:
            raise pytest.UsageError(f"--attention-impl={spec}: {type(error).__name__}: {error}") from error
    return config.stash[_ADAPTER]


def _param(adapter: Adapter, case: Case) -> object:
    marks = []
    reason = adapter.skip_reason(case) or judge_skip_reason(case)
    if reason is not None:
        marks.append(pytest.mark.skip(reason=reason))
    elif (known := expected_failure(adapter, case)) is not None:
        # a known bug whose repro still reproduces: strict, so a pass fails the run. Unmarked when the repro
        # no longer reproduces (judged plainly) or cannot tell (then check raises ReproError, unexcused).
        marks.append(pytest.mark.xfail(reason=f"{known.describe()}; its repro reproduces with {known.where()}",
                                       strict=True))
    return pytest.param(case, id=case.id, marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        adapter = _adapter(metafunc.config)
        cases = matrix(metafunc.config.getoption("attention_size", "quick"), adapter.families)
        metafunc.parametrize("case", [_param(adapter, case) for case in cases])


def test_case(case: Case, pytestconfig: pytest.Config) -> None:
    """The kernel agrees with the reference on this case (the checker's message says where not)."""
    check(_adapter(pytestconfig), case, pytestconfig.getoption("attention_device", "cpu"))
