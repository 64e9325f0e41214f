"""How fast one GPU reads the decode suite's K/V bytes when reading is all a kernel does: a plain Triton read
(each of P programs sums a contiguous run of 256-byte rows, as a decode program streams its keys) at several
program counts, and torch's own sum, on buffers the size of the K/V caches of three decode configurations.
GPU us by CUDA-graph replay (no host in the way). The ceiling a decode kernel reading those bytes once can
approach, and whether 132 programs (every SM of an H200) read faster than 128 (what the split count gives
the suite's power-of-two shapes).

Usage: ``PYTHONPATH=.:scripts python3 scripts/read_ceiling.py``."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from decode_profile import graph_us

#: (name, bytes of K and V): bf16, D 128
SIZES = [("B1 Hkv8 Nk32k", 2 * 1 * 8 * 32768 * 128 * 2), ("B16 Hkv8 Nk4k", 2 * 16 * 8 * 4096 * 128 * 2),
         ("B8 Hkv32 Nk8k", 2 * 8 * 32 * 8192 * 128 * 2)]
PROGRAMS = [96, 112, 128, 132, 256, 264, 396, 528]
#: (rows per tile, warps, stages)
CONFIGS = [(128, 4, 3), (64, 4, 4)]


@triton.jit
def _read_kernel(X, Out, rows, BLOCK_R: tl.constexpr, D: tl.constexpr):
    """Program p sums rows [p * rows / P, (p + 1) * rows / P) of X ([rows, D]) into Out[p, :]."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    r_lo = (rows * p) // P
    r_hi = (rows * (p + 1)) // P
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for r in range(r_lo, r_hi, BLOCK_R):
        rr = r + offs_r
        x = tl.load(X + rr.to(tl.int64)[:, None] * D + offs_d[None, :], mask=(rr < r_hi)[:, None], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    tl.store(Out + p * D + offs_d, acc)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for name, nbytes in SIZES:
        x = torch.randn(nbytes // 256, 128, device="cuda", dtype=torch.bfloat16)
        want = x.float().sum().item()
        cells = [f"torch.sum {nbytes / graph_us(lambda x=x: x.sum(dtype=torch.float32)) / 1e6:.2f}"]
        for block_r, warps, stages in CONFIGS:
            for P in PROGRAMS:
                out = torch.empty(P, 128, device="cuda", dtype=torch.float32)

                def read(x=x, P=P, out=out, block_r=block_r, warps=warps, stages=stages):
                    _read_kernel[(P,)](x, out, x.shape[0], BLOCK_R=block_r, D=128, num_warps=warps,
                                       num_stages=stages)
                read()
                ok = abs(out.sum().item() - want) <= 1e-2 * x.numel() ** 0.5  # a missed tile is ~128x that
                us = graph_us(read)
                bad = "" if ok else " BAD"
                cells.append(f"{block_r}/{warps}/{stages} P{P} {us:.1f}us {nbytes / us / 1e6:.2f}{bad}")
        print(f"{name} ({nbytes / 2**20:.0f} MiB), TB/s: " + " | ".join(cells), flush=True)
        x = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
