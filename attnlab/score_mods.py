"""Score modifiers: the keywords models ship with, validated into one value, and their rule written once in
PyTorch (for the reference and the PyTorch backends; the Triton kernels apply the same rule tile by tile).

For query i and key j of batch b and query head h, with s = scale * q.k (natural units):

    s <- c * tanh(s / c)                         softcap=c (Gemma-2), first
    s <- s - slope[b, h] * |i + Lk - Lq - j|     alibi_slopes (FlashAttention's rule: Lq, Lk the row's lengths,
                                                 whatever ``align`` says), then the bias and the masks
    softmax over the allowed keys and one virtual key of logit sinks[h] and value 0 (gpt-oss): the sink is not
    capped, gets no ALiBi and no mask; lse counts it, so a row with no allowed key gives 0 and lse = sinks[h].
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ScoreMods:
    """The validated score modifiers of one call (all None: none)."""

    softcap: float | None = None
    #: float32 [B, Hq] on the inputs' device (an [Hq] argument expanded over B: stride 0, never copied)
    alibi: torch.Tensor | None = None
    #: the caller's sinks [Hq] (any float dtype; its gradient is returned in that dtype)
    sinks: torch.Tensor | None = None
    #: the sinks as the kernels read them: detached and contiguous, in their own dtype (the kernels compute in
    #: float32); no copy unless they are strided
    kernel_sinks: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.sinks is not None

    @classmethod
    def build(cls, B: int, Hq: int, device: torch.device, softcap: Any = None, alibi_slopes: Any = None,
              sinks: Any = None) -> ScoreMods:
        """Validate the keywords: ``softcap`` a finite float > 0 or None; ``alibi_slopes`` float32 [Hq] or
        [B, Hq], not requiring grad; ``sinks`` floating [Hq]; both on the inputs' device."""
        if softcap is not None:
            if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
                raise TypeError(f"softcap must be a float > 0 or None; got {softcap!r}")
            if not (math.isfinite(softcap) and softcap > 0):
                raise ValueError(f"softcap must be a finite float > 0; got {softcap!r}")
            softcap = float(softcap)
        alibi = None
        if alibi_slopes is not None:
            t = _tensor("alibi_slopes", alibi_slopes, device)
            if t.dtype != torch.float32:
                raise TypeError(f"alibi_slopes must be float32 (FlashAttention's convention); got {t.dtype}")
            if t.requires_grad:
                raise ValueError("alibi_slopes must not require grad: attnlab returns no gradient for the slopes "
                                 "(detach them, or make the bias a float mask that requires grad)")
            if tuple(t.shape) == (Hq,):
                t = t.contiguous().expand(B, Hq)
            elif tuple(t.shape) != (B, Hq):
                raise ValueError(f"alibi_slopes must have shape [Hq] = [{Hq}] or [B, Hq] = [{B}, {Hq}]; "
                                 f"got {list(t.shape)}")
            alibi = t
        if sinks is not None:
            t = _tensor("sinks", sinks, device)
            if not t.dtype.is_floating_point:
                raise TypeError(f"sinks must be a floating tensor [Hq]; got dtype {t.dtype}")
            if tuple(t.shape) != (Hq,):
                raise ValueError(f"sinks must have shape [Hq] = [{Hq}]; got {list(t.shape)}")
            sinks = t
        return cls(softcap, alibi, sinks, None if sinks is None else sinks.detach().contiguous())

    def empty_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The lse of rows with no allowed key, shaped like ``lse`` ([B, Hq, N]): -inf, or each head's sink."""
        if self.sinks is None:
            return torch.full_like(lse, float("-inf"))
        return self.sinks.detach().float().view(1, -1, 1).expand(lse.shape)

    # ---- the rule in PyTorch ---------------------------------------------------------------------------
    def scores(self, s: torch.Tensor, i0: int, lq: torch.Tensor, lk: torch.Tensor) -> torch.Tensor:
        """Softcap, then ALiBi, on scaled scores ``s`` [B, Hq, rows, Nk] of rows ``i0 ..`` in ``s``'s dtype;
        ``lq``, ``lk``: each batch entry's effective lengths [B]."""
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.alibi is not None:
            B, _, rows, Nk = s.shape
            i = torch.arange(i0, i0 + rows, device=s.device).view(1, 1, rows, 1)
            j = torch.arange(Nk, device=s.device).view(1, 1, 1, Nk)
            dist = (i + (lk - lq).view(B, 1, 1, 1).to(s.device) - j).abs().to(s.dtype)
            s = s - self.alibi.to(device=s.device, dtype=s.dtype).view(B, -1, 1, 1) * dist
        return s

    def capped_grad(self, ds: torch.Tensor, s_capped: torch.Tensor) -> torch.Tensor:
        """The gradient reaching the uncapped score from ``ds`` at the capped score: times 1 - tanh^2."""
        if self.softcap is None:
            return ds
        t = s_capped / self.softcap
        return ds * (1 - t * t)


def _tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but q is on {device}")
    return value
