"""Backward alone through the public call: the Hopper backward (ATTNLAB_HOPPER=sync) beside the portable one (mode
0 at the backward) and sdpa-cudnn, after checking the Hopper gradients against the portable ones on the same
input. Usage on the GPU: PYTHONPATH=. python3 .wip/hopper-bwd/bwd_ab.py OUT.json"""

import json
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms

CASES = [(4, 16, 16, 4096, True), (4, 16, 16, 4096, False), (2, 32, 8, 4096, True), (1, 16, 16, 16384, True)]


def case(B: int, Hq: int, Hkv: int, N: int, causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")

    def grads(mode: str):
        def call():
            hopper.set_mode(mode)
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call

    before = hb.launches
    mine = grads("sync")()
    taken = hb.launches == before + 1
    ref = grads("0")()
    err = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(mine, ref)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    calls = {"hopper-bwd": grads("sync"), "portable-bwd": grads("0"),
             "sdpa-cudnn-bwd": lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)}
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d128 {'causal' if causal else 'full'}", "hopper_taken": taken,
           "err_vs_portable": err, "passed": taken and max(err) < 2e-2}
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        cudnn = row["ms"]["sdpa-cudnn-bwd"]
        row["cudnn_ms_over"] = {name: cudnn / ms for name, ms in row["ms"].items()}
    return row


def main(path: str) -> None:
    rows = []
    for c in CASES:
        rows.append(case(*c))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
