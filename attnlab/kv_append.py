"""KV append: the new keys and values of a decoding step written into the cache inside the attention call
(FlashAttention's ``flash_attn_with_kvcache`` convention).

``attention(q, k_cache, v_cache, k_new=..., v_new=..., kv_len=...[, block_table=...])`` writes the ``Nnew`` new
keys and values of batch entry b at cache positions ``kv_len[b] .. kv_len[b] + Nnew - 1`` (a dense cache in the
call's layout, or a paged one), then attends over ``kv_len[b] + Nnew`` keys. ``kv_len`` holds the lengths before
the append and is not modified. Lengths on the host are checked against the capacity; lengths on the GPU are
never read back: a write past the capacity is dropped and the call attends over ``min(kv_len + Nnew, capacity)``
keys. The caches and the new tensors get no gradient. The write is one Triton kernel (:mod:`.append_kernel`),
an op of its own (``attnlab::kv_append``, mutating the caches) so that ``torch.compile`` and CUDA graphs see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.masks import plain_int


@dataclass(frozen=True)
class Append:
    """A validated append, not yet written: the tensors, the lengths before it (int32 [B] on q's device), the
    number of new positions and the cache's capacity."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    before: torch.Tensor
    block_table: torch.Tensor | None
    layout: str
    n_new: int
    cap: int

    @property
    def after(self) -> torch.Tensor:
        """The lengths the attention then covers: kv_len + Nnew, at most the capacity."""
        return (self.before + self.n_new).clamp(max=self.cap)

    def write(self) -> None:
        """Write the new keys and values into the caches (the op ``attnlab::kv_append``)."""
        if self.n_new and self.before.numel() and self.k_new.numel():
            torch.ops.attnlab.kv_append(self.k_cache, self.v_cache, self.k_new, self.v_new, self.before,
                                        self.block_table, self.layout)


def check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: Any, v_new: Any, kv_len: Any,
          block_table: torch.Tensor | None, layout: str) -> Append:
    """Validate an append (nothing is written): types, dtypes, devices, shapes against the caches and the
    block table, and host lengths against the capacity. Under ``torch.compile`` lengths are taken as GPU
    lengths are (clamped, never read)."""
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"layout must be one of ('bhnd', 'bnhd'); got {layout!r}")
    if kv_len is None:
        raise ValueError("k_new needs kv_len: the lengths of the cached sequences before the append")
    if v_new is None:
        raise ValueError("k_new and v_new come together; v_new is missing")
    for name, t in (("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad, but a KV append is a cache update with no gradient: detach it")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}; got {t.dtype}")
    if k_new.dim() != 4 or v_new.dim() != 4 or k_new.shape[:3] != v_new.shape[:3]:
        raise ValueError(f"k_new and v_new must be rank 4 in the call's layout and agree but in the head dim; got "
                         f"{list(k_new.shape)} and {list(v_new.shape)}")
    kn, vn = (k_new, v_new) if layout == "bhnd" else (k_new.transpose(1, 2), v_new.transpose(1, 2))
    B, Hkv, n_new, D = kn.shape
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError("a paged append needs an int32 block table [B, max_blocks]")
        if block_table.device != q.device or block_table.shape[0] != B:
            raise ValueError(f"the block table must be [B={B}, max_blocks] on q's device; got "
                             f"{list(block_table.shape)} on {block_table.device}")
        if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError("a paged append needs caches [num_blocks, block_size, Hkv, D]")
        cap = block_table.shape[1] * k_cache.shape[1]
        heads, dims = (k_cache.shape[2], k_cache.shape[3]), v_cache.shape[3]
    else:
        kc = k_cache if layout == "bhnd" else k_cache.transpose(1, 2)
        vc = v_cache if layout == "bhnd" else v_cache.transpose(1, 2)
        if kc.dim() != 4 or vc.dim() != 4 or kc.shape[0] != B or kc.shape[:3] != vc.shape[:3]:
            raise ValueError(f"the dense caches must be [B={B}, ...] in the call's layout; got {list(k_cache.shape)}")
        cap = kc.shape[2]
        heads, dims = (kc.shape[1], kc.shape[3]), vc.shape[3]
    if heads != (Hkv, D) or dims != vn.shape[3]:
        raise ValueError(f"k_new/v_new (Hkv={Hkv}, D={D}, Dv={vn.shape[3]}) do not fit the caches "
                         f"(Hkv={heads[0]}, D={heads[1]}, Dv={dims})")
    if torch.compiler.is_compiling():  # traced: lengths as the GPU's are (clamped, never read)
        t = torch.as_tensor(kv_len, device=q.device).to(torch.int32)
        before = (t.expand(B) if t.dim() == 0 else t).clamp(min=0)
    else:
        before = _lengths(kv_len, B, cap, n_new, q.device)
    return Append(k_cache, v_cache, k_new, v_new, before, block_table, layout, n_new, cap)


def _lengths(kv_len: Any, B: int, cap: int, n_new: int, device: torch.device) -> torch.Tensor:
    """kv_len as int32 [B] on ``device``: host values checked so that kv_len + Nnew fits the capacity; GPU values
    clamped at 0 (never read back)."""
    kv_len = plain_int(kv_len)
    if isinstance(kv_len, torch.Tensor):
        if kv_len.dtype.is_floating_point or kv_len.dtype == torch.bool or kv_len.dim() > 1:
            raise TypeError(f"kv_len must be an integer tensor [B]; got {kv_len.dtype} {list(kv_len.shape)}")
        t = kv_len.expand(B) if kv_len.dim() == 0 else kv_len
        if t.shape[0] != B:
            raise ValueError(f"kv_len must have shape [B] = [{B}]; got {list(kv_len.shape)}")
        if t.device.type != "cpu":
            return t.to(device=device, dtype=torch.int32).clamp(min=0)
        host = t.tolist()
    elif isinstance(kv_len, int) and not isinstance(kv_len, bool):
        host = [kv_len] * B
    elif isinstance(kv_len, Sequence):
        host = [plain_int(x) for x in kv_len]
        if len(host) != B or not all(isinstance(x, int) and not isinstance(x, bool) for x in host):
            raise TypeError(f"kv_len must hold B = {B} ints; got {kv_len!r}")
    else:
        raise TypeError(f"kv_len must be an int, a sequence of ints or an integer tensor [B]; got {kv_len!r}")
    if host and (min(host) < 0 or max(host) + n_new > cap):
        raise ValueError(f"kv_len + Nnew must lie in [0, {cap}] (the cache's capacity); got kv_len in "
                         f"[{min(host)}, {max(host)}] with Nnew = {n_new}")
    t = torch.tensor(host, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@torch.library.custom_op("attnlab::kv_append", mutates_args=("k_cache", "v_cache"))
def _kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               kv_len: torch.Tensor, block_table: torch.Tensor | None, layout: str) -> None:
    """Write k_new and v_new into the caches at each sequence's length (:mod:`.append_kernel`)."""
    from attnlab.backends.triton.append_kernel import kv_append_kernel, triton
    from attnlab.backends.triton.configs import COMPILE_OPTIONS, padded_head_dim
    from attnlab.backends.triton.interpreter import interpreter
    from attnlab.backends.triton.runtime import jit_run

    if triton is None:
        raise RuntimeError("k_new (a KV append) needs triton, which is not importable here")
    bhnd = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
    kn, vn = bhnd(k_new), bhnd(v_new)
    B, Hkv, n_new, D = kn.shape
    paged = block_table is not None
    if paged:  # [num_blocks, block_size, Hkv, D]: (block, head, slot, d) strides, as the kernel reads them
        kc = k_cache.permute(0, 2, 1, 3)
        vc = v_cache.permute(0, 2, 1, 3)
        cap, nb, bs, table = block_table.shape[1] * k_cache.shape[1], k_cache.shape[0], k_cache.shape[1], block_table
    else:
        kc, vc = bhnd(k_cache), bhnd(v_cache)
        cap, nb, bs, table = kc.shape[2], 1, 1, kv_len
    block_d = max(padded_head_dim(D), padded_head_dim(vn.shape[3]))
    args = (kn, vn, k_cache, v_cache, kv_len, table, *kn.stride(), *vn.stride(), *kc.stride(), *vc.stride(),
            table.stride(0) if paged else 0, table.stride(1) if paged else 0, cap, nb, D, vn.shape[3])
    kw = dict(BLOCK_D=block_d, BLOCK_SIZE=bs, PAGED=paged, num_warps=1, **COMPILE_OPTIONS)
    if k_cache.is_cuda:
        jit_run(kv_append_kernel, (n_new, Hkv, B), args, kw)
        return
    with interpreter(kv_append_kernel) as kernel:
        kernel[(n_new, Hkv, B)](*args, **kw)


@_kv_append.register_fake
def _(k_cache, v_cache, k_new, v_new, kv_len, block_table, layout) -> None:
    return None
