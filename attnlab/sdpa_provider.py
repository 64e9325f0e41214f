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
  is given (context parallelism hands it merged ones).

What attnlab does not compute (dropout, the debug mask, float32 inputs, head dims above 256) is refused with a
RuntimeError that says why; it is never a silent wrong result. :func:`stats` counts the calls served and refused.
"""

from __future__ import annotations

import dataclasses
import math

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
    return _Handle(lib)


def _refuse(why: str, what: str) -> RuntimeError:
    _STATS["refused"] += 1
    return RuntimeError(f"attnlab (SDPA's active flash provider) cannot run this {what}: {why}; call "
                        "torch.nn.attention.restore_flash_attention_impl() to use PyTorch's own kernel")


def _why_not(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> str | None:
    if dropout_p != 0.0:
        return f"dropout_p = {dropout_p} (attnlab has no dropout)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the flash backend takes float16 or bfloat16)"
    if q.dim() != 4 or k.dim() != 4:
        return f"q of {q.dim()} dims (the dense flash op takes [B, H, N, D])"
    if q.shape[-1] > 256:
        return f"head dim {q.shape[-1]} (attnlab takes up to 256)"
    return None


def _problem(q, k, v, is_causal: bool, scale: float | None):
    from attnlab.problem import make_problem

    causal = dict(causal=True, align="bottom_right") if is_causal else {}
    return make_problem(q, k, v, scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), **causal)


def _forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on CUDA."""
    why = _why_not(query, key, dropout_p) or ("return_debug_mask=True" if return_debug_mask else None)
    if why is not None:
        raise _refuse(why, "forward")
    from attnlab.backends import registry

    prob = _problem(query, key, value, is_causal, scale)
    out = torch.empty_like(query)  # the query's layout, as PyTorch's kernel returns it
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    with torch.no_grad():
        registry()["triton"].forward(prob, out, lse)
    _STATS["forward"] += 1
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)  # no dropout: no random state
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
              is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward`` on CUDA, from the out and logsumexp it is given."""
    why = _why_not(query, key, dropout_p)
    if why is not None:
        raise _refuse(why, "backward")
    from attnlab.backends.triton.backward import backward as triton_backward

    prob = _problem(query, key, value, is_causal, scale)
    with torch.no_grad():
        dq, dk, dv = triton_backward(prob, out, logsumexp.float(), grad_out)
    _STATS["backward"] += 1
    return dq, dk, dv
