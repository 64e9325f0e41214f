"""A/B of the decode merge launched by programmatic dependent launch (td.PDL) against a plain second launch,
beside sdpa-cudnn, in one run: per config, GPU time per call by CUDA-graph replay and the median of 300
back-to-back CUDA-event-timed public calls over two input sets (as the harness times them), PDL off and on
alternately twice; then the paged caches (blocks of 16 and 64) with PDL on. Outputs are compared bit for bit
between the two launches. bf16 Hq32 D128 Nq1. Stdout only.

Usage on the GPU machine: ``PYTHONPATH=.:scripts python3 scripts/decode_pdl_ab.py``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from call_probe import loop
from decode_profile import decode_inputs, graph_us
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab import calls
from attnlab.backends.triton import decode as td
from attnlab.paged import to_paged


def events(fn, sets: int = 2, reps: int = 300) -> float:
    """Median us of ``reps`` event-timed calls queued back to back, rotating over ``sets`` input sets, after 20
    untimed ones (call_probe's loop)."""
    for i in range(20):
        fn(i % sets)
    return loop(fn, sets, reps)[0]


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for B, Hkv, Nk in [(16, 8, 4096), (8, 8, 8192), (8, 32, 8192), (1, 8, 32768), (8, 8, 32768),
                       (1, 8, 131072), (1, 32, 131072)]:
        sets = [decode_inputs(B, Hkv, Nk, seed=s) for s in range(2)]
        gb = 2 * sets[0][1].numel() * 2 / 1e9
        label = f"B{B} Hkv{Hkv} Nk{Nk}"

        def cudnn(i, sets=sets):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*sets[i], enable_gqa=True)

        res = {"cudnn": ([graph_us(lambda: cudnn(0))], [events(cudnn)])}
        outs = {}
        for pdl in (False, True, False, True):
            td.PDL = pdl
            td._PLANS.clear()
            calls.clear()

            def ours(i, sets=sets):
                return attnlab.attention(*sets[i])

            outs.setdefault(pdl, ours(0).clone())
            g, e = res.setdefault(f"pdl={int(pdl)}", ([], []))
            g.append(graph_us(lambda ours=ours: ours(0)))
            e.append(events(ours))
        same = torch.equal(outs[False], outs[True])
        line = " | ".join(f"{k} graph {min(g):6.1f} events {min(e):6.1f} ({gb / (min(e) * 1e-6):5.0f} GB/s)"
                          for k, (g, e) in res.items())
        print(f"{label}: {line} | bitwise equal {same}", flush=True)
        if (B, Hkv, Nk) in ((1, 8, 32768), (8, 8, 8192)):
            q, k, v = sets[0]
            for bs in (16, 64):
                kc, vc, bt = to_paged(k, v, bs)

                def paged(i=0, q=q, kc=kc, vc=vc, bt=bt):
                    return attnlab.attention(q, kc, vc, block_table=bt)

                got = paged()
                us, ev = graph_us(paged), events(paged)
                print(f"{label} paged{bs} pdl=1: graph {us:6.1f} events {ev:6.1f} | equal to dense "
                      f"{torch.equal(got, outs[True])}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
