"""A/B of the Hopper forward's schedules on an sm_90 GPU: persistent programs (``hopper_forward.PERSISTENT``) and
the consumers' ping-pong (``hopper_forward.PINGPONG``), each on and off, through
``attnlab.attention(..., backend="triton")`` as a user calls it, beside sdpa-cudnn, in interleaved rounds.

Each case's output under every setting is checked against the float64 reference (first two batch entries)
before anything is timed; all outputs must also be equal bit for bit (the same sums in the same order). Times:
CUDA-event median over rounds of 20 back-to-back calls each (``ms``), per setting:
``python -m attnlab.bench.hopper_persistent_ab OUT.json``.
"""

from __future__ import annotations

import sys

import torch

from attnlab.bench.timing import interleaved_ms

#: (PERSISTENT, PINGPONG) by label; under a band (causal) PERSISTENT changes nothing.
SETTINGS = {"grid": (False, False), "grid+pingpong": (False, True), "persistent": (True, False),
            "persistent+pingpong": (True, True)}
CASES = [  # (B, H, N, D, causal, dtype)
    (8, 16, 1024, 128, False, torch.bfloat16), (8, 16, 1024, 128, True, torch.bfloat16),
    (4, 16, 4096, 128, False, torch.bfloat16), (4, 16, 4096, 128, True, torch.bfloat16),
    (1, 16, 16384, 128, False, torch.bfloat16),
    (8, 16, 1024, 64, False, torch.bfloat16), (4, 16, 4096, 64, False, torch.bfloat16),
    (1, 16, 16384, 64, False, torch.bfloat16), (8, 16, 1024, 128, False, torch.float16),
]


def _case(B: int, H: int, N: int, D: int, causal: bool, dtype: torch.dtype, rounds: int) -> dict:
    import attnlab
    from attnlab import fast_calls
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.check import compare

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))

    def ours(setting: tuple[bool, bool]):
        """The public call, with (PERSISTENT, PINGPONG) switched now (and the fast calls made before dropped)."""
        hopper.PERSISTENT, hopper.PINGPONG = setting
        fast_calls.clear()
        return lambda: attnlab.attention(q, k, v, causal=causal, backend="triton")

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    ref = attnlab.reference(q[:2], k[:2], v[:2], causal=causal)[0]
    outs = {label: ours(setting)() for label, setting in SETTINGS.items()}
    first = next(iter(outs.values()))
    row = {"case": f"{str(dtype)[6:]} b{B} h{H} n{N} d{D} {'causal' if causal else 'full'}",
           "equal": all(bool(torch.equal(o, first)) for o in outs.values()),
           "passed": {label: bool(compare(o[:2], ref).passed) for label, o in outs.items()}, "ms": {}}
    del ref, outs, first
    if row["equal"] and all(row["passed"].values()):
        row["ms"] = interleaved_ms(  # (ours switches the setting as its turn comes)
            [*SETTINGS, "sdpa-cudnn"], lambda label: cudnn if label == "sdpa-cudnn" else ours(SETTINGS[label]),
            rounds)
        row["over_cudnn"] = {key: row["ms"]["sdpa-cudnn"] / t for key, t in row["ms"].items()}
    return row


def run(out: str, rounds: int = 7) -> dict:
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.bench.experiment import run_rows

    before = hopper.PERSISTENT, hopper.PINGPONG
    hopper.set_mode("sync")
    try:
        return run_rows(CASES, lambda *case: _case(*case, rounds), out)
    finally:
        hopper.PERSISTENT, hopper.PINGPONG = before


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main
    from attnlab.bench.experiment import needs_sm90

    return experiment_main("attnlab.bench.hopper_persistent_ab", __doc__, run, argv, needs_sm90)


if __name__ == "__main__":
    sys.exit(main())
