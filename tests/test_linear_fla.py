"""attention_ref.linear against fla-core's naive references (flash-linear-attention), in a subprocess.

fla-core lives in a folder of its own and runs in a subprocess that loads its ``naive.py`` files
by path (why: ``tests/fla_core.py``). Slow (a pip install, about 10 s from a local wheel cache,
and a second interpreter): runs only with ``ATTENTION_REF_SLOW_TESTS=1``;
``ATTENTION_REF_FLA_TARGET=DIR`` reuses a folder where that install already happened (it is
created there if missing).

fla's references compute in float32 and apply neither the L2 normalisation nor a check of
the gates, so q and k are normalised here first and attention_ref runs in float64 with
``use_qk_l2norm=False``: the differences are float32 rounding.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from fla_core import install_fla, run_fla, slow  # tests/fla_core.py

from attention_ref.linear import gated_delta_rule, gated_linear_attention, kimi_delta_attention, l2_normalize

pytestmark = slow

RUNNER = textwrap.dedent("""
    import importlib.util, sys
    from pathlib import Path
    import torch

    target, inputs_path, outputs_path = map(Path, sys.argv[1:4])

    def load(name, relative):  # a naive.py by path: fla/__init__.py (Triton) never runs
        spec = importlib.util.spec_from_file_location(name, target / relative)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    gdr = load("fla_naive_gdr", "fla/ops/gated_delta_rule/naive.py")
    kda = load("fla_naive_kda", "fla/ops/kda/naive.py")
    gla = load("fla_naive_gla", "fla/ops/gla/naive.py")
    simple = load("fla_naive_simple_gla", "fla/ops/simple_gla/naive.py")
    assert "fla" not in sys.modules and "transformers" not in sys.modules
    x = torch.load(inputs_path)
    a, b, c, d = x["gdr"], x["kda"], x["gla"], x["simple_gla"]
    out = {
        "gdr_recurrent": gdr.naive_recurrent_gated_delta_rule(
            a["q"], a["k"], a["v"], a["beta"], a["g"], initial_state=a["initial_state"],
            output_final_state=True),
        "gdr_chunk": gdr.naive_chunk_gated_delta_rule(
            a["q"], a["k"], a["v"], a["g"], a["beta"], chunk_size=16,
            initial_state=a["initial_state"], output_final_state=True),
        "kda_recurrent": kda.naive_recurrent_kda(
            b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["initial_state"],
            output_final_state=True),
        "kda_chunk": kda.naive_chunk_kda(
            b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["initial_state"],
            output_final_state=True, chunk_size=16),
        "gla_recurrent": gla.naive_recurrent_gla(
            c["q"], c["k"], c["v"], c["g"], initial_state=c["initial_state"], output_final_state=True),
        "simple_gla_recurrent": simple.naive_recurrent_simple_gla(
            d["q"], d["k"], d["v"], d["g"], initial_state=d["initial_state"], output_final_state=True),
        "simple_gla_chunk": simple.naive_chunk_simple_gla(
            d["q"], d["k"], d["v"], d["g"], initial_state=d["initial_state"], output_final_state=True,
            chunk_size=16),
    }
    torch.save(out, outputs_path)
""")


@pytest.fixture(scope="module")
def fla_target(tmp_path_factory) -> Path:
    return install_fla(tmp_path_factory)


def _inputs(seed: int, B: int, L: int, H: int, Hv: int, E: int, Ev: int, per_channel: bool) -> dict:
    """float32 inputs (so both sides read the same numbers), q and k of unit length."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(B, L, H, E, generator=gen)) for _ in range(2))
    gate_shape = (B, L, Hv, E) if per_channel else (B, L, Hv)
    return {"q": q, "k": k, "v": torch.randn(B, L, Hv, Ev, generator=gen),
            "g": -0.3 * torch.rand(*gate_shape, generator=gen),  # log decay <= 0
            "beta": torch.rand(B, L, Hv, generator=gen),
            "initial_state": torch.randn(B, Hv, E, Ev, generator=gen)}


def test_equal_to_fla_naive_references(fla_target, tmp_path):
    # prime sizes where fla allows; L a multiple of the chunk (fla's naive_chunk_kda asserts it)
    inputs = {"gdr": _inputs(0, B=2, L=48, H=3, Hv=3, E=7, Ev=5, per_channel=False),  # fla's GDR: Hv = H
              "kda": _inputs(1, B=2, L=48, H=2, Hv=6, E=7, Ev=5, per_channel=True),  # grouped value heads
              # gated linear attention, a decay per key channel (fla's gla) and per head (simple_gla)
              "gla": _inputs(2, B=2, L=48, H=3, Hv=3, E=7, Ev=5, per_channel=True),
              "simple_gla": _inputs(3, B=2, L=48, H=3, Hv=3, E=7, Ev=5, per_channel=False)}
    for name in ("gla", "simple_gla"):
        del inputs[name]["beta"]  # no delta term
    theirs = run_fla(fla_target, RUNNER, inputs, tmp_path)
    f64 = {name: {n: t.double() for n, t in x.items()} for name, x in inputs.items()}
    ours = {"gdr": gated_delta_rule(**f64["gdr"], use_qk_l2norm=False, output_final_state=True),
            "kda": kimi_delta_attention(**f64["kda"], use_qk_l2norm=False, output_final_state=True),
            "gla": gated_linear_attention(**f64["gla"], output_final_state=True, mode="chunked", chunk_size=16),
            "simple_gla": gated_linear_attention(**f64["simple_gla"], output_final_state=True, mode="chunked",
                                                 chunk_size=16)}
    assert len(theirs) == 7
    for name, (their_out, their_state) in theirs.items():
        our_out, our_state = ours[name.rsplit("_", 1)[0]]
        assert their_out.dtype == torch.float32, name
        for what, theirs_t, ours_t in (("out", their_out, our_out), ("state", their_state, our_state)):
            torch.testing.assert_close(theirs_t.double(), ours_t, atol=2e-5, rtol=1e-4,
                                       msg=lambda m, label=f"{name} {what}": f"{label}: {m}")
