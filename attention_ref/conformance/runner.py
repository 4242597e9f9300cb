"""Running cases: one case against the checker (`check`), a whole matrix into a `Report` (`run`).

Each case is judged by `attention_ref.testing.assert_attention_close`, with the
tolerances it chooses (FlashAttention's rule: a kernel may be at most twice as
far from the float64 reference as plain PyTorch in the inputs' own dtype). The
NSA and MoBA cases are judged so too, as the one attention each equals
(`attention_ref.conformance.families`); the FP8 cases by
`attention_ref.testing.assert_fp8_attention_close`, against float64 attention of
the dequantized inputs, with the allowance of the adapter's `FP8Path`. The
suite never loosens them: a known bug is an expected failure while its repro
still reproduces against the installed library (`attention_ref.conformance.KnownFailure`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from attention_ref import testing
from attention_ref.conformance.adapter import Adapter, KnownFailure, ReproError, Unsupported, load_adapter
from attention_ref.conformance.cases import Case, Inputs, matrix, to_layout
from attention_ref.conformance.families import fp8_format
from attention_ref.conformance.report import CaseResult, Report
from attention_ref.testing.arguments import ATTENTION_KWARGS

__all__ = ["check", "expected_failure", "judge_skip_reason", "run", "versions"]


def _checker_takes(name: str) -> bool:
    """Whether today's `assert_attention_close` takes the keyword ``name`` (it is being extended)."""
    parameters = inspect.signature(testing.assert_attention_close).parameters
    if name in parameters:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return takes_kwargs and name in ATTENTION_KWARGS


def judge_skip_reason(case: Case) -> str | None:
    """Why the checker cannot judge ``case`` yet, or ``None``."""
    if "sinks" in case.features and not _checker_takes("sinks"):
        return "attention_ref.testing.assert_attention_close takes no sinks= yet: the case cannot be judged"
    return None


def expected_failure(adapter: Adapter, case: Case) -> KnownFailure | None:
    """The known bug ``case`` is expected to fail by: one that applies and whose repro still reproduces.

    ``None`` when no known bug applies, when its repro no longer reproduces (the case is judged
    plainly), or when the repro cannot tell (`ReproError`: then `check` raises it for the case).
    """
    known = adapter.known_failure(case)
    if known is None:
        return None
    try:
        return known if known.expected() else None
    except ReproError:
        return None


def check(adapter: Adapter | str, case: Case, device: torch.device | str = "cpu") -> None:
    """Run one case and judge it; return quietly when the kernel agrees with the reference.

    The adapter's call gets the case's `attention_ref.conformance.cases.Problem`
    in its layout; its output (and, in a bwd case, its gradients for a seeded
    ``grad_output``) are put back in the canonical layout and given to
    `attention_ref.testing.assert_attention_close` with the case's arguments
    (an NSA or MoBA case: the one attention it equals; an FP8 case: to
    `attention_ref.testing.assert_fp8_attention_close`).

    Raises:
        AssertionError: the output or a gradient is out of bounds (the checker's
            message), or the output has the wrong shape. When a known bug applies
            whose repro no longer reproduces, the message says so: the bug appears
            fixed upstream, so this failure is something else.
        ReproError: a known bug applies and its repro raised (or returned no bool):
            whether the bug still shows cannot be told, whatever the kernel did (the
            message ends with the kernel's own outcome).
        Exception: whatever the kernel raised.
    """
    adapter = load_adapter(adapter)
    known = adapter.known_failure(case)
    cannot_tell: ReproError | None = None
    reproduces = False
    if known is not None:
        try:
            reproduces = known.expected()
        except ReproError as error:
            cannot_tell = error
    inputs = case.build(device)
    try:
        _check(adapter, case, inputs)
    except Unsupported:  # a refusal is not judged, whatever the repro says
        raise
    except Exception as error:
        if cannot_tell is not None:
            raise ReproError(f"{cannot_tell}\n  the kernel, judged plainly: {type(error).__name__}: "
                             f"{error}") from cannot_tell.__cause__
        if known is not None and not reproduces:  # the known bug is gone here: keep the error, say so
            error.args = (f"{error.args[0] if error.args else ''}\n  note: the known failure {known.describe()} "
                          f"no longer reproduces with {known.where()} (fixed upstream, it appears), so this "
                          "failure is not that bug, or its repro misses it",
                          *error.args[1:])
        raise
    if cannot_tell is not None:
        message = f"{cannot_tell}\n  the kernel, judged plainly, agreed with the reference"
        raise ReproError(message) from cannot_tell.__cause__


def _check(adapter: Adapter, case: Case, inputs: Inputs) -> None:
    problem = inputs.problem(adapter.layout, requires_grad=case.backward)
    output = adapter.call(problem)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{adapter.name}'s call must return a torch.Tensor, got {type(output).__name__}")
    actual = to_layout(output, adapter.output_layout)
    expected_shape = (*inputs.query.shape[:-1], inputs.value.shape[-1])  # (..., L, Ev)
    if tuple(actual.shape) != expected_shape:
        got = tuple(output.shape)
        raise AssertionError(
            f"{adapter.name} returned shape {got} in layout {adapter.output_layout!r}, expected "
            f"{tuple(to_layout(torch.empty(expected_shape, device='meta'), adapter.output_layout).shape)}"
        )
    if case.scenario.family == "fp8":
        _check_fp8(adapter, inputs, actual.detach())
        return
    key, value = inputs.judged_key_value or (inputs.key, inputs.value)
    kwargs = dict(inputs.reference_kwargs)
    sinks = problem.sinks if case.backward and problem.sinks is not None else None
    unused: list[str] = []
    if case.backward:
        generator = torch.Generator().manual_seed(case.seed + 1)
        grad_output = torch.randn(expected_shape, generator=generator).to(case.dtype).to(actual.device)
        leaves = (problem.query, problem.key, problem.value) + ((sinks,) if sinks is not None else ())
        if output.grad_fn is None:
            raise AssertionError(f"{adapter.name}'s output has no gradient (grad_fn is None) in a bwd case")
        grads = torch.autograd.grad(output, leaves, to_layout(grad_output, adapter.output_layout), allow_unused=True)
        # an input the output does not reach in autograd gets 0, right only where the true gradient is 0
        unused = [name for name, g in zip(("query", "key", "value", "sinks"), grads) if g is None]
        grads = tuple(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True))
        canonical = tuple(to_layout(g, adapter.layout) for g in grads[:3]) + grads[3:]  # dsinks is (H,)
        kwargs.update(grad_output=grad_output, actual_grads=canonical)
    tensors = [actual.detach(), inputs.query, key, value]
    if adapter.layout == adapter.output_layout != "bhld" and _checker_takes("layout"):
        # the checker takes the kernel's layout itself (and reports positions in it)
        tensors = [to_layout(t, adapter.layout) for t in tensors]
        if case.backward:
            kwargs["grad_output"] = to_layout(kwargs["grad_output"], adapter.layout)
            kwargs["actual_grads"] = grads  # as the kernel gave them
        kwargs["layout"] = adapter.layout
    try:
        testing.assert_attention_close(*tensors, **kwargs)
    except AssertionError as error:
        if unused:
            names = " and ".join(f"problem.{name}" for name in unused)
            error.args = (f"{adapter.name}: the gradient for {names} never arrives: autograd finds no path from the "
                          f"output to {'them' if len(unused) > 1 else 'it'} (did the call use a copy, or a "
                          "module's own parameter, instead of the problem's tensor?); judged as 0 below\n"
                          f"{error.args[0] if error.args else ''}", *error.args[1:])
        raise


def _check_fp8(adapter: Adapter, inputs: Inputs, actual: torch.Tensor) -> None:
    """An FP8 case: the output against float64 attention of the dequantized inputs, the allowance the adapter's path's."""
    args = inputs.arguments
    testing.assert_fp8_attention_close(
        actual, inputs.query, inputs.key, inputs.value, args["q_descale"], args["k_descale"], args["v_descale"],
        fmt=fp8_format(inputs.query.dtype), is_causal=args.get("causal") is not None, scale=args.get("scale"),
        enable_gqa=bool(args.get("enable_gqa")), **dataclasses.asdict(adapter.fp8_path))


def _result(case: Case, status: str, detail: str, seconds: float) -> CaseResult:
    dtype = str(case.dtype).removeprefix("torch.")
    return CaseResult(case.id, case.scenario.name, dtype, "bwd" if case.backward else "fwd", case.shape,
                      status, detail, seconds)


def run_case(adapter: Adapter, case: Case, device: torch.device | str = "cpu") -> CaseResult:
    """One case's `CaseResult`: skipped, passed, failed, error, xfailed or xpassed."""
    reason = adapter.skip_reason(case) or judge_skip_reason(case)
    if reason is not None:
        return _result(case, "skipped", reason, 0.0)
    known = adapter.known_failure(case)
    expected = expected_failure(adapter, case)
    start = time.perf_counter()
    try:
        check(adapter, case, device)
    except AssertionError as error:
        status, detail = "failed", str(error)
    except Unsupported as error:  # the kernel refused the input on purpose: not judged
        return _result(case, "skipped", f"refused by the kernel: {error}", time.perf_counter() - start)
    except Exception as error:  # the kernel raised (or a known bug's repro did): reported, not propagated
        status, detail = "error", f"{type(error).__name__}: {error}"
    else:
        status, detail = "passed", ""
    seconds = time.perf_counter() - start
    if expected is not None:
        if status == "passed":
            status, detail = "xpassed", (f"a known failure did not show, though its repro still reproduces with "
                                         f"{expected.where()}: {expected.describe()} (does the entry apply to "
                                         "this case?)")
        else:
            status, detail = "xfailed", f"{expected.describe()}; its repro reproduces with {expected.where()}\n{detail}"
    elif known is not None and status == "passed" and known.predates():  # a release from before the bug
        detail = f"the known failure {known.describe()} does not reproduce with {known.where()}, an older release"
    elif known is not None and status == "passed":  # its repro no longer reproduces: judged plainly, and passed
        detail = (f"the known failure {known.describe()} no longer reproduces with {known.where()}: fixed upstream, "
                  "it appears; the entry can go")
    return _result(case, status, detail, seconds)


def versions() -> dict[str, str | None]:
    """The versions of the libraries a run depends on (``None``: not installed)."""
    found: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("attention-ref", "transformers", "triton"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _progress(cases: list[Case], name: str, enabled: bool) -> Iterator[Case]:
    """The cases, with a progress bar on stderr (tqdm when installed, else a line every 10%)."""
    if not enabled:
        yield from cases
        return
    try:
        from tqdm import tqdm
    except ImportError:
        step = max(1, len(cases) // 10)
        for i, case in enumerate(cases, 1):
            yield case
            if i % step == 0 or i == len(cases):
                print(f"{name}: {i}/{len(cases)} cases", file=sys.stderr)
        return
    yield from tqdm(cases, desc=name, unit="case", file=sys.stderr)


def run(
    adapter: Adapter | str,
    size: str = "quick",
    *,
    progress: bool = False,
    device: torch.device | str = "cpu",
    select: Callable[[Case], bool] | Iterable[str] | None = None,
) -> Report:
    """Run every case of ``size`` that the adapter supports; return the `Report`.

    The cases are those of the adapter's families (``adapter.families``): the
    attention matrix, or the NSA, MoBA and FP8 cases of an adapter claiming them.

    Args:
        adapter: an `Adapter`, or ``"package.module:name"`` of one.
        size: ``"quick"`` (the small shapes, low precision on the core scenarios)
            or ``"full"`` (see `attention_ref.conformance.cases.matrix`).
        progress: show a progress bar on stderr.
        device: where the inputs go (they are drawn on the CPU first, so the
            numbers are the same on every device).
        select: only some cases: a predicate on `Case`, or case ids.

    Returns:
        A `Report`: ``.summary()``, ``.table()``, ``.to_json()``; ``.ok`` is True
        when no case failed, raised or passed against a known bug.

    Raises:
        ValueError: an unknown size, or ids in ``select`` that are not cases of it.

    Example:
        >>> from attention_ref import conformance
        >>> report = conformance.run("attention_ref.conformance.shipped:torch_sdpa_math",
        ...                          select=["causal-float32-fwd-small"])
        >>> report.summary()  # doctest: +ELLIPSIS
        'torch-sdpa-math (quick, cpu): 1 passed in ... s'
    """
    adapter = load_adapter(adapter)
    cases = matrix(size, adapter.families)
    if isinstance(select, str):  # one id: a str is iterable too, and its characters are no ids
        select = [select]
    if select is not None and not callable(select):
        wanted = list(select)
        known_ids = {case.id for case in cases}
        unknown = [i for i in wanted if i not in known_ids]
        if unknown:
            raise ValueError(f"no {size} case has the ids {unknown}")
        cases = [case for case in cases if case.id in set(wanted)]
    elif select is not None:
        cases = [case for case in cases if select(case)]
    start = time.perf_counter()
    results = [run_case(adapter, case, device) for case in _progress(cases, adapter.name, progress)]
    return Report(adapter.name, adapter.description, size, str(torch.device(device)), results, versions(),
                  time.perf_counter() - start)
