"""The Hopper forward's host side: which calls it takes, when it is compiled, and its launch.

On an sm_90 GPU the ``triton`` backend's forward runs the Gluon kernel of
:mod:`~attnlab.backends.triton.hopper_kernel` (warp-specialized, TMA, warpgroup MMA) for the calls
:func:`unsupported` accepts, and the portable kernel for every other call.

When it is compiled. A first call must not wait for a compile that a portable kernel already avoids
(:mod:`~attnlab.backends.triton.cold_launch`), so by default (``ATTNLAB_HOPPER=1``) the first call of a kernel
variant runs the portable kernel and nothing else (a first forward and backward compile their own kernels; a
compile beside them would share the GIL), the second starts the Hopper kernel's compile on a worker thread, and
the calls after it has finished run the Hopper kernel. Both compute the contract and pass the checker, but their
float32 sums run in different orders, so the first calls and the later ones may differ in the last bits.
``ATTNLAB_HOPPER=sync`` compiles on the first call and waits (benchmarks and tests: every call runs one kernel);
``ATTNLAB_HOPPER=0`` keeps every call on the portable kernel. :func:`set_mode` switches at run time.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import warnings
from concurrent.futures import Future
from typing import NamedTuple

import torch

from attnlab.backends.triton import configs
from attnlab.backends.triton import runtime as _rt
from attnlab.problem import Problem

BLOCK_M = 64  #: rows per consumer warpgroup; a program owns two such halves
BLOCK_N = 128  #: keys per tile (a consumer's 64 x 128 float32 scores: 64 registers per thread)
STAGES = 2  #: K/V slots in the ring (2 x 2 x 128 x 128 x 2 bytes, the Q and O halves: 192 KiB at D 128)
CONSUMER_REGS = 240  #: registers per thread of a consumer warpgroup (the loader's warpgroup keeps 24)
MAX_REGS = 168  #: the kernel's per-thread limit over its 12 warps: 2 x 240 + 24 = 3 x 168
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
MODES = ("0", "1", "sync")
#: Whether a launch without a band runs at most one program per SM, each looping over work items
#: (ATTNLAB_HOPPER_PERSISTENT=0: one program per item, as under a band). See hopper_kernel's docstring.
PERSISTENT: bool = os.environ.get("ATTNLAB_HOPPER_PERSISTENT", "1") != "0"
#: Whether the two consumer warpgroups take turns to issue their products (FlashAttention-3's ping-pong: one's
#: softmax runs while the other's products hold the tensor cores) rather than issue them as they come
#: (ATTNLAB_HOPPER_PINGPONG=0). See hopper_kernel's docstring.
PINGPONG: bool = os.environ.get("ATTNLAB_HOPPER_PINGPONG", "1") != "0"

#: Per head dim, the band width (keys a row may see: left + right + 1, both sides bounded) up to which a call runs
#: the portable kernel, which is faster on such narrow bands (docs/decisions.md, "Narrow windows on Hopper: the
#: portable kernel"). Tests that hold the Hopper kernel itself to the contract on narrow bands turn
#: NARROW_TO_PORTABLE off.
PORTABLE_BANDS: dict[int, int] = {64: 2048, 128: 128}
NARROW_TO_PORTABLE: bool = True

_SPELLINGS = {"0": "0", "false": "0", "off": "0", "no": "0", "1": "1", "true": "1", "on": "1", "yes": "1", "": "1",
              "sync": "sync"}


def _from_environment() -> str:
    """ATTNLAB_HOPPER as a mode; an unknown value warns and leaves the default."""
    given = os.environ.get("ATTNLAB_HOPPER", "1")
    mode = _SPELLINGS.get(given.strip().lower())
    if mode is None:
        warnings.warn(f"ATTNLAB_HOPPER={given!r} is not one of 0, 1 or sync (or off/on): using 1", stacklevel=2)
        return "1"
    return mode


_mode = _from_environment()


def set_mode(mode: str) -> str:
    """Set how the Hopper forward is used (module docstring): "1" (compile in the background, the default),
    "sync" (compile on the first call) or "0" (never); returns the previous mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"ATTNLAB_HOPPER must be one of {MODES}; got {mode!r}")
    prev, _mode = _mode, mode
    return prev


def mode() -> str:
    """The current mode ("0", "1" or "sync")."""
    return _mode


def gluon_module(name: str):
    """The Gluon kernel module ``attnlab.backends.triton.<name>``, or the reason it cannot be imported (a triton
    without Gluon's Hopper API)."""
    try:
        return importlib.import_module(f"attnlab.backends.triton.{name}")
    except Exception as err:  # any import failure means: no Hopper path
        return f"the Hopper kernel {name} needs triton's Gluon Hopper API: {err}"


@functools.cache
def _kernel_module():
    """The forward's Gluon module, or the reason it cannot be imported."""
    return gluon_module("hopper_kernel")


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def on_sm90(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU (Hopper; the warpgroup MMA is sm_90's alone)."""
    return t.is_cuda and _is_sm90(t.device.index)


def tma_ready(t: torch.Tensor) -> bool:
    """A tensor TMA can read: last dim contiguous, other strides positive (no broadcast) and, with the base,
    16-byte aligned."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * size) % 16 == 0 for s in t.stride()[:-1]))


def band_width(left: int | None, right: int | None) -> int | None:
    """Keys a row may see under a window bounded on both sides (left + right + 1, at most 0 for an empty band);
    None when a side is unbounded."""
    return None if left is None or right is None else left + right + 1


def unsupported(prob: Problem, out: torch.Tensor) -> str | None:
    """Why the Hopper forward does not take ``prob`` (None: it does). It computes float16/bfloat16, D = Dv of 64
    or 128, the causal and window bands in either alignment, q_len, Nq != Nk, GQA, lse, the soft cap and ALiBi;
    kv_len, explicit masks and biases, packed sequences, sinks and bands up to :data:`PORTABLE_BANDS` keys wide run
    on the portable kernel. (kv_len: the kernel masks keys past it, but reads K and V in whole tiles, and P V would
    multiply NaN past a length by 0; the contract keeps what lies past a length out of every result.)"""
    if _mode == "0":
        return "ATTNLAB_HOPPER=0"
    q = prob.q
    if not on_sm90(q):
        return "sm_90 GPUs only"
    if prob.dtype not in (torch.float16, torch.bfloat16):
        return "float16 and bfloat16 only"
    if prob.D != prob.Dv or prob.D not in HEAD_DIMS:
        return f"D = Dv in {HEAD_DIMS} only"
    spec = prob.spec
    width = band_width(spec.left, spec.right)
    if NARROW_TO_PORTABLE and width is not None and width <= PORTABLE_BANDS[prob.D]:
        return (f"a band of {width} keys per row at D {prob.D} runs faster on the portable kernel (up to "
                f"{PORTABLE_BANDS[prob.D]})")
    if prob.packed is not None:
        return "no packed sequences"
    if spec.kv_len is not None:
        return "no kv_len (whole K/V tiles are read: values past a length would reach P V)"
    if spec.mask is not None or spec.bias is not None or prob.mods.sinks is not None:
        return "no explicit mask, bias or sinks"
    if _items(q) >= 2**31:
        return "at most 2**31 - 1 work items (row tiles of 128 x B x Hq)"
    if not all(tma_ready(t) for t in (q, prob.k, prob.v, out)):
        return "TMA needs the last dim contiguous and 16-byte aligned strides and bases"
    if isinstance(_kernel_module(), str):
        return _kernel_module()
    return None


def descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor of ``t`` (float16, bfloat16 or float32) for blocks ``block``, in the shared layout
    the kernels' buffers take (NVMMA's default for the block)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    names = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    layout = gl.NVMMASharedLayout.get_default_for(block, names[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _items(q: torch.Tensor) -> int:
    """Work items of a launch on [B, H, N, D] views: row tiles of 2 * BLOCK_M x B x Hq."""
    B, Hq, Nq, _ = q.shape
    return -(-Nq // (2 * BLOCK_M)) * B * Hq


def _persistent(uneven: bool) -> bool:
    """Whether a launch loops over work items in at most one program per SM: when they cost the same (no band,
    no lengths: ``uneven`` False), unless :data:`PERSISTENT` is off. Otherwise one program per item lets the
    hardware balance them. (Score modifiers also take one program per item: in the loop over items their
    per-score arithmetic spills registers, ptxas sm_90a.)"""
    return PERSISTENT and not uneven


def _grid(q: torch.Tensor, persistent: bool) -> tuple[int, int, int]:
    items = _items(q)
    if not persistent or not q.is_cuda:  # (CPU tensors: a compile's stand-ins; the grid is not used)
        return (items, 1, 1)
    return (min(items, _rt.sm_count(q.device.index)), 1, 1)


class Extras(NamedTuple):
    """What the lengths and the score modifiers add to a launch (None: absent): int32 [B] lengths on the GPU, the
    ALiBi slopes read through ``alibi_strides`` (of their [B, Hq] view) and the soft cap in base 2."""

    kv_len: torch.Tensor | None = None
    q_len: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    alibi_strides: tuple[int, int] = (0, 0)
    cap2: float | None = None

    def arguments(self, placeholder: torch.Tensor) -> tuple:
        """KvLen, QLen, Alibi, s_ab, s_ah, cap2 as the kernel takes them (``placeholder`` for absent tensors)."""
        return (placeholder if self.kv_len is None else self.kv_len, placeholder if self.q_len is None else self.q_len,
                placeholder if self.alibi is None else self.alibi, *self.alibi_strides,
                0.0 if self.cap2 is None else self.cap2)

    def flags(self) -> tuple[bool, bool, bool, bool]:
        """HAS_KV_LEN, HAS_Q_LEN, HAS_SOFTCAP, HAS_ALIBI."""
        return self.kv_len is not None, self.q_len is not None, self.cap2 is not None, self.alibi is not None


NO_EXTRAS = Extras()  #: a launch without lengths or score modifiers


def _extras(prob: Problem) -> Extras:
    spec, mods = prob.spec, prob.mods
    return Extras(spec.kv_len, spec.q_len, mods.alibi, tuple(mods.alibi.stride()) if mods.alibi is not None else (0, 0),
                  None if mods.softcap is None else mods.softcap * LOG2E)


def _launch_args(q, k, v, out, lse, qk_scale: float, left: int | None, right: int | None, bottom_right: bool,
                 extras: Extras = NO_EXTRAS) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keywords) of one launch on [B, H, N, D] views."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    args = (descriptor(q, [1, 1, BLOCK_M, D]), descriptor(k, [1, 1, BLOCK_N, D]),
            descriptor(v, [1, 1, BLOCK_N, D]), descriptor(out, [1, 1, BLOCK_M, D]),
            lse if lse is not None else out, *(lse.stride() if lse is not None else (0, 0, 0)),
            Nq, Nk, B, Hq, Hq // k.shape[1], qk_scale, left if left is not None else 0,
            right if right is not None else 0, *extras.arguments(out))
    persistent = _persistent(left is not None or right is not None or any(extras.flags()))
    has_kv_len, has_q_len, has_softcap, has_alibi = extras.flags()
    kw = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, STAGES=STAGES, HAS_LEFT=left is not None,
              HAS_RIGHT=right is not None, BOTTOM_RIGHT=bottom_right, WRITE_LSE=lse is not None,
              CONSUMER_REGS=CONSUMER_REGS, PERSISTENT=persistent, PINGPONG=PINGPONG, HAS_KV_LEN=has_kv_len,
              HAS_Q_LEN=has_q_len, HAS_SOFTCAP=has_softcap, HAS_ALIBI=has_alibi, num_warps=4, maxnreg=MAX_REGS,
              **configs.COMPILE_OPTIONS)
    return _grid(q, persistent), args, kw


def _problem_args(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> tuple[tuple, tuple, dict]:
    spec = prob.spec
    q, k = prob.q, prob.k
    return _launch_args(q, k, prob.v, out, lse, prob.scale * LOG2E, clamped_width(spec.left, q, k),
                        clamped_width(spec.right, q, k), spec.align == "bottom_right", _extras(prob))


@functools.cache
def _descriptor_defaults() -> dict:
    """The installed triton's host tensor descriptor fields that have defaults (padding; triton 3.9 adds
    round_f32_to_tf32), so that :class:`LightDescriptor` carries every field its launcher reads."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


class LightDescriptor:
    """What Triton's launcher reads of a host tensor descriptor for a repeated launch: base, shape, strides and
    the fields with defaults; the block and the shared layout are the compiled kernel's, fixed by its variant
    (the forward's and the backward's repeated launches use it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__dict__.update(_descriptor_defaults())
        self.base, self.shape, self.strides = t, list(t.shape), list(t.stride())


#: Compiled kernels by variant, for launches without the JIT's binding (built descriptors, specialization).
_kernels: dict[tuple, object] = {}


def clamped_width(w: int | None, q: torch.Tensor, k: torch.Tensor) -> int | None:
    """A band width clamped to +-(Nq + Nk): the same band (past that every key, or none, is on its side), and
    every bound the kernel computes from it stays a 32-bit int (the JIT types an int argument by its value)."""
    if w is None:
        return None
    bound = q.shape[2] + k.shape[2]
    return max(-bound, min(w, bound))


def _launch(key: tuple, q, k, v, out, lse, qk_scale: float, left: int | None, right: int | None,
            bottom_right: bool, extras: Extras) -> None:
    """One launch on [B, H, N, D] views: the first of a variant through the JIT, later ones straight to the
    compiled kernel's launcher with the values the JIT would pass (every parameter the JIT specializes on is in
    the variant: the ints are not specialized, the descriptors' types follow dtype and D)."""
    left, right = clamped_width(left, q, k), clamped_width(right, q, k)
    compiled = _kernels.get(key)
    if compiled is None:
        grid, args, kw = _launch_args(q, k, v, out, lse, qk_scale, left, right, bottom_right, extras)
        compiled = _kernel_module().attn_fwd_hopper[grid](*args, **kw)
        if _rt.fast_launch_supported(compiled):
            _kernels[key] = compiled
        return
    B, Hq, Nq, D = q.shape
    write_lse = lse is not None
    persistent = _persistent(left is not None or right is not None or any(extras.flags()))
    L = LightDescriptor
    values = (L(q), L(k), L(v), L(out), lse if write_lse else out,
              *(lse.stride() if write_lse else (0, 0, 0)), Nq, k.shape[2], B, Hq, Hq // k.shape[1], qk_scale,
              0 if left is None else left, 0 if right is None else right, *extras.arguments(out), BLOCK_M, BLOCK_N,
              D, STAGES, left is not None, right is not None, bottom_right, write_lse, CONSUMER_REGS, persistent,
              PINGPONG, *extras.flags())
    _rt.run_compiled(compiled, _grid(q, persistent), _rt.stream_of(q.device.index), values)


def _variant(prob: Problem, lse: torch.Tensor | None) -> tuple:
    """What a compiled kernel is specialized on, beyond what every taken call shares (16-byte alignment)."""
    spec = prob.spec
    band, flags = spec.left is not None or spec.right is not None, _extras(prob).flags()
    return (prob.q.device.index, prob.dtype, prob.D, spec.left is not None, spec.right is not None,
            spec.align == "bottom_right", lse is not None, *flags, PINGPONG, _persistent(band or any(flags)))


launches = 0  #: Hopper launches by the whole way so far (tests read it; fast calls do not count)

#: Compiles by variant: a Future while in flight, then True (ready) or the error's text (never taken).
_compiles: dict[tuple, Future | bool | str] = {}
_seen: set[tuple] = set()  #: variants called once, their compile not started yet
_lock = threading.Lock()


def _ready(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> bool:
    """Whether the variant's kernel is compiled; on its second call starts its compile (in sync mode: on its first,
    and waits)."""
    return ready(_variant(prob, lse), lambda: (_kernel_module().attn_fwd_hopper, *_problem_args(prob, out, lse)),
                 prob.q.device)


def ready(key: tuple, launch, device: torch.device) -> bool:
    """Whether the Hopper kernel variant ``key`` (the forward's or the backward's) is compiled; on its second call
    starts its compile on a worker thread (in sync mode: on its first, and waits). ``launch()`` gives the
    (kernel, grid, arguments, keywords) it compiles for."""
    state = _compiles.get(key)
    if state is True:
        return True
    if isinstance(state, str):
        return False
    if isinstance(state, Future):
        if _mode == "sync":
            _settle(key, state)
        return _compiled(key)
    if _mode != "sync" and key not in _seen:  # the variant's first call: the portable kernel alone
        _seen.add(key)
        return False
    kernel, grid, args, kw = launch()
    from attnlab.backends.triton import background

    with _lock:
        if key not in _compiles:
            _compiles[key] = background.ahead(kernel, grid, args, kw, device, jit=True)
    return ready(key, launch, device) if _mode == "sync" else False


def failed(prob: Problem, lse: torch.Tensor | None) -> bool:
    """Whether the variant's compile failed (its calls stay on the portable kernel for good)."""
    return isinstance(_compiles.get(_variant(prob, lse)), str)


def _compiled(key: tuple) -> bool:
    """Whether the variant ``key``'s compile has finished well (settling a finished one)."""
    state = _compiles.get(key)
    if isinstance(state, Future) and state.done():
        _settle(key, state)
    return _compiles.get(key) is True


def _settle(key: tuple, future: Future) -> None:
    try:
        future.result()
        _compiles[key] = True
    except Exception as err:  # a variant that does not compile stays on the portable kernel
        _compiles[key] = f"{type(err).__name__}: {err}"


def forward(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> bool:
    """Run the Hopper forward for ``prob`` if it takes it and its kernel is compiled; False when the caller runs
    the portable kernel instead (not taken, or still compiling)."""
    if unsupported(prob, out) is not None or not _ready(prob, out, lse):
        return False
    spec = prob.spec
    _launch(_variant(prob, lse), prob.q, prob.k, prob.v, out, lse, prob.scale * LOG2E, spec.left, spec.right,
            spec.align == "bottom_right", _extras(prob))
    global launches
    launches += 1
    return True


def fast_call(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
    """The fast call of ``prob``'s signature (:mod:`attnlab.fast_calls`) when the Hopper forward takes it: out and
    lse allocated as this call's were and one launch; None on a call made before the kernel is compiled (that
    call takes the whole way)."""
    key, write_lse = _variant(prob, lse), lse is not None
    lse_shape, dev = (prob.B, prob.Hq, prob.Nq), prob.device
    spec, scale = prob.spec, prob.scale * LOG2E
    left, right, bottom_right = spec.left, spec.right, spec.align == "bottom_right"
    bnhd = prob.layout == "bnhd"
    empty_like, contiguous = torch.empty_like, torch.contiguous_format
    first = _extras(prob)  # the slopes' strides and the cap are the signature's; lengths and slopes come per call
    a_strides, cap2 = first.alibi_strides, first.cap2
    uneven = left is not None or right is not None or any(first.flags())
    del first  # (no tensor of the first call is kept)
    width = band_width(left, right)
    narrow = width is not None and width <= PORTABLE_BANDS[prob.D]

    def call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks):
        if (_mode == "0" or not _compiled(key) or key[-2:] != (PINGPONG, _persistent(uneven))
                or (narrow and NARROW_TO_PORTABLE)):  # (switched since)
            return None
        o = empty_like(q, memory_format=contiguous)  # in the caller's layout, as the whole way allocates it
        m = torch.empty(lse_shape, dtype=torch.float32, device=dev) if write_lse else None
        extras = Extras(kv_len, q_len, alibi_slopes, a_strides, cap2)
        if bnhd:  # the kernel reads [B, H, N, D] views
            _launch(key, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2), m, scale, left,
                    right, bottom_right, extras)
        else:
            _launch(key, q, k, v, o, m, scale, left, right, bottom_right, extras)
        return o, m

    return call
