"""Split count against pipeline depth on one GPU, per decode-suite configuration: the split kernel with
deeper pipelines (more key tiles in flight per program) at about one and two programs per SM, against the
default config at its own split count and SDPA's cuDNN kernel; the paged caches (blocks of 16 and 64 keys)
for the deep configs at one program per SM. GPU us by CUDA-graph replay; outputs checked against the
default's (max abs error; paged against their dense run, bit for bit).

Usage: ``PYTHONPATH=.:scripts python3 scripts/decode_deep_sweep.py``."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from decode_profile import case_inputs, graph_us, paged_cache
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab.backends.triton import decode as td
from attnlab.bench.suites import decode_suite

#: (config, programs per SM aimed at)
CANDIDATES = [(td.DecodeConfig(128, 4, 3), 1), (td.DecodeConfig(128, 4, 3), 2), (td.DecodeConfig(128, 4, 4), 1),
              (td.DecodeConfig(64, 4, 4), 1), (td.DecodeConfig(64, 4, 4), 2), (td.DecodeConfig(64, 4, 3), 2)]
PAGED = [td.DecodeConfig(128, 4, 3), td.DecodeConfig(64, 4, 4)]


def sweep(case, sms: int) -> None:
    B, Hkv, Nk = case.B, case.Hkv, case.Nk
    prob, q, k, v, kv_len = case_inputs(case)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    td._PLANS.clear()
    td.decode_forward(prob, ref, None)
    cells = [f"default S={td.gpu_plan(prob).n_split} {graph_us(lambda: td.decode_forward(prob, out, None)):.1f}"]
    mask = None if kv_len is None else (torch.arange(Nk, device="cuda")[None, :] < kv_len[:, None])[:, None, None]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    cells.append(f"cudnn {graph_us(cudnn):.1f}")
    base = B * Hkv
    caches = {bs: paged_cache(prob, k, v, bs) for bs in (16, 64)}
    for cfg, per_sm in CANDIDATES:
        tiles = -(-Nk // cfg.block_n)
        S = max(1, min(per_sm * sms // base, tiles // td.MIN_TILES_PER_SPLIT))
        name = f"{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages} S{S}"
        try:
            td.decode_forward(prob, out, None, config=cfg, splits=S)
            err = (out.float() - ref.float()).abs().max().item()
            us = graph_us(lambda cfg=cfg, S=S: td.decode_forward(prob, out, None, config=cfg, splits=S))
            cells.append(f"{name} {us:.1f}{'' if err < 1e-2 else ' BAD'}")
            if per_sm == 1 and cfg in PAGED:
                dense = out.clone()
                for bs, pk in caches.items():
                    td.decode_forward(prob, out, None, config=cfg, splits=S, paged=pk)
                    same = torch.equal(out, dense)
                    us = graph_us(lambda cfg=cfg, S=S, pk=pk: td.decode_forward(prob, out, None, config=cfg,
                                                                                splits=S, paged=pk))
                    cells.append(f"{name} p{bs} {us:.1f}{'' if same else ' DIFFERS'}")
        except Exception as e:
            cells.append(f"{name} {type(e).__name__}: {str(e)[:60]}")
    print(f"{case.name:36s} " + " | ".join(cells), flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in decode_suite("cuda"):
        sweep(case, sms)
        td._PLANS.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
