"""The adapter protocol: how a kernel is described to the suite.

An `Adapter` is a name, a call, a layout and the features the kernel supports.
The call takes a `attention_ref.conformance.cases.Problem` (the case's tensors
in the adapter's layout and its arguments) and returns the attention output::

    def call(p):
        return my_attention(p.query, p.key, p.value, causal=p.is_causal, softmax_scale=p.scale)

    adapter = Adapter("mine", call, layout="blhd", supports={"causal", "backward"})

The suite runs every case whose features the adapter supports, in the dtypes it
lists, and skips the others with the reason. Known bugs are `KnownFailure`
entries: the case is expected to fail while the named library is at most the
version the bug was seen in, and the report says so when it passes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from attention_ref.conformance.cases import DTYPES, FEATURES, LAYOUTS, Case, Problem

__all__ = ["Adapter", "KnownFailure", "Unsupported", "load_adapter", "version_tuple"]


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


@dataclass(frozen=True)
class KnownFailure:
    """A bug found in a library: the cases it breaks, keyed by the versions it was seen in.

    Attributes:
        reason: what is wrong, in one sentence.
        library: the distribution the bug is in (``"transformers"``, ``"torch"``).
        seen_in: the version it was seen in, or the versions (each one checked):
            ``("5.23.0", "5.24.0")``. The failure is expected while the installed
            version is at most the newest of them; in a later version the case is
            judged plainly again (it passes once fixed; a failure names this entry,
            and once the bug is confirmed there its version joins ``seen_in``).
        applies: which cases it breaks: a predicate on `Case`, or a set of case ids
            and scenario names (a scenario name: every dtype and direction of it).
        dtypes: only in these dtypes (``None``: all).
        backward_only: only the bwd cases.

    Raises:
        ValueError: ``seen_in`` empty, or not version numbers.
    """

    reason: str
    library: str
    seen_in: str | tuple[str, ...]
    applies: Callable[[Case], bool] | frozenset[str] = field(compare=False)
    dtypes: tuple[torch.dtype, ...] | None = None
    backward_only: bool = False

    def __post_init__(self) -> None:
        versions = (self.seen_in,) if isinstance(self.seen_in, str) else tuple(self.seen_in)
        if not versions:
            raise ValueError(f"KnownFailure {self.reason!r}: seen_in must name at least one version, got ()")
        for version in versions:
            version_tuple(version)  # raises, naming it, on what is not a version number
        object.__setattr__(self, "seen_in", tuple(sorted(versions, key=version_tuple)))

    @property
    def newest_seen(self) -> str:
        """The newest version the bug was seen in: it is expected up to this one."""
        return self.seen_in[-1]

    def matches(self, case: Case) -> bool:
        """Whether this bug is about ``case`` (whatever the installed version)."""
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
        """Whether the installed library is at most the newest ``seen_in`` (so the bug is still expected)."""
        installed = self.installed()
        return installed is not None and version_tuple(installed) <= version_tuple(self.newest_seen)

    def describe(self) -> str:
        """``"<reason> (seen in <library> <version>[, <version>] and <version>)"``."""
        seen = self.seen_in[0] if len(self.seen_in) == 1 else (
            ", ".join(self.seen_in[:-1]) + " and " + self.seen_in[-1])
        return f"{self.reason} (seen in {self.library} {seen})"


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
        layout: ``"bhld"`` (heads before positions, torch's) or ``"blhd"``
            (FlashAttention's): the layout of the tensors the call gets.
        output_layout: the layout of what the call returns; defaults to ``layout``
            (transformers' attention functions take ``"bhld"`` and return ``"blhd"``).
        dtypes: the dtypes the kernel takes; the cases in others are skipped.
        known_failures: bugs found, each pinned to a library version.
        notes: why a feature is not supported, shown as the skip reason.
        description: one line for the report.

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
        """The known bug about ``case``, if any (whatever the installed version)."""
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
