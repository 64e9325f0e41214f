"""A/B of how the backward sums dQ, through the public call as a user calls it, beside sdpa-cudnn's backward, in
interleaved rounds: its own pass (``pass``, the default), or inside the dK/dV pass by elementwise atomic adds
(``atomic``) or by the copy engine's bulk reductions of whole tiles (``tma``, sm_90 and later;
:mod:`attnlab.backends.triton.dq_sum`).

The backward alone: each competitor's forward runs once with inputs that require grad, and the timed call is
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``. Before anything is timed, each mode's gradients
are compared with float64 autograd on a slice (batch entry 0, kv head 0 and its query heads), and with the ``pass``
mode's on the whole problem (the sums' order differs: not bit for bit). Times: CUDA-event median over rounds
of 10 back-to-back calls each (``ms``): ``python -m attnlab.bench.bwd_dq_sum OUT.json``.
"""

from __future__ import annotations

import sys

import torch

from attnlab.bench.timing import interleaved_ms

#: the modes compared: (backward.DQ_MODE, dq_sum.TMA)
SETTINGS = {"pass": ("pass", True), "atomic": ("atomic", False), "tma": ("atomic", True)}
CASES = [  # (B, Hq, Hkv, N, D, causal)
    (4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True),
    (1, 16, 16, 16384, 128, True), (4, 16, 16, 4096, 64, True), (8, 16, 16, 1024, 128, True),
]


def _switch(mode: str) -> None:
    from attnlab.backends.triton import backward, dq_sum

    backward.DQ_MODE, dq_sum.TMA = SETTINGS[mode]


def _float64_error(q, k, v, dout, causal: bool, grads) -> float:
    """The largest of max|g - g64| / max(1, max|g64|) over dq, dk, dv, on batch entry 0 and kv head 0 with its
    query heads (a slice small enough for float64 autograd on the GPU)."""
    from attnlab.reference import reference

    group = q.shape[1] // k.shape[1]
    heads = (group, 1, 1)
    sl = [t[:1, :n].detach().double().requires_grad_() for t, n in zip((q, k, v), heads, strict=True)]
    ref = torch.autograd.grad(reference(*sl, causal=causal)[0], sl, dout[:1, :group].double())
    worst = 0.0
    for g, r, n in zip(grads, ref, heads, strict=True):
        worst = max(worst, ((g[:1, :n].double() - r).abs().max() / max(1.0, r.abs().max().item())).item())
    return worst


def _case(B: int, Hq: int, Hkv: int, N: int, D: int, causal: bool, rounds: int) -> dict:
    import attnlab

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")

    def ours(mode: str):
        """The backward in ``mode``, switched now."""
        _switch(mode)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def cudnn_backward():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                 enable_gqa=Hq != Hkv)
        return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}", "ms": {},
           "float64_error": {}, "over_pass_error": {}}
    first = ours("pass")()
    for mode in SETTINGS:
        grads = ours(mode)()
        row["float64_error"][mode] = _float64_error(q, k, v, dout, causal, grads)
        row["over_pass_error"][mode] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                           for a, b in zip(grads, first, strict=True))
        del grads
    del first
    # bf16 gradients: the textbook's error is a few 1e-3 of the largest entry; a wrong sum is far off
    row["passed"] = all(e < 2e-2 for e in row["float64_error"].values())
    if row["passed"]:
        cudnn = cudnn_backward()
        row["ms"] = interleaved_ms([*SETTINGS, "sdpa-cudnn"], lambda label: cudnn if label == "sdpa-cudnn"
                                   else ours(label), rounds, warmup=2, calls=10)
        row["over_cudnn"] = {key: row["ms"]["sdpa-cudnn"] / t for key, t in row["ms"].items()}
        row["over_pass"] = {mode: row["ms"]["pass"] / row["ms"][mode] for mode in SETTINGS}
    return row


def run(out: str, rounds: int = 7) -> dict:
    from attnlab.backends.triton import backward, dq_sum
    from attnlab.bench.experiment import run_rows

    before = backward.DQ_MODE, dq_sum.TMA
    try:
        return run_rows(CASES, lambda *case: _case(*case, rounds), out)
    finally:
        backward.DQ_MODE, dq_sum.TMA = before


def _needs_gpu() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main

    return experiment_main("attnlab.bench.bwd_dq_sum", __doc__, run, argv, _needs_gpu)


if __name__ == "__main__":
    sys.exit(main())
