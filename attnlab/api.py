"""The public entry point :func:`attention`, and the PyTorch custom ops behind it.

``attention`` is the op ``attnlab::attention`` (``torch.library.custom_op``): ``torch.compile(fullgraph=True)``
sees one node (its fake implementation gives the output shapes without running anything) and autograd
reaches its backward, the op ``attnlab::attention_backward``. Outside tracing the dispatcher is skipped: a call
that needs no gradient runs the op's implementation directly, and one that needs a gradient runs the same
implementation and autograd formula as a ``torch.autograd.Function`` (:class:`_EagerAttention`).

Gradients: the kernel backends (``triton`` and the CUDA kernels) differentiate through the Triton backward
kernels (:mod:`attnlab.backends.triton.backward`), from the forward's saved out and lse; the backends built from PyTorch
ops (``reference``, ``torch``, ``sdpa``), and any call whose float mask requires grad, through the chunked
backward of :mod:`attnlab.textbook_backward` (the mask's gradient included). A backend
without a backward is refused for inputs that require grad, and ``auto`` then picks one that has one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from attnlab import backends as _backends
from attnlab import fast_calls as _calls
from attnlab import kv_append
from attnlab.fp8 import attention_fp8
from attnlab.options import Options, define_op, eager_function, lengths_arg, plain_eager
from attnlab.paged import gather_paged, paged_kv, paged_placeholders
from attnlab.problem import FP8, make_problem
from attnlab.textbook_backward import sum_to_shape, textbook_backward

_poison = False
#: The Problem an eager call that needs a gradient validated, handed to its forward (``given``) and, through the
#: autograd context, to its backward (``backward``), so that neither validates the same call again. Per thread;
#: set only around the one call that takes it.
_handoff = threading.local()


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Fill every output with NaN before the backend runs, so an element it fails to write shows up.

    The checker uses this: an unwritten element then fails as NaN instead of passing by luck.
    """
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    align: str | None = None,
    kv_len: Any = None,
    q_len: Any = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "bhnd",
    backend: str = "auto",
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked multi-head attention ``softmax(scale * q k^T + bias, masked) v``.

    q is [B, Hq, Nq, D] and k, v are [B, Hkv, Nk, D] (layout "bhnd"), or [B, N, H, D] (layout "bnhd"),
    any strides. GQA/MQA: query head h reads kv head h // (Hq // Hkv). Masks: ``causal`` and ``window``
    (relative to the diagonal set by ``align``), effective lengths ``kv_len`` / ``q_len`` [B], and an
    explicit ``mask`` (bool, True = attend; or float, an additive bias) broadcastable to
    [B, Hq, Nq, Nk]. A row with no allowed key returns 0 (and lse -inf), never NaN.

    Returns out (q's dtype, device and layout) or, with ``return_lse``, (out, lse [B, Hq, Nq] float32).
    Lengths given on the host (ints, lists, CPU tensors) are validated (ValueError outside [0, N]); lengths
    already on the GPU are never read back (no device sync): values outside [0, N] are clamped to it.
    Gradients: when q, k, v (or a float mask) require grad, ``auto`` picks a differentiable backend, and naming
    a backend without a backward is a ValueError rather than an output that silently carries no gradient.

    Score modifiers (:mod:`attnlab.score_mods`): ``softcap=c`` caps the scaled scores at c * tanh(s / c) before
    any bias or mask (Gemma-2); ``alibi_slopes`` (float32 [Hq] or [B, Hq]) subtracts slope * |i + Lk - Lq - j|
    (FlashAttention's rule, never materialized); ``sinks`` ([Hq], gpt-oss) adds one virtual key of that logit
    and value 0 to every row's softmax: lse counts it, an empty row gives 0 with lse = its sink, and the sinks
    get a gradient.

    FP8 (:mod:`attnlab.fp8`): float8_e4m3fn q, k and v, whose real values are their stored values times
    ``q_descale``, ``k_descale``, ``v_descale`` (None for 1, a number, a one-element tensor, or a float [B, H] per
    head: the kv heads for k and v, q's heads or the kv heads for q). The output is bfloat16; a forward only (no
    gradient, no paged cache or append); the kernel is ``triton`` on compute capability 8.9+.

    KV append (:mod:`attnlab.kv_append`): with ``k_new`` and ``v_new`` ([B, Hkv, Nnew, D] in the call's layout) and
    ``kv_len`` (required: the lengths before the append, not modified), k and v are caches (dense, or paged
    with ``block_table``) into which the call first writes the new keys at positions kv_len .. kv_len + Nnew - 1,
    then attends over kv_len + Nnew keys. No gradient reaches the caches or the new tensors.

    Paged KV cache: with ``block_table`` (int32 [B, max_blocks]), k and v are caches [num_blocks, block_size,
    Hkv, D] and logical key j of batch b is ``k[block_table[b, j // block_size], j % block_size]``; Nk is
    max_blocks * block_size and ``kv_len`` says how many keys each sequence has (FlashAttention's
    ``flash_attn_with_kvcache`` convention). q keeps its layout. ``triton-decode`` (auto's choice for a few
    query rows on a GPU) reads the caches in place; other backends, and calls that need gradients, gather
    them to dense k and v first.

    A call takes one of three routes:

    1. **the fast call** (no gradient, not traced, a signature seen before: :mod:`attnlab.fast_calls`): the
       backend's cached launch, nothing validated or looked up again;
    2. **the whole way** (no gradient, not traced, a new signature): validate (:func:`attnlab.problem.make_problem`),
       pick the backend (:func:`attnlab.backends.resolve`), run it, and remember its fast call;
    3. **the op** (a gradient is needed, or ``torch.compile`` traces the call): the custom op
       ``attnlab::attention`` with its autograd formula, run eagerly as a ``torch.autograd.Function`` when no
       tracing or dispatch mode needs the dispatcher.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {return_lse!r}")
    if v_new is not None and k_new is None:
        raise ValueError("k_new and v_new come together; k_new is missing")
    if getattr(q, "dtype", None) == FP8 or q_descale is not None or k_descale is not None or v_descale is not None:
        return attention_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, kv_len=kv_len,
                             q_len=q_len, mask=mask, alibi_slopes=alibi_slopes, sinks=sinks,
                             opts=Options.of(causal, window, align, scale, layout, softcap), backend=backend,
                             return_lse=return_lse, block_table=block_table, k_new=k_new, poison=_poison)
    needs_grad = torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False) or getattr(mask, "requires_grad", False)
        or getattr(sinks, "requires_grad", False)
    )
    mods = (alibi_slopes, sinks)
    if not (needs_grad or torch.compiler.is_compiling()):
        key = None if _poison else _calls.signature(q, k, v, kv_len, q_len, mask, block_table, causal, window,
                                                    align, scale, layout, backend, return_lse, softcap,
                                                    alibi_slopes, sinks, k_new, v_new)
        entry = _calls.lookup(key)
        if entry is not None:
            got = entry(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, k_new, v_new)
            if got is not None:
                return got if return_lse else got[0]
        opts = Options.of(causal, window, align, scale, layout, softcap)
        append, given_kv_len = None, kv_len
        if k_new is not None:  # validated here, written by _run (in the backend's launch where it can)
            append = kv_append.check(q, k, v, k_new, v_new, kv_len, block_table, layout)
            kv_len = append.after
        out, lse, prob, be, out_bhnd, paged, fused = _run(q, k, v, kv_len, q_len, mask, block_table, *mods, opts,
                                                          backend, return_lse, needs_grad, append)
        # A paged call only when its caches were read in place through the caller's own table (not gathered
        # to dense, not a contiguous copy of a strided table); an append only when the backend wrote it.
        if key is not None and (block_table is None or (paged is not None and paged.block_table is block_table)) \
                and (append is None or fused):
            fast = be.fast_call(prob, out_bhnd, lse, paged, append)
            if fast is not None:
                _calls.remember(key, fast, prob, given_kv_len, q_len)
    else:
        opts = Options.of(causal, window, align, scale, layout, softcap)
        if k_new is not None:  # write the step's keys first; attend over the longer sequences
            append = kv_append.check(q, k, v, k_new, v_new, kv_len, block_table, layout)
            if not torch.compiler.is_compiling():  # the whole call's checks before the caches change
                _check_call(q, k, v, append.after, q_len, mask, block_table, alibi_slopes, sinks, opts)
            append.write()
            kv_len = append.after
        if block_table is not None and needs_grad:  # the caches get their gradients through a differentiable gather
            k, v = gather_paged(q, k, v, block_table, layout, kv_len)
            block_table = None
        if torch.compiler.is_compiling():
            # The op takes lengths as tensors: Python ints and lists become (host) tensors, validated in the op.
            kv_len, q_len = lengths_arg(kv_len), lengths_arg(q_len)
        else:
            # Validate first (the same TypeError/ValueError as without grad); the forward then takes the lengths
            # as validated (int32 on q's device), not converted again.
            prob = _problem(q, k, v, kv_len, q_len, mask, *mods, opts)
            kv_len, q_len = prob.spec.kv_len, prob.spec.q_len
        args = (q, k, v, kv_len, q_len, mask, block_table, *mods, *opts.flat(), backend, return_lse, needs_grad)
        if not torch.compiler.is_compiling() and plain_eager(q, k, v):
            _handoff.given = (args[:9], opts, prob)  # (the op's tensor arguments: block_table is None here)
            try:
                out, lse = _EagerAttention.apply(*args)
            finally:
                _handoff.given = None
        else:
            out, lse = torch.ops.attnlab.attention(*args)
    return (out, lse) if return_lse else out


def _given_problem(tensors: tuple, opts: Options):
    """The Problem the caller validated for exactly these op arguments (the same objects and options), or None."""
    given = getattr(_handoff, "given", None)
    if given is None or given[1] != opts or any(a is not b for a, b in zip(given[0], tensors, strict=True)):
        return None
    return given[2]


def _check_call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts: Options) -> None:
    """Every check the call's problem (and paged cache) gets, without running it: a KV append runs this before
    it writes, so that a call refused afterwards has not changed the caches."""
    if block_table is None:
        _problem(q, k, v, kv_len, q_len, mask, alibi_slopes, sinks, opts)
        return
    kd, vd = paged_placeholders(q, k, v, block_table, opts.layout)
    prob = _problem(q, kd, vd, kv_len, q_len, mask, alibi_slopes, sinks, opts)
    paged_kv(k, v, block_table, B=prob.B, Hkv=prob.Hkv, D=prob.D, Nk=prob.Nk, dtype=prob.dtype,
             device=prob.device, kv_len=prob.spec.kv_len)


def _problem(q, k, v, kv_len, q_len, mask, alibi_slopes, sinks, opts: Options):
    return make_problem(q, k, v, kv_len=kv_len, q_len=q_len, mask=mask, alibi_slopes=alibi_slopes, sinks=sinks,
                        **opts.keywords())


def _run(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts: Options, backend: str,
         want_lse: bool, needs_grad: bool, append: kv_append.Append | None = None):
    """Validate, pick the backend, run it: (out, lse, the problem, the backend, out as [B, H, N, D], the paged
    cache read in place or None, whether the backend wrote ``append`` in its own launch). lse is None unless
    ``want_lse`` or ``needs_grad`` (the kernels' backward starts from the forward's lse). ``append``: a KV
    append not yet written (``kv_len`` holds the lengths after it), written once everything is validated: by the
    backend's launch where it ``fuses_append``, else by its own kernel before the backend reads the caches."""
    paged = None
    if block_table is not None and backend == "auto" and q.device.type == "cpu":
        # no CPU backend auto picks reads a paged cache in place: gather now, so auto sees the real k and v
        if append is not None:
            _check_call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts)
            append.write()
            append = None
        k, v = gather_paged(q, k, v, block_table, opts.layout, kv_len)
        block_table = None
    if block_table is not None:
        kd, vd = paged_placeholders(q, k, v, block_table, opts.layout)
        prob = _problem(q, kd, vd, kv_len, q_len, mask, alibi_slopes, sinks, opts)
        paged = paged_kv(k, v, block_table, B=prob.B, Hkv=prob.Hkv, D=prob.D, Nk=prob.Nk, dtype=prob.dtype,
                         device=prob.device, kv_len=prob.spec.kv_len)
    else:
        prob = (_given_problem((q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks), opts)
                or _problem(q, k, v, kv_len, q_len, mask, alibi_slopes, sinks, opts))
    be = _backends.resolve(backend, prob, needs_grad=needs_grad)
    fused = append is not None and be.fuses_append
    if append is not None and not fused:
        append.write()
    if paged is not None and not be.reads_paged:  # this backend takes dense k and v: gather them
        kd, vd = paged.dense()  # [B, Hkv, Nk, D], the placeholders' shape: nothing validated changes
        prob, paged = dataclasses.replace(prob, k=kd, v=vd), None
    out, out_bhnd = prob.new_out()
    want_lse = want_lse or needs_grad
    lse = prob.new_lse() if want_lse else None
    if out.numel() == 0 or prob.Nk == 0 or prob.B == 0:
        if fused:
            append.write()
        out.zero_()
        if lse is not None:
            lse.copy_(prob.mods.empty_lse(lse))
    else:
        if _poison:
            out.fill_(float("nan"))
            if lse is not None:
                lse.fill_(float("nan"))
        kernel_grad = needs_grad and be.kernel_backward and not _bias_needs_grad(mask)
        if kernel_grad and prob.q.is_cuda and _triton_backward_available():
            from attnlab.backends.triton.backward import compile_ahead

            compile_ahead(prob, out_bhnd, lse)  # the backward's kernels compile while the forward runs
        with torch.no_grad():  # the op's outputs carry no history of their own; autograd goes through the op
            if fused:
                be.forward_append(prob, paged, out_bhnd, lse, append)
            elif paged is not None:
                be.forward_paged(prob, paged, out_bhnd, lse)
            else:
                be.forward(prob, out_bhnd, lse)
    return out, lse, prob, be, out_bhnd, paged, fused


_Tensor, _OptTensor = torch.Tensor, torch.Tensor | None
#: The op's parameters around the options' flat ones (:func:`attnlab.options.define_op`).
_OP_BEFORE = [("q", _Tensor), ("k", _Tensor), ("v", _Tensor), ("kv_len", _OptTensor), ("q_len", _OptTensor),
              ("mask", _OptTensor), ("block_table", _OptTensor), ("alibi_slopes", _OptTensor), ("sinks", _OptTensor)]
_OP_AFTER = [("backend", str), ("want_lse", bool), ("needs_grad", bool)]
_ARG_NAMES = tuple(n for n, _ in (*_OP_BEFORE, *Options.FLAT, *_OP_AFTER))


def _attention_body(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts: Options, backend: str,
                    want_lse: bool, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = _run(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts, backend, want_lse,
                        needs_grad)
    return out, lse if lse is not None else q.new_empty((0,), dtype=torch.float32)  # the schema's empty lse


def _attention_fake(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, opts: Options, backend: str,
                    want_lse: bool, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if not (want_lse or needs_grad):
        return out, q.new_empty((0,), dtype=torch.float32)
    bhnd = opts.layout == "bhnd"
    B, Hq, Nq = (q.shape[0], q.shape[1], q.shape[2]) if bhnd else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty((B, Hq, Nq), dtype=torch.float32)


_attention_op, _attention_impl = define_op("attnlab::attention", _OP_BEFORE, _OP_AFTER, tuple[_Tensor, _Tensor],
                                           _attention_body, _attention_fake)


def _attention_backward_body(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, kv_len: torch.Tensor | None, q_len: torch.Tensor | None,
    mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, opts: Options,
    backend: str, mask_grad: bool, sinks_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask, dsinks) in the caller's layout; dmask is empty unless ``mask_grad``, dsinks empty
    unless ``sinks_grad`` (the sinks require grad; then in sinks' dtype).

    The kernel backends (Triton, CUDA) take the Triton backward kernels from the saved out and lse; the
    backends built from PyTorch ops, and any call whose bias needs a gradient, the chunked PyTorch backward.
    """
    prob = getattr(_handoff, "backward", None) or _problem(q, k, v, kv_len, q_len, mask, alibi_slopes, sinks, opts)
    be = _backends.resolve(backend, prob, needs_grad=True)

    def none() -> torch.Tensor:  # a new empty tensor each time: an op's outputs must not alias each other
        return q.new_empty((0,))

    if be.kernel_backward and not mask_grad and _triton_backward_available():
        from attnlab.backends.triton.backward import gradients

        dq, dk, dv, dsinks = gradients(prob, prob.to_layout(out), lse, prob.to_layout(dout), dlse,
                                       sinks_grad=sinks_grad)
        return (prob.to_layout(dq), prob.to_layout(dk), prob.to_layout(dv), none(),
                none() if dsinks is None or not sinks_grad else dsinks.to(sinks.dtype))
    dtype = torch.float64 if be.name == "reference" else torch.float32
    dq, dk, dv, dbias, dsinks = textbook_backward(prob, prob.to_layout(dout), dlse, dtype=dtype,
                                                  bias_grad=mask_grad)
    dmask = sum_to_shape(dbias, mask.shape).to(mask.dtype) if mask_grad else none()
    return (prob.to_layout(dq).to(q.dtype), prob.to_layout(dk).to(k.dtype), prob.to_layout(dv).to(v.dtype),
            dmask, none() if dsinks is None or not sinks_grad else dsinks.to(sinks.dtype))


_BWD_BEFORE = [("dout", _Tensor), ("dlse", _OptTensor), ("q", _Tensor), ("k", _Tensor), ("v", _Tensor),
               ("out", _Tensor), ("lse", _Tensor), ("kv_len", _OptTensor), ("q_len", _OptTensor), ("mask", _OptTensor),
               ("alibi_slopes", _OptTensor), ("sinks", _OptTensor)]
_BWD_AFTER = [("backend", str), ("mask_grad", bool), ("sinks_grad", bool)]
_BWD_RETURNS = tuple[_Tensor, _Tensor, _Tensor, _Tensor, _Tensor]


def _attention_backward_fake(dout, dlse, q, k, v, out, lse, kv_len, q_len, mask, alibi_slopes, sinks,
                             opts: Options, backend: str, mask_grad: bool, sinks_grad: bool):
    dmask = torch.empty_like(mask) if mask_grad else q.new_empty((0,))
    dsinks = torch.empty_like(sinks) if sinks is not None and sinks_grad else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask, dsinks


_attention_backward_op, _attention_backward_impl = define_op(
    "attnlab::attention_backward", _BWD_BEFORE, _BWD_AFTER, _BWD_RETURNS, _attention_backward_body,
    _attention_backward_fake)


def _triton_backward_available() -> bool:
    from attnlab.backends.triton.forward_kernel import IMPORT_ERROR

    return IMPORT_ERROR is None


def _bias_needs_grad(mask: torch.Tensor | None) -> bool:
    """Whether the call's mask is a float bias that requires grad (its backward is then the PyTorch one)."""
    return mask is not None and mask.dtype.is_floating_point and mask.requires_grad


def _setup_context(ctx, inputs, output) -> None:
    a = dict(zip(_ARG_NAMES, inputs))
    mask = a["mask"]
    ctx.mask_grad = _bias_needs_grad(mask)
    ctx.want_lse = a["want_lse"]
    ctx.options = (*(a[n] for n, _ in Options.FLAT), a["backend"])  # the backward op's flat options, backend
    ctx.save_for_backward(a["q"], a["k"], a["v"], *output, a["kv_len"], a["q_len"], mask, a["alibi_slopes"],
                          a["sinks"])
    ctx.sinks_grad = a["sinks"] is not None and a["sinks"].requires_grad
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient tensor: dlse is None
    # an eager call's validated Problem, for its backward (None through the op: the backward validates again)
    ctx.problem = _given_problem(inputs[:len(_OP_BEFORE)], Options.from_flat(*(a[n] for n, _ in Options.FLAT)))


def _backward(ctx, dout, dlse, backward_op=None):
    """The op's autograd formula (``backward_op``: the backward op, or its implementation when eager)."""
    q, k, v, out, lse, kv_len, q_len, mask, alibi_slopes, sinks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.want_lse else None
    eager = backward_op is not None  # (the eager twin's backward: the op's implementation, called directly)
    backward_op = backward_op or torch.ops.attnlab.attention_backward
    _handoff.backward = ctx.problem if eager else None
    try:
        dq, dk, dv, dmask, dsinks = backward_op(dout, dlse, q, k, v, out, lse, kv_len, q_len, mask, alibi_slopes,
                                                sinks, *ctx.options, ctx.mask_grad, ctx.sinks_grad)
    finally:
        _handoff.backward = None
    # One gradient per op input: q, k, v, kv_len, q_len, mask, block_table (gathered before the op whenever a
    # gradient is needed, so always None here), alibi_slopes (never a gradient), sinks, then the non-tensor
    # arguments.
    return (dq, dk, dv, None, None, dmask if ctx.mask_grad else None, None, None,
            dsinks if ctx.sinks_grad else None, *([None] * (len(_ARG_NAMES) - len(_OP_BEFORE))))


_attention_op.register_autograd(_backward, setup_context=_setup_context)


#: The op and its autograd formula run eagerly, without the dispatcher (a call that needs a gradient and is not
#: being traced): the same implementation, saved tensors and backward.
_EagerAttention = eager_function("_EagerAttention", _attention_impl, _setup_context, _backward,
                                 _attention_backward_impl)
