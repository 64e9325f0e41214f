"""Small cases of each CUDA kernel for compute-sanitizer (memcheck, racecheck); syncs after each launch.

naive, tiled, rowmax (cp.async and element loads, with and without split keys + merge), fp32 and bf16,
GQA, masks, bottom-right causal with lengths, strided views, D 40/64/128/256. Run on a GPU from the
repository root (a script, not a test):

    PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 3 python3 tools/sanitize_cuda.py
    PYTHONPATH=. compute-sanitizer --tool racecheck --error-exitcode 3 python3 tools/sanitize_cuda.py
"""

import sys

import torch

import attnlab
from attnlab.backends import cuda as C

C.set_debug_sync(True)
torch.manual_seed(0)
dev = "cuda"
for D in (64, 128, 256):
    for dt in (torch.float32, torch.bfloat16):
        qf = torch.randn(1, 2, 130, D, device=dev, dtype=dt)
        kf = torch.randn(1, 2, 300, D, device=dev, dtype=dt)
        o1, l1 = attnlab.attention(qf, kf, kf, causal=True, align="bottom_right", backend="cuda-rowmax",
                                   return_lse=True)
        with C.rowmax_splits(3):
            o2, l2 = attnlab.attention(qf, kf, kf, kv_len=[170], backend="cuda-rowmax", return_lse=True)
        if dt == torch.float32 and D == 64:
            with C.rowmax_async_copy(False):
                attnlab.attention(qf, kf, kf, window=(40, 3), align="top_left", backend="cuda-rowmax")
        torch.cuda.synchronize()
        print("rowmax D", D, dt, "ok", float(o1.float().abs().sum()), float(o2.float().abs().sum()), flush=True)
for family in ("rowmax", "tiled", "naive"):
    be = f"cuda-{family}"
    for dt in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 70, 4, 40, device=dev, dtype=dt)
        k = torch.randn(2, 90, 2, 40, device=dev, dtype=dt)
        mask = torch.rand(2, 1, 70, 90, device=dev) < 0.8
        out, lse = attnlab.attention(q, k, k, causal=True, align="bottom_right", kv_len=[90, 33], q_len=[70, 50],
                                     mask=mask, layout="bnhd", backend=be, return_lse=True)
        qf = torch.randn(1, 2, 100, 64, device=dev, dtype=dt)
        out2 = attnlab.attention(qf, qf, qf, causal=True, backend=be)
        torch.cuda.synchronize()
        print(family, dt, "ok", float(out.float().abs().sum()), float(out2.float().abs().sum()), flush=True)
sys.exit(0)
