"""Masks: turn attention's mask keywords into one validated description that every backend consumes.

The semantics (docs/contract.md, "Masks") in one place. For batch b, query head h, row i and key j, key j
is *allowed* iff

    j < Lk_b  and  i < Lq_b                      (effective lengths: kv_len, q_len)
    and  diag_i - left <= j <= diag_i + right     (window; causal is right = 0; None = unbounded)
    and  mask[b, h, i, j]                        (explicit bool mask, True = attend)

where ``diag_i = i`` for ``align="top_left"`` and ``diag_i = i + Lk_b - Lq_b`` for ``"bottom_right"``.
An additive bias (float mask) adds to the score; ``-inf`` there also removes the key.

:class:`MaskSpec` holds this as: the effective lengths (device tensors for kernels, host lists for
drawing), the diagonal offset per batch, the window bounds, and the explicit mask or bias as *expanded
views* (stride 0 on broadcast dims: never materialized). It offers the per-element predicate
(:meth:`MaskSpec.allowed`, for the reference and the PyTorch backends) derived from the rule written once as
FlexAttention's ``mask_mod`` / ``score_mod`` (:attr:`MaskSpec.mask_mod`, :attr:`MaskSpec.score_mod`: what
the Flex competitor compiles), the analytic key range of a block
of rows (:meth:`MaskSpec.key_range`, the loop bounds kernels use), and the tile classifier
(:meth:`MaskSpec.tile_classes`: each tile of the score matrix is empty, partial or full).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGNS = ("top_left", "bottom_right")

#: Tile classes returned by :meth:`MaskSpec.tile_classes`.
EMPTY, PARTIAL, FULL = 0, 1, 2


def plain_int(value: Any) -> Any:
    """A NumPy (or other ``numbers.Integral``) integer as a Python int; anything else (bools too) as it is."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)) and type(value).__name__ != "bool_":
        return int(value)
    return value


def _as_lengths(name: str, value: Any, batch: int, limit: int, device: torch.device) -> torch.Tensor | None:
    """Validate kv_len / q_len and return a contiguous int32 tensor [B] on ``device`` (None if not given)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a sequence of ints or an integer tensor of shape [B]; got a bool")
    value = plain_int(value)
    if isinstance(value, int):
        if batch > 0 and not 0 <= value <= limit:
            raise ValueError(f"{name} values must lie in [0, {limit}]; got values in [{value}, {value}]")
        return int_lengths(batch, value, device)
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor; got dtype {value.dtype}")
        if value.dim() == 0:
            value = value.expand(batch)
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must have shape [B] = [{batch}]; got {list(value.shape)}")
        t = value
    elif isinstance(value, Sequence):
        value = [plain_int(x) for x in value]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise TypeError(f"{name} as a sequence must hold ints (Python or NumPy); got {value!r}")
        if len(value) != batch:
            raise ValueError(f"{name} must have one length per batch entry (B = {batch}); got {len(value)}")
        t = torch.tensor(list(value), dtype=torch.int64)
    else:
        raise TypeError(
            f"{name} must be an int, a sequence of ints or an integer tensor of shape [B]; got {type(value).__name__}"
        )
    if t.device.type != "cpu":
        return device_lengths(t.to(device), limit)
    if batch > 0:
        lo, hi = (int(x) for x in torch.stack([t.min(), t.max()]).tolist())
        if lo < 0 or hi > limit:
            raise ValueError(f"{name} values must lie in [0, {limit}]; got values in [{lo}, {hi}]")
    if device.type == "cuda":
        t = t.to(torch.int32).pin_memory().to(device, non_blocking=True)  # host lengths: no stream sync
    t = t.to(device=device, dtype=torch.int32)
    if t.stride() != (1,):  # an expanded 0-dim length or a strided view: kernels read a plain int32 array
        t = torch.empty(batch, dtype=torch.int32, device=device).copy_(t)
    return t


def int_lengths(batch: int, value: int, device: torch.device) -> torch.Tensor:
    """One length (already checked) for every batch entry, as kernels read it: int32 [B], made on ``device``
    (a fill there: no host copy, no sync)."""
    return torch.full((batch,), value, dtype=torch.int32, device=device)


def device_lengths(t: torch.Tensor, limit: int) -> torch.Tensor:
    """Lengths already on the GPU, as kernels read them: a new contiguous int32 tensor clamped to [0, limit].

    They are never read back to the host (that would synchronize the device on every call); values outside
    [0, limit] mean the nearest bound. One small kernel for int32 input, two for other integer dtypes.
    """
    if t.dtype == torch.int32:
        return t.clamp(0, limit).contiguous()  # clamp makes a new tensor: the caller's is never written
    out = torch.empty(t.shape, dtype=torch.int32, device=t.device)
    return out.copy_(t).clamp_(0, limit)


def _as_window(window: Any, causal: bool) -> tuple[int | None, int | None]:
    if window is None:
        left, right = None, None
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints or None; got {window!r}")
        left, right = plain_int(window[0]), plain_int(window[1])
        for side, x in (("left", left), ("right", right)):
            if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
                raise TypeError(f"window {side} must be an int or None; got {x!r}")
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


#: Bias dtypes the kernels read as they are (converted to float32 in registers, tile by tile).
BIAS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _as_mask(mask: torch.Tensor | None, shape: tuple[int, int, int, int], device: torch.device):
    """Split ``mask`` into (bool view, bias view), each expanded to ``shape`` without copying anything: the
    broadcast dims get stride 0 and a bias keeps the caller's dtype (kernels convert it in registers).
    Only a bias in a dtype the kernels do not read (float8 kinds) is converted to float32, at its own size."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor (bool or floating); got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q is on {device}; put them on one device")
    if mask.dim() > 4:
        raise ValueError(f"mask must broadcast to [B, Hq, Nq, Nk] = {list(shape)}; got rank {mask.dim()}")
    try:
        if torch.broadcast_shapes(tuple(mask.shape), shape) != shape:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"mask of shape {list(mask.shape)} does not broadcast to [B, Hq, Nq, Nk] = {list(shape)}"
        ) from None
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    if m.dtype == torch.bool:
        return m.expand(shape), None
    if m.dtype.is_floating_point:
        if m.dtype not in BIAS_DTYPES:
            m = m.to(torch.float32)
        return None, m.expand(shape)
    raise TypeError(f"mask must be bool (True = attend) or floating (additive bias); got dtype {mask.dtype}")


@dataclass(frozen=True)
class MaskSpec:
    """Validated mask description of one attention problem (see the module docstring for the rule)."""

    B: int
    Hq: int
    Nq: int
    Nk: int
    causal: bool = False
    left: int | None = None  #: keys before the diagonal a row may see (None: unbounded)
    right: int | None = None  #: keys after the diagonal a row may see (None: unbounded; causal: 0)
    align: str = "top_left"
    kv_len: torch.Tensor | None = None  #: contiguous int32 [B] on the inputs' device, None = Nk
    q_len: torch.Tensor | None = None  #: contiguous int32 [B] on the inputs' device, None = Nq
    mask: torch.Tensor | None = None  #: bool view expanded to [B, Hq, Nq, Nk]
    #: the additive bias in the caller's dtype (one of BIAS_DTYPES), a view expanded to [B, Hq, Nq, Nk]: what
    #: the kernels read (converting to float32 in registers) and the reference adds. Never copied.
    bias: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  #: where predicates are built
    _host: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        B: int,
        Hq: int,
        Nq: int,
        Nk: int,
        *,
        device: torch.device | str = "cpu",
        causal: bool = False,
        window: tuple[int | None, int | None] | None = None,
        align: str | None = None,
        kv_len: Any = None,
        q_len: Any = None,
        mask: torch.Tensor | None = None,
    ) -> MaskSpec:
        """Validate the keywords of :func:`attnlab.attention` and build the spec."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current GPU, as torch reads it
            device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool; got {causal!r}")
        left, right = _as_window(window, causal)
        banded = causal or window is not None
        if align is None:
            if banded and Nq != Nk:
                raise ValueError(
                    f"causal/window with Nq != Nk ({Nq} != {Nk}) is ambiguous: pass align='top_left' "
                    "(row i's diagonal is key i, as PyTorch is_causal) or align='bottom_right' "
                    "(key i + Nk - Nq, as FlashAttention and KV-cache decoding)"
                )
            align = "top_left"
        elif align not in ALIGNS:
            raise ValueError(f"align must be one of {ALIGNS} or None; got {align!r}")
        shape = (B, Hq, Nq, Nk)
        bool_mask, bias = _as_mask(mask, shape, device)
        return cls(
            B=B,
            Hq=Hq,
            Nq=Nq,
            Nk=Nk,
            causal=causal,
            left=left,
            right=right,
            align=align,
            kv_len=_as_lengths("kv_len", kv_len, B, Nk, device),
            q_len=_as_lengths("q_len", q_len, B, Nq, device),
            mask=bool_mask,
            bias=bias,
            device=device,
        )

    # ---- summaries ---------------------------------------------------------------------------------
    @property
    def banded(self) -> bool:
        """True when a causal or window rule limits the keys of each row."""
        return self.left is not None or self.right is not None

    @property
    def kind(self) -> str:
        """A short name of the mask kinds in play, e.g. ``"causal+kv_len"`` (keys for autotuning, tables)."""
        parts = []
        if self.causal and self.left is None and self.right == 0:
            parts.append("causal" if self.align == "top_left" else "causal_br")
        elif self.banded:
            parts.append("window" if self.align == "top_left" else "window_br")
        if self.kv_len is not None:
            parts.append("kv_len")
        if self.q_len is not None:
            parts.append("q_len")
        if self.mask is not None:
            parts.append("bool_mask")
        if self.bias is not None:
            parts.append("bias")
        return "+".join(parts) or "dense"

    @property
    def bias_src(self) -> torch.Tensor | None:
        """The bias in the caller's dtype: :attr:`bias` itself (once a separate field beside a float32 copy)."""
        return self.bias

    @property
    def explicit(self) -> torch.Tensor | None:
        """The explicit mask or bias view, whichever is given."""
        return self.mask if self.mask is not None else self.bias

    # ---- lengths and diagonals ---------------------------------------------------------------------
    def lengths(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Lq, Lk) as int64 tensors [B] (defaults filled in)."""
        dev = self.device if device is None else torch.device(device)

        def filled(given: torch.Tensor | None, default: int) -> torch.Tensor:
            # Defaults are made on the device itself: a host tensor moved there would sync the stream.
            if given is None:
                return torch.full((self.B,), default, dtype=torch.long, device=dev)
            return given.to(device=dev, dtype=torch.long)

        return filled(self.q_len, self.Nq), filled(self.kv_len, self.Nk)

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """(Lq, Lk) as Python lists, cached (one device sync the first time)."""
        if "lengths" not in self._host:
            lq, lk = self.lengths(torch.device("cpu"))
            self._host["lengths"] = (lq.tolist(), lk.tolist())
        return self._host["lengths"]

    def diag_offset(self, device: torch.device | None = None) -> torch.Tensor:
        """Per-batch offset of the diagonal: 0 (top_left) or Lk_b - Lq_b (bottom_right), int64 [B]."""
        lq, lk = self.lengths(device)
        return lk - lq if self.align == "bottom_right" else torch.zeros_like(lk)

    # ---- the rule, once: FlexAttention's mask_mod and score_mod -----------------------------------
    def _mask_mod(self, explicit: bool = True) -> Callable:
        """The rule as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (index tensors that
        broadcast, or scalars under FlexAttention's vmap); ``explicit=False`` leaves the bool mask out."""
        kvl = self.kv_len.long() if self.kv_len is not None else None
        ql = self.q_len.long() if self.q_len is not None else None
        per_b = kvl is not None or ql is not None
        off_b = self.diag_offset() if self.align == "bottom_right" and per_b else None
        const_off = self.Nk - self.Nq if self.align == "bottom_right" and not per_b else 0
        left, right = self.left, self.right
        mask = self.mask if explicit else None

        def mask_mod(b, h, q_idx, kv_idx):
            ok = q_idx >= 0
            if kvl is not None:
                ok = ok & (kv_idx < kvl[b])
            if ql is not None:
                ok = ok & (q_idx < ql[b])
            if left is not None or right is not None:
                diag = q_idx + (off_b[b] if off_b is not None else const_off)
                if left is not None:
                    ok = ok & (kv_idx >= diag - left)
                if right is not None:
                    ok = ok & (kv_idx <= diag + right)
            if mask is not None:
                ok = ok & mask[b, h, q_idx, kv_idx]
            return ok

        return mask_mod

    @property
    def mask_mod(self) -> Callable | None:
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``: lengths, the band around ``diag = q_idx +
        offset`` (0 top-left; ``Lk_b - Lq_b`` bottom-right, per batch entry when lengths are given) and the
        explicit bool mask. None when there is nothing to express (dense, or a bias alone)."""
        if not (self.banded or self.kv_len is not None or self.q_len is not None or self.mask is not None):
            return None
        return self._mask_mod()

    @property
    def score_mod(self) -> Callable | None:
        """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``: adds the bias (in the score's dtype, as
        the kernels add it in float32); None without one."""
        if self.bias is None:
            return None
        bias = self.bias

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx].to(score.dtype)

        return score_mod

    def score_rows(self, s: torch.Tensor, i0: int = 0, i1: int | None = None) -> torch.Tensor:
        """:attr:`score_mod` on a block of scores ``s`` [B, Hq, rows, Nk] of rows ``i0 .. i1``, in ``s``'s dtype:
        what the reference and the PyTorch backends apply (the bias in the caller's dtype, :meth:`bias_rows`)."""
        bias = self.bias_rows(i0, i1)
        return s if bias is None else s + bias.to(s.dtype)

    def flex_mods(self) -> tuple[Callable | None, Callable | None, bool, bool]:
        """(mask_mod, score_mod, depends on b, depends on h): what ``create_block_mask`` and
        ``flex_attention`` take."""
        per_b = self.kv_len is not None or self.q_len is not None
        return self.mask_mod, self.score_mod, per_b or self.mask is not None, self.mask is not None

    # ---- the per-element predicate -----------------------------------------------------------------
    def allowed(
        self,
        i0: int = 0,
        i1: int | None = None,
        device: torch.device | str | None = None,
        *,
        explicit: bool = True,
    ) -> torch.Tensor:
        """Bool tensor [B, Hm, i1 - i0, Nk] (Hm = Hq with an explicit mask, else 1): True where j is allowed.

        :attr:`mask_mod` evaluated on the index grid, on the spec's device (then moved to ``device``). Rows
        ``i0 .. i1`` only, so callers can chunk. The bias is not included: add :meth:`bias_rows` to the
        scores, whose ``-inf`` entries remove keys too. ``explicit=False`` leaves the bool mask out
        (structure only: lengths and band).
        """
        i1 = self.Nq if i1 is None else i1
        dev = self.device
        b = torch.arange(self.B, device=dev).view(-1, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
        i = torch.arange(i0, i1, device=dev).view(1, 1, -1, 1)
        j = torch.arange(self.Nk, device=dev).view(1, 1, 1, -1)
        ok = self._mask_mod(False)(b, h, i, j)  # lengths and band: the same for every head
        if explicit and self.mask is not None:  # the bool mask's rows as a slice (mask_mod indexes it per element)
            ok = (ok & self.mask[:, :, i0:i1]).contiguous()
        else:
            ok = ok.expand(self.B, 1, i1 - i0, self.Nk).contiguous()
        return ok if device is None else ok.to(device)

    def bias_rows(self, i0: int = 0, i1: int | None = None) -> torch.Tensor | None:
        """The additive bias for rows ``i0 .. i1`` in the caller's dtype, a view [B, Hq, rows, Nk], or None."""
        if self.bias is None:
            return None
        return self.bias[:, :, i0 : (self.Nq if i1 is None else i1)]

    # ---- loop bounds and the tile classifier -------------------------------------------------------
    def key_range(self, b: int, i0: int, i1: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that rows ``i0 .. i1-1`` of batch ``b`` may attend, from lengths and the band.

        Ignores the explicit mask (data, not structure). Kernels compute the same bounds on the device
        to skip tiles that are empty by construction. ``lo >= hi`` means no key at all.
        """
        lqs, lks = self.host_lengths()
        lq, lk = lqs[b], lks[b]
        i1 = min(i1, lq)
        if i0 >= i1:
            return 0, 0
        off = lk - lq if self.align == "bottom_right" else 0
        lo = 0 if self.left is None else max(0, i0 + off - self.left)
        hi = lk if self.right is None else min(lk, i1 - 1 + off + self.right + 1)
        return lo, max(lo, hi)

    def tile_classes(self, block_m: int, block_n: int, *, explicit: bool = True) -> torch.Tensor:
        """Classify each (block_m x block_n) tile: EMPTY (0), PARTIAL (1) or FULL (2).

        Returns int8 [B, Hm, ceil(Nq/block_m), ceil(Nk/block_n)] (Hm = Hq when the explicit mask or bias
        takes part, else 1). Elements past Nq/Nk do not count. With ``explicit=True`` the bool mask and
        the bias's ``-inf`` entries take part (exact, computed chunk by chunk); with ``explicit=False``
        only the structure (lengths, band) does, which is what kernels can know without reading the mask.
        """
        if block_m < 1 or block_n < 1:
            raise ValueError(f"block sizes must be positive; got {block_m} x {block_n}")
        tm, tn = math.ceil(self.Nq / block_m), math.ceil(self.Nk / block_n)
        use_explicit = explicit and (self.mask is not None or self.bias is not None)
        hm = self.Hq if use_explicit else 1
        out = torch.empty(self.B, hm, tm, tn, dtype=torch.int8)
        pad_n = tn * block_n - self.Nk
        for t in range(tm):
            i0, i1 = t * block_m, min(self.Nq, (t + 1) * block_m)
            ok = self.allowed_with_bias(i0, i1, "cpu") if use_explicit else self.allowed(i0, i1, "cpu", explicit=False)
            ok = ok.expand(self.B, hm, i1 - i0, self.Nk)
            ok = torch.nn.functional.pad(ok.to(torch.int8), (0, pad_n)).view(self.B, hm, i1 - i0, tn, block_n)
            valid = torch.nn.functional.pad(
                torch.ones(self.Nk, dtype=torch.int8), (0, pad_n)
            ).view(tn, block_n).bool()
            any_ok = ok.bool().any(dim=(2, 4))
            all_ok = (ok.bool() | ~valid.view(1, 1, 1, tn, block_n)).all(dim=(2, 4))
            out[:, :, t] = torch.where(all_ok, FULL, torch.where(any_ok, PARTIAL, EMPTY)).to(torch.int8)
        return out

    def allowed_with_bias(self, i0: int = 0, i1: int | None = None,
                          device: torch.device | str | None = None) -> torch.Tensor:
        """:meth:`allowed`, and where a bias is given also its entries that are not -inf: the keys that get
        a nonzero weight (rows ``i0 .. i1``, on ``device``, default the spec's)."""
        ok = self.allowed(i0, i1, device)
        if self.bias is not None:
            ok = ok & (self.bias[:, :, i0 : (self.Nq if i1 is None else i1)].to(ok.device) != float("-inf"))
        return ok

    def work_fraction(self, block_m: int, block_n: int, *, explicit: bool = False) -> dict[str, float]:
        """Fractions of tiles that are empty, partial and full: the work a block-skipping kernel saves."""
        c = self.tile_classes(block_m, block_n, explicit=explicit)
        n = max(1, c.numel())
        return {name: float((c == k).sum()) / n for name, k in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}
