# ruff: noqa
"""The Hopper backward's kernel variants (gpurun/hopper_bwd_kernel_<v>.py) against HEAD's, the backward alone
through the public call: each variant's gradients checked against HEAD's kernel, then all interleaved with
sdpa-cudnn over 5 rounds of 10 calls.  Usage: PYTHONPATH=. python3 gpurun/variants_ab.py OUT.json v1 v2 ..."""
import importlib.util, json, os, sys
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms

def load(v):
    spec = importlib.util.spec_from_file_location(f"hbk_{v}", f"gpurun/hopper_bwd_kernel_{v}.py")
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m

VARIANTS = {"head": (hb._kernel_module(), {})}
for v in sys.argv[2:]:
    VARIANTS[v] = (load(v), {})

def use(name):
    mod, cache = VARIANTS[name]
    hb._kernel_module = lambda: mod
    hb._kernels = cache

CASES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True),
         (1, 16, 16, 16384, 128, False), (1, 16, 16, 16384, 128, True), (2, 32, 8, 4096, 64, True),
         (8, 16, 2, 2048, 64, True), (1, 64, 8, 8192, 64, True), (2, 32, 8, 4096, 64, False),
         (4, 8, 1, 4096, 128, True)]
if os.environ.get("VARIANT_CASES"):
    CASES = [CASES[int(i)] for i in os.environ["VARIANT_CASES"].split(",")]

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

def case(B, Hq, Hkv, N, D, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")
    def grads(name):
        def call():
            use(name)
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}", "err_vs_head": {}}
    before = hb.launches
    ref = grads("head")()
    row["taken"] = hb.launches == before + 1
    for name in VARIANTS:
        if name != "head":
            got = grads(name)()
            row["err_vs_head"][name] = [rel(a, b) for a, b in zip(got, ref)]
    row["passed"] = row["taken"] and all(max(e) < 1e-2 for e in row["err_vs_head"].values())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    calls = {name: grads(name) for name in VARIANTS}
    calls["sdpa-cudnn-bwd"] = lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        row["cudnn_ms_over"] = {n: row["ms"]["sdpa-cudnn-bwd"] / ms for n, ms in row["ms"].items()}
    use("head")
    return row

def main(path):
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "variants": list(VARIANTS),
           "command": "PYTHONPATH=. python3 gpurun/variants_ab.py OUT.json " + " ".join(sys.argv[2:])}
    rows = []
    for c in CASES:
        rows.append(case(*c))
        r = rows[-1]
        print(r["case"], r["passed"], {k: round(v, 3) for k, v in r.get("cudnn_ms_over", {}).items()},
              {k: round(max(v), 4) for k, v in r["err_vs_head"].items()}, flush=True)
        with open(path, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main(sys.argv[1])
