"""The KV-append kernel: new keys and values written into a dense or paged cache at each sequence's length.

One program per (new position t, kv head h, batch entry b) copies one row of k_new (D) and of v_new (Dv)
to cache position ``p = kv_len[b] + t`` (kv_len clamped at 0): in a dense cache row p of batch entry b, in a
paged cache slot ``p % BLOCK_SIZE`` of block ``block_table[b, p // BLOCK_SIZE]`` (the id clamped into the
cache). A position at or past the capacity ``cap`` is not written, so no length makes a store leave the cache.
Plain pointer arithmetic with masks: compiled by Triton on CUDA tensors, run by its interpreter on CPU tensors.
"""

from __future__ import annotations

from attnlab.backends.triton.forward_kernel import tl, triton

if triton is not None:

    @triton.jit
    def kv_append_kernel(
        KNew, VNew, KCache, VCache, KvLen, Table,
        s_kb, s_kh, s_kt, s_kd,
        s_vb, s_vh, s_vt, s_vd,
        s_cb, s_ch, s_cn, s_cd,
        s_wb, s_wh, s_wn, s_wd,
        s_tb, s_tc, cap, num_blocks, D, Dv,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        p = tl.maximum(tl.load(KvLen + b), 0) + t
        offs_d = tl.arange(0, BLOCK_D)
        fits = (offs_d * 0 + p) < cap  # (a vector: the interpreter takes no scalar mask)
        if PAGED:  # s_cb/s_wb are the caches' block strides, s_cn/s_wn their slot strides
            blk = tl.load(Table + b * s_tb + (tl.minimum(p, cap - 1) // BLOCK_SIZE) * s_tc)
            blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
            k_dst = KCache + blk * s_cb + (p % BLOCK_SIZE) * s_cn + h * s_ch
            v_dst = VCache + blk * s_wb + (p % BLOCK_SIZE) * s_wn + h * s_wh
        else:
            k_dst = KCache + b * s_cb + h * s_ch + p.to(tl.int64) * s_cn
            v_dst = VCache + b * s_wb + h * s_wh + p.to(tl.int64) * s_wn
        k = tl.load(KNew + b * s_kb + h * s_kh + t * s_kt + offs_d * s_kd, mask=offs_d < D)
        v = tl.load(VNew + b * s_vb + h * s_vh + t * s_vt + offs_d * s_vd, mask=offs_d < Dv)
        tl.store(k_dst + offs_d * s_cd, k, mask=(offs_d < D) & fits)
        tl.store(v_dst + offs_d * s_wd, v, mask=(offs_d < Dv) & fits)
