"""The adapter protocol: how a kernel is described to the suite.

An `Adapter` is a name, a call, a layout and the features the kernel supports.
The call takes a `attention_ref.conformance.cases.Problem` (the case's tensors
in the adapter's layout and its arguments) and returns the attention output::

    def call(p):
        return my_attention(p.query, p.key, p.value, causal=p.is_causal, softmax_scale=p.scale)

    adapter = Adapter("mine", call, layout="blhd", supports={"causal", "backward"})

The suite runs every case whose features the adapter supports, in the dtypes it
lists, and skips the others with the reason. An adapter that claims a family
(``"nsa"``, ``"moba"``, ``"fp8"``: `attention_ref.conformance.families`) runs
that family's cases instead of the attention matrix; an FP8 kernel says how it
rounds on its way with an `FP8Path`. Known bugs are `KnownFailure`
entries, each with a small repro of the bug run against the installed library:
the case is expected to fail while the repro reproduces, whatever the version,
and is judged plainly once it stops (the report then says the bug appears fixed
upstream).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from attention_ref.conformance.cases import (
    DTYPES,
    FAMILIES,
    FEATURES,
    LAYOUTS,
    Case,
    Problem,
)
from attention_ref.testing import assert_fp8_attention_close

__all__ = ["Adapter", "FP8Path", "KnownFailure", "ReproError", "Unsupported", "forget_repro_results", "load_adapter",
           "version_tuple"]


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the release numbers, for comparing versions.

    Examples:
        >>> version_tuple("5.23.0"), version_tuple("2.13.0+cpu"), version_tuple("3.0.0rc1")
        ((5, 23, 0), (2, 13, 0), (3, 0, 0))
    """
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _installed(library: str) -> str | None:
    if library == "torch":
        return torch.__version__
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


class Unsupported(Exception):
    """Raised by an adapter's call when the kernel itself refuses this input, loudly.

    The case is reported as skipped, with the message as the reason: the kernel did not
    answer, so there is nothing to judge. Use it only for a refusal the library makes on
    purpose (torch's ``"No available kernel"``, for one), never to hide an error: a kernel
    that raises anything else is reported as an error.
    """


class ReproError(RuntimeError):
    """A known failure's repro raised, or returned something other than a bool: whether its bug
    still shows cannot be told.

    The case is not expected to fail then, and `attention_ref.conformance.check` raises this
    error for it, naming the entry (the kernel's own outcome in the message): in a report the
    case is an ``error``, under pytest a failed test. A repro that cannot run is a problem to
    fix, never a reason to pass or to excuse a case.
    """


# Each repro's answer, run once per process: ``repro -> (repro, True | False | the ReproError it gave)``, keyed
# by the repro itself (equal bound methods share an answer), or by its id when it is not hashable (the repro is
# kept beside its answer, so that id is not reused).
_REPRO_RESULTS: dict[object, tuple[Callable[[], bool], bool | ReproError]] = {}


def _repro_key(repro: Callable[[], bool]) -> object:
    try:
        hash(repro)
    except TypeError:
        return ("id", id(repro))
    return repro


def forget_repro_results() -> None:
    """Forget every repro's cached answer, so that the next `KnownFailure.expected` runs it again
    (after changing what is installed in this process, say)."""
    _REPRO_RESULTS.clear()


@dataclass(frozen=True)
class KnownFailure:
    """A bug found in a library: the cases it breaks, and a small repro that says whether it still shows.

    The case is expected to fail while ``repro()`` returns True against the library
    installed here, whatever its version: a release that ships the same bug again
    stays green, and a release that fixes it is judged plainly (a right kernel
    passes, and the report says the bug appears fixed upstream and the entry can go;
    a kernel that still fails names this entry and says its repro no longer
    reproduces, so the failure is something else). The repro runs once per process.

    Attributes:
        reason: what is wrong, in one sentence.
        library: the distribution the bug is in (``"transformers"``, ``"torch"``):
            the reports name its installed version.
        applies: which cases it breaks: a predicate on `Case`, or a set of case ids
            and scenario names (a scenario name: every dtype and direction of it).
        repro: ``repro() -> bool``: a minimal reproduction run against the installed
            library, True while the bug shows (an error the bug itself raises counts as
            showing: catch it inside). A repro that raises anything else, or returns
            something other than a bool, cannot tell: see `ReproError`.
        first_seen: the version the bug was first seen in (``"5.23.0"``), for the
            reader and the reports; it does not decide whether the failure is expected.
        dtypes: only in these dtypes (``None``: all).
        backward_only: only the bwd cases.

    Raises:
        TypeError: ``repro`` is not callable.
        ValueError: ``first_seen`` is not a version number.

    Example:
        >>> def halves_go_to_even() -> bool:  # a minimal call into torch: True while the "bug" shows
        ...     return torch.tensor(2.5).round().item() == 2.0
        >>> known = KnownFailure("round() takes 2.5 to 2", "torch", frozenset({"plain"}), halves_go_to_even,
        ...                      first_seen="2.13.0")
        >>> known.expected(), known.describe()
        (True, 'round() takes 2.5 to 2 (torch, first seen in 2.13.0)')
    """

    reason: str
    library: str
    applies: Callable[[Case], bool] | frozenset[str] = field(compare=False)
    repro: Callable[[], bool] = field(compare=False, repr=False)
    first_seen: str | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    backward_only: bool = False

    def __post_init__(self) -> None:
        if not callable(self.repro):
            raise TypeError(f"KnownFailure {self.reason!r}: repro must be a function "
                            f"repro() -> bool, got {type(self.repro).__name__} {self.repro!r}")
        if self.first_seen is not None:
            version_tuple(self.first_seen)  # raises, naming it, on what is not a version number

    def matches(self, case: Case) -> bool:
        """Whether this bug is about ``case`` (whether or not it still shows)."""
        if self.dtypes is not None and case.dtype not in self.dtypes:
            return False
        if self.backward_only and not case.backward:
            return False
        if callable(self.applies):
            return bool(self.applies(case))
        return case.id in self.applies or case.scenario.name in self.applies

    def installed(self) -> str | None:
        """The version of ``library`` installed here (None: not installed)."""
        return _installed(self.library)

    def expected(self) -> bool:
        """Whether the bug still shows here, so its cases are expected to fail: ``repro()``, run once per process.

        Raises:
            ReproError: the repro raised, or returned something other than a bool
                (the answer is cached too: each call raises it again).
        """
        key = _repro_key(self.repro)
        if key not in _REPRO_RESULTS:
            _REPRO_RESULTS[key] = (self.repro, self._run_repro())
        _, result = _REPRO_RESULTS[key]
        if isinstance(result, ReproError):
            raise ReproError(*result.args) from result.__cause__
        return result

    def _run_repro(self) -> bool | ReproError:
        name = getattr(self.repro, "__qualname__", repr(self.repro))
        cannot_tell = f"cannot tell whether the known failure {self.describe()} still shows"
        try:
            answer = self.repro()
        except Exception as error:  # noqa: BLE001 - any error: the repro cannot tell (the ReproError says so)
            failure = ReproError(f"{cannot_tell}: its repro {name}() raised {type(error).__name__}: {error}")
            failure.__cause__ = error
            return failure
        if not isinstance(answer, bool):
            return ReproError(f"{cannot_tell}: its repro {name}() must return True or False, "
                              f"got {type(answer).__name__} {answer!r}")
        return answer

    def predates(self) -> bool:
        """Whether the installed ``library`` is older than ``first_seen``: a release from before the bug.

        Example:
            >>> KnownFailure("a bug", "torch", frozenset(), lambda: False, first_seen="99.0").predates()
            True
        """
        installed = self.installed()
        return (self.first_seen is not None and installed is not None
                and version_tuple(installed) < version_tuple(self.first_seen))

    def where(self) -> str:
        """``"<library> <installed version>"``: what the repro ran against."""
        return f"{self.library} {self.installed() or '(not installed)'}"

    def describe(self) -> str:
        """``"<reason> (<library>, first seen in <version>)"``, or ``"<reason> (<library>)"``."""
        seen = f", first seen in {self.first_seen}" if self.first_seen is not None else ""
        return f"{self.reason} ({self.library}{seen})"


@dataclass(frozen=True)
class FP8Path:
    """How an FP8 kernel rounds beyond its inputs: the keywords `attention_ref.testing.assert_fp8_attention_close`
    judges its FP8 cases by. The defaults are FlashAttention-3's.

    Attributes:
        p_format: the format P is rounded to before the P·V product (``None``: P kept in float32).
        p_offset_log2: ``c``: P is scaled so that its row maximum is ``2^c`` before rounding.
        denominator: ``"unrounded"`` (the row sum of the float32 P) or ``"rounded"``.
        accumulate_bits: the accumulators' significand bits (22 for FP8 tensor cores, ``None`` for float32's 24).
        output_roundings: how many times the output is rounded to its dtype.

    Raises:
        ValueError, TypeError: what the checker refuses (named): an unknown format, an offset
            above the format's largest value (FlashAttention issue #2716), ...

    Example:
        >>> FP8Path(p_format="e5m2")  # FlashAttention-4's other P format
        FP8Path(p_format='e5m2', p_offset_log2=8.0, denominator='unrounded', accumulate_bits=22, output_roundings=1)
    """

    p_format: str | None = "e4m3fn"
    p_offset_log2: float = 8.0
    denominator: str = "unrounded"
    accumulate_bits: int | None = 22
    output_roundings: int = 1

    def __post_init__(self) -> None:
        one = torch.zeros(1, 1, 1, 1)  # the checker's argument checks, on one zero: a bad value raises, named
        assert_fp8_attention_close(one, one, one, one, **dataclasses.asdict(self))


@dataclass(frozen=True)
class Adapter:
    """A kernel described for the conformance suite.

    Attributes:
        name: a short name for reports (``"torch-sdpa-math"``).
        call: ``call(problem) -> output``: the attention output in
            ``output_layout``; in the bwd cases it must be differentiable with
            respect to ``problem.query``, ``problem.key``, ``problem.value`` and,
            in the sinks cases, ``problem.sinks`` (all four are judged): use those
            tensors themselves, not copies (a module that owns its sinks
            parameter gets ``problem.sinks`` in its place, e.g. through
            ``torch.func.functional_call``).
        supports: the features the kernel supports (keys of
            `attention_ref.conformance.FEATURES`); a case needing another is skipped.
            Claiming a family (``"nsa"``, ``"moba"``, ``"fp8"``) runs its cases in
            place of the attention matrix (`families`).
        layout: ``"bhld"`` (heads before positions, torch's) or ``"blhd"``
            (FlashAttention's): the layout of the tensors the call gets.
        output_layout: the layout of what the call returns; defaults to ``layout``
            (transformers' attention functions take ``"bhld"`` and return ``"blhd"``).
        dtypes: the dtypes the kernel takes; the cases in others are skipped.
        known_failures: bugs found, each with a repro that says whether it still shows.
        notes: why a feature is not supported, shown as the skip reason.
        description: one line for the report.
        fp8_path: how the kernel rounds in the FP8 cases (FlashAttention-3's by default).

    Raises:
        ValueError: an unknown feature, layout or dtype.
    """

    name: str
    call: Callable[[Problem], torch.Tensor] = field(repr=False)
    supports: frozenset[str] = frozenset()
    layout: str = "bhld"
    output_layout: str | None = None
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES.values())
    known_failures: tuple[KnownFailure, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict, repr=False)
    description: str = ""
    fp8_path: FP8Path = field(default_factory=FP8Path)

    def __post_init__(self) -> None:
        supports = frozenset(self.supports)
        unknown = sorted(supports - FEATURES.keys())
        if unknown:
            raise ValueError(f"adapter {self.name!r}: unknown features {unknown}; known: {sorted(FEATURES)}")
        object.__setattr__(self, "supports", supports)
        for name in ("layout", "output_layout"):
            value = getattr(self, name)
            if value is not None and value not in LAYOUTS:
                raise ValueError(f"adapter {self.name!r}: {name} must be one of {LAYOUTS}, got {value!r}")
        if self.output_layout is None:
            object.__setattr__(self, "output_layout", self.layout)
        bad = [d for d in self.dtypes if d not in DTYPES.values()]
        if bad:
            raise ValueError(f"adapter {self.name!r}: dtypes must be among {list(DTYPES)}, got {bad}")
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        object.__setattr__(self, "known_failures", tuple(self.known_failures))
        if not isinstance(self.fp8_path, FP8Path):
            raise TypeError(f"adapter {self.name!r}: fp8_path must be an FP8Path, got {type(self.fp8_path).__name__}")

    @property
    def families(self) -> tuple[str, ...]:
        """The scenario families the adapter runs: those of `FAMILIES` it claims, else ``("attention",)``.

        A family's kernel takes its own arguments (NSA's gates, FP8's descales), so
        an adapter claiming one runs no case of the attention matrix.

        Example:
            >>> Adapter("x", lambda p: p.query, supports={"moba", "gqa"}).families
            ('moba',)
        """
        return tuple(family for family in FAMILIES if family in self.supports) or ("attention",)

    def skip_reason(self, case: Case) -> str | None:
        """Why the adapter does not run ``case``, or ``None`` when it does."""
        missing = sorted(case.features - self.supports)
        if missing:
            notes = [f"{m}: {self.notes[m]}" for m in missing if m in self.notes]
            return f"{self.name} does not support {', '.join(missing)}" + (f" ({'; '.join(notes)})" if notes else "")
        if case.dtype not in self.dtypes:
            dtype = str(case.dtype).removeprefix("torch.")
            note = self.notes.get(dtype)
            return f"{self.name} does not take {dtype}" + (f" ({note})" if note else "")
        return None

    def known_failure(self, case: Case) -> KnownFailure | None:
        """The known bug about ``case``, if any (whether or not it still shows)."""
        return next((k for k in self.known_failures if k.matches(case)), None)


def load_adapter(spec: str | Adapter | Callable[[], Adapter]) -> Adapter:
    """An adapter from ``"package.module:name"`` (an `Adapter`, or a function returning one).

    Args:
        spec: the import path, or the adapter itself, or a function without
            arguments that returns one.

    Raises:
        ValueError: a spec without ``":"``, or a name that is neither an
            adapter nor a function returning one.
        ImportError: the module does not import.
        AttributeError: the module has no such name.

    Examples:
        >>> load_adapter("attention_ref.conformance.shipped:torch_sdpa_math").name
        'torch-sdpa-math'
    """
    obj: object = spec
    if isinstance(spec, str):
        module_name, sep, attribute = spec.partition(":")
        if not sep or not module_name or not attribute:
            raise ValueError(f"an adapter is given as 'package.module:name', got {spec!r}")
        obj = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    if not isinstance(obj, Adapter) and callable(obj):
        obj = obj()
    if not isinstance(obj, Adapter):
        raise ValueError(
            f"{spec!r} must name an attention_ref.conformance.Adapter or a function returning one, "
            f"got {type(obj).__name__}"
        )
    return obj
