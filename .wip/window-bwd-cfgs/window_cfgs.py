# ruff: noqa
"""The gpt-oss-like layer's backward (B2 Hq64 Hkv8 N4096 D64 bf16, window (127, 0)): each dK/dV and dQ config's
kernel time (triton.testing.do_bench, median), its gradients checked against the product's default pair.
PYTHONPATH=. python3 .wip/window-bwd-cfgs/window_cfgs.py OUT.json"""
import json, os, sys
import torch, triton
from triton.testing import do_bench
import attnlab
from attnlab.problem import make_problem
from attnlab.backends.triton import backward as bw, bwd_launch as bl, configs
from attnlab.backends.triton.configs import BwdConfig as C

g = torch.Generator(device="cuda").manual_seed(0)
W = int(os.environ.get("W", 127))
q = torch.randn(2, 64, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(2, 8, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
out, lse = attnlab.attention(q, k, v, window=(W, 0), return_lse=True, backend="triton")
dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
prob = make_problem(q, k, v, window=(W, 0))
ref = bw.gradients(prob, out, lse, dout)[:3]
delta = torch.empty(lse.shape, dtype=torch.float32, device="cuda"); lse2 = torch.empty_like(delta)
bl.launch_preprocess(prob, out, lse, dout, delta, lse2, False)
picked = bw._decide(prob, None, False, dout, delta, lse2, None, None, None)[:2]
KV = [*configs.dkdv_candidates(torch.bfloat16, 64), C(64, 64, 8, 3), C(32, 64, 4, 3), C(32, 64, 4, 2), C(32, 32, 4, 3), C(64, 32, 4, 3), C(16, 64, 4, 3)]
DQ = [*configs.dq_candidates(torch.bfloat16, 64), C(64, 64, 8, 3), C(64, 32, 4, 3), C(32, 64, 4, 3), C(64, 128, 8, 3), C(32, 32, 4, 3)]
rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
rows = []
for kind, space in (("dkdv", KV), ("dq", DQ)):
    for cfg in dict.fromkeys(space):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if kind == "dkdv":
            fn = lambda: bl.launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg, False)
        else:
            fn = lambda: bl.launch_dq(prob, dout, delta, lse2, dq, cfg, False)
        try:
            fn(); torch.cuda.synchronize()
            err = [rel(dk, ref[1]), rel(dv, ref[2])] if kind == "dkdv" else [rel(dq, ref[0])]
            ms = [do_bench(fn, warmup=5, rep=30, return_mode="median") for _ in range(3)]
            row = {"kernel": kind, "cfg": list(cfg.__dict__.values()) if hasattr(cfg, "__dict__") else list(cfg), "err": err, "ms": ms, "default": cfg == picked[0 if kind == "dkdv" else 1]}
        except Exception as e:
            row = {"kernel": kind, "cfg": str(cfg), "error": repr(e)[:200]}
        rows.append(row); print(row, flush=True)
json.dump({"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT"), "shape": "B2 Hq64 Hkv8 N4096 D64 bf16", "window": [W, 0],
           "method": "kernel alone after the preprocess, triton.testing.do_bench median (warmup 5 ms, rep 30 ms), 3 times; gradients vs the default pair's (rel. to max)",
           "command": "PYTHONPATH=. python3 .wip/window-bwd-cfgs/window_cfgs.py OUT.json"}, "rows": rows}, open(sys.argv[1], "w"), indent=1)
