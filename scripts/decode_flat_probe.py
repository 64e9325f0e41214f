"""Flat splits against the (split, unit) grid on one GPU, per decode-suite configuration without ragged
lengths: the split kernel's default plan (grid), flat splits over P programs for a few configs and P (every
SM busy: P a multiple of the SM count), SDPA's cuDNN kernel, and the paged caches (blocks of 16 and 64 keys)
with flat splits. GPU us by CUDA-graph replay; outputs checked against the default's (max abs error; paged
against their dense flat run, bit for bit).

Usage: ``PYTHONPATH=.:scripts python3 scripts/decode_flat_probe.py``."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from decode_profile import graph_us, paged_cache
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab.backends.triton import decode as td
from attnlab.bench.suites import decode_suite
from attnlab.problem import make_problem

#: (config, programs per SM)
FLAT = [(td.DEEP_CONFIG, 1), (td.DecodeConfig(64, 4, 2), 2), (td.DecodeConfig(64, 4, 2), 4),
        (td.DecodeConfig(64, 4, 3), 2)]
#: paged runs: (config, programs per SM)
PAGED = [(td.DEEP_CONFIG, 1), (td.DecodeConfig(64, 4, 2, maxnreg=128), 4)]


def probe(case, sms: int) -> None:
    B, Hkv, Nk = case.B, case.Hkv, case.Nk
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, case.Hq, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    prob = make_problem(q, k, v)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    td._PLANS.clear()
    td.decode_forward(prob, ref, None)
    plan = td.gpu_plan(prob)
    cells = [f"grid {plan.cfg.block_n}/{plan.cfg.num_stages} S={plan.n_split} "
             f"{graph_us(lambda: td.decode_forward(prob, out, None)):.1f}"]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    cells.append(f"cudnn {graph_us(cudnn):.1f}")
    for cfg, per_sm in FLAT:
        P = per_sm * sms
        name = f"flat {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages} P{P}"
        try:
            td.decode_forward(prob, out, None, config=cfg, programs=P)
            err = (out.float() - ref.float()).abs().max().item()
            us = graph_us(lambda cfg=cfg, P=P: td.decode_forward(prob, out, None, config=cfg, programs=P))
            cells.append(f"{name} {us:.1f}{'' if err < 1e-2 else f' BAD {err:.2g}'}")
        except Exception as e:
            cells.append(f"{name} {type(e).__name__}: {str(e)[:80]}")
    for bs in (16, 64):
        pk = paged_cache(prob, k, v, bs)
        for cfg, per_sm in PAGED:
            P = per_sm * sms
            name = f"p{bs} flat {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages} P{P}"
            try:
                td.decode_forward(prob, out, None, config=cfg, programs=P)
                dense = out.clone()
                td.decode_forward(prob, out, None, config=cfg, programs=P, paged=pk)
                same = torch.equal(out, dense)
                us = graph_us(lambda cfg=cfg, P=P, pk=pk: td.decode_forward(prob, out, None, config=cfg,
                                                                            programs=P, paged=pk))
                cells.append(f"{name} {us:.1f}{'' if same else ' DIFFERS'}")
            except Exception as e:
                cells.append(f"{name} {type(e).__name__}: {str(e)[:80]}")
        pk = None
    print(f"{case.name:36s} " + " | ".join(cells), flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in decode_suite("cuda"):
        if case.kv_len is None:
            probe(case, sms)
        td._PLANS.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
