"""Backends ``triton`` (the fused Triton forward kernel; :mod:`~attnlab.backends.triton.forward_kernel` explains it) and
``triton-decode`` (the split-KV path for a few query rows)."""

from __future__ import annotations

import torch

from attnlab import warm_start
from attnlab.backends import Availability, Backend
from attnlab.backends.triton import configs as _cfg
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.backends.triton import runtime as _rt
from attnlab.backends.triton.decode import decode_forward, decode_supported, gpu_plan
from attnlab.backends.triton.forward import autotune, jit_launch, plan_for
from attnlab.backends.triton.forward_kernel import IMPORT_ERROR
from attnlab.problem import Problem


class TritonBackend(Backend):
    """attnlab's fused Triton forward kernel (:mod:`attnlab.backends.triton.forward_kernel` explains it)."""

    name = "triton"
    takes = ("float32/float16/bfloat16, D and Dv 1-256, every mask, softcap, ALiBi slopes, sinks, packed "
             "sequences natively; CUDA tensors compiled (on sm_90 Hopper kernels: the forward for "
             "float16/bfloat16, D = Dv of 64 or 128, no kv_len, explicit mask, bias, sinks, packing or narrow "
             "two-sided band; the backward for D = Dv of 64 or 128 (64 on full rows with GQA only), dense or "
             "causal, ALiBi), CPU tensors interpreted; float8_e4m3fn forward (compute capability 8.9+), without "
             "gradients")
    takes_fp8 = True
    kernel_backward = True  # differentiated by the Triton backward kernels (attnlab.backends.triton.backward)
    description = (
        "fused Triton forward kernel: online softmax in exp2, block skipping, every mask, GQA; "
        "CPU tensors run through Triton's interpreter"
    )

    def availability(self) -> Availability:
        if IMPORT_ERROR is not None:
            return Availability(False, IMPORT_ERROR)
        return Availability(True)

    def unsupported(self, prob: Problem) -> str | None:
        if IMPORT_ERROR is not None:
            return IMPORT_ERROR
        if prob.device.type not in ("cuda", "cpu"):
            return f"runs on CUDA tensors (compiled) or CPU tensors (interpreter); got {prob.device}"
        if (prob.packed is None and prob.B > 65535) or prob.Hq > 65535:  # packed sequences share the first axis
            return f"grid limit: B (unpacked) and Hq must be at most 65535; got B={prob.B}, Hq={prob.Hq}"
        if prob.device.type == "cuda" and prob.dtype == torch.bfloat16:
            major, _ = _rt.capability(_rt.device_index(prob.device))
            if major < 8:
                return "bfloat16 needs compute capability 8.0 or newer"
        if prob.device.type == "cuda" and prob.descale is not None:
            if _rt.capability(_rt.device_index(prob.device)) < (8, 9):
                return "float8_e4m3fn needs compute capability 8.9 or newer (Ada, Hopper): its MMA takes 8-bit floats"
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        if not prob.q.is_cuda:
            if not _empty(prob, out, lse):
                jit_launch(prob, out, lse, _cfg.INTERPRETER_CONFIG, interpret=True)
            return
        if prob.packed is not None:  # through the JIT: no forward plan takes prefix sums
            _on_device(prob, out, lse, lambda: jit_launch(prob, out, lse, _cfg.config_for(prob, out, lse, autotune),
                                                          interpret=False))
            return
        _on_device(prob, out, lse, lambda: hopper.forward(prob, out, lse)
                   or plan_for(prob, out, lse).launch(prob, out, lse))

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, paged=None, append=None):
        if (append is not None or not prob.q.is_cuda or paged is not None or prob.packed is not None
                or prob.Dv != prob.D or prob.descale is not None or _empty_problem(prob, out)):
            return None  # (a fast call allocates out like q; an FP8 call packs its descales per call; an empty
            # call launched nothing: no plan to build or tune for it)
        if hopper.unsupported(prob, out) is None and not hopper.failed(prob, lse):  # sm_90: once it is compiled
            return hopper.fast_call(prob, out, lse)
        return plan_for(prob, out, lse).fast_call(prob, out, lse)


class TritonDecodeBackend(TritonBackend):
    """The split-KV decode path for a few query rows (:mod:`attnlab.backends.triton.decode`): the keys of each
    (batch, kv head) split over several programs, the query heads of a kv group packed into one tile."""

    name = "triton-decode"
    takes = ("Nq <= 16 query rows (decoding), float32/float16/bfloat16, D 1-256 with Dv = D, every mask, paged "
             "caches, softcap, ALiBi slopes, sinks; packed sequences padded")
    description = (
        "split-KV Triton decode for Nq <= 16: keys split over programs, GQA groups packed, partial states "
        "merged by their lse"
    )
    reads_paged = True
    fuses_append = True
    takes_fp8 = False

    def unsupported(self, prob: Problem) -> str | None:
        return decode_supported(prob)

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        _on_device(prob, out, lse, lambda: decode_forward(prob, out, lse))

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, paged=None, append=None):
        if not prob.q.is_cuda or _empty_problem(prob, out):
            return None
        return gpu_plan(prob, paged=paged, append=append).fast_call(prob, out, lse)

    def forward_paged(self, prob: Problem, paged, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        _on_device(prob, out, lse, lambda: decode_forward(prob, out, lse, paged=paged))  # validated by the caller

    def forward_append(self, prob: Problem, paged, out: torch.Tensor, lse: torch.Tensor | None, append) -> None:
        if _empty_problem(prob, out):  # nothing to attend: the append is still written
            append.write()
        _on_device(prob, out, lse, lambda: decode_forward(prob, out, lse, paged=paged, append=append))


def _empty_problem(prob: Problem, out: torch.Tensor) -> bool:
    """Nothing to launch: no output element, or no key."""
    return not out.numel() or not prob.Nk


def _empty(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> bool:
    """Write an empty problem's answer (out 0, lse -inf or the sinks) and say so; False when there is work to
    launch."""
    if not _empty_problem(prob, out):
        return False
    out.zero_()
    if lse is not None:
        lse.copy_(prob.mods.empty_lse(lse))
    return True


def _on_device(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, launch) -> None:
    """Run ``launch`` unless the problem is empty, with q's GPU current (CPU tensors: as they are)."""
    if _empty(prob, out, lse):
        return
    if prob.q.is_cuda:
        warm_start.wait()
    if prob.q.is_cuda and torch.cuda.current_device() != prob.q.get_device():
        with torch.cuda.device(prob.q.device):
            launch()
    else:
        launch()
