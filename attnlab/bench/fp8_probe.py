"""The FP8 forward beside the bfloat16 one on a GPU with an 8-bit MMA (compute capability 8.9+), through
``attnlab.attention(..., backend="triton")`` as a user calls it, with sdpa-cudnn on the bfloat16 values, in
interleaved rounds: ``python -m attnlab.bench.fp8_probe OUT.json``.

Per case, one draw: FP8 q, k, v (N(0, 1) rounded to e4m3) with descales in [0.5, 1.5) (q's and v's per head,
k's per tensor); the bfloat16 calls take the real values (stored value times descale) rounded to bfloat16. FP8 is
timed with V as stored ([B, H, N, D]) and keys-contiguous (its transposed copy, as Hopper's 8-bit MMA reads it).
Every output is checked against the float64 reference of the same real values (the first two batch entries;
FP8 with its tolerance and the textbook FP8 emulation as baseline) before anything is timed; a failed output is
reported and not timed. Times: CUDA-event median over rounds of 20 back-to-back calls (``ms``), TFLOP/s of the
useful products (4 N^2 D per head, halved under causal), and each call's max error against float64 beside them.
"""

from __future__ import annotations

import sys

import torch

from attnlab.bench.timing import interleaved_ms

CASES = [  # (B, H, N, D, causal)
    (4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (8, 16, 2048, 64, True), (1, 16, 16384, 128, True),
]
F8 = torch.float8_e4m3fn


def _case(B: int, H: int, N: int, D: int, causal: bool, rounds: int) -> dict:
    import attnlab
    from attnlab.cases import Case, make_inputs
    from attnlab.check import compare

    q, k, v, kw = make_inputs(Case("fp8", B=B, Hq=H, Nq=N, D=D, causal=causal), dtype=F8, device="cuda", seed=0)
    descales = {n: kw.pop(n) for n in ("q_descale", "k_descale", "v_descale")}
    real = [(t.float() * d.view(*d.shape, 1, 1) if d.dim() == 2 else t.float() * d).bfloat16()
            for t, d in zip((q, k, v), descales.values())]
    v_keys = v.transpose(-1, -2).contiguous().transpose(-1, -2)

    def fp8(v_in):
        return lambda: attnlab.attention(q, k, v_in, backend="triton", **descales, **kw)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*real, is_causal=causal)

    calls = {"fp8": fp8(v), "fp8-v-keys": fp8(v_keys), "bf16": lambda: attnlab.attention(*real, backend="triton",
                                                                                          **kw),
             "sdpa-cudnn-bf16": cudnn}
    two = {n: d[:2] if d.dim() == 2 else d for n, d in descales.items()}
    ref = attnlab.reference(q[:2], k[:2], v[:2], **two, **kw)[0]
    emul = attnlab.attention(q[:2], k[:2], v[:2], backend="torch", **two, **kw)
    row: dict = {"case": f"b{B} h{H} n{N} d{D} {'causal' if causal else 'full'}", "max_abs": {}, "passed": {},
                 "ms": {}, "tflops": {}}
    for name, fn in calls.items():
        out = fn()[:2]
        rep = compare(out, ref, dtype=F8, base=emul) if name.startswith("fp8") else compare(out, ref)
        row["max_abs"][name], row["passed"][name] = rep.max_abs, bool(rep.passed)
    del ref, emul
    row["ms"] = interleaved_ms([n for n in calls if row["passed"][n]], calls.__getitem__, rounds)
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    for name, ms in row["ms"].items():
        row["tflops"][name] = flops / ms / 1e9
    return row


def run(out: str, rounds: int = 7) -> dict:
    from attnlab.backends.triton import hopper_forward as hopper
    from attnlab.bench.experiment import run_environment, write

    hopper.set_mode("sync")  # (the bfloat16 call's kernel on sm_90 is the Hopper path from its first call)
    rows = []
    for case in CASES:
        rows.append(_case(*case, rounds))
        print(rows[-1], flush=True)
    return write({"environment": run_environment("cuda"), "rows": rows}, out)


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.experiment import main as experiment_main

    def needs() -> str | None:
        ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
        return None if ok else "needs a GPU of compute capability 8.9 or newer (an 8-bit MMA)"

    return experiment_main("attnlab.bench.fp8_probe", __doc__, run, argv, needs)


if __name__ == "__main__":
    sys.exit(main())
