"""The pytest plugin that runs the conformance suite on a kernel named on the command line.

Registered by the package (``[project.entry-points.pytest11]``), so that

    pytest --pyargs attention_ref.conformance --attention-impl=package.module:adapter [--full]

runs one test per case of the matrix (`attention_ref.conformance.cases.matrix`),
named by the case's id, so ``-k causal_bottom_right-float16-bwd`` reruns one.
A case the adapter does not support is skipped with the reason; a known bug
(`attention_ref.conformance.KnownFailure`) is a strict xfail while its repro
reproduces against the installed library, and an ordinary test once it stops
(its failure message then says the bug appears fixed upstream).

Options (in the group "attention_ref conformance"):

- ``--attention-impl=package.module:name``: the adapter (an `Adapter`, or a
  function returning one), e.g. ``attention_ref.conformance.shipped:torch_sdpa_math``;
- ``--quick`` (the default) or ``--full``: the size of the matrix (``--attention-size=quick|full``
  when another plugin already defines ``--quick`` or ``--full``);
- ``--attention-device=cpu|cuda``: where the inputs go.

Every pytest run in an environment with the package installed loads this
module (and so imports the package and torch; not triton, not transformers).
The suite itself is collected only when ``--attention-impl`` is given or its
package is named on the command line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SUITE = Path(__file__).with_name("test_suite.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attention_ref conformance")
    group.addoption("--attention-impl", default=None, metavar="MODULE:NAME",
                    help="the adapter of the kernel to run the attention_ref conformance suite on")
    group.addoption("--attention-size", dest="attention_size", choices=("quick", "full"), default="quick",
                    help="conformance suite: the quick matrix (the default) or the full one (every dtype, two "
                         "shape sets)")
    # The short spellings, unless another plugin already owns them: this plugin is loaded by every pytest
    # run where attention_ref is installed, and must not break one that has its own --quick or --full.
    taken = {name for owner in [parser._anonymous, *parser._groups] for option in owner.options
             for name in option.names()}
    for flag, size in (("--quick", "quick"), ("--full", "full")):
        if flag not in taken:
            group.addoption(flag, dest="attention_size", action="store_const", const=size,
                            help=f"conformance suite: the same as --attention-size={size}")
    group.addoption("--attention-device", default="cpu", help="conformance suite: the device of the inputs")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the suite out of ordinary runs: it runs when asked for with ``--attention-impl``
    or when its package is named (then it says what is missing)."""
    if collection_path != _SUITE or config.getoption("attention_impl"):
        return None
    asked = any("conformance" in str(arg) for arg in config.args)
    return None if asked else True
