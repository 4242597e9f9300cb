"""What a run found: one result per case, as a table, JSON and a one-line summary.

`Report` is what `attention_ref.conformance.run` returns; `agreement_matrix`
puts several reports side by side, one column per adapter and one row per
scenario, as the "Conformance" page shows them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["STATUSES", "CaseResult", "Report", "agreement_matrix"]

#: A case's outcome, in pytest's words. ``failed``: the checker rejected the result;
#: ``error``: the kernel raised, or a known bug's repro did
#: (`attention_ref.conformance.ReproError`); ``xfailed``: a known bug, its repro still
#: reproducing; ``xpassed``: a known bug whose repro still reproduces did not show in the
#: case (the entry, or the adapter, needs a look). A ``passed`` case with a detail is a
#: known bug whose repro no longer reproduces: fixed upstream, it appears; the entry can go.
STATUSES = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
_PROBLEMS = ("failed", "error", "xpassed")


@dataclass(frozen=True)
class CaseResult:
    """One case's outcome: its id and parts, the status, why, and how long it took."""

    id: str
    scenario: str
    dtype: str
    direction: str
    shape: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    """The results of one adapter on one size of the matrix.

    Attributes:
        adapter: the adapter's name.
        description: its one-line description.
        size: ``"quick"`` or ``"full"``.
        device: where the inputs were.
        results: one `CaseResult` per case, in the matrix's order.
        versions: the versions of the libraries involved (torch, transformers, ...).
        seconds: the wall time of the run.
    """

    adapter: str
    description: str
    size: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """``{status: number of cases}`` for every status, zeros included."""
        counted = Counter(r.status for r in self.results)
        return {status: counted.get(status, 0) for status in STATUSES}

    @property
    def ok(self) -> bool:
        """No case failed, raised or passed against a known bug."""
        return not self.problems()

    def problems(self) -> list[CaseResult]:
        """The results that need a look: ``failed``, ``error`` and ``xpassed``."""
        return [r for r in self.results if r.status in _PROBLEMS]

    def notes(self) -> list[CaseResult]:
        """The passed cases with something to say: a known bug whose repro no longer reproduces."""
        return [r for r in self.results if r.status == "passed" and r.detail]

    def summary(self) -> str:
        """One line: ``"torch-sdpa-math (quick, cpu): 60 passed, 2 xfailed, 30 skipped in 1.2 s"``."""
        parts = [f"{n} {status}" for status, n in self.counts().items() if n]
        return f"{self.adapter} ({self.size}, {self.device}): {', '.join(parts) or 'no cases'} in {self.seconds:.1f} s"

    def table(self, statuses: Sequence[str] | None = None, width: int = 100) -> str:
        """A text table, one line per case: id, status, time and the first line of why.

        Args:
            statuses: only the cases with these statuses (``None``: all).
            width: the longest line; the reason is cut to fit.
        """
        rows = [r for r in self.results if statuses is None or r.status in statuses]
        if not rows:
            return "(no cases)"
        id_width = max(len("case"), *(len(r.id) for r in rows))
        head = f"{'case':<{id_width}}  {'status':<8} {'ms':>7}  detail"
        lines = [head, "-" * min(width, max(len(head), 40))]
        for r in rows:
            detail = r.detail.strip().splitlines()[0] if r.detail.strip() else ""
            line = f"{r.id:<{id_width}}  {r.status:<8} {r.seconds * 1e3:>7.1f}  {detail}"
            lines.append(line if len(line) <= width else line[: width - 3] + "...")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Everything, as plain data: the adapter, the versions, the counts and every result."""
        return {
            "adapter": self.adapter,
            "description": self.description,
            "size": self.size,
            "device": self.device,
            "versions": self.versions,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "results": [asdict(r) for r in self.results],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        """The `Report` that `to_dict` wrote (a committed run, say); other keys are ignored."""
        return cls(data["adapter"], data["description"], data["size"], data["device"],
                   [CaseResult(**result) for result in data["results"]], dict(data["versions"]), data["seconds"])

    def to_json(self, indent: int | None = 1) -> str:
        """`to_dict` as JSON."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        problems = self.problems()
        body = self.table(_PROBLEMS) if problems else "every case run agreed with the reference"
        notes = "".join(f"\nnote, {r.id}: {r.detail}" for r in self.notes())
        return f"{self.summary()}\n{body}{notes}"


def _cell(results: list[CaseResult]) -> str:
    """One matrix cell: ``ok``, ``FAIL 2/6``, ``xfail 6/6`` or ``-`` (every case skipped)."""
    run = [r for r in results if r.status != "skipped"]
    if not run:
        return "-"
    counted = Counter(r.status for r in run)
    bad = counted["failed"] + counted["error"] + counted["xpassed"]
    if bad:
        return f"FAIL {bad}/{len(run)}"
    if counted["xfailed"]:
        return f"xfail {counted['xfailed']}/{len(run)}"
    return "ok"


def agreement_matrix(reports: Sequence[Report]) -> str:
    """A Markdown table: one row per scenario, one column per adapter.

    A cell reads ``ok`` when every case of the scenario the adapter ran agreed
    with the reference, ``FAIL n/m`` when ``n`` of ``m`` failed (or raised),
    ``xfail n/m`` for known bugs, and ``-`` when the adapter supports none of them.
    """
    scenarios: list[str] = []
    for report in reports:
        for r in report.results:
            if r.scenario not in scenarios:
                scenarios.append(r.scenario)
    header = "| scenario | " + " | ".join(r.adapter for r in reports) + " |"
    rule = "|---|" + "---|" * len(reports)
    lines = [header, rule]
    for scenario in scenarios:
        cells = [_cell([r for r in report.results if r.scenario == scenario]) for report in reports]
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
