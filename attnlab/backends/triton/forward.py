"""Launching the kernel: its arguments from a :class:`~attnlab.problem.Problem` and a config, the grid, the JIT
launch, and the fast path for repeated launches of one call signature (:class:`_Plan`: the compiled kernel's
launcher called directly, without the JIT's per-call binding).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from attnlab.backends.triton import configs as _cfg
from attnlab.backends.triton import forward_kernel as _k
from attnlab.backends.triton import runtime as _rt
from attnlab.backends.triton.configs import Config, config_for, kernel_key_axis, kernel_qk_chunk, padded_head_dim
from attnlab.backends.triton.forward_kernel import LOG2E, triton
from attnlab.backends.triton.interpreter import interpreter
from attnlab.fast_calls import evict_oldest
from attnlab.problem import Problem


def _arguments(prob: Problem, cfg: Config, interpret: bool, write_lse: bool) -> tuple[list, list, list, dict]:
    """The kernel's arguments for ``prob`` and ``cfg`` except those of out and lse, in signature order:
    (pointers before Out, the arguments between Lse and out's strides, those after lse's strides,
    the compile-time constants). :func:`jit_launch` and :class:`_Plan` put out and lse in between."""
    spec, packed = prob.spec, prob.packed
    q, k, v = prob.q, prob.k, prob.v
    D, Dv = prob.D, prob.Dv
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    if prob.descale is not None:  # an 8-bit tl.dot reduces over at least 32 (D's zero padding adds nothing)
        block_d = max(block_d, 32)
    explicit = spec.explicit
    if explicit is not None and explicit.dtype == torch.bool:
        explicit = explicit.view(torch.uint8)  # the kernel reads a bool mask as bytes
    e = explicit if explicit is not None else q  # a placeholder pointer when absent (never read)
    e_strides = explicit.stride() if explicit is not None else (0, 0, 0, 0)
    if packed is not None:  # the kernel reads a packed call's prefix sums where it reads lengths otherwise
        kv_len, q_len = packed.cu_k, packed.cu_q
    else:
        kv_len = spec.kv_len if spec.kv_len is not None else q
        q_len = spec.q_len if spec.q_len is not None else q
    left = spec.left if spec.left is not None else 0
    right = spec.right if spec.right is not None else 0
    if dtype_is_f32 := prob.dtype == torch.float32:
        precision = "tf32" if (_cfg.TF32 and not interpret) else "ieee"
    else:
        precision = "ieee"  # ignored for half types (their products are exact in float32)
    mods = prob.mods
    alibi = mods.alibi if mods.alibi is not None else q  # placeholders when absent (never read)
    sinks = mods.kernel_sinks if mods.sinks is not None else q
    a_strides = mods.alibi.stride() if mods.alibi is not None else (0, 0)
    cap2 = mods.softcap * LOG2E if mods.softcap is not None else 0.0
    descale = prob.descale if prob.descale is not None else q  # FP8 only: [B, Hq, 3]
    z_strides = prob.descale.stride()[:2] if prob.descale is not None else (0, 0)
    head = [q, k, v]
    mid = [kv_len, q_len, e, alibi, sinks, descale, *_rt.batch_strides(q, packed), *_rt.batch_strides(k, packed),
           *_rt.batch_strides(v, packed)]
    tail = [*e_strides, *a_strides, *z_strides, prob.Nq, prob.Nk, D, Dv, q.shape[2], k.shape[2], prob.group,
            prob.scale * LOG2E, left, right, cap2]
    constants = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, EVEN_D=(block_d == D),
        BLOCK_DV=block_dv, EVEN_DV=(block_dv == Dv),
        HAS_SOFTCAP=mods.softcap is not None, HAS_ALIBI=mods.alibi is not None, HAS_SINKS=mods.sinks is not None,
        HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
        BOTTOM_RIGHT=spec.align == "bottom_right",
        HAS_KV_LEN=spec.kv_len is not None, HAS_Q_LEN=spec.q_len is not None,
        HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
        WRITE_LSE=write_lse, DOT_PRECISION=precision,
        # The interpreter multiplies bfloat16 bit patterns (stored as uint16) as integers in tl.dot;
        # upcasting to float32 first (exact) gives the tensor cores' products.
        UPCAST_DOT=interpret and not dtype_is_f32,
        QK_CHUNK=kernel_qk_chunk(cfg, block_d),
        KEY_AXIS=kernel_key_axis(cfg, prob.dtype),
        ROWS_OUTER=_rows_outer(prob, cfg),
        VARLEN=packed is not None,
        FP8=prob.descale is not None,
    )
    return head, mid, tail, constants


def _bind(head: Sequence, mid: Sequence, tail: Sequence, out: torch.Tensor, lse: torch.Tensor | None,
          packed=None) -> tuple:
    """The kernel's run-time arguments in signature order: :func:`_arguments`' parts with out and lse (and
    their strides) in between; without lse, out stands in for its pointer (never written) with strides 0."""
    if lse is None:
        return (*head, out, out, *mid, *_rt.batch_strides(out, packed), 0, 0, 0, *tail)
    return (*head, out, lse, *mid, *_rt.batch_strides(out, packed), *_rt.batch_strides(lse, packed), *tail)


def jit_launch(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, cfg: Config, interpret: bool):
    """Launch the kernel once with ``cfg`` through Triton's JIT (writes every element of out and lse).

    Returns what the JIT returns for a compiled launch (the compiled kernel), None in the interpreter.
    """
    head, mid, tail, constants = _arguments(prob, cfg, interpret, lse is not None)
    args = _bind(head, mid, tail, out, lse, prob.packed)
    kw = dict(constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_cfg.COMPILE_OPTIONS)
    if not interpret:
        return _rt.jit_run(_k.attn_fwd_kernel, _grid(prob, cfg), args, kw)
    with interpreter(_k.attn_fwd_kernel) as kernel:
        return kernel[_grid(prob, cfg)](*args, **kw)


def _rows_outer(prob: Problem, cfg: Config) -> bool:
    """Whether the grid runs row tiles outermost (``cfg.rows_outer``; a grid's z extent is at most 65535).

    Under a causal mask a row tile's work grows with its index. Launched head by head (each head's
    tiles longest first), the last head's longest tile starts near the end and runs alone; with row tiles
    outermost, the longest tiles of every head go first and the tail is short tiles (docs/decisions.md,
    "Row tiles outermost"). Heads then share less of their K/V in L2, which the (compute-bound) float32
    candidates afford.
    """
    return cfg.rows_outer and prob.packed is None and triton.cdiv(prob.Nq, cfg.block_m) <= 65535


def _grid(prob: Problem, cfg: Config) -> tuple[int, int, int]:
    """One program per (row tile, query head, batch entry); packed, per (slot, query head), the slots
    holding every sequence's row tiles (:func:`~attnlab.backends.triton.tiles.packed_tile`)."""
    if _rows_outer(prob, cfg):
        return (prob.Hq, prob.B, triton.cdiv(prob.Nq, cfg.block_m))
    return _rt.tile_grid(prob, prob.Nq, prob.q.shape[2], cfg.block_m, prob.Hq)


class _Plan:
    """How one call signature is launched with one config: the compiled kernel of each out/lse layout seen so
    far, and the arguments that the signature fixes (sizes, strides, scalars, the constants).

    The first launch of each layout goes through Triton's JIT (:func:`~attnlab.backends.triton.runtime.jit_run`),
    which specializes, compiles or finds the compiled kernel, and returns it. Later launches of that layout call
    the compiled kernel's launcher directly, with the arguments the JIT would pass: the JIT's per-call work
    (binding about 45 arguments, specializing each, building the cache key) is what made small problems wait for
    the host. That is sound because everything the JIT specializes on is in the plan's key
    (:func:`~attnlab.backends.triton.runtime.call_signature`: dtypes, shapes, strides, scalars, which masks are
    present, and the 16-byte alignment of every pointer) or in the layout key (out's and lse's strides and
    alignment). Only the tensors themselves (their addresses) change from call to call. Launch hooks are honoured
    as the JIT honours them.
    """

    __slots__ = ("cfg", "device", "fixed", "grid", "kernels")

    def __init__(self, prob: Problem, cfg: Config) -> None:
        self.cfg = cfg
        self.grid = _grid(prob, cfg)
        self.device = prob.device.index
        self.kernels: dict[tuple, object] = {}
        self.fixed: dict[bool, tuple] = {}  # write_lse -> (mid after its 3 pointers, tail, the constants' values)

    def launch(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        key = _rt.layout_key(out, lse)
        kernel = self.kernels.get(key)
        if kernel is None or not _rt.FAST_LAUNCH:
            kernel = self._jit_launch(prob, out, lse)
            if _rt.FAST_LAUNCH and _rt.fast_launch_supported(kernel):
                self.kernels[key] = kernel
            return
        write_lse = lse is not None
        fixed = self.fixed.get(write_lse)
        if fixed is None:
            _, mid, tail, constants = _arguments(prob, self.cfg, False, write_lse)
            fixed = self.fixed[write_lse] = (mid[6:], tail, tuple(constants[n] for n in _constexpr_names()))
        mid_rest, tail, constants = fixed
        spec, q = prob.spec, prob.q
        explicit = spec.explicit
        if explicit is not None and explicit.dtype == torch.bool:
            explicit = explicit.view(torch.uint8)
        head = (q, prob.k, prob.v)
        mods = prob.mods  # the slopes' strides, the cap and which modifiers are present are in the plan's key
        mid = (spec.kv_len if spec.kv_len is not None else q, spec.q_len if spec.q_len is not None else q,
               explicit if explicit is not None else q, mods.alibi if mods.alibi is not None else q,
               mods.kernel_sinks if mods.sinks is not None else q,
               prob.descale if prob.descale is not None else q, *mid_rest)
        # The launcher takes every parameter in signature order, the constants (which come last) too.
        args = (*_bind(head, mid, tail, out, lse), *constants)
        _rt.run_compiled(kernel, self.grid, _rt.stream_of(self.device), args)

    def _jit_launch(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
        """A launch through the JIT; a config that does not fit this GPU (a table made on a larger one, or the
        heuristic default) gives way to the next candidate, for this plan and the problem's tune key."""
        while True:
            try:
                return jit_launch(prob, out, lse, self.cfg, interpret=False)
            except Exception as err:
                nxt = _cfg.fall_back(prob, self.cfg) if _cfg.out_of_resources(err) else None
                if nxt is None:
                    raise
                self.cfg, self.grid = nxt, _grid(prob, nxt)
                self.kernels.clear()
                self.fixed.clear()

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
        """After a launch for ``prob`` into ``out`` and ``lse``: a function ``(q, k, v, kv_len, q_len, mask,
        block_table, alibi_slopes, sinks) -> (out, lse or None)`` (the table unused here) for a later call of the
        signature (:mod:`attnlab.fast_calls`). It allocates out and lse as this call's were (so the compiled kernel
        of their layout applies), puts the call's tensors into the fixed arguments and calls the launcher; None
        once TF32 or autotune switched since (take the whole way).
        None here when there is no compiled kernel of that layout to call directly."""
        key = _rt.layout_key(out, lse)
        kernel = self.kernels.get(key)
        if kernel is None or not _rt.FAST_LAUNCH:  # (an empty call never gets here: it launched nothing)
            return None
        write_lse = lse is not None
        _, mid, tail, constants = _arguments(prob, self.cfg, False, write_lse)
        rest = (*mid[6:], *out.stride(), *(lse.stride() if write_lse else (0, 0, 0)), *tail,
                *(constants[n] for n in _constexpr_names()))
        empty_like, contiguous = torch.empty_like, torch.contiguous_format
        lse_shape, dev, index, grid = (prob.B, prob.Hq, prob.Nq), prob.device, self.device, self.grid
        current_stream, pointers = _rt.current_stream, _rt.pointers
        switches = (_cfg.TF32, _cfg.AUTOTUNE, _cfg.SHIPPED_ONLY)
        go = _rt.launcher(kernel)

        def call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks):
            if (_cfg.TF32, _cfg.AUTOTUNE, _cfg.SHIPPED_ONLY) != switches or not _rt.FAST_LAUNCH:
                return None
            o = empty_like(q, memory_format=contiguous)  # q's shape, dtype and device: out's (cheaper than empty)
            m = torch.empty(lse_shape, dtype=torch.float32, device=dev) if write_lse else None
            tensors = (q, k, v, o, o if m is None else m, q if kv_len is None else kv_len,
                       q if q_len is None else q_len, q if mask is None else mask,
                       q if alibi_slopes is None else alibi_slopes, q if sinks is None else sinks,
                       q)  # (no descale: a fast call is never FP8)
            go(grid, current_stream(index), (*pointers(tensors), *rest))
            return o, m

        return call


@functools.cache
def _constexpr_names() -> tuple[str, ...]:
    params = _k.attn_fwd_kernel.params
    names = tuple(p.name for p in params if p.is_constexpr)
    assert all(p.is_constexpr for p in params[len(params) - len(names):]), "constants must come last"
    return names


#: Plans by call signature (:func:`~attnlab.backends.triton.runtime.call_signature`), so that every call of one
#: shape and mask kind, each with a new Problem as attnlab.attention makes one, reuses one plan and its compiled
#: kernel. Bounded: the oldest plan goes first.
_PLANS: dict[tuple, _Plan] = {}


def forget_plans() -> None:
    """Drop every plan (after tuning: a plan keeps the config it was made with)."""
    _PLANS.clear()


def plan_for(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> _Plan:
    """The plan of ``prob``'s call signature for the current TF32 and autotune settings (its config from
    config_for)."""
    key = _rt.call_signature(prob)
    plan = _PLANS.get(key)
    if plan is None:
        evict_oldest(_PLANS, _rt.MAX_PLANS)
        plan = _PLANS[key] = _Plan(prob, config_for(prob, out, lse, autotune))
    return plan


def autotune(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> Config:
    """Time each candidate on this problem (outputs are overwritten by the final launch) and keep the best.

    Each candidate launches through its own :class:`_Plan` (the JIT once, then the direct launcher), so
    that the host stays ahead of the GPU and ``do_bench`` (which clears the L2 before every call) times
    the kernel rather than the host; and the median is kept, not the mean, so that one slow call cannot
    decide (docs/decisions.md, "How long a tune times each candidate").
    """
    plans: dict[Config, _Plan] = {}
    if prob.packed is not None:  # no plan takes prefix sums: every candidate through the JIT

        def launch(cfg: Config) -> None:
            jit_launch(prob, out, lse, cfg, interpret=False)

        return _cfg.fastest(_cfg.candidates(prob.dtype, _cfg.problem_head_dim(prob)), launch,
                            f"dtype={prob.dtype}, D={prob.D}, Dv={prob.Dv}")

    def launch(cfg: Config) -> None:
        plan = plans.get(cfg)
        if plan is None:  # one plan per candidate (setdefault would build a new one on every timed call)
            plan = plans[cfg] = _Plan(prob, cfg)
        plan.launch(prob, out, lse)

    return _cfg.fastest(_cfg.candidates(prob.dtype, _cfg.problem_head_dim(prob)), launch,
                        f"dtype={prob.dtype}, D={prob.D}, Dv={prob.Dv}")
