"""The float64 reference against an independent row-by-row loop, and against SDPA's math backend."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab


def naive_attention(q, k, v, *, causal=False, window=None, align=None, kv_len=None, q_len=None, mask=None,
                    scale=None):
    """The contract written out as a plain loop over (b, h, i): no chunking, no broadcasting tricks."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    align = align or "top_left"
    out = torch.zeros(B, Hq, Nq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Nq), -math.inf, dtype=torch.float64)
    for b in range(B):
        lk = Nk if kv_len is None else int(kv_len[b])
        lq = Nq if q_len is None else int(q_len[b])
        for h in range(Hq):
            for i in range(Nq):
                diag = i + (lk - lq if align == "bottom_right" else 0)
                scores, keys = [], []
                for j in range(Nk):
                    if j >= lk or i >= lq:
                        continue
                    if left is not None and j < diag - left:
                        continue
                    if right is not None and j > diag + right:
                        continue
                    s = scale * float(q[b, h, i].double() @ k[b, h // g, j].double())
                    if mask is not None:
                        m = mask.expand(B, Hq, Nq, Nk)[b, h, i, j]
                        if m.dtype == torch.bool:
                            if not bool(m):
                                continue
                        else:
                            s += float(m)
                    if s == -math.inf:
                        continue
                    scores.append(s)
                    keys.append(j)
                if not scores:
                    continue
                mx = max(scores)
                w = [math.exp(s - mx) for s in scores]
                total = sum(w)
                out[b, h, i] = sum(wj * v[b, h // g, j].double() for wj, j in zip(w, keys)) / total
                lse[b, h, i] = mx + math.log(total)
    return out, lse


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    Nq = draw(st.integers(1, 9))
    Nk = draw(st.integers(1, 9))
    D = draw(st.integers(1, 6))
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.none() | st.integers(0, 5)), draw(st.none() | st.integers(0, 5)))
    if ("causal" in kw or "window" in kw) and (Nq != Nk or draw(st.booleans())):
        kw["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        kw["kv_len"] = [draw(st.integers(0, Nk)) for _ in range(B)]
    if draw(st.booleans()):
        kw["q_len"] = [draw(st.integers(0, Nq)) for _ in range(B)]
    mask_kind = draw(st.sampled_from([None, "bool", "bias"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if mask_kind is not None:
        shape = tuple(draw(st.sampled_from([1, full])) for full in (B, Hq, Nq, Nk))
        if mask_kind == "bool":
            kw["mask"] = torch.rand(shape, generator=gen) < 0.6
        else:
            bias = torch.randn(shape, generator=gen, dtype=torch.float64)
            kw["mask"] = bias.masked_fill(torch.rand(shape, generator=gen) < 0.2, -math.inf)
    q = torch.randn(B, Hq, Nq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, D, generator=gen, dtype=torch.float64)
    return q, k, v, kw


@settings(max_examples=120, deadline=None)
@given(problems())
def test_reference_matches_row_loop(p):
    q, k, v, kw = p
    out, lse = attnlab.reference(q, k, v, **kw)
    want_out, want_lse = naive_attention(q, k, v, **kw)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_reference_chunking_is_exact():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 50, 8, generator=gen)
    k = torch.randn(2, 2, 61, 8, generator=gen)
    v = torch.randn(2, 2, 61, 8, generator=gen)
    from attnlab.problem import make_problem
    from attnlab.reference import reference_forward

    prob = make_problem(q, k, v, causal=True, align="bottom_right", kv_len=[61, 30])
    whole, whole_lse = reference_forward(prob)
    tiny, tiny_lse = reference_forward(prob, max_chunk_bytes=1)  # one row per chunk
    # The same float64 math row by row. Not bit for bit: a BLAS may multiply a 1-row block with another kernel
    # (another summation order) than a 50-row block (seen with torch 2.14 and AVX2 forced); a lost or shifted
    # row would be off by O(1), far beyond float64 rounding.
    torch.testing.assert_close(tiny, whole, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(tiny_lse, whole_lse, atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("case", ["causal", "bool", "gqa"])
def test_reference_matches_sdpa_math_in_float64(case):
    """Where the semantics coincide (top-left causal, bool masks without empty rows, GQA)."""
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, N, D = 2, 4, 4, 37, 24
    if case == "gqa":
        Hkv = 2
    q = torch.randn(B, Hq, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, D, generator=gen, dtype=torch.float64)
    kw, skw = {}, {}
    if case == "causal":
        kw["causal"], skw["is_causal"] = True, True
    if case == "bool":
        m = torch.rand(B, 1, N, N, generator=gen) < 0.5
        m[..., 0] = True  # no empty row: SDPA math gives NaN there, the contract gives 0
        kw["mask"], skw["attn_mask"] = m, m
    kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, kk, vv, **skw)
    out, _ = attnlab.reference(q, k, v, **kw)
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-11)


def test_reference_16384_chunks_without_the_full_score_matrix():
    """Nq = Nk = 16384 on CPU: the float64 score matrix alone would be 2 GiB; the chunked reference
    must stay far below that (peak RSS measured in a fresh process) and agree with a direct row."""
    code = textwrap.dedent(
        """
        import resource, torch, attnlab
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        g = torch.Generator().manual_seed(0)
        N, D = 16384, 4
        q, k, v = (torch.randn(1, 1, N, D, generator=g) for _ in range(3))
        out, lse = attnlab.reference(q, k, v, causal=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        i = N - 1
        s = (q[0, 0, i].double() @ k[0, 0].double().T) / D ** 0.5
        row = torch.softmax(s, -1) @ v[0, 0].double()
        assert torch.allclose(out[0, 0, i], row, atol=1e-12), (out[0, 0, i], row)
        assert torch.isfinite(lse).all()
        print(peak // 1024)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    peak_mib = int(res.stdout.strip().splitlines()[-1])
    assert peak_mib < 1024, f"reference peaked at {peak_mib} MiB; the full float64 score matrix is 2048 MiB"
