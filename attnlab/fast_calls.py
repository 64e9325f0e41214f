"""Repeated calls: a call whose signature was seen before skips validation, the backend choice and planning.

A call's *signature* is everything :func:`attnlab.attention` validates and plans from, apart from the tensors'
addresses and the values held by GPU length tensors: the shapes, strides, dtypes, devices and 16-byte alignment
of q, k, v and of the mask, GPU length, ALiBi slope, sink and KV-append tensors; lengths given as a Python int
(by value); and the keywords (the softcap by value).
The first call of a signature goes the whole way (``make_problem``, ``resolve``, the backend's launch plan).
When the chosen backend hands back a fast call for it (:meth:`attnlab.backends.Backend.fast_call`: the Triton
kernels on a GPU do, the CUDA kernels for dense calls without lengths or masks whose launch needs no split
workspace or staged output), the later calls of that signature run it directly: the output's allocation and the
kernel launches, with nothing validated twice.
The answer is the same as the whole way's: what validation checks depends on the signature alone, and what it
computes from values (GPU lengths clamped to [0, N]) the kernels compute again where they load the lengths.

The whole way is taken every time by calls that need a gradient or are being traced (they go through the
custom op or its eager autograd twin), calls with lengths, masks or a block table on the host (validated by
value), tensors on the CPU or of a tensor subclass (sinks and slopes may be an ``nn.Parameter``), calls whose
GPU is not the current one, and calls with poisoned outputs. A paged cache's call has a signature when its
block table is on the GPU (its ids are never read on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnlab.masks import BIAS_DTYPES, device_lengths, int_lengths

#: A backend's fast call: (q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks[, k_new, v_new]) ->
#: (out, lse or None), the new keys and values only for a call with a KV append (kv_len: the lengths before it);
#: the slopes are the caller's float32 [Hq] or [B, Hq] tensor, the sinks contiguous (in their own dtype);
#: lengths are None or contiguous, 16-byte aligned int32 [B] GPU tensors, NOT clamped (the Triton kernels clamp
#: every length they load: :func:`attnlab.backends.triton.tiles.lengths`; a backend whose kernels do not must
#: clamp them itself),
#: the same dtype and alignment as the whole way's lengths (its compiled kernels are specialized on them);
#: the mask and block table are the caller's tensors or None. None back means "take the whole way" (a global
#: switch the plan depends on has changed since).
FastCall = Callable[..., "tuple[torch.Tensor, torch.Tensor | None] | None"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
#: Entries by signature. Bounded: the oldest goes first.
_CALLS: dict[tuple, _Entry] = {}
MAX_CALLS = 1024


def tensor_key(t: torch.Tensor) -> tuple:
    """What a plan or fast call depends on of a tensor: shape, strides, dtype, device and 16-byte alignment."""
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)


def _lengths_key(x: Any, device: int) -> Any:
    """None, ("int", value) or a GPU tensor's metadata; raises LookupError for lengths validated by value and
    for lengths on another GPU than q's (the whole way moves those; a fast call would not)."""
    if x is None:
        return None
    if type(x) is int:
        return ("int", x)
    if type(x) is _Tensor and x.is_cuda and x.get_device() == device and x.dim() == 1:  # 0-dim: expanded
        return tensor_key(x)
    raise LookupError


def _mod_key(t: Any, device: int, floating: bool) -> Any:
    """None or a modifier tensor's metadata: float32 slopes that do not require grad (``floating`` False) or
    floating sinks (``floating`` True: a call that differentiates them never comes here; a plain tensor or a
    parameter), on q's GPU; raises LookupError for anything else (the whole way validates it, and refuses or
    converts it)."""
    if t is None:
        return None
    # A model's learned sinks are an ``nn.Parameter`` (a subclass that computes as a plain tensor); a call that
    # reaches here does not differentiate them.
    if type(t) in (_Tensor, _Parameter) and t.is_cuda and t.get_device() == device and (
            t.dtype.is_floating_point if floating else t.dtype == torch.float32 and not t.requires_grad):
        return tensor_key(t)
    raise LookupError


def signature(q, k, v, kv_len, q_len, mask, block_table, causal, window, align, scale, layout, backend,
              want_lse, softcap=None, alibi_slopes=None, sinks=None, k_new=None, v_new=None) -> tuple | None:
    """The call's signature, or None when the call must take the whole way (see the module docstring)."""
    if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and q.is_cuda and k.is_cuda
            and v.is_cuda):
        return None
    if k_new is None and v_new is None:
        new_key = None
    elif (type(k_new) is _Tensor and type(v_new) is _Tensor and k_new.is_cuda and v_new.is_cuda
          and not (k_new.requires_grad or v_new.requires_grad)):
        new_key = (tensor_key(k_new), tensor_key(v_new))
    else:
        return None  # the whole way refuses it
    if type(causal) is not bool:
        return None
    try:
        if window is not None:
            left, right = window
            if not all(x is None or type(x) is int for x in (left, right)):
                return None
            window = (left, right)
        if mask is not None:
            if type(mask) is not _Tensor or not mask.is_cuda:
                return None
            if mask.dtype != torch.bool and mask.dtype not in BIAS_DTYPES:
                return None  # the full path converts it (or refuses it): not the caller's buffer
            mask_key = tensor_key(mask)
        else:
            mask_key = None
        if block_table is not None:
            if type(block_table) is not _Tensor or not block_table.is_cuda:
                return None  # a table on the host has its ids checked
            table_key = tensor_key(block_table)
        else:
            table_key = None
        if any(x is not None and type(x) not in (int, float) for x in (scale, softcap)):
            return None  # numpy scalars, Decimal, Fraction equal a float as keys; validation decides them
        device = q.get_device()
        if type(alibi_slopes) is _Tensor and alibi_slopes.dim() == 1 and alibi_slopes.stride() != (1,):
            return None  # the whole way makes [Hq] slopes contiguous: a copy, not the caller's tensor
        return (tensor_key(q), tensor_key(k), tensor_key(v), _lengths_key(kv_len, device),
                _lengths_key(q_len, device), mask_key, table_key, causal, window, align,
                None if scale is None else float(scale), layout, backend, bool(want_lse),
                None if softcap is None else float(softcap), _mod_key(alibi_slopes, device, False),
                _mod_key(sinks, device, True), new_key)
    except (LookupError, TypeError, ValueError, RuntimeError):  # host lengths, a malformed keyword, no storage
        return None


class _Entry:
    """A fast call and how to make its lengths kernel-ready: None (absent), ``(B, value)`` for an int length
    (a new int32 tensor each call, on the call's stream), True for a GPU tensor passed as given (int32,
    contiguous and 16-byte aligned, as the whole way's clamped copy is: no kernel of its own) or the limit of
    the clamped int32 copy of any other GPU tensor (an int64 one, say); and whether the sinks go as given
    (contiguous) or as a contiguous copy, as the whole way's."""

    __slots__ = ("device", "fast", "kv", "ql", "sinks_as_given")

    def __init__(self, fast: FastCall, device: int, kv: Any, ql: Any, sinks_as_given: bool = True) -> None:
        self.fast, self.device, self.kv, self.ql = fast, device, kv, ql
        self.sinks_as_given = sinks_as_given

    def _lengths(self, how: Any, given: Any) -> torch.Tensor:
        """Lengths given as ``given`` made kernel-ready by ``how`` (never None: the caller checks)."""
        if how is True:
            return given
        if type(how) is int:
            return device_lengths(given, how)
        return int_lengths(how[0], how[1], torch.device("cuda", self.device))

    def __call__(self, q, k, v, kv_len, q_len, mask, block_table, alibi_slopes=None, sinks=None, k_new=None,
                 v_new=None):
        if torch.cuda.current_device() != self.device:
            return None
        kv = None if self.kv is None else self._lengths(self.kv, kv_len)
        ql = None if self.ql is None else self._lengths(self.ql, q_len)
        if sinks is not None and not self.sinks_as_given:
            sinks = sinks.contiguous()
        if k_new is not None:  # a KV append's fast call (only a backend that writes it in its launch makes one)
            return self.fast(q, k, v, kv, ql, mask, block_table, alibi_slopes, sinks, k_new, v_new)
        return self.fast(q, k, v, kv, ql, mask, block_table, alibi_slopes, sinks)


def lookup(key: tuple | None) -> _Entry | None:
    return None if key is None else _CALLS.get(key)


def remember(key: tuple, fast: FastCall, prob, kv_len: Any, q_len: Any) -> None:
    """Keep ``fast`` for later calls of ``key``; ``prob`` is the first call's problem. No tensor of the first
    call is kept: an int length is made anew on each call's stream (a tensor made on the first call's stream
    could still be in flight when another stream reads it)."""

    def lengths(given: Any, limit: int) -> Any:
        if given is None:
            return None
        if type(given) is int:
            return (prob.B, given)
        as_given = given.dtype == torch.int32 and given.stride() == (1,) and given.data_ptr() % 16 == 0
        return True if as_given else limit  # (dtype, strides and alignment are in the signature)

    sinks = prob.mods.sinks
    as_given = sinks is None or sinks.stride() == (1,)
    evict_oldest(_CALLS, MAX_CALLS)
    _CALLS[key] = _Entry(fast, prob.device.index, lengths(kv_len, prob.Nk), lengths(q_len, prob.Nq), as_given)


def evict_oldest(cache: dict, limit: int) -> None:
    """Drop the oldest entries of ``cache`` until one more fits under ``limit``; safe when another thread
    evicts at the same time (a key already gone, or the dict changing size, is no error)."""
    while len(cache) >= max(limit, 1):
        try:
            cache.pop(next(iter(cache), None), None)
        except RuntimeError:  # changed size while iterating: look again
            continue


def clear() -> None:
    """Forget every signature (tests use this; nothing else needs to)."""
    _CALLS.clear()
