"""Which backward a sliding window should run on an sm_90 GPU: the Hopper backward (``ATTNLAB_HOPPER=sync``)
against the portable passes (``ATTNLAB_HOPPER=0``), over window widths, on ``attnlab.attention(...,
backend="triton")``'s output as a user calls it, beside compiled Flex with the same block mask.

Each case's gradients under both modes are checked first, on batch entry 0 and kv head 0 with its group of query
heads, against float64 gradients (FlashAttention's rule: at most twice the bf16 textbook's error plus a floor);
then, interleaved over rounds, CUDA-event times per call (``ms``): ``bwd`` is the backward alone
(``torch.autograd.grad`` with the graph retained), ``fwd+bwd`` a forward and its backward (Flex's only mode: compiled
Flex refuses a retained graph). ``python -m attnlab.bench.hopper_bwd_window_route OUT.json``.
"""

from __future__ import annotations

import sys

import torch

from attnlab.bench.timing import interleaved_ms

MODES = ("sync", "0")  #: the Hopper backward, the portable passes
CASES = [  # (B, Hq, Hkv, N, D, window width W: keys j in [i - W + 1, i], sinks); the widest question first
    (2, 64, 8, 4096, 64, 128, True),  # gpt-oss's sliding layer
    (2, 64, 8, 4096, 64, 128, False), (2, 64, 8, 4096, 64, 1024, False),
    (2, 64, 8, 4096, 128, 128, False), (2, 64, 8, 4096, 128, 1024, False),
    *((2, 64, 8, 4096, 64, w, False) for w in (256, 512, 2048)),
    (1, 16, 16, 16384, 128, 128, False), (1, 16, 16, 16384, 128, 2048, False),
]


def _check(q, k, v, dout, kw: dict, grads: tuple[torch.Tensor, ...], group: int) -> bool:
    """Whether dq, dk, dv of batch entry 0, kv head 0 (and its query heads) pass against float64 gradients."""
    from attnlab.check import compare
    from attnlab.problem import make_problem
    from attnlab.textbook_backward import textbook_backward

    sl = (q[:1, :group], k[:1, :1], v[:1, :1])
    sinks = kw.get("sinks")
    skw = dict(kw, sinks=None if sinks is None else sinks[:group])
    prob = make_problem(*sl, **skw)
    g64 = textbook_backward(prob, dout[:1, :group], None, dtype=torch.float64)[:3]
    base = textbook_backward(prob, dout[:1, :group], None, dtype=q.dtype)[:3]
    got = (grads[0][:1, :group], grads[1][:1, :1], grads[2][:1, :1])
    return all(bool(compare(g, r, dtype=q.dtype, base=b).baseline_passed) for g, r, b in zip(got, g64, base))


def window_inputs(B: int, Hq: int, Hkv: int, N: int, D: int, width: int, with_sinks: bool) -> tuple:
    """(q, k, v, dout, keywords) of one case on the GPU, bf16, seeded: q, k and v require grad; the keywords hold
    the window of ``width`` keys ending at each row's own, and sinks when asked (the probes of this backward's
    route share them)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = dict(window=(width - 1, 0))
    if with_sinks:
        kw["sinks"] = torch.randn(Hq, device="cuda", generator=g)
    return q, k, v, dout, kw


def _case(B: int, Hq: int, Hkv: int, N: int, D: int, width: int, with_sinks: bool, rounds: int) -> dict:
    """One case's check and interleaved timing."""
    import attnlab
    from attnlab import fast_calls
    from attnlab.backends.triton import hopper_backward
    from attnlab.backends.triton import hopper_forward as hopper

    q, k, v, dout, kw = window_inputs(B, Hq, Hkv, N, D, width, with_sinks)

    def ours(mode: str):
        """The public call under ``mode`` (set now; the fast calls made before dropped)."""
        hopper.set_mode(mode)
        fast_calls.clear()
        return lambda: attnlab.attention(q, k, v, backend="triton", **kw)

    held, ran, passed = {}, {}, {}
    for mode in MODES:
        held[mode] = ours(mode)()
        before = hopper_backward.launches
        grads = torch.autograd.grad(held[mode], (q, k, v), dout, retain_graph=True)
        ran[mode] = hopper_backward.launches > before
        passed[mode] = _check(q.detach(), k.detach(), v.detach(), dout, kw, grads, Hq // Hkv)
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} window{width}" + (" sinks" if with_sinks else ""),
           "ran_hopper_backward": ran, "passed": passed, "ms": {}}
    if all(passed.values()) and ran["sync"] and not ran["0"]:  # each mode ran the kernel it names
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def band(b, h, i, j):
            return (j <= i) & (j > i - width)

        block = create_block_mask(band, None, None, N, N, device="cuda")
        flex = torch.compile(flex_attention)

        def call_of(label: str):
            what, _, mode = label.partition(" hopper=")
            if what == "flex fwd+bwd":
                return lambda: torch.autograd.grad(flex(q, k, v, block_mask=block, enable_gqa=Hq != Hkv), (q, k, v),
                                                   dout)
            fwd = ours(mode)
            if what == "bwd":
                return lambda: torch.autograd.grad(held[mode], (q, k, v), dout, retain_graph=True)
            return lambda: torch.autograd.grad(fwd(), (q, k, v), dout)

        labels = [f"{w} hopper={m}" for w in ("bwd", "fwd+bwd") for m in MODES]
        if not with_sinks:  # (Flex's block mask has no sink)
            labels.append("flex fwd+bwd")
        row["ms"] = interleaved_ms(labels, call_of, rounds)
        row["portable_bwd_over_hopper"] = row["ms"]["bwd hopper=0"] / row["ms"]["bwd hopper=sync"]
    return row


def run(out: str, rounds: int = 5) -> dict:
    """Every case, with the Hopper backward's width rule lifted (``PORTABLE_WINDOWS_BELOW``: the question this
    probe answers), restored after."""
    from attnlab.backends.triton import hopper_backward
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.bench.experiment import run_rows

    before, widths = hopper.mode(), hopper_backward.PORTABLE_WINDOWS_BELOW
    hopper_backward.PORTABLE_WINDOWS_BELOW = {}
    hopper_backward.forget_plans()
    try:
        return run_rows(CASES, lambda *case: _case(*case, rounds), out)
    finally:
        hopper.set_mode(before)
        hopper_backward.PORTABLE_WINDOWS_BELOW = widths
        hopper_backward.forget_plans()


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main
    from attnlab.bench.experiment import needs_sm90

    return experiment_main("attnlab.bench.hopper_bwd_window_route", __doc__, run, argv, needs_sm90)


if __name__ == "__main__":
    sys.exit(main())
