"""Notebook 06: the Triton guide's forward kernel read closely, its choices replayed in PyTorch on the CPU.

The guide starts the running denominator at ``l_i = 1.0``, pads the head dim to ``next_power_of_2(D)`` with
no mask on the padded columns, maps query heads to kv heads with ``//`` (and warns against ``%``), and gives MQA
head-less K/V. Each function replays one of these on small tensors, beside the contract (the float64
reference), so a notebook can show when the choice is harmless and when it is not.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

import attnlab


def guide_loop(s2: torch.Tensor, v: torch.Tensor, block: int, l_init: float) -> torch.Tensor:
    """The guide's online softmax over base-2 scores ``s2`` [rows, N] (the scaled scores times log2(e), -inf
    where masked) and values ``v`` [N, Dv], ``block`` keys at a time, with ``l_i`` starting at ``l_init``:
    ``m_ij = max(m_i, rowmax)``, ``p = exp2(s - m_ij)``, ``alpha = exp2(m_i - m_ij)``, ``l_i = l_i alpha + sum p``,
    ``acc = acc alpha + p v``; the output ``acc / l_i``. No guard for a row whose scores are all -inf so far."""
    rows = s2.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=s2.dtype)
    l_i = torch.full((rows,), l_init, dtype=s2.dtype)
    acc = torch.zeros(rows, v.shape[1], dtype=s2.dtype)
    for n0 in range(0, s2.shape[1], block):
        s = s2[:, n0:n0 + block]
        m_new = torch.maximum(m, s.max(dim=1).values)
        p = torch.exp2(s - m_new[:, None])
        alpha = torch.exp2(m - m_new)
        l_i = l_i * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v[n0:n0 + block]
        m = m_new
    return acc / l_i[:, None]


def l_init_table(block: int = 4, seed: int = 0) -> pd.DataFrame:
    """Three rows of 12 keys, read 4 at a time: keys allowed from the first tile on; the first tile masked and
    later keys allowed (as ragged lengths or a sliding window give); no key allowed. The guide's loop with
    ``l_i`` starting at 1.0 (its choice) and at 0.0, against the float64 softmax with the contract's empty-row
    rule (0). Max |error| per row, or NaN."""
    g = torch.Generator().manual_seed(seed)
    n, dv = 12, 4
    s = torch.randn(3, n, generator=g, dtype=torch.float64) * 2
    v = torch.randn(n, dv, generator=g, dtype=torch.float64)
    s[1, :block] = float("-inf")
    s[2, :] = float("-inf")
    want = torch.softmax(s, dim=1).nan_to_num(0.0) @ v  # all -inf: the contract's 0
    s2 = s * math.log2(math.e)
    rows = ["allowed keys in the first tile", "first tile masked, later keys allowed", "no allowed key"]
    out = {}
    for l_init in (1.0, 0.0):
        got = guide_loop(s2, v, block, l_init)
        out[f"l_i starts at {l_init:g}"] = [(got[i] - want[i]).abs().max().item() for i in range(3)]
    return pd.DataFrame(out, index=pd.Index(rows, name="row"))


def padded_head_dim_error(D: int, N: int = 8, seed: int = 0) -> float:
    """Max |error| of the guide's host code for head dim ``D`` when the kernel reads ``next_power_of_2(D)``
    columns of contiguous [N, D] rows with no mask on the extra ones: row n's extra columns are the first
    elements of row n + 1 (the last row's are zeros here; on a GPU, whatever follows the tensor). Scores and
    output are computed from those reads in float64, against the true attention (0 when D is a power of 2)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(N, D, generator=g, dtype=torch.float64) for _ in range(3))
    dp = 1 << (D - 1).bit_length()

    def read(t: torch.Tensor) -> torch.Tensor:  # dp consecutive elements from each row's start
        flat = torch.cat([t.reshape(-1), torch.zeros(dp, dtype=t.dtype)])
        return torch.stack([flat[i * D:i * D + dp] for i in range(N)])

    qr, kr, vr = read(q), read(k), read(v)
    got = (torch.softmax(qr @ kr.T / math.sqrt(D), dim=1) @ vr)[:, :D]
    want = torch.softmax(q @ k.T / math.sqrt(D), dim=1) @ v
    return (got - want).abs().max().item()


def head_maps(Hq: int, Hkv: int) -> pd.DataFrame:
    """The kv head each query head reads: ``h // (Hq // Hkv)`` (grouped, PyTorch's ``enable_gqa`` and the
    contract) and ``h % Hkv`` (interleaved, the guide's warning), and whether they agree."""
    group = Hq // Hkv
    rows = [{"query head": h, "h // group": h // group, "h % Hkv": h % Hkv} for h in range(Hq)]
    d = pd.DataFrame(rows).set_index("query head")
    d["same"] = d["h // group"] == d["h % Hkv"]
    return d


def interleaved_map_error(Hq: int = 4, Hkv: int = 2, seed: int = 0) -> tuple[float, float]:
    """(max |error| of attention with K/V repeated group-wise (``repeat_interleave``, the ``//`` map), max |error|
    with K/V tiled (``repeat``, the ``%`` map)), each against attnlab's GQA call on the same inputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, 6, 8, generator=g)
    k, v = torch.randn(1, Hkv, 6, 8, generator=g), torch.randn(1, Hkv, 6, 8, generator=g)
    want = attnlab.attention(q, k, v)
    group = Hq // Hkv
    grouped = attnlab.attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    tiled = attnlab.attention(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))
    return (grouped - want).abs().max().item(), (tiled - want).abs().max().item()


def headless_mqa(seed: int = 0) -> dict[str, object]:
    """MQA with head-less K/V [B, N, D] (the guide squeezes the head dim away): what attnlab says when given
    one, and that ``unsqueeze(1)`` (a view, no copy) gives the MQA call, against repeating K/V per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k3, v3 = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    try:
        attnlab.attention(q, k3, v3)
        refused = "accepted"
    except (TypeError, ValueError) as err:
        refused = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    k4, v4 = k3.unsqueeze(1), v3.unsqueeze(1)
    mqa = attnlab.attention(q, k4, v4)
    repeated = attnlab.attention(q, k4.expand(-1, 4, -1, -1), v4.expand(-1, 4, -1, -1))
    return {"head-less k": refused, "unsqueeze(1) is a view": k4.data_ptr() == k3.data_ptr(),
            "max |MQA - repeated|": (mqa - repeated).abs().max().item()}
