"""A/B of the backward's grid order (``bwd_grid.TILES_OUTER``): a head's tiles side by side (``none``), or one tile
of every head before the next tile of any, in the dK/dV grid alone (``dkdv``), in both (``all``) or where the rule
says (``auto``), through the public call as a user calls it, beside sdpa-cudnn's backward, in
interleaved rounds.

The backward alone: each competitor's forward runs once with inputs that require grad, and the timed call is
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``. The two orders' gradients must be equal bit for
bit (each program computes the same tile either way; the backward suite checks them against float64) before
anything is timed. Times: CUDA-event median over rounds of 10 back-to-back calls each (``ms``):
``python -m attnlab.bench.bwd_grid_order OUT.json``.
"""

from __future__ import annotations

import heapq
import sys

import torch

from attnlab.bench.timing import interleaved_ms

#: the modes of bwd_grid.TILES_OUTER compared
SETTINGS = ("none", "dkdv", "all", "auto")
CASES = [  # (B, Hq, Hkv, N, D, causal)
    (2, 32, 8, 4096, 128, True), (1, 16, 16, 4096, 128, True), (4, 16, 16, 4096, 128, True),
    (1, 32, 8, 16384, 128, True), (2, 32, 8, 4096, 128, False), (2, 16, 16, 2048, 128, True),
]


def finish_times(heads: int, tiles: int, group: int, tiles_outer: bool, sms: int = 132) -> list[float]:
    """The decisions log's model of a causal dK/dV pass: one program per (head, key tile), its work the group's
    query heads times the row tiles it sees (``tiles - j`` for key tile ``j``), started in grid order on the first
    of ``sms`` SMs to free up (one program per SM). Returns when each SM runs out of work, in work units, sorted."""
    order = ([(h, j) for j in range(tiles) for h in range(heads)] if tiles_outer
             else [(h, j) for h in range(heads) for j in range(tiles)])
    free = [0.0] * sms
    heapq.heapify(free)
    for _, j in order:
        heapq.heappush(free, heapq.heappop(free) + group * (tiles - j))
    return sorted(free)


def ideal_time(heads: int, tiles: int, group: int, sms: int = 132) -> float:
    """The modeled pass's work spread evenly over ``sms`` SMs (:func:`finish_times`' units)."""
    return heads * group * tiles * (tiles + 1) / 2 / sms


def modeled_time(heads: int, tiles: int, group: int, tiles_outer: bool, sms: int = 132) -> float:
    """The modeled pass's time (its last SM's finish, :func:`finish_times`) over its ideal (:func:`ideal_time`)."""
    return finish_times(heads, tiles, group, tiles_outer, sms)[-1] / ideal_time(heads, tiles, group, sms)


def _case(B: int, Hq: int, Hkv: int, N: int, D: int, causal: bool, rounds: int) -> dict:
    import attnlab
    from attnlab.backends.triton import bwd_grid

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")

    def ours(mode: str):
        """The backward with TILES_OUTER switched now."""
        bwd_grid.TILES_OUTER = mode
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def cudnn_backward():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                 enable_gqa=Hq != Hkv)
        return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

    grads = {mode: ours(mode)() for mode in SETTINGS}
    first = next(iter(grads.values()))
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}",
           "equal": all(bool(torch.equal(a, b)) for got in grads.values() for a, b in zip(got, first, strict=True)),
           "ms": {}}
    del grads, first
    if row["equal"]:
        cudnn = cudnn_backward()
        row["ms"] = interleaved_ms(  # (ours switches the mode as its turn comes)
            [*SETTINGS, "sdpa-cudnn"], lambda label: cudnn if label == "sdpa-cudnn" else ours(label), rounds,
            warmup=2, calls=10)
        row["over_cudnn"] = {key: row["ms"]["sdpa-cudnn"] / t for key, t in row["ms"].items()}
        row["over_none"] = {mode: row["ms"]["none"] / row["ms"][mode] for mode in SETTINGS}
    return row


def run(out: str, rounds: int = 7) -> dict:
    from attnlab.backends.triton import bwd_grid
    from attnlab.bench.experiment import run_rows

    before = bwd_grid.TILES_OUTER
    try:
        return run_rows(CASES, lambda *case: _case(*case, rounds), out)
    finally:
        bwd_grid.TILES_OUTER = before


def _needs_gpu() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main

    return experiment_main("attnlab.bench.bwd_grid_order", __doc__, run, argv, _needs_gpu)


if __name__ == "__main__":
    sys.exit(main())
