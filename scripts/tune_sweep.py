"""Sweeps behind three defaults, in one GPU call: the decode split count when B * Hkv already fills the
GPU (MHA), the paged decode's pipeline depth and key tile, and the backward kernels' candidate configs on the
padding case. GPU time by CUDA-graph replay for decode (the host out of the way), ``do_bench`` medians for
the backward; each backward config's gradients are compared with the default config's. Stdout only.

Usage on the GPU machine: ``PYTHONPATH=. python3 scripts/tune_sweep.py``.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from attnlab.backends.triton import backward as tb
from attnlab.backends.triton import decode as td
from attnlab.bench.suites import _seeded_lengths
from attnlab.problem import make_problem

sys.path.insert(0, "scripts")
from decode_profile import decode_inputs, graph_us, paged_cache


def decode_splits(B: int, Hkv: int, Nk: int, kv_len: bool) -> None:
    """GPU time of the dense decode by split count, the default first."""
    q, k, v = decode_inputs(B, Hkv, Nk)
    lens = torch.tensor(_seeded_lengths(B, Nk // 4, Nk, seed=5), device="cuda", dtype=torch.int32) if kv_len else None
    prob = make_problem(q, k, v, kv_len=lens)
    out = torch.empty_like(q)
    cfg = td.default_config(prob.dtype, 128)
    default = td.num_splits(prob, cfg, td._sm_count(0))
    line = []
    for S in (1, 2, 3, 4, 6, 8):
        us = graph_us(lambda S=S: td.decode_forward(prob, out, None, splits=S, config=cfg))
        line.append(f"S{S}:{us:.1f}")
    print(f"decode B{B} Hkv{Hkv} Nk{Nk}{' kvlen' if kv_len else ''} (default S={default}): {' '.join(line)}",
          flush=True)


def paged_configs(B: int, Hkv: int, Nk: int) -> None:
    """GPU time of the paged decode (block sizes 16 and 64) by config, beside the dense cache, default S."""
    q, k, v = decode_inputs(B, Hkv, Nk)
    prob = make_problem(q, k, v)
    out = torch.empty_like(q)
    ref = torch.empty_like(q)
    base = td.default_config(prob.dtype, 128)
    dense = graph_us(lambda: td.decode_forward(prob, ref, None, config=base))
    print(f"paged B{B} Hkv{Hkv} Nk{Nk}: dense {base} {dense:.1f} us", flush=True)
    for bs in (16, 64):
        pk = paged_cache(prob, k, v, bs)
        line = []
        for cfg in (td.DecodeConfig(64, 4, 2), td.DecodeConfig(64, 4, 3), td.DecodeConfig(64, 4, 4),
                    td.DecodeConfig(32, 4, 3), td.DecodeConfig(32, 4, 4), td.DecodeConfig(128, 8, 3)):
            try:
                us = graph_us(lambda cfg=cfg, pk=pk: td.decode_forward(prob, out, None, config=cfg, paged=pk))
                err = (out.float() - ref.float()).abs().max().item()
                name = f"bn{cfg.block_n}w{cfg.num_warps}st{cfg.num_stages}"
                line.append(f"{name}:{us:.1f}({dense / us:.2f}x,err{err:.0e})")
            except Exception as e:  # a config that does not fit
                line.append(f"bn{cfg.block_n}w{cfg.num_warps}st{cfg.num_stages}:{type(e).__name__}")
        print(f"  block {bs}: {' '.join(line)}", flush=True)


BWD_EXTRA_DKDV = [tb.BwdConfig(32, 128, 4, 3), tb.BwdConfig(32, 128, 4, 4), tb.BwdConfig(64, 128, 8, 3),
                  tb.BwdConfig(32, 128, 8, 3), tb.BwdConfig(64, 64, 4, 3)]
BWD_EXTRA_DQ = [tb.BwdConfig(128, 32, 4, 3), tb.BwdConfig(64, 64, 4, 3), tb.BwdConfig(128, 64, 8, 3),
                tb.BwdConfig(64, 32, 4, 3), tb.BwdConfig(128, 32, 8, 3)]


def backward_configs(B: int, H: int, N: int, kv_len: bool, causal: bool) -> None:
    """Each dK/dV and dQ config (the candidates, then the extras) on one bf16 D128 case: median ms, and the
    largest difference from the default config's gradient over its largest magnitude."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    lens = torch.tensor(_seeded_lengths(B, N // 4, N, seed=6), device="cuda", dtype=torch.int32) if kv_len else None
    prob = make_problem(q, k, v, kv_len=lens, causal=causal)
    from attnlab.api import attention

    out, lse = attention(q, k, v, kv_len=lens, causal=causal, backend="triton", return_lse=True)
    delta = torch.empty(B, H, N, dtype=torch.float32, device="cuda")
    lse2 = torch.empty_like(delta)
    tb._launch_preprocess(prob, out, lse, dout, delta, lse2, False)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    kv_space, q_space = tb.dkdv_candidates(torch.bfloat16, 128), tb.dq_candidates(torch.bfloat16, 128)
    tb._launch_dkdv(prob, dout, delta, lse2, dk, dv, kv_space[0], False)
    tb._launch_dq(prob, dout, delta, lse2, dq, q_space[0], False)
    ref_k, ref_v, ref_q = dk.clone(), dv.clone(), dq.clone()
    tag = f"B{B} H{H} N{N}{' kvlen' if kv_len else ''}{' causal' if causal else ''}"
    for cfg in dict.fromkeys(kv_space + BWD_EXTRA_DKDV):  # the extras not already candidates
        try:
            ms = do_bench(lambda cfg=cfg: tb._launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg, False),
                          return_mode="median")
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in ((dk, ref_k), (dv, ref_v)))
            print(f"bwd {tag} dkdv {cfg}: {ms:.3f} ms err {err:.1e}", flush=True)
        except Exception as e:
            print(f"bwd {tag} dkdv {cfg}: {type(e).__name__}", flush=True)
    for cfg in dict.fromkeys(q_space + BWD_EXTRA_DQ):
        try:
            ms = do_bench(lambda cfg=cfg: tb._launch_dq(prob, dout, delta, lse2, dq, cfg, False), return_mode="median")
            err = ((dq.float() - ref_q.float()).abs().max() / ref_q.float().abs().max()).item()
            print(f"bwd {tag} dq   {cfg}: {ms:.3f} ms err {err:.1e}", flush=True)
        except Exception as e:
            print(f"bwd {tag} dq   {cfg}: {type(e).__name__}", flush=True)


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for B, Hkv, Nk, kv in ((8, 32, 8192, False), (16, 32, 16384, True), (1, 32, 131072, False),
                           (8, 8, 32768, False), (1, 8, 131072, False)):
        decode_splits(B, Hkv, Nk, kv)
    for B, Hkv, Nk in ((1, 8, 32768), (8, 8, 8192), (8, 32, 8192)):
        paged_configs(B, Hkv, Nk)
    backward_configs(8, 16, 4096, True, False)
    backward_configs(4, 16, 4096, False, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
