"""Split count against pipeline depth on one GPU: the decode split kernel at few splits (down to one program
per (batch, kv head), no merge) with deeper pipelines (more key tiles in flight per program) against the
default config at its own split count. GPU us by CUDA-graph replay; errors against the default's output.

Usage: ``PYTHONPATH=.:scripts python3 scripts/decode_deep_sweep.py``."""

from __future__ import annotations

import sys

import torch
from decode_profile import decode_inputs, graph_us

from attnlab.backends.triton import decode as td
from attnlab.problem import make_problem

CONFIGS = [td.DecodeConfig(64, 4, 2), td.DecodeConfig(64, 4, 3), td.DecodeConfig(64, 4, 4), td.DecodeConfig(64, 4, 5),
           td.DecodeConfig(64, 8, 3), td.DecodeConfig(64, 8, 4), td.DecodeConfig(128, 8, 3), td.DecodeConfig(128, 4, 3),
           td.DecodeConfig(32, 4, 6)]


def sweep(B: int, Hkv: int, Nk: int) -> None:
    q, k, v = decode_inputs(B, Hkv, Nk)
    gb = 2 * k.numel() * 2 / 1e9
    prob = make_problem(q, k, v)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    td._PLANS.clear()
    td.decode_forward(prob, ref, None)
    default = graph_us(lambda: td.decode_forward(prob, out, None))
    print(f"B{B} Hkv{Hkv} Nk{Nk} default S={td.gpu_plan(prob).n_split}: {default:.1f} us "
          f"{gb / default / 1e-3:.2f} TB/s", flush=True)
    for cfg in CONFIGS:
        cells = []
        for S in (1, 2, 4, 8, 16, 32, 64):
            if S > 1 and B * Hkv * S > 4 * 132:
                continue
            try:
                td.decode_forward(prob, out, None, config=cfg, splits=S)
                err = (out.float() - ref.float()).abs().max().item()
                us = graph_us(lambda cfg=cfg, S=S: td.decode_forward(prob, out, None, config=cfg, splits=S))
                cells.append(f"S{S} {us:.1f}{'' if err < 1e-2 else ' BAD'}")
            except Exception as e:
                cells.append(f"S{S} {type(e).__name__}")
        print(f"B{B} Hkv{Hkv} Nk{Nk} {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}: " + " | ".join(cells),
              flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for B, Hkv, Nk in [(16, 8, 4096), (8, 8, 8192), (1, 8, 32768), (8, 32, 8192)]:
        sweep(B, Hkv, Nk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
