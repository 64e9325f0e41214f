"""Tests of the Triton backward (backends/triton/backward.py): dq, dk, dv against float64 autograd of the reference.

Each case runs the Triton forward (for out and lse) and :func:`attnlab.backends.triton.backward.backward` on seeded
inputs, and compares the gradients with those of :func:`attnlab.reference` (float64, autograd). float32 is
judged by a tight abs/rel tolerance (IEEE products); float16/bfloat16 by FlashAttention's rule:
``max|g - g64| <= 2 * max|g_textbook - g64| + floor``, where g_textbook is autograd of the textbook
computation in the same low dtype and floor the dtype's unit roundoff times max|g64|. Every gradient must
be free of NaN, and exactly 0 where the contract makes it 0: rows with no allowed key (dq), keys no row
sees (dk, dv). CPU tests run the kernels through Triton's interpreter on small odd shapes; GPU tests
(marker ``gpu``) run the same matrix at 8x the lengths, and a larger causal case per dtype.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.api import attention
from attnlab.backends.triton import backward as triton_bwd
from attnlab.backends.triton import bwd_grid, bwd_launch, hopper_forward
from attnlab.backends.triton import runtime as triton_runtime
from attnlab.cases import Case, make_inputs
from attnlab.check import UNIT_ROUNDOFF, run_attention, run_reference
from attnlab.problem import make_problem
from attnlab.reference import masked_scores, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

#: (case, dtype) pairs of the CPU matrix: every mask kind, both alignments with Nq < Nk and Nq > Nk, empty
#: rows and keys, GQA/MQA, layouts and views, D from 1 to 256, each dtype several times.
CASES = [
    (Case("dense_odd", B=1, Hq=2, Nq=37, Nk=53, D=24), F32),
    (Case("dense_odd", B=1, Hq=2, Nq=37, Nk=53, D=24), F16),
    (Case("dense_odd", B=1, Hq=2, Nq=37, Nk=53, D=24), BF16),
    (Case("causal", B=2, Hq=2, Nq=37, D=32, causal=True), BF16),
    (Case("causal_tl_nq<nk", B=1, Hq=2, Nq=17, Nk=45, D=16, causal=True, align="top_left"), F16),
    (Case("causal_br_nq<nk", B=1, Hq=2, Nq=21, Nk=50, D=16, causal=True, align="bottom_right"), F32),
    (Case("causal_br_nq>nk", B=1, Hq=2, Nq=45, Nk=17, D=16, causal=True, align="bottom_right"), BF16),
    (Case("causal_tl_nq>nk", B=1, Hq=2, Nq=40, Nk=23, D=16, causal=True, align="top_left"), F32),
    (Case("window", B=1, Hq=2, Nq=41, D=16, window=(8, 4)), F16),
    (Case("window_br_nq>nk_d40", B=2, Hq=1, Nq=37, Nk=21, D=40, window=(6, 3), align="bottom_right"), F32),
    (Case("window_left_only", B=1, Hq=2, Nq=35, D=16, window=(6, None)), F32),
    (Case("window_causal_br", B=1, Hq=2, Nq=19, Nk=50, D=16, causal=True, window=(5, None),
          align="bottom_right"), BF16),
    (Case("window_misses", B=1, Hq=2, Nq=30, Nk=12, D=16, window=(2, 1), align="top_left"), F32),
    (Case("kv_len", B=3, Hq=1, Nq=31, Nk=45, D=16, kv_len=(0, 23, 45)), F32),
    (Case("q_len_kv_len", B=3, Hq=1, Nq=29, D=16, kv_len=(29, 13, 0), q_len=(29, 20, 5)), BF16),
    (Case("q_len_causal_br", B=3, Hq=1, Nq=24, Nk=40, D=16, causal=True, align="bottom_right",
          kv_len=(40, 31, 10), q_len=(24, 9, 17)), F32),
    (Case("q_len_zero_window", B=2, Hq=1, Nq=27, D=16, window=(4, 4), q_len=(0, 19)), F16),
    (Case("kv_len_all_zero", B=2, Hq=1, Nq=9, Nk=13, D=16, kv_len=(0, 0)), F32),
    (Case("bool_full", B=2, Hq=1, Nq=23, Nk=31, D=16, mask="bool_full"), F32),
    (Case("bool_full", B=2, Hq=1, Nq=23, Nk=31, D=16, mask="bool_full"), BF16),
    (Case("bool_1h1k_causal", B=1, Hq=3, Nq=27, D=16, mask="bool_1h1k", causal=True), F16),
    (Case("bias_full", B=1, Hq=2, Nq=21, Nk=26, D=16, mask="bias_full"), F32),
    (Case("bias_11qk_causal", B=2, Hq=1, Nq=28, D=16, mask="bias_11qk", causal=True), BF16),
    (Case("bias_b1qk_kv_len", B=2, Hq=1, Nq=22, Nk=30, D=16, mask="bias_b1qk", kv_len=(30, 11)), F16),
    (Case("gqa", B=1, Hq=6, Hkv=2, Nq=26, Nk=33, D=16), BF16),
    (Case("gqa_causal_br", B=1, Hq=4, Hkv=2, Nq=14, Nk=39, D=32, causal=True, align="bottom_right"), F32),
    (Case("mqa_bool", B=1, Hq=4, Hkv=1, Nq=19, D=16, mask="bool_b1qk"), F32),
    (Case("mqa_bnhd_transposed_window", B=1, Hq=4, Hkv=1, Nq=30, Nk=38, D=16, layout="bnhd", view="transposed",
          window=(5, 5), align="bottom_right"), F16),
    (Case("bnhd", B=2, Hq=2, Nq=29, Nk=35, D=16, layout="bnhd"), F16),
    (Case("transposed_view", B=1, Hq=3, Nq=27, Nk=30, D=16, view="transposed"), BF16),
    (Case("strided_d_causal_d40", B=1, Hq=2, Nq=31, D=40, view="strided_d", causal=True), F32),
    (Case("bnhd_transposed_kv_len", B=2, Hq=2, Nq=26, Nk=34, D=16, layout="bnhd", view="transposed",
          kv_len=(34, 17)), F32),
    (Case("d1", B=1, Hq=2, Nq=17, D=1), F32),
    (Case("d1", B=1, Hq=2, Nq=17, D=1), BF16),
    (Case("d100", B=1, Hq=1, Nq=21, Nk=29, D=100, causal=True, align="top_left"), F16),
    (Case("d256", B=1, Hq=1, Nq=9, Nk=20, D=256), F32),
    (Case("d256", B=1, Hq=1, Nq=9, Nk=20, D=256, causal=True, align="bottom_right"), BF16),
    (Case("tile_aligned", B=1, Hq=2, Nq=32, Nk=48, D=16, causal=True, align="bottom_right"), F32),
    (Case("decode_nq1", B=3, Hq=2, Hkv=1, Nq=1, Nk=37, D=16, causal=True, align="bottom_right",
          kv_len=(37, 1, 20)), F32),
    (Case("nk1", B=1, Hq=2, Nq=17, Nk=1, D=16), F16),
    (Case("dv_d48_dv24_causal", B=1, Hq=2, Nq=29, D=48, Dv=24, causal=True), F32),
    (Case("dv_d24_dv40_gqa_window_br", B=1, Hq=4, Hkv=2, Nq=23, Nk=37, D=24, Dv=40, window=(5, 2),
          align="bottom_right"), BF16),
    (Case("dv_d192_dv128_causal_br", B=1, Hq=1, Nq=17, Nk=26, D=192, Dv=128, causal=True, align="bottom_right"),
     F32),
    (Case("dv_d64_dv128_kv_len", B=2, Hq=1, Nq=19, Nk=33, D=64, Dv=128, kv_len=(33, 0)), F16),
]

#: Packed sequences (attention_varlen): empty sequences, single rows, one long among short ones, GQA/MQA,
#: both alignments, windows, Dv != D.
PACKED = [
    (Case("varlen_dense", Hq=2, D=16, seqs=((5, 7), (0, 3), (17, 17), (1, 0), (33, 20))), F32),
    (Case("varlen_causal_br_gqa", Hq=4, Hkv=2, D=32, seqs=((9, 30), (40, 40), (1, 1), (0, 0), (21, 5)),
          causal=True, align="bottom_right"), BF16),
    (Case("varlen_causal_tl_mqa", Hq=3, Hkv=1, D=24, seqs=((30, 12), (2, 2), (45, 45)), causal=True,
          align="top_left"), F32),
    (Case("varlen_window_br_dv", Hq=2, D=16, Dv=24, seqs=((19, 19), (3, 40), (26, 26)), window=(4, 2),
          align="bottom_right"), F16),
]


def _textbook(q, k, v, kw: dict) -> torch.Tensor:
    """The textbook attention in the inputs' dtype, differentiable (empty rows: out 0, gradient 0)."""
    prob = make_problem(q, k, v, **kw)
    B, Hq, Hkv, Nq, Nk, Dv = prob.B, prob.Hq, prob.Hkv, prob.Nq, prob.Nk, prob.Dv
    s = masked_scores(prob, 0, Nq, prob.dtype)
    empty = (s == float("-inf")).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    o = torch.matmul(p.reshape(B, Hkv, Hq // Hkv, Nq, Nk), prob.v.unsqueeze(2)).reshape(B, Hq, Nq, Dv)
    return prob.to_layout(o)


def _triton_grads(q, k, v, dout, kw: dict) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in the caller's layout: the Triton forward's out and lse, then the Triton backward."""
    prob = make_problem(q, k, v, **kw)
    out, lse = attention(q, k, v, backend="triton", return_lse=True, **kw)
    grads = triton_bwd.backward(prob, prob.to_layout(out), lse, prob.to_layout(dout))
    for g, x in zip(grads, (prob.q, prob.k, prob.v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    return tuple(prob.to_layout(g) for g in grads)


def _autograd(fn, q, k, v, dout, dtype) -> tuple[torch.Tensor, ...]:
    """Gradients of ``fn(q, k, v)`` with respect to q, k, v (cast to ``dtype``) for the upstream ``dout``."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    fn(*leaves).backward(dout.to(dtype))
    return tuple(x.grad for x in leaves)


def _zero_where_unseen(case: Case, q, k, v, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, Hq, Nq] with no allowed key, keys [B, Hkv, Nk] that no row of their group sees)."""
    prob = make_problem(q, k, v, **kw)
    ok = prob.spec.allowed_with_bias().expand(prob.B, prob.Hq, prob.Nq, prob.Nk)
    empty_rows = ~ok.any(dim=-1)
    seen = ok.reshape(prob.B, prob.Hkv, prob.group, prob.Nq, prob.Nk).any(dim=(2, 3))
    return prob.to_layout(empty_rows.unsqueeze(-1)).squeeze(-1), prob.to_layout((~seen).unsqueeze(-1)).squeeze(-1)


def _check(case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    q, k, v, kw = make_inputs(case, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), generator=gen).to(device=device, dtype=dtype)
    ours = _triton_grads(q, k, v, dout, kw)
    ref = _autograd(lambda a, b, c: reference(a, b, c, **kw)[0], q, k, v, dout, torch.float64)
    base = _autograd(lambda a, b, c: _textbook(a, b, c, kw), q, k, v, dout, dtype) if dtype != F32 else None
    _judge(ours, ref, base, _zero_where_unseen(case, q, k, v, kw), dtype)


def _judge(ours, ref, base, zeros, dtype) -> None:
    """Each gradient against float64 autograd: no NaN or Inf, exactly 0 where no row or key is allowed, and
    within the dtype's tolerance (float32) or twice the textbook's error plus a floor (half types)."""
    empty_rows, unseen_keys = zeros
    for i, name in enumerate(("dq", "dk", "dv")):
        g, g64 = ours[i].double(), ref[i]
        assert not torch.isnan(g).any(), f"{name}: NaN"
        assert torch.isfinite(g).all(), f"{name}: Inf"
        zero_at = empty_rows if name == "dq" else unseen_keys
        assert (g[zero_at] == 0).all(), f"{name}: nonzero where no key/row is allowed"
        err = (g - g64).abs().max().item() if g.numel() else 0.0
        scale = max(1.0, g64.abs().max().item() if g.numel() else 0.0)
        if dtype == F32:  # IEEE products: float32 rounding of the sums only
            tol = 5e-6 * scale
            assert err <= tol, f"{name}: max|g - g64| = {err:.3e} > {tol:.1e}"
        else:
            base_err = (base[i].double() - g64).abs().max().item() if g.numel() else 0.0
            bound = 2 * base_err + UNIT_ROUNDOFF[dtype] * scale
            assert err <= bound, f"{name}: max|g - g64| = {err:.3e} > 2 * {base_err:.3e} + floor ({bound:.3e})"


def _packed_unseen(q, k, v, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [total_q, Hq] with no allowed key, keys [total_k, Hkv] no row of their group sees) of a packed
    call, sequence by sequence."""
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    band = {n: kw[n] for n in ("causal", "window", "align") if n in kw}
    rows = torch.zeros(q.shape[:2], dtype=torch.bool)
    keys = torch.zeros(k.shape[:2], dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [x[s].unsqueeze(0) for x, s in ((q, qs), (k, ks), (v, ks))]
        r, c = _zero_where_unseen(None, *one, {"layout": "bnhd", **band})
        rows[qs], keys[ks] = r[0].cpu(), c[0].cpu()
    return rows.to(q.device), keys.to(q.device)


def _check_packed(case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    """The public packed call's gradients (backend triton: the varlen op's backward) against float64 autograd
    of the per-sequence reference, and (half types) against the textbook's error in the same dtype."""
    q, k, v, kw = make_inputs(case, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), generator=gen).to(device=device, dtype=dtype)
    ours = _autograd(lambda a, b, c: run_attention(a, b, c, kw, backend="triton"), q, k, v, dout, dtype)
    ref = _autograd(lambda a, b, c: run_reference(a, b, c, kw)[0], q, k, v, dout, torch.float64)
    base = _autograd(lambda a, b, c: _packed_textbook(a, b, c, kw), q, k, v, dout, dtype) if dtype != F32 else None
    _judge(ours, ref, base, _packed_unseen(q, k, v, kw), dtype)


def _packed_textbook(q, k, v, kw: dict) -> torch.Tensor:
    """The textbook attention of each packed sequence in the inputs' dtype, differentiable, concatenated."""
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    band = {n: kw[n] for n in ("causal", "window", "align") if n in kw}
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_k[b + 1] == cu_k[b]:  # no key: the contract's 0 (the textbook's matmul of nothing is 0 too)
            outs.append(q.new_zeros((cu_q[b + 1] - cu_q[b], q.shape[1], v.shape[2])) * q[qs].sum())
            continue
        outs.append(_textbook(q[qs].unsqueeze(0), k[ks].unsqueeze(0), v[ks].unsqueeze(0),
                              {"layout": "bnhd", **band})[0])
    return torch.cat(outs)


# ------------------------------------------------------------------------------------------------------
# CPU: the interpreter
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "dtype"), PACKED, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_packed_gradients_cpu(case, dtype):
    _check_packed(case, dtype, "cpu")


@pytest.mark.parametrize(("case", "dtype"), CASES, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_gradients_cpu(case, dtype):
    _check(case, dtype, "cpu")


def _one_pass_dims(case: Case) -> bool:
    """Whether the one-pass mode takes the case's head dims (both at most ONE_PASS_MAX_D)."""
    return max(case.D, case.Dv or case.D) <= triton_bwd.ONE_PASS_MAX_D


#: The one-pass backward (dQ added up by atomics in the dK/dV pass) on a cross-section of the matrix: every mask
#: kind, both alignments, empty rows and keys, GQA/MQA, views, D 1 to 128, Dv != D, and the packed cases.
ONE_PASS = [c for c in CASES if c[0].name in {
    "dense_odd", "causal_br_nq>nk", "causal_tl_nq<nk", "window_br_nq>nk_d40", "q_len_kv_len", "kv_len_all_zero",
    "bool_1h1k_causal", "bias_b1qk_kv_len", "gqa", "mqa_bnhd_transposed_window", "strided_d_causal_d40", "d1",
    "d100", "decode_nq1", "dv_d24_dv40_gqa_window_br", "dv_d64_dv128_kv_len"}]


@pytest.fixture
def atomic_dq(monkeypatch):
    """The backward in its one-pass mode (ATTNLAB_BWD_DQ=atomic), its dQ pass never launched."""
    monkeypatch.setattr(triton_bwd, "DQ_MODE", "atomic")

    def no_dq_pass(*a, **k):
        raise AssertionError("the one-pass backward launched the dQ pass")

    monkeypatch.setattr(bwd_launch, "launch_dq", no_dq_pass)


@pytest.mark.parametrize(("case", "dtype"), ONE_PASS, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_one_pass_gradients_cpu(case, dtype, atomic_dq):
    _check(case, dtype, "cpu")


@pytest.mark.parametrize(("case", "dtype"), PACKED, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_one_pass_packed_gradients_cpu(case, dtype, atomic_dq):
    _check_packed(case, dtype, "cpu")


@pytest.mark.parametrize("mode", ["pass", "atomic"])
def test_nan_past_the_lengths_reaches_no_gradient(mode, monkeypatch):
    """NaN in K and V past kv_len (an uninitialized cache) and in Q and dO past q_len (padding rows): every
    gradient stays finite, padding rows' dq and unseen keys' dk, dv are exactly 0, and the rest equals the
    gradients of the clean inputs (in both modes: the one-pass dQ multiplies by K and V as well)."""
    monkeypatch.setattr(triton_bwd, "DQ_MODE", mode)
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 2, n, 16, generator=g) for n in (24, 40, 40, 24))
    kw = dict(kv_len=torch.tensor([40, 23]), q_len=torch.tensor([24, 17]))
    clean = _triton_grads(q, k, v, dout, kw)
    dirty = [t.clone() for t in (q, k, v, dout)]
    dirty[1][1, :, 23:] = float("nan")
    dirty[2][1, :, 23:] = float("nan")
    dirty[0][1, :, 17:] = float("nan")
    dirty[3][1, :, 17:] = float("nan")
    dq, dk, dv = _triton_grads(*dirty, kw)
    for got in (dq, dk, dv):
        assert torch.isfinite(got).all()
    assert not dq[1, :, 17:].any() and not dk[1, :, 23:].any() and not dv[1, :, 23:].any()
    for a, b in zip((dq, dk, dv), clean):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_one_pass_has_configs_of_its_own():
    """The one-pass mode's dK/dV space starts from 32-row query tiles at D 128 (half types); its configs are tuned
    and cached under a name of their own, for which the shipped table has no entries (it gives none, not an
    error), so a two-pass config never stands in for it."""
    from attnlab.backends.triton import configs, tune_cache, tuned_table
    from attnlab.backends.triton.configs import BwdConfig

    assert configs.dkdv_candidates(BF16, 128, one_pass=True)[0] == BwdConfig(32, 128, 8, 3)
    assert configs.dkdv_candidates(BF16, 64, one_pass=True) == configs.dkdv_candidates(BF16, 64)
    assert configs.dkdv_candidates(F32, 128, one_pass=True) == configs.dkdv_candidates(F32, 128)
    assert triton_bwd._tables(True)[0] == "bwd1" and triton_bwd._tables(False)[0] == "bwd"
    key = (BF16, 128, "causal", 1, 4096, 4096, 64)
    assert tuned_table.lookup("bwd", "sm90", key) is not None
    assert tuned_table.lookup("bwd1", "sm90", key) is None
    assert tune_cache.kernel_source_hash("bwd1") == tune_cache.kernel_source_hash("bwd")
    q = torch.randn(1, 2, 8, 16)
    wide = make_problem(torch.randn(1, 2, 8, 192), torch.randn(1, 2, 8, 192), q)  # D 192 > ONE_PASS_MAX_D
    was = triton_bwd.DQ_MODE
    try:
        triton_bwd.DQ_MODE = "atomic"
        assert triton_bwd.one_pass(make_problem(q, q, q)) and not triton_bwd.one_pass(wide)
    finally:
        triton_bwd.DQ_MODE = was


def _shared_bytes(D: int, Dv: int, kv: list, dq: list, sm: int) -> list[int]:
    """The shared memory the dK/dV kernel at each config of ``kv`` and the dQ kernel at each of ``dq`` ask for at
    D / Dv (bf16, causal), compiled on the CPU for sm_``sm``."""
    from triton.backends.compiler import GPUTarget

    from attnlab.backends.triton.cold_launch import compile_only

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 300, D, generator=g).to(BF16) for _ in range(2))
    v, dout = (torch.randn(1, 2, 300, Dv, generator=g).to(BF16) for _ in range(2))
    prob, rows = make_problem(q, k, v, causal=True), torch.zeros(1, 2, 300)
    dk, dv, dq_ = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    launches = ([bwd_launch.dkdv_launch(prob, dout, rows, rows, dk, dv, c, False) for c in kv]
                + [bwd_launch.dq_launch(prob, dout, rows, rows, dq_, c, False) for c in dq])
    return [compile_only(fn, args, kw, 0, GPUTarget("cuda", sm, 32))[0].metadata.shared
            for fn, _, args, kw in launches]


def test_the_wide_256_wide_configs_fit_the_bound_that_picks_them():
    """At 256-wide head tiles (D 192 / Dv 128, and D 256) every wide candidate of both kernels asks for no more shared
    memory than ``WIDE_TILES_SHARED_BYTES``, the bound a GPU must reach to start from them (sm_90), and each kernel's
    narrow first candidate for less than an Ampere SM's 163 KiB (sm_80). Compiled on the CPU."""
    from pathlib import Path

    import triton

    from attnlab.backends.triton import configs

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    wide = (configs.dkdv_candidates(BF16, 256, wide_first=True)[:3], configs.dq_candidates(BF16, 256, True)[:2])
    narrow = ([configs.dkdv_candidates(BF16, 256)[0]], [configs.dq_candidates(BF16, 256)[0]])
    assert not set(narrow[0] + narrow[1]) & set(wide[0] + wide[1])
    for D, Dv in ((192, 128), (256, 256)):
        sizes = _shared_bytes(D, Dv, *wide, sm=90)
        assert max(sizes) <= configs.WIDE_TILES_SHARED_BYTES, (D, sizes)
        sizes = _shared_bytes(D, Dv, *narrow, sm=80)
        assert max(sizes) <= 163 * 1024, (D, sizes)


@pytest.mark.parametrize("optin, D, Dv, wide", [(227 * 1024, 192, 128, True), (227 * 1024, 256, 100, True),
                                                (163 * 1024, 192, 128, False), (99 * 1024, 192, 128, False),
                                                (227 * 1024, 256, 256, False), (227 * 1024, 192, 192, False),
                                                (200 * 1024, 192, 128, True), (200 * 1024 - 1, 192, 128, False)])
def test_256_wide_spaces_follow_the_value_dim_and_the_gpus_shared_memory(optin, D, Dv, wide, monkeypatch):
    """At 256-wide head tiles a value tile of at most 128 (D 192 / Dv 128, the MLA shape) starts from the wide
    configs on a GPU whose block holds them (a Hopper SM); D = Dv = 256 (and Dv 192, padded to it), or a GPU with
    less shared memory, starts from the narrow ones. Other head dims keep their order."""
    from types import SimpleNamespace

    from attnlab.backends.triton import configs
    from attnlab.backends.triton.configs import BwdConfig

    monkeypatch.setattr(triton_bwd._rt, "shared_optin", lambda index: optin)

    def spaces(D, Dv):  # what _spaces reads of a problem on CUDA device 0
        return triton_bwd._spaces(SimpleNamespace(device=torch.device("cuda", 0), dtype=BF16, D=D, Dv=Dv), False)

    kv, dq = spaces(D, Dv)
    assert (kv[0], dq[0]) == ((BwdConfig(32, 128, 8, 2), BwdConfig(128, 64, 8, 1)) if wide else
                              (BwdConfig(32, 64, 8, 1), BwdConfig(64, 32, 8, 1)))
    assert sorted(map(str, kv)) == sorted(map(str, configs.dkdv_candidates(BF16, 256)))  # the same, reordered
    assert sorted(map(str, dq)) == sorted(map(str, configs.dq_candidates(BF16, 256)))
    assert spaces(128, 128) == (configs.dkdv_candidates(BF16, 128), configs.dq_candidates(BF16, 128))
    assert configs.wide_tiles_first(128, None) and not configs.wide_tiles_first(256, None)  # off a GPU: a Hopper SM


def test_one_pass_gives_way_to_two_while_torch_asks_for_determinism(monkeypatch):
    """Under torch.use_deterministic_algorithms the atomic mode runs the dQ pass (a sum in a fixed order); an
    unknown mode is refused by name."""
    case = Case("gqa_causal", B=1, Hq=4, Hkv=2, Nq=21, Nk=27, D=16, causal=True, align="bottom_right")
    q, k, v, kw = make_inputs(case, dtype=F32, device="cpu", seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    launched = []
    real = bwd_launch.launch_dq
    monkeypatch.setattr(bwd_launch, "launch_dq", lambda *a, **k: (launched.append(1), real(*a, **k))[1])
    monkeypatch.setattr(triton_bwd, "DQ_MODE", "atomic")
    atomic = _triton_grads(q, k, v, dout, kw)
    assert launched == []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        two = _triton_grads(q, k, v, dout, kw)
    finally:
        torch.use_deterministic_algorithms(was)
    assert launched == [1]
    for a, b in zip(atomic, two):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    monkeypatch.setattr(triton_bwd, "DQ_MODE", "atomics")
    with pytest.raises(ValueError, match="ATTNLAB_BWD_DQ must be one of"):
        _triton_grads(q, k, v, dout, kw)


def test_empty_problems_launch_nothing():
    for nq, nk in ((0, 5), (5, 0), (0, 0)):
        q, k, v = torch.randn(1, 2, nq, 8), torch.randn(1, 2, nk, 8), torch.randn(1, 2, nk, 8)
        prob = make_problem(q, k, v)
        out, lse = torch.zeros(1, 2, nq, 8), torch.full((1, 2, nq), float("-inf"))
        dq, dk, dv = triton_bwd.backward(prob, out, lse, torch.ones_like(out))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert not dq.any() and not dk.any() and not dv.any()


def test_broadcast_dout_and_determinism():
    """dout with stride 0 (the gradient of a sum) is read as given, and two runs agree bit for bit."""
    case = Case("gqa_causal", B=1, Hq=4, Hkv=2, Nq=21, Nk=27, D=16, causal=True, align="bottom_right")
    q, k, v, kw = make_inputs(case, dtype=F32, device="cpu", seed=3)
    dout = torch.ones(1, 1, 1, 1).expand(q.shape)
    first = _triton_grads(q, k, v, dout, kw)
    second = _triton_grads(q, k, v, dout.contiguous(), kw)
    ref = _autograd(lambda a, b, c: reference(a, b, c, **kw)[0], q, k, v, dout, torch.float64)
    for a, b, r in zip(first, second, ref):
        assert torch.equal(a, b)
        assert (a.double() - r).abs().max().item() <= 2e-5 * max(1.0, r.abs().max().item())


def test_rejects_wrong_shapes():
    q = torch.randn(1, 2, 5, 8)
    prob = make_problem(q, q, q)
    with pytest.raises(ValueError, match="lse"):
        triton_bwd.backward(prob, q, torch.zeros(1, 2, 4), q)


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("case", "dtype"), CASES, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_gradients_gpu(case, dtype):
    _check(case.scaled(8), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "dtype"), PACKED, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_packed_gradients_gpu(case, dtype):
    _check_packed(case.scaled(8), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gradients_gpu_large(dtype, D):
    case = Case("gqa_causal_large", B=2, Hq=4, Hkv=2, Nq=1000, Nk=1100, D=D, causal=True, align="bottom_right",
                kv_len=(1100, 700))
    _check(case, dtype, "cuda")


#: D 192 / Dv 128 (the MLA shape) in half types, whose 256-wide tiles start from the wide configs on a Hopper SM
#: (128 keys a program, two stages): long enough for several key tiles, dense with GQA and kv lengths, and packed.
MLA = [
    Case("mla_gqa_causal_large", B=2, Hq=4, Hkv=2, Nq=1000, Nk=1100, D=192, Dv=128, causal=True,
         align="bottom_right", kv_len=(1100, 700)),
    Case("mla_varlen_causal", Hq=4, Hkv=2, D=192, Dv=128, seqs=((700, 700), (0, 5), (333, 333), (1, 1), (517, 900)),
         causal=True, align="bottom_right"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("case", MLA, ids=lambda c: c.name)
def test_gradients_gpu_mla_dims(case, dtype):
    (_check_packed if case.seqs is not None else _check)(case, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "dtype"), [c for c in CASES + PACKED if _one_pass_dims(c[0])],
                         ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_one_pass_gradients_gpu(case, dtype, atomic_dq):
    (_check_packed if case.seqs is not None else _check)(case.scaled(8), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_one_pass_gradients_gpu_large(dtype, D, atomic_dq):
    test_gradients_gpu_large(dtype, D)


def test_shapes_the_jit_specializes_alike_share_their_backward_compiled_ahead():
    """The key of a backward compiled ahead follows its configs and what Triton specializes on: N 1000 and 1048
    (neither a multiple of 16) with the same configs share it, so a new shape of compiled variants starts no
    background work; N 1008 (a multiple of 16), another window width, D 100 (16 does not divide it) or another
    config does not."""
    from attnlab.backends.triton.backward import _ahead_key
    from attnlab.backends.triton.configs import BwdConfig

    cfgs = (BwdConfig(64, 128, 8, 3), BwdConfig(128, 64, 8, 3))

    def key(N, window=(256, 0), D=96, cfgs=cfgs, Hq=8, Dv=None, sinks=None):
        q = torch.empty(2, Hq, N, D, dtype=torch.float16)
        k = torch.empty(2, 1, N, D, dtype=torch.float16)
        v = torch.empty(2, 1, N, Dv or D, dtype=torch.float16)
        prob = make_problem(q, k, v, window=window, align="top_left", sinks=sinks)
        return _ahead_key(prob, torch.empty(2, Hq, N, Dv or D, dtype=torch.float16), cfgs)

    assert key(1000) == key(1048)
    assert key(1000) != key(1008)
    assert key(1000) != key(1000, window=(255, 0))
    assert key(1000) == key(1000, D=80)  # the same padded head dim, 16 divides both: one variant
    assert key(1000) != key(1000, D=100)
    assert key(1000) != key(1000, cfgs=(BwdConfig(64, 128, 8, 2), cfgs[1]))
    assert key(1000) != key(1000, Hq=16)  # Hq 8 and 16: both multiples of 8, not of 16
    assert key(1000, D=128, Dv=128) != key(1000, D=32, Dv=128)  # the same larger head dim, other tiles for q.k
    sinks = torch.zeros(8)
    assert key(1000, sinks=sinks) != key(1000, sinks=sinks.clone().requires_grad_())  # the preprocess's variant


def test_compile_ahead_stands_in_a_gradient_only_where_it_shares_the_layout():
    """compile_ahead reuses q, k, v as the stand-ins of dq, dk, dv (compiled for their strides and alignment)
    only where torch.empty_like(x), which the backward allocates, would have x's strides and alignment."""
    from attnlab.backends.triton.backward import _like_its_gradient

    x = torch.randn(2, 8, 3, 16)
    assert _like_its_gradient(x) and _like_its_gradient(x.transpose(1, 2))  # dense, in any dim order
    assert not _like_its_gradient(x[:, :1].expand(2, 8, 3, 16))  # broadcast: its gradient is contiguous
    assert not _like_its_gradient(x[..., :8])  # gaps
    assert not _like_its_gradient(torch.randn(2 * 8 * 3 * 16 + 1)[1:].view(2, 8, 3, 16))  # 4 bytes off


#: Mask and modifier sets of the launch tests below (their one-pass sets pass a dQ accumulator).
LAUNCH_MODS = ["plain", "mask_sinks_lengths", "alibi_one_pass", "alibi_softcap_one_pass", "bias_bnhd"]


def _bound_launches(mods: str, seed: int = 0, **over) -> tuple[tuple, list]:
    """The launch key of one CPU problem of ``mods`` (new random tensors for each ``seed``, the same shapes) and,
    per launch (preprocess, dK/dV, dQ): its grid, every argument value bound as Triton binds them, and its leading
    tensors (``*_tensors``)."""
    from attnlab.backends.triton.configs import BwdConfig
    from attnlab.backends.triton.runtime import bound_values, later_parameters

    g = torch.Generator().manual_seed(seed)
    shape = (2, 40, 4, 16) if mods == "bias_bnhd" else (2, 4, 40, 16)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    kw = {"plain": dict(causal=True),
          "mask_sinks_lengths": dict(mask=torch.rand(40, 40, generator=g) > 0.3, kv_len=[30 + seed, 40],
                                     sinks=torch.randn(4, generator=g), q_len=[40, 20 - seed]),
          "alibi_one_pass": dict(alibi_slopes=torch.rand(4, generator=g), window=(5, 3)),
          "alibi_softcap_one_pass": dict(alibi_slopes=torch.rand(2, 4, generator=g), window=(5, 3), softcap=20.0),
          "bias_bnhd": dict(mask=torch.randn(4, 40, 40, generator=g), layout="bnhd")}[mods]
    prob = make_problem(q, k, v, **{**kw, **over})
    out, dout, dq, dk, dv = (torch.empty(2, 4, 40, 16) for _ in range(5))
    lse, delta, lse2 = (torch.empty(2, 4, 40) for _ in range(3))
    cfg = BwdConfig(16, 16, 4, 1)
    acc = torch.zeros_like(dq) if mods.endswith("one_pass") else None
    shares = torch.empty(12) if prob.mods.sinks is not None else None
    launches = [(bwd_launch.preprocess_launch(prob, out, lse, dout, delta, lse2, False, shares),
                 bwd_launch.preprocess_tensors(prob, out, lse, dout, delta, lse2, shares)),
                (bwd_launch.dkdv_launch(prob, dout, delta, lse2, dk, dv, cfg, False, acc),
                 bwd_launch.dkdv_tensors(prob, dout, delta, lse2, dk, dv, acc)),
                (bwd_launch.dq_launch(prob, dout, delta, lse2, dq, cfg, False),
                 bwd_launch.dq_tensors(prob, dout, delta, lse2, dq))]
    key = bwd_launch.launch_key(prob, out, dout, lse, delta, lse2, dq, dk, dv)
    return key, [(grid, bound_values(args, kws, later_parameters(kernel, len(args))), tensors)
                 for (kernel, grid, args, kws), tensors in launches]


@pytest.mark.parametrize("mods", LAUNCH_MODS)
def test_the_backward_launches_lead_with_all_their_tensors(mods):
    """A direct launch keeps every argument value after the leading tensors (bwd_launch): so each launch's
    arguments, bound as Triton binds them, must open with exactly its ``*_tensors`` and hold no tensor after."""
    for _, values, tensors in _bound_launches(mods)[1]:
        n = len(tensors)
        assert all(isinstance(a, torch.Tensor) and (a.data_ptr(), a.dtype) == (b.data_ptr(), b.dtype)
                   for a, b in zip(values[:n], tensors, strict=True))  # (a bool mask: a new uint8 view)
        assert not any(isinstance(x, torch.Tensor) for x in values[n:])


@pytest.mark.parametrize("mods", LAUNCH_MODS)
def test_one_launch_key_keeps_one_grid_and_one_tail(mods):
    """A direct launch reuses the first launch's grid and every value after its tensors for the whole launch key
    (bwd_launch): two problems of one key (new tensors, new values, the same shapes, strides and options) must
    build the same grid and the same tail, and the key must change with what the tail holds."""
    def tails(key_and_launches):
        key, launches = key_and_launches
        return key, [(grid, values[len(tensors):]) for grid, values, tensors in launches]

    first, second = tails(_bound_launches(mods, 0)), tails(_bound_launches(mods, 1))
    assert first[0] == second[0] and first[1] == second[1]
    other = tails(_bound_launches(mods, 0, scale=0.3))
    assert other[0] != first[0] and other[1] != first[1]  # a value in the tail: in the key too


def test_a_backward_chooses_its_configs_once_per_launch_key(monkeypatch):
    """A repeated backward of one launch key takes its configs and spaces from the memo (no new choice); another
    key, a packed call (no key) and any table change (a tune) choose again."""
    from attnlab.backends.triton.configs import BwdConfig

    prob = make_problem(*(torch.randn(1, 2, 40, 16) for _ in range(3)), causal=True)
    chose = []
    pair = (BwdConfig(64, 64, 4, 1), BwdConfig(64, 32, 4, 1))
    monkeypatch.setattr(triton_bwd, "configs_for", lambda *a: chose.append(1) or pair)
    monkeypatch.setattr(triton_bwd, "_decided", {})
    none = [None] * 6
    first = triton_bwd._decide(prob, ("sig", "layouts"), False, *none)
    assert first[:2] == pair and first[2:] == triton_bwd._spaces(prob, False) and len(chose) == 1
    assert triton_bwd._decide(prob, ("sig", "layouts"), False, *none) == first and len(chose) == 1
    triton_bwd._decide(prob, ("sig", "layouts"), True, *none)  # the one-pass mode: its own entry
    triton_bwd._decide(prob, ("sig", "other layouts"), False, *none)
    triton_bwd._decide(prob, None, False, *none)
    triton_bwd._decide(prob, None, False, *none)
    assert len(chose) == 5
    monkeypatch.setattr(triton_bwd, "_fastest", lambda space, launch: space[-1])  # a tune without a GPU
    monkeypatch.setattr(triton_bwd.tune_cache, "store", lambda *a: None)
    monkeypatch.setattr(triton_bwd, "_ahead_seen", {("a forward",): None})
    triton_bwd._tune(prob, *none, key=("tune key",))
    assert not triton_bwd._ahead_seen, "a tune left compile_ahead's memo in place"
    triton_bwd._decide(prob, ("sig", "layouts"), False, *none)
    assert len(chose) == 6, "a tune left the memo's configs in place"
    # a table emptied while a choice is being made (another thread's tune): that choice is not kept
    def racing(*a):
        chose.append(1)
        triton_bwd._forget_choices()
        return pair

    monkeypatch.setattr(triton_bwd, "configs_for", racing)
    triton_bwd._decide(prob, ("sig", "racing"), False, *none)
    monkeypatch.setattr(triton_bwd, "configs_for", lambda *a: chose.append(1) or pair)
    triton_bwd._decide(prob, ("sig", "racing"), False, *none)
    assert len(chose) == 8


@pytest.mark.gpu
def test_a_repeated_forward_compiles_its_backward_ahead_once(monkeypatch):
    """compile_ahead chooses configs and builds its key once per call signature and layout of out and lse: a
    repeated forward of one layout skips it; another layout of out does not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    prob = make_problem(q, k, v, window=(31, 0))
    out, lse = torch.empty_like(q), torch.empty(1, 4, 200, device="cuda")
    chose = []
    real = triton_bwd.configs_for
    monkeypatch.setattr(triton_bwd, "configs_for", lambda *a: chose.append(1) or real(*a))
    monkeypatch.setattr(triton_bwd, "_ahead_seen", {})
    monkeypatch.setattr(triton_bwd, "AUTOTUNE", False)
    monkeypatch.setattr(triton_bwd.configs, "COMPILE_AHEAD", True)
    triton_bwd.compile_ahead(prob, out, lse)
    triton_bwd.compile_ahead(make_problem(q.clone(), k, v, window=(31, 0)), torch.empty_like(q), lse)
    assert len(chose) == 1
    bnhd = torch.empty(1, 200, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    triton_bwd.compile_ahead(prob, bnhd, lse)
    assert len(chose) == 2
    triton_bwd._wait_ahead(prob, out)


@pytest.mark.gpu
def test_a_repeated_backward_launches_directly(monkeypatch):
    """A backward of a call signature seen before launches its three compiled kernels directly (no JIT launch)
    and gives the first backward's gradients bit for bit; a dout of another alignment is another key (the JIT
    again). A GQA window call with sinks, as a gpt-oss layer makes it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(hopper_forward, "_mode", "0")  # the portable passes (on sm_90 the Gluon pass takes this call)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = dict(window=(63, 0), align="bottom_right", sinks=torch.randn(8, device="cuda", generator=g))
    prob = make_problem(q, k, v, **kw)
    out, lse = attention(q, k, v, return_lse=True, backend="triton", **kw)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    jit = []
    real = bwd_launch.jit_run
    monkeypatch.setattr(bwd_launch, "jit_run", lambda *a: jit.append(a[0]) or real(*a))
    monkeypatch.setattr(bwd_launch, "COMPILED", {})
    first = triton_bwd.gradients(prob, out, lse, dout)
    assert len(jit) == 3
    again = triton_bwd.gradients(prob, out, lse, dout.clone())
    assert len(jit) == 3, "a repeated backward went through the JIT"
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # a new call of the same key (new q, k, v, sinks and outputs): launched directly, as the JIT launches it
    q2, k2, v2 = (x + 0.5 for x in (q, k, v))
    kw2 = dict(kw, sinks=2 * kw["sinks"])
    out2, lse2 = attention(q2, k2, v2, return_lse=True, backend="triton", **kw2)
    direct = triton_bwd.gradients(make_problem(q2, k2, v2, **kw2), out2, lse2, dout)
    assert len(jit) == 3, "a new call of the same key went through the JIT"
    monkeypatch.setattr(triton_runtime, "FAST_LAUNCH", False)
    jitted = triton_bwd.gradients(make_problem(q2, k2, v2, **kw2), out2, lse2, dout)
    assert len(jit) == 6
    for a, b in zip(direct, jitted):
        assert torch.equal(a, b)
    monkeypatch.setattr(triton_runtime, "FAST_LAUNCH", True)
    odd = torch.empty(dout.numel() + 1, device="cuda", dtype=dout.dtype)[1:].view(dout.shape).copy_(dout)
    third = triton_bwd.gradients(prob, out, lse, odd)
    assert len(jit) > 6
    for a, b in zip(first, third):
        assert torch.equal(a, b)


def _gpu_case(seed: int = 11):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 8, 700, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 4, 700, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = dict(causal=True, align="bottom_right", alibi_slopes=torch.rand(8, device="cuda", generator=g))
    out, lse = attention(q, k, v, return_lse=True, backend="triton", **kw)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    return make_problem(q, k, v, **kw), out, lse, dout


def _poisoned_gradients(prob, out, lse, dout):
    """:func:`gradients` right after blocks of the gradients' sizes were filled with NaN and freed, so that the
    caching allocator hands them out again (and so for Delta and the base-2 lse): a gradient read before its pass
    ended, or computed before the preprocess, is NaN, not a stale right one."""
    poison = [torch.full_like(x, float("nan")) for x in (prob.q, prob.k, prob.v, lse, lse)]
    del poison
    return triton_bwd.gradients(prob, out, lse, dout)


@pytest.mark.gpu
def test_two_streams_give_one_streams_gradients_and_wait_for_each_other(monkeypatch):
    """The dQ pass on its side stream: the gradients equal the one-stream backward's bit for bit, also when the
    current stream is slow to reach the preprocess (the side stream must wait for it) and when the dQ pass is slow
    to finish (the current stream must wait for it before the gradients are read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prob, out, lse, dout = _gpu_case()
    monkeypatch.setattr(bwd_grid, "MIN_WAVES", 0)  # this small problem's backward on two streams too
    monkeypatch.setattr(triton_bwd, "TWO_STREAMS", False)
    want = triton_bwd.gradients(prob, out, lse, dout)[:3]
    monkeypatch.setattr(triton_bwd, "TWO_STREAMS", True)
    for a, b in zip(want, triton_bwd.gradients(prob, out, lse, dout)):
        assert torch.equal(a, b)
    sleep = 200_000_000  # GPU cycles: about 0.1 s, far longer than the whole backward
    real_pre, real_dq = bwd_launch.launch_preprocess, bwd_launch.launch_dq
    monkeypatch.setattr(bwd_launch, "launch_preprocess",
                        lambda *a, **k: (torch.cuda._sleep(sleep), real_pre(*a, **k))[1])
    for a, b in zip(want, _poisoned_gradients(prob, out, lse, dout)):
        assert torch.equal(a, b), "the dQ pass ran before the preprocess"
    monkeypatch.setattr(bwd_launch, "launch_preprocess", real_pre)
    monkeypatch.setattr(bwd_launch, "launch_dq", lambda *a, **k: (torch.cuda._sleep(sleep), real_dq(*a, **k))[1])
    for a, b in zip(want, _poisoned_gradients(prob, out, lse, dout)):
        assert torch.equal(a, b), "the gradients were read before the dQ pass ended"


@pytest.mark.gpu
def test_two_stream_backward_replays_in_a_cuda_graph(monkeypatch):
    """The fork to the side stream and the join are captured: a replayed backward gives the eager gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from attnlab.bench.replay import capture

    monkeypatch.setattr(bwd_grid, "MIN_WAVES", 0)

    prob, out, lse, dout = _gpu_case(12)
    monkeypatch.setattr(triton_bwd, "TWO_STREAMS", True)  # whatever ATTNLAB_BWD_STREAMS says
    want = triton_bwd.gradients(prob, out, lse, dout)
    graph, got = capture(lambda: triton_bwd.gradients(prob, out, lse, dout))
    for t in got[:3]:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_a_backward_of_few_waves_stays_on_one_stream(monkeypatch):
    """Two streams only where the dK/dV grid holds MIN_WAVES programs per SM (B2 H4 N700: a few dozen). The
    portable passes' rule: on sm_90 the Hopper backward, which takes this case once compiled (by an earlier
    test in the same process, say), is switched off."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prob, out, lse, dout = _gpu_case(13)
    monkeypatch.setattr(hopper_forward, "_mode", "0")
    monkeypatch.setattr(triton_bwd, "TWO_STREAMS", True)  # whatever ATTNLAB_BWD_STREAMS says
    seen = []
    real = bwd_grid.side_by_side
    monkeypatch.setattr(bwd_grid, "side_by_side", lambda two, *a: seen.append(two) or real(two, *a))
    triton_bwd.gradients(prob, out, lse, dout)
    monkeypatch.setattr(bwd_grid, "MIN_WAVES", 0)
    triton_bwd.gradients(prob, out, lse, dout)
    assert seen == [False, True]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pass", "atomic"])
def test_a_backward_config_that_does_not_fit_gives_way_to_the_next(mode, monkeypatch):
    """A dK/dV config that does not fit the GPU (Triton's OutOfResources at its first launch), in the two-pass and
    the one-pass mode: the next candidate of its space runs, with a warning, and is kept for the tune key; the
    gradients are those of a backward that starts from that config."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from attnlab.backends.triton import configs

    monkeypatch.setattr(hopper_forward, "_mode", "0")  # the portable passes, whose configs these are
    monkeypatch.setattr(triton_bwd, "DQ_MODE", mode)
    monkeypatch.setattr(triton_bwd, "AUTOTUNE", False)
    for table in ("_tuned", "_picked", "_tuned1", "_picked1", "_decided"):
        monkeypatch.setattr(triton_bwd, table, {})
    prob, out, lse, dout = _gpu_case(14)
    one = triton_bwd.one_pass(prob)
    assert one == (mode == "atomic")
    kv_cfg, q_cfg, kv_space, _ = triton_bwd._decide(prob, None, one, *[None] * 6)
    assert kv_cfg in kv_space[:-1], f"the table picks {kv_cfg}, which no candidate follows: pick another case"
    following = kv_space[kv_space.index(kv_cfg) + 1]

    class OutOfResources(Exception):
        pass

    tried = []
    real = bwd_launch.launch_dkdv

    def launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg, *rest, **kw):
        tried.append(cfg)
        if cfg == kv_cfg:
            raise OutOfResources("out of resource: shared memory")
        return real(prob, dout, delta, lse2, dk, dv, cfg, *rest, **kw)

    monkeypatch.setattr(bwd_launch, "launch_dkdv", launch_dkdv)
    with pytest.warns(UserWarning, match="does not fit"):
        got = triton_bwd.gradients(prob, out, lse, dout)
    assert tried == [kv_cfg, following]
    _, tuned, picked = triton_bwd._tables(one)
    assert not tuned and picked == {configs.bwd_tune_key(prob): (following, q_cfg)}
    want = triton_bwd.gradients(prob, out, lse, dout)  # the kept pair, chosen again (the memo was emptied)
    assert tried[2:] == [following]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    if one:  # dQ added up by atomics in any order: equal to rounding
        torch.testing.assert_close(got[0], want[0])
    else:
        assert torch.equal(got[0], want[0])


#: Cases of both grid orders: head and batch axes of unequal sizes (a swapped axis reads past its tensor), GQA/MQA,
#: causal both ways, lengths, a band.
GRID_ORDERS = [c for c in CASES if c[0].name in {
    "causal", "gqa", "gqa_causal_br", "q_len_kv_len", "window_br_nq>nk_d40", "mqa_bnhd_transposed_window"}]


def _grads_in_both_orders(q, k, v, dout, kw, monkeypatch) -> dict[bool, tuple[torch.Tensor, ...]]:
    got = {}
    for outer in (False, True):
        monkeypatch.setattr(bwd_grid, "TILES_OUTER", "all" if outer else "none")
        got[outer] = _triton_grads(q, k, v, dout, kw)
    return got


@pytest.mark.parametrize(("case", "dtype"), GRID_ORDERS, ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_both_grid_orders_give_the_same_gradients_cpu(case, dtype, monkeypatch):
    """The dK/dV and dQ grids with the tiles outermost (TILES_OUTER) or a head's tiles side by side: every program
    computes the same tile either way, so the gradients are equal bit for bit (and right: the matrix above)."""
    q, k, v, kw = make_inputs(case, dtype=dtype, device="cpu", seed=3)
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), generator=torch.Generator().manual_seed(4)).to(dtype)
    got = _grads_in_both_orders(q, k, v, dout, kw, monkeypatch)
    for name, a, b in zip(("dq", "dk", "dv"), got[False], got[True]):
        assert torch.equal(a, b), f"{name} differs between the grid orders"


@pytest.mark.parametrize(("case", "dtype"), GRID_ORDERS[:3],
                         ids=lambda x: x.name if isinstance(x, Case) else str(x)[6:])
def test_one_pass_with_the_tiles_outermost_cpu(case, dtype, atomic_dq, monkeypatch):
    """The one-pass mode's dK/dV kernel, which also adds dQ, with its tiles outermost: right against float64."""
    monkeypatch.setattr(bwd_grid, "TILES_OUTER", "all")
    _check(case, dtype, "cpu")


def test_tiles_outer_rule_and_modes(monkeypatch):
    """auto: either grid, whatever the group, with keys bounded on the right only, below MIN_WAVES programs per SM;
    none, dkdv, all as named; anything else a ValueError."""
    def prob(Hkv: int, **kw):
        return make_problem(torch.zeros(1, 4, 256, 16), *(torch.zeros(1, Hkv, 256, 16) for _ in range(2)), **kw)

    outer = bwd_grid.tiles_outer
    monkeypatch.setattr(bwd_grid, "TILES_OUTER", "auto")
    monkeypatch.setattr(bwd_grid, "MIN_WAVES", 6)
    gqa = prob(2, causal=True)  # dK/dV: 4 key tiles of 64 x 2 kv heads = 8 programs; dQ: 4 x 4 query heads = 16
    assert outer(gqa, "dkdv", 64, sms=2) and not outer(gqa, "dkdv", 64, sms=1)  # 8 < 12; 8 >= 6
    assert outer(gqa, "dq", 64, sms=3) and not outer(gqa, "dq", 64, sms=2)  # 16 < 18; 16 >= 12
    assert outer(prob(1, window=(None, 2)), "dkdv", 64, sms=2)  # MQA, a window open to the left
    assert not outer(prob(1, window=(3, 2)), "dkdv", 64, sms=2)  # a band: every key tile sees as many rows
    assert not outer(prob(1, window=(3, None)), "dq", 64, sms=100)  # bounded on the left only
    mha = prob(4, causal=True)  # 16 programs in either grid
    assert all(outer(mha, kernel, 64, sms=3) and not outer(mha, kernel, 64, sms=2) for kernel in ("dkdv", "dq"))
    assert not outer(prob(2), "dkdv", 64, sms=100) and not outer(prob(2), "dq", 64, sms=100)  # no mask
    assert not outer(gqa, "dkdv", 64)  # no sms given and a CPU problem: no GPU to fill
    for mode, want in (("none", (False, False)), ("dkdv", (True, False)), ("all", (True, True))):
        monkeypatch.setattr(bwd_grid, "TILES_OUTER", mode)
        assert (outer(prob(4), "dkdv", 64), outer(prob(4), "dq", 64)) == want
    monkeypatch.setattr(bwd_grid, "TILES_OUTER", "all")  # more tiles than the grid's last axis takes: never
    long_keys = make_problem(torch.zeros(1, 1, 8, 1), *(torch.zeros(1, 1, 70_000, 1) for _ in range(2)))
    assert outer(long_keys, "dkdv", 2) and not outer(long_keys, "dkdv", 1)  # 35,000 and 70,000 key tiles
    monkeypatch.setattr(bwd_grid, "TILES_OUTER", "1")
    with pytest.raises(ValueError, match="ATTNLAB_BWD_TILES_OUTER must be one of"):
        outer(prob(4), "dq", 64)


def test_tiles_outer_grid_puts_the_tiles_last():
    prob = make_problem(*(torch.zeros(3, 5, n, 16) for n in (40, 100, 100)))
    from attnlab.backends.triton.runtime import tile_grid

    assert tile_grid(prob, 100, 100, 32, 5) == (4, 5, 3)
    assert tile_grid(prob, 100, 100, 32, 5, tiles_outer=True) == (5, 3, 4)


@pytest.mark.gpu
def test_auto_grid_order_follows_min_waves_between_calls(monkeypatch):
    """auto's choice for one signature changes with MIN_WAVES (here: the GQA causal case under and over it): each
    call launches the kernel compiled for the order it chose, and the gradients stay equal bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prob, out, lse, dout = _gpu_case(15)
    monkeypatch.setattr(bwd_grid, "TILES_OUTER", "auto")
    monkeypatch.setattr(triton_bwd, "TWO_STREAMS", False)
    got = []
    for waves in (10**6, 0, 10**6):
        monkeypatch.setattr(bwd_grid, "MIN_WAVES", waves)
        got.append(triton_bwd.gradients(prob, out, lse, dout)[:3])
    assert bwd_grid.tiles_outer(prob, "dkdv", 16) is True  # under MIN_WAVES = 10**6 programs per SM
    for later in got[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), got[0], later):
            assert torch.equal(a, b), f"{name} differs between the grid orders auto chose"


@pytest.mark.gpu
def test_both_grid_orders_give_the_same_gradients_gpu(monkeypatch):
    """As on the CPU, at GPU sizes with ALiBi and bottom-right causal, GQA 8/4, B 2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prob, out, lse, dout = _gpu_case(14)
    got = {}
    for outer in (False, True):
        monkeypatch.setattr(bwd_grid, "TILES_OUTER", "all" if outer else "none")
        got[outer] = triton_bwd.gradients(prob, out, lse, dout)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), got[False], got[True]):
        assert torch.equal(a, b), f"{name} differs between the grid orders"


def test_device_index_follows_the_current_device_and_sm_count_is_cached(monkeypatch):
    """runtime.device_index asks for the current device each time (a device without an index); sm_count, asked per
    backward, is cached by device."""
    from attnlab.backends.triton import runtime

    current = iter([0, 1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: next(current))
    assert [runtime.device_index(torch.device("cuda")) for _ in range(2)] == [0, 1]
    assert runtime.device_index(torch.device("cuda", 3)) == 3
    assert hasattr(runtime.sm_count, "cache_info")
