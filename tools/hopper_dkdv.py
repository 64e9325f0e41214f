"""An experiment, not the product: a Hopper dK/dV kernel in Gluon (warp-specialized, TMA, warpgroup MMA).

A program owns BLOCK_N = 2 * 64 keys of one kv head: two consumer warpgroups own 64 keys each (their K and V
halves stay in shared memory for the whole program, their dK and dV accumulators in registers); a loader warp
streams the row tiles (Q and dO, BLOCK_M rows) of every query head of the group through a ring of STAGES slots.
Per row tile a consumer computes S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory), P^T = exp2(S^T * c -
lse2), dS^T = P^T * (dP^T - Delta), and dV += P^T dO, dK += dS^T Q (P^T and dS^T from registers). Dense or
causal, no lengths.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

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
def _consumer(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
              BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    q_desc = descs[0]
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, q_empty, do_ready, do_empty, kv_ready = bars
    Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn = ptrs
    Nq, Nk, Hq, group, off = sizes
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
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
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)

    mbarrier.wait(kv_ready.index(0), 0)
    it = t_lo * 0
    for g in range(0, group):
        row_base = (b.to(gl.int64) * Hq + kvh * group + g) * Nq
        for t in range(t_lo, t_hi):
            slot = it % STAGES
            phase = (it // STAGES) & 1
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
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            it += 1

    # ---- epilogue: dK = scale * sum dS^T Q; keys past Nk are not stored ----
    keys_a = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    keep = gl.expand_dims(keys_a < Nk, 1)
    kv_rows = gl.expand_dims(keys_a.to(gl.int64), 1)
    dk_ptrs = DK + b.to(gl.int64) * s_kb + kvh.to(gl.int64) * s_kh + kv_rows * s_kn + gl.expand_dims(cols, 0)
    dv_ptrs = DV + b.to(gl.int64) * s_vb + kvh.to(gl.int64) * s_vh + kv_rows * s_vn + gl.expand_dims(cols, 0)
    gl.store(dk_ptrs, (dk * scale).to(dtype), mask=keep)
    gl.store(dv_ptrs, dv.to(dtype), mask=keep)


@gluon.jit
def _p_and_ds(S, dP, it, n_t, t_lo, b, kvh, group, Hq, Nq, Lse2, Delta, keys, k0, off, qk_scale,
              s_layout: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr, BLOCK_M: gl.constexpr,
              CAUSAL: gl.constexpr):
    """P^T and dS^T of the ring's tile ``it`` (head g = it // n_t of the group, row tile t_lo + it % n_t), as the
    A operands of dV += P^T dO and dK += dS^T Q."""
    g = it // n_t
    t = t_lo + it - g * n_t
    row_base = (b.to(gl.int64) * Hq + kvh * group + g) * Nq
    rows = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    lse2 = gl.load(Lse2 + row_base + rows, mask=rows < Nq, other=float("inf"))
    delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
    s = S * qk_scale
    if CAUSAL:
        if t * BLOCK_M + off < k0 + HALF_N - 1:  # a tile the diagonal crosses
            ok = gl.expand_dims(keys, 1) <= gl.expand_dims(rows + off, 0)
            s = gl.where(ok, s, float("-inf"))
    p = gl.exp2(s - gl.expand_dims(lse2, 0))
    ds = p * (dP - gl.expand_dims(delta, 0))
    return p, ds


@gluon.jit
def _consumer_pipe(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
                   BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   LATE_CONVERT: gl.constexpr):
    """As _consumer, pipelined by one tile (the forward's schedule): tile i's S and dP are issued ahead of tile
    i-1's dV and dK, and the elementwise step of tile i runs while those two are on the tensor cores."""
    q_desc = descs[0]
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, q_empty, do_ready, do_empty, kv_ready = bars
    Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn = ptrs
    Nq, Nk, Hq, group, off = sizes
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)

    pid_n = gl.program_id(0)
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * (2 * HALF_N)
    k0 = n0 + HALF * HALF_N
    t_lo, t_hi = _row_tiles(n0, Nq, off, BLOCK_M, CAUSAL)
    n_t = t_hi - t_lo
    n_all = n_t * group
    keys = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    k_tile = k_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    v_tile = v_bufs.index(HALF).reshape([HALF_N, HEAD_D])
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=a_layout)
    p_op = gl.zeros([HALF_N, BLOCK_M], dtype, layout=op_layout)
    ds_op = gl.zeros([HALF_N, BLOCK_M], dtype, layout=op_layout)

    mbarrier.wait(kv_ready.index(0), 0)
    if n_all > 0:  # ---- tile 0: S, dP, then its P^T and dS^T ----
        mbarrier.wait(q_ready.index(0), 0)
        S = warpgroup_mma(k_tile, q_bufs.index(0).reshape([BLOCK_M, HEAD_D]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(0), 0)
        dP = warpgroup_mma(v_tile, do_bufs.index(0).reshape([BLOCK_M, HEAD_D]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
        S, dP = warpgroup_mma_wait(0, deps=(S, dP))
        p, ds = _p_and_ds(S, dP, 0, n_t, t_lo, b, kvh, group, Hq, Nq, Lse2, Delta, keys, k0, off, qk_scale,
                          s_layout, op_layout, dtype, BLOCK_M, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
    for it in range(1, n_all):
        # ---- issue S_it, dP_it, then dV and dK of tile it-1; P^T, dS^T of tile it while the last two run ----
        slot = it % STAGES
        phase = (it // STAGES) & 1
        prev = (it - 1) % STAGES
        mbarrier.wait(q_ready.index(slot), phase)
        S = warpgroup_mma(k_tile, q_bufs.index(slot).reshape([BLOCK_M, HEAD_D]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dP = warpgroup_mma(v_tile, do_bufs.index(slot).reshape([BLOCK_M, HEAD_D]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
        dv = warpgroup_mma(p_op, do_bufs.index(prev).reshape([BLOCK_M, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_bufs.index(prev).reshape([BLOCK_M, HEAD_D]), dk, is_async=True)
        S, dP = warpgroup_mma_wait(2, deps=(S, dP))
        if LATE_CONVERT:  # the operands in flight are rewritten only after their products are done
            p, ds = _p_and_ds(S, dP, it, n_t, t_lo, b, kvh, group, Hq, Nq, Lse2, Delta, keys, k0, off, qk_scale,
                              s_layout, op_layout, dtype, BLOCK_M, CAUSAL)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        else:
            p, ds = _p_and_ds(S, dP, it, n_t, t_lo, b, kvh, group, Hq, Nq, Lse2, Delta, keys, k0, off,
                              qk_scale, s_layout, op_layout, dtype, BLOCK_M, CAUSAL)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(prev), count=1)
        mbarrier.arrive(do_empty.index(prev), count=1)
    if n_all > 0:  # ---- the last tile's dV and dK ----
        last = (n_all - 1) % STAGES
        dv = warpgroup_mma(p_op, do_bufs.index(last).reshape([BLOCK_M, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_bufs.index(last).reshape([BLOCK_M, HEAD_D]), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(last), count=1)
        mbarrier.arrive(do_empty.index(last), count=1)

    # ---- epilogue: dK = scale * sum dS^T Q; keys past Nk are not stored ----
    keys_a = k0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    keep = gl.expand_dims(keys_a < Nk, 1)
    kv_rows = gl.expand_dims(keys_a.to(gl.int64), 1)
    dk_ptrs = DK + b.to(gl.int64) * s_kb + kvh.to(gl.int64) * s_kh + kv_rows * s_kn + gl.expand_dims(cols, 0)
    dv_ptrs = DV + b.to(gl.int64) * s_vb + kvh.to(gl.int64) * s_vh + kv_rows * s_vn + gl.expand_dims(cols, 0)
    gl.store(dk_ptrs, (dk * scale).to(dtype), mask=keep)
    gl.store(dv_ptrs, dv.to(dtype), mask=keep)


@gluon.jit
def _loader(HALF: gl.constexpr, descs, bufs, bars, ptrs, sizes, qk_scale, scale,
            BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    q_desc, do_desc, k_desc, v_desc = descs
    q_bufs, do_bufs, k_bufs, v_bufs = bufs
    q_ready, q_empty, do_ready, do_empty, kv_ready = bars
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


@gluon.jit(do_not_specialize=["Nq", "Nk", "Hq", "group", "off"])
def bwd_dkdv_hopper(q_desc, do_desc, k_desc, v_desc, Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                    Nq, Nk, Hq, group, off, qk_scale, scale,
                    BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PIPE: gl.constexpr):
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2, 1, 1, HALF_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2, 1, 1, HALF_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(do_empty.index(i), count=2)
    mbarrier.init(kv_ready.index(0), count=1)

    descs = (q_desc, do_desc, k_desc, v_desc)
    bufs = (q_bufs, do_bufs, k_bufs, v_bufs)
    bars = (q_ready, q_empty, do_ready, do_empty, kv_ready)
    ptrs = (Lse2, Delta, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn)
    sizes = (Nq, Nk, Hq, group, off)
    if PIPE > 0:
        gl.warp_specialize([
            (_consumer_pipe, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL,
                              PIPE == 2)),
            (_consumer_pipe, (1, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL,
                              PIPE == 2)),
            (_loader, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
            (_consumer, (1, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
            (_loader, (0, descs, bufs, bars, ptrs, sizes, qk_scale, scale, BLOCK_M, HEAD_D, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block, t.dtype))


def launch_args(q, k, v, dout, lse2, delta, dk, dv, causal: bool, scale: float, block_m: int = 64,
                stages: int = 2, regs: int = 240, pipe: int = 0):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    assert dk.stride(-1) == 1 and dv.stride(-1) == 1
    grid = (-(-Nk // (2 * HALF_N.value)), Hkv, B)
    args = (_descriptor(q, [1, 1, block_m, D]), _descriptor(dout, [1, 1, block_m, D]),
            _descriptor(k, [1, 1, HALF_N.value, D]), _descriptor(v, [1, 1, HALF_N.value, D]), lse2, delta, dk, dv,
            *dk.stride()[:3], *dv.stride()[:3], Nq, Nk, Hq, Hq // Hkv, Nk - Nq if causal else 0,
            scale * 1.4426950408889634, scale)
    kw = dict(BLOCK_M=block_m, HEAD_D=D, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=regs, PIPE=pipe, num_warps=4,
              maxnreg=168)
    return grid, args, kw


def dkdv(q, k, v, dout, lse2, delta, causal: bool, scale: float, **cfg):
    """dk, dv of [B, H, N, D] bf16/fp16 tensors given lse2 (base-2 lse, +inf for empty rows) and Delta, both
    float32 [B, Hq, Nq] contiguous."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, args, kw = launch_args(q, k, v, dout, lse2, delta, dk, dv, causal, scale, **cfg)
    bwd_dkdv_hopper[grid](*args, **kw)
    return dk, dv
