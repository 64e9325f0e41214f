"""Counting what a case asks for: allowed scores (exact, per row from lengths and band), useful FLOPs,
the fewest bytes a kernel must move, rows with no allowed key."""

from __future__ import annotations

import torch

from attnlab.bench.suites import BenchCase
from attnlab.masks import MaskSpec

# ---------------------------------------------------------------------------------------------------------
# Counting: allowed scores, FLOPs, bytes
# ---------------------------------------------------------------------------------------------------------


def row_counts(spec: MaskSpec) -> torch.Tensor:
    """Allowed keys of each query row from the lengths and the band, analytically: int64 [B, Nq] (CPU).

    Row i of batch b (with ``i < Lq_b``) may see keys ``[lo, hi)`` with ``lo = max(0, diag - left)`` and
    ``hi = min(Lk_b, diag + right + 1)`` (unbounded sides give 0 and Lk_b), ``diag = i`` (top-left) or
    ``i + Lk_b - Lq_b`` (bottom-right). An explicit mask is not included (see :func:`allowed_count`).
    """
    lq, lk = (t.view(-1, 1) for t in spec.lengths("cpu"))
    i = torch.arange(spec.Nq, dtype=torch.long).view(1, -1)
    diag = i + spec.diag_offset("cpu").view(-1, 1)
    lo = torch.zeros_like(diag) if spec.left is None else (diag - spec.left).clamp_min(0)
    hi = lk.expand_as(diag) if spec.right is None else torch.minimum(lk, diag + spec.right + 1)
    return (hi - lo).clamp_min(0) * (i < lq)


def allowed_count(spec: MaskSpec, chunk_rows: int = 1024) -> int:
    """Number of allowed (b, h, i, j) scores summed over batch entries and query heads.

    Analytic per row (:func:`row_counts`) when there is no explicit mask; with a bool mask or a bias, the
    predicate (and the bias's -inf entries) is counted exactly, chunk by chunk over rows.
    """
    if spec.mask is None and spec.bias is None:
        return int(row_counts(spec).sum()) * spec.Hq
    total = 0
    for i0 in range(0, spec.Nq, chunk_rows):
        i1 = min(spec.Nq, i0 + chunk_rows)
        total += int(spec.allowed_with_bias(i0, i1).expand(spec.B, spec.Hq, i1 - i0, spec.Nk).sum())
    return total


def useful_flops(case: BenchCase, spec: MaskSpec | None = None) -> int:
    """FlashAttention-convention FLOPs counting only allowed scores: 4 * D * allowed_count."""
    return 4 * case.D * allowed_count(spec if spec is not None else case.spec())


def min_bytes(case: BenchCase, spec: MaskSpec | None = None) -> int:
    """q and out once, plus the K and V rows of the keys any query of a batch entry may attend."""
    spec = spec if spec is not None else case.spec()
    qo = 2 * case.B * case.Hq * case.Nq * case.D * case.elem_size
    keys = 0
    for b in range(case.B):
        lo, hi = spec.key_range(b, 0, case.Nq)
        keys += max(0, hi - lo)
    return qo + 2 * keys * case.hkv * case.D * case.elem_size


def empty_rows(spec: MaskSpec) -> torch.Tensor | None:
    """bool [B, Hm, Nq, 1] of rows with no allowed key (on the spec's device), or None when there is none."""
    if spec.mask is None and spec.bias is None:
        e = (row_counts(spec) == 0).view(spec.B, 1, spec.Nq, 1)
        return e.to(spec.device) if bool(e.any()) else None
    rows = [~spec.allowed_with_bias(i0, min(spec.Nq, i0 + 1024)).any(dim=-1, keepdim=True)
            for i0 in range(0, spec.Nq, 1024)]
    e = torch.cat(rows, dim=2)
    return e if bool(e.any()) else None
