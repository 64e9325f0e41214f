"""Which forward kernel a sliding window should run on an sm_90 GPU: the Hopper kernel
(``ATTNLAB_HOPPER=sync``) against the portable one (``ATTNLAB_HOPPER=0``), over window widths, through
``attnlab.attention(..., backend="triton")`` as a user calls it, beside compiled Flex with the same block mask.

Each case's output under both modes is checked against the float64 reference before anything is timed. Times:
CUDA-event median over interleaved rounds of 20 back-to-back calls (``ms``), per mode:
``python -m attnlab.bench.hopper_window_route OUT.json``.
"""

from __future__ import annotations

import sys

import torch

from attnlab.bench.timing import interleaved_ms

MODES = ("sync", "0")  #: the Hopper kernel, the portable kernel
CASES = [  # (B, Hq, Hkv, N, D, window width W: keys j in [i - W + 1, i]; W = N is causal)
    *((2, 64, 8, 4096, 64, w) for w in (128, 256, 512, 1024, 2048)),  # gpt-oss's layer and wider
    *((1, 16, 16, 16384, 128, w) for w in (128, 512, 2048)),
    (2, 64, 64, 4096, 64, 128), (2, 64, 64, 4096, 64, 1024), (2, 64, 8, 4096, 128, 128), (2, 64, 8, 4096, 128, 1024),
    (1, 16, 16, 16384, 64, 128), (1, 16, 16, 16384, 64, 2048),
    (4, 16, 16, 4096, 64, 4096), (8, 16, 16, 1024, 64, 1024), (1, 16, 16, 16384, 64, 16384),
    (4, 16, 16, 4096, 128, 4096),
]


def _case(B: int, Hq: int, Hkv: int, N: int, D: int, width: int, rounds: int) -> dict:
    """One case's check and interleaved timing; both modes run whatever the routing rule would pick."""
    import attnlab
    from attnlab import fast_calls
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.check import compare

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    window = (width - 1, 0)

    def ours(mode: str):
        """The public call under ``mode`` (set now; the fast calls made before dropped)."""
        hopper.set_mode(mode)
        fast_calls.clear()
        return lambda: attnlab.attention(q, k, v, window=window, backend="triton")

    ref = attnlab.reference(q[:1], k[:1], v[:1], window=window)[0]
    outs, ran = {}, {}
    for mode in MODES:
        before = hopper.launches
        outs[mode] = ours(mode)()
        ran[mode] = hopper.launches > before
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} window{width}", "ran_hopper_kernel": ran,
           "passed": {mode: bool(compare(o[:1], ref).passed) for mode, o in outs.items()}, "ms": {}}
    del ref, outs
    if all(row["passed"].values()) and ran["sync"] and not ran["0"]:  # each mode ran the kernel it names
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def band(b, h, i, j):
            return (j <= i) & (j > i - width)

        block = create_block_mask(band, None, None, N, N, device="cuda")
        flex = torch.compile(flex_attention)
        calls = {f"hopper={m}": ours(m) for m in MODES}
        calls["flex"] = lambda: flex(q, k, v, block_mask=block, enable_gqa=Hq != Hkv)
        row["ms"] = interleaved_ms(  # (ours switches the mode as its turn comes)
            list(calls), lambda label: ours(label.removeprefix("hopper=")) if label.startswith("hopper=")
            else calls[label], rounds)
        row["portable_over_hopper"] = row["ms"]["hopper=sync"] / row["ms"]["hopper=0"]
    return row


def run(out: str, rounds: int = 5) -> dict:
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.bench.experiment import run_rows

    before, narrow = hopper.mode(), hopper.NARROW_TO_PORTABLE
    hopper.NARROW_TO_PORTABLE = False  # "sync" must mean the Hopper kernel, narrow band or not
    try:
        return run_rows(CASES, lambda *case: _case(*case, rounds), out)
    finally:
        hopper.set_mode(before)
        hopper.NARROW_TO_PORTABLE = narrow


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main
    from attnlab.bench.experiment import needs_sm90

    return experiment_main("attnlab.bench.hopper_window_route", __doc__, run, argv, needs_sm90)


if __name__ == "__main__":
    sys.exit(main())
