# ruff: noqa
"""D 64 without GQA: the Hopper backward (its GQA-only rule lifted) against the portable backward and sdpa-cudnn,
the backward alone through the public call, after the two agree.  PYTHONPATH=. python3 .wip/hopper-bwd-0712b/mha64_ab.py OUT.json"""
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

CASES = [(4, 16, 4096, True), (1, 16, 16384, True), (4, 16, 4096, False), (8, 16, 2048, True), (2, 32, 8192, True)]

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

rows = []
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "command": "PYTHONPATH=. python3 .wip/hopper-bwd-0712b/mha64_ab.py OUT.json"}
for B, H, N, causal in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, N, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")
    def grads(hop):
        def call():
            hb.GQA_ONLY_HEAD_DIMS = () if hop else (64,)
            hopper.set_mode("sync" if hop else "0")
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call
    before = hb.launches
    a = grads(True)()
    taken = hb.launches == before + 1
    b = grads(False)()
    row = {"case": f"bf16 b{B} h{H} n{N} d64 {'causal' if causal else 'full'}", "taken": taken,
           "err_vs_portable": [rel(x, y) for x, y in zip(a, b)]}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    calls = {"hopper": grads(True), "portable": grads(False),
             "sdpa-cudnn-bwd": lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)}
    if taken and max(row["err_vs_portable"]) < 2e-2:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        row["cudnn_ms_over"] = {n: row["ms"]["sdpa-cudnn-bwd"] / ms for n, ms in row["ms"].items()}
    hb.GQA_ONLY_HEAD_DIMS = (64,)
    hopper.set_mode("sync")
    rows.append(row)
    print(row["case"], taken, {k: round(x, 3) for k, x in row.get("cudnn_ms_over", {}).items()}, flush=True)
    json.dump({"environment": env, "rows": rows}, open(sys.argv[1], "w"), indent=1)
    torch.cuda.empty_cache()
