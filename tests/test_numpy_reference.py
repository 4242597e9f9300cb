"""The pure NumPy reference: parity with the torch core, and cases small enough to compute by hand."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attention_ref
from attention_ref import attention_weights, scaled_dot_product_attention
from attention_ref import reference_numpy as ref

L, S, E, EV = 5, 7, 11, 13


def _ours(q, k, v, mask=None, **kwargs) -> np.ndarray:
    as_t = torch.from_numpy
    m = None if mask is None else as_t(np.asarray(mask))
    return scaled_dot_product_attention(as_t(q), as_t(k), as_t(v), m, **kwargs).numpy()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool_keys", "float", "fully_masked_rows"])
@pytest.mark.parametrize("leading", [(), (3,), (2, 3)])
def test_numpy_matches_torch_core(leading, mask_kind, is_causal):
    rng = np.random.default_rng(len(leading) * 10 + len(mask_kind) + int(is_causal))
    q, k, v = rng.normal(size=(*leading, L, E)), rng.normal(size=(*leading, S, E)), rng.normal(size=(*leading, S, EV))
    mask = {
        "none": None,
        "bool": rng.random((*leading, L, S)) < 0.6,
        "bool_keys": rng.random((S,)) < 0.6,
        "float": rng.normal(size=(L, S)),
        "fully_masked_rows": np.ones((L, S), dtype=bool),
    }[mask_kind]
    if mask_kind == "fully_masked_rows":
        mask[[1, 3]] = False
    expected = _ours(q, k, v, mask, is_causal=is_causal)
    actual = ref.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    assert actual.shape == (*leading, L, EV)
    np.testing.assert_allclose(actual, expected, atol=1e-12, rtol=1e-10)
    if mask_kind == "fully_masked_rows":
        assert (actual[..., [1, 3], :] == 0).all()


def test_numpy_custom_scale_and_empty_keys():
    rng = np.random.default_rng(7)
    q, k, v = rng.normal(size=(L, E)), rng.normal(size=(S, E)), rng.normal(size=(S, EV))
    np.testing.assert_allclose(ref.scaled_dot_product_attention(q, k, v, scale=0.3), _ours(q, k, v, scale=0.3), atol=1e-12)
    out = ref.scaled_dot_product_attention(q, k[:0], v[:0])
    assert out.shape == (L, EV) and (out == 0).all()


def test_numpy_module_imports_only_numpy():
    path = Path(attention_ref.__file__).parent / "reference_numpy.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('reference_numpy', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'reference_numpy imported torch'\n"
        "assert 'attention_ref' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- hand-computable cases: each is checked on the NumPy reference and on the torch core --------


def _both_weights(q: np.ndarray, k: np.ndarray, mask=None) -> list[np.ndarray]:
    """Weights from both implementations (NumPy via values = identity)."""
    S_ = k.shape[-2]
    numpy_w = ref.scaled_dot_product_attention(q, k, np.eye(S_), mask)
    m = None if mask is None else torch.from_numpy(np.asarray(mask))
    torch_w = attention_weights(torch.from_numpy(q), torch.from_numpy(k), m).numpy()
    return [numpy_w, torch_w]


def test_two_keys_by_hand():
    # scale = 1/sqrt(2): scores = [0, sqrt(2)] / sqrt(2) = [0, 1]  ->  weights [1, e] / (1 + e)
    q = np.array([[0.0, math.sqrt(2.0)]])
    k = np.eye(2)
    expected = np.array([[1.0, math.e]]) / (1.0 + math.e)
    for w in _both_weights(q, k):
        np.testing.assert_allclose(w, expected, rtol=1e-15, atol=0)


def test_softmax_by_hand():
    scores = np.array([[0.0, math.log(3.0)], [-np.inf, -np.inf], [5.0, 5.0]])
    np.testing.assert_allclose(ref.softmax(scores), [[0.25, 0.75], [0.0, 0.0], [0.5, 0.5]], rtol=1e-15)


def test_one_hot_mask_selects_value_rows():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(3, E)), rng.normal(size=(S, E)), rng.normal(size=(S, EV))
    chosen = [4, 0, 6]
    mask = np.zeros((3, S), dtype=bool)
    mask[np.arange(3), chosen] = True
    for out in (ref.scaled_dot_product_attention(q, k, v, mask), _ours(q, k, v, mask)):
        np.testing.assert_array_equal(out, v[chosen])  # weight exactly 1 on one key


def test_one_hot_keys_with_large_scores_select_values():
    # keys are the basis vectors, a query points at one of them: softmax is one-hot to rounding
    rng = np.random.default_rng(2)
    keys = np.eye(5)
    v = rng.normal(size=(5, EV))
    targets = [3, 1, 4]
    q = 200.0 * keys[targets]
    for out in (ref.scaled_dot_product_attention(q, keys, v, scale=1.0), _ours(q, keys, v, scale=1.0)):
        np.testing.assert_allclose(out, v[targets], rtol=1e-14, atol=1e-14)


def test_equal_scores_give_uniform_weights_and_the_mean_value():
    rng = np.random.default_rng(3)
    k, v = rng.normal(size=(S, E)), rng.normal(size=(S, EV))
    q = np.zeros((L, E))  # every score is 0
    for w in _both_weights(q, k):
        np.testing.assert_allclose(w, np.full((L, S), 1.0 / S), rtol=1e-15)
    for out in (ref.scaled_dot_product_attention(q, k, v), _ours(q, k, v)):
        np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), (L, EV)), rtol=1e-13, atol=1e-15)
    # with a mask: uniform over the keys that take part
    keep = np.array([True, False, True, True, False, False, True])
    for out in (ref.scaled_dot_product_attention(q, k, v, keep), _ours(q, k, v, keep)):
        np.testing.assert_allclose(out, np.broadcast_to(v[keep].mean(axis=0), (L, EV)), rtol=1e-13, atol=1e-15)


def test_causal_by_hand():
    # zero queries: query i averages the values 0..i
    v = np.arange(4 * 2, dtype=np.float64).reshape(4, 2)
    q = k = np.zeros((4, 3))
    expected = np.cumsum(v, axis=0) / np.arange(1, 5)[:, None]
    for out in (ref.scaled_dot_product_attention(q, k, v, is_causal=True), _ours(q, k, v, is_causal=True)):
        np.testing.assert_allclose(out, expected, rtol=1e-15)


def test_numpy_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"q and k must share E.*\(5, 11\).*\(7, 3\)"):
        ref.scaled_dot_product_attention(np.zeros((L, E)), np.zeros((S, 3)), np.zeros((S, EV)))
    with pytest.raises(ValueError, match=r"k and v must share S.*\(7, 11\).*\(5, 13\)"):
        ref.scaled_dot_product_attention(np.zeros((L, E)), np.zeros((S, E)), np.zeros((L, EV)))
