"""GPU time without the host: a call captured in a CUDA graph and replayed, and the seeded decode inputs the
decode tools time it on. Used by ``tools/decode_profile.py``, ``tools/launch_cost.py``, the GPU tests and the
bench's ``graph_ms`` column (:func:`graph_times`)."""

from __future__ import annotations

import torch


def capture(call, *, warmup: int = 2, calls: int = 1):
    """``call`` warmed up ``warmup`` times on a side stream (allocations and compiles happen there), then
    ``calls`` of it captured in one CUDA graph: (the graph, the last call's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = call()
    return graph, out


def graph_us(fn, calls: int = 20, reps: int = 20) -> float:
    """GPU time per call with the host out of the way: ``calls`` calls captured in one CUDA graph, replayed
    ``reps`` times, the best replay."""
    g, _ = capture(fn, warmup=3, calls=calls)
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


def graph_times(call, sets: int, calls: int = 20, reps: int = 10) -> list[float]:
    """Milliseconds per call of ``reps`` replays of one CUDA graph that holds ``calls`` calls, ``call(i)``
    rotating over the ``sets`` input sets as the bench's event-timed calls do (the bench's ``graph_ms`` is
    their median). The graph is dropped before it returns."""
    g, _ = capture(lambda: [call(i % sets) for i in range(calls)][-1], warmup=2, calls=1)
    try:
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / calls)
    finally:
        del g
    return times


def decode_inputs(B: int, Hkv: int, Nk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded bf16 decode inputs: q [B, 32, 1, 128], k and v [B, Hkv, Nk, 128] (the decode suite's shapes)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v
