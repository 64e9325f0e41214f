"""A guard against a torch bug that silently loses precision in CPU math (pytorch/pytorch#188792).

ATen runs contiguous float unary ops (exp, log, sqrt, ...) on CPU through oneMKL's VML, one chunk per
intra-op thread. oneMKL (2024.2, bundled with current torch wheels) picks each VML function's kernel on its
first call; when that first call runs on several threads at once, one thread's chunk may come from a
low-accuracy kernel. Seen here: in about one fresh process in seven, ``torch.exp`` of 3200 float64 values
was off by up to 3e-9 relative in the second thread's half, which moved the float64 reference by 5e-10 (and
flipped a notebook's "< 1e-12" check). Calling each function once on one element, on this thread, settles
the choice before any parallel call; steady-state results are unchanged. Done once, on import of attnlab.
"""

from __future__ import annotations

import functools

import torch

#: The unary ops attnlab's CPU math uses that ATen hands to VML.
OPS = (torch.exp, torch.exp2, torch.log, torch.log2, torch.sqrt)


@functools.cache
def settle_vml_dispatch() -> None:
    """Call every op of :data:`OPS` once on a one-element float32 and float64 tensor (single-threaded)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.ones(1, dtype=dtype)
        for op in OPS:
            op(x)
