"""Probe of the experimental one-pass Gluon backward (tools/hopper_bwd1.py) on a GPU, from the repository root:
``python tools/hopper_bwd1_probe.py OUT.json``. Against the portable backward and sdpa-cudnn's: gradients compared
with the portable backward's, then times."""

import json
import sys
import traceback

import torch

sys.path.insert(0, "tools")
import hopper_bwd1

import attnlab
from attnlab.backends.triton import backward as tb
from attnlab.bench.timing import interleaved_ms
from attnlab.problem import make_problem

CASES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True),
         (1, 16, 16, 16384, 128, True), (8, 16, 16, 1024, 128, True), (1, 4, 2, 1000, 128, True),
         (2, 3, 3, 333, 128, False)]
LOG2E = 1.4426950408889634


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def case(B, Hq, Hkv, N, D, causal, rounds):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = attnlab.attention(q, k, v, causal=causal, backend="triton", return_lse=True)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    prob = make_problem(qd, kd, vd, causal=causal)
    delta = (out.detach().float() * dout.float()).sum(-1).contiguous()
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse * LOG2E).float().contiguous()
    ref = tb.gradients(prob, out.detach(), lse.detach(), dout)[:3]
    got = hopper_bwd1.gradients(qd, kd, vd, dout, lse2, delta, causal, prob.scale)
    torch.cuda.synchronize()
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}",
           "err": [rel(a, b) for a, b in zip(got, ref)]}
    row["passed"] = max(row["err"]) < 2e-2
    print(row["case"], row["err"], flush=True)
    if not row["passed"] or rounds == 0:
        return row

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

    calls = {"portable-bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
             "sdpa-cudnn-bwd": cudnn(),
             "gluon-one-pass": lambda: hopper_bwd1.gradients(qd, kd, vd, dout, lse2, delta, causal, prob.scale)}
    row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], rounds, warmup=2, calls=10)
    print(row["case"], {k_: round(v_, 4) for k_, v_ in row["ms"].items()}, flush=True)
    return row


def main(out):
    rows = []
    for c in CASES:
        try:
            rows.append(case(*c, rounds=5 if c[3] >= 1024 else 0))
        except Exception as err:  # keep going: one call, many answers
            traceback.print_exc()
            rows.append({"case": str(c), "error": repr(err)[:3000]})
            if "async_atomic_add" in repr(err) or "NoneType" in repr(err):
                break
        json.dump({"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "rows": rows},
                  open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
