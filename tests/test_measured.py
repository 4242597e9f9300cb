"""attention_ref.measured: the committed results are found from any working directory, or named."""

from __future__ import annotations

from pathlib import Path

import pytest

from attention_ref import measured

ROOT = Path(__file__).resolve().parents[1]


def test_the_results_are_found_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert measured.results_folder() == ROOT / "benchmarks" / "results"
    assert measured.results_folder("kv-cache") == ROOT / "benchmarks" / "results" / "kv-cache"
    assert list(measured.results_folder("kv-cache").glob("kv-cache-*.json"))


def test_outside_a_checkout_the_error_says_where_the_results_live(tmp_path, monkeypatch):
    # an installed wheel: the package's folder has no benchmarks/ beside it
    monkeypatch.setattr(measured, "_RESULTS", tmp_path / "benchmarks" / "results")
    with pytest.raises(FileNotFoundError, match=r"no benchmarks/results/kv-cache next to attention_ref .*"
                       r"live in a checkout of the repository"):
        measured.results_folder("kv-cache")
    with pytest.raises(FileNotFoundError, match=r"no benchmarks/results next to"):
        measured.results_folder()


@pytest.mark.parametrize("kind", ["../src", "/etc", "kv-cache/../../x"])
def test_a_kind_outside_the_results_is_refused(kind):
    with pytest.raises(ValueError, match=f"kind must name a folder inside benchmarks/results, got '{kind}'"):
        measured.results_folder(kind)
    with pytest.raises(TypeError, match="kind must be a str, got int"):
        measured.results_folder(3)
