"""Probe of the experimental Gluon dK/dV kernel (tools/hopper_dkdv.py) on a GPU, from the repository root:
``python tools/hopper_dkdv_probe.py OUT.json``. Against the portable dK/dV pass, the whole portable backward and
sdpa-cudnn's backward; its gradients compared with the portable backward's (held to float64 by the tests)."""

import json
import sys
import traceback

import torch

sys.path.insert(0, "tools")
import hopper_dkdv

import attnlab
from attnlab.backends.triton import backward as tb
from attnlab.bench.timing import interleaved_ms
from attnlab.problem import make_problem

CASES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True),
         (1, 16, 16, 16384, 128, True), (4, 16, 16, 4096, 64, True), (4, 16, 16, 4096, 64, False),
         (8, 16, 16, 1024, 128, True), (1, 4, 2, 1000, 128, True), (2, 3, 3, 333, 64, False)]
LOG2E = 1.4426950408889634


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def case(B, Hq, Hkv, N, D, causal, variants, rounds):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attnlab.attention(q, k, v, causal=causal, backend="triton", return_lse=True)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    prob = make_problem(qd, kd, vd, causal=causal)
    outd = out.detach()
    delta = (outd.float() * dout.float()).sum(-1).contiguous()
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse * LOG2E).float().contiguous()
    _, dk_p, dv_p, _ = tb.gradients(prob, outd, lse.detach(), dout)
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}", "err": {}, "ms": {}}
    for name, kw in variants.items():
        dk_h, dv_h = hopper_dkdv.dkdv(qd, kd, vd, dout, lse2, delta, causal, prob.scale, **kw)
        torch.cuda.synchronize()
        row["err"][name] = (rel(dk_h, dk_p), rel(dv_h, dv_p))
    row["passed"] = all(max(e) < 2e-2 for e in row["err"].values())
    print(row["case"], row["err"], flush=True)
    if not row["passed"] or rounds == 0:
        return row
    dk, dv, dq = torch.empty_like(kd), torch.empty_like(vd), torch.empty_like(qd)
    cfg = tb.configs_for(prob, dout, delta, lse2, dq, dk, dv)[0]
    row["portable_cfg"] = str(cfg)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

    calls = {
        "portable-dkdv": lambda: tb._launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg, False),
        "portable-bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "sdpa-cudnn-bwd": cudnn(),
    }
    for name, kw in variants.items():
        calls[name] = (lambda kw=kw: hopper_dkdv.dkdv(qd, kd, vd, dout, lse2, delta, causal, prob.scale, **kw))
    row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], rounds, warmup=2, calls=10)
    print(row["case"], {k_: round(v_, 4) for k_, v_ in row["ms"].items()}, flush=True)
    return row


def main(out):
    rows = []
    for c in CASES:
        if c[4] == 128:
            variants = {"bm32-s2": dict(block_m=32), "bm32-s4": dict(block_m=32, stages=4),
                        "bm32-s4-pipe2": dict(block_m=32, stages=4, pipe=2),
                        "bm32-s6-pipe2": dict(block_m=32, stages=6, pipe=2),
                        "bm32-s4-pipe1": dict(block_m=32, stages=4, pipe=1)}
        else:
            variants = {"bm64-s2": dict(block_m=64), "bm64-s4": dict(block_m=64, stages=4),
                        "bm64-s4-pipe2": dict(block_m=64, stages=4, pipe=2),
                        "bm64-s6-pipe2": dict(block_m=64, stages=6, pipe=2)}
        try:
            rows.append(case(*c, variants, rounds=5 if c[3] >= 1024 else 0))
        except Exception as err:  # keep going: one call, many answers
            traceback.print_exc()
            rows.append({"case": str(c), "error": repr(err)[:2000]})
        json.dump({"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "rows": rows},
                  open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
