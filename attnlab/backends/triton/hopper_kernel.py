"""The Hopper forward kernel (sm_90, Gluon): warp-specialized, TMA loads, warpgroup MMA.

Tiling and warp mapping
-----------------------
A work item is ``2 * BLOCK_M`` query rows (BLOCK_M = 64) of one (batch b, query head h); query head h reads kv
head ``h // group``. Items are numbered head by head, each head's row tiles last-first: item t is row tile
``n_m - 1 - t % n_m`` of head ``t // n_m`` (n_m row tiles per head). Program p of P runs items p, p + P, ...:
the host launches one program per item under a band (the hardware then hands the longest first and balances
the rest) and at most one per SM without one (every item costs the same; a program's next item reuses its
shared memory and overlaps its loads with the last one's epilogue). Either way the items running at once are
a few heads' row tiles, whose K and V stay in L2. The program's warps split into three partitions:

- a **loader** (one warp) that issues TMA copies: for each item, the two halves of the Q tile as their slots
  free up, then K and V tiles of ``BLOCK_N`` keys into a ring of ``STAGES`` shared-memory slots that runs on
  across items, each slot guarded by a *ready* barrier (the copy's bytes landed) and an *empty* barrier (both
  consumers are done with it);
- two **consumers** (a warpgroup of four warps each, rows ``[0, BLOCK_M)`` and ``[BLOCK_M, 2 * BLOCK_M)`` of the
  tile) that run ``S = Q K^T`` and ``acc += P V`` as warpgroup MMAs (``wgmma``) straight from the shared slots
  and keep the online softmax in the accumulator's registers. The two consumers run free of each other, so
  one's softmax overlaps the other's matrix products on the tensor cores; with PINGPONG they take turns to
  issue them (FlashAttention-3's ping-pong: a consumer waits for its turn, issues its products, passes the turn
  by an mbarrier and runs its softmax while the other's products run). After an item's last ``Q K^T`` a
  consumer releases its Q half (the loader brings the next item's while the last ``P V`` and the epilogue run)
  and stages its output in a shared slot of its own for one TMA store.

Inside a consumer the products are pipelined by one tile: for key tile j it issues ``S_j = Q K_j^T`` and then
``acc += P_{j-1} V_{j-1}``, waits for the first only, and computes the softmax of ``S_j`` while the second runs.
The wgmma groups retire in issue order, so ``warpgroup_mma_wait(1)`` returns once ``S_j`` is done.

Online softmax in base 2 (as :mod:`~attnlab.backends.triton.forward_kernel`)
---------------------------------------------------------------------
``s = (q . k) * scale * log2(e)``; per row ``m_i`` (running max), ``l_i`` (running sum of ``exp2(s - m_i)``),
``acc`` (running sum of ``exp2(s - m_i) v``, float32). ``alpha = exp2(m_i - m_new)`` rescales ``acc`` once
its pending product has landed. A row that has seen no allowed key has ``m_new = -inf``; the subtraction uses 0
there, which keeps every ``p`` and ``alpha`` at exactly 0. At the end ``out = acc / l_i`` and
``lse = (m_i + log2 l_i) ln 2``; a row with ``l_i = 0`` writes 0 and lse = -inf. P is rounded to the input
dtype before ``P V``.

Masks: the band (causal or window, either alignment, aligned with the batch entry's lengths) and the lengths:
keys past kv_len are masked, rows past q_len are padding (0, lse -inf). Tiles that every row of a consumer sees
whole skip the mask arithmetic; the others apply it. The score modifiers apply to every tile, in base 2 and in
the portable kernel's order: the soft cap, then ALiBi (``- slope * |i + Lk - Lq - j|``). Tiles outside the band
are never loaded. The TMA descriptors are four-dimensional ``[B, H, N, D]`` over the caller's strides, so rows
past N read as zeros and stores past Nq are clipped by the copy engine. What this kernel computes is
:func:`hopper_forward.unsupported`'s; every other call runs the portable kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# triton 3.6 names the TMA copies async_copy_*; later releases name them async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _full_tiles(i0, Lq, Lk, off, win_left, win_right, t_lo, t_hi, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_Q_LEN: gl.constexpr):
    """Key tiles ``[f_lo, f_hi)`` inside ``[t_lo, t_hi)`` that every row of ``[i0, i0 + BLOCK_M)`` sees whole (with
    q_len, none where a row is padding: those rows are masked to 0)."""
    i_last = gl.minimum(i0 + BLOCK_M, Lq) - 1
    full_lo = t_lo * 0
    full_hi = Lk + t_lo * 0
    if HAS_Q_LEN:
        full_hi = gl.where(i0 + BLOCK_M <= Lq, full_hi, 0)
    if HAS_LEFT:
        full_lo = gl.maximum(full_lo, i_last + off - win_left)
    if HAS_RIGHT:
        full_hi = gl.minimum(full_hi, i0 + off + win_right + 1)
    f_lo = gl.minimum(gl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
    f_hi = gl.maximum(gl.minimum(gl.maximum(full_hi, 0) // BLOCK_N, t_hi), f_lo)
    return f_lo, f_hi


@gluon.jit
def _softmax_update(S, j, m_i, l_i, rows, qk_scale, f_lo, f_hi, Lq, Lk, off, win_left, win_right, cap2, slope2,
                    BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_Q_LEN: gl.constexpr,
                    HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """One key tile's step of the online softmax: (p, m_new, l_new, alpha) from the raw products ``S``. In base 2:
    the soft cap ``cap2 * tanh(s / cap2)`` (tanh by exp2, saturating), then ALiBi ``- slope2 * |i + Lk - Lq - j|``,
    as the portable kernel's tiles.softcap and tiles.alibi; then, in partial tiles, the lengths and the band."""
    s = S * qk_scale
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S.type.layout))
    if HAS_SOFTCAP:
        s = cap2 * (1.0 - 2.0 / (1.0 + gl.exp2(s * (2.0 * 1.4426950408889634 / cap2))))
    if HAS_ALIBI:
        dist = gl.expand_dims((rows + (Lk - Lq)).to(gl.float32), 1) - gl.expand_dims(keys.to(gl.float32), 0)
        s = s - slope2 * gl.abs(dist)
    if (j < f_lo) | (j >= f_hi):  # a partial tile: the lengths and the band
        key_j = gl.expand_dims(keys, 0)
        row_i = gl.expand_dims(rows, 1)
        ok = (key_j < Lk) & (row_i >= 0)
        if HAS_Q_LEN:
            ok = ok & (row_i < Lq)
        if HAS_LEFT:
            ok = ok & (key_j >= row_i + off - win_left)
        if HAS_RIGHT:
            ok = ok & (key_j <= row_i + off + win_right)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _tile(t, Hq, group, bounds, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
          HAS_RIGHT: gl.constexpr, HAS_KV_LEN: gl.constexpr, HAS_Q_LEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """Work item t: (b, h, kv head, first row m0, key tiles [t_lo, t_hi) that some of its 2 * BLOCK_M rows may
    see, the batch entry's lengths Lq and Lk (kv_len, q_len clamped into [0, N]) and its diagonal offset). Head by
    head, each head's row tiles last-first (under a causal band the longest first)."""
    Nq, Nk, win_left, win_right, KvLen, QLen = bounds
    n_m = (Nq + 2 * BLOCK_M - 1) // (2 * BLOCK_M)
    pid_m = n_m - 1 - t % n_m
    bh = t // n_m
    b = bh // Hq
    h = bh % Hq
    m0 = pid_m * (2 * BLOCK_M)
    Lq = Nq + m0 * 0
    Lk = Nk + m0 * 0
    if HAS_Q_LEN:
        Lq = gl.minimum(gl.maximum(gl.load(QLen + b), 0), Nq)
    if HAS_KV_LEN:
        Lk = gl.minimum(gl.maximum(gl.load(KvLen + b), 0), Nk)
    if BOTTOM_RIGHT:
        off = Lk - Lq
    else:
        off = m0 * 0
    i_last = gl.minimum(m0 + 2 * BLOCK_M, Lq) - 1
    lo = m0 * 0
    hi = gl.where(m0 < Lq, Lk, 0)  # an item of padding rows only sees no key
    if HAS_LEFT:
        lo = gl.maximum(lo, m0 + off - win_left)
    if HAS_RIGHT:
        hi = gl.minimum(hi, i_last + off + win_right + 1)
    t_lo = lo // BLOCK_N
    t_hi = gl.where(hi > lo, (hi + BLOCK_N - 1) // BLOCK_N, t_lo)
    return b, h, h // group, m0, t_lo, t_hi, Lq, Lk, off


@gluon.jit
def _turn_take(turns, k_turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is this consumer's turn to issue its products (its ``k_turn``-th; consumer 0
    goes first: a fresh barrier reads as phase 1 done)."""
    if PINGPONG:
        mbarrier.wait(turns.index(HALF), (k_turn & 1) ^ (1 - HALF))


@gluon.jit
def _turn_pass(turns, k_turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: products issued; the other consumer's turn. Returns the turns taken so far."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - HALF), count=1)
    return k_turn + 1


@gluon.jit
def _consumer_item(t, it0, n_done, k_turn, HALF: gl.constexpr, descs, bufs, bars, Lse, sizes, bounds, qk_scale,
                   mods, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, WRITE_LSE: gl.constexpr,
                   PINGPONG: gl.constexpr, HAS_KV_LEN: gl.constexpr, HAS_Q_LEN: gl.constexpr,
                   BOTTOM_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """Rows ``[m0 + HALF * BLOCK_M, + BLOCK_M)`` of work item ``t``: the pipelined loop over its key tiles and the
    epilogue. ``it0``: the K/V ring's position, which runs on across items; ``n_done``: items done before this
    one; ``k_turn``: the product-issuing turns taken (both consumers take one per key tile and one more for the
    last P V of an item with a key tile, none for an item without: their counts agree). Returns the three,
    advanced past this item."""
    q_desc, o_desc = descs[0], descs[3]
    q_bufs, k_bufs, v_bufs, o_bufs = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    Hq, group, _, s_lb, s_lh, s_ln = sizes
    Nq, win_left, win_right = bounds[0], bounds[2], bounds[3]
    cap2, Alibi, s_ab, s_ah = mods

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_desc.dtype
    q_tile = q_bufs.index(HALF).reshape([BLOCK_M, HEAD_D])
    o_tile = o_bufs.index(HALF).reshape([BLOCK_M, HEAD_D])
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    b, h, _, m0, t_lo, t_hi, Lq, Lk, off = _tile(t, Hq, group, bounds, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                 HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
    i0 = m0 + HALF * BLOCK_M
    rows = i0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    f_lo, f_hi = _full_tiles(i0, Lq, Lk, off, win_left, win_right, t_lo, t_hi, BLOCK_M, BLOCK_N, HAS_LEFT,
                             HAS_RIGHT, HAS_Q_LEN)
    slope2 = qk_scale * 0.0
    if HAS_ALIBI:  # the head's slope, in base 2
        slope2 = gl.load(Alibi + b.to(gl.int64) * s_ab + h.to(gl.int64) * s_ah) * 1.4426950408889634
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)

    mbarrier.wait(q_ready.index(HALF), n_done & 1)
    if t_hi > t_lo:
        # ---- the first key tile: S_0 and its softmax (acc is still zero) ----
        slot = it0 % STAGES
        mbarrier.wait(k_ready.index(slot), (it0 // STAGES) & 1)
        k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
        _turn_take(turns, k_turn, HALF, PINGPONG)
        S = warpgroup_mma(q_tile, k_t, zero_s, use_acc=False, is_async=True)
        k_turn = _turn_pass(turns, k_turn, HALF, PINGPONG)
        S = warpgroup_mma_wait(0, deps=(S, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_i, l_i, alpha = _softmax_update(S, t_lo, m_i, l_i, rows, qk_scale, f_lo, f_hi, Lq, Lk, off, win_left,
                                             win_right, cap2, slope2, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_Q_LEN,
                                             HAS_SOFTCAP, HAS_ALIBI)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        # ---- key tile j: issue S_j, then P_{j-1} V_{j-1}; the softmax of S_j runs while P V is on the tensor
        # cores (wgmma groups retire in issue order, so waiting for all but one returns once S_j is done) ----
        for j in range(t_lo + 1, t_hi):
            it = it0 + j - t_lo
            slot = it % STAGES
            prev = (it - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
            k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
            _turn_take(turns, k_turn, HALF, PINGPONG)
            S = warpgroup_mma(q_tile, k_t, zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
            k_turn = _turn_pass(turns, k_turn, HALF, PINGPONG)
            S = warpgroup_mma_wait(1, deps=(S, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m_i, l_i, alpha = _softmax_update(S, j, m_i, l_i, rows, qk_scale, f_lo, f_hi, Lq, Lk, off,
                                                 win_left, win_right, cap2, slope2, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                 HAS_Q_LEN, HAS_SOFTCAP, HAS_ALIBI)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        # ---- Q is read for the last time: the loader may bring the next item's; the last P V ----
        mbarrier.arrive(q_empty.index(HALF), count=1)
        it = it0 + t_hi - 1 - t_lo
        last = it % STAGES
        mbarrier.wait(v_ready.index(last), (it // STAGES) & 1)
        _turn_take(turns, k_turn, HALF, PINGPONG)
        acc = warpgroup_mma(p_op, v_bufs.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        k_turn = _turn_pass(turns, k_turn, HALF, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(last), count=1)
    else:
        mbarrier.arrive(q_empty.index(HALF), count=1)

    # ---- epilogue: normalize, stage through this half's O slot (its last store done), one TMA store; lse ----
    live = l_i != 0.0
    l_div = gl.where(live, l_i, 1.0)
    scale_o = gl.convert_layout(gl.where(live, 1.0 / l_div, 0.0), gl.SliceLayout(1, o_layout))
    live_o = gl.expand_dims(gl.convert_layout(live, gl.SliceLayout(1, o_layout)), 1)
    out = gl.where(live_o, acc * gl.expand_dims(scale_o, 1), 0.0)  # a dead row is 0, whatever 0 * V gave acc
    tma.store_wait(0)
    o_tile.store(out.to(dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, i0, 0], o_bufs.index(HALF))
    if WRITE_LSE:
        lse = gl.where(live, (m_i + gl.log2(l_div)) * 0.6931471805599453, float("-inf"))
        l_ptrs = Lse + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows.to(gl.int64) * s_ln
        gl.store(l_ptrs, lse, mask=rows < Nq)
    return it0 + t_hi - t_lo, n_done + 1, k_turn


@gluon.jit
def _consumer(HALF: gl.constexpr, descs, bufs, bars, Lse, sizes, bounds, qk_scale, mods,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, WRITE_LSE: gl.constexpr, PERSISTENT: gl.constexpr,
              PINGPONG: gl.constexpr, HAS_KV_LEN: gl.constexpr, HAS_Q_LEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
              HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """A consumer's half of each of the program's work items (one item unless PERSISTENT)."""
    it0 = gl.program_id(0) * 0
    n_done = it0
    k_turn = it0
    if PERSISTENT:
        for t in range(gl.program_id(0), sizes[2], gl.num_programs(0)):
            it0, n_done, k_turn = _consumer_item(t, it0, n_done, k_turn, HALF, descs, bufs, bars, Lse, sizes,
                                                 bounds, qk_scale, mods, BLOCK_M, BLOCK_N, HEAD_D, STAGES, HAS_LEFT,
                                                 HAS_RIGHT, WRITE_LSE, PINGPONG, HAS_KV_LEN, HAS_Q_LEN,
                                                 BOTTOM_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
    else:
        _consumer_item(gl.program_id(0), it0, n_done, k_turn, HALF, descs, bufs, bars, Lse, sizes, bounds, qk_scale,
                       mods, BLOCK_M, BLOCK_N, HEAD_D, STAGES, HAS_LEFT, HAS_RIGHT, WRITE_LSE, PINGPONG, HAS_KV_LEN,
                       HAS_Q_LEN, BOTTOM_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
    tma.store_wait(0)


@gluon.jit
def _loader_item(t, it, n_done, descs, bufs, bars, sizes, bounds, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_KV_LEN: gl.constexpr,
                 HAS_Q_LEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """Work item ``t``'s loads: both Q halves as their slots free up, then K_j and V_j into the ring as its slots
    free up. Returns the ring's position and the items done, advanced past this item."""
    q_desc, k_desc, v_desc = descs[0], descs[1], descs[2]
    q_bufs, k_bufs, v_bufs = bufs[0], bufs[1], bufs[2]
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5]
    Hq, group = sizes[0], sizes[1]
    b, h, kvh, m0, t_lo, t_hi, _, _, _ = _tile(t, Hq, group, bounds, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                               HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
    for half in gl.static_range(2):  # a fresh barrier reads as phase 1 done: the first wait passes
        mbarrier.wait(q_empty.index(half), (n_done & 1) ^ 1)
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, m0 + half * BLOCK_M, 0], q_ready.index(half), q_bufs.index(half))
    for j in range(t_lo, t_hi):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [b, kvh, j * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [b, kvh, j * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot))
        it += 1
    return it, n_done + 1


@gluon.jit
def _loader(HALF: gl.constexpr, descs, bufs, bars, Lse, sizes, bounds, qk_scale, mods,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
            HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, WRITE_LSE: gl.constexpr, PERSISTENT: gl.constexpr,
            PINGPONG: gl.constexpr, HAS_KV_LEN: gl.constexpr, HAS_Q_LEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
            HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """The TMA partition: each of the program's work items in turn (one unless PERSISTENT)."""
    it = gl.program_id(0) * 0
    n_done = it
    if PERSISTENT:
        for t in range(gl.program_id(0), sizes[2], gl.num_programs(0)):
            it, n_done = _loader_item(t, it, n_done, descs, bufs, bars, sizes, bounds, BLOCK_M, BLOCK_N, STAGES,
                                      HAS_LEFT, HAS_RIGHT, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
    else:
        _loader_item(gl.program_id(0), it, n_done, descs, bufs, bars, sizes, bounds, BLOCK_M, BLOCK_N, STAGES,
                     HAS_LEFT, HAS_RIGHT, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)


@gluon.jit(do_not_specialize=["Lse", "s_lb", "s_lh", "s_ln", "Nq", "Nk", "B", "Hq", "group", "win_left",
                              "win_right", "KvLen", "QLen", "Alibi", "s_ab", "s_ah", "cap2"])
def attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, Lse, s_lb, s_lh, s_ln, Nq, Nk, B, Hq, group, qk_scale,
                    win_left, win_right, KvLen, QLen, Alibi, s_ab, s_ah, cap2,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                    WRITE_LSE: gl.constexpr, CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
                    PINGPONG: gl.constexpr, HAS_KV_LEN: gl.constexpr, HAS_Q_LEN: gl.constexpr,
                    HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """Program p of P runs work item p (PERSISTENT: items p, p + P, p + 2P, ...) of the
    ``ceil(Nq / (2 * BLOCK_M)) * B * Hq`` items (the module docstring: P is the host's choice)."""
    n_items = (Nq + 2 * BLOCK_M - 1) // (2 * BLOCK_M) * (B * Hq)

    # ---- shared memory: the Q halves, the K and V rings, the O halves; their barriers ----
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2, 1, 1, BLOCK_M, HEAD_D], o_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)  # ping-pong: the other consumer passes the turn
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)

    descs = (q_desc, k_desc, v_desc, o_desc)
    bufs = (q_bufs, k_bufs, v_bufs, o_bufs)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns)
    sizes = (Hq, group, n_items, s_lb, s_lh, s_ln)
    bounds = (Nq, Nk, win_left, win_right, KvLen, QLen)
    mods = (cap2, Alibi, s_ab, s_ah)
    gl.warp_specialize([
        (_consumer, (0, descs, bufs, bars, Lse, sizes, bounds, qk_scale, mods, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                     HAS_LEFT, HAS_RIGHT, WRITE_LSE, PERSISTENT, PINGPONG, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT,
                     HAS_SOFTCAP, HAS_ALIBI)),
        (_consumer, (1, descs, bufs, bars, Lse, sizes, bounds, qk_scale, mods, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                     HAS_LEFT, HAS_RIGHT, WRITE_LSE, PERSISTENT, PINGPONG, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT,
                     HAS_SOFTCAP, HAS_ALIBI)),
        (_loader, (0, descs, bufs, bars, Lse, sizes, bounds, qk_scale, mods, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                   HAS_LEFT, HAS_RIGHT, WRITE_LSE, PERSISTENT, PINGPONG, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT,
                   HAS_SOFTCAP, HAS_ALIBI)),
    ], [4, 1], [CONSUMER_REGS, 24])
