"""Measure this GPU's roofs, for the notebooks' rooflines: the bf16 dense matmul peak, an FP32 FMA roof (what
the CUDA-core float32 kernels can reach), the IEEE float32 matmul rate, and the HBM read-only and copy rates.

Writes ``data/bench/<gpu>/roofs.json`` (or the path given) with the environment. One GPU, about 20 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import triton
import triton.language as tl

from attnlab.bench.results import gpu_slug


def best_us(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3)
    return best


@triton.jit
def _fma_kernel(X, Y, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
    """Four independent chains of a = a * b + c per element, in registers: 8 * N_ITER FLOP per element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    b, c = x * 0.5 + 0.25, x * 0.125
    a0, a1, a2, a3 = x, x + 1.0, x + 2.0, x + 3.0
    for _ in range(N_ITER):
        a0 = a0 * b + c
        a1 = a1 * b + c
        a2 = a2 * b + c
        a3 = a3 * b + c
    tl.store(Y + offs, a0 + a1 + a2 + a3)


def main() -> int:
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict = {}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out["bf16_matmul_tflops"] = max(2 * n**3 / best_us(lambda: a @ b) / 1e6 for _ in range(3))
    a32, b32 = a.float(), b.float()
    out["fp32_matmul_tflops"] = 2 * n**3 / best_us(lambda: a32 @ b32, reps=5) / 1e6
    block, n_iter = 1024, 4096
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    elems = sms * 64 * block
    x = torch.rand(elems, device="cuda")
    y = torch.empty_like(x)
    us = best_us(lambda: _fma_kernel[(elems // block,)](x, y, N_ITER=n_iter, BLOCK=block, num_warps=8), reps=5)
    out["fp32_fma_tflops"] = 8 * n_iter * elems / us / 1e6
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").view(torch.float32)  # 2 GiB
    big.uniform_()
    dst = torch.empty_like(big)
    nbytes = big.numel() * 4
    out["read_tbps"] = nbytes / best_us(lambda: big.sum(), reps=10) / 1e6
    out["copy_tbps"] = 2 * nbytes / best_us(lambda: dst.copy_(big), reps=10) / 1e6
    out = {k: round(v, 1) if "tflops" in k else round(v, 2) for k, v in out.items()}
    commit = os.environ.get("ATTNLAB_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"gpu": name, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": commit or None,
           "how": "best of repeated runs (CUDA events): bf16 and fp32 (TF32 off) 8192^3 matmul; four chains of "
                  "fp32 FMA in registers (Triton); sum of a 2 GiB float32 tensor (read); copy_ of it (read + write)"}
    folder = Path("data/bench") / gpu_slug(name)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else folder / "roofs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"roofs": out, "environment": env}, indent=1) + "\n")
    print(json.dumps(out), "->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
