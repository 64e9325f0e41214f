"""Problem: validate one call's tensors and keywords into the normalized form every backend consumes.

Backends see q, k, v as ``[B, H, N, D]`` *views* (layout "bnhd" is a transpose, never a copy; any strides;
v's head dim ``Dv`` may differ from q's and k's ``D``), a :class:`~attnlab.masks.MaskSpec`, and the softmax
scale. A packed (variable-length) call is a Problem with a :class:`Packed`: its q, k, v are the packed
tensors as ``[1, H, total, D]`` views, and B, Nq, Nk are the number of sequences and the bounds on their
lengths. Every check of the public contract that is not about masks lives here, so that bad input fails the
same way whatever the backend.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from attnlab.masks import MaskSpec, plain_int
from attnlab.score_mods import ScoreMods

LAYOUTS = ("bhnd", "bnhd")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The 8-bit float the FP8 forward takes (with its descales; :func:`descales`); its output is bfloat16.
FP8 = torch.float8_e4m3fn
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Packed:
    """The sequences of a packed call (:func:`attnlab.attention_varlen`): sequence b is rows
    ``cu_q[b]:cu_q[b+1]`` of q and ``cu_k[b]:cu_k[b+1]`` of k and v.

    ``checked``: the prefix sums were validated on the host (every row belongs to one sequence no longer than
    its bound); otherwise they live on the GPU and were never read back, and kernels clamp what they load.
    """

    cu_q: torch.Tensor  #: int32 [B + 1] on q's device
    cu_k: torch.Tensor  #: int32 [B + 1] on q's device
    max_q: int
    max_k: int
    checked: bool

    @property
    def seqs(self) -> int:
        return self.cu_q.shape[0] - 1


@dataclass(frozen=True)
class Problem:
    """One attention call, validated. q, k, v are [B, H, N, D] views of the caller's tensors (with
    ``packed``: [1, H, total, D] views of the packed ones)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: MaskSpec
    scale: float
    layout: str
    packed: Packed | None = None
    mods: ScoreMods = field(default_factory=ScoreMods)  #: softcap, ALiBi slopes, sinks (:mod:`attnlab.score_mods`)
    #: FP8 inputs only: float32 [B, Hq, 3], per query head the descales of q, of its kv head's k and of its v
    #: (:func:`descales`); None for every other dtype.
    descale: torch.Tensor | None = None

    @property
    def B(self) -> int:
        """Batch entries; for a packed call, sequences."""
        return self.q.shape[0] if self.packed is None else self.packed.seqs

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Nq(self) -> int:
        """Query rows per batch entry; for a packed call, the bound on a sequence's (max_seqlen_q)."""
        return self.q.shape[2] if self.packed is None else self.packed.max_q

    @property
    def Nk(self) -> int:
        """Keys per batch entry; for a packed call, the bound on a sequence's (max_seqlen_k)."""
        return self.k.shape[2] if self.packed is None else self.packed.max_k

    @property
    def D(self) -> int:
        """The head dim of q and k."""
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        """The head dim of v and of the output."""
        return self.v.shape[3]

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head h // group."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def out_dtype(self) -> torch.dtype:
        """The output's dtype: q's, except bfloat16 for FP8 inputs."""
        return torch.bfloat16 if self.q.dtype == FP8 else self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def to_layout(self, t: torch.Tensor) -> torch.Tensor:
        """A [B, H, N, D] tensor as a view in the caller's layout (packed: [total, H, D])."""
        if self.packed is not None:
            return t.transpose(1, 2).squeeze(0)
        return t if self.layout == "bhnd" else t.transpose(1, 2)

    def new_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate the output, contiguous in the caller's layout, and return (caller's view, bhnd view).
        A packed output whose sequences were not checked on the host starts as zeros: rows a too small
        max_seqlen_q leaves out are then 0, never uninitialized."""
        if self.packed is not None:
            total = self.q.shape[2]
            make = torch.empty if self.packed.checked else torch.zeros
            out = make((total, self.Hq, self.Dv), dtype=self.out_dtype, device=self.device)
            return out, out.unsqueeze(0).transpose(1, 2)
        shape = (self.B, self.Hq, self.Nq, self.Dv) if self.layout == "bhnd" else (self.B, self.Nq, self.Hq, self.Dv)
        out = torch.empty(shape, dtype=self.out_dtype, device=self.device)
        return out, (out if self.layout == "bhnd" else out.transpose(1, 2))

    def new_lse(self) -> torch.Tensor:
        """An lse tensor for this problem, float32: [B, Hq, Nq], or for a packed call [1, Hq, total] (the
        caller's [Hq, total] with a batch dim; -inf where a packed call left rows out)."""
        if self.packed is not None:
            lse = torch.empty((1, self.Hq, self.q.shape[2]), dtype=torch.float32, device=self.device)
            return lse if self.packed.checked else lse.fill_(float("-inf"))
        return torch.empty((self.B, self.Hq, self.Nq), dtype=torch.float32, device=self.device)


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
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
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
    allowed = DTYPES + ((torch.float64,) if allow_float64 else ()) + (FP8,)
    if q.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"q has dtype {q.dtype}; this backend takes {names}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"k and v must agree in all but the head dim; got {list(k.shape)} and {list(v.shape)}")
    if Bk != B:
        raise ValueError(f"q and k/v must have the same batch size; got {B} and {Bk}")
    if Dk != D:
        raise ValueError(f"q and k/v must have the same head dim D; got {D} and {Dk}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in [1, {MAX_HEAD_DIM}]; got {D}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"v's head dim Dv must be in [1, {MAX_HEAD_DIM}]; got {v.shape[3]}")
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
    mods = ScoreMods.build(B, Hq, q.device, softcap, alibi_slopes, sinks)
    descale = descales(q, Hkv, q_descale, k_descale, v_descale)
    return Problem(q=q, k=k, v=v, spec=spec, scale=float(scale), layout=layout, mods=mods, descale=descale)


def descales(q: torch.Tensor, Hkv: int, q_descale: Any, k_descale: Any, v_descale: Any) -> torch.Tensor | None:
    """The FP8 descales of a call with q ``[B, Hq, N, D]`` as one float32 ``[B, Hq, 3]`` tensor (q's, its kv
    head's k's, v's), or None for other dtypes. Each descale is None (1), a number, a one-element float tensor (per
    tensor) or a float tensor ``[B, H]`` (per head: H is q's heads for q_descale, the kv heads for the others), on
    q's device (a one-element one may be on the CPU). q's may also be per kv head, ``[B, Hkv]`` (FlashAttention-3's
    shape: one value for a group's query heads). The input's real value is its stored value times its descale."""
    given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if q.dtype != FP8:
        named = [n for n, d in given.items() if d is not None]
        if named:
            verb = "applies" if len(named) == 1 else "apply"
            raise ValueError(f"{', '.join(named)} {verb} to float8_e4m3fn inputs only; q has dtype {q.dtype}")
        return None
    B, Hq = q.shape[0], q.shape[1]
    group = Hq // Hkv
    planes = []
    for n, d in given.items():
        p = _descale(n, d, B, Hkv if n != "q_descale" or _per_kv_head(d, B, Hkv) else Hq, q.device)
        planes.append(p.repeat_interleave(group, dim=1) if p.shape[1] != Hq else p)  # a kv head's, for its group
    return torch.stack(planes, dim=-1).contiguous()


def _per_kv_head(d: Any, B: int, Hkv: int) -> bool:
    """Whether a q descale is given per kv head ([B, Hkv], FlashAttention-3's shape under GQA)."""
    return isinstance(d, torch.Tensor) and tuple(d.shape) == (B, Hkv)


def descale_number(name: str, d: Any) -> bool:
    """Whether descale ``d`` is a number (then finite, else ValueError); a float tensor gives False, anything else
    a TypeError."""
    if isinstance(d, numbers.Real) and not isinstance(d, bool):
        if not math.isfinite(d):
            raise ValueError(f"{name} must be finite; got {d}")
        return True
    if not isinstance(d, torch.Tensor) or not d.dtype.is_floating_point or d.dtype == FP8:
        raise TypeError(f"{name} must be a number or a float tensor (one element, or [B, H] per head); got {d!r}")
    return False


def _descale(name: str, d: Any, B: int, H: int, device: torch.device) -> torch.Tensor:
    """One descale as float32 ``[B, H]`` on ``device``."""
    if d is None:
        d = 1.0
    if descale_number(name, d):
        return torch.full((B, H), float(d), dtype=torch.float32, device=device)
    if d.numel() == 1 and d.device.type == "cpu" and device.type != "cpu":
        # a host scalar is read on the host and filled in on q's device: no copy, no sync (a CUDA graph keeps the
        # value it was captured with)
        return torch.full((B, H), float(d), dtype=torch.float32, device=device)
    if d.device != device:
        raise ValueError(f"{name} is on {d.device} but q is on {device}")
    if d.numel() == 1:
        return d.reshape(1, 1).float().expand(B, H)
    if tuple(d.shape) != (B, H):
        raise ValueError(f"{name} must have one element (per tensor) or shape [B, H] = [{B}, {H}] (per head); got "
                         f"{list(d.shape)}")
    return d.float()


def _prefix_sums(name: str, cu: Any, total: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Validate one ``cu_seqlens`` tensor: (int32 [B + 1] on ``device``, whether it was checked on the host).
    Host prefix sums must start at 0, end at ``total`` and never decrease; GPU ones are never read back."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of prefix sums [B + 1]; got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32 (FlashAttention's convention); got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape [B + 1] with B >= 0; got {list(cu.shape)}")
    if cu.device.type != "cpu":
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device} but q is on {device}")
        return cu.contiguous(), False
    host = cu.tolist()
    if host[0] != 0 or host[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}; got {host[0]} ... {host[-1]}")
    steps = [b - a for a, b in itertools.pairwise(host)]
    if any(s < 0 for s in steps):
        raise ValueError(f"{name} must never decrease; got {host}")
    if device.type == "cuda":
        cu = cu.pin_memory().to(device, non_blocking=True)  # host prefix sums: no stream sync
    return cu.to(device).contiguous(), True


def _max_seqlen(name: str, value: Any) -> int:
    value = plain_int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value


def make_packed_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
    max_seqlen_k: Any, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
    align: str | None = None, scale: float | None = None, allow_float64: bool = False,
    softcap: float | None = None, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> Problem:
    """Validate the arguments of :func:`attnlab.attention_varlen` into a packed :class:`Problem`.

    q is [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; the prefix sums int32 [B + 1]. ``align``
    is required with ``causal`` or ``window``: a sequence's lengths may live on the GPU, where the host cannot
    see whether they differ. Raises TypeError / ValueError naming the problem and what is allowed.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have rank 3 ([total, H, D], packed sequences); got shape {list(t.shape)}")
    if q.dtype == FP8:
        raise TypeError("attention_varlen takes float32, float16 or bfloat16; the FP8 forward is attnlab.attention "
                        "with q_descale, k_descale, v_descale")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must hold the same packed keys; got {k.shape[0]} and {v.shape[0]} rows")
    if (causal or window is not None) and align is None:
        raise ValueError("attention_varlen needs align='top_left' or 'bottom_right' with causal or window: a "
                         "sequence's query and key lengths may differ, and the prefix sums may be on the GPU")
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
    base = make_problem(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal, window=window,
                        align=align, scale=scale, layout="bnhd", allow_float64=allow_float64)
    cu_q, host_q = _prefix_sums("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k, host_k = _prefix_sums("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got {cu_q.shape[0]} and "
                         f"{cu_k.shape[0]}")
    for name, cu, host, bound in (("q", cu_seqlens_q, host_q, max_q), ("k", cu_seqlens_k, host_k, max_k)):
        if host:
            longest = int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0
            if longest > bound:
                raise ValueError(f"max_seqlen_{name} must be at least every sequence's length; got {bound}, and "
                                 f"a sequence has {longest}")
    seqs = cu_q.shape[0] - 1
    spec = MaskSpec.build(seqs, base.Hq, max_q, max_k, device=q.device, causal=causal, window=window,
                          align=base.spec.align)
    packed = Packed(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, checked=host_q and host_k)
    mods = ScoreMods.build(seqs, base.Hq, q.device, softcap, alibi_slopes, sinks)
    return Problem(q=base.q, k=base.k, v=base.v, spec=spec, scale=base.scale, layout="bnhd", packed=packed,
                   mods=mods)
