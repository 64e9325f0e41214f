"""Online softmax, step by step: the running state (m, l, acc) that lets a kernel stream over keys.

For one query row with scores ``s_j`` and values ``v_j``, the state after seeing keys ``0..j`` is

    m   = max_k s_k                         (running maximum)
    l   = sum_k exp(s_k - m)                (running denominator, relative to m)
    acc = sum_k exp(s_k - m) v_k            (running numerator, relative to m)

and ``out = acc / l``, ``lse = m + log l``. When a new block of scores raises the maximum from ``m`` to
``m'``, the old ``l`` and ``acc`` are *rescaled* by ``alpha = exp(m - m')``. Two states over disjoint key
sets merge by the same rule (:func:`merge`), which is what split-K decoding relies on.

This module is teaching code in float64/float32 PyTorch on one row at a time; kernels do the same per
thread block. Nothing here is fast, everything here is countable: each function reports how many
exponentials it evaluated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pandas as pd
import torch

LOG2E = 1.0 / math.log(2.0)  #: log2(e): exp(x) = exp2(x * LOG2E)


@dataclass
class State:
    """The online-softmax state of one row (or a batch of rows: m, l are [...], acc is [..., D])."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor

    @classmethod
    def empty(cls, D: int, dtype: torch.dtype = torch.float64, batch: tuple[int, ...] = ()) -> State:
        """The state of no keys at all: m = -inf, l = 0, acc = 0."""
        return cls(
            m=torch.full(batch, float("-inf"), dtype=dtype),
            l=torch.zeros(batch, dtype=dtype),
            acc=torch.zeros((*batch, D), dtype=dtype),
        )

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse); a row that saw no allowed key gives out = 0 and lse = -inf, never NaN."""
        ok = self.l > 0
        safe_l = torch.where(ok, self.l, torch.ones_like(self.l))
        out = torch.where(ok.unsqueeze(-1), self.acc / safe_l.unsqueeze(-1), torch.zeros_like(self.acc))
        lse = torch.where(ok, self.m + torch.log(safe_l), torch.full_like(self.m, float("-inf")))
        return out, lse


def _safe_alpha(m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """exp(m_old - m_new) with exp(-inf - (-inf)) taken as 1 (nothing seen yet: nothing to rescale)."""
    both_empty = torch.isneginf(m_old) & torch.isneginf(m_new)
    return torch.where(both_empty, torch.ones_like(m_old), torch.exp(m_old - torch.where(both_empty, 0, m_new)))


def update(state: State, s: torch.Tensor, v: torch.Tensor) -> tuple[State, int]:
    """Fold a block of scores ``s`` [..., n] and values ``v`` [..., n, D] into ``state`` (block rowmax).

    Returns the new state and the number of exponentials evaluated: one per score plus one rescale.
    Masked keys carry ``s = -inf`` and contribute exactly 0.
    """
    m_new = torch.maximum(state.m, s.amax(dim=-1))
    alpha = _safe_alpha(state.m, m_new)
    m_sub = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # the -1e30/-inf guard
    p = torch.exp(s - m_sub.unsqueeze(-1))
    l = alpha * state.l + p.sum(dim=-1)
    acc = alpha.unsqueeze(-1) * state.acc + (p.unsqueeze(-2) @ v).squeeze(-2)
    return State(m_new, l, acc), s.shape[-1] + 1


def trace(s: torch.Tensor, v: torch.Tensor, block: int = 1) -> pd.DataFrame:
    """A step-by-step trace of one row: after each block of ``block`` keys, the state and its output.

    ``s`` is [N] and ``v`` is [N, D] (D small, for printing). One row per step with the keys seen, the
    block's max, ``m``, ``alpha`` (the rescale factor), ``l``, ``acc`` and the current ``out = acc / l``,
    a float column per component (``acc[0]``, ...: a list of floats in a cell prints differently across
    pandas versions). The last row's ``out`` equals the softmax of the whole row times v.
    """
    s, v = s.to(torch.float64), v.to(torch.float64)
    st = State.empty(v.shape[-1])
    rows = []
    for j0 in range(0, s.shape[0], block):
        j1 = min(s.shape[0], j0 + block)
        m_old = st.m.clone()
        st, _ = update(st, s[j0:j1], v[j0:j1])
        out, _ = st.finalize()
        rows.append({
            "keys": f"{j0}" if j1 - j0 == 1 else f"{j0}-{j1 - 1}",
            "block_max": float(s[j0:j1].max()),
            "m": float(st.m),
            "alpha": float(_safe_alpha(m_old, st.m)),
            "l": float(st.l),
            **{f"acc[{d}]": float(x) for d, x in enumerate(st.acc)},
            **{f"out[{d}]": float(x) for d, x in enumerate(out)},
        })
    return pd.DataFrame(rows)


def per_element(s: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """Online softmax updated one score at a time (what a naive tiled kernel does per thread).

    For every key: a new max, a rescale ``exp(m - m')`` and ``exp(s - m')``: two exponentials per score.
    ``s`` [R, N], ``v`` [N, D]. Returns (out [R, D] in ``dtype``, number of exponentials).
    """
    s, v = s.to(dtype), v.to(dtype)
    st = State.empty(v.shape[-1], dtype, (s.shape[0],))
    n_exp = 0
    for j in range(s.shape[1]):
        m_new = torch.maximum(st.m, s[:, j])
        alpha = _safe_alpha(st.m, m_new)
        p = torch.exp(s[:, j] - torch.where(torch.isneginf(m_new), 0, m_new))
        st = State(m_new, alpha * st.l + p, alpha.unsqueeze(-1) * st.acc + p.unsqueeze(-1) * v[j])
        n_exp += 2 * s.shape[0]
    return st.finalize()[0], n_exp


def block_rowmax(s: torch.Tensor, v: torch.Tensor, block: int = 16, dtype: torch.dtype = torch.float32,
                 use_exp2: bool = False) -> tuple[torch.Tensor, int]:
    """Online softmax with the block's row max taken first: one exponential per score plus one per block.

    With ``use_exp2`` the scores are multiplied by log2(e) once (kernels fold it into the softmax scale)
    and ``exp2`` is used throughout, the form GPUs evaluate natively (``ex2.approx``).
    ``s`` [R, N], ``v`` [N, D]. Returns (out [R, D] in ``dtype``, number of exponentials).
    """
    s, v = s.to(dtype), v.to(dtype)
    if use_exp2:
        s = s * torch.tensor(LOG2E, dtype=dtype)
    ex = torch.exp2 if use_exp2 else torch.exp
    R, N = s.shape
    m = torch.full((R,), float("-inf"), dtype=dtype)
    l = torch.zeros(R, dtype=dtype)
    acc = torch.zeros(R, v.shape[-1], dtype=dtype)
    n_exp = 0
    for j0 in range(0, N, block):
        sb = s[:, j0 : j0 + block]
        m_new = torch.maximum(m, sb.amax(dim=-1))
        both = torch.isneginf(m) & torch.isneginf(m_new)
        alpha = torch.where(both, torch.ones_like(m), ex(m - torch.where(both, 0, m_new)))
        p = ex(sb - torch.where(torch.isneginf(m_new), 0, m_new).unsqueeze(-1))
        l = alpha * l + p.sum(-1)
        acc = alpha.unsqueeze(-1) * acc + p @ v[j0 : j0 + block]
        m = m_new
        n_exp += R * (sb.shape[1] + 1)
    out = torch.where((l > 0).unsqueeze(-1), acc / torch.where(l > 0, l, 1).unsqueeze(-1), 0)
    return out, n_exp


def softmax_reference(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The one-shot ``softmax(s) @ v`` in float64 (rows of all -inf give 0)."""
    s, v = s.to(torch.float64), v.to(torch.float64)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isneginf(m), 0, m))
    l = p.sum(-1, keepdim=True)
    return torch.where(l > 0, (p @ v) / torch.where(l > 0, l, 1), 0)


def compare_variants(R: int = 64, N: int = 512, D: int = 32, *, block: int = 64, spread: float = 4.0,
                     seed: int = 0) -> pd.DataFrame:
    """Per-element vs block rowmax (with exp or exp2) in float32, against float64: exp count and error.

    Scores are ``spread * N(0, 1)``; one row per variant with the exponentials per score and the max
    absolute error of the output.
    """
    g = torch.Generator().manual_seed(seed)
    s = spread * torch.randn(R, N, generator=g, dtype=torch.float64)
    v = torch.randn(N, D, generator=g, dtype=torch.float64)
    ref = softmax_reference(s, v)
    rows = []
    variants = [
        ("per-element (exp)", lambda: per_element(s, v)),
        (f"block rowmax {block} (exp)", lambda: block_rowmax(s, v, block)),
        (f"block rowmax {block} (exp2, log2e prescale)", lambda: block_rowmax(s, v, block, use_exp2=True)),
        ("one-shot softmax (float32)", lambda: (softmax_reference(s.float(), v.float()), R * N)),
    ]
    for name, fn in variants:
        out, n_exp = fn()
        rows.append({
            "variant": name,
            "exp_per_score": n_exp / (R * N),
            "max_abs_err": float((out.double() - ref).abs().max()),
        })
    return pd.DataFrame(rows)


def merge(a: State, b: State) -> State:
    """Combine the states of two disjoint key sets into the state of their union.

    ``m = max(m_a, m_b)``; each side is rescaled by ``exp(m_side - m)``. An empty side (m = -inf) adds
    nothing. This is exact: merging the states of any split of the keys equals the one-shot state.
    """
    m = torch.maximum(a.m, b.m)
    wa, wb = _safe_alpha(a.m, m), _safe_alpha(b.m, m)
    wa = torch.where(torch.isneginf(a.m), torch.zeros_like(wa), wa)
    wb = torch.where(torch.isneginf(b.m), torch.zeros_like(wb), wb)
    return State(m, wa * a.l + wb * b.l, wa.unsqueeze(-1) * a.acc + wb.unsqueeze(-1) * b.acc)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """The split-K combine in the (out, lse) form kernels store: weights ``exp(lse_side - lse)``.

    Returns (out, lse) of the union. Rows empty on both sides stay out = 0, lse = -inf.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), 0, lse)
    wa = torch.where(torch.isneginf(lse_a), 0, torch.exp(lse_a - safe)).unsqueeze(-1)
    wb = torch.where(torch.isneginf(lse_b), 0, torch.exp(lse_b - safe)).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def state_of(s: torch.Tensor, v: torch.Tensor, block: int | None = None) -> State:
    """The state after streaming all of ``s`` [..., N] / ``v`` [..., N, D] (float64), in blocks of ``block``."""
    s, v = s.to(torch.float64), v.to(torch.float64)
    st = State.empty(v.shape[-1], torch.float64, tuple(s.shape[:-1]))
    n = s.shape[-1]
    block = n if block is None else block
    for j0 in range(0, n, max(1, block)):
        st, _ = update(st, s[..., j0 : j0 + block], v[..., j0 : j0 + block, :])
    return st


def split_k(s: torch.Tensor, v: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the keys of each row into ``splits`` chunks, compute each chunk's (out, lse) on its own, and
    combine them with :func:`merge_lse`, as split-K decoding does. Returns (out, lse)."""
    n = s.shape[-1]
    bounds = [round(i * n / splits) for i in range(splits + 1)]
    out = lse = None
    for a, b in itertools.pairwise(bounds):
        o, lse_c = state_of(s[..., a:b], v[..., a:b, :]).finalize()
        out, lse = (o, lse_c) if out is None else merge_lse(out, lse, o, lse_c)
    return out, lse
