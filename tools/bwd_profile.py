"""The backward's kernels under ncu: one warmed-up backward alone of attnlab's public ``triton`` call and one of
cuDNN's through SDPA (B4 H16 N4096 D128 bf16, causal), alone in the profiled region in that order. On a GPU, from
the repository root:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section ComputeWorkloadAnalysis --metrics regex:sm__pipe_tensor_op_[gh]mma_cycles_active.avg.pct.* \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        --csv --page details python tools/bwd_profile.py > OUT.csv

The timed call is ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``, as the backward suite's.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ours = attnlab.attention(q, k, v, causal=True, backend="triton")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(3):
        for out in (ours, theirs):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for out in (ours, theirs):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
