"""Committed measurements: where a checkout of the repository keeps them.

The benchmarks write JSON files with their provenance under ``benchmarks/results/`` of
the repository, and several pages show those numbers. They are not part of the installed
package: a page run from a checkout (or an editable install, ``pip install -e``) finds
them from whatever folder it runs in; run against an installed wheel it stops with an
error that says where they are, instead of printing an empty table.

Example:
    >>> from attention_ref.measured import results_folder
    >>> results_folder("kv-cache").name
    'kv-cache'
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["results_folder"]

_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def results_folder(kind: str = "") -> Path:
    """The folder of committed results ``benchmarks/results/<kind>`` of this package's checkout.

    Found next to the package's own source, not the working directory, so a script run
    from any folder finds it.

    Args:
        kind: a sub-folder (``"kv-cache"``, ``"conformance"``); ``""`` for the top one.

    Returns:
        The folder.

    Raises:
        FileNotFoundError: the package is not installed from a checkout (a wheel), or
            the checkout has no such folder: the message says where the files live.
        TypeError: ``kind`` is not a str.
        ValueError: ``kind`` is absolute or climbs out of ``benchmarks/results``.
    """
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str, got {type(kind).__name__}")
    if Path(kind).is_absolute() or ".." in Path(kind).parts:
        raise ValueError(f"kind must name a folder inside benchmarks/results, got {kind!r}")
    folder = _RESULTS / kind
    if not folder.is_dir():
        where = f"benchmarks/results/{kind}".rstrip("/")
        raise FileNotFoundError(
            f"no {where} next to attention_ref ({_RESULTS.parent.parent}): the committed measurements "
            "live in a checkout of the repository; run this from a clone installed with pip install -e")
    return folder
