"""Backends ``cuda-naive``, ``cuda-tiled``, ``cuda-rowmax``, ``cuda-mma``: the CUDA C kernels of ``kernels/``,
compiled at run time with NVRTC through CuPy (:mod:`attnlab.backends.cuda.launch`)."""

from __future__ import annotations

import torch

from attnlab.backends import Availability, Backend, cuda_device_reason, no_cuda_reason
from attnlab.backends.cuda.launch import fast_call, run, variant_for
from attnlab.backends.cuda.variant import DMAX_BUCKETS, DTYPE_CODES, FAMILY_DTYPES, GRID_LIMITS
from attnlab.problem import Problem


class _CudaBackend(Backend):
    takes = ("CUDA tensors, float32/float16/bfloat16 (computed in float32), D 1-256 with Dv = D, every mask, no "
             "score modifiers; "
             "packed sequences padded")

    family = ""
    kernel_backward = True  # differentiated by the Triton backward kernels (attnlab.backends.triton.backward)

    def availability(self) -> Availability:
        why = no_cuda_reason()
        try:
            import cupy  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA install
            fix = ("CuPy is not installed: pip install 'attnlab[cuda12]' or 'attnlab[cuda13]' (CuPy for your CUDA "
                   "major version)" if isinstance(e, ModuleNotFoundError) else
                   f"CuPy does not import ({type(e).__name__}: {e})")
            return Availability(False, fix if why is None else f"{why}; and {fix}")
        return Availability(True) if why is None else Availability(False, why)

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, paged=None, append=None):
        """The launch of a later call of ``prob``'s signature with its own pointers (dense calls without lengths
        or masks: :func:`attnlab.backends.cuda.launch.fast_call`), or None."""
        return None if paged is not None or append is not None else fast_call(self.family, prob, out, lse)

    def unsupported(self, prob: Problem) -> str | None:
        why = cuda_device_reason(prob)
        if why is not None:
            return why
        if prob.dtype not in DTYPE_CODES:
            return f"dtype {prob.dtype} (the CUDA kernels take float32, float16, bfloat16)"
        if prob.Dv != prob.D:
            return f"the CUDA kernels take one head dim for q, k and v; got D={prob.D}, Dv={prob.Dv}"
        if prob.mods.any:
            return "the CUDA C kernels take no score modifiers (softcap, ALiBi slopes, sinks); the triton backend does"
        if prob.B * prob.Hq > GRID_LIMITS[1] and self.family == "naive":
            return f"B*Hq = {prob.B * prob.Hq} exceeds the grid limit {GRID_LIMITS[1]} of the naive kernel"
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        run(self.family, prob, out, lse)

    def kernel_label(self, prob: Problem) -> str:
        """The compiled variant that computes ``prob`` (e.g. ``mma_bf16_d64_fastexp_wide``)."""
        return variant_for(self.family, prob).label


class CudaNaiveBackend(_CudaBackend):
    name = "cuda-naive"
    family = "naive"
    description = "three-pass CUDA kernel: max, sum of exp, weighted sum (one block per (bh, query))"


class CudaTiledBackend(_CudaBackend):
    name = "cuda-tiled"
    family = "tiled"
    description = "tiled CUDA kernel: Q tile in shared memory, K/V tiles streamed, online softmax per element"


class CudaRowmaxBackend(_CudaBackend):
    name = "cuda-rowmax"
    family = "rowmax"
    description = "tiled CUDA kernel with block-wise rowmax (one exp per score) and register micro-tiles"


class CudaMmaBackend(_CudaBackend):
    name = "cuda-mma"
    family = "mma"
    description = ("tensor-core CUDA kernel: mma.sync on 16-bit tiles staged by cp.async and read by ldmatrix, "
                   "online softmax on the accumulator fragments")
    takes = ("CUDA tensors of sm_80 or newer, float16/bfloat16 (float32 accumulators), D 1-128 with Dv = D, every "
             "mask, no score modifiers; packed sequences padded")

    def unsupported(self, prob: Problem) -> str | None:
        why = super().unsupported(prob)
        if why is not None:
            return why
        if DTYPE_CODES[prob.dtype] not in FAMILY_DTYPES[self.family]:
            return (f"dtype {prob.dtype}: the tensor-core kernel takes float16 or bfloat16 (the MMA's 16-bit inputs); "
                    "float32 runs on cuda-rowmax or triton")
        if prob.D > DMAX_BUCKETS[self.family][-1]:
            return f"head dim D = {prob.D}: the tensor-core kernel takes D up to {DMAX_BUCKETS[self.family][-1]}"
        major, _ = torch.cuda.get_device_capability(prob.device)
        if major < 8:
            return f"compute capability {major}.x: the tensor-core kernel needs sm_80 or newer (cp.async, ldmatrix)"
        return None
