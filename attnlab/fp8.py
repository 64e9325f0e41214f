"""The FP8 forward: :func:`attnlab.attention` on float8_e4m3fn q, k and v with their descales.

FlashAttention-3's convention: a tensor's real value is its stored e4m3 value times its descale (one per tensor,
or one per batch entry and head: :func:`attnlab.problem.descales`); the output is bfloat16 and lse float32. The
kernel (backend ``triton``, compute capability 8.9+) runs Q K^T and P V on the 8-bit MMA with float32
accumulators and P rounded to e4m3; ``reference`` computes the real values in float64, and ``torch`` in float32
with P rounded as the kernel rounds it (the checker's baseline). Every mask, length, GQA and score modifier of the
contract applies.

It is a forward for inference: inputs that require grad are refused (no gradient is ever silently dropped), and
so are paged caches and KV appends. A call runs the custom op ``attnlab::attention_fp8`` (one node for
``torch.compile``), eagerly without the dispatcher; the descales are packed per call, so it has no fast call.
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab import backends as _backends
from attnlab.options import Options, define_op, lengths_arg, plain_eager
from attnlab.problem import FP8, descale_number, descales, make_problem


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_descale: Any, k_descale: Any,
                  v_descale: Any, kv_len: Any, q_len: Any, mask: torch.Tensor | None, alibi_slopes: Any, sinks: Any,
                  opts: Options, backend: str, return_lse: bool, block_table: Any = None, k_new: Any = None,
                  poison: bool = False):
    """:func:`attnlab.attention` for FP8 inputs (it routes here): out, or (out, lse) with ``return_lse``.
    ``poison``: fill the outputs with NaN before the backend runs (the checker's, :func:`attnlab.api.poison_outputs`;
    eager calls only)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor; got {type(q).__name__}")
    if q.dtype != FP8:  # descales given with inputs of another dtype: make_problem's error, before any other
        descales(q, 1, q_descale, k_descale, v_descale)
    if block_table is not None or k_new is not None:
        raise ValueError("the FP8 forward takes dense k and v: no block_table, k_new or v_new (an FP8 call is a "
                         "prefill forward; decode from a bfloat16 or float16 cache)")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in
                                       (q, k, v, mask, sinks, q_descale, k_descale, v_descale)):
        raise ValueError("the FP8 forward has no backward, and an input requires grad: its output would silently "
                         "carry no gradient. Call it under torch.no_grad() or on detached inputs, or train in "
                         "bfloat16")
    scales = (q_descale, k_descale, v_descale)
    if torch.compiler.is_compiling() or not plain_eager(q, k, v):
        kv_len, q_len = lengths_arg(kv_len), lengths_arg(q_len)  # (the op takes lengths as tensors)
        scales = tuple(_as_tensor(n, d, q) for n, d in zip(("q_descale", "k_descale", "v_descale"), scales))
        out, lse = torch.ops.attnlab.attention_fp8(q, k, v, *scales, kv_len, q_len, mask, alibi_slopes, sinks,
                                                   *opts.flat(), backend, return_lse)
    else:
        out, lse = _fp8_run(q, k, v, *scales, kv_len, q_len, mask, alibi_slopes, sinks, opts, backend, return_lse,
                            poison)
    return (out, lse) if return_lse else out


def _as_tensor(name: str, d: Any, q: torch.Tensor) -> torch.Tensor | None:
    """A descale as the op takes it: None or a tensor (a number becomes a float32 scalar on q's device)."""
    if d is None or isinstance(d, torch.Tensor):
        return d  # (make_problem checks a tensor in the op)
    if not torch.compiler.is_compiling():
        descale_number(name, d)  # (a number or an error)
    # (traced, a number that changed between compiled calls is symbolic: not read here, only filled in)
    return torch.full((), d, dtype=torch.float32, device=q.device)


def _fp8_body(q, k, v, q_descale, k_descale, v_descale, kv_len, q_len, mask, alibi_slopes, sinks, opts: Options,
              backend: str, want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_run(q, k, v, q_descale, k_descale, v_descale, kv_len, q_len, mask, alibi_slopes, sinks, opts, backend,
                    want_lse, False)


def _fp8_run(q, k, v, q_descale, k_descale, v_descale, kv_len, q_len, mask, alibi_slopes, sinks, opts: Options,
             backend: str, want_lse: bool, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    prob = make_problem(q, k, v, kv_len=kv_len, q_len=q_len, mask=mask, alibi_slopes=alibi_slopes, sinks=sinks,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **opts.keywords())
    be = _backends.resolve(backend, prob)
    out, out_bhnd = prob.new_out()
    lse = prob.new_lse() if want_lse else None
    if out.numel() == 0 or prob.Nk == 0 or prob.B == 0:
        out.zero_()
        if lse is not None:
            lse.copy_(prob.mods.empty_lse(lse))
    else:
        if poison:  # the checker's: an element the backend fails to write shows up as NaN
            out.fill_(float("nan"))
            if lse is not None:
                lse.fill_(float("nan"))
        with torch.no_grad():
            be.forward(prob, out_bhnd, lse)
    return out, lse if lse is not None else q.new_empty((0,), dtype=torch.float32)


def _fp8_fake(q, k, v, q_descale, k_descale, v_descale, kv_len, q_len, mask, alibi_slopes, sinks, opts: Options,
              backend: str, want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16)
    if not want_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    bhnd = opts.layout == "bhnd"
    B, Hq, Nq = (q.shape[0], q.shape[1], q.shape[2]) if bhnd else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty((B, Hq, Nq), dtype=torch.float32)


_T, _OptT = torch.Tensor, torch.Tensor | None
_BEFORE = [("q", _T), ("k", _T), ("v", _T), ("q_descale", _OptT), ("k_descale", _OptT), ("v_descale", _OptT),
           ("kv_len", _OptT), ("q_len", _OptT), ("mask", _OptT), ("alibi_slopes", _OptT), ("sinks", _OptT)]
_AFTER = [("backend", str), ("want_lse", bool)]
_fp8_op, _ = define_op("attnlab::attention_fp8", _BEFORE, _AFTER, tuple[_T, _T], _fp8_body, _fp8_fake)
