"""Where decode's split states are merged, A/B on one GPU: in the split kernel (the last split of each column
merges, one launch a call) against the merge kernel (a second launch), through ``attnlab.attention``, beside
sdpa-cudnn and sdpa-flash on the same tensors.

Per decode-suite configuration (bf16, D 128, Hq 32, Nq 1): each output checked against the float64 reference
first; GPU time per call in CUDA-graph replay (``graph_us``, no host); back-to-back calls timed by one event
pair (``stream_us``: the host's launches overlap the GPU's work, as in a decode loop); host time per call
(``host_us``, GPU kept busy); the split count and the split kernel's registers. One line per (config, way).

    PYTHONPATH=.:scripts python3 scripts/merge_ab.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from decode_profile import decode_inputs, graph_us
from host_time import gpu_us as stream_us
from host_time import host_us
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab import calls
from attnlab.backends.triton import decode as td
from attnlab.check import compare
from attnlab.problem import make_problem
from attnlab.reference import reference_forward

CONFIGS = [(16, 8, 4096), (8, 8, 8192), (8, 32, 8192), (1, 8, 32768), (8, 8, 32768), (1, 8, 131072),
           (1, 32, 131072)]


def run_config(B: int, Hkv: int, Nk: int) -> None:
    q, k, v = decode_inputs(B, Hkv, Nk)
    gb = 2 * k.numel() * 2 / 1e9
    label = f"B{B} Hkv{Hkv} Nk{Nk}"
    ref = reference_forward(make_problem(q, k, v))[0]
    ways = {}
    for name, kind in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def sd(kind=kind):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ways[name] = sd
    for in_split in (True, False):
        def call(in_split=in_split):
            td.MERGE_IN_SPLIT = in_split
            return attnlab.attention(q, k, v, backend="triton-decode")
        ways["merge-in-split" if in_split else "merge-kernel"] = call
    for name, fn in ways.items():
        try:
            calls.clear()
            rep = compare(fn(), ref, dtype=q.dtype)
            extra = ""
            if name.startswith("merge"):
                plan = td.gpu_plan(make_problem(q, k, v))
                split = plan.kernels[False][0].compiled
                regs = next(iter(split.values())).n_regs if split else "?"
                extra = f"{plan.n_split} | {regs}"
            g, s, h = graph_us(fn), stream_us(fn), host_us(fn)
            print(f"{label} | {name} | {g:.1f} | {gb / (g * 1e-6):.0f} | {s:.1f} | {h:.1f} | {extra} | "
                  f"{'ok' if rep.passed else 'FAILED ' + str(rep)}", flush=True)
        except RuntimeError as e:
            print(f"{label} | {name} | failed: {str(e)[:100]}", flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    print("# config | way | graph us | GB/s | stream us | host us | splits | regs | checked", flush=True)
    for B, Hkv, Nk in CONFIGS:
        run_config(B, Hkv, Nk)
        torch.cuda.empty_cache()
    td.MERGE_IN_SPLIT = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
