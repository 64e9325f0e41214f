"""How fast one GPU reads the decode suite's K/V bytes when reading is all a kernel does: torch's own sum,
and a plain Triton stream (each of P programs sums one contiguous run of BLOCK-element chunks into a float32
vector, as a decode program streams its keys; several loads in flight) at several program counts and
configs, on buffers the size of the K/V caches of three decode configurations. GPU us by CUDA-graph replay
(no host in the way): what a decode kernel that reads those bytes once can be held against (a plain stream,
not a proven limit: attnlab's decode and cuDNN's beat it on the larger caches).

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
PROGRAMS = [128, 132, 264, 528, 1056]
#: (elements a chunk, warps, stages)
CONFIGS = [(8192, 8, 3), (4096, 4, 4), (16384, 8, 3)]


@triton.jit
def _read_kernel(X, Out, chunks, BLOCK: tl.constexpr):
    """Program p sums chunks [p * chunks / P, (p + 1) * chunks / P) of X (BLOCK bf16 elements each) into
    Out[p, :] (float32, BLOCK)."""
    p = tl.program_id(0).to(tl.int64)
    P = tl.num_programs(0)
    c_lo = (chunks * p) // P
    c_hi = (chunks * (p + 1)) // P
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(c_lo, c_hi):
        acc += tl.load(X + c * BLOCK + offs).to(tl.float32)
    tl.store(Out + p * BLOCK + offs, acc)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for name, nbytes in SIZES:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        want = x.double().sum().item()
        cells = [f"torch.sum {nbytes / graph_us(lambda x=x: x.sum(dtype=torch.float32)) / 1e6:.2f}"]
        for block, warps, stages in CONFIGS:
            for P in PROGRAMS:
                out = torch.empty(P, block, device="cuda", dtype=torch.float32)

                def read(x=x, P=P, out=out, block=block, warps=warps, stages=stages):
                    _read_kernel[(P,)](x, out, x.numel() // block, BLOCK=block, num_warps=warps,
                                       num_stages=stages)
                read()
                ok = abs(out.double().sum().item() - want) <= 0.5  # a chunk missed or read twice: ~sqrt(BLOCK)
                us = graph_us(read)
                bad = "" if ok else " BAD"
                cells.append(f"{block}/{warps}/{stages} P{P} {us:.1f}us {nbytes / us / 1e6:.2f}{bad}")
        print(f"{name} ({nbytes / 2**20:.0f} MiB), TB/s: " + " | ".join(cells), flush=True)
        x = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
