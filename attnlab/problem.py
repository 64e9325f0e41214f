"""Problem: validate one call's tensors and keywords into the normalized form every backend consumes.

Backends see q, k, v as ``[B, H, N, D]`` *views* (layout "bnhd" is a transpose, never a copy; any strides),
a :class:`~attnlab.masks.MaskSpec`, and the softmax scale. Every check of the public contract that is not
about masks lives here, so that bad input fails the same way whatever the backend.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.masks import MaskSpec

LAYOUTS = ("bhnd", "bnhd")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Problem:
    """One attention call, validated. q, k, v are [B, H, N, D] views of the caller's tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: MaskSpec
    scale: float
    layout: str

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Nq(self) -> int:
        return self.q.shape[2]

    @property
    def Nk(self) -> int:
        return self.k.shape[2]

    @property
    def D(self) -> int:
        return self.q.shape[3]

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head h // group."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def to_layout(self, t: torch.Tensor) -> torch.Tensor:
        """A [B, H, N, D] tensor as a view in the caller's layout."""
        return t if self.layout == "bhnd" else t.transpose(1, 2)

    def new_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate the output, contiguous in the caller's layout, and return (caller's view, bhnd view)."""
        shape = (self.B, self.Hq, self.Nq, self.D) if self.layout == "bhnd" else (self.B, self.Nq, self.Hq, self.D)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        return out, (out if self.layout == "bhnd" else out.transpose(1, 2))


def _check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have rank 4 ([B, H, N, D] or [B, N, H, D]); got shape {list(t.shape)}")
    return t


def make_problem(
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
    allow_float64: bool = False,
) -> Problem:
    """Validate the arguments of :func:`attnlab.attention` and return the normalized :class:`Problem`.

    Raises ``TypeError`` for wrong types and ``ValueError`` for wrong values, each naming the problem and
    what is allowed.
    """
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "bnhd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    allowed = DTYPES + ((torch.float64,) if allow_float64 else ())
    if q.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"q has dtype {q.dtype}; this backend takes {names}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape; got {list(k.shape)} and {list(v.shape)}")
    if Bk != B:
        raise ValueError(f"q and k/v must have the same batch size; got {B} and {Bk}")
    if Dk != D:
        raise ValueError(f"q and k/v must have the same head dim D; got {D} and {Dk}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in [1, {MAX_HEAD_DIM}]; got {D}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of kv heads (GQA/MQA); got Hq={Hq}, Hkv={Hkv}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None (1/sqrt(D)); got {scale!r}")
    spec = MaskSpec.build(
        B, Hq, Nq, Nk, device=q.device, causal=causal, window=window, align=align,
        kv_len=kv_len, q_len=q_len, mask=mask,
    )
    return Problem(q=q, k=k, v=v, spec=spec, scale=float(scale), layout=layout)
