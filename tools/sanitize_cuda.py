"""Small cases of each CUDA kernel for compute-sanitizer (memcheck, racecheck); syncs after each launch.

naive, tiled, rowmax (cp.async and element loads, with and without split keys + merge), fp32 and bf16,
GQA, masks, bottom-right causal with lengths, strided views, D 40/64/128/256; mma (cp.async and element
loads, fp16 and bf16, D 33/40/64/100/128, GQA, masks, lengths, windows, a strided layout). Run on a GPU from the
repository root (a script, not a test); ``mma`` as an argument runs the mma cases only:

    PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 3 python3 tools/sanitize_cuda.py [mma]
    PYTHONPATH=. compute-sanitizer --tool racecheck --error-exitcode 3 python3 tools/sanitize_cuda.py [mma]
"""

import sys

import torch

import attnlab
from attnlab.backends import cuda as C

C.set_debug_sync(True)
torch.manual_seed(0)
dev = "cuda"


def mma_cases() -> None:
    """The tensor-core kernel: both load paths, both 16-bit dtypes, the head-dim buckets and padding."""
    for D in (33, 40, 64, 100, 128):  # 33: the output goes through the staging buffer (odd D)
        for dt in (torch.float16, torch.bfloat16):
            q = torch.randn(2, 4, 130, D, device=dev, dtype=dt)
            k = torch.randn(2, 2, 300, D, device=dev, dtype=dt)
            o1, _ = attnlab.attention(q, k, k, causal=True, align="bottom_right", kv_len=[300, 77], backend="cuda-mma",
                                      return_lse=True)
            mask = torch.rand(2, 1, 130, 300, device=dev) < 0.7
            o2 = attnlab.attention(q, k, k, mask=mask, window=(50, 10), align="bottom_right", q_len=[130, 64],
                                   backend="cuda-mma")
            with C.rowmax_async_copy(False):
                o3 = attnlab.attention(q, k, k, causal=True, align="bottom_right", backend="cuda-mma")
            qb, kb = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            o4 = attnlab.attention(qb, kb, kb, layout="bnhd", causal=True, align="top_left", backend="cuda-mma")
            with C.mma_wide(False):  # on sm_90 the calls above without a mask run the wide kernel; here its own tiles
                o5 = attnlab.attention(q, k, k, causal=True, align="bottom_right", kv_len=[300, 77],
                                       backend="cuda-mma")
            torch.cuda.synchronize()
            sums = [float(o.float().abs().sum()) for o in (o1, o2, o3, o4, o5)]
            print("mma D", D, dt, "ok", *sums, flush=True)


if sys.argv[1:] == ["mma"]:
    mma_cases()
    sys.exit(0)
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
mma_cases()
sys.exit(0)
