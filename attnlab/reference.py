"""The float64 reference: the contract computed as plainly as possible, chunked over query rows.

Every backend is judged against this. It runs on the inputs' device, upcasts to float64 and processes
query rows in chunks so that the score blocks (scores, exponentials, predicate) stay under
``max_chunk_bytes`` (default 256 MiB): a
16384 x 16384 problem runs on a laptop. GQA is a broadcast over a [B, Hkv, group, rows, D] view of q, so
k and v are never repeated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnlab.paged import gather_paged
from attnlab.problem import Problem, make_problem

DEFAULT_CHUNK_BYTES = 256 * 2**20


def masked_scores(prob: Problem, i0: int, i1: int, dtype: torch.dtype) -> torch.Tensor:
    """Scores of rows ``i0 .. i1`` in ``dtype``: ``scale * q k^T + bias``, ``-inf`` where not allowed.

    Shape [B, Hq, rows, Nk]. ``dtype`` is the arithmetic type (float64 for the reference, the input
    dtype for the textbook backend).
    """
    B, Hq, Hkv, g, D = prob.B, prob.Hq, prob.Hkv, prob.group, prob.D
    q = prob.q[:, :, i0:i1].to(dtype).reshape(B, Hkv, g, i1 - i0, D)
    k = prob.k.to(dtype).unsqueeze(2)  # [B, Hkv, 1, Nk, D]
    s = torch.matmul(q, k.transpose(-1, -2)).reshape(B, Hq, i1 - i0, prob.Nk) * prob.scale
    if prob.mods.softcap is not None or prob.mods.alibi is not None:
        s = prob.mods.scores(s, i0, *effective_lengths(prob))
    s = prob.spec.score_rows(s, i0, i1)
    return s.masked_fill(~prob.spec.allowed(i0, i1), float("-inf"))


def effective_lengths(prob: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(Lq, Lk) of every batch entry [B]: q_len and kv_len where given, else Nq and Nk."""
    spec = prob.spec
    lq = spec.q_len if spec.q_len is not None else torch.full((prob.B,), prob.Nq, device=prob.device)
    lk = spec.kv_len if spec.kv_len is not None else torch.full((prob.B,), prob.Nk, device=prob.device)
    return lq.long(), lk.long()


def softmax_rows(s: torch.Tensor, v: torch.Tensor, group: int,
                 sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of masked scores ``s`` [B, Hq, rows, Nk] times v [B, Hkv, Nk, Dv], with the empty-row rule.

    Returns (out [B, Hq, rows, Dv], lse [B, Hq, rows]) in ``s``'s dtype. A row whose scores are all -inf
    gives out = 0 and lse = -inf; NaN in the scores propagates. (A NaN in V at a key the row does not
    attend also reaches it here, as 0 * NaN in the matmul; kernels that never load that key do not.)
    ``sinks`` [Hq]: one more key per row of that logit and value 0 (out 0 and lse = the sink for an empty row).
    """
    m = s.amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(device=s.device, dtype=s.dtype).view(1, -1, 1, 1)
        m = torch.maximum(m, sink)
    empty = m == float("-inf")  # every score -inf: no allowed key (a NaN row is not empty: it propagates)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink - m_safe)
    B, Hq, rows, Nk = s.shape
    pv = torch.matmul(p.reshape(B, Hq // group, group, rows, Nk), v.unsqueeze(2)).reshape(B, Hq, rows, -1)
    out = torch.where(empty, torch.zeros_like(pv), pv / torch.where(empty, torch.ones_like(l), l))
    lse = (m_safe + torch.log(l)).squeeze(-1)
    return out, lse


def dequantized(prob: Problem, dtype: torch.dtype) -> Problem:
    """An FP8 problem with q, k, v as their real values in ``dtype`` (stored value times descale), and every
    other problem as it is. (Each e4m3 value is exact in float32; times a float32 descale, exact in float64.)"""
    if prob.descale is None:
        return prob
    d = prob.descale.to(dtype)  # [B, Hq, 3]
    g = prob.group
    q = prob.q.to(dtype) * d[:, :, 0, None, None]
    k = prob.k.to(dtype) * d[:, ::g, 1, None, None]  # (a kv head's descale, repeated over its query heads)
    v = prob.v.to(dtype) * d[:, ::g, 2, None, None]
    return dataclasses.replace(prob, q=q, k=k, v=v, descale=None)


def reference_forward(prob: Problem, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) of a validated problem, as bhnd tensors."""
    prob = dequantized(prob, torch.float64)
    B, Hq, Nq, Nk, Dv = prob.B, prob.Hq, prob.Nq, prob.Nk, prob.Dv
    out = torch.zeros(B, Hq, Nq, Dv, dtype=torch.float64, device=prob.device)
    lse = torch.full((B, Hq, Nq), float("-inf"), dtype=torch.float64, device=prob.device)
    if out.numel() == 0 or Nk == 0:
        if prob.mods.sinks is not None:  # no key at all: every row's lse is its sink
            lse = prob.mods.sinks.to(device=prob.device, dtype=torch.float64).view(1, Hq, 1).expand(B, Hq, Nq).clone()
        return out, lse
    # Per row of the chunk: the float64 scores and their exponentials (8 + 8 bytes) and the bool predicate.
    rows = max(1, max_chunk_bytes // max(1, B * Hq * Nk * 17))
    v = prob.v.to(torch.float64)
    for i0 in range(0, Nq, rows):
        i1 = min(Nq, i0 + rows)
        o, l = softmax_rows(masked_scores(prob, i0, i1, torch.float64), v, prob.group, prob.mods.sinks)
        out[:, :, i0:i1] = o
        lse[:, :, i0:i1] = l
    return out, lse


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    align: str | None = None,
    kv_len: Any = None,
    q_len: Any = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "bhnd",
    block_table: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention with the same keywords as :func:`attnlab.attention`; always returns (out, lse).

    ``out`` has q's layout; ``lse`` is [B, Hq, Nq] (natural log, -inf for rows with no allowed key). With
    ``block_table``, k and v are paged caches, gathered to dense first.
    """
    if block_table is not None:
        k, v = gather_paged(q, k, v, block_table, layout, kv_len)
    prob = make_problem(
        q, k, v, causal=causal, window=window, align=align, kv_len=kv_len, q_len=q_len,
        mask=mask, scale=scale, layout=layout, allow_float64=True, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )
    out, lse = reference_forward(prob, max_chunk_bytes)
    return prob.to_layout(out), lse


def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, align: str | None = None, scale: float | None = None,
    softcap: float | None = None, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over packed sequences with :func:`attnlab.attention_varlen`'s arguments: each sequence
    on its own, as the plain reference computes it. Returns (out [total_q, Hq, Dv], lse [Hq, total_q]).
    The prefix sums are read on the host (validated as the public call validates host prefix sums)."""
    from attnlab.problem import make_packed_problem

    make_packed_problem(q, k, v, cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), max_seqlen_q, max_seqlen_k, causal=causal,
                        window=window, align=align, scale=scale, allow_float64=True, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        o, lse = reference(q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0), causal=causal,
                           window=window, align=align, scale=scale, layout="bnhd", softcap=softcap,
                           alibi_slopes=slopes, sinks=sinks, max_chunk_bytes=max_chunk_bytes)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:
        return (torch.zeros(0, q.shape[1], v.shape[2], dtype=torch.float64, device=q.device),
                torch.zeros(q.shape[1], 0, dtype=torch.float64, device=q.device))
    return torch.cat(outs), torch.cat(lses, dim=1)
