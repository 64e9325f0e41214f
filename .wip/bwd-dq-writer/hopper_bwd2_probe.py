"""Probe of the experimental one-pass Gluon backward (hopper_bwd2.py beside it), its dQ modes against the portable
backward and sdpa-cudnn's: gradients compared with the portable backward's, then times."""

import json
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hopper_bwd2

import attnlab
from attnlab.backends.triton import backward as tb
from attnlab.bench.timing import interleaved_ms
from attnlab.problem import make_problem

CASES = [(1, 4, 2, 1000, 128, True), (2, 3, 3, 333, 128, False), (4, 16, 16, 4096, 128, True),
         (4, 16, 16, 4096, 128, False), (2, 32, 8, 4096, 128, True)]
LOG2E = 1.4426950408889634
W = dict(writer_regs=24, writer_rows=4)
VARIANTS = {"rows-writer": dict(dq_mode=1, rows=True, **W), "rows-writer-tma": dict(dq_mode=4, rows=True, **W),
            "swapped-writer-tma": dict(dq_mode=4, **W), "rows-writer-no-add": dict(dq_mode=2, rows=True, **W),
            "rows-no-dq": dict(dq_mode=3, rows=True, **W)}
CHECKED = ("rows-writer", "rows-writer-tma", "swapped-writer-tma")


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
    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}", "err": {}}
    for name in CHECKED:
        got = hopper_bwd2.gradients(qd, kd, vd, dout, lse2, delta, causal, prob.scale, **VARIANTS[name])
        torch.cuda.synchronize()
        row["err"][name] = [rel(a, b) for a, b in zip(got, ref)]
    row["passed"] = {name: max(e) < 2e-2 for name, e in row["err"].items()}
    print(row["case"], row["err"], flush=True)
    if rounds == 0:
        return row

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

    calls = {"portable-bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
             "sdpa-cudnn-bwd": cudnn(),
             **{name: (lambda cfg=cfg: hopper_bwd2.gradients(qd, kd, vd, dout, lse2, delta, causal, prob.scale,
                                                             **cfg))
                for name, cfg in VARIANTS.items() if row["passed"].get(name, True)}}
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
        json.dump({"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                   "triton": triton.__version__},
                   "variants": VARIANTS, "rows": rows},
                  open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
