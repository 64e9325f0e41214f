"""The backward's launches: each kernel's arguments, and launching them compiled.

A launch is ``(kernel, grid, arguments, keywords)``; its arguments open with the tensors it reads and writes
(:func:`preprocess_tensors`, :func:`dkdv_tensors`, :func:`dq_tensors`), then sizes, strides and scalars. On a GPU
the first launch of a launch key (:func:`launch_key`: the call's signature and the layouts of its per-call tensors,
with the kernel, its config and grid order) goes through Triton's JIT. It is then kept as a direct launch: the
compiled kernel's launcher, the grid and every value after the leading tensors. Everything those values hold is
fixed by the key, so a later launch of the key gathers its tensors' addresses and calls the launcher: no arguments
rebuilt, none bound by Triton (host time on every training step, as the forward's plans save it). On CPU tensors
the kernels run through Triton's interpreter with :data:`INTERPRETER_CONFIG`.
"""

from __future__ import annotations

import torch

from attnlab.backends.triton import bwd_grid, configs
from attnlab.backends.triton import runtime as _rt
from attnlab.backends.triton.configs import BwdConfig, padded_head_dim
from attnlab.backends.triton.forward_kernel import LOG2E
from attnlab.backends.triton.interpreter import interpreted_fn
from attnlab.backends.triton.runtime import batch_strides, jit_run, tile_grid
from attnlab.fast_calls import evict_oldest
from attnlab.problem import Problem

try:
    from attnlab.backends.triton.backward_kernels import bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess
except ImportError:  # no triton: backward.gradients says so before anything here runs
    bwd_dkdv_kernel = bwd_dq_kernel = bwd_preprocess = None

#: The interpreter's configs: small tiles, so that the CPU tests' short sequences span several tiles of
#: both kinds (partial and full) in both passes.
INTERPRETER_CONFIG = BwdConfig(16, 16, 1, 1)
#: Rows per program of the preprocess (GPU; the interpreter uses INTERPRETER_CONFIG.block_m).
PREPROCESS_BLOCK_M = 64


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------
def mask_pointers(prob: Problem) -> tuple[torch.Tensor, ...]:
    """The pointers KvLen, QLen, Explicit, Alibi (q where one is absent: a placeholder, never read)."""
    spec, q, mods = prob.spec, prob.q, prob.mods
    explicit = spec.explicit
    if explicit is not None and explicit.dtype == torch.bool:
        explicit = explicit.view(torch.uint8)  # the kernels read a bool mask as bytes
    if prob.packed is not None:  # the kernels read a packed call's prefix sums where they read lengths otherwise
        lengths = (prob.packed.cu_k, prob.packed.cu_q)
    else:
        lengths = (spec.kv_len if spec.kv_len is not None else q, spec.q_len if spec.q_len is not None else q)
    return (*lengths, explicit if explicit is not None else q, mods.alibi if mods.alibi is not None else q)


def mask_arguments(prob: Problem) -> tuple[list, dict]:
    """(the explicit mask's and the slopes' strides; the mask and score modifier constants) for the kernels (their
    pointers: :func:`mask_pointers`)."""
    spec, mods = prob.spec, prob.mods
    explicit = spec.explicit
    strides = list(explicit.stride()) if explicit is not None else [0, 0, 0, 0]
    strides += list(mods.alibi.stride()) if mods.alibi is not None else [0, 0]
    constants = dict(
        HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
        BOTTOM_RIGHT=spec.align == "bottom_right",
        HAS_KV_LEN=spec.kv_len is not None, HAS_Q_LEN=spec.q_len is not None,
        HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
        VARLEN=prob.packed is not None,
        HAS_SOFTCAP=mods.softcap is not None, HAS_ALIBI=mods.alibi is not None,
    )
    return strides, constants


def _common(prob: Problem, interpret: bool) -> dict:
    """Compile-time constants shared by the dK/dV and dQ kernels."""
    block_d, block_dv = padded_head_dim(prob.D), padded_head_dim(prob.Dv)
    return dict(
        BLOCK_D=block_d, EVEN_D=block_d == prob.D, BLOCK_DV=block_dv, EVEN_DV=block_dv == prob.Dv,
        DOT_PRECISION="ieee",
        # The interpreter multiplies bfloat16 bit patterns as integers in tl.dot: upcast (exactly) first.
        UPCAST=interpret and prob.dtype != torch.float32,
    )


def _scalars(prob: Problem) -> list:
    spec = prob.spec
    cap2 = prob.mods.softcap * LOG2E if prob.mods.softcap is not None else 0.0
    return [prob.Hq, prob.Nq, prob.Nk, prob.D, prob.Dv, prob.q.shape[2], prob.k.shape[2], prob.group,
            prob.scale * LOG2E, prob.scale,
            spec.left if spec.left is not None else 0, spec.right if spec.right is not None else 0, cap2]


def _preprocess_block_m(interpret: bool) -> int:
    return INTERPRETER_CONFIG.block_m if interpret else PREPROCESS_BLOCK_M


def preprocess_grid(prob: Problem, interpret: bool) -> tuple[int, int, int]:
    return tile_grid(prob, prob.Nq, prob.q.shape[2], _preprocess_block_m(interpret), prob.Hq)


def preprocess_tensors(prob, out, lse, dout, delta, lse2, sink_part=None) -> tuple[torch.Tensor, ...]:
    """The preprocess's leading tensor arguments (lse where one is absent)."""
    spec, packed = prob.spec, prob.packed
    q_len = packed.cu_q if packed is not None else spec.q_len if spec.q_len is not None else lse
    has_sinks = sink_part is not None
    return (out, dout, lse, delta, lse2, q_len, prob.mods.kernel_sinks if has_sinks else lse,
            sink_part if has_sinks else lse)


def preprocess_launch(prob, out, lse, dout, delta, lse2, interpret: bool, sink_part=None) -> tuple:
    """(kernel, grid, arguments, keywords) of the preprocess; with ``sink_part`` (float32, one per program) it
    also stores each program's share of the sinks' gradient there."""
    packed = prob.packed
    args = (*preprocess_tensors(prob, out, lse, dout, delta, lse2, sink_part), *batch_strides(out, packed),
            *batch_strides(dout, packed), *batch_strides(lse, packed), prob.Hq, prob.Nq, prob.Dv, prob.q.shape[2])
    kw = dict(BLOCK_M=_preprocess_block_m(interpret),
              BLOCK_DV=padded_head_dim(prob.Dv), HAS_Q_LEN=prob.spec.q_len is not None, VARLEN=packed is not None,
              HAS_SINKS=sink_part is not None, num_warps=1 if interpret else 4, **configs.COMPILE_OPTIONS)
    return bwd_preprocess, preprocess_grid(prob, interpret), args, kw


def dkdv_tensors(prob, dout, delta, lse2, dk, dv, dq_acc=None) -> tuple[torch.Tensor, ...]:
    """The dK/dV kernel's leading tensor arguments (dk in place of an absent dQ accumulator)."""
    return (prob.q, prob.k, prob.v, dout, lse2, delta, dk, dv, dq_acc if dq_acc is not None else dk,
            *mask_pointers(prob))


def dkdv_launch(prob, dout, delta, lse2, dk, dv, cfg: BwdConfig, interpret: bool,
                dq_acc: torch.Tensor | None = None, dq_like: torch.Tensor | None = None) -> tuple:
    """(kernel, grid, arguments, keywords) of the dK/dV kernel with ``cfg``; with ``dq_acc`` (float32, zeroed) the
    one-pass variant, which adds dQ into it, read through ``dq_like``'s strides when given (a compile ahead's
    stand-in)."""
    e_strides, mask_constants = mask_arguments(prob)
    outer = bwd_grid.tiles_outer(prob, "dkdv", cfg.block_n)
    grid = tile_grid(prob, prob.Nk, prob.k.shape[2], cfg.block_n, prob.Hkv, outer)
    pk = prob.packed
    dq_strides = batch_strides(dq_like if dq_like is not None else dq_acc, pk) if dq_acc is not None else (0,) * 4
    args = (*dkdv_tensors(prob, dout, delta, lse2, dk, dv, dq_acc),
            *batch_strides(prob.q, pk), *batch_strides(prob.k, pk), *batch_strides(prob.v, pk),
            *batch_strides(dout, pk), *batch_strides(dk, pk), *batch_strides(dv, pk), *dq_strides, *e_strides,
            *_scalars(prob))
    kw = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_common(prob, interpret), **mask_constants,
              DQ_ATOMIC=dq_acc is not None, TILES_OUTER=outer, num_warps=cfg.num_warps,
              num_stages=cfg.num_stages,
              **configs.COMPILE_OPTIONS)
    return bwd_dkdv_kernel, grid, args, kw


def dq_tensors(prob, dout, delta, lse2, dq) -> tuple[torch.Tensor, ...]:
    """The dQ kernel's leading tensor arguments."""
    return (prob.q, prob.k, prob.v, dout, lse2, delta, dq, *mask_pointers(prob))


def dq_launch(prob, dout, delta, lse2, dq, cfg: BwdConfig, interpret: bool) -> tuple:
    """(kernel, grid, arguments, keywords) of the dQ kernel with ``cfg``."""
    e_strides, mask_constants = mask_arguments(prob)
    outer = bwd_grid.tiles_outer(prob, "dq", cfg.block_m)
    grid = tile_grid(prob, prob.Nq, prob.q.shape[2], cfg.block_m, prob.Hq, outer)
    pk = prob.packed
    args = (*dq_tensors(prob, dout, delta, lse2, dq),
            *batch_strides(prob.q, pk), *batch_strides(prob.k, pk), *batch_strides(prob.v, pk),
            *batch_strides(dout, pk), *batch_strides(dq, pk), *e_strides, *_scalars(prob))
    kw = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_common(prob, interpret), **mask_constants,
              TILES_OUTER=outer, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
              **configs.COMPILE_OPTIONS)
    return bwd_dq_kernel, grid, args, kw


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------
def launch_fitting(launch, cfg: BwdConfig, space: list[BwdConfig], what: str) -> BwdConfig:
    """``launch(cfg)``, or with the next candidates of ``space`` while a config does not fit this GPU; returns the
    config that ran."""
    while True:
        try:
            launch(cfg)
            return cfg
        except Exception as err:
            nxt = configs.next_fitting(space, cfg, what) if configs.out_of_resources(err) else None
            if nxt is None:
                raise
            cfg = nxt


#: Direct launches by full launch key (the kernel, its config and grid order, :func:`launch_key`): the compiled
#: kernel's launcher, the grid, and every argument value after the leading tensors, in signature order.
COMPILED: dict[tuple, tuple] = {}


def launch_key(prob: Problem, *tensors: torch.Tensor) -> tuple | None:
    """What a backward's compiled kernels depend on besides their configs: the call's signature and the layouts of
    the per-call tensors (out, dout, lse, Delta, the base-2 lse, dq, dk, dv); None for a packed call, whose
    prefix sums the signature does not hold (it launches through the JIT every time)."""
    if prob.packed is not None:
        return None
    return (_rt.call_signature(prob), _rt.layout_key(*tensors))


def _direct(key: tuple | None, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Launch the direct launch of ``key`` with these leading tensors, if there is one; say whether it ran."""
    hit = COMPILED.get(key) if key is not None and _rt.FAST_LAUNCH else None
    if hit is None:
        return False
    go, grid, rest = hit
    go(grid, _rt.current_stream(torch.cuda.current_device()), (*_rt.pointers(tensors), *rest))
    return True


def _go(launch: tuple, interpret: bool, key: tuple | None, n_tensors: int) -> None:
    """Run ``(kernel, grid, args, keywords)``, whose first ``n_tensors`` arguments are its tensors: interpreted,
    or through the JIT, keeping it as the direct launch of ``key`` (None: never kept)."""
    kernel, grid, args, kw = launch
    if interpret:
        interpreted_fn(kernel)[grid](*args, **kw)
        return
    compiled = jit_run(kernel, grid, args, kw)
    if key is None or not _rt.FAST_LAUNCH or not _rt.fast_launch_supported(compiled):
        return
    values = _rt.bound_values(args, kw, _rt.later_parameters(kernel, len(args)))
    if any(isinstance(x, torch.Tensor) for x in values[n_tensors:]):  # (never: the builders lead with them all)
        return
    evict_oldest(COMPILED, 3 * _rt.MAX_PLANS)
    COMPILED[key] = (_rt.launcher(compiled), (*grid, 1, 1)[:3], values[n_tensors:])


def preprocess_key(key: tuple | None, shares: bool, one: bool) -> tuple | None:
    """The preprocess's full launch key; it names the mode (``one``) too, so that a backward's first call in
    either mode is the one that waits for its kernels compiled ahead."""
    return None if key is None else ("preprocess", shares, one, key)


def launch_preprocess(prob, out, lse, dout, delta, lse2, interpret: bool, key: tuple | None = None,
                      sink_part: torch.Tensor | None = None, one: bool = False) -> None:
    """The preprocess (directly where its key launched before)."""
    full = None if interpret else preprocess_key(key, sink_part is not None, one)
    tensors = preprocess_tensors(prob, out, lse, dout, delta, lse2, sink_part)
    if not _direct(full, tensors):
        _go(preprocess_launch(prob, out, lse, dout, delta, lse2, interpret, sink_part), interpret, full,
            len(tensors))


def launch_dkdv(prob, dout, delta, lse2, dk, dv, cfg: BwdConfig, interpret: bool, key: tuple | None = None,
                dq_acc: torch.Tensor | None = None) -> None:
    """The dK/dV pass; its full key (as the dQ pass's) names the grid order it takes: its kernel's own."""
    full = None if interpret or key is None else (
        "dkdv", cfg, dq_acc is not None, bwd_grid.tiles_outer(prob, "dkdv", cfg.block_n), key)
    tensors = dkdv_tensors(prob, dout, delta, lse2, dk, dv, dq_acc)
    if not _direct(full, tensors):
        _go(dkdv_launch(prob, dout, delta, lse2, dk, dv, cfg, interpret, dq_acc), interpret, full, len(tensors))


def launch_dq(prob, dout, delta, lse2, dq, cfg: BwdConfig, interpret: bool, key: tuple | None = None) -> None:
    """The dQ pass."""
    full = None if interpret or key is None else ("dq", cfg, bwd_grid.tiles_outer(prob, "dq", cfg.block_m), key)
    tensors = dq_tensors(prob, dout, delta, lse2, dq)
    if not _direct(full, tensors):
        _go(dq_launch(prob, dout, delta, lse2, dq, cfg, interpret), interpret, full, len(tensors))
