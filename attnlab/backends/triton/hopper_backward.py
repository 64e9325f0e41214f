"""The Hopper backward's host side: which calls it takes, when it is compiled, and its launch.

On an sm_90 GPU the ``triton`` backend's backward runs the Gluon kernel of
:mod:`~attnlab.backends.triton.hopper_bwd_kernel` (one pass: dK, dV and dQ, dQ added up by TMA reduce-adds) for
the calls :func:`unsupported` accepts, once the portable preprocess has written Delta and the base-2 lse; every
other call runs the portable kernels. It follows the Hopper forward's switch and compile modes
(:mod:`~attnlab.backends.triton.hopper_forward`: ``ATTNLAB_HOPPER``, a variant's first call runs the portable
kernels, its second starts the compile on a worker thread, ``sync`` compiles on the first call and waits).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from attnlab.backends.triton import configs
from attnlab.backends.triton import hopper_forward as fwd
from attnlab.backends.triton import runtime as _rt
from attnlab.fast_calls import evict_oldest
from attnlab.problem import Problem

BLOCK_M = 64  #: query rows per tile streamed past a program's keys
HALF_N = 64  #: keys per consumer warpgroup; a program owns two halves
STAGES = 2  #: Q/dO slots in the ring
CONSUMER_REGS = 240  #: registers per thread of a consumer warpgroup (the loader's and writer's warpgroup: 24)
MAX_REGS = 168  #: the kernel's per-thread limit over its 12 warps: 2 x 240 + 24 = 3 x 168
HEAD_DIMS = (64, 128)
FULL_ROWS_GQA_ONLY_HEAD_DIMS = (64,)  #: head dims whose unmasked rows are taken only under GQA (else portable)
#: Head dim -> the band width (keys) below which a window runs on the portable passes: a step that short is
#: host-bound, and the Gluon route costs more host time than the portable launch it replaces.
PORTABLE_WINDOWS_BELOW: dict[int, int] = {64: 1024}
#: The programs' order (the kernel's ``_program_tile``): 0, a kv head's key tiles together; 1, each key tile of a
#: batch entry's kv heads together, the longest first; 2, each key tile of every kv head and batch entry together.
#: None picks by :func:`order`'s rule; a number forces that order on every call (experiments and tests).
ORDER: int | None = None
ORDER1_MAX_NK = 4096  #: the longest key row that takes order 1 under the causal band, past four waves
SMS_OFF_GPU = 132  #: the SMs :func:`order` counts for a problem off the GPU (tests): a Hopper SXM part's
#: Parts each kv head's group of query heads is split into, one program each (the kernel's ``SPLIT``, a power of
#: two that divides the group): None picks by :func:`split`'s rule; a number forces it where it divides the group.
SPLIT: int | None = None
SPLIT_CAUSAL_WAVES = 2.5  #: under the causal band a grid under one wave is split until it holds this many waves


@functools.cache
def _kernel_module():
    """The backward's Gluon module, or the reason it cannot be imported."""
    return fwd.gluon_module("hopper_bwd_kernel")


def unsupported(prob: Problem, dout: torch.Tensor) -> str | None:
    """Why the Hopper backward does not take ``prob`` (None: it does). It computes float16/bfloat16, D = Dv of 64
    or 128, fewer than 2**31 rows over all heads padded to 4 (lse2 and Delta are read by TMA), no mask, the causal
    band or any window in either alignment, Nq != Nk, GQA, ALiBi, sinks (they enter through the forward's lse alone)
    and the lse's gradient. D 64 off the causal band, and any D under a window's left edge, take GQA only (without
    it the portable backward is as fast or faster); D 64 takes windows :data:`PORTABLE_WINDOWS_BELOW` keys wide or
    wider. Lengths, explicit masks and biases, packed sequences, the soft cap and deterministic mode (dQ's adds land
    in any order) run on the portable kernels."""
    if fwd.mode() == "0":
        return "ATTNLAB_HOPPER=0"
    q = prob.q
    if not fwd.on_sm90(q):
        return "sm_90 GPUs only"
    if prob.dtype not in (torch.float16, torch.bfloat16):
        return "float16 and bfloat16 only"
    if prob.D != prob.Dv or prob.D not in HEAD_DIMS:
        return f"D = Dv in {HEAD_DIMS} only"
    spec, mods = prob.spec, prob.mods
    if max(_grid(prob)[1:]) > 65535:
        return ("at most 65535 along the grid's second and third axes (key tiles of 128, kv heads times the group's "
                "parts, batch entries)")
    if prob.packed is not None or spec.kv_len is not None or spec.q_len is not None:
        return "no lengths or packed sequences"
    if spec.mask is not None or spec.bias is not None:
        return "no explicit mask or bias"
    if mods.softcap is not None:
        return "no soft cap"
    if prob.D in FULL_ROWS_GQA_ONLY_HEAD_DIMS and prob.group == 1 and not _causal(prob):
        return (f"D {prob.D} without the causal band: with grouped query heads only (without, the portable backward "
                "is faster)")
    if prob.group == 1 and prob.spec.left is not None:
        return ("a window's left edge: with grouped query heads only (without, the portable backward is as fast or "
                "faster)")
    width, below = fwd.band_width(spec.left, spec.right), PORTABLE_WINDOWS_BELOW.get(prob.D)
    if width is not None and below is not None and width < below:
        return (f"D {prob.D}: windows at least {below} keys wide only (a narrower one's training step is host-bound, "
                "and the portable launch costs less host time)")
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic mode (dQ is added up by reduce-adds in any order)"
    if prob.B * prob.Hq * _rows(prob) >= 2**31:
        return "fewer than 2**31 query rows over all heads (TMA's coordinates into lse2 and Delta)"
    if not all(fwd.tma_ready(t) for t in (q, prob.k, prob.v, dout)):
        return "TMA needs the last dim contiguous and 16-byte aligned strides and bases"
    if isinstance(_kernel_module(), str):
        return _kernel_module()
    return None


def _rows(prob: Problem) -> int:
    """Each head's rows in the lse2 and Delta the kernel reads: Nq rounded up to 4, so that TMA reads every row
    tile from a 16-byte aligned start (an unaligned start faults on the GPU: docs/decisions.md, "The Hopper
    backward's lse2 and Delta by TMA")."""
    return -(-prob.Nq // 4) * 4


def _padded_rows(prob: Problem, t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, Hq, Nq] float32) with each head's rows padded to :func:`_rows` (itself when Nq is a multiple of
    4); the kernel never reads the padding as a row (rows past Nq are masked)."""
    rows = _rows(prob)
    return t if rows == prob.Nq else torch.nn.functional.pad(t, (0, rows - prob.Nq))


def _causal(prob: Problem) -> bool:
    """Whether a row sees no key past its diagonal: ``causal=True``, or the window ``(None, 0)`` that is the same
    band."""
    return prob.spec.left is None and prob.spec.right == 0


def _sms(prob: Problem) -> int:
    """The SMs of the problem's GPU (:data:`SMS_OFF_GPU` off the GPU)."""
    return _rt.sm_count(_rt.device_index(prob.device)) if prob.device.type == "cuda" else SMS_OFF_GPU


def _programs(prob: Problem, parts: int) -> int:
    """The grid's size: key tiles of 128 x kv heads x parts of each group x batch entries."""
    return -(-prob.Nk // (2 * HALF_N)) * prob.Hkv * parts * prob.B


def split(prob: Problem) -> int:
    """How many programs share each kv head's key tile, each taking an equal run of its query heads and adding
    its dK and dV up in float32 for the host to sum: :data:`SPLIT` when set and it divides the group; else 1 for
    a grid of a wave or more (there the parts' float32 stores and sums cost more than they balance), and a grid
    under one wave doubled while the group allows until it fills the SMs (full rows, where every program's work
    is the same) or holds :data:`SPLIT_CAUSAL_WAVES` waves (under the causal band, where key tile 0's programs,
    the longest, set a short grid's time)."""
    if SPLIT is not None:
        return SPLIT if SPLIT >= 1 and prob.group % SPLIT == 0 else 1
    sms = _sms(prob)
    if _programs(prob, 1) >= sms:
        return 1
    waves = SPLIT_CAUSAL_WAVES if _causal(prob) else 1
    parts = 1
    while prob.group % (2 * parts) == 0 and _programs(prob, parts) < waves * sms:
        parts *= 2
    return parts


def order(prob: Problem, parts: int | None = None) -> int:
    """The programs' order for ``prob``: :data:`ORDER` when set, else on full rows 0 (a kv head's tiles share its
    Q and dO in L2); under the causal band, where a key tile's work falls with its index, the longest tiles first
    as far as L2 allows: 2 (every head's at once) when the grid is at most two waves of programs, where the last
    wave's imbalance is most of the time; 1 (one batch entry's heads at once) up to 4096 keys or four waves; 0
    beyond, where the band's rows are long enough for L2 reuse to matter more. Waves count the split's
    programs (``parts``: the caller's :func:`split`, else computed)."""
    if ORDER is not None:
        return ORDER
    if not _causal(prob):
        return 0
    waves = _programs(prob, split(prob) if parts is None else parts) / _sms(prob)
    if waves <= 2:
        return 2
    return 1 if prob.Nk <= ORDER1_MAX_NK or waves <= 4 else 0


def _variant(prob: Problem, program_order: int | None = None, parts: int | None = None) -> tuple:
    """What a compiled kernel is specialized on, beyond what every taken call shares (``program_order`` and
    ``parts``: the caller's :func:`order` and :func:`split`, else computed)."""
    s = split(prob) if parts is None else parts
    o = order(prob, s) if program_order is None else program_order
    return ("backward", prob.q.device.index, prob.dtype, prob.D, *_band(prob)[:2], o, prob.mods.alibi is not None,
            s)


def _band(prob: Problem) -> tuple[bool, bool, int, int]:
    """(MASK_HI, MASK_LO, off_hi, off_lo) of the kernel: row i sees no key j > i + off_hi (a right edge: the causal
    mask or a window's right side) and none j < i + off_lo (a window's left side); offsets 0 without that edge.
    The widths are clamped as the forward's (``hopper_forward.clamped_width``): the same band, and 32-bit offsets."""
    spec = prob.spec
    diag = prob.Nk - prob.Nq if spec.align == "bottom_right" else 0
    left, right = (fwd.clamped_width(w, prob.q, prob.k) for w in (spec.left, spec.right))
    return (right is not None, left is not None, 0 if right is None else diag + right,
            0 if left is None else diag - left)


def _grid(prob: Problem, program_order: int | None = None, parts: int | None = None) -> tuple[int, int, int]:
    """One program per key tile of 128, kv head, part of its group and batch entry, the axes in :func:`order`'s
    order (the caller's ``program_order`` and ``parts``, else computed)."""
    s = split(prob) if parts is None else parts
    o = order(prob, s) if program_order is None else program_order
    heads = prob.Hkv * s
    tiles = -(-prob.Nk // (2 * HALF_N))
    return ((tiles, heads, prob.B), (heads, tiles, prob.B), (heads, prob.B, tiles))[o]


def _alibi(prob: Problem) -> tuple:
    """Alibi, s_ab, s_ah, alibi_off as the kernel takes them: the slopes' [B, Hq] view and Nk - Nq (``prob.q`` and
    zeros without ALiBi)."""
    a = prob.mods.alibi
    return (prob.q, 0, 0, 0) if a is None else (a, *a.stride(), prob.Nk - prob.Nq)


#: The kernel's constexprs, in its signature's order (:func:`_values` gives their values in that order).
_CONSTEXPRS = ("BLOCK_M", "HEAD_D", "STAGES", "MASK_HI", "MASK_LO", "CONSUMER_REGS", "ORDER", "HAS_ALIBI", "SPLIT")


def _values(prob: Problem, parts: int, program_order: int, dk_strides: tuple, dv_strides: tuple) -> tuple:
    """(fixed, constexprs): the kernel's arguments from DK's strides up to the slopes, and its constexprs, in its
    signature's order; the first launch passes them by name and keyword, a relaunch by position."""
    hi, lo, off_hi, off_lo = _band(prob)
    return ((*dk_strides, *dv_strides, prob.Nq, _rows(prob), prob.Nk, prob.Hq, prob.group, off_hi, off_lo,
             prob.scale * fwd.LOG2E, prob.scale),
            (BLOCK_M, prob.D, STAGES, hi, lo, CONSUMER_REGS, program_order, prob.mods.alibi is not None, parts))


def _launch_args(prob: Problem, dout, lse2, delta, dq_acc, dk, dv) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keywords) of one launch; ``dq_acc`` is float32 [B, Hq, Nq, D], zeroed; ``dk`` and ``dv``
    what the kernel writes: the gradients, or with :func:`split` > 1 float32 [B, Hkv * parts, Nk, D] partial
    sums (:func:`_partials`)."""
    q, k, v = prob.q, prob.k, prob.v
    D = prob.D
    s = split(prob)
    o = order(prob, s)
    fixed, constexprs = _values(prob, s, o, dk.stride()[:3], dv.stride()[:3])
    args = (fwd.descriptor(q, [1, 1, BLOCK_M, D]), fwd.descriptor(dout, [1, 1, BLOCK_M, D]),
            fwd.descriptor(k, [1, 1, HALF_N, D]), fwd.descriptor(v, [1, 1, HALF_N, D]),
            fwd.descriptor(dq_acc, [1, 1, BLOCK_M, D // 2]), fwd.descriptor(lse2.view(-1), [BLOCK_M]),
            fwd.descriptor(delta.view(-1), [BLOCK_M]), dk, dv, *fixed, *_alibi(prob))
    kw = dict(zip(_CONSTEXPRS, constexprs), num_warps=4, maxnreg=MAX_REGS, **configs.COMPILE_OPTIONS)
    return _grid(prob, o, s), args, kw


def _compile_launch(prob: Problem, lse2: torch.Tensor, delta: torch.Tensor) -> tuple:
    """(kernel, grid, arguments, keywords) to compile ``prob``'s variant for, with stand-ins of the call's dout,
    dQ accumulator, dk and dv (the same dtypes and alignment; none is written). lse2 and Delta come unpadded: the
    rows' alignment is a launch's matter, and the kernel does not specialize on Nq_rows."""
    acc = torch.empty((1, 1, 1, prob.D), dtype=torch.float32, device=prob.device)
    dk = torch.empty((1, 1, 1, prob.D), dtype=torch.float32 if split(prob) > 1 else prob.dtype, device=prob.device)
    return (_kernel_module().attn_bwd_hopper, *_launch_args(prob, prob.q, lse2, delta, acc, dk, dk))


def _partials(prob: Problem, parts: int, device: torch.device | str | None = None) -> torch.Tensor:
    """One float32 [2, B, Hkv * parts, Nk, D] buffer for the parts' dK and dV sums (in that order; part p of kv
    head h at ``h * parts + p``), so that one reduction adds both up; on ``device`` (the problem's by default; "meta"
    for its strides alone)."""
    return torch.empty((2, prob.B, prob.Hkv * parts, prob.Nk, prob.D), dtype=torch.float32,
                       device=prob.device if device is None else device)


#: Compiled kernels by variant, for launches without the JIT's binding.
_kernels: dict[tuple, object] = {}
launches = 0  #: Hopper backward launches so far (tests read it)


class _Plan(NamedTuple):
    """What :func:`run` decides once per launch key: the variant, the group's parts, the programs' order and grid,
    and the launch's values that do not change from call to call (those after the gradients' tensors up to the
    slopes, and the constexprs after the slopes)."""

    variant: tuple
    parts: int
    order: int
    grid: tuple[int, int, int]
    fixed: tuple
    constexprs: tuple


#: :func:`run`'s plans (or the refusal, None) by launch key, switch mode, deterministic mode and the forced split
#: and order: the rule checks, split, order, band and grid are host time on every training step otherwise. The
#: module's other settings are read when a key is first planned (:func:`forget_plans` after changing one).
_plans: dict[tuple, _Plan | None] = {}


def forget_plans() -> None:
    """Drop every kept plan, so that the next call of each key is decided again (after a module setting changed)."""
    _plans.clear()


def _plan(prob: Problem, dout: torch.Tensor, delta: torch.Tensor, lse2: torch.Tensor, dk: torch.Tensor,
          dv: torch.Tensor) -> _Plan | None:
    """``prob``'s plan for these gradients' layouts, or None when the Hopper backward does not take it
    (:func:`unsupported`, or a Delta or lse2 TMA cannot read: not contiguous or not 16-byte aligned)."""
    if unsupported(prob, dout) is not None:
        return None
    if not all(t.is_contiguous() and fwd.tma_ready(t.view(-1)) for t in (lse2, delta)):
        return None
    s = split(prob)
    o = order(prob, s)
    if s > 1:  # the kernel writes the parts' buffer (its halves share their strides)
        dk = dv = _partials(prob, s, "meta")[0]
    return _Plan(_variant(prob, o, s), s, o, _grid(prob, o, s), *_values(prob, s, o, dk.stride()[:3], dv.stride()[:3]))


def run(prob: Problem, dout: torch.Tensor, delta: torch.Tensor, lse2: torch.Tensor, dk: torch.Tensor,
        dv: torch.Tensor, dq_acc: torch.Tensor | None = None, key: tuple | None = None) -> torch.Tensor | None:
    """dK and dV into ``dk``, ``dv`` and dQ, float32 [B, Hq, Nq, D], returned, when the Hopper backward takes
    ``prob`` and its kernel is compiled; None when the caller runs the portable kernels instead (nothing done).
    ``delta`` and ``lse2`` are the preprocess's, contiguous float32 [B, Hq, Nq] (not contiguous or not 16-byte
    aligned: None, TMA reads them); ``dq_acc``, a zeroed float32 dQ the caller has already (any strides TMA can
    write), else one is made. ``key``, the backward's launch key (:func:`~.bwd_launch.launch_key`: the call's
    signature and the layouts of dout, Delta, lse2, dq, dk and dv), keeps the call's plan for the next call with
    that key; None plans every call."""
    memo = None if key is None else (key, fwd.mode(), torch.are_deterministic_algorithms_enabled(), SPLIT, ORDER)
    plan = _plans.get(memo, False) if memo is not None else False
    if plan is False:
        plan = _plan(prob, dout, delta, lse2, dk, dv)
        if memo is not None:
            evict_oldest(_plans, _rt.MAX_PLANS)
            _plans[memo] = plan
    if plan is None or not fwd.ready(plan.variant, lambda: _compile_launch(prob, lse2, delta), prob.device):
        return None
    if dq_acc is None or not fwd.tma_ready(dq_acc):
        dq_acc = torch.zeros(prob.q.shape, dtype=torch.float32, device=prob.device)
    lse2, delta = _padded_rows(prob, lse2), _padded_rows(prob, delta)
    s = plan.parts
    grad_k, grad_v = dk, dv
    if s > 1:  # the parts' sums, added up below
        parts = _partials(prob, s)
        dk, dv = parts[0], parts[1]
    compiled = _kernels.get(plan.variant)
    if compiled is None:
        grid, args, kw = _launch_args(prob, dout, lse2, delta, dq_acc, dk, dv)
        compiled = _kernel_module().attn_bwd_hopper[grid](*args, **kw)
        if _rt.fast_launch_supported(compiled):
            _kernels[plan.variant] = compiled
    else:
        L = fwd.LightDescriptor
        values = (L(prob.q), L(dout), L(prob.k), L(prob.v), L(dq_acc), L(lse2.view(-1)), L(delta.view(-1)), dk, dv,
                  *plan.fixed, *_alibi(prob), *plan.constexprs)
        _rt.run_compiled(compiled, plan.grid, _rt.stream_of(prob.device.index), values)
    if s > 1:
        sums = parts.view(2, prob.B, prob.Hkv, s, prob.Nk, prob.D).sum(3)
        grad_k.copy_(sums[0])
        grad_v.copy_(sums[1])
    global launches
    launches += 1
    return dq_acc
