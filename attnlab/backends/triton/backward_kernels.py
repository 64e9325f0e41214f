"""The Triton backward kernels of attention (FlashAttention-2 style), launched by :mod:`~.backward`.

The math
--------
The forward saved ``lse_i = log sum_j exp(s_ij)`` (natural log) for every query row. With it, the softmax
is recomputed tile by tile without a second reduction: ``p_ij = exp(s_ij - lse_i)``, here in base 2 like
the forward, ``p = exp2(s * log2(e) - lse * log2(e))``. For an upstream gradient dO:

    dV = P^T dO                       dP = dO V^T
    Delta_i = sum_d dO_id O_id        (= sum_j p_ij dP_ij, the softmax's Jacobian in one number per row)
    dS = P * (dP - Delta)             (the gradient of the scores s = scale * q.k + bias)
    dQ = scale * dS K                 dK = scale * dS^T Q

A row with no allowed key (lse = -inf) and a padding row (i >= Lq) must give zero gradients. The
preprocess stores such rows' base-2 lse as **+inf**, so that every ``p = exp2(s - (+inf))`` is exactly 0
(also where s is -inf): no guard is needed anywhere in the loops, and dS = 0 * (dP - Delta) = 0.

Tiling and program mapping
--------------------------
Three launches, each a grid of programs over tiles of the [Nq, Nk] score matrix of one (batch, head):

1. ``bwd_preprocess``: grid ``(ceil(Nq / BLOCK_M), Hq, B)``. One program reads a [BLOCK_M, D] tile of O
   and dO and writes Delta and the base-2 lse (``Lse2``, +inf for empty and padding rows) of its rows:
   float32 [B, Hq, Nq], contiguous. With sinks (``HAS_SINKS``) it also stores its rows' share of the sink's
   gradient, ``-sum p_sink * Delta`` with ``p_sink = exp(sink - lse)``, one float per program; the host sums the
   shares of each head (no atomics: deterministic).
2. ``bwd_dkdv_kernel``: grid ``(ceil(Nk / BLOCK_N), Hkv, B)``. One program owns one key tile of one kv
   head: it loads K and V ([BLOCK_N, D]) once and keeps dK and dV accumulators (float32) for them while
   query tiles of ``BLOCK_M`` rows stream past. The score tile is held transposed, ``S^T = K Q^T``
   ([BLOCK_N keys, BLOCK_M queries]), so that dV += P^T dO and dK += dS^T Q are plain products. For
   GQA/MQA the program loops over the ``group`` query heads of its kv head (h = kvh * group + g): the
   group's sum is accumulated in registers, so K/V are never repeated and no atomics are needed.
3. ``bwd_dq_kernel``: grid ``(ceil(Nq / BLOCK_M), Hq, B)``, row tiles last first (a causal row's work
   grows with its index). One program owns one row tile of one query head: Q, dO, Lse2 and Delta are
   loaded once; key tiles of kv head ``h // group`` stream past and dQ += dS K accumulates in float32.
   Each dQ element is written by one program: deterministic, no atomics.

With ``TILES_OUTER`` (not packed) launches 2 and 3 take the grid ``(heads, B, tiles)`` instead: the GPU starts
programs in the grid's order, so one tile of every head starts before the next tile of any, the heaviest
first under a causal mask (the first key tile, the last row tile), and no long program is left to the last wave.

One pass (``DQ_ATOMIC``): the dK/dV kernel also multiplies the dS tile it already holds by its K tile and adds
``scale * dS K`` into a float32 dQ (zeroed first) with relaxed atomic adds, and launch 3 is skipped: five
products per tile pair instead of seven, for one float32 add per dQ element and key tile, in no fixed order (dQ
is not bitwise reproducible; the host keeps two passes when torch asks for deterministic algorithms).

With a value head dim of its own, V, dO, dV and the preprocess run over Dv (``BLOCK_DV``), Q, K, dQ, dK over
D. Packed sequences (``VARLEN``) map programs as the forward does (:mod:`~.forward_kernel`): the grids' first
axis holds packed slots (``total // BLOCK + B``, :func:`tiles.packed_tile`) in place of the tile index, the batch
axis is 1, and each program finds its sequence's first row and key from the prefix sums and bounds every load
and store by the sequence's own lengths; Delta and Lse2 are then [Hq, total_q].

Both loops recompute S (and dP) from Q, K, V, dO: dQ's pass costs two extra products, the price of writing
every gradient once.

Block skipping
--------------
As in the forward, the loops visit only tiles that the lengths and the band allow, and split them into
partial tiles (bounds and band predicate applied) and full ones (no predicate): the dQ pass uses the
forward's key range per row tile, ``[lo, hi)`` and ``[full_lo, full_hi)`` (:func:`tiles.key_tiles`); the dK/dV
pass uses the band solved for rows, the rows ``[lo, hi)`` that may see some key of the tile and
``[full_lo, full_hi)`` that see all of them (:func:`_query_tiles`): key j is seen by row i iff
``j - off - right <= i <= j - off + left`` (off the diagonal offset of the alignment). A key tile that
holds keys past Lk is partial for every row tile. Keys no row may see keep dK = dV = 0. A bool mask or a
bias is data, read through its broadcast strides in every visited tile (the bias is a constant: it gets no
gradient).

Precision
---------
Every product accumulates in float32. For float16/bfloat16, P and dS are rounded to the input dtype before
they enter a product (as FlashAttention does); for float32 every product is exact IEEE
(``input_precision="ieee"``). In the interpreter, half-type operands are upcast to float32 (exactly) before
``tl.dot``, whose interpreted version multiplies bfloat16 bit patterns as integers otherwise. Addresses
come from the caller's strides (any layout, views, a non-unit D stride); batch, head and tile offsets are
64-bit. Plain pointer arithmetic with masks only (no ``tl.make_block_ptr``), for triton 3.4 to 3.9 and the
interpreter.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # attnlab.backends.triton.backward reports the backward unavailable
    triton, tl = None, None

if triton is not None:
    from attnlab.backends.triton import tiles

    # -----------------------------------------------------------------------------------------------
    # Helpers: loads, operand rounding, the query tiles of a key tile, the explicit mask
    # -----------------------------------------------------------------------------------------------
    @triton.jit
    def _load_rows(base, offs, n_valid, offs_d, D, s_n, s_d, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
                   UPCAST: tl.constexpr):
        """A [len(offs), BLOCK_D] tile starting at ``base``: rows ``offs >= n_valid`` and columns past D read 0
        (no predicate at all for a tile known to be in bounds with an unpadded D)."""
        return tiles.load_tile(base + offs[:, None] * s_n + offs_d[None, :] * s_d, offs, offs_d, n_valid, D, 0,
                          CHECK_ROWS, EVEN_D, UPCAST)

    @triton.jit
    def _operand(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
        """``x`` (float32) rounded to the input dtype for a product; in the interpreter back to float32."""
        x = x.to(DTYPE)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _query_tiles(n0, Lk, Lq, off, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Row tiles of keys ``[n0, n0 + BLOCK_N)``: those with a row that may see some key of the tile, and
        inside them those whose every row sees every key (the band solved for i:
        ``j - off - right <= i <= j - off + left``)."""
        n_last = tl.minimum(n0 + BLOCK_N, Lk) - 1  # the last key that is not past Lk
        lo = off * 0
        hi = Lq
        full_lo = lo
        full_hi = hi
        if HAS_RIGHT:  # i >= j - off - right
            lo = tl.maximum(lo, n0 - off - win_right)
            full_lo = tl.maximum(lo, n0 + BLOCK_N - 1 - off - win_right)
        if HAS_LEFT:  # i <= j - off + left
            hi = tl.minimum(hi, n_last - off + win_left + 1)
            full_hi = tl.minimum(hi, n0 - off + win_left + 1)
        hi = tl.where(n0 < Lk, tl.maximum(hi, lo), lo)  # a tile of keys past Lk is seen by no row
        full_hi = tl.where(n0 + BLOCK_N <= Lk, full_hi, full_lo)  # keys past Lk: every row tile is partial
        return tiles.tile_ranges(lo, hi, full_lo, full_hi, BLOCK_M)

    @triton.jit
    def _modified(s, rows, keys, cap2, slope2, alibi_off, KEY_AXIS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr):
        """The score modifiers on base-2 scores (soft cap, then ALiBi) and the cap's derivative ``1 - tanh^2``
        (1.0 without a cap), by which the gradient of a capped score reaches q and k."""
        dcap = 1.0
        if HAS_SOFTCAP:
            s = tiles.softcap(s, cap2)
            t = s / cap2
            dcap = 1.0 - t * t
        if HAS_ALIBI:
            s = tiles.alibi(s, rows, keys, alibi_off, slope2, KEY_AXIS)
        return s, dcap

    @triton.jit
    def _explicit(s, e_base, rows, keys, Nq, Nk, s_ei, s_ej, KEY_AXIS: tl.constexpr, HAS_MASK: tl.constexpr):
        """The explicit mask (-inf where False) or the bias (times log2(e)) applied to base-2 scores ``s``,
        whose keys run along KEY_AXIS; ``e_base`` points at the (batch, head) of the mask. The bias is read in
        the caller's dtype and made float32 here."""
        row_i = tl.expand_dims(rows, KEY_AXIS)
        key_j = tl.expand_dims(keys, 1 - KEY_AXIS)
        ok = (row_i < Nq) & (key_j < Nk)
        return tiles.apply_explicit(s, e_base + row_i.to(tl.int64) * s_ei + key_j.to(tl.int64) * s_ej, ok, HAS_MASK)

    @triton.jit
    def _row_base(b64, h64, q0, Hq, Nq, Tq, VARLEN: tl.constexpr):
        """Where row 0 of (batch b, head h) is in Delta and Lse2: contiguous [B, Hq, Nq], or for a packed call
        [Hq, Tq] with the sequence's first row at q0."""
        if VARLEN:
            base = h64 * Tq + q0.to(tl.int64)
        else:
            base = (b64 * Hq + h64) * Nq
        return base

    # -----------------------------------------------------------------------------------------------
    # 1. Preprocess: Delta = rowsum(dO * O), and the base-2 lse
    # -----------------------------------------------------------------------------------------------
    @triton.jit
    def bwd_preprocess(
        O, DO, Lse, Delta, Lse2, QLen, Sinks, SinkPart,
        s_ob, s_oh, s_on, s_od,
        s_gb, s_gh, s_gn, s_gd,
        s_lb, s_lh, s_ln,
        Hq, Nq, Dv, Tq,
        BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_Q_LEN: tl.constexpr, VARLEN: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        h = tl.program_id(1)
        if VARLEN:  # grid (packed slots, Hq, 1)
            b, pid_m = tiles.packed_tile(QLen, tl.program_id(0), Tq, BLOCK_M)
        else:
            pid_m = tl.program_id(0)
            b = tl.program_id(2)
        i0 = pid_m * BLOCK_M
        zero = i0 * 0
        # (QLen stands in for the keys' prefix sums too: only the rows are used here)
        q0, _, Lq, _, _, n_rows, _ = tiles.sequence(QLen, QLen, b, zero, Nq, Nq, Tq, Tq, VARLEN, False, HAS_Q_LEN,
                                                    False)
        offs_m = tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = i0 + offs_m
        b64, h64, i64 = b.to(tl.int64), h.to(tl.int64), (q0 + i0).to(tl.int64)
        o = _load_rows(O + b64 * s_ob + h64 * s_oh + i64 * s_on, offs_m, n_rows - i0, offs_dv, Dv, s_on, s_od,
                       True, False, True)
        do = _load_rows(DO + b64 * s_gb + h64 * s_gh + i64 * s_gn, offs_m, n_rows - i0, offs_dv, Dv, s_gn, s_gd,
                        True, False, True)
        delta = tl.sum(o * do, 1)
        lse = tl.load(Lse + b64 * s_lb + h64 * s_lh + (q0.to(tl.int64) + rows) * s_ln, mask=rows < n_rows,
                      other=float("-inf"))
        live = (lse != float("-inf")) & (rows < Lq)  # Lq: the row's length, clamped to [0, Nq]
        # +inf for a row with no allowed key or a padding row: then every p = exp2(s - lse2) is 0
        lse2 = tl.where(live, lse * 1.4426950408889634, float("inf"))
        delta = tl.where(live, delta, 0.0)
        out_ptrs = _row_base(b64, h64, q0, Hq, Nq, Tq, VARLEN) + rows
        tl.store(Delta + out_ptrs, delta, mask=rows < n_rows)
        tl.store(Lse2 + out_ptrs, lse2, mask=rows < n_rows)
        if HAS_SINKS:  # this tile's share of the sink's gradient: -sum of p_sink * Delta, p_sink = exp(sink - lse)
            p_sink = tl.where(live, tl.math.exp2((tl.load(Sinks + h).to(tl.float32) - lse) * 1.4426950408889634), 0.0)
            # stored head-major, one float per program: the host sums each head's row of shares
            share = (h64 * tl.num_programs(2) + tl.program_id(2)) * tl.num_programs(0) + tl.program_id(0)
            tl.store(SinkPart + share, -tl.sum(p_sink * delta, 0))

    # -----------------------------------------------------------------------------------------------
    # 2. dK and dV: a key tile stationary, query tiles streaming
    # -----------------------------------------------------------------------------------------------
    @triton.jit
    def _dkdv_row_tile(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, e_base, dq_base, m0, keys, Lq, Lk, off, win_left,
        win_right, Nq, Nk, D, Dv, s_qn, s_qd, s_gn, s_gd, s_ei, s_ej, s_dqn, s_dqd, qk_scale, scale, cap2, slope2,
        alibi_off,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
        EVEN_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PARTIAL: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    ):
        """dK and dV updated with the query rows ``[m0, m0 + BLOCK_M)`` of one head (scores held as S^T); with
        ``DQ_ATOMIC`` also these keys' share of the rows' dQ, ``scale * dS K``, added into the float32 ``dq_base``."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = m0 + offs_m
        m64 = m0.to(tl.int64)
        # padding rows (past Lq) read as 0: their p is 0 by their +inf lse2, and so must their q and dO be
        q = _load_rows(q_base + m64 * s_qn, offs_m, Lq - m0, offs_d, D, s_qn, s_qd, PARTIAL, EVEN_D, UPCAST)
        do = _load_rows(do_base + m64 * s_gn, offs_m, Lq - m0, offs_dv, Dv, s_gn, s_gd, PARTIAL, EVEN_DV, UPCAST)
        if PARTIAL:
            lse2 = tl.load(lse2_base + rows, mask=rows < Nq, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < Nq, other=0.0)
        else:
            lse2 = tl.load(lse2_base + rows)
            delta = tl.load(delta_base + rows)

        # S^T = K Q^T in base 2, masked; P^T = exp2(S^T - lse2) (0 for rows with lse2 = +inf)
        s_t = tiles.score_mod(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), qk_scale)
        s_t, dcap = _modified(s_t, rows, keys, cap2, slope2, alibi_off, 0, HAS_SOFTCAP, HAS_ALIBI)
        if HAS_MASK or HAS_BIAS:
            s_t = _explicit(s_t, e_base, rows, keys, Nq, Nk, s_ei, s_ej, 0, HAS_MASK)
        if PARTIAL:
            s_t = tiles.band(s_t, keys, rows, Lk, off, win_left, win_right, 0, HAS_LEFT, HAS_RIGHT)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        dv = tl.dot(_operand(p_t, DTYPE, UPCAST), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T = P^T * (dP^T - Delta)
        if HAS_SOFTCAP:  # through the cap: times 1 - tanh^2
            ds_t = ds_t * dcap
        ds_op = _operand(ds_t, DTYPE, UPCAST)
        dk = tl.dot(ds_op, q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q
        if DQ_ATOMIC:  # dQ[rows] += scale * dS K: one add per element and key tile, in no fixed order
            dq = tl.dot(tl.trans(ds_op), k, input_precision=DOT_PRECISION) * scale
            dq_ptrs = dq_base + rows.to(tl.int64)[:, None] * s_dqn + offs_d[None, :] * s_dqd
            tl.atomic_add(dq_ptrs, dq, mask=(rows < Nq)[:, None] & (offs_d < D)[None, :], sem="relaxed")
        return dk, dv

    @triton.jit
    def bwd_dkdv_kernel(
        Q, K, V, DO, Lse2, Delta, DK, DV, DQ, KvLen, QLen, Explicit, Alibi,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_gb, s_gh, s_gn, s_gd,
        s_dkb, s_dkh, s_dkn, s_dkd,
        s_dvb, s_dvh, s_dvn, s_dvd,
        s_dqb, s_dqh, s_dqn, s_dqd,
        s_eb, s_eh, s_ei, s_ej, s_ab, s_ah,
        Hq, Nq, Nk, D, Dv, Tq, Tk, group, qk_scale, scale, win_left, win_right, cap2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr,
        TILES_OUTER: tl.constexpr,
    ):
        # ---- which tile: key tile pid_n of kv head kvh, batch b -----------------------------------------
        if VARLEN:  # grid (packed slots, Hkv, 1): a sequence's first key tile (the most rows) first
            kvh = tl.program_id(1)
            b, pid_n = tiles.packed_tile(KvLen, tl.program_id(0), Tk, BLOCK_N)
        elif TILES_OUTER:  # grid (Hkv, B, key tiles): the first key tile (the most rows) of every head first
            kvh = tl.program_id(0)
            b = tl.program_id(1)
            pid_n = tl.program_id(2)
        else:  # grid (key tiles, Hkv, B): a head's key tiles side by side
            kvh = tl.program_id(1)
            pid_n = tl.program_id(0)
            b = tl.program_id(2)
        n0 = pid_n * BLOCK_N
        zero = n0 * 0
        row_base_nq = Nq  # Delta and Lse2 are laid out by the bound, not by a packed sequence's length
        # (Nq, Nk become the bounds of this program's rows and keys: a packed sequence's own lengths)
        q0, k0, Lq, Lk, off, Nq, Nk = tiles.sequence(KvLen, QLen, b, zero, Nq, Nk, Tq, Tk, VARLEN, HAS_KV_LEN,
                                                     HAS_Q_LEN, BOTTOM_RIGHT)
        t_lo, f_lo, f_hi, t_hi = _query_tiles(n0, Lk, Lq, off, win_left, win_right, BLOCK_M, BLOCK_N,
                                              HAS_LEFT, HAS_RIGHT)

        # ---- the stationary K and V tiles; dK and dV accumulators --------------------------------------
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        keys = n0 + offs_n
        b64, kvh64, n64 = b.to(tl.int64), kvh.to(tl.int64), (k0 + n0).to(tl.int64)
        # keys past the length read as 0 (their scores are masked; the one-pass dQ multiplies by K and V too, so
        # whatever lies past the length, NaN in a cache included, must not enter)
        k = _load_rows(K + b64 * s_kb + kvh64 * s_kh + n64 * s_kn, offs_n, Lk - n0, offs_d, D, s_kn, s_kd,
                       True, EVEN_D, UPCAST)
        v = _load_rows(V + b64 * s_vb + kvh64 * s_vh + n64 * s_vn, offs_n, Lk - n0, offs_dv, Dv, s_vn, s_vd,
                       True, EVEN_DV, UPCAST)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

        # ---- every query head of the group, each in three phases of row tiles ---------------------------
        for g in range(0, group):
            h64 = (kvh * group + g).to(tl.int64)
            q_base = Q + b64 * s_qb + h64 * s_qh + q0.to(tl.int64) * s_qn
            do_base = DO + b64 * s_gb + h64 * s_gh + q0.to(tl.int64) * s_gn
            row0 = _row_base(b64, h64, q0, Hq, row_base_nq, Tq, VARLEN)
            e_base = Explicit + b64 * s_eb + h64 * s_eh
            dq_base = DQ + b64 * s_dqb + h64 * s_dqh + q0.to(tl.int64) * s_dqn
            slope2 = 0.0
            if HAS_ALIBI:  # this query head's slope, in base 2
                slope2 = tl.load(Alibi + b64 * s_ab + h64 * s_ah) * 1.4426950408889634
            # partial [t_lo, f_lo) (rows above a band's right edge: none without one), full, partial [f_hi, t_hi)
            for phase in tl.static_range(0 if HAS_RIGHT else 1, 3):
                t_begin, t_end = tiles.phase_range(phase, t_lo, f_lo, f_hi, t_hi)
                for t in range(t_begin, t_end):
                    dk, dv = _dkdv_row_tile(
                        dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, e_base, dq_base,
                        zero + t * BLOCK_M, keys, Lq, Lk, off, win_left, win_right, Nq, Nk, D, Dv, s_qn, s_qd, s_gn,
                        s_gd,
                        s_ei, s_ej, s_dqn, s_dqd, qk_scale, scale, cap2, slope2, Lk - Lq, BLOCK_M, BLOCK_D, BLOCK_DV,
                        EVEN_D, EVEN_DV, HAS_SOFTCAP, HAS_ALIBI, phase != 1, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                        Q.dtype.element_ty, DOT_PRECISION, UPCAST, DQ_ATOMIC,
                    )

        # ---- epilogue: dK = scale * sum dS^T Q; keys no row sees keep 0 --------------------------------
        dk = dk * scale
        in_keys = (keys < Nk)[:, None]
        dk_ptrs = (DK + b64 * s_dkb + kvh64 * s_dkh + (k0.to(tl.int64) + keys)[:, None] * s_dkn
                   + offs_d[None, :] * s_dkd)
        dv_ptrs = (DV + b64 * s_dvb + kvh64 * s_dvh + (k0.to(tl.int64) + keys)[:, None] * s_dvn
                   + offs_dv[None, :] * s_dvd)
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=in_keys & (offs_d < D)[None, :])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=in_keys & (offs_dv < Dv)[None, :])

    # -----------------------------------------------------------------------------------------------
    # 3. dQ: a row tile stationary, key tiles streaming
    # -----------------------------------------------------------------------------------------------
    @triton.jit
    def _dq_key_tile(
        dq, q, do, lse2, delta, k_base, v_base, e_base, n0, rows, Lk, off, win_left, win_right,
        Nq, Nk, D, Dv, s_kn, s_kd, s_vn, s_vd, s_ei, s_ej, qk_scale, cap2, slope2, alibi_off,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
        EVEN_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PARTIAL: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """dQ updated with the keys ``[n0, n0 + BLOCK_N)``."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        keys = n0 + offs_n
        n64 = n0.to(tl.int64)
        k = _load_rows(k_base + n64 * s_kn, offs_n, Lk - n0, offs_d, D, s_kn, s_kd, PARTIAL, EVEN_D, UPCAST)
        v = _load_rows(v_base + n64 * s_vn, offs_n, Lk - n0, offs_dv, Dv, s_vn, s_vd, PARTIAL, EVEN_DV, UPCAST)
        s = tiles.score_mod(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale)  # base 2
        s, dcap = _modified(s, rows, keys, cap2, slope2, alibi_off, 1, HAS_SOFTCAP, HAS_ALIBI)
        if HAS_MASK or HAS_BIAS:
            s = _explicit(s, e_base, rows, keys, Nq, Nk, s_ei, s_ej, 1, HAS_MASK)
        if PARTIAL:
            s = tiles.band(s, keys, rows, Lk, off, win_left, win_right, 1, HAS_LEFT, HAS_RIGHT)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
        ds = p * (dp - delta[:, None])  # dS = P * (dP - Delta)
        if HAS_SOFTCAP:  # through the cap: times 1 - tanh^2
            ds = ds * dcap
        return tl.dot(_operand(ds, DTYPE, UPCAST), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K

    @triton.jit
    def bwd_dq_kernel(
        Q, K, V, DO, Lse2, Delta, DQ, KvLen, QLen, Explicit, Alibi,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_gb, s_gh, s_gn, s_gd,
        s_dqb, s_dqh, s_dqn, s_dqd,
        s_eb, s_eh, s_ei, s_ej, s_ab, s_ah,
        Hq, Nq, Nk, D, Dv, Tq, Tk, group, qk_scale, scale, win_left, win_right, cap2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, VARLEN: tl.constexpr, TILES_OUTER: tl.constexpr,
    ):
        # ---- which tile: row tile pid_m (last first) of query head h, batch b; kv head h // group --------
        if VARLEN:  # grid (packed slots, Hq, 1), the last slot first
            h = tl.program_id(1)
            b, pid_m = tiles.packed_tile(QLen, tl.num_programs(0) - 1 - tl.program_id(0), Tq, BLOCK_M)
        elif TILES_OUTER:  # grid (Hq, B, row tiles): the last row tile (the most keys) of every head first
            h = tl.program_id(0)
            b = tl.program_id(1)
            pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
        else:  # grid (row tiles, Hq, B): a head's row tiles side by side
            h = tl.program_id(1)
            pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
            b = tl.program_id(2)
        i0 = pid_m * BLOCK_M
        zero = i0 * 0
        row_base_nq = Nq  # Delta and Lse2 are laid out by the bound, not by a packed sequence's length
        # (Nq, Nk become the bounds of this program's rows and keys: a packed sequence's own lengths)
        q0, k0, Lq, Lk, off, Nq, Nk = tiles.sequence(KvLen, QLen, b, zero, Nq, Nk, Tq, Tk, VARLEN, HAS_KV_LEN,
                                                     HAS_Q_LEN, BOTTOM_RIGHT)
        t_lo, f_lo, f_hi, t_hi = tiles.key_tiles(i0, Lk, Lq, off, win_left, win_right, BLOCK_M, BLOCK_N,
                                            HAS_LEFT, HAS_RIGHT)

        # ---- the stationary row tile: Q, dO, Lse2, Delta -----------------------------------------------
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = i0 + offs_m
        b64, h64, i64 = b.to(tl.int64), h.to(tl.int64), (q0 + i0).to(tl.int64)
        kvh64 = (h // group).to(tl.int64)
        # padding rows (past Lq) read as 0, so that their dQ is exactly 0 whatever lies there
        q = _load_rows(Q + b64 * s_qb + h64 * s_qh + i64 * s_qn, offs_m, Lq - i0, offs_d, D, s_qn, s_qd,
                       True, EVEN_D, UPCAST)
        do = _load_rows(DO + b64 * s_gb + h64 * s_gh + i64 * s_gn, offs_m, Lq - i0, offs_dv, Dv, s_gn, s_gd,
                        True, EVEN_DV, UPCAST)
        row0 = _row_base(b64, h64, q0, Hq, row_base_nq, Tq, VARLEN)
        lse2 = tl.load(Lse2 + row0 + rows, mask=rows < Nq, other=float("inf"))
        delta = tl.load(Delta + row0 + rows, mask=rows < Nq, other=0.0)
        k_base = K + b64 * s_kb + kvh64 * s_kh + k0.to(tl.int64) * s_kn
        v_base = V + b64 * s_vb + kvh64 * s_vh + k0.to(tl.int64) * s_vn
        e_base = Explicit + b64 * s_eb + h64 * s_eh
        slope2 = 0.0
        if HAS_ALIBI:  # the head's slope, in base 2
            slope2 = tl.load(Alibi + b64 * s_ab + h64 * s_ah) * 1.4426950408889634
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # partial [t_lo, f_lo) (keys left of a band's left edge: none without one), full, partial [f_hi, t_hi)
        for phase in tl.static_range(0 if HAS_LEFT else 1, 3):
            t_begin, t_end = tiles.phase_range(phase, t_lo, f_lo, f_hi, t_hi)
            for t in range(t_begin, t_end):
                dq = _dq_key_tile(
                    dq, q, do, lse2, delta, k_base, v_base, e_base, zero + t * BLOCK_N, rows, Lk, off,
                    win_left, win_right, Nq, Nk, D, Dv, s_kn, s_kd, s_vn, s_vd, s_ei, s_ej, qk_scale, cap2, slope2,
                    Lk - Lq, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, HAS_SOFTCAP, HAS_ALIBI, phase != 1,
                    HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                    Q.dtype.element_ty, DOT_PRECISION, UPCAST,
                )

        # ---- epilogue: dQ = scale * sum dS K; empty and padding rows give 0 ----------------------------
        dq = dq * scale
        dq_ptrs = (DQ + b64 * s_dqb + h64 * s_dqh + (q0.to(tl.int64) + rows)[:, None] * s_dqn
                   + offs_d[None, :] * s_dqd)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(rows < Nq)[:, None] & (offs_d < D)[None, :])
