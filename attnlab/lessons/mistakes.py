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
