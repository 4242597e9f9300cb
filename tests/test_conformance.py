"""`attention_ref.conformance`: the case matrix, the adapter protocol, the reports, the pytest plugin.

Every shipped adapter runs the quick matrix here and must agree with the reference
on every case it supports, except the known bugs, each carrying a small repro run
against the installed library: expected to fail while the repro reproduces,
whatever the version, and judged plainly once it stops (a stand-in library with a
planted bug, switched on and off, holds the rule to both). Adapters with planted bugs (a
wrong scale, an ignored mask, GQA heads in the wrong order, the other causal
alignment, an inverted boolean mask, a forgotten transpose) must be reported on
exactly the cases that exercise the bug. The FP8 family likewise: the emulated FlashAttention-3
path passes, and a descale applied twice or left out, K's and V's descales swapped, P saturating
while the row sum counts it in full, per-head descales expanded with ``repeat`` fail every FP8
case (the NSA and MoBA families: ``tests/test_conformance_sparse.py``). ``torch.compile`` on CPU
takes minutes: the compiled FlexAttention adapters run only with ``ATTENTION_REF_SLOW_TESTS=1``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attention_ref import conformance, quant
from attention_ref.conformance import Adapter, FP8Path, KnownFailure, shipped
from attention_ref.conformance import adapter as adapter_module
from attention_ref.conformance.runner import expected_failure
from attention_ref.conformance.cases import FEATURES, SCENARIOS, by_id, matrix


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the cases are tiny, and on a busy machine OpenMP's spinning threads
    cost more than the arithmetic (measured: 10x the CPU time of the whole file)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
SLOW = pytest.mark.skipif(not os.environ.get("ATTENTION_REF_SLOW_TESTS"),
                          reason="torch.compile on CPU takes minutes: set ATTENTION_REF_SLOW_TESTS=1")
HF_FLEX = {"float_mask_per_head-float32-fwd-small", "float_mask_batch1-float32-fwd-small"}
TORCH_FLEX = {f"softcap-{dtype}-fwd-small" for dtype in ("float32", "float16", "bfloat16")}
# Each shipped adapter: the cases its known bugs break (expected to fail while their repros reproduce here) and
# how many must pass at least.
EXPECTED = {
    "torch-sdpa-math": (set(), 50),
    "torch-sdpa-flash": (set(), 50),
    "torch-flex": (TORCH_FLEX, 38),
    "torch-multihead": (set(), 35),
    "hf-sdpa": (set(), 70),
    "hf-flex": (HF_FLEX, 36),
    "hf-eager": (set(), 65),
    "attention_ref-math": (set(), 88),
    "attention_ref-tiled": (set(), 88),
    "attention_ref-triton": (set(), 30),
}


# ---- the matrix ----------------------------------------------------------------------------------


def test_the_matrix_sizes_and_ids():
    quick, full = matrix("quick"), matrix("full")
    assert (len(quick), len(full)) == (90, 336)
    assert len({c.id for c in full}) == len(full)  # every id names one case
    assert {c.id for c in quick} <= {c.id for c in full}  # a quick case reruns by its id in full
    assert quick[0].id == "plain-float32-fwd-small"
    assert by_id("causal_bottom_right-float16-bwd-medium").shape == "medium"
    with pytest.raises(KeyError, match="no conformance case has the id 'causal-float64-fwd-small'"):
        by_id("causal-float64-fwd-small")
    with pytest.raises(ValueError, match=r"size must be one of \('quick', 'full'\), got 'huge'"):
        matrix("huge")


def test_every_feature_is_exercised_and_every_scenario_needs_known_features():
    used = set().union(*(s.features for s in SCENARIOS.values())) | {"backward"}
    assert used == set(FEATURES)


def test_a_case_is_the_same_numbers_every_time():
    case = by_id("gqa-bfloat16-bwd-small")
    a, b = case.build(), case.build()
    assert case.seed == 3760335049  # zlib.crc32(b"gqa-bfloat16-bwd-small"), on every machine
    for x, y in ((a.query, b.query), (a.key, b.key), (a.value, b.value)):
        assert torch.equal(x, y) and x.dtype == torch.bfloat16
    assert a.query.shape == (2, 6, 5, 16) and a.key.shape == (2, 2, 7, 16)  # H = 6, Hkv = 2, L = 5, S = 7


def test_dense_mask_in_each_convention():
    p = by_id("causal_bool_mask-float32-fwd-small").build().problem("bhld", requires_grad=False)
    keep = p.dense_mask()  # bool: the attn_mask and the top-left causal rule
    assert keep.dtype == torch.bool and keep.shape == (2, 3, 5, 7)
    assert not keep[..., 0, 1:].any() and torch.equal(keep, p.attn_mask & torch.ones(5, 7, dtype=torch.bool).tril())
    float_mask = p.dense_mask(fill=torch.finfo(torch.float32).min)  # transformers' eager convention
    assert float_mask.dtype == torch.float32
    assert torch.equal(float_mask == 0, keep) and (float_mask[~keep] == torch.finfo(torch.float32).min).all()
    assert by_id("plain-float32-fwd-small").build().problem("bhld", False).dense_mask() is None


def test_a_blhd_problem_is_the_transpose_and_paged_pools_hold_the_dense_keys():
    inputs = by_id("paged_prefill-float32-fwd-small").build()
    p = inputs.problem("blhd", requires_grad=False)
    assert torch.equal(p.query, inputs.query.transpose(1, 2))
    assert p.key.shape == (8, 4, 3, 16)  # (num_blocks, block_size, Hkv, E): FlashAttention's pool, 5 blocks used
    b, position = 0, 6  # sequence 0's position 6: block table entry 6 // 4, slot 6 % 4
    block = int(p.block_table[b, position // 4])
    assert torch.equal(p.key[block, position % 4], inputs.key[b, :, position])


# ---- the shipped adapters ------------------------------------------------------------------------------


#: The adapters whose quick matrix is a heavy sweep of another library's FlexAttention (about 10 s each alone:
#: dynamo traces the mods of every case): with `dev.py check --newest` they run in the newest tier only, and the
#: pinned torch and transformers run them on the conformance page (float32, the build and the shown code).
FLEX_SWEEPS = {"torch-flex", "hf-flex"}


#: The adapter that runs the Triton kernel (under Triton's interpreter on a CPU): marked ``triton_kernel``.
TRITON_ADAPTERS = {"attention_ref-triton"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.sweep) if name in FLEX_SWEEPS
                                  else pytest.param(name, marks=pytest.mark.triton_kernel) if name in TRITON_ADAPTERS
                                  else name for name in sorted(EXPECTED)])
def test_shipped_adapter_agrees_with_the_reference_except_its_known_bugs(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    if name == "attention_ref-triton":
        pytest.importorskip("triton")
    report = conformance.run(shipped.SHIPPED[name](), "quick")
    assert report.ok, str(report)
    known, at_least = EXPECTED[name]
    adapter = shipped.SHIPPED[name]()  # the known failures whose repros reproduce with the library installed here
    showing = {case_id for case_id in known if adapter.known_failure(by_id(case_id)).expected()}
    assert {r.id for r in report.results if r.status == "xfailed"} == showing
    assert report.counts()["passed"] >= at_least, report.summary()


def test_known_bugs_carry_a_repro_and_say_why():
    pytest.importorskip("transformers")
    flex = shipped.hf_flex()
    known = flex.known_failure(by_id("float_mask_per_head-float32-fwd-small"))
    assert known.library == "transformers" and known.first_seen == "5.23.0"
    assert "head 0's float mask to every head" in known.describe()
    assert known.describe().endswith("(transformers, first seen in 5.23.0)")
    assert flex.known_failure(by_id("float_mask-float32-fwd-small")) is None  # (B, 1, L, S): no bug
    # both bugs reproduce with the transformers installed here (the pinned release and the newest)
    assert [k.expected() for k in flex.known_failures] == [True, True]


@pytest.mark.parametrize("version", ["9.99.0", "5.22.0"])
def test_the_shipped_flex_bugs_are_expected_in_any_release_that_still_has_them(version, monkeypatch):
    """The repros decide, not the version: the transformers installed here, reported as a release the
    entries never saw, still shows both bugs, so its float-mask cases stay expected failures."""
    transformers = pytest.importorskip("transformers")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "transformers" else real(name))
    monkeypatch.setattr(transformers, "__version__", version)
    monkeypatch.setattr(adapter_module, "_REPRO_RESULTS", {})  # run the repros again, under this version
    report = conformance.run(shipped.hf_flex(), select=sorted(HF_FLEX))
    assert [r.status for r in report.results] == ["xfailed", "xfailed"] and report.ok, str(report)
    assert all(f"its repro reproduces with transformers {version}\n" in r.detail for r in report.results)
    assert f"transformers {version} flex_attention_forward" in report.description


def test_the_shipped_flex_repros_see_a_fix_and_cannot_tell_a_different_answer(monkeypatch):
    """Each shipped repro says False once transformers is fixed (here: a flex_attention_forward that adds the
    mask broadcast as it should), and cannot tell when transformers gives an answer neither right nor the bug's."""
    pytest.importorskip("transformers")
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex_module

    def fixed(module, query, key, value, attention_mask, **kwargs):
        full = attention_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])  # (B, H, L, S)
        out = flex_attention(query, key, value, score_mod=lambda score, b, h, q, kv: score + full[b, h, q, kv])
        return out.transpose(1, 2), None  # (B, L, H, E), as transformers returns it

    def zeros(module, query, key, value, attention_mask, **kwargs):
        return torch.zeros_like(query).transpose(1, 2), None

    for forward, expected in [(fixed, [False, False]), (zeros, [conformance.ReproError] * 2)]:
        monkeypatch.setattr(hf_flex_module, "flex_attention_forward", forward)
        monkeypatch.setattr(adapter_module, "_REPRO_RESULTS", {})
        answers = []
        for known in shipped.hf_flex().known_failures:
            try:
                answers.append(known.expected())
            except conformance.ReproError as error:
                assert "the library gives neither the right output nor the bug's" in str(error)
                answers.append(type(error))
        assert answers == expected, forward.__name__


def test_the_torch_flex_repro_sees_the_captured_float_bug_a_fix_and_a_different_answer(monkeypatch):
    """The repro of eager flex_attention's captured-float bug (torch 2.15.0) against stand-ins for flex_attention:
    one that refuses the second score_mod as 2.15.0 does (True), a right one (False), and one that gives
    another answer (it cannot tell). Then the installed torch: the soft-capping cases are xfailed exactly
    while the repro reproduces, else judged plainly and passed, the report saying why."""
    from torch.nn.attention import flex_attention as flex_module

    def right(q, k, v, score_mod, **kwargs):  # flex_attention's definition, score_mod on every score at once
        B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        b, h, q_idx, kv_idx = (torch.arange(n).view([-1 if i == j else 1 for j in range(4)])
                               for i, n in enumerate((B, H, L, S)))  # broadcast to (B, H, L, S)
        scores = score_mod((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, b, h, q_idx, kv_idx)
        return torch.softmax(scores, dim=-1) @ v

    calls = []

    def refuses_the_second(q, k, v, score_mod, **kwargs):
        calls.append(score_mod)
        if len(calls) > 1:
            raise RuntimeError("(zf64,) can only be of (Tensor, int, SymInt) but got (<class 'torch.SymFloat'>,)")
        return right(q, k, v, score_mod)

    def zeros(q, k, v, **kwargs):
        return torch.zeros_like(q)

    (known,) = shipped.torch_flex().known_failures
    for flex, expected in [(refuses_the_second, True), (right, False), (zeros, conformance.ReproError)]:
        monkeypatch.setattr(flex_module, "flex_attention", flex)
        monkeypatch.setattr(adapter_module, "_REPRO_RESULTS", {})
        try:
            answer = known.expected()
        except conformance.ReproError as error:
            assert "the library gives neither the right output nor the bug's" in str(error)
            answer = conformance.ReproError
        assert answer is expected, flex.__name__
    monkeypatch.undo()
    monkeypatch.setattr(adapter_module, "_REPRO_RESULTS", {})
    report = conformance.run(shipped.torch_flex(), select=["plain-float32-fwd-small", "softcap-float32-fwd-small",
                                                           "softcap-float16-fwd-small"])
    softcap = [r for r in report.results if r.scenario == "softcap"]
    assert report.ok, str(report)
    if known.expected():
        assert [r.status for r in softcap] == ["xfailed", "xfailed"]
    else:
        assert [r.status for r in softcap] == ["passed", "passed"]
        why = "an older release" if known.predates() else "fixed upstream, it appears"
        assert all(why in r.detail for r in softcap), [r.detail for r in softcap]


def test_unsupported_features_are_skipped_with_the_reason():
    report = conformance.run(shipped.torch_flex(), select=["causal-float32-bwd-small", "sinks-float32-fwd-small"])
    reasons = {r.id: r.detail for r in report.results}
    assert reasons["causal-float32-bwd-small"] == (
        "torch-flex does not support backward (backward: FlexAttention has no backward on CPU (NotImplementedError))")
    assert reasons["sinks-float32-fwd-small"] == "torch-flex does not support sinks"


@pytest.mark.sweep  # the first compile: 33 s (torch 2.13) and 38 s (torch 2.15) of a check's test time on 2 cores
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("factory", [shipped.torch_flex_compiled, shipped.hf_flex_compiled])
def test_compiled_flex_adapters_run_one_case_in_every_run(factory):
    """One compile each, so that every shipped adapter runs in CI; more below. Marked ``sweep``: with
    ``dev.py check --newest`` (CI) it runs once, with the newest torch and transformers."""
    if factory is shipped.hf_flex_compiled:
        pytest.importorskip("transformers")
    report = conformance.run(factory(), select=["plain-float32-fwd-small"])
    assert [r.status for r in report.results] == ["passed"], str(report)


@SLOW
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("factory", [shipped.torch_flex_compiled, shipped.hf_flex_compiled])
def test_compiled_flex_adapters(factory):
    if factory is shipped.hf_flex_compiled:
        pytest.importorskip("transformers")
    ids = ["plain-float32-fwd-small", "float_mask-float32-fwd-small", "causal_bottom_right-float32-fwd-small",
           "document-float32-fwd-small", "softcap-float16-fwd-small"]
    report = conformance.run(factory(), select=ids)
    assert report.ok, str(report)
    statuses = {r.id: r.status for r in report.results}
    if factory is shipped.hf_flex_compiled:  # its float masks crash the process on a CPU: not run
        assert statuses.pop("float_mask-float32-fwd-small") == "skipped"
    assert set(statuses.values()) == {"passed"}, str(report)


# ---- break the code: planted bugs are reported where they show -------------------------------------------


def _sdpa(p, **overrides):
    kwargs = {"attn_mask": p.attn_mask, "is_causal": p.is_causal, "scale": p.scale, "enable_gqa": p.enable_gqa}
    kwargs.update(overrides)
    mask = kwargs["attn_mask"]
    if kwargs["is_causal"] and mask is not None:  # torch takes one or the other: fold the causal rule in
        causal = torch.ones(p.query.shape[-2], p.key.shape[-2], dtype=torch.bool).tril()
        mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, float("-inf"))
        kwargs.update(attn_mask=mask, is_causal=False)
    return F.scaled_dot_product_attention(p.query, p.key, p.value, **kwargs)


def _wrong_gqa_order(p):
    if not p.enable_gqa:
        return _sdpa(p)
    groups = p.query.shape[1] // p.key.shape[1]
    key, value = p.key.repeat(1, groups, 1, 1), p.value.repeat(1, groups, 1, 1)  # should be repeat_interleave
    return F.scaled_dot_product_attention(p.query, key, value, attn_mask=p.attn_mask, is_causal=p.is_causal,
                                          scale=p.scale)


def _transposed_back_forgotten(p):
    bhld = {"query": p.query.transpose(1, 2), "key": p.key.transpose(1, 2), "value": p.value.transpose(1, 2)}
    return _sdpa(dataclasses.replace(p, layout="bhld", **bhld))  # returned as (B, H, L, Ev), not blhd


def _inverted_bool_mask(p):
    mask = p.attn_mask
    return _sdpa(p, attn_mask=~mask if mask is not None and mask.dtype == torch.bool else mask)


BOOL_MASKS = {"key_padding", "bool_mask", "bool_mask_batch1", "empty_rows", "causal_bool_mask"}
# name: (call, layout, the scenarios that must fail (None: all it runs), (a case, the likely cause it names))
PLANTED = {
    "scale 1/E": (lambda p: _sdpa(p, scale=1 / p.query.shape[-1]), "bhld", None,
                  ("plain", "likely cause: scale = 1/E = 0.0625 instead of 1/sqrt(E) = 0.25")),
    "mask ignored": (lambda p: _sdpa(p, attn_mask=None), "bhld",
                     BOOL_MASKS | {"float_mask", "float_mask_per_head", "float_mask_batch1"}, None),
    "gqa heads repeated, not interleaved": (_wrong_gqa_order, "bhld", {"gqa"},
                                            ("gqa", "likely cause: the key and value heads in the wrong GQA order")),
    "bottom-right causal taken as top-left": (lambda p: _sdpa(p, is_causal=p.causal is not None), "bhld",
                                              {"causal_bottom_right", "causal_bottom_right_tall",
                                               "gqa_bottom_right"}, None),
    "bool mask inverted": (_inverted_bool_mask, "bhld", BOOL_MASKS,
                           ("bool_mask", "likely cause: the boolean attn_mask is inverted")),
    "output not transposed back": (_transposed_back_forgotten, "blhd", None, None),
}
_SUPPORTS = {"backward", "scale", "value_dim", "gqa", "mqa", "key_padding", "bool_mask", "float_mask", "empty_rows",
             "causal", "causal_bottom_right"}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_bug_is_reported_on_the_cases_that_exercise_it(name):
    call, layout, failing, named = PLANTED[name]
    supports = _SUPPORTS - ({"causal_bottom_right"} if name != "bottom-right causal taken as top-left" else set())
    adapter = Adapter(f"planted: {name}", call, supports=supports, layout=layout)
    report = conformance.run(adapter, select=lambda c: c.dtype == torch.float32)
    bad = {r.scenario for r in report.problems()}
    run = {r.scenario for r in report.results if r.status != "skipped"}
    assert bad == (run if failing is None else failing & run) and bad, report.table()
    if named is not None:
        scenario, cause = named
        assert all(cause in r.detail for r in report.problems() if r.scenario == scenario), report.table()
    assert not report.ok and "failed" in report.summary()


def test_a_planted_bug_says_where_the_output_differs():
    adapter = Adapter("planted", PLANTED["scale 1/E"][0], supports=_SUPPORTS)
    report = conformance.run(adapter, select=["plain-float32-fwd-small"])
    (result,) = report.results
    assert result.status == "failed"
    assert re.search(r"output:\n    max\|actual - reference\|", result.detail), result.detail
    assert "likely cause" in result.detail and "query (2, 3, 5, 16), key (2, 3, 7, 16)" in result.detail


def test_an_input_whose_gradient_never_arrives_is_named():
    """Issue 32: an adapter wrapping a module that owns its sinks copies problem.sinks; the checker used to say
    only "dsinks: actual 0, reference 1.99"."""
    base = shipped.attention_ref_math()

    def copies_the_sinks(p):
        return base.call(dataclasses.replace(p, sinks=p.sinks.detach().clone()))  # the module's own parameter

    report = conformance.run(Adapter("copies", copies_the_sinks, supports=base.supports),
                             select=["sinks-float32-bwd-small", "sinks-float32-fwd-small"])
    fwd, bwd = report.results
    assert (bwd.status, fwd.status) == ("failed", "passed")
    assert bwd.detail.startswith("copies: the gradient for problem.sinks never arrives: autograd finds no path "
                                 "from the output to it"), bwd.detail
    assert "\n  dsinks:\n" in bwd.detail
    right = conformance.run(base, select=["sinks-float32-bwd-small"])  # the same case, the tensor itself: passes
    assert [r.status for r in right.results] == ["passed"]


def test_a_kernel_that_raises_is_an_error_not_a_crash():
    def broken(p):
        raise RuntimeError("kernel launch failed")

    report = conformance.run(Adapter("broken", broken), select=["plain-float32-fwd-small"])
    assert [(r.status, r.detail) for r in report.results] == [("error", "RuntimeError: kernel launch failed")]


# ---- the FP8 family: FlashAttention-3's path emulated passes, planted bugs fail every case -------------------


def _fp8_kernel(p, q_descale=None, k_descale=None, v_descale=None, **p_path):
    """`quant.fp8_attention` on the problem (bhld) with these descales (the problem's where None), P as
    FlashAttention-3 rounds it unless ``p_path`` says otherwise, in the case's output dtype."""
    descales = [p_d if d is None else d for p_d, d in zip((p.q_descale, p.k_descale, p.v_descale),
                                                           (q_descale, k_descale, v_descale), strict=True)]
    out = quant.fp8_attention(p.query, p.key, p.value, *descales, is_causal=p.causal is not None, scale=p.scale,
                              enable_gqa=True, **{"p_format": "e4m3fn", **p_path})
    return out.to(p.output_dtype)


def _q_descale_by_repeat(p):
    """Each query head's descale from the (B, Hkv) ones by ``repeat``: head h reads KV group h % Hkv's, not h // G's."""
    H, Hkv = p.query.shape[1], p.key.shape[1]
    per_head = p.q_descale.repeat(1, H // Hkv)  # (B, Hkv) -> (B, H), should be repeat_interleave
    outs = [quant.fp8_attention(p.query[:, h:h + 1], p.key[:, kv:kv + 1], p.value[:, kv:kv + 1], per_head[:, h:h + 1],
                                p.k_descale[:, kv:kv + 1], p.v_descale[:, kv:kv + 1], p_format="e4m3fn",
                                is_causal=p.causal is not None, scale=p.scale)
            for h, kv in ((h, h // (H // Hkv)) for h in range(H))]
    return torch.cat(outs, dim=1).to(p.output_dtype)  # H x (B, 1, L, Ev) -> (B, H, L, Ev)


FP8_PLANTED = {
    "v descale applied twice": lambda p: _fp8_kernel(p, v_descale=p.v_descale * p.v_descale),
    "q descale omitted": lambda p: _fp8_kernel(p, q_descale=torch.ones_like(p.q_descale)),
    "k and v descales swapped": lambda p: _fp8_kernel(p, k_descale=p.v_descale, v_descale=p.k_descale),
    # FlashAttention issue #2716: a row maximum 4 behind the offset 8, P up to 2^12 where e4m3fn ends at 448
    "P saturating, the row sum counting it in full": lambda p: _fp8_kernel(p, p_offset_log2=12),
    "per-head q descales by repeat, not repeat_interleave": _q_descale_by_repeat,
}
_FP8 = {"fp8", "gqa", "causal"}


def test_the_fp8_cases_give_quantized_inputs_their_descales_and_the_output_dtype():
    p = by_id("fp8-bfloat16-fwd-small").build().problem("blhd", requires_grad=False)
    assert p.query.dtype == p.key.dtype == torch.float8_e4m3fn and p.output_dtype == torch.bfloat16
    assert p.query.shape == (2, 5, 6, 16) and p.key.shape == (2, 129, 2, 16)  # (B, L, H, E), S one past a tile
    assert p.q_descale.shape == p.k_descale.shape == (2, 2) and p.v_descale.dtype == torch.float32  # (B, Hkv)
    assert (p.k_descale / p.v_descale).min() < 0.01 and (p.k_descale / p.v_descale).max() > 1  # far apart
    causal = by_id("fp8_causal-float16-fwd-medium").build().problem("bhld", requires_grad=False)
    assert causal.is_causal and causal.query.shape[-2] == causal.key.shape[-2] == 257
    assert [len(matrix(size, ["fp8"])) for size in ("quick", "full")] == [6, 12]  # no bwd: fwd in 3 dtypes


def test_the_emulated_flash_attention_3_path_passes_every_fp8_case():
    adapter = shipped.attention_ref_fp8()
    report = conformance.run(adapter)
    assert adapter.families == ("fp8",) and report.ok, report.table()
    assert [r.status for r in report.results] == ["passed"] * 6 and {r.scenario for r in report.results} == {
        "fp8", "fp8_causal"}
    unrounded_p = conformance.run(Adapter("p kept in float32", lambda p: _fp8_kernel(p, p_format=None),
                                          supports=_FP8))  # a tighter kernel is inside the bound too
    assert unrounded_p.ok, unrounded_p.table()


def test_an_fp8_kernel_is_judged_by_the_path_its_adapter_declares():
    """FlashAttention-4's e5m2 P rounds twice as coarsely as e4m3fn: out of FlashAttention-3's allowance on the
    causal case (its first rows weigh few keys, each heavily), within its own everywhere."""
    e5m2 = {"call": lambda p: _fp8_kernel(p, p_format="e5m2"), "supports": _FP8}
    undeclared = conformance.run(Adapter("e5m2 P as if e4m3fn", **e5m2), select=lambda c: c.dtype == torch.float32)
    assert {r.id: r.status for r in undeclared.results} == {"fp8-float32-fwd-small": "passed",
                                                            "fp8_causal-float32-fwd-small": "failed"}
    declared = conformance.run(Adapter("e5m2 P", **e5m2, fp8_path=FP8Path(p_format="e5m2")))
    assert declared.ok, declared.table()
    with pytest.raises(ValueError, match=r"p_offset_log2=10 scales P up to 2\^10 = 1024, above e4m3fn's largest "
                                         r"value 448: .*issue #2716"):
        FP8Path(p_offset_log2=10)
    with pytest.raises(ValueError, match=r"p_format must be None or one of \['e4m3fn', 'e4m3fnuz', 'e5m2', "
                                         r"'e5m2fnuz'\], got 'e4m3'"):
        FP8Path(p_format="e4m3")
    with pytest.raises(TypeError, match="adapter 'x': fp8_path must be an FP8Path, got dict"):
        Adapter("x", lambda p: p.query, supports={"fp8"}, fp8_path={"p_format": "e5m2"})


@pytest.mark.parametrize("name", sorted(FP8_PLANTED))
def test_a_planted_fp8_bug_fails_every_fp8_case(name):
    report = conformance.run(Adapter(f"planted: {name}", FP8_PLANTED[name], supports=_FP8))
    assert [r.status for r in report.results] == ["failed"] * 6, report.table()
    assert all(r.detail.startswith("assert_fp8_attention_close: ") and "breaks " in r.detail
               for r in report.results), report.table()
    assert report.summary().startswith(f"planted: {name} (quick, cpu): 6 failed")


# ---- known failures: expected while their repro reproduces ----------------------------------------------


class StandInLibrary:
    """A library with a planted bug, switched on and off: while ``fixed`` is False, a float mask reaches
    every head as head 0's (transformers' flex bug, in miniature). ``calls`` counts the runs of its repro."""

    def __init__(self):
        self.fixed = False
        self.calls = 0

    def attention(self, q, k, v, mask=None, scale=None):
        if not self.fixed and mask is not None and mask.dtype != torch.bool:
            mask = mask[:, :1]  # (B, 1, L, S): head 0's mask on every head, the planted bug
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def call(self, p):
        """The adapter's call: the case's problem through the library."""
        return self.attention(p.query, p.key, p.value, p.attn_mask, p.scale)

    def repro(self) -> bool:
        """True while a mask that hides key 0 from head 1 only does not reach head 1."""
        self.calls += 1
        q, k, v = (torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
        mask = torch.zeros(1, 2, 3, 3)  # (B, H, L, S)
        mask[0, 1, :, 0] = float("-inf")
        right = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return not torch.allclose(self.attention(q, k, v, mask), right)


PER_HEAD = ["float_mask_per_head-float32-fwd-small", "float_mask_per_head-float32-bwd-small"]
PLAIN = "plain-float32-fwd-small"
MASK_BUG = "float masks reach every head as head 0's (torch, first seen in 2.9.0)"


@pytest.fixture
def library(monkeypatch):
    monkeypatch.setattr(adapter_module, "_REPRO_RESULTS", {})  # every test runs its repros afresh
    return StandInLibrary()


def _through(library, known, call=None):
    """An adapter whose kernel calls the stand-in library (or ``call``), with ``known`` as its known bug."""
    return Adapter("through-the-library", call or library.call, supports={"float_mask", "scale", "backward"},
                   known_failures=(known,))


def _mask_bug(library, repro=None):
    return KnownFailure("float masks reach every head as head 0's", "torch", frozenset({"float_mask_per_head"}),
                        repro or library.repro, first_seen="2.9.0")


def test_a_known_failure_is_expected_while_its_repro_reproduces(library):
    report = conformance.run(_through(library, _mask_bug(library)), select=[*PER_HEAD, PLAIN])
    statuses = {r.id: r.status for r in report.results}
    assert statuses == {**dict.fromkeys(PER_HEAD, "xfailed"), PLAIN: "passed"} and report.ok, str(report)
    detail = next(r.detail for r in report.results if r.id == PER_HEAD[0])
    assert detail.startswith(f"{MASK_BUG}; its repro reproduces with torch {torch.__version__}\n"), detail
    assert library.calls == 1  # once per process, not once per case
    conformance.run(_through(library, _mask_bug(library)), select=PER_HEAD)  # a new adapter, the same repro
    assert library.calls == 1


def test_a_known_failure_whose_repro_stops_reproducing_is_judged_plainly_and_said_fixed(library):
    library.fixed = True  # the next release fixes it
    report = conformance.run(_through(library, _mask_bug(library)), select=[*PER_HEAD, PLAIN])
    assert [r.status for r in report.results] == ["passed"] * 3 and report.ok, str(report)
    fixed = (f"the known failure {MASK_BUG} no longer reproduces with torch {torch.__version__}: fixed upstream, "
             "it appears; the entry can go")
    assert {r.id: r.detail for r in report.results} == {**dict.fromkeys(PER_HEAD, fixed), PLAIN: ""}
    assert f"note, {PER_HEAD[0]}: {fixed}" in str(report)

    def still_wrong(p):  # the kernel has the bug itself, whatever the library does
        mask = p.attn_mask[:, :1] if p.attn_mask is not None and p.attn_mask.dtype != torch.bool else p.attn_mask
        return F.scaled_dot_product_attention(p.query, p.key, p.value, attn_mask=mask, scale=p.scale)

    report = conformance.run(_through(library, _mask_bug(library), still_wrong), select=[*PER_HEAD, PLAIN])
    statuses = {r.id: r.status for r in report.results}
    assert statuses == {**dict.fromkeys(PER_HEAD, "failed"), PLAIN: "passed"} and not report.ok, str(report)
    note = (f"\n  note: the known failure {MASK_BUG} no longer reproduces with torch {torch.__version__} (fixed "
            "upstream, it appears), so this failure is not that bug, or its repro misses it")
    assert all(note in r.detail for r in report.results if r.id in PER_HEAD), str(report)
    with pytest.raises(AssertionError, match=r"no longer reproduces with torch .* so this failure is not that bug"):
        conformance.check(_through(library, _mask_bug(library), still_wrong), by_id(PER_HEAD[0]))


def test_a_case_that_passes_while_its_repro_still_reproduces_is_reported(library):
    """The repro says the library has the bug, yet the case passed: the entry (or the adapter) needs a look."""
    right = shipped.torch_sdpa_math().call
    (result,) = conformance.run(_through(library, _mask_bug(library), right), select=PER_HEAD[:1]).results
    assert result.status == "xpassed"
    assert result.detail == (f"a known failure did not show, though its repro still reproduces with torch "
                             f"{torch.__version__}: {MASK_BUG} (does the entry apply to this case?)")


def test_a_repro_that_cannot_tell_is_an_error_naming_the_entry_whatever_the_kernel_did(library):
    def renamed_upstream():
        raise AttributeError("module 'library' has no attribute 'attention'")

    right = shipped.torch_sdpa_math().call
    for call, outcome in [(right, "the kernel, judged plainly, agreed with the reference"),
                          (library.call, "the kernel, judged plainly: AssertionError: ")]:
        (result,) = conformance.run(_through(library, _mask_bug(library, renamed_upstream), call),
                                    select=PER_HEAD[:1]).results
        assert result.status == "error", result
        assert result.detail.startswith(
            f"ReproError: cannot tell whether the known failure {MASK_BUG} still shows: its repro "
            "test_a_repro_that_cannot_tell_is_an_error_naming_the_entry_whatever_the_kernel_did.<locals>."
            "renamed_upstream() raised AttributeError: module 'library' has no attribute 'attention'\n  "
            + outcome), result.detail
    known = _mask_bug(library, lambda: None)  # forgot to return
    with pytest.raises(conformance.ReproError, match=r"its repro .*<lambda>\(\) must return True or False, got "
                                                     r"NoneType None"):
        known.expected()
    with pytest.raises(conformance.ReproError, match="must return True or False"):  # kept: raised again
        known.expected()
    assert expected_failure(_through(library, known), by_id(PER_HEAD[0])) is None  # not excused


def test_the_pytest_plugin_expects_a_bug_only_while_its_repro_reproduces(tmp_path):
    (tmp_path / "kernels_with_bugs.py").write_text(textwrap.dedent("""
        import torch.nn.functional as F
        from attention_ref.conformance import Adapter, KnownFailure

        def call(p):  # head 0's float mask on every head: the bug of the library underneath
            mask = p.attn_mask
            if mask is not None and mask.dtype.is_floating_point:
                mask = mask[:, :1]
            return F.scaled_dot_product_attention(p.query, p.key, p.value, attn_mask=mask, scale=p.scale)

        def broken_repro():
            raise ImportError("cannot import name 'attention' from 'library'")

        bugs = (KnownFailure("head 0's mask", "torch", frozenset({"float_mask_per_head"}), lambda: True),
                KnownFailure("batch 1 masks", "torch", frozenset({"float_mask_batch1"}), lambda: False),
                KnownFailure("plain attention", "torch", frozenset({"plain"}), broken_repro))
        adapter = Adapter("with-bugs", call, supports={"float_mask", "scale"}, known_failures=bugs)
    """))
    selected = "float32-fwd-small and (float_mask_per_head or float_mask_batch1 or plain)"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "attention_ref.conformance",
               "--attention-impl=kernels_with_bugs:adapter", "-k", selected, "-rfxX", "-q"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert re.search(r"\b1 failed, 1 passed, \d+ deselected, 1 xfailed\b", out), out
    assert re.search(r"XFAIL .*float_mask_per_head-float32-fwd-small.* - head 0's mask \(torch\); its repro "
                     r"reproduces with torch", out), out
    assert "FAILED test_suite.py::test_case[plain-float32-fwd-small]" in out, out
    assert ("ReproError: cannot tell whether the known failure plain attention (torch) still shows: its repro "
            "broken_repro() raised ImportError: cannot import name 'attention' from 'library'") in out, out


def test_a_known_failure_needs_a_repro_and_a_version_number():
    with pytest.raises(TypeError, match=r"KnownFailure 'a bug': repro must be a function repro\(\) -> bool, got "
                                        r"frozenset frozenset\(\)"):
        KnownFailure("a bug", "torch", "2.13.0", frozenset())  # the old signature: seen_in, then applies
    with pytest.raises(ValueError, match="not a version number: 'latest'"):
        KnownFailure("a bug", "torch", frozenset(), lambda: True, first_seen="latest")
    assert KnownFailure("a bug", "torch", frozenset(), lambda: True).describe() == "a bug (torch)"


# ---- the protocol's errors ---------------------------------------------------------------------------------


def test_adapter_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"adapter 'x': unknown features \['windows'\]; known: \["):
        Adapter("x", lambda p: p.query, supports={"windows"})
    with pytest.raises(ValueError, match=r"adapter 'x': layout must be one of \('bhld', 'blhd'\), got 'bshd'"):
        Adapter("x", lambda p: p.query, layout="bshd")
    with pytest.raises(ValueError, match=r"adapter 'x': dtypes must be among \['float32', 'float16', 'bfloat16'\]"):
        Adapter("x", lambda p: p.query, dtypes=(torch.float64,))
    with pytest.raises(ValueError, match="an adapter is given as 'package.module:name', got 'nomodule'"):
        conformance.load_adapter("nomodule")
    with pytest.raises(ValueError, match="must name an attention_ref.conformance.Adapter or a function returning one"):
        conformance.load_adapter("attention_ref.conformance.cases:FEATURES")
    with pytest.raises(ValueError, match=r"no quick case has the ids \['nope'\]"):
        conformance.run(shipped.torch_sdpa_math(), select=["nope"])


def test_a_wrong_output_shape_fails_with_both_shapes():
    report = conformance.run(Adapter("short", lambda p: p.query[..., :3, :]), select=["plain-float32-fwd-small"])
    assert report.results[0].detail == (
        "short returned shape (2, 3, 3, 16) in layout 'bhld', expected (2, 3, 5, 16)")


# ---- the report ----------------------------------------------------------------------------------------------


def test_the_report_as_summary_table_json_and_matrix():
    report = conformance.run(shipped.torch_sdpa_math(),
                             select=["plain-float32-fwd-small", "sinks-float32-fwd-small", "causal-float32-bwd-small"])
    assert re.fullmatch(r"torch-sdpa-math \(quick, cpu\): 2 passed, 1 skipped in \d+\.\d s", report.summary())
    lines = report.table().splitlines()
    assert lines[0].split() == ["case", "status", "ms", "detail"]
    assert [line.split()[:2] for line in lines[2:]] == [
        ["plain-float32-fwd-small", "passed"], ["causal-float32-bwd-small", "passed"],
        ["sinks-float32-fwd-small", "skipped"]]
    data = json.loads(report.to_json())
    assert data["counts"]["passed"] == 2 and data["versions"]["torch"] == torch.__version__
    assert [r["id"] for r in data["results"]] == [r.id for r in report.results]
    again = conformance.Report.from_dict(data)  # a committed run read back, as the Conformance page does
    assert again.results == report.results and again.versions == report.versions
    assert again.summary() == report.summary().rsplit(" in ", 1)[0] + f" in {round(report.seconds, 3):.1f} s"
    assert conformance.agreement_matrix([report]).splitlines() == [
        "| scenario | torch-sdpa-math |", "|---|---|", "| plain | ok |", "| causal | ok |", "| sinks | - |"]


def test_progress_goes_to_stderr(capsys):
    conformance.run(shipped.torch_sdpa_math(), select=["plain-float32-fwd-small"], progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "torch-sdpa-math" in captured.err


# ---- the pytest plugin -----------------------------------------------------------------------------------------


def test_the_pytest_plugin_runs_the_suite_on_a_named_adapter(tmp_path):
    (tmp_path / "my_kernels.py").write_text(textwrap.dedent("""
        import torch.nn.functional as F
        from attention_ref.conformance import Adapter

        def call(p):
            return F.scaled_dot_product_attention(p.query, p.key, p.value, scale=p.scale) * 1.01

        adapter = Adapter("slightly-off", call, supports={"scale"})
    """))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "attention_ref.conformance",
               "--attention-impl=my_kernels:adapter", "-k", "plain-float32 or scale-float32 or causal-float32-fwd",
               "-rfs", "-q"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "FAILED" in out and "test_case[plain-float32-fwd-small]" in out and "likely cause" in out
    assert "slightly-off does not support causal" in out and "slightly-off does not support backward" in out
    assert "2 failed, 4 skipped" in out, out


def test_the_plugin_leaves_quick_and_full_to_another_plugin_that_owns_them(tmp_path):
    """Loaded in every pytest run where the package is installed, the plugin must not break a run whose
    own plugin defines --full: it keeps --attention-size for itself."""
    (tmp_path / "other_plugin.py").write_text(textwrap.dedent("""
        def pytest_addoption(parser):
            parser.addoption("--full", action="store_true", help="another plugin's --full")
    """))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "other_plugin", "--pyargs",
               "attention_ref.conformance", "--attention-impl=attention_ref.conformance.shipped:attention_ref_math",
               "--attention-size=full", "-k", "plain-float16-fwd-medium", "-q"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


# ---- the full run's script ---------------------------------------------------------------------------------------


def test_the_full_run_script_writes_json_with_provenance(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import conformance_full
    finally:
        sys.path.pop(0)
    out = tmp_path / "run.json"
    argv = ["--size", "quick", "--adapters", "attention_ref-tiled", "--no-progress", "--out", str(out)]
    assert conformance_full.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["provenance"]["command"] == "python benchmarks/conformance_full.py " + " ".join(argv)
    assert record["provenance"]["versions"]["torch"] == torch.__version__ and "git_commit" in record["provenance"]
    assert record["config"]["cases"] == 90
    assert record["summary"]["attention_ref-tiled"]["passed"] == 90


def _conformance_full():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import conformance_full
    finally:
        sys.path.pop(0)
    return conformance_full


@pytest.mark.own("the full-run script's shards and processes against its one-process record: the adapters' "
                 "verdicts are judged by the tests above")
def test_the_full_run_split_over_processes_gives_the_one_process_record(tmp_path):
    full = _conformance_full()
    one, split = tmp_path / "one.json", tmp_path / "split.json"
    base = ["--size", "quick", "--adapters", "attention_ref-math", "torch-sdpa-math", "--no-progress"]
    assert full.main([*base, "--out", str(one)]) == 0
    assert full.main([*base, "--jobs", "2", "--shards", "3", "--out", str(split)]) == 0
    for name in ("attention_ref-math", "torch-sdpa-math"):
        a, b = (json.loads(p.read_text())["reports"][name] for p in (one, split))
        assert [(r["id"], r["status"]) for r in a["results"]] == [(r["id"], r["status"]) for r in b["results"]]
        assert b["processes"] == 3 and b["not_reached"] == 0 and b["counts"] == a["counts"]


def test_a_lost_cuda_context_ends_the_process_and_the_next_goes_on_from_the_next_case(monkeypatch):
    full = _conformance_full()
    base = shipped.torch_sdpa_math()

    def call(p):
        if p.scale is not None:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return base.call(p)

    monkeypatch.setitem(shipped.SHIPPED, "asserting", lambda: conformance.Adapter("asserting", call,
                                                                                    supports=base.supports))
    first = full._run_adapter("asserting", "quick", torch.device("cpu"), False, None)
    (lost,) = first["context_lost_at"]
    assert lost.startswith("scale-") and first["not_reached"] > 0 and first["results"][-1]["status"] == "error"
    rest = full._run_adapter("asserting", "quick", torch.device("cpu"), False, None, after=lost)
    merged = full._merge([first, rest], "quick")
    assert len(merged["context_lost_at"]) >= 2 and merged["processes"] == 2
    assert [r["id"] for r in merged["results"]][:len(first["results"])] == [r["id"] for r in first["results"]]
    assert merged["counts"]["error"] == len(merged["context_lost_at"])


@pytest.mark.parametrize("argv, message", [
    (["--shards", "0"], "--shards must be at least 1"), (["--jobs", "0"], "--jobs must be at least 1"),
    (["--max-wall-s", "0"], "--max-wall-s must be positive"), (["--shard", "3/2"], "--shard must be k/n"),
    (["--resume-after", "nope"], "--resume-after 'nope' is no case")])
def test_the_full_run_names_a_bad_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        _conformance_full().main(["--size", "quick", "--adapters", "torch-sdpa-math", *argv])
    assert message in capsys.readouterr().err


# ---- a kernel's own refusal ----------------------------------------------------------------------------------


def test_a_kernel_that_refuses_an_input_is_skipped_with_its_reason_and_anything_else_is_an_error():
    base = shipped.torch_sdpa_math()

    def refuses_masks(p):
        if p.attn_mask is not None:
            raise conformance.Unsupported("no masks here")
        if p.scale is not None:
            raise RuntimeError("No available kernel, but not Unsupported: an error")
        return base.call(p)

    adapter = conformance.Adapter("picky", refuses_masks, supports=base.supports)
    ids = ["bool_mask-float32-fwd-small", "scale-float32-fwd-small", "plain-float32-fwd-small"]
    statuses = {r.id: (r.status, r.detail) for r in conformance.run(adapter, select=ids).results}
    assert statuses["bool_mask-float32-fwd-small"] == ("skipped", "refused by the kernel: no masks here")
    assert statuses["scale-float32-fwd-small"][0] == "error"
    assert statuses["plain-float32-fwd-small"] == ("passed", "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
@pytest.mark.parametrize("name", sorted(shipped.CUDA_ONLY))
def test_torchs_cuda_only_kernels_say_so_on_a_cpu(name):
    with pytest.raises(RuntimeError, match=f"{name}: torch has this SDPA kernel on CUDA only"):
        shipped.SHIPPED[name]()


def test_torchs_no_available_kernel_becomes_a_refusal_with_torchs_reasons(monkeypatch):
    import torch.nn.functional as F

    def no_kernel(*args, **kwargs):
        import warnings

        warnings.warn("Flash attention does not support the attn_mask argument.", UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_kernel)
    (result,) = conformance.run(shipped.torch_sdpa_flash(), select=["bool_mask-float32-fwd-small"]).results
    assert result.status == "skipped"
    assert result.detail == ("refused by the kernel: torch FLASH_ATTENTION: "
                             "Flash attention does not support the attn_mask argument.")
