"""The Triton backward of attention: dq, dk, dv of one validated :class:`~attnlab.problem.Problem`.

:func:`backward` takes what the forward saved (out and its lse) and the upstream gradient dout, and runs
three kernels (:mod:`attnlab.backends.triton.backward_kernels` explains the math, the tiling and the program mapping):
a preprocess (Delta = rowsum(dO * O), the base-2 lse), dK/dV with a key tile stationary (GQA/MQA groups
summed in registers, no atomics), and dQ in its own pass (deterministic, no atomics). The whole contract is
supported: causal and windows in both alignments, kv_len and q_len, bool masks and additive biases (a
constant: it gets no gradient), GQA/MQA, any strides, float32 / float16 / bfloat16, D from 1 to 256.

On CUDA tensors the kernels are compiled, each with a small config space per dtype and padded head dim
(:func:`dkdv_candidates`, :func:`dq_candidates`); with ``AUTOTUNE`` each kernel's candidates are timed
once per :func:`tune_key` and the fastest kept (on disk too, :mod:`~attnlab.backends.triton.tune_cache`),
else the first is used. On CPU tensors the same kernels run
through Triton's interpreter with one small config, inside :func:`attnlab.backends.triton.interpreter.interpreter`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch

from attnlab.backends.triton import tune_cache
from attnlab.backends.triton.configs import _block_d, _pow2_bucket, fastest
from attnlab.backends.triton.interpreter import _interpreted_fn, interpreter
from attnlab.backends.triton.kernel import LOG2E
from attnlab.problem import Problem

try:
    import triton

    from attnlab.backends.triton.backward_kernels import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess
except ImportError:  # the caller finds out when it calls backward()
    triton = None


@dataclass(frozen=True)
class BwdConfig:
    """Launch configuration of one backward kernel: BLOCK_M query rows by BLOCK_N keys, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


#: The interpreter's configs: small tiles, so that the CPU tests' short sequences span several tiles of
#: both kinds (partial and full) in both passes.
INTERPRETER_CONFIG = BwdConfig(16, 16, 1, 1)
#: Rows per program of the preprocess (GPU; the interpreter uses INTERPRETER_CONFIG.block_m).
PREPROCESS_BLOCK_M = 64

#: Whether GPU launches autotune (ATTNLAB_TRITON_BWD_AUTOTUNE=0: always the first candidate).
AUTOTUNE: bool = os.environ.get("ATTNLAB_TRITON_BWD_AUTOTUNE", "1") != "0"
_tuned: dict[tuple, tuple[BwdConfig, BwdConfig]] = {}


def dkdv_candidates(dtype: torch.dtype, block_d: int) -> list[BwdConfig]:
    """GPU configs of the dK/dV kernel (the first is the default): a large key tile (stationary: K, V
    and two float32 accumulators live for the whole program) and a smaller query tile that streams."""
    if dtype == torch.float32:  # IEEE products on the FMA units: small tiles, registers are the limit
        if block_d <= 64:
            return [BwdConfig(32, 64, 4, 2), BwdConfig(32, 32, 4, 2), BwdConfig(16, 64, 4, 2)]
        if block_d <= 128:
            return [BwdConfig(16, 32, 4, 2), BwdConfig(32, 32, 8, 2)]
        return [BwdConfig(16, 16, 4, 1), BwdConfig(16, 32, 8, 1)]
    # H200, bf16 D128 (data/gpu_tests/nvidia-h200-tune-sweep-189ca35.txt), ms for B8 H16 N4096 with ragged
    # kv_len (B4 H16 N4096 causal): (64, 128, 8, 3) 2.27 (1.16), (64, 128, 8, 2) 2.68 (1.24), (32, 128, 8, 3)
    # 2.68 (1.35), (32, 64, 4, 2) 2.82 (1.26), (32, 128, 8, 2) 3.52 (1.54), (64, 64, 8, 2) 4.97 (2.22); four
    # warps with 128-key tiles (the Triton tutorial's choice) 7.2 and more. The third stage hides the
    # streaming Q and dO loads behind the five dots.
    if block_d <= 64:
        return [BwdConfig(64, 128, 8, 3), BwdConfig(64, 64, 4, 3), BwdConfig(32, 128, 4, 3),
                BwdConfig(64, 128, 8, 2)]
    if block_d <= 128:
        return [BwdConfig(64, 128, 8, 3), BwdConfig(64, 128, 8, 2), BwdConfig(32, 64, 4, 2), BwdConfig(32, 128, 8, 3)]
    return [BwdConfig(32, 64, 8, 1), BwdConfig(32, 32, 4, 1), BwdConfig(16, 64, 4, 1)]


def dq_candidates(dtype: torch.dtype, block_d: int) -> list[BwdConfig]:
    """GPU configs of the dQ kernel (the first is the default): a large row tile (stationary: Q, dO and
    the dQ accumulator), key tiles streaming."""
    if dtype == torch.float32:
        if block_d <= 64:
            return [BwdConfig(64, 32, 4, 2), BwdConfig(32, 32, 4, 2), BwdConfig(64, 16, 4, 2)]
        if block_d <= 128:
            return [BwdConfig(32, 16, 4, 2), BwdConfig(32, 32, 8, 2)]
        return [BwdConfig(16, 16, 4, 1), BwdConfig(32, 16, 8, 1)]
    if block_d <= 64:
        return [BwdConfig(128, 64, 8, 3), BwdConfig(128, 32, 4, 3), BwdConfig(64, 64, 4, 3)]
    if block_d <= 128:
        # H200, bf16 D128 (the same sweep), ms for the ragged kv_len case (causal): (128, 64, 8, 3) 1.54
        # (0.78), (64, 64, 4, 2) 1.55 (0.83), (128, 32, 8, 2) 1.58 (0.84), (64, 32, 4, 3) 1.66 (0.85),
        # (128, 64, 8, 2) 1.77 (0.95).
        return [BwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 4, 2), BwdConfig(128, 32, 8, 2), BwdConfig(64, 32, 4, 3)]
    return [BwdConfig(64, 32, 8, 1), BwdConfig(64, 16, 4, 1), BwdConfig(32, 32, 4, 1)]


def tune_key(prob: Problem) -> tuple:
    """What a tuned pair of configs is remembered by: device, dtype, head dim, mask kind, GQA group and
    size buckets."""
    return (prob.device.index, prob.dtype, _block_d(prob.D), prob.spec.kind, prob.group,
            _pow2_bucket(prob.Nq), _pow2_bucket(prob.Nk), _pow2_bucket(prob.B * prob.Hq))


# ---------------------------------------------------------------------------------------------------
# Arguments and launches
# ---------------------------------------------------------------------------------------------------
def _mask_arguments(prob: Problem) -> tuple[list, list, dict]:
    """(pointers KvLen, QLen, Explicit; the explicit mask's strides; the mask constants) for the kernels."""
    spec = prob.spec
    explicit = spec.explicit
    if explicit is not None and explicit.dtype == torch.bool:
        explicit = explicit.view(torch.uint8)  # the kernels read a bool mask as bytes
    q = prob.q  # a placeholder pointer for whatever is absent (never read)
    ptrs = [spec.kv_len if spec.kv_len is not None else q, spec.q_len if spec.q_len is not None else q,
            explicit if explicit is not None else q]
    strides = list(explicit.stride()) if explicit is not None else [0, 0, 0, 0]
    constants = dict(
        HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
        BOTTOM_RIGHT=spec.align == "bottom_right",
        HAS_KV_LEN=spec.kv_len is not None, HAS_Q_LEN=spec.q_len is not None,
        HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
    )
    return ptrs, strides, constants


def _common(prob: Problem, interpret: bool) -> dict:
    """Compile-time constants shared by the dK/dV and dQ kernels."""
    block_d = _block_d(prob.D)
    return dict(
        BLOCK_D=block_d, EVEN_D=block_d == prob.D, DOT_PRECISION="ieee",
        # The interpreter multiplies bfloat16 bit patterns as integers in tl.dot: upcast (exactly) first.
        UPCAST=interpret and prob.dtype != torch.float32,
    )


def _scalars(prob: Problem) -> list:
    spec = prob.spec
    return [prob.Hq, prob.Nq, prob.Nk, prob.D, prob.group, prob.scale * LOG2E, prob.scale,
            spec.left if spec.left is not None else 0, spec.right if spec.right is not None else 0]


def _launch_preprocess(prob, out, lse, dout, delta, lse2, interpret: bool) -> None:
    block_m = INTERPRETER_CONFIG.block_m if interpret else PREPROCESS_BLOCK_M
    spec = prob.spec
    kernel = _interpreted_fn(_bwd_preprocess) if interpret else _bwd_preprocess
    grid = (triton.cdiv(prob.Nq, block_m), prob.Hq, prob.B)
    kernel[grid](
        out, dout, lse, delta, lse2, spec.q_len if spec.q_len is not None else lse,
        *out.stride(), *dout.stride(), *lse.stride(), prob.Hq, prob.Nq, prob.D,
        BLOCK_M=block_m, BLOCK_D=_block_d(prob.D), HAS_Q_LEN=spec.q_len is not None,
        num_warps=1 if interpret else 4,
    )


def _launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg: BwdConfig, interpret: bool) -> None:
    ptrs, e_strides, mask_constants = _mask_arguments(prob)
    kernel = _interpreted_fn(_bwd_dkdv_kernel) if interpret else _bwd_dkdv_kernel
    grid = (triton.cdiv(prob.Nk, cfg.block_n), prob.Hkv, prob.B)
    kernel[grid](
        prob.q, prob.k, prob.v, dout, lse2, delta, dk, dv, *ptrs,
        *prob.q.stride(), *prob.k.stride(), *prob.v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        *e_strides, *_scalars(prob),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_common(prob, interpret), **mask_constants,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_dq(prob, dout, delta, lse2, dq, cfg: BwdConfig, interpret: bool) -> None:
    ptrs, e_strides, mask_constants = _mask_arguments(prob)
    kernel = _interpreted_fn(_bwd_dq_kernel) if interpret else _bwd_dq_kernel
    grid = (triton.cdiv(prob.Nq, cfg.block_m), prob.Hq, prob.B)
    kernel[grid](
        prob.q, prob.k, prob.v, dout, lse2, delta, dq, *ptrs,
        *prob.q.stride(), *prob.k.stride(), *prob.v.stride(), *dout.stride(), *dq.stride(),
        *e_strides, *_scalars(prob),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_common(prob, interpret), **mask_constants,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _fastest(configs: list[BwdConfig], launch) -> BwdConfig:
    """The fastest of ``configs`` (see :func:`~attnlab.backends.triton.configs.fastest`)."""
    return fastest(configs, launch, "the backward")


def configs_for(prob: Problem, dout, delta, lse2, dq, dk, dv) -> tuple[BwdConfig, BwdConfig]:
    """(dK/dV config, dQ config) of a GPU launch: tuned once per :func:`tune_key`, or the defaults.
    Tuning overwrites dq, dk, dv (each launch writes every element; the final launch comes after)."""
    block_d = _block_d(prob.D)
    kv_space, q_space = dkdv_candidates(prob.dtype, block_d), dq_candidates(prob.dtype, block_d)
    if not AUTOTUNE:
        return kv_space[0], q_space[0]
    key = tune_key(prob)
    got = _tuned.get(key)
    if got is None:
        got = _stored_configs(prob, key, kv_space, q_space)
        if got is None:
            got = (
                _fastest(kv_space, lambda c: _launch_dkdv(prob, dout, delta, lse2, dk, dv, c, False)),
                _fastest(q_space, lambda c: _launch_dq(prob, dout, delta, lse2, dq, c, False)),
            )
            tune_cache.store("bwd", prob.device.index, key[1:], [dataclasses.asdict(c) for c in got])
        _tuned[key] = got
    return got


def _stored_configs(prob: Problem, key: tuple, kv_space: list[BwdConfig],
                    q_space: list[BwdConfig]) -> tuple[BwdConfig, BwdConfig] | None:
    """The (dK/dV, dQ) configs stored on disk for ``key`` (:mod:`.tune_cache`; the device index left out),
    if both are still among the candidates."""
    got = tune_cache.load("bwd", prob.device.index, key[1:])
    with contextlib.suppress(TypeError, ValueError):
        kv, q = (BwdConfig(**c) for c in got)
        return (kv, q) if kv in kv_space and q in q_space else None
    return None


# ---------------------------------------------------------------------------------------------------
# The public entry point
# ---------------------------------------------------------------------------------------------------
def _check(name: str, t: torch.Tensor, shape: tuple, prob: Problem) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    if t.device != prob.device:
        raise ValueError(f"{name} is on {t.device} but q is on {prob.device}")


def _minus_dlse(delta: torch.Tensor, dlse: torch.Tensor | None) -> None:
    """Delta -= dlse (rows with no allowed key have p = 0 everywhere: their -inf lse takes no gradient)."""
    if dlse is not None:
        delta.sub_(torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0))


def backward(prob: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of attention for ``prob`` given the upstream gradient ``dout``.

    ``out`` and ``dout`` are [B, Hq, Nq, D] (any strides), ``lse`` float32 [B, Hq, Nq] as the forward wrote
    them (natural log, -inf for rows with no allowed key). Returns tensors shaped like ``prob.q``,
    ``prob.k``, ``prob.v`` ([B, H, N, D], q's dtype, laid out like the inputs where they are dense). The
    bias, if any, is a constant. Rows with no allowed key and padding rows give dq = 0; keys no row sees
    give dk = dv = 0. Nothing is launched for an empty problem. ``dlse`` ([B, Hq, Nq], or None) is the
    gradient reaching the lse when the caller used it: since d lse / d s = p, it enters as Delta - dlse.
    """
    if triton is None:
        raise RuntimeError("the Triton backward needs triton (not importable)")
    B, Hq, Nq, D = prob.B, prob.Hq, prob.Nq, prob.D
    _check("out", out, (B, Hq, Nq, D), prob)
    _check("dout", dout, (B, Hq, Nq, D), prob)
    _check("lse", lse, (B, Hq, Nq), prob)
    if dout.dtype != prob.dtype:
        dout = dout.to(prob.dtype)
    if lse.dtype != torch.float32:
        lse = lse.float()
    dq, dk, dv = torch.empty_like(prob.q), torch.empty_like(prob.k), torch.empty_like(prob.v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    interpret = not prob.q.is_cuda
    spec = prob.spec
    if interpret and spec.kv_len is not None and not bool(spec.kv_len.any()):  # host tensor: no sync
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(B, Hq, Nq, dtype=torch.float32, device=prob.device)
    lse2 = torch.empty_like(delta)
    if interpret:
        with interpreter(_bwd_preprocess):
            _launch_preprocess(prob, out, lse, dout, delta, lse2, True)
            _minus_dlse(delta, dlse)
            _launch_dkdv(prob, dout, delta, lse2, dk, dv, INTERPRETER_CONFIG, True)
            _launch_dq(prob, dout, delta, lse2, dq, INTERPRETER_CONFIG, True)
        return dq, dk, dv
    same = torch.cuda.current_device() == prob.q.get_device()
    with contextlib.nullcontext() if same else torch.cuda.device(prob.device):
        _launch_preprocess(prob, out, lse, dout, delta, lse2, False)
        _minus_dlse(delta, dlse)
        kv_cfg, q_cfg = configs_for(prob, dout, delta, lse2, dq, dk, dv)
        _launch_dkdv(prob, dout, delta, lse2, dk, dv, kv_cfg, False)
        _launch_dq(prob, dout, delta, lse2, dq, q_cfg, False)
    return dq, dk, dv
