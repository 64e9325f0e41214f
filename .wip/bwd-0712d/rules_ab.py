# ruff: noqa
"""The Hopper backward against the portable backward (and sdpa-cudnn where it takes the call), the backward alone
through the public call, after the two agree.  Modes: alibi (ALiBi on full rows, its rule lifted), mha64 (D 64
without GQA, its rule lifted), oddnq (odd Nq; run in a tree with the odd-Nq patch applied).
Usage: PYTHONPATH=. python3 gpurun/rules_ab.py MODE OUT.json"""
import json, os, sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms

MODE = sys.argv[1]
# (B, Hq, Hkv, Nq, Nk, D, causal, alibi)
CASES = {
    "alibi": [(4, 16, 16, 4096, 4096, 128, False, True), (1, 16, 16, 16384, 16384, 128, False, True),
              (8, 16, 16, 2048, 2048, 64, False, True), (2, 32, 8, 4096, 4096, 128, False, True),
              (2, 32, 8, 4096, 4096, 64, False, True)],
    "mha64": [(4, 16, 16, 4096, 4096, 64, True, False), (1, 16, 16, 16384, 16384, 64, True, False),
              (4, 16, 16, 4096, 4096, 64, False, False), (8, 16, 16, 2048, 2048, 64, True, False),
              (2, 32, 32, 8192, 8192, 64, True, False)],
    "oddnq": [(4, 16, 16, 4095, 4095, 128, True, False), (4, 16, 16, 4093, 4093, 128, False, False),
              (2, 32, 8, 4097, 4097, 128, True, False), (8, 16, 2, 2047, 2047, 64, True, False),
              (2, 16, 16, 3001, 4096, 128, False, False)],
}[MODE]

orig = hb.unsupported
def lifted(prob, dout):
    why = orig(prob, dout)
    if why and ((MODE == "alibi" and why.startswith("ALiBi")) or (MODE == "mha64" and why.startswith("D 64"))):
        return None
    return why

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

rows = []
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "mode": MODE,
       "command": f"PYTHONPATH=. python3 gpurun/rules_ab.py {MODE} OUT.json"}
for B, Hq, Hkv, Nq, Nk, D, causal, alibi in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, Nq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = dict(causal=causal)
    if Nq != Nk and causal:
        kw["align"] = "bottom_right"
    if alibi:
        kw["alibi_slopes"] = torch.exp2(-torch.arange(1, Hq + 1, device="cuda", dtype=torch.float32) * 8 / Hq)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, backend="triton", **kw)
    def grads(hop):
        def call():
            hb.unsupported = lifted
            hopper.set_mode("sync" if hop else "0")
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call
    before = hb.launches
    a = grads(True)()
    taken = hb.launches == before + 1
    b = grads(False)()
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} nq{Nq} nk{Nk} d{D} {'causal' if causal else 'full'}"
                   f"{' alibi' if alibi else ''}", "taken": taken, "err_vs_portable": [rel(x, y) for x, y in zip(a, b)]}
    calls = {"hopper": grads(True), "portable": grads(False)}
    if not alibi:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        calls["sdpa-cudnn-bwd"] = lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)
    if taken and max(row["err_vs_portable"]) < 2e-2:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        row["portable_ms_over"] = {n: row["ms"]["portable"] / ms for n, ms in row["ms"].items()}
        if "sdpa-cudnn-bwd" in row["ms"]:
            row["cudnn_ms_over"] = {n: row["ms"]["sdpa-cudnn-bwd"] / ms for n, ms in row["ms"].items()}
    hb.unsupported = orig
    hopper.set_mode("sync")
    rows.append(row)
    print(row["case"], taken, round(max(row["err_vs_portable"]), 4),
          {k: round(x, 3) for k, x in row.get("portable_ms_over", {}).items()},
          {k: round(x, 3) for k, x in row.get("cudnn_ms_over", {}).items()}, flush=True)
    json.dump({"environment": env, "rows": rows}, open(sys.argv[2], "w"), indent=1)
    del q, k, v, dout, out
    torch.cuda.empty_cache()
