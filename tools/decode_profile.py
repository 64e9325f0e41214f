"""Where decode time goes on one GPU: host profile of the repeated public call, GPU-only time (CUDA-graph
replay) of attnlab and SDPA, a sweep of split counts and key tiles, and the paged caches. One call, stdout.

``--graph-only``: the CUDA-graph times of every decode-suite configuration without ragged lengths, no sweep
and no profile (what notebook 10 reads, converted to data/experiments/nvidia-h200/decode-graph.csv)."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.backends.triton import decode as td
from attnlab.bench.replay import graph_us
from attnlab.paged import paged_kv, to_paged
from attnlab.problem import make_problem


def case_inputs(case) -> tuple:
    """A decode-suite case's seeded bf16 inputs and problem: (prob, q, k, v, kv_len), q [B, Hq, 1, D], k and v
    [B, Hkv, Nk, D], kv_len an int32 GPU tensor or None (the same draws, in the same order, as decode_inputs)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(case.B, case.Hq, 1, case.D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(case.B, case.Hkv, case.Nk, case.D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    kv_len = None if case.kv_len is None else torch.tensor(case.kv_len, device="cuda", dtype=torch.int32)
    return make_problem(q, k, v, **({} if kv_len is None else {"kv_len": kv_len})), q, k, v, kv_len


def paged_cache(prob, k: torch.Tensor, v: torch.Tensor, block_size: int):
    """k and v as a validated paged cache of ``block_size`` keys per block (blocks shuffled), for
    ``td.decode_forward(..., paged=...)``."""
    kc, vc, bt = to_paged(k, v, block_size)
    return paged_kv(kc, vc, bt, B=prob.B, Hkv=prob.Hkv, D=prob.D, Nk=prob.Nk, dtype=prob.dtype, device=prob.device,
                    block_size=None, kv_len=None)


def profile_config(B: int, Hkv: int, Nk: int, sweep: bool = True) -> None:
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gb = 2 * k.numel() * 2 / 1e9
    label = f"B{B} Hkv{Hkv} Nk{Nk}"

    def rate(us):
        return f"{us:7.1f} us {gb / (us * 1e-6):6.0f} GB/s"

    for name, kind in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def sd(kind=kind):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            print(label, f"sdpa-{name:14s}", rate(graph_us(sd)), flush=True)
        except RuntimeError as e:
            print(label, name, "failed", str(e)[:80])
    print(label, "attnlab auto      ", rate(graph_us(lambda: attnlab.attention(q, k, v))), flush=True)
    for bs in (16, 64):
        kc, vc, bt = to_paged(k, v, bs)
        us = graph_us(lambda kc=kc, vc=vc, bt=bt: attnlab.attention(q, kc, vc, block_table=bt))
        print(label, f"attnlab paged{bs:<4d}", rate(us), flush=True)
    if not sweep:
        return
    prob = make_problem(q, k, v)
    out = torch.empty_like(q)
    default = td.num_splits(prob, td.default_config(prob.dtype, 128), td._sm_count(0))
    for cfg in (td.DecodeConfig(64, 4, 2), td.DecodeConfig(128, 4, 2), td.DecodeConfig(128, 8, 3),
                td.DecodeConfig(32, 4, 3)):
        line = []
        for S in (4, 8, 16, 32, 64, 128):
            tiles = -(-Nk // cfg.block_n)
            if S > tiles:
                continue
            us = graph_us(lambda S=S, cfg=cfg: td.decode_forward(prob, out, None, splits=S, config=cfg))
            line.append(f"S{S}:{us:.1f}")
        print(label, f"sweep bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} (default S={default}):",
              " ".join(line), flush=True)
    attnlab.attention(q, k, v)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        attnlab.attention(q, k, v)
    prof.disable()
    torch.cuda.synchronize()
    if B == 1:
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> int:
    torch.manual_seed(0)
    if "--graph-only" in sys.argv:
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
        for B, Hkv, Nk in [(16, 8, 4096), (8, 8, 8192), (8, 32, 8192), (1, 8, 32768), (8, 8, 32768),
                           (1, 8, 131072), (1, 32, 131072)]:
            profile_config(B, Hkv, Nk, sweep=False)
        return 0
    for B, Hkv, Nk in [(1, 8, 32768), (8, 8, 8192), (16, 8, 4096), (8, 8, 32768)]:
        profile_config(B, Hkv, Nk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
