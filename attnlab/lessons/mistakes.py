"""Deliberate kernel mistakes, emulated in PyTorch, so notebooks can show the checker catching them.

The one here is the most common launch bug of attention kernels: a 1-D grid of ``B * Hq`` programs,
one per (batch, head), where the kernel decomposes its program id in the wrong order. Each program loads
the q/k/v (and the kv_len) of the (b, h) it *computes*, but stores to the slot its program id names,
``pid = b * Hq + h``. With B = 1 or Hq = 1 both orders agree, which is why small tests miss it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from attnlab.api import attention


def program_to_head(pid: int, B: int, H: int, *, swapped: bool = False) -> tuple[int, int]:
    """The (b, h) program ``pid`` of a ``B * H`` grid works on: ``divmod(pid, H)``, or, with the mistake,
    ``(pid % B, pid // B)`` (the decomposition of a grid laid out as [H, B])."""
    return (pid % B, pid // B) if swapped else divmod(pid, H)


def launch_table(B: int, H: int) -> pd.DataFrame:
    """One row per program: the head it stores to, and the head it reads with and without the mistake."""
    rows = []
    for pid in range(B * H):
        rows.append({"pid": pid, "stores (b, h)": divmod(pid, H),
                     "reads, correct": program_to_head(pid, B, H),
                     "reads, swapped": program_to_head(pid, B, H, swapped=True)})
    return pd.DataFrame(rows)


def grid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, swapped: bool = False,
                   **kw: Any) -> torch.Tensor:
    """Attention as a ``B * Hq`` grid of per-head programs would compute it, optionally with the b/h mix-up.

    Each program's result is what a correct kernel computes for the (b, h) it reads (including that
    batch's lengths); it lands in the output slot of its program id. q, k, v in layout "bhnd".
    """
    full = attention(q, k, v, backend="torch", **kw)
    B, H = q.shape[0], q.shape[1]
    out = torch.empty_like(full)
    for pid in range(B * H):
        b, h = program_to_head(pid, B, H, swapped=swapped)
        sb, sh = divmod(pid, H)
        out[sb, sh] = full[b, h]
    return out


# ---- more mistakes the two documents warn about -------------------------------------------------------
def gqa_kv_head(h: int, Hq: int, Hkv: int, *, interleaved: bool = False) -> int:
    """The kv head query head ``h`` reads: ``h // (Hq // Hkv)`` (grouped, the contract and PyTorch's
    ``enable_gqa``), or with the mistake ``h % Hkv`` (interleaved)."""
    return h % Hkv if interleaved else h // (Hq // Hkv)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, interleaved: bool = False,
                  **kw: Any) -> torch.Tensor:
    """GQA computed by giving every query head its own copy of the kv head it maps to (``gqa_kv_head``),
    then ordinary attention; ``interleaved=True`` is the ``h % Hkv`` mistake. Layout "bhnd"."""
    Hq, Hkv = q.shape[1], k.shape[1]
    idx = torch.tensor([gqa_kv_head(h, Hq, Hkv, interleaved=interleaved) for h in range(Hq)])
    return attention(q, k[:, idx], v[:, idx], backend="torch", **kw)


def reversed_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with the condition written backwards: key j allowed when ``j > i`` (the future)
    instead of ``j <= i``. The last query row then has no allowed key (an empty row: zeros)."""
    nq, nk = q.shape[-2], k.shape[-2]
    allowed = torch.arange(nk).view(1, -1) > torch.arange(nq).view(-1, 1)
    return attention(q, k, v, mask=allowed, backend="torch")


def mha_double_scaling(E: int = 64, heads: int = 4, N: int = 16, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """``nn.MultiheadAttention`` against the same computation rebuilt from its weights with attnlab, once
    right (attnlab scales by 1/sqrt(D) itself) and once with q pre-scaled by hand, so the scale is applied
    twice. Returns the three outputs, float32, ``[1, N, E]``."""
    g = torch.Generator().manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, heads, batch_first=True)
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        x = torch.randn(1, N, E, generator=g)
        want, _ = mha(x, x, x, need_weights=False)
        qkv = torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias)
        q, k, v = (t.view(1, N, heads, E // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        D = E // heads

        def finish(o: torch.Tensor) -> torch.Tensor:
            return mha.out_proj(o.transpose(1, 2).reshape(1, N, E))

        right = finish(attention(q, k, v, backend="torch"))
        twice = finish(attention(q / D**0.5, k, v, backend="torch"))  # the default scale applies again
    return {"nn.MultiheadAttention": want, "attnlab": right, "attnlab, q pre-scaled": twice}
