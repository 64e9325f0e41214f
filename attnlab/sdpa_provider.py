"""attnlab as PyTorch's flash-attention provider: the kernels behind SDPA's flash backend, swapped for attnlab's.

PyTorch lets a library register the implementation behind ``aten::_scaled_dot_product_flash_attention`` and its
backward (``torch.nn.attention.register_flash_attention_impl``); a user then switches to it with
``torch.nn.attention.activate_flash_attention_impl("attnlab")`` (or :func:`activate`), and every model that calls
``F.scaled_dot_product_attention`` on the flash backend runs attnlab's Triton kernels, with no adapter.

Importing attnlab registers it where the installed torch has the registry, and never activates it. While active,
the dense SDPA flash ops run here, in the argument meanings of PyTorch's own flash kernel:

* q, k, v are [B, H, N, D] (any strides); GQA as the head counts imply; ``scale`` None means 1/sqrt(D);
* ``is_causal`` with Nq != Nk aligns the diagonal bottom-right (key i + Nk - Nq), as FlashAttention does;
* the logsumexp is float32 [B, Hq, Nq] in natural log, as attnlab's; the backward takes the out and logsumexp it
  is given (context parallelism hands it merged ones);
* ``aten::_flash_attention_forward`` / ``_backward`` (what ``torch.nn.attention.varlen.varlen_attn`` calls) take
  [B, N, H, D] tensors, or packed [total, H, D] ones with cumulative sequence lengths (lse [H, total]); their
  ``window_size_left/right`` (-1: unbounded; ``is_causal`` sets the right side to 0) are attnlab's window,
  aligned bottom-right within each sequence; the output has the query's strides, as PyTorch's kernel returns it;
  torch 2.13's in-place form (``_flash_attention_forward_no_dropout_inplace``) is served where it exists;
* a row with no allowed key has lse -inf (PyTorch's flash kernel writes +inf there): a backward must run on the
  provider that ran its forward.

What attnlab does not compute here (dropout, the debug mask, float32 inputs, head dims above 256, ``seqused_k``, a
``block_table``, ALiBi slopes: the flash backward takes none, so their gradients would be wrong, and anything
attnlab's own validation refuses) is refused with a RuntimeError that says why; never a silent wrong result.
:func:`stats` counts the calls served and refused.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

NAME = "attnlab"
#: Calls served and refused since the process started (forward and backward counted apart).
_STATS = {"forward": 0, "backward": 0, "refused": 0}


def _registry():
    """torch's flash-attention registry module, or None where the installed torch has none."""
    try:
        from torch.nn.attention import _registry as registry
    except ImportError:
        return None
    return registry if hasattr(registry, "register_flash_attention_impl") else None


def available() -> bool:
    """Whether the installed torch has the flash-attention registry attnlab plugs into (torch 2.11 and newer)."""
    return _registry() is not None


def register() -> bool:
    """Make ``"attnlab"`` one of ``torch.nn.attention.list_flash_attention_impls()`` (nothing is activated);
    False where the installed torch has no registry."""
    registry = _registry()
    if registry is None:
        return False
    registry.register_flash_attention_impl(NAME, register_fn=_install)
    return True


def activate() -> None:
    """Switch SDPA's flash backend to attnlab's kernels (``torch.nn.attention.activate_flash_attention_impl``)."""
    registry = _registry()
    if registry is None:
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry; attnlab can be SDPA's "
                           "flash provider from torch 2.11 on (torch.nn.attention.activate_flash_attention_impl)")
    if NAME not in registry.list_flash_attention_impls():
        register()
    registry.activate_flash_attention_impl(NAME)


def deactivate() -> None:
    """Give SDPA's flash backend back to PyTorch's own kernel."""
    registry = _registry()
    if registry is not None and registry.current_flash_attention_impl() == NAME:
        registry.restore_flash_attention_impl()


def active() -> bool:
    """Whether attnlab serves SDPA's flash backend now."""
    registry = _registry()
    return registry is not None and registry.current_flash_attention_impl() == NAME


def stats() -> dict[str, int]:
    """Calls served (``forward``, ``backward``) and ``refused`` since the process started."""
    return dict(_STATS)


@dataclasses.dataclass
class _Handle:
    """What the registry keeps while attnlab is active; ``remove`` drops the dispatcher registrations."""

    library: object | None

    def remove(self) -> None:
        lib, self.library = self.library, None
        destroy = getattr(lib, "_destroy", None)
        if destroy is not None:
            destroy()


def _install() -> _Handle:
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    lib.impl("_scaled_dot_product_flash_attention", _forward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention_backward", _backward, "CUDA")
    lib.impl("_flash_attention_forward", _flash_forward, "CUDA")
    lib.impl("_flash_attention_backward", _flash_backward, "CUDA")
    if hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):  # torch 2.13 on
        lib.impl("_flash_attention_forward_no_dropout_inplace", _flash_forward_inplace, "CUDA")
    return _Handle(lib)


def _refuse(why: str, what: str) -> RuntimeError:
    _STATS["refused"] += 1
    return RuntimeError(f"attnlab (SDPA's active flash provider) cannot run this {what}: {why}; call "
                        "torch.nn.attention.restore_flash_attention_impl() to use PyTorch's own kernel")


def _why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, dims: int = 4) -> str | None:
    if dropout_p != 0.0:
        return f"dropout_p = {dropout_p} (attnlab has no dropout)"
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            return f"{name} of dtype {t.dtype} (the flash backend takes float16 or bfloat16)"
        if t.dim() != dims:
            return f"{name} of {t.dim()} dims (this form of the flash op takes {dims})"
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        return f"head dim {max(q.shape[-1], v.shape[-1])} (attnlab takes up to 256)"
    return None


@contextlib.contextmanager
def _refusing(what: str):
    """Inside, attnlab's own validation errors (ValueError, TypeError) become the provider's counted refusal."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise _refuse(str(e), what) from e


def _problem(q, k, v, scale: float | None, mask: dict):
    """The Problem of [B, H, N, D] q, k, v with attnlab's mask keywords (:func:`_mask_keywords`); ``scale`` None
    is 1/sqrt(D), as in PyTorch."""
    from attnlab.problem import make_problem

    return make_problem(q, k, v, scale=scale, **mask)


def _no_random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) pair the flash ops return: zeros, since attnlab draws nothing (no dropout)."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def _forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on CUDA."""
    why = _why_not(query, key, value, dropout_p) or ("return_debug_mask=True" if return_debug_mask else None)
    if why is not None:
        raise _refuse(why, "forward")
    from attnlab.backends import resolve

    with _refusing("forward"):
        prob = _problem(query, key, value, scale, _mask_keywords(is_causal, None, None))
        backend = resolve("triton", prob)
    out = torch.empty_like(query)  # the query's layout, as PyTorch's kernel returns it
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    with torch.no_grad():
        backend.forward(prob, out, lse)
    _STATS["forward"] += 1
    seed, offset = _no_random_state(query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
              is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward`` on CUDA, from the out and logsumexp it is given."""
    why = _why_not(query, key, value, dropout_p)
    if why is not None:
        raise _refuse(why, "backward")
    from attnlab.backends.triton.backward import backward as triton_backward

    with _refusing("backward"):
        prob = _problem(query, key, value, scale, _mask_keywords(is_causal, None, None))
    with torch.no_grad():
        dq, dk, dv = triton_backward(prob, out, logsumexp.float(), grad_out)
    _STATS["backward"] += 1
    return dq, dk, dv


# ---- aten::_flash_attention_forward / _backward: [B, N, H, D], or packed [total, H, D] with prefix sums --------


def _mask_keywords(is_causal: bool, window_size_left, window_size_right) -> dict:
    """attnlab's mask keywords for FlashAttention's causal flag and window sides (-1 or None: unbounded)."""
    left = None if window_size_left is None or window_size_left < 0 else int(window_size_left)
    right = None if window_size_right is None or window_size_right < 0 else int(window_size_right)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return {}
    if left is None and right == 0:
        return {"causal": True, "align": "bottom_right"}
    return {"window": (left, right), "align": "bottom_right"}


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` on CUDA: dense [B, N, H, D], or packed with ``cum_seq_q``. ``num_splits``
    (a scheduling hint of torch 2.13's schema) is ignored."""
    got, lse = _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                          return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                          block_table)
    # the query's strides, as the op's meta function says (attnlab's own output has them for a contiguous query)
    out = got if got.stride() == query.stride() else torch.empty_like(query).copy_(got)
    seed, offset = _no_random_state(query.device)
    return out, lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward_no_dropout_inplace`` (torch 2.13 on): the same, into ``out``; returns lse."""
    got, lse = _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                          return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                          block_table)
    out.copy_(got)
    return lse


def _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
               scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
               block_table) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the flash op's arguments by attnlab's public calls, or the counted refusal."""
    packed = cum_seq_q is not None
    refusals = (("return_debug_mask=True", return_debug_mask),
                ("seqused_k (keys used per sequence) is not taken", seqused_k is not None),
                ("block_table (a paged cache) is not taken by this op", block_table is not None),
                ("alibi_slopes: the flash backward takes none, so their gradients would be wrong",
                 alibi_slopes is not None),
                ("cum_seq_q without cum_seq_k", packed and cum_seq_k is None))
    why = _why_not(query, key, value, dropout_p, 3 if packed else 4) or next((w for w, on in refusals if on), None)
    if why is not None:
        raise _refuse(why, "forward")
    from attnlab.api import attention
    from attnlab.varlen import attention_varlen

    kw = dict(_mask_keywords(is_causal, window_size_left, window_size_right), scale=scale, backend="triton",
              return_lse=True)
    with torch.no_grad(), _refusing("forward"):
        if packed:
            got, lse = attention_varlen(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), **kw)
        else:
            got, lse = attention(query, key, value, layout="bnhd", **kw)
    _STATS["forward"] += 1
    return got, lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward`` on CUDA, from the out and logsumexp it is given."""
    packed = cum_seq_q is not None
    why = _why_not(query, key, value, dropout_p, 3 if packed else 4)
    if why is not None:
        raise _refuse(why, "backward")
    kw = _mask_keywords(is_causal, window_size_left, window_size_right)
    with torch.no_grad(), _refusing("backward"):
        if packed:
            from attnlab.varlen import packed_gradients

            grads = packed_gradients(grad_out, query, key, value, out, logsumexp.float(), cum_seq_q, cum_seq_k,
                                     max_q, max_k, scale=scale, **kw)
        else:
            from attnlab.backends.triton.backward import backward as triton_backward

            bhnd = [t.transpose(1, 2) for t in (query, key, value, out, grad_out)]
            prob = _problem(*bhnd[:3], scale, kw)
            grads = [g.transpose(1, 2) for g in triton_backward(prob, bhnd[3], logsumexp.float(), bhnd[4])]
    _STATS["backward"] += 1
    return tuple(grads)
