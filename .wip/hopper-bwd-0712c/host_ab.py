# ruff: noqa
"""The Hopper backward as committed (product) against b4645b3's host and kernel (old), swapped at
hopper_backward.run, the backward alone through the public call: gradients of old against product's, then both
interleaved with sdpa-cudnn and the portable backward over 5 rounds of 10 calls.
PYTHONPATH=. python3 .wip/hopper-bwd-0712c/host_ab.py OUT.json"""
import importlib.util, json, os, sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m

old_kernel = load(".wip/hopper-bwd-0712c/hopper_bwd_kernel_b46.py", "hbk_b46")
old = load(".wip/hopper-bwd-0712c/hopper_backward_old.py", "hb_old")
old._kernel_module = lambda: old_kernel
RUNS = {"product": hb.run, "old": old.run}

CASES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True),
         (1, 16, 16, 16384, 128, False), (1, 16, 16, 16384, 128, True), (2, 32, 8, 4096, 64, True),
         (8, 16, 2, 2048, 64, True), (4, 8, 1, 4096, 128, True)]

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

def case(B, Hq, Hkv, N, D, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")
    def grads(name, mode="sync"):
        def call():
            hb.run = RUNS[name]
            hopper.set_mode(mode)
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}"}
    before = (hb.launches, old.launches)
    ref = grads("product")()
    row["product_taken"] = hb.launches == before[0] + 1
    got = grads("old")()
    row["old_taken"] = old.launches == before[1] + 1
    portable = grads("product", "0")()
    row["old_err_vs_product"] = [rel(a, b) for a, b in zip(got, ref)]
    row["product_err_vs_portable"] = [rel(a, b) for a, b in zip(ref, portable)]
    row["passed"] = row["product_taken"] and row["old_taken"] and max(row["old_err_vs_product"]) < 1e-2 and max(
        row["product_err_vs_portable"]) < 2e-2
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    calls = {"product": grads("product"), "old": grads("old"), "portable": grads("product", "0"),
             "sdpa-cudnn-bwd": lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)}
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        row["cudnn_ms_over"] = {n: row["ms"]["sdpa-cudnn-bwd"] / ms for n, ms in row["ms"].items()}
    hb.run = RUNS["product"]
    hopper.set_mode("sync")
    return row

def main(path):
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "old": "b4645b3",
           "command": "PYTHONPATH=. python3 .wip/hopper-bwd-0712c/host_ab.py OUT.json"}
    rows = []
    for c in CASES:
        rows.append(case(*c))
        r = rows[-1]
        print(r["case"], r["passed"], {k: round(v, 3) for k, v in r.get("cudnn_ms_over", {}).items()},
              round(max(r["old_err_vs_product"]), 4), round(max(r["product_err_vs_portable"]), 4), flush=True)
        with open(path, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main(sys.argv[1])
