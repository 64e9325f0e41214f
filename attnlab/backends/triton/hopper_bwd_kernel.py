"""The Hopper backward kernel (sm_90, Gluon): one pass over key tiles computes dK, dV and dQ.

The math is :mod:`~attnlab.backends.triton.backward_kernels`': with the forward's base-2 lse (``Lse2``, +inf for a
row with no allowed key) and ``Delta_i = sum_d dO_id O_id`` (less the lse's own gradient), per tile

    S = Q K^T * scale * log2(e)     P = exp2(S - lse2)     dP = dO V^T     dS = P * (dP - Delta)
    dV += P^T dO                    dK += scale * dS^T Q   dQ += scale * dS K

with ALiBi's bias ``- slope2 * |i + Nk - Nq - j|`` added to S (base 2; it has no gradient, so dS is the same).

Tiling and warp mapping
-----------------------
A program owns ``2 * HALF_N`` keys (HALF_N = 64) of one kv head of batch entry b and one of ``SPLIT`` equal runs
of the query heads that share it (SPLIT = 1: all of them); its grid holds ``ceil(Nk / 128) * Hkv * SPLIT * B``
programs, its axes ordered as :func:`_program_tile` reads them. With SPLIT > 1 each program's dK and dV are a
partial sum, stored in float32 at head ``kvh * SPLIT + part`` for the host to add up: more programs where a few
long ones would leave SMs idle. Its warps split into four partitions:

- two **consumers** (a warpgroup each) own one half of the keys: K and V of that half stay in shared memory, the
  half's dK and dV accumulate in registers (float32, [64, D] each). Query row tiles of ``BLOCK_M`` (64) rows of
  every query head of the program's run of the group stream past. Per row tile a consumer runs ``S = Q K^T`` and
  ``dP = dO V^T`` as warpgroup MMAs ([rows, keys], two rows' lse2 and Delta per thread), forms P and dS in
  registers, stores them in shared memory and runs ``dV += P^T dO`` and ``dK += dS^T Q`` from there. Once both
  halves of dS are stored, each consumer computes half of the columns of ``dQ = dS K`` over all 128 keys and
  stages it in a shared buffer of its own. The dQ product is issued behind dK's before the consumer waits for
  dV and dK, so that the tensor cores do not drain between them;
- a **loader** (one warp) brings K and V once, then Q with the row tile's lse2 and dO with its Delta by TMA into
  a ring of ``STAGES`` slots, each guarded by a *ready* barrier (the bytes landed) and an *empty* barrier (both
  consumers are done), so that a consumer reads lse2 and Delta from shared memory, not from global memory;
- a **dQ writer** (one warp) adds each staged half of dQ into the float32 dQ in global memory by one TMA bulk
  reduce-add, so that the consumers go on to the next row tile while the sum is made in L2. Every key tile adds
  into the same rows of dQ: the host zeroes it before and rounds it into the output dtype after.

A band's edges (either alignment; ``MASK_HI``: row i sees no key j > i + off_hi, the causal mask and a window's
right side; ``MASK_LO``: none j < i + off_lo, a window's left side) skip row tiles that see none of the program's
keys and apply the mask only on tiles an edge crosses. The TMA descriptors are four-dimensional
``[B, H, N, D]``: rows past Nq and keys past Nk read as zeros (keys past Nk are masked in the last key tile and
their dK and dV are not stored), and reduce-adds past Nq are clipped by the copy engine. lse2 and Delta are read
through one-dimensional descriptors of all rows of all heads (``[B * Hq * Nq_rows]``, each head's rows padded
to a multiple of 4 by the host: a box must start on a 16-byte boundary, an unaligned start faults): a tile's rows
past Nq hold padding or the next head's values (zeros past the last head), which the consumers replace by +inf
and 0, so p = 0 there. What this kernel computes is :func:`hopper_backward.unsupported`'s.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

HALF_N = gl.constexpr(64)  #: keys per consumer
LOG2E = gl.constexpr(1.4426950408889634)  #: ALiBi's slopes enter in base 2


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of a shared tile into global memory (triton 3.6 has the op but no Gluon wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load and add async_atomic_add.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def _row_tiles(n0, Nq, band, BLOCK_M: gl.constexpr, MASK_HI: gl.constexpr, MASK_LO: gl.constexpr):
    """Row tiles ``[t_lo, t_hi)`` that may see some key of ``[n0, n0 + 2 * HALF_N)``: from row ``n0 - off_hi`` on
    under the upper edge, up to row ``n0 + 2 * HALF_N - 1 - off_lo`` under the lower one."""
    off_hi, off_lo = band
    t_lo = n0 * 0
    if MASK_HI:
        t_lo = gl.maximum(n0 - off_hi, 0) // BLOCK_M
    t_hi = (Nq + BLOCK_M - 1) // BLOCK_M
    if MASK_LO:  # tiles up to the last row, -1 when none (its numerator stays >= 0)
        t_hi = gl.minimum(t_hi, (gl.maximum(n0 + 2 * HALF_N - 1 - off_lo, -1) + BLOCK_M) // BLOCK_M)
    return t_lo, gl.maximum(t_hi, t_lo)


@gluon.jit
def _probabilities(S, rows, keys, lse2, qk_scale, band, Nk, cross_hi, cross_lo, ragged, slope2, alibi_off,
                   MASK_HI: gl.constexpr, MASK_LO: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """P = exp2(S * qk_scale - lse2), with ALiBi's ``- slope2 * |i + Nk - Nq - j|`` (``alibi_off`` = Nk - Nq, the
    forward's rule; a bias, so dS's formula is unchanged), masked where a band's edge crosses the tile
    (``cross_hi``, ``cross_lo``) and, in the last key tile (``ragged``), past Nk: those keys read as zeros, and
    their p = exp2(-lse2) would reach dQ through dS (an inf times a zero key is NaN)."""
    off_hi, off_lo = band
    s = S * qk_scale
    if HAS_ALIBI:  # float positions per row and per key, then one subtraction per score (as tiles.alibi)
        dist = gl.expand_dims((rows + alibi_off).to(gl.float32), 1) - gl.expand_dims(keys.to(gl.float32), 0)
        s = s - slope2 * gl.abs(dist)
    if MASK_HI:
        if cross_hi:
            s = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(rows + off_hi, 1), s, float("-inf"))
    if MASK_LO:
        if cross_lo:
            s = gl.where(gl.expand_dims(keys, 0) >= gl.expand_dims(rows + off_lo, 1), s, float("-inf"))
    if ragged:
        s = gl.where(gl.expand_dims(keys < Nk, 0), s, float("-inf"))
    return gl.exp2(s - gl.expand_dims(lse2, 1))


@gluon.jit
def _store_dkdv(dk, dv, k0, b, kvh, Nk, DK, DV, dk_strides, dv_strides, HEAD_D: gl.constexpr):
    """A consumer's dK and dV rows (keys k0 onward, in the output dtype); keys past Nk are not stored."""
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dk.type.layout))
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, dk.type.layout)), 0)
    keep = gl.expand_dims(keys < Nk, 1)
    kv_rows = gl.expand_dims(keys.to(gl.int64), 1)
    s_kb, s_kh, s_kn = dk_strides
    s_vb, s_vh, s_vn = dv_strides
    gl.store(DK + b.to(gl.int64) * s_kb + kvh.to(gl.int64) * s_kh + kv_rows * s_kn + cols, dk, mask=keep)
    gl.store(DV + b.to(gl.int64) * s_vb + kvh.to(gl.int64) * s_vh + kv_rows * s_vn + cols, dv, mask=keep)


@gluon.jit
def _program_tile(ORDER: gl.constexpr, SPLIT: gl.constexpr):
    """(key tile, kv head, batch entry, part of the group) of this program, read from the grid's axes in ``ORDER``
    (its kv-head axis, ``Hkv`` below, holds ``Hkv * SPLIT`` programs, a kv head's parts side by side; programs start
    roughly in the order of their index, axis 0 fastest). 0: grid ``(tiles, Hkv, B)``, a kv head's key tiles
    together (they share its Q and dO in L2); 1: ``(Hkv, tiles, B)``, key tile 0 of every kv head of a batch entry
    first (the longest under the causal band), then tile 1...; 2: ``(Hkv, B, tiles)``, tile 0 of every kv head of
    every batch entry first. The axes are read, not divided by a runtime value (its registers spill in the
    consumers); SPLIT is a power of two, a shift and a mask."""
    if ORDER == 0:
        pid_n, head, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    elif ORDER == 1:
        pid_n, head, b = gl.program_id(1), gl.program_id(0), gl.program_id(2)
    else:
        pid_n, head, b = gl.program_id(2), gl.program_id(0), gl.program_id(1)
    return pid_n, head // SPLIT, b, head % SPLIT


@gluon.jit
def _heads(part, group, SPLIT: gl.constexpr):
    """The run ``[g_lo, g_hi)`` of the group's query heads that part ``part`` of ``SPLIT`` takes."""
    size = group // SPLIT
    return part * size, part * size + size


@gluon.jit
def _consumer(HALF: gl.constexpr, bufs, bars, DK, DV, dk_strides, dv_strides, Nq, Nk, group, band, qk_scale,
              scale, alibi, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              MASK_HI: gl.constexpr, MASK_LO: gl.constexpr, ORDER: gl.constexpr, HAS_ALIBI: gl.constexpr,
              SPLIT: gl.constexpr):
    """Keys ``[k0, k0 + HALF_N)``: dK and dV over every row tile of its heads, and half of D of each tile's dQ."""
    q_bufs, do_bufs, k_bufs, v_bufs, p_bufs, ds_bufs, dq_bufs, lse2_bufs, delta_bufs = bufs
    q_ready, q_empty, do_ready, do_empty, kv_ready, ds_ready, ds_free, dq_ready, dq_free = bars
    dtype: gl.constexpr = q_bufs.dtype
    HALF_D: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_N, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    pid_n, kvh, b, part = _program_tile(ORDER, SPLIT)
    g_lo, g_hi = _heads(part, group, SPLIT)
    n0 = pid_n * (2 * HALF_N)
    k0 = n0 + HALF * HALF_N
    t_lo, t_hi = _row_tiles(n0, Nq, band, BLOCK_M, MASK_HI, MASK_LO)
    off_hi, off_lo = band
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
    ragged = k0 + HALF_N > Nk  # this half holds keys past Nk
    k_tile = k_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    v_tile = v_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    p_tile = p_bufs.index(HALF)
    zero_s = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=dq_layout)
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=kv_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=kv_layout)

    mbarrier.wait(kv_ready.index(0), 0)
    it = t_lo * 0
    Alibi, s_ab, s_ah, alibi_off = alibi
    for g in range(g_lo, g_hi):
        slope2 = qk_scale * 0.0
        if HAS_ALIBI:  # this query head's slope, in base 2
            slope2 = gl.load(Alibi + b.to(gl.int64) * s_ab + (kvh * group + g).to(gl.int64) * s_ah) * LOG2E
        for t in range(t_lo, t_hi):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            buf = it % 2
            q_tile = q_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            do_tile = do_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            mbarrier.wait(q_ready.index(slot), phase)
            S = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dP = warpgroup_mma(do_tile, v_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            rows = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            lse2 = gl.where(rows < Nq, lse2_bufs.index(slot).load(rows.type.layout), float("inf"))
            delta = gl.where(rows < Nq, delta_bufs.index(slot).load(rows.type.layout), 0.0)
            # ---- dV += P^T dO (while dP lands), then dS and dK += dS^T Q; P and dS through shared memory ----
            S = warpgroup_mma_wait(1, deps=(S, ))  # (the groups retire in issue order: S, then dP)
            cross_hi = t * BLOCK_M + off_hi < k0 + HALF_N - 1  # the tile's first row misses the half's last key
            cross_lo = t * BLOCK_M + BLOCK_M - 1 + off_lo > k0  # its last row misses the half's first key
            p = _probabilities(S, rows, keys, lse2, qk_scale, band, Nk, cross_hi, cross_lo, ragged, slope2,
                               alibi_off, MASK_HI, MASK_LO, HAS_ALIBI)
            p_tile.store(p.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_tile.permute((1, 0)), do_tile, dv, is_async=True)
            dP = warpgroup_mma_wait(1, deps=(dP, ))
            ds = p * (dP - gl.expand_dims(delta, 1))
            ds_half = ds_bufs.index(buf * 2 + HALF)
            mbarrier.wait(ds_free.index(buf), ((it // 2) & 1) ^ 1)
            ds_half.store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dk = warpgroup_mma(ds_half.permute((1, 0)), q_tile, dk, is_async=True)
            # ---- dQ[:, this half of D] = dS K over both halves of the keys, queued behind dK, staged ----
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
            dq = warpgroup_mma(ds_bufs.index(buf * 2),
                               k_bufs.index(0).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                               zero_dq, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_bufs.index(buf * 2 + 1),
                               k_bufs.index(1).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                               dq, is_async=True)
            dv, dk = warpgroup_mma_wait(1, deps=(dv, dk))  # groups retire in issue order: dV, dK, dQ's two MMAs
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            mbarrier.arrive(ds_free.index(buf), count=1)
            mbarrier.wait(dq_free.index(HALF), (it & 1) ^ 1)
            dq_bufs.index(HALF).reshape([BLOCK_M, HALF_D]).store(dq * scale)
            fence_async_shared()  # the writer's TMA reads it through the async proxy
            mbarrier.arrive(dq_ready.index(HALF), count=1)
            it += 1

    out_dtype: gl.constexpr = DK.dtype.element_ty  # q's dtype, or float32 for a part's sums (SPLIT > 1)
    _store_dkdv((dk * scale).to(out_dtype), dv.to(out_dtype), k0, b, kvh * SPLIT + part, Nk, DK, DV, dk_strides,
                dv_strides, HEAD_D)


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, lse2_desc, delta_desc, bufs, bars, Nq, Nq_rows, Hq, group, band,
            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASK_HI: gl.constexpr, MASK_LO: gl.constexpr,
            ORDER: gl.constexpr, SPLIT: gl.constexpr):
    """K and V of both halves once, then Q with lse2 and dO with Delta of every row tile of its heads through the
    ring."""
    q_bufs, do_bufs, k_bufs, v_bufs = bufs[0], bufs[1], bufs[2], bufs[3]
    lse2_bufs, delta_bufs = bufs[7], bufs[8]
    q_ready, q_empty, do_ready, do_empty, kv_ready = bars[0], bars[1], bars[2], bars[3], bars[4]
    pid_n, kvh, b, part = _program_tile(ORDER, SPLIT)
    g_lo, g_hi = _heads(part, group, SPLIT)
    n0 = pid_n * (2 * HALF_N)
    t_lo, t_hi = _row_tiles(n0, Nq, band, BLOCK_M, MASK_HI, MASK_LO)
    mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(k_desc, [b, kvh, n0 + half * HALF_N, 0], kv_ready.index(0), k_bufs.index(half))
        _tma_load(v_desc, [b, kvh, n0 + half * HALF_N, 0], kv_ready.index(0), v_bufs.index(half))
    it = t_lo * 0
    for g in range(g_lo, g_hi):
        h = kvh * group + g
        row0 = (b * Hq + h) * Nq_rows  # the head's first row in lse2 and Delta (the host keeps it under 2**31)
        for t in range(t_lo, t_hi):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(q_empty.index(slot), phase ^ 1)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + lse2_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, t * BLOCK_M, 0], q_ready.index(slot), q_bufs.index(slot))
            _tma_load(lse2_desc, [row0 + t * BLOCK_M], q_ready.index(slot), lse2_bufs.index(slot))
            mbarrier.wait(do_empty.index(slot), phase ^ 1)
            mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            _tma_load(do_desc, [b, h, t * BLOCK_M, 0], do_ready.index(slot), do_bufs.index(slot))
            _tma_load(delta_desc, [row0 + t * BLOCK_M], do_ready.index(slot), delta_bufs.index(slot))
            it += 1


@gluon.jit
def _dq_writer(dq_desc, bufs, bars, Nq, group, band, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
               MASK_HI: gl.constexpr, MASK_LO: gl.constexpr, ORDER: gl.constexpr, SPLIT: gl.constexpr):
    """Adds each staged half of a row tile's dQ into the float32 dQ by a TMA bulk reduce-add."""
    dq_bufs = bufs[6]
    dq_ready, dq_free = bars[7], bars[8]
    pid_n, kvh, b, part = _program_tile(ORDER, SPLIT)
    g_lo, g_hi = _heads(part, group, SPLIT)
    t_lo, t_hi = _row_tiles(pid_n * (2 * HALF_N), Nq, band, BLOCK_M, MASK_HI, MASK_LO)
    it = t_lo * 0
    for g in range(g_lo, g_hi):
        for t in range(t_lo, t_hi):
            for half in gl.static_range(2):
                mbarrier.wait(dq_ready.index(half), it & 1)
                _tma_reduce_add(dq_desc, [b, kvh * group + g, t * BLOCK_M, half * (HEAD_D // 2)], dq_bufs.index(half))
                tma.store_wait(0)  # the copy engine has read the buffer
                mbarrier.arrive(dq_free.index(half), count=1)
            it += 1


@gluon.jit(do_not_specialize=["Nq", "Nq_rows", "Nk", "Hq", "group", "off_hi", "off_lo", "Alibi", "s_ab", "s_ah",
                              "alibi_off"])
def attn_bwd_hopper(q_desc, do_desc, k_desc, v_desc, dq_desc, lse2_desc, delta_desc, DK, DV, s_kb, s_kh, s_kn, s_vb,
                    s_vh, s_vn, Nq, Nq_rows, Nk, Hq, group, off_hi, off_lo, qk_scale, scale, Alibi, s_ab, s_ah,
                    alibi_off, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    MASK_HI: gl.constexpr, MASK_LO: gl.constexpr, CONSUMER_REGS: gl.constexpr, ORDER: gl.constexpr,
                    HAS_ALIBI: gl.constexpr, SPLIT: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    rk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], dtype)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_N, HEAD_D], v_desc.layout)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF_N], rk_layout)  # [half, rows, keys]
    ds_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HALF_N], rk_layout)  # [buffer * 2 + half, rows, keys]
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_D // 2], dq_desc.layout)
    lse2_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse2_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS stored
        mbarrier.init(ds_free.index(i), count=2)  # both consumers' dQ products done with them
        mbarrier.init(dq_ready.index(i), count=1)  # consumer i staged its half of dQ
        mbarrier.init(dq_free.index(i), count=1)  # the writer's copy has read it
    mbarrier.init(kv_ready.index(0), count=1)

    bufs = (q_bufs, do_bufs, k_bufs, v_bufs, p_bufs, ds_bufs, dq_bufs, lse2_bufs, delta_bufs)
    bars = (q_ready, q_empty, do_ready, do_empty, kv_ready, ds_ready, ds_free, dq_ready, dq_free)
    dk_strides = (s_kb, s_kh, s_kn)
    dv_strides = (s_vb, s_vh, s_vn)
    alibi = (Alibi, s_ab, s_ah, alibi_off)
    band = (off_hi, off_lo)
    gl.warp_specialize([
        (_consumer, (0, bufs, bars, DK, DV, dk_strides, dv_strides, Nq, Nk, group, band, qk_scale, scale,
                     alibi, BLOCK_M, HEAD_D, STAGES, MASK_HI, MASK_LO, ORDER, HAS_ALIBI, SPLIT)),
        (_consumer, (1, bufs, bars, DK, DV, dk_strides, dv_strides, Nq, Nk, group, band, qk_scale, scale,
                     alibi, BLOCK_M, HEAD_D, STAGES, MASK_HI, MASK_LO, ORDER, HAS_ALIBI, SPLIT)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, lse2_desc, delta_desc, bufs, bars, Nq, Nq_rows, Hq, group, band,
                   BLOCK_M, STAGES, MASK_HI, MASK_LO, ORDER, SPLIT)),
        (_dq_writer, (dq_desc, bufs, bars, Nq, group, band, BLOCK_M, HEAD_D, MASK_HI, MASK_LO, ORDER, SPLIT)),
    ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
