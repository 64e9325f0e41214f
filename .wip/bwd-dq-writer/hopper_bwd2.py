"""An experiment, not the product: the whole backward in one Gluon pass over key tiles (Hopper), dQ included,
with dQ added up by a warp of its own.

A program owns 2 * 64 keys of one kv head (batch b): two consumer warpgroups own 64 keys each, their K and V halves
in shared memory and their dK and dV accumulators in registers; a loader warp streams the row tiles (Q and dO,
BLOCK_M = 64 rows) of every query head of the group through a ring of STAGES slots. Per row tile a consumer
computes S and dP for its 64 keys, P and dS, dV += P^T dO and dK += dS^T Q; once both consumers have stored their
half of dS in shared memory, each computes half of the columns of dQ = scale * dS K over all 128 keys. Two
orientations of S and dP:

- swapped (``rows=False``): S^T = K Q^T, [keys, rows]; P^T feeds dV from registers, dS^T goes to shared memory.
  Each thread holds sixteen rows' lse and Delta.
- rows (``rows=True``, FlashAttention-3's): S = Q K^T, [rows, keys], two rows per thread; P and dS go to shared
  memory and dV, dK read them transposed there.

``dq_mode``: 0, the consumers add their dQ half by elementwise float32 atomics; 1, they stage it in shared memory
and a writer warp adds it (the consumers go on to the next row tile); 2, the writer reads it but adds nothing
(an ablation: the atomics' cost); 3, no dQ at all (an ablation: the dK/dV part alone); 4, the writer adds each
staged half by one TMA bulk reduce-add (FlashAttention-3's way). Keys past Nk are not masked here (the product form,
.wip/hopper-bwd, masks them: in float16 their p can overflow and reach dQ as NaN). Triton gives the default
partition (consumer 0) the registers the workers leave (504 per thread over the three warpgroups at 384 threads),
and the loader and the writer share a warpgroup: so ``writer_regs`` above 24 takes registers from consumer 0.
Dense or causal (either alignment by ``off``), no lengths, D 128, bf16/fp16. The host converts dQ after.
"""

from __future__ import annotations

import torch
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

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """A TMA bulk reduce-add of a shared tile into global memory: triton 3.6's builder has the op, its Gluon no
    wrapper (3.9 calls it ``tma.async_atomic_add``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36

HALF_N = gl.constexpr(64)


@gluon.jit
def _row_tiles(n0, Nq, off, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Row tiles [t_lo, t_hi) that may see some key of [n0, n0 + 2 * HALF_N): row i sees key j iff j <= i + off."""
    t_lo = n0 * 0
    if CAUSAL:
        t_lo = gl.maximum(n0 - off, 0) // BLOCK_M
    t_hi = gl.maximum((Nq + BLOCK_M - 1) // BLOCK_M, t_lo)
    return t_lo, t_hi


@gluon.jit
def _hand_off_dq(HALF: gl.constexpr, dq, t, it, head_row, Nq, DQ, dq_bufs, dq_ready, dq_free,
                 BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, DQ_MODE: gl.constexpr):
    """This consumer's half of D of a row tile's dQ (already scaled) into the float32 dQ: by elementwise atomics
    (``DQ_MODE`` 0), else staged in its shared buffer for the writer warp once the writer is done with the last."""
    if DQ_MODE == 0:
        rows = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq.type.layout))
        cols = HALF * (HEAD_D // 2) + gl.arange(0, HEAD_D // 2, layout=gl.SliceLayout(0, dq.type.layout))
        ptrs = DQ + (head_row.to(gl.int64) * Nq + gl.expand_dims(rows, 1)) * HEAD_D + gl.expand_dims(cols, 0)
        gl.atomic_add(ptrs, dq, mask=gl.expand_dims(rows < Nq, 1), sem="relaxed")
    else:
        mbarrier.wait(dq_free.index(HALF), (it & 1) ^ 1)
        if DQ_MODE == 4:  # the writer's TMA reads it through the async proxy
            dq_bufs.index(HALF).reshape([BLOCK_M, HEAD_D // 2]).store(dq)
            fence_async_shared()
        else:
            dq_bufs.index(HALF).store(dq)
        mbarrier.arrive(dq_ready.index(HALF), count=1)


@gluon.jit
def _store_dkdv(dk, dv, k0, b, kvh, Nk, ptrs, HEAD_D: gl.constexpr):
    """A consumer's dK and dV rows (keys k0 onward, in the output dtype); keys past Nk are not stored."""
    DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn = ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6], ptrs[7], ptrs[8], ptrs[9]
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dk.type.layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, dk.type.layout))
    keep = gl.expand_dims(keys < Nk, 1)
    kv_rows = gl.expand_dims(keys.to(gl.int64), 1)
    gl.store(DK + b.to(gl.int64) * s_kb + kvh.to(gl.int64) * s_kh + kv_rows * s_kn + gl.expand_dims(cols, 0), dk,
             mask=keep)
    gl.store(DV + b.to(gl.int64) * s_vb + kvh.to(gl.int64) * s_vh + kv_rows * s_vn + gl.expand_dims(cols, 0), dv,
             mask=keep)


@gluon.jit
def _consumer(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
              BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              DQ_MODE: gl.constexpr):
    q_desc = descs[0]
    q_bufs, do_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
    q_ready, q_empty, do_ready, do_empty, kv_ready, ds_ready, ds_free, dq_ready, dq_free = bars
    Lse2, Delta, DQ = ptrs[0], ptrs[1], ptrs[10]
    Nq, Nk, Hq, group, off = sizes
    dtype: gl.constexpr = q_desc.dtype
    HALF_D: gl.constexpr = HEAD_D // 2

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)

    pid_n = gl.program_id(0)
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * (2 * HALF_N)
    k0 = n0 + HALF * HALF_N
    t_lo, t_hi = _row_tiles(n0, Nq, off, BLOCK_M, CAUSAL)
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    k_tile = k_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    v_tile = v_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_q = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=q_layout)
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)

    mbarrier.wait(kv_ready.index(0), 0)
    it = t_lo * 0
    for g in range(0, group):
        row_base = (b.to(gl.int64) * Hq + kvh * group + g) * Nq
        head_row = b * Hq + kvh * group + g
        for t in range(t_lo, t_hi):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            buf = it % 2
            q_tile = q_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            do_tile = do_bufs.index(slot).reshape([BLOCK_M, HEAD_D])
            mbarrier.wait(q_ready.index(slot), phase)
            S = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dP = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            rows = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            lse2 = gl.load(Lse2 + row_base + rows, mask=rows < Nq, other=float("inf"))
            delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
            S = warpgroup_mma_wait(1, deps=(S, ))
            s = S * qk_scale
            if CAUSAL:
                if t * BLOCK_M + off < k0 + HALF_N - 1:  # a tile the diagonal crosses
                    ok = gl.expand_dims(keys, 1) <= gl.expand_dims(rows + off, 0)
                    s = gl.where(ok, s, float("-inf"))
            p = gl.exp2(s - gl.expand_dims(lse2, 0))
            dP = warpgroup_mma_wait(0, deps=(dP, ))
            ds = p * (dP - gl.expand_dims(delta, 0))
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            # ---- dS^T into this consumer's half of the shared tile (once the last use of this buffer is done) ----
            ds_all = ds_bufs.index(buf)
            mbarrier.wait(ds_free.index(buf), ((it // 2) & 1) ^ 1)
            ds_all.slice(HALF * HALF_N, HALF_N, dim=0).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dk = warpgroup_mma(ds_all.slice(HALF * HALF_N, HALF_N, dim=0), q_tile, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            # ---- dQ[:, this half of D] = dS K over both halves of the keys ----
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
            if DQ_MODE == 3:  # ablation: no dQ at all
                mbarrier.arrive(ds_free.index(buf), count=1)
            else:
                ds_t = ds_all.permute((1, 0))  # [rows, 128 keys]
                dq = warpgroup_mma(ds_t.slice(0, HALF_N, dim=1),
                                   k_bufs.index(0).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                                   zero_q, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_t.slice(HALF_N, HALF_N, dim=1),
                                   k_bufs.index(1).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                                   dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(ds_free.index(buf), count=1)
                _hand_off_dq(HALF, dq * scale, t, it, head_row, Nq, DQ, dq_bufs, dq_ready, dq_free, BLOCK_M, HEAD_D,
                             DQ_MODE)
            it += 1

    # ---- epilogue: dK = scale * sum dS^T Q; keys past Nk are not stored ----
    _store_dkdv((dk * scale).to(dtype), dv.to(dtype), k0, b, kvh, Nk, ptrs, HEAD_D)


@gluon.jit
def _consumer_rows(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
                   BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   DQ_MODE: gl.constexpr):
    """The consumer with S and dP as [rows, keys] (two row values per thread, not sixteen): P and dS go through
    shared memory, and dV += P^T dO, dK += dS^T Q read them transposed there."""
    q_desc = descs[0]
    q_bufs, do_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs, p_bufs = bufs
    q_ready, q_empty, do_ready, do_empty, kv_ready, ds_ready, ds_free, dq_ready, dq_free = bars
    Lse2, Delta, DQ = ptrs[0], ptrs[1], ptrs[10]
    Nq, Nk, Hq, group, off = sizes
    dtype: gl.constexpr = q_desc.dtype
    HALF_D: gl.constexpr = HEAD_D // 2

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_N, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_D, 16])

    pid_n = gl.program_id(0)
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * (2 * HALF_N)
    k0 = n0 + HALF * HALF_N
    t_lo, t_hi = _row_tiles(n0, Nq, off, BLOCK_M, CAUSAL)
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
    k_tile = k_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    v_tile = v_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    p_tile = p_bufs.index(HALF)
    zero_s = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    zero_q = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=q_layout)
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)

    mbarrier.wait(kv_ready.index(0), 0)
    it = t_lo * 0
    for g in range(0, group):
        row_base = (b.to(gl.int64) * Hq + kvh * group + g) * Nq
        head_row = b * Hq + kvh * group + g
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
            lse2 = gl.load(Lse2 + row_base + rows, mask=rows < Nq, other=float("inf"))
            delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
            S = warpgroup_mma_wait(1, deps=(S, ))
            s = S * qk_scale
            if CAUSAL:
                if t * BLOCK_M + off < k0 + HALF_N - 1:  # a tile the diagonal crosses
                    ok = gl.expand_dims(keys, 0) <= gl.expand_dims(rows + off, 1)
                    s = gl.where(ok, s, float("-inf"))
            p = gl.exp2(s - gl.expand_dims(lse2, 1))
            p_tile.store(p.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_tile.permute((1, 0)), do_tile, dv, is_async=True)
            dP = warpgroup_mma_wait(1, deps=(dP, ))
            ds = p * (dP - gl.expand_dims(delta, 1))
            # ---- dS into this consumer's half of the shared [2, rows, keys] tile ----
            ds_half = ds_bufs.index(buf * 2 + HALF)
            mbarrier.wait(ds_free.index(buf), ((it // 2) & 1) ^ 1)
            ds_half.store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dk = warpgroup_mma(ds_half.permute((1, 0)), q_tile, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            # ---- dQ[:, this half of D] = dS K over both halves of the keys ----
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
            if DQ_MODE == 3:  # ablation: no dQ at all
                mbarrier.arrive(ds_free.index(buf), count=1)
            else:
                dq = warpgroup_mma(ds_bufs.index(buf * 2),
                                   k_bufs.index(0).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                                   zero_q, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_bufs.index(buf * 2 + 1),
                                   k_bufs.index(1).reshape([HALF_N, HEAD_D]).slice(HALF * HALF_D, HALF_D, dim=1),
                                   dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(ds_free.index(buf), count=1)
                _hand_off_dq(HALF, dq * scale, t, it, head_row, Nq, DQ, dq_bufs, dq_ready, dq_free, BLOCK_M, HEAD_D,
                             DQ_MODE)
            it += 1

    _store_dkdv((dk * scale).to(dtype), dv.to(dtype), k0, b, kvh, Nk, ptrs, HEAD_D)


@gluon.jit
def _loader(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
            BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    q_desc, do_desc, k_desc, v_desc = descs[0], descs[1], descs[2], descs[3]
    q_bufs, do_bufs, k_bufs, v_bufs = bufs[0], bufs[1], bufs[2], bufs[3]
    q_ready, q_empty, do_ready, do_empty, kv_ready = bars[0], bars[1], bars[2], bars[3], bars[4]
    Nq, _, _, group, off = sizes
    pid_n = gl.program_id(0)
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * (2 * HALF_N)
    t_lo, t_hi = _row_tiles(n0, Nq, off, BLOCK_M, CAUSAL)
    mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(k_desc, [b, kvh, n0 + half * HALF_N, 0], kv_ready.index(0), k_bufs.index(half))
        _tma_load(v_desc, [b, kvh, n0 + half * HALF_N, 0], kv_ready.index(0), v_bufs.index(half))
    it = t_lo * 0
    for g in range(0, group):
        h = kvh * group + g
        for t in range(t_lo, t_hi):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(q_empty.index(slot), phase ^ 1)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, t * BLOCK_M, 0], q_ready.index(slot), q_bufs.index(slot))
            mbarrier.wait(do_empty.index(slot), phase ^ 1)
            mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
            _tma_load(do_desc, [b, h, t * BLOCK_M, 0], do_ready.index(slot), do_bufs.index(slot))
            it += 1


@gluon.jit
def _dq_writer(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
               BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               DQ_MODE: gl.constexpr, WRITER_ROWS: gl.constexpr):
    """Adds the consumers' staged dQ halves into the float32 dQ (one warp): by elementwise atomics
    (``DQ_MODE`` 1) or by one TMA bulk reduce-add a half (4)."""
    dq_desc = descs[4]
    dq_bufs = bufs[5]
    dq_ready, dq_free = bars[7], bars[8]
    DQ = ptrs[10]
    Nq, _, Hq, group, off = sizes
    HALF_D: gl.constexpr = HEAD_D // 2
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16],
                                            warps_per_cta=[1, 1], order=[1, 0])
    pid_n = gl.program_id(0)
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * (2 * HALF_N)
    t_lo, t_hi = _row_tiles(n0, Nq, off, BLOCK_M, CAUSAL)
    r_off = gl.arange(0, WRITER_ROWS, layout=gl.SliceLayout(1, layout))
    c_off = gl.arange(0, HALF_D, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(r_off, 1) * HEAD_D + gl.expand_dims(c_off, 0)  # int32, within a chunk of rows
    sink = gl.zeros([WRITER_ROWS, HALF_D], gl.float32, layout=layout)
    it = t_lo * 0
    for g in range(0, group):
        head_row = b * Hq + kvh * group + g
        for t in range(t_lo, t_hi):
            rows_left = Nq - t * BLOCK_M
            for half in range(0, 2):
                tile_base = DQ + (head_row.to(gl.int64) * Nq + t * BLOCK_M) * HEAD_D + half * HALF_D
                mbarrier.wait(dq_ready.index(half), it & 1)
                if DQ_MODE == 4:  # rows past Nq fall outside the descriptor's bounds: TMA skips them
                    _tma_add(dq_desc, [b, kvh * group + g, t * BLOCK_M, half * HALF_D], dq_bufs.index(half))
                    tma.store_wait(0)
                else:
                    tile = dq_bufs.index(half)
                    for c in gl.static_range(0, BLOCK_M // WRITER_ROWS):
                        part = tile.slice(c * WRITER_ROWS, WRITER_ROWS, dim=0).load(layout)
                        if DQ_MODE == 1:
                            keep = gl.expand_dims(r_off < rows_left - c * WRITER_ROWS, 1)
                            gl.atomic_add(tile_base + c * WRITER_ROWS * HEAD_D + offs, part, mask=keep,
                                          sem="relaxed")
                        else:  # ablation: read, do not add
                            sink += part
                mbarrier.arrive(dq_free.index(half), count=1)
            it += 1
    if DQ_MODE == 2:
        gl.store(DQ + gl.expand_dims(r_off, 1) * HEAD_D + gl.expand_dims(c_off, 0), sink,
                 mask=gl.expand_dims(r_off < 0, 1))


@gluon.jit(do_not_specialize=["Nq", "Nk", "Hq", "group", "off"])
def bwd_hopper(q_desc, do_desc, k_desc, v_desc, dq_desc, Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
               DQ, Nq, Nk, Hq, group, off, qk_scale, scale,
               BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, DQ_MODE: gl.constexpr, WRITER_ROWS: gl.constexpr,
               WRITER_REGS: gl.constexpr, ROWS: gl.constexpr):
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF_N, BLOCK_M], q_desc.dtype)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2, 1, 1, HALF_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2, 1, 1, HALF_N, HEAD_D], v_desc.layout)
    if ROWS:  # [buffer * 2 + half, rows, keys of the half]
        rk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], q_desc.dtype)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_M, HALF_N], rk_layout)
        p_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HALF_N], rk_layout)
    else:
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, 2 * HALF_N, BLOCK_M], ds_layout)
        p_bufs = ds_bufs
    if DQ_MODE == 4:  # the descriptor's swizzle, for the TMA
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_D // 2], dq_desc.layout)
    else:
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=WRITER_ROWS, order=[1, 0])
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2], dq_layout)
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS^T stored
        mbarrier.init(ds_free.index(i), count=2)  # both consumers' dQ products done with it
        mbarrier.init(dq_ready.index(i), count=1)  # consumer i staged its dQ half
        mbarrier.init(dq_free.index(i), count=1)  # the writer has added it
    mbarrier.init(kv_ready.index(0), count=1)

    descs = (q_desc, do_desc, k_desc, v_desc, dq_desc)
    bufs = (q_bufs, do_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs, p_bufs)
    bars = (q_ready, q_empty, do_ready, do_empty, kv_ready, ds_ready, ds_free, dq_ready, dq_free)
    ptrs = (Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, DQ)
    sizes = (Nq, Nk, Hq, group, off)
    if DQ_MODE == 1 or DQ_MODE == 2 or DQ_MODE == 4:
        gl.warp_specialize([
            (_consumer_rows if ROWS else _consumer,
             (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL, DQ_MODE)),
            (_consumer_rows if ROWS else _consumer,
             (1, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL, DQ_MODE)),
            (_loader, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
            (_dq_writer, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL, DQ_MODE,
                          WRITER_ROWS)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, WRITER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_rows if ROWS else _consumer,
             (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL, DQ_MODE)),
            (_consumer_rows if ROWS else _consumer,
             (1, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL, DQ_MODE)),
            (_loader, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])

def _layout(block, dtype):
    names = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
    return gl.NVMMASharedLayout.get_default_for(block, names[dtype])


def _descriptor(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, t.dtype))


def launch_args(q, k, v, dout, lse2, delta, dq_acc, dk, dv, causal: bool, scale: float, stages: int = 2,
                regs: int = 240, dq_mode: int = 1, writer_rows: int = 4, writer_regs: int = 24,
                rows: bool = False):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    block_m = 64
    assert D == 128 and dk.stride(-1) == 1 and dv.stride(-1) == 1 and dq_acc.is_contiguous()
    grid = (-(-Nk // (2 * HALF_N.value)), Hkv, B)
    args = (_descriptor(q, [1, 1, block_m, D]), _descriptor(dout, [1, 1, block_m, D]),
            _descriptor(k, [1, 1, HALF_N.value, D]), _descriptor(v, [1, 1, HALF_N.value, D]),
            _descriptor(dq_acc, [1, 1, block_m, D // 2]), lse2, delta, dk, dv,
            *dk.stride()[:3], *dv.stride()[:3], dq_acc, Nq, Nk, Hq, Hq // Hkv, Nk - Nq if causal else 0,
            scale * 1.4426950408889634, scale)
    kw = dict(BLOCK_M=block_m, HEAD_D=D, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=regs,
              DQ_MODE=dq_mode, WRITER_ROWS=writer_rows, WRITER_REGS=writer_regs, ROWS=rows, num_warps=4,
              maxnreg=168)
    return grid, args, kw


def gradients(q, k, v, dout, lse2, delta, causal: bool, scale: float, **cfg):
    """dq, dk, dv of [B, H, N, 128] bf16/fp16 tensors given lse2 (base-2 lse, +inf for empty rows) and Delta,
    both float32 [B, Hq, Nq] contiguous."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grid, args, kw = launch_args(q, k, v, dout, lse2, delta, dq_acc, dk, dv, causal, scale, **cfg)
    bwd_hopper[grid](*args, **kw)
    return dq_acc.to(q.dtype), dk, dv
