"""Paged KV caches (FlashAttention's ``flash_attn_with_kvcache`` convention): validation and the dense view.

k and v caches are ``[num_blocks, block_size, Hkv, D]``; ``block_table`` is an int32 ``[B, max_blocks]``
tensor, and logical key j of batch b lives at ``cache[block_table[b, j // block_size], j % block_size]``;
Nk = max_blocks * block_size. The checks here are host-side (shapes, dtypes, devices; the ids of a table on
the host): they never read a GPU table's values, so they cost no device sync; kernels clamp block ids instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PagedKV:
    """A validated paged cache: caches [num_blocks, block_size, Hkv, D], block table int32 [B, max_blocks]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def Nk(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical k and v as [B, Hkv, Nk, D] copies (ids clamped into range, as the kernels read them)."""
        ids = self.block_table.long().clamp(0, self.num_blocks - 1)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            B, mb = ids.shape
            x = cache[ids.reshape(-1)].reshape(B, mb * self.block_size, cache.shape[2], cache.shape[3])
            return x.transpose(1, 2)

        return gather(self.k_cache), gather(self.v_cache)


def paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, *, B: int, Hkv: int, D: int,
             Nk: int, dtype: torch.dtype, device: torch.device, block_size: int | None = None,
             kv_len: torch.Tensor | None = None) -> PagedKV:
    """Check a paged cache against the problem's B, Hkv, D, Nk (= max_blocks * block_size), dtype and
    device; raise TypeError/ValueError naming what is wrong. A strided block table is made contiguous.

    A table on the host also has its ids checked: those of the blocks that hold a sequence's keys (the first
    ceil(kv_len_b / block_size) of row b; all of them without ``kv_len``) must lie in [0, num_blocks). Entries
    past a sequence's keys are never read and may hold anything. A GPU table is never read back."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, Hkv, D] of one shape; got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    nb, bs, hkv, d = k_cache.shape
    if (hkv, d) != (Hkv, D) or nb == 0 or bs == 0:
        raise ValueError(f"caches [num_blocks, block_size, Hkv, D] = {list(k_cache.shape)} do not fit Hkv={Hkv}, "
                         f"D={D} (and need num_blocks, block_size >= 1)")
    if block_size is not None and block_size != bs:
        raise ValueError(f"block_size={block_size} but the caches hold blocks of {bs} keys")
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise TypeError(f"caches must have q's dtype {dtype}; got {k_cache.dtype}, {v_cache.dtype}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 [B={B}, max_blocks]; got {block_table.dtype} "
                         f"{list(block_table.shape)}")
    if block_table.shape[1] * bs != Nk:
        raise ValueError(f"Nk={Nk} must be max_blocks * block_size = {block_table.shape[1]} * {bs}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if block_table.device.type == "cpu" and block_table.numel():  # host ids are checked; GPU ids are clamped
        mb = block_table.shape[1]
        blocks = (torch.full((B,), mb) if kv_len is None
                  else (kv_len.cpu().long().reshape(-1).expand(B) + bs - 1) // bs)
        ids = block_table[torch.arange(mb)[None, :] < blocks[:, None]]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nb):
            raise ValueError(f"block_table ids of the blocks in use must lie in [0, num_blocks) = [0, {nb}); got "
                             f"ids in [{int(ids.min())}, {int(ids.max())}]")
    return PagedKV(k_cache, v_cache, block_table)


def _cache_dims(q: Any, k: Any, block_table: Any, layout: str = "bhnd") -> tuple[int, int, int, int]:
    """(B, Hkv, D, Nk) that a paged call implies, after the checks that must come before any shape is read."""
    for name, t in (("q", q), ("k_cache", k), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if k.dim() != 4:
        raise ValueError(f"with block_table, k and v are caches [num_blocks, block_size, Hkv, D]; got k of shape "
                         f"{list(k.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 [B, max_blocks]; got shape {list(block_table.shape)}")
    hq = (q.shape[2] if layout == "bnhd" else q.shape[1]) if q.dim() == 4 else 0
    if hq > 0 and (k.shape[2] == 0 or hq % k.shape[2] != 0):
        raise ValueError(
            f"with block_table, k and v are paged caches [num_blocks, block_size, Hkv, D] (FlashAttention's "
            f"kvcache layout); k of shape {list(k.shape)} would have Hkv={k.shape[2]}, which does not divide q's "
            f"{hq} heads. A dense k [B, Hkv, Nk, D] or [B, Nk, Hkv, D] goes without block_table")
    return q.shape[0], k.shape[2], k.shape[3], block_table.shape[1] * k.shape[1]


def paged_placeholders(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                       layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the logical k and v of a paged call, in ``layout``, for validating the problem: expanded
    views of one uninitialized element (stride 0), never read by a backend that reads the caches."""
    B, Hkv, D, Nk = _cache_dims(q, k, block_table, layout)
    shape = (B, Hkv, Nk, D) if layout != "bnhd" else (B, Nk, Hkv, D)
    return k.new_empty(()).expand(shape), v.new_empty(()).expand(shape) if isinstance(v, torch.Tensor) else v


def gather_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, layout: str,
                 kv_len: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical k and v of a paged call as dense tensors in ``layout`` (validated; differentiable in the
    caches, whose gradients are scattered back through the gather). See :func:`paged_kv` for the checks.
    ``kv_len``: the call's lengths (host ids past them are not checked), or None."""
    B, Hkv, D, Nk = _cache_dims(q, k, block_table, layout)
    lens = None
    if kv_len is not None and block_table.device.type == "cpu":
        try:
            lens = torch.as_tensor(kv_len, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            lens = None  # not lengths at all: make_problem names the mistake
    paged = paged_kv(k, v, block_table, B=B, Hkv=Hkv, D=D, Nk=Nk, dtype=q.dtype, device=q.device, kv_len=lens)
    kd, vd = paged.dense()
    return (kd, vd) if layout != "bnhd" else (kd.transpose(1, 2), vd.transpose(1, 2))


def to_paged(k: torch.Tensor, v: torch.Tensor, block_size: int, *, seed: int = 0,
             spare_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense ``[B, Hkv, Nk, D]`` k and v as paged caches ``[num_blocks, block_size, Hkv, D]`` and an int32
    block table ``[B, Nk // block_size]`` whose blocks are shuffled over the cache (as an allocator leaves them),
    with ``spare_blocks`` unused ones; on k's device. Nk must be a multiple of ``block_size``."""
    B, Hkv, Nk, D = k.shape
    if block_size < 1 or Nk % block_size:
        raise ValueError(f"Nk={Nk} must be a positive multiple of block_size={block_size}")
    mb = Nk // block_size
    num_blocks = B * mb + spare_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: B * mb].to(k.device)

    def scatter(x: torch.Tensor) -> torch.Tensor:
        cache = x.new_zeros(num_blocks, block_size, Hkv, D)
        cache[perm] = x.reshape(B, Hkv, mb, block_size, D).permute(0, 2, 3, 1, 4).reshape(B * mb, block_size, Hkv, D)
        return cache

    return scatter(k), scatter(v), perm.view(B, mb).to(torch.int32)

