"""The public entry point: :func:`attention`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from attnlab import backends as _backends
from attnlab.problem import make_problem

_poison = False


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Fill every output with NaN before the backend runs, so an element it fails to write shows up.

    The checker uses this: an unwritten element then fails as NaN instead of passing by luck.
    """
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


def attention(
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
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked multi-head attention ``softmax(scale * q k^T + bias, masked) v``.

    q is [B, Hq, Nq, D] and k, v are [B, Hkv, Nk, D] (layout "bhnd"), or [B, N, H, D] (layout "bnhd"),
    any strides. GQA/MQA: query head h reads kv head h // (Hq // Hkv). Masks: ``causal`` and ``window``
    (relative to the diagonal set by ``align``), effective lengths ``kv_len`` / ``q_len`` [B], and an
    explicit ``mask`` (bool, True = attend; or float, an additive bias) broadcastable to
    [B, Hq, Nq, Nk]. A row with no allowed key returns 0 (and lse -inf), never NaN.

    Returns out (q's dtype, device and layout) or, with ``return_lse``, (out, lse [B, Hq, Nq] float32).
    Validating ``kv_len``/``q_len`` reads their min and max: one device sync when they are GPU tensors.
    """
    prob = make_problem(
        q, k, v, causal=causal, window=window, align=align, kv_len=kv_len, q_len=q_len,
        mask=mask, scale=scale, layout=layout,
    )
    be = _backends.resolve(backend, prob)
    out, out_bhnd = prob.new_out()
    lse = torch.empty(prob.B, prob.Hq, prob.Nq, dtype=torch.float32, device=prob.device) if return_lse else None
    if out.numel() == 0 or prob.Nk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
    else:
        if _poison:
            out.fill_(float("nan"))
            if lse is not None:
                lse.fill_(float("nan"))
        be.forward(prob, out_bhnd, lse)
    return (out, lse) if return_lse else out
