"""The public entry point :func:`attention_varlen`: packed variable-length sequences, and the custom ops behind it.

Many sequences packed into one token stream, each attending only within itself (FlashAttention's varlen
convention): q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv], and int32 prefix sums
``cu_seqlens_q`` / ``cu_seqlens_k`` [B + 1] that say where each sequence starts.

Two routes:

* **packed** (the ``triton`` backend, and ``auto`` on a GPU): the op ``attnlab::attention_varlen`` runs the
  Triton kernels on the packed tensors, one program per (sequence, row tile); nothing is padded, and no
  prefix sum on the GPU is read back (the call is CUDA-graph safe). Its backward is the op
  ``attnlab::attention_varlen_backward``. ``torch.compile`` sees one op.
* **padded** (every other backend, and ``auto`` on a CPU): the sequences are gathered into a padded
  [B, max_seqlen, H, D] batch with per-sequence lengths, :func:`attnlab.attention` runs on it, and the rows are
  scattered back, all with differentiable tensor ops on the device (no host read either).
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab.api import attention
from attnlab.options import Options, define_op, eager_function, plain_eager
from attnlab.problem import Problem, make_packed_problem


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    align: str | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences: sequence b's queries ``q[cu_q[b]:cu_q[b+1]]`` attend only to its keys
    ``k[cu_k[b]:cu_k[b+1]]`` (and values), with causal and window aligned to the sequence's own lengths.

    q is [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] (Dv may differ from D); the prefix sums are
    int32 [B + 1]; ``max_seqlen_q`` / ``max_seqlen_k`` bound every sequence's length. ``align`` ("top_left" or
    "bottom_right") is required with ``causal`` or ``window``. Returns out [total_q, Hq, Dv] or, with
    ``return_lse``, (out, lse [Hq, total_q] float32). An empty sequence and a row with no allowed key give 0
    (lse -inf, or the head's sink with ``sinks``). Prefix sums on the host are validated (start 0, end at the
    total, never decreasing, no sequence longer than its max); prefix sums on the GPU, and any under
    ``torch.compile``, are never read back: rows that a too small ``max_seqlen_q`` leaves out are 0, and
    nothing is read out of bounds. Differentiable in q, k and v (and
    the sinks). ``softcap``, ``alibi_slopes`` ([Hq] or [B, Hq]) and ``sinks`` as in :func:`attnlab.attention`,
    ALiBi's distance taken within each sequence.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {return_lse!r}")
    opts = Options.of(causal, window, align, scale, "bnhd", softcap)
    prob = None
    if (causal or window is not None) and align is None:  # (traced too: the one check that needs no tensor)
        raise ValueError("attention_varlen needs align='top_left' or 'bottom_right' with causal or window: a "
                         "sequence's query and key lengths may differ, and the prefix sums may be on the GPU")
    if not torch.compiler.is_compiling():  # validate now, the same errors on both routes (traced: prefix sums
        # are taken as GPU ones are, clamped and never read, on either route)
        prob = make_packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   alibi_slopes=alibi_slopes, sinks=sinks, **_problem_keywords(opts))
    if not _packed_route(backend, q):
        cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if prob is None else (prob.packed.cu_q, prob.packed.cu_k)
        return _padded(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), alibi_slopes, sinks, opts,
                       backend, return_lse)
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sinks))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), alibi_slopes, sinks,
            *opts.flat(), backend, return_lse, needs_grad)
    if prob is not None and not needs_grad:
        out, lse = _forward(prob, return_lse)
    elif not torch.compiler.is_compiling() and plain_eager(q, k, v):
        out, lse = _EagerVarlen.apply(*args)
    else:
        out, lse = torch.ops.attnlab.attention_varlen(*args)
    return (out, lse) if return_lse else out


def _problem_keywords(opts: Options) -> dict[str, Any]:
    return {"causal": opts.causal, "window": opts.window, "align": opts.align, "scale": opts.scale,
            "softcap": opts.softcap}


def _packed_route(backend: str, q: torch.Tensor) -> bool:
    """Whether the call runs the Triton kernels on the packed tensors: backend ``triton``, or ``auto`` on a GPU
    (where auto's first choice for packed sequences is the Triton kernel). Decided from the name and the device
    only, so that tracing decides the same."""
    from attnlab.backends.triton.forward_kernel import IMPORT_ERROR

    if backend == "triton":
        return True
    return backend == "auto" and q.device.type == "cuda" and IMPORT_ERROR is None


# ---------------------------------------------------------------------------------------------------
# The packed route: the Triton kernels on the packed tensors
# ---------------------------------------------------------------------------------------------------
def _forward(prob: Problem, want_lse: bool, needs_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, Hq, Dv], lse [Hq, total_q] or an empty tensor) of a packed problem, by the Triton kernel."""
    from attnlab.backends import resolve

    be = resolve("triton", prob, needs_grad=needs_grad)
    out, out_bhnd = prob.new_out()
    lse = prob.new_lse() if (want_lse or needs_grad) else None
    if out.numel() and prob.Nk and prob.B:
        if needs_grad and prob.q.is_cuda:
            from attnlab.backends.triton.backward import compile_ahead

            compile_ahead(prob, out_bhnd, lse)  # the backward's kernels compile while the forward runs
        with torch.no_grad():
            be.forward(prob, out_bhnd, lse)
    else:
        out.zero_()
        if lse is not None:
            lse.copy_(prob.mods.empty_lse(lse))
    return out, lse[0] if lse is not None else prob.q.new_empty((0,), dtype=torch.float32)  # the schema's empty lse


_Tensor = torch.Tensor
_OptTensor = torch.Tensor | None
_BEFORE = [("q", _Tensor), ("k", _Tensor), ("v", _Tensor), ("cu_seqlens_q", _Tensor), ("cu_seqlens_k", _Tensor),
           ("max_seqlen_q", int), ("max_seqlen_k", int), ("alibi_slopes", _OptTensor), ("sinks", _OptTensor)]
_AFTER = [("backend", str), ("want_lse", bool), ("needs_grad", bool)]
_ARG_NAMES = tuple(n for n, _ in (*_BEFORE, *Options.FLAT, *_AFTER))


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, opts: Options) -> Problem:
    return make_packed_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=alibi_slopes, sinks=sinks,
                               **_problem_keywords(opts))


def _varlen_body(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, opts: Options, backend: str,
                 want_lse: bool, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(_packed(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, opts), want_lse, needs_grad)


def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, opts: Options, backend: str,
                 want_lse: bool, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    if not (want_lse or needs_grad):
        return out, q.new_empty((0,), dtype=torch.float32)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


_varlen_op, _varlen_impl = define_op("attnlab::attention_varlen", _BEFORE, _AFTER, tuple[_Tensor, _Tensor],
                                     _varlen_body, _varlen_fake)

_BWD_BEFORE = [("dout", _Tensor), ("dlse", _OptTensor), ("q", _Tensor), ("k", _Tensor), ("v", _Tensor),
               ("out", _Tensor), ("lse", _Tensor), ("cu_seqlens_q", _Tensor), ("cu_seqlens_k", _Tensor),
               ("max_seqlen_q", int), ("max_seqlen_k", int), ("alibi_slopes", _OptTensor), ("sinks", _OptTensor)]


def _varlen_backward_body(dout, dlse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks,
                          opts: Options, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of a packed call by the Triton backward kernels, from the saved out and lse (dsinks
    empty without sinks)."""
    from attnlab.backends.triton.backward import gradients

    prob = _packed(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, opts)
    bhnd = (lambda t: t.unsqueeze(0).transpose(1, 2))  # [total, H, D] -> [1, H, total, D]
    dq, dk, dv, dsinks = gradients(prob, bhnd(out), lse.unsqueeze(0), bhnd(dout),
                                   None if dlse is None else dlse.unsqueeze(0))
    dsinks = q.new_empty((0,)) if dsinks is None else dsinks.to(sinks.dtype)
    return prob.to_layout(dq), prob.to_layout(dk), prob.to_layout(dv), dsinks


def packed_gradients(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
                     align: str | None = None,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`attention_varlen` by the Triton backward kernels, from a forward's ``out``
    [total_q, Hq, Dv] and ``lse`` [Hq, total_q] handed in (SDPA's varlen flash op gives them; a ring of context
    parallelism hands merged ones)."""
    opts = Options.of(causal, window, align, scale, "bnhd", None)
    dq, dk, dv, _ = _varlen_backward_body(dout, None, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          int(max_seqlen_q), int(max_seqlen_k), None, None, opts, "triton")
    return dq, dk, dv


def _varlen_backward_fake(dout, dlse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks,
                          opts: Options, backend: str):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


_varlen_backward_op, _varlen_backward_impl = define_op(
    "attnlab::attention_varlen_backward", _BWD_BEFORE, [("backend", str)],
    tuple[_Tensor, _Tensor, _Tensor, _Tensor], _varlen_backward_body, _varlen_backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    a = dict(zip(_ARG_NAMES, inputs))
    ctx.want_lse = a["want_lse"]
    ctx.sizes = (a["max_seqlen_q"], a["max_seqlen_k"])
    ctx.options = (*(a[n] for n, _ in Options.FLAT), a["backend"])
    ctx.save_for_backward(a["q"], a["k"], a["v"], *output, a["cu_seqlens_q"], a["cu_seqlens_k"], a["alibi_slopes"],
                          a["sinks"])
    ctx.sinks_grad = a["sinks"] is not None and a["sinks"].requires_grad
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, backward_op=None):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.want_lse else None
    backward_op = backward_op or torch.ops.attnlab.attention_varlen_backward
    dq, dk, dv, dsinks = backward_op(dout, dlse, q, k, v, out, lse, cu_q, cu_k, *ctx.sizes, alibi_slopes, sinks,
                                     *ctx.options)
    # one gradient per op input: q, k, v, the prefix sums, the sizes, alibi_slopes (none), sinks, the options
    return (dq, dk, dv, None, None, None, None, None, dsinks if ctx.sinks_grad else None,
            *([None] * (len(_ARG_NAMES) - len(_BEFORE))))


_varlen_op.register_autograd(_backward, setup_context=_setup_context)


_EagerVarlen = eager_function("_EagerVarlen", _varlen_impl, _setup_context, _backward, _varlen_backward_impl)


# ---------------------------------------------------------------------------------------------------
# The padded route: gather to [B, max_seqlen, H, D], attention with lengths, scatter back
# ---------------------------------------------------------------------------------------------------
def _slots(cu: torch.Tensor, max_len: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, max_len], lengths [B]): the packed row of each padded slot, ``total`` (a spare row) for a slot
    past its sequence's end; lengths clamped to [0, max_len]. On the prefix sums' device, no host read."""
    starts = cu[:-1].long().clamp(0, total)
    lengths = (cu[1:].long().clamp(0, total) - starts).clamp(0, max_len)
    offs = torch.arange(max_len, device=cu.device)
    rows = torch.where(offs[None, :] < lengths[:, None], starts[:, None] + offs[None, :], total)
    return rows, lengths


def _gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[total, H, D] -> [B, max_len, H, D]: slots past a sequence's end read a zero row."""
    spare = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return spare[rows]


def _padded(q, k, v, cu_q, cu_k, max_q: int, max_k: int, alibi_slopes, sinks, opts: Options, backend: str,
            want_lse: bool):
    rows_q, len_q = _slots(cu_q, max_q, q.shape[0])
    rows_k, len_k = _slots(cu_k, max_k, k.shape[0])
    got = attention(_gather(q, rows_q), _gather(k, rows_k), _gather(v, rows_k), causal=opts.causal,
                    window=opts.window, align=opts.align or "top_left", scale=opts.scale, layout="bnhd",
                    q_len=len_q, kv_len=len_k, backend=backend, return_lse=want_lse, softcap=opts.softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
    out_p, lse_p = got if want_lse else (got, None)
    B, total = rows_q.shape[0], q.shape[0]
    flat = rows_q.reshape(-1)
    out = out_p.new_zeros((total + 1, *out_p.shape[2:])).index_copy(0, flat, out_p.reshape(B * max_q,
                                                                                           *out_p.shape[2:]))
    out = out[:total]
    if lse_p is None:
        return out
    lse = lse_p.new_full((lse_p.shape[1], total + 1), float("-inf"))
    lse = lse.index_copy(1, flat, lse_p.transpose(0, 1).reshape(lse_p.shape[1], B * max_q))[:, :total]
    return out, lse
