"""Host time per call and GPU time of small problems through attnlab.attention vs SDPA, side by side.

Host time: the wall time of N back-to-back calls without synchronizing, divided by N, while the GPU is kept
busy (so the CPU side is what is measured). Prints one line per (case, competitor).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import attnlab


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def gpu_us(fn, n=100):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def competitors(q, k, v, causal):
    return {
        "sdpa (raw F.sdpa)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "attnlab triton": lambda: attnlab.attention(q, k, v, causal=causal, backend="triton"),
        "attnlab auto": lambda: attnlab.attention(q, k, v, causal=causal),
        "attnlab sdpa": lambda: attnlab.attention(q, k, v, causal=causal, backend="sdpa"),
    }


def main() -> int:
    torch.manual_seed(0)
    for B, H, N, D, causal in [(1, 8, 128, 64, True), (4, 16, 512, 64, False), (2, 32, 256, 128, True)]:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, fn in competitors(q, k, v, causal).items():
            print(f"B{B} H{H} N{N} D{D} causal={causal} {name:20s} host {host_us(fn):7.1f} us  "
                  f"gpu {gpu_us(fn):7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
