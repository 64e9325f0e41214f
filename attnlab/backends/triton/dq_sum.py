"""Where the one-pass backward (``ATTNLAB_BWD_DQ=atomic``) adds dQ up: a float32 accumulator, zeroed, and how
the dK/dV kernel reaches it.

Each dK/dV program adds ``scale * dS K`` of every row tile it visits into the rows' dQ. Elementwise atomic adds
cost one instruction and one trip to L2 per element and key tile, issued by the threads that should be running
the products. On sm_90 and later the copy engine (TMA) takes a whole tile as one bulk reduction
(``cp.reduce.async.bulk.tensor``) through a tensor descriptor over the accumulator: the threads stage the tile in
shared memory and go on. The descriptor needs the accumulator's rows 16-byte aligned, so with it the accumulator
is contiguous ``[B * Hq, rows, D]`` and ``D`` a multiple of 4; elsewhere it is laid out like dq and the kernel
adds through pointers. Either way the sum's order varies from run to run.
"""

from __future__ import annotations

import functools
import os

import torch

from attnlab.problem import Problem

#: Whether a GPU that has TMA takes dQ's tiles by bulk reductions (``ATTNLAB_BWD_DQ_TMA=0``: elementwise atomics).
TMA: bool = os.environ.get("ATTNLAB_BWD_DQ_TMA", "1") != "0"


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def _descriptors_reduce() -> bool:
    """Whether the installed triton has host tensor descriptors and their bulk ``atomic_add``."""
    try:
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(getattr(tl, "tensor_descriptor", object), "atomic_add")


def uses_tma(prob: Problem) -> bool:
    """Whether ``prob``'s one-pass backward adds dQ by bulk reductions (a CUDA GPU of sm_90 or later, D a multiple
    of 4, :data:`TMA` on)."""
    return (TMA and prob.q.is_cuda and prob.D % 4 == 0 and _descriptors_reduce()
            and _has_tma(prob.q.get_device()))


def accumulator(prob: Problem, dq: torch.Tensor) -> torch.Tensor:
    """The zeroed float32 dQ that the dK/dV pass adds into: contiguous with TMA, else laid out like ``dq``."""
    if uses_tma(prob):
        return torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
    return torch.zeros_like(dq, dtype=torch.float32)


def argument(acc: torch.Tensor, block_m: int, block_d: int, tma: bool):
    """What the dK/dV kernel's ``DQ`` parameter gets: with ``tma`` a descriptor over ``acc`` seen as
    ``[B * Hq, rows, D]`` whose block is one row tile of one head (``[1, block_m, block_d]``: a tile past the rows
    or past D is clipped by the copy engine), else ``acc`` itself."""
    if not tma:
        return acc
    from triton.tools.tensor_descriptor import TensorDescriptor

    heads_rows = acc.view(-1, acc.shape[-2], acc.shape[-1])
    return TensorDescriptor(heads_rows, list(heads_rows.shape), list(heads_rows.stride()), [1, block_m, block_d])
