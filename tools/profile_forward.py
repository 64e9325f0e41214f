"""One forward of attnlab's ``triton`` backend and one of SDPA's cuDNN kernel, for Nsight Compute to profile.

Both are run (compiled, planned) before the profiler starts; the profiled region holds exactly one call of each,
so ``ncu --profile-from-start off`` sees one attnlab kernel and cuDNN's kernel(s). Usage on the GPU:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --csv --page details python tools/profile_forward.py [causal]
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab


def main(causal: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def ours():
        return attnlab.attention(q, k, v, causal=causal, backend="triton")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for _ in range(3):
        ours(), cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main("causal" in sys.argv[1:])
