"""Check the Triton backward on a CUDA GPU and time it beside sdpa-flash's backward, in one call.

1. Correctness: the GPU tests of tests/test_triton_bwd.py (marker ``gpu``: the CPU matrix at 8x the lengths
   and a larger GQA causal case per dtype and head dim), in four parallel pytest processes, with each
   kernel's first (default) config (autotuning off: fewer compilations).
2. Speed (bf16, D128): backward alone, through :func:`attnlab.backends.triton.backward.backward` (preprocess, dK/dV and
   dQ, autotuned once), against sdpa-flash's backward (``torch.autograd.grad`` of an output made under
   ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), medians of ``triton.testing.do_bench``. Backward FLOPs
   are 2.5x the forward's ``4 * B * H * N * N * D`` (causal halves). Each config of both kernels is timed
   too. Usage: ``PYTHONPATH=. python3 scripts/bwd_gpu_check.py [--skip-tests] [--skip-bench]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

os.environ.setdefault("ATTNLAB_AUTOTUNE", "0")  # the forward only makes out and lse here

import torch
import triton
from triton.testing import do_bench

from attnlab.api import attention
from attnlab.backends.triton import backward as triton_bwd
from attnlab.problem import make_problem

SHARDS = ["float32 and not large", "float16 and not bfloat16 and not large", "bfloat16 and not large", "large"]


def run_tests(timeout: int) -> bool:
    env = dict(os.environ, ATTNLAB_AUTOTUNE="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_triton_bwd.py"]
    procs = [subprocess.Popen([*cmd, "-k", k], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in SHARDS]
    ok = True
    for k, p in zip(SHARDS, procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\nTIMEOUT"
        ok = ok and p.returncode == 0
        lines = out.strip().splitlines()
        fails = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        print(f"[tests -k '{k}'] rc={p.returncode}: {lines[-1] if lines else ''}")
        for ln in fails[:20]:
            print("   ", ln[:300])
        if p.returncode not in (0, None) and not fails:
            print("\n".join(lines[-30:]))
    return ok


def tflops(B: int, H: int, N: int, D: int, causal: bool, ms: float) -> float:
    flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def bench_case(B: int, H: int, N: int, D: int, causal: bool, per_config: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    prob = make_problem(q, k, v, causal=causal)
    out, lse = attention(q, k, v, causal=causal, backend="triton", return_lse=True)
    t0 = time.perf_counter()
    dq, dk, dv = triton_bwd.backward(prob, out, lse, dout)  # the first call tunes
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - t0
    ms = do_bench(lambda: triton_bwd.backward(prob, out, lse, dout), warmup=10, rep=50, return_mode="median")

    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        ms_fa = do_bench(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), warmup=10, rep=50,
                         return_mode="median")
        ref = torch.autograd.grad(o, leaves, dout, retain_graph=True)
    diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip((dq, dk, dv), ref)]
    tag = f"B{B} H{H} N{N} D{D} bf16 {'causal' if causal else 'dense '}"
    print(f"{tag}: triton bwd {ms:.3f} ms {tflops(B, H, N, D, causal, ms):6.1f} TFLOP/s | sdpa-flash bwd "
          f"{ms_fa:.3f} ms {tflops(B, H, N, D, causal, ms_fa):6.1f} TFLOP/s | ratio {ms_fa / ms:.3f}x | "
          f"tuned {triton_bwd._tuned.get(triton_bwd.tune_key(prob))} in {tune_s:.1f} s | "
          f"max|d - d_fa|/max|d_fa| dq {diffs[0]:.1e} dk {diffs[1]:.1e} dv {diffs[2]:.1e}")
    if not per_config:
        return
    delta = torch.empty(B, H, N, dtype=torch.float32, device="cuda")
    lse2 = torch.empty_like(delta)
    triton_bwd._launch_preprocess(prob, out, lse, dout, delta, lse2, False)
    ms_pre = do_bench(lambda: triton_bwd._launch_preprocess(prob, out, lse, dout, delta, lse2, False),
                      return_mode="median")
    print(f"    preprocess {ms_pre:.3f} ms")
    block_d = triton_bwd.padded_head_dim(D)
    for cfg in triton_bwd.dkdv_candidates(torch.bfloat16, block_d):
        try:
            t = do_bench(lambda cfg=cfg: triton_bwd._launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg, False),
                         return_mode="median")
            print(f"    dkdv {cfg}: {t:.3f} ms")
        except Exception as e:
            print(f"    dkdv {cfg}: {type(e).__name__}")
    for cfg in triton_bwd.dq_candidates(torch.bfloat16, block_d):
        try:
            t = do_bench(lambda cfg=cfg: triton_bwd._launch_dq(prob, dout, delta, lse2, dq, cfg, False),
                         return_mode="median")
            print(f"    dq   {cfg}: {t:.3f} ms")
        except Exception as e:
            print(f"    dq   {cfg}: {type(e).__name__}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=180)
    args = ap.parse_args()
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"triton {triton.__version__}")
    ok = True
    if not args.skip_tests:
        t0 = time.perf_counter()
        ok = run_tests(args.test_timeout)
        print(f"tests: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.0f} s")
    if not args.skip_bench:
        for causal in (False, True):
            bench_case(4, 16, 4096, 128, causal, per_config=True)
        for causal in (False, True):
            bench_case(1, 16, 16384, 128, causal, per_config=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
