"""The backward of attention in PyTorch ops, chunked over query rows: the gradients of the contract.

For one row i with probabilities ``p = softmax(s)`` over its allowed keys and output ``o = p V``, given
``dO`` (and ``dlse``, the gradient reaching the row's log-sum-exp when the caller used it):

    dV    += p^T dO                       (summed over the query heads of a kv group: GQA/MQA)
    dP     = dO V^T
    Delta  = rowsum(p * dP) = rowsum(dO * o)
    dS     = p * (dP - Delta + dlse)      (d lse / d s = p)
    dQ     = scale * dS K,   dK += scale * dS^T Q,   d bias = dS

Score modifiers (:mod:`attnlab.score_mods`): a soft cap multiplies dS by ``1 - tanh^2`` of the capped score on
its way to q and k (the bias gradient is taken after the cap); ALiBi is a constant; a sink is one more key of
value 0 in every row's normalization, whose gradient is ``d sink = -sum_i p_sink,i (Delta_i - dlse_i)``.

A key a row may not see has p = 0 and so gets no gradient; a row with no allowed key has p = 0 everywhere
and gets zero gradients, never NaN. P is recomputed from q and k chunk by chunk (the score blocks stay under
``max_chunk_bytes``), so the backward never holds the whole [B, H, Nq, Nk] matrix. This is the backward of
the backends built from PyTorch ops (``reference`` in float64, ``torch`` and ``sdpa`` in float32).
"""

from __future__ import annotations

import torch

from attnlab.problem import Problem
from attnlab.reference import DEFAULT_CHUNK_BYTES, masked_scores


def textbook_backward(
    prob: Problem,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    dtype: torch.dtype = torch.float32,
    bias_grad: bool = False,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dq, dk, dv, dbias, dsinks) of ``prob`` for ``dout`` ([B, Hq, Nq, Dv] view) and ``dlse`` ([B, Hq, Nq] or
    None).

    dq, dk, dv are [B, H, N, D] (dv: Dv) in ``dtype``; dbias is [B, Hq, Nq, Nk] in ``dtype`` when ``bias_grad``
    (the caller sums it over the mask's broadcast dims), else None; dsinks [Hq] in ``dtype`` when the problem has
    sinks, else None. Arithmetic in ``dtype``.
    """
    B, Hq, Hkv, g, Nq, Nk, D, Dv = prob.B, prob.Hq, prob.Hkv, prob.group, prob.Nq, prob.Nk, prob.D, prob.Dv
    dev, mods = prob.device, prob.mods
    dq = torch.zeros(B, Hq, Nq, D, dtype=dtype, device=dev)
    dk = torch.zeros(B, Hkv, Nk, D, dtype=dtype, device=dev)
    dv = torch.zeros(B, Hkv, Nk, Dv, dtype=dtype, device=dev)
    dbias = torch.zeros(B, Hq, Nq, Nk, dtype=dtype, device=dev) if bias_grad else None
    dsinks = torch.zeros(Hq, dtype=dtype, device=dev) if mods.sinks is not None else None
    sink = None if mods.sinks is None else mods.sinks.detach().to(device=dev, dtype=dtype).view(1, Hq, 1, 1)
    if dq.numel() == 0 or Nk == 0:
        if dsinks is not None and dlse is not None and dlse.numel():  # every row's lse is its sink
            dsinks += dlse.to(dtype).sum(dim=(0, 2))
        return dq, dk, dv, dbias, dsinks
    k, v = prob.k.to(dtype), prob.v.to(dtype)
    rows = max(1, max_chunk_bytes // max(1, B * Hq * Nk * 4 * torch.finfo(dtype).bits // 8))
    for i0 in range(0, Nq, rows):
        i1 = min(Nq, i0 + rows)
        r = i1 - i0
        s = masked_scores(prob, i0, i1, dtype)  # [B, Hq, r, Nk]
        m = s.amax(dim=-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # empty rows: every p is exp(-inf) = 0
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            l = l + torch.exp(sink - m)
        l = torch.where(l == 0, torch.ones_like(l), l)
        p = p / l
        do = dout[:, :, i0:i1].to(dtype).reshape(B, Hkv, g, r, Dv)
        pg = p.reshape(B, Hkv, g, r, Nk)
        dv += torch.einsum("bhgrn,bhgrd->bhnd", pg, do)
        dp = torch.matmul(do, v.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, g, r, Nk]
        delta = (pg * dp).sum(dim=-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, :, i0:i1].to(dtype).reshape(B, Hkv, g, r, 1)
        if sink is not None:  # p_sink = exp(sink - m) / l; d sink = -sum p_sink (Delta - dlse)
            p_sink = (torch.exp(sink - m) / l).reshape(B, Hkv, g, r, 1)
            dsinks += -(p_sink * delta).reshape(B, Hq, r).sum(dim=(0, 2))
        ds = pg * (dp - delta)
        if dbias is not None:
            dbias[:, :, i0:i1] = ds.reshape(B, Hq, r, Nk)
        if mods.softcap is not None:  # through the cap: times 1 - tanh^2 of the capped score
            q_rows = prob.q[:, :, i0:i1].to(dtype).reshape(B, Hkv, g, r, D)
            capped = torch.tanh(torch.matmul(q_rows, k.unsqueeze(2).transpose(-1, -2)) * prob.scale / mods.softcap)
            ds = ds * (1 - capped * capped)
        dq[:, :, i0:i1] = (torch.matmul(ds, k.unsqueeze(2)) * prob.scale).reshape(B, Hq, r, D)
        q = prob.q[:, :, i0:i1].to(dtype).reshape(B, Hkv, g, r, D)
        dk += torch.einsum("bhgrn,bhgrd->bhnd", ds, q) * prob.scale
    return dq, dk, dv, dbias, dsinks


def sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a [B, Hq, Nq, Nk] gradient over the dims a mask of ``shape`` was broadcast along."""
    lead = grad.dim() - len(shape)
    g = grad.sum(dim=tuple(range(lead))) if lead > 0 else grad
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return (g.sum(dim=dims, keepdim=True) if dims else g).reshape(shape)
