"""The Hopper backward's group split (hopper_backward.split), the backward alone through the public call: each
case's gradients by the product's rule checked against the portable backward's, every forced split against the
whole group's (dK and dV within 1e-2 of the largest entry: float32 sums in another order), then the product, each
split forced, the portable backward and sdpa-cudnn interleaved over 5 rounds of 10 calls.
Usage on an sm_90 GPU: PYTHONPATH=. python3 .wip/hopper-bwd-0712b/split_ab.py OUT.json
"""

import json
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms
from attnlab.problem import make_problem

#: (B, Hq, Hkv, N, D, causal): the short grids of long groups the order check found slow, the backward suite's GQA
#: row, a group of 8 at 3.9 waves whole, full rows of a short grid, and D 64
CASES = [(4, 8, 1, 4096, 128, True), (2, 32, 4, 2048, 128, True), (2, 32, 8, 4096, 128, True),
         (1, 32, 8, 8192, 128, True), (4, 8, 1, 4096, 128, False), (8, 16, 2, 2048, 64, True),
         (1, 64, 8, 8192, 64, True), (2, 32, 8, 4096, 128, False),
         (1, 16, 2, 6272, 128, True), (1, 8, 1, 4096, 128, False), (1, 16, 2, 8192, 128, False)]
if os.environ.get("SPLIT_CASES"):
    CASES = [CASES[int(i)] for i in os.environ["SPLIT_CASES"].split(",")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def case(B: int, Hq: int, Hkv: int, N: int, D: int, causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")

    def grads(parts: int | None, mode: str = "sync"):
        def call():
            hb.SPLIT = parts
            hopper.set_mode(mode)
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call

    prob = make_problem(q, k, v, causal=causal)
    hb.SPLIT = None
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}",
           "product_split": hb.split(prob), "product_order": hb.order(prob), "checks": {}}
    before = hb.launches
    product = grads(None)()
    row["product_taken"] = hb.launches == before + 1
    portable = grads(None, "0")()
    row["product_err_vs_portable"] = [rel(a, b) for a, b in zip(product, portable)]
    whole = grads(1)()
    splits = [s for s in (1, 2, 4, 8) if (Hq // Hkv) % s == 0]
    for s in splits[1:]:
        before = hb.launches
        dq, dk, dv = grads(s)()
        row["checks"][s] = {"taken": hb.launches == before + 1, "order": None,
                            "err_vs_whole": [rel(dq, whole[0]), rel(dk, whole[1]), rel(dv, whole[2])]}
        hb.SPLIT = s
        row["checks"][s]["order"] = hb.order(prob)
    row["passed"] = row["product_taken"] and max(row["product_err_vs_portable"]) < 2e-2 and all(
        c["taken"] and max(c["err_vs_whole"]) < 1e-2 for c in row["checks"].values())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    calls = {f"split-{s}": grads(s) for s in splits}
    calls["product"] = grads(None)
    calls["portable-bwd"] = grads(None, "0")
    calls["sdpa-cudnn-bwd"] = lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        cudnn = row["ms"]["sdpa-cudnn-bwd"]
        row["cudnn_ms_over"] = {name: cudnn / ms for name, ms in row["ms"].items()}
    hb.SPLIT = None
    hopper.set_mode("sync")
    return row


def main(path: str) -> None:
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"),
           "command": "PYTHONPATH=. python3 .wip/hopper-bwd-0712b/split_ab.py OUT.json"}
    rows = []
    for c in CASES:
        rows.append(case(*c))
        print(json.dumps(rows[-1]), flush=True)
        with open(path, "w") as f:  # after every row: a call cut by its time limit keeps what it measured
            json.dump({"environment": env, "rows": rows}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
