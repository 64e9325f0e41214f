"""GPU time without the host: a call captured in a CUDA graph and replayed, and the seeded decode inputs the
decode tools time it on. Used by ``tools/decode_profile.py`` and ``tools/launch_cost.py``."""

from __future__ import annotations

import torch


def graph_us(fn, calls=20, reps=20):
    """GPU time per call with the host out of the way: ``calls`` calls captured in one CUDA graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    return best


def decode_inputs(B: int, Hkv: int, Nk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded bf16 decode inputs: q [B, 32, 1, 128], k and v [B, Hkv, Nk, 128] (the decode suite's shapes)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v
