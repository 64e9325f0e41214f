"""Split-KV Triton decode path: a few query rows against a long (optionally paged) KV cache.

Why a separate path
-------------------
Decoding reads K and V once and does almost no arithmetic per byte, so its speed is the rate at which the
GPU streams the KV cache. The fused forward (:mod:`attnlab.backends.triton.kernel`) runs one program per (row
tile, query head, batch entry): with Nq = 1, B * Hq programs each read their kv head's whole cache, so a GQA
group reads the same K/V ``group`` times and a small batch leaves most SMs idle.

Packing, splitting and the program mapping
------------------------------------------
* **GQA packing.** The ``group = Hq // Hkv`` query heads of one kv head and the Nq query rows are packed
  into the M dimension of one tile: packed row ``r = g * Nq + i`` is query head ``kvh * group + g``, row
  ``i``. One program therefore multiplies a [BLOCK_M, D] Q tile by each K tile it loads, and K/V bytes are
  read once per kv head. BLOCK_M is a power of two >= 16 (tl.dot's minimum; rows past ``group * Nq`` are
  masked); more packed rows than BLOCK_M are cut into row tiles (``row_tiles``), each its own program.
* **Split-KV.** The keys a kv head's rows may see (``[lo, hi)`` from kv_len, q_len and the causal/window
  band, the same bounds as :meth:`attnlab.masks.MaskSpec.key_range`) are cut into ``S`` nearly equal runs
  of whole key tiles, one per program; a split whose run is empty (a short ragged sequence) writes the
  empty state m = -inf, l = 0, acc = 0. The grid is ``(S, Hkv * row_tiles, B)``: the splits of one head
  are neighbours in launch order. ``S`` follows from B, Hkv, Nk, the SM count and how many programs of
  the compiled kernel fit on an SM (one wave: :func:`num_splits`).
* **Flat splits** (no kv_len or q_len: every unit, a (batch entry, kv head, row tile), has the same T key
  tiles). The grid is 1-D, P programs, and the ``units * T`` tiles laid end to end are cut into P nearly
  equal runs, so that every SM gets the same work when B * Hkv does not divide by the SM count (the (split,
  unit) grid's B * Hkv * S programs use 128 of an H200's 132 SMs at the decode suite's shapes). A run may
  end one unit and start the next; each unit's runs store their states in slots 0, 1, ... of its rows, a
  unit inside one run is written out whole, and the program of slot 0 records the unit's run count for
  the merge.
* **Online softmax** per packed row, in base 2 as in the fused forward: ``m_i`` (running max of
  ``s = scale * log2(e) * q.k (+ log2(e) * bias)``), ``l_i`` (sum of ``exp2(s - m_i)``) and ``acc`` (sum of
  ``exp2(s - m_i) * v``), float32. Within a split, key tiles that every row sees in full run without any
  predicate; the partial tiles at the ends of the band and the length pay for the masks.
* **Merge.** Each split stores its unnormalized state (m, l, acc) in a float32 workspace, and a second
  kernel combines the S states of each (batch, query head, row) with the lse rule: ``m = max_s m_s``,
  ``l = sum_s l_s * exp2(m_s - m)``, ``out = sum_s acc_s * exp2(m_s - m) / l``, ``lse = (m + log2 l) * ln 2``;
  l = 0 (no allowed key anywhere) gives out = 0 and lse = -inf. The merge's programs are (row, block of
  MERGE_BLOCK_D columns): B1 Hq32 has 32 rows, too few programs to read 1 MiB of states quickly. With
  S = 1 the split kernel normalizes and writes out and lse itself, and no merge runs.
* **Programmatic dependent launch** (``PDL``, Hopper and newer): each split program tells the GPU at its start
  that the merge may launch, and the merge, launched with ``launch_pdl``, waits (``gdc_wait``) until the split
  kernel has finished and its stores are visible. The merge is then launched while the split kernel's last
  programs still run (its programs wait in the slots they leave idle) instead of after a launch gap. Only the
  merge is a dependent launch: the next call's split kernel still starts after this merge has finished, so
  the split states a stream reuses are never overwritten while read.
* **Paged KV cache** (FlashAttention's ``flash_attn_with_kvcache`` convention): caches
  ``[num_blocks, block_size, Hkv, D]`` and an int32 ``block_table [B, max_blocks]``; logical key j of batch
  b is read at ``cache[block_table[b, j // block_size], j % block_size]``. The block size is a compile-time
  constant (``BLOCK_SIZE``; 1 for a dense cache): the key-to-block arithmetic is then shifts and masks, not
  integer divisions. Block ids are clamped to
  ``[0, num_blocks)`` and no block-table entry at or past kv_len is read, so a bad table never reads out of
  bounds.

Plain pointer arithmetic with masks only (never ``tl.make_block_ptr``): the same functions compile with
triton 3.4 to 3.9 and run through Triton's interpreter on CPU tensors (``attnlab.backends.triton.interpreter``'s
``interpreter``), where BLOCK_M = BLOCK_N = 16 so small tests span several tiles, row tiles and splits.
"""

from __future__ import annotations

from attnlab.backends.triton.kernel import tl, triton

try:  # grid dependency control (programmatic dependent launch): triton 3.4 and newer, NVIDIA GPUs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton, or one without it: PDL_AVAILABLE is False and the PDL branches never compile
    gdc_launch_dependents = gdc_wait = None
PDL_AVAILABLE = gdc_wait is not None

# ---------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------
if triton is not None:
    from attnlab.backends.triton import tiles

    @triton.jit
    def _block_ids(Bt, t, offs_n, Lk, num_blocks, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The cache block of each key of key tile ``t`` (int64, [BLOCK_N]), read from the block table row
        ``Bt``: ids clamped to [0, num_blocks), and no entry at or past Lk read (0 there)."""
        keys = t * BLOCK_N + offs_n
        blk = tl.load(Bt + keys // BLOCK_SIZE, mask=keys < Lk, other=0)
        return tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)

    @triton.jit
    def _key_offsets(blk, keys, s_kn, s_kblk, s_vn, s_vblk, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
        """int64 offsets of ``keys``' rows in K and V: dense, key * key stride (the batch is in the base
        pointer); paged, through their blocks ``blk`` (:func:`_block_ids`)."""
        if PAGED:
            slot = (keys % BLOCK_SIZE).to(tl.int64)
            return blk * s_kblk + slot * s_kn, blk * s_vblk + slot * s_vn
        else:
            kk = keys.to(tl.int64)
            return kk * s_kn, kk * s_vn

    @triton.jit
    def _scores(q, k, e_rows, keys, rows, row_ok, Lk, Nk, off, win_left, win_right, qk_scale, s_ej,
                PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Base-2 scores of one tile, [BLOCK_M packed rows, BLOCK_N keys]: -inf where the explicit mask,
        the length or (partial tiles only) the band forbids the key. ``rows`` are query row indices."""
        s = tiles.score_mod(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale)
        if HAS_MASK or HAS_BIAS:
            e_ptrs = e_rows[:, None] + keys[None, :].to(tl.int64) * s_ej
            e_ok = row_ok[:, None] & (keys < Nk)[None, :]
            if HAS_MASK:
                allowed = tl.load(e_ptrs, mask=e_ok, other=0)
                s = tl.where(allowed != 0, s, float("-inf"))
            else:
                s = s + tl.load(e_ptrs, mask=e_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # float32 first
        if PARTIAL:
            ok = (keys < Lk)[None, :] & row_ok[:, None]
            if HAS_LEFT:  # j >= diag_i - left
                ok = ok & (keys[None, :] >= (rows + off - win_left)[:, None])
            if HAS_RIGHT:  # j <= diag_i + right
                ok = ok & (keys[None, :] <= (rows + off + win_right)[:, None])
            s = tl.where(ok, s, float("-inf"))
        return s

    @triton.jit
    def _tile(m_i, l_i, acc, q, t, blk, k_base, v_base, e_rows, rows, row_ok, offs_n, offs_d,
              Lk, Nk, D, off, win_left, win_right, qk_scale,
              s_kn, s_kblk, s_kd, s_vn, s_vblk, s_vd, s_ej,
              BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
              PAGED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Key tile ``t`` of the split: load K and V (dense, or paged through the tile's blocks ``blk``),
        score, update."""
        keys = t * BLOCK_N + offs_n
        k_off, v_off = _key_offsets(blk, keys, s_kn, s_kblk, s_vn, s_vblk, BLOCK_SIZE, PAGED)
        k = tiles.load_tile(k_base + k_off[:, None] + offs_d[None, :] * s_kd, keys, offs_d, Lk, D, 0, PARTIAL, EVEN_D,
                       UPCAST)
        v = tiles.load_tile(v_base + v_off[:, None] + offs_d[None, :] * s_vd, keys, offs_d, Lk, D, 0, PARTIAL, EVEN_D,
                       UPCAST)
        s = _scores(q, k, e_rows, keys, rows, row_ok, Lk, Nk, off, win_left, win_right, qk_scale, s_ej,
                    PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, DOT_PRECISION)
        p, m_i, l_i, acc = tiles.softmax_update(s, m_i, l_i, acc, 1, PARTIAL or HAS_MASK or HAS_BIAS)
        return m_i, l_i, tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, BlockTable, KvLen, QLen, Explicit,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_btb, s_eb, s_eh, s_ei, s_ej,
        Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right, units, slots,
        Out, Lse, WsM, WsL, WsAcc, WsCount, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        PAGED: tl.constexpr, FINAL: tl.constexpr, FLAT: tl.constexpr, WRITE_LSE: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # the merge may launch now: it waits for this whole kernel before it reads a state
            gdc_launch_dependents()
        zero = tl.program_id(0) * 0  # an int32 scalar tensor: keeps every bound a tensor
        if FLAT:
            tl.static_assert(not (HAS_KV_LEN or HAS_Q_LEN), "flat splits need the same keys for every unit")
            _flat_runs(Q, K, V, BlockTable, KvLen, QLen, Explicit, zero,
                       s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                       s_btb, s_eb, s_eh, s_ei, s_ej,
                       Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right, units, slots,
                       Out, Lse, WsM, WsL, WsAcc, WsCount, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
                       BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_SIZE, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                       HAS_MASK, HAS_BIAS, PAGED, WRITE_LSE, UPCAST, DOT_PRECISION)
        else:
            # ---- which program: split, (kv head, row tile), batch entry; this split's run of key tiles --
            split = tl.program_id(0)
            S = tl.num_programs(0)
            b = tl.program_id(2)
            Lk, Lq, off = tiles.lengths(KvLen, QLen, b, zero, Nq, Nk, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
            t_lo, f_lo, f_hi, t_hi = tiles.key_tiles(zero, Lk, Lq, off, win_left, win_right, BLOCK_M, BLOCK_N,
                                                     HAS_LEFT, HAS_RIGHT)
            n_tiles = t_hi - t_lo
            s_lo = t_lo + (n_tiles * split) // S  # nearly equal runs of whole tiles
            s_hi = t_lo + (n_tiles * (split + 1)) // S
            _run(Q, K, V, BlockTable, Explicit, b, tl.program_id(1), s_lo, s_hi, f_lo, f_hi, Lk, Lq, off,
                 split, S, FINAL,
                 s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                 s_btb, s_eb, s_eh, s_ei, s_ej,
                 Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right,
                 Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
                 BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_SIZE, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                 PAGED, FINAL, WRITE_LSE, UPCAST, DOT_PRECISION)

    @triton.jit
    def _flat_runs(Q, K, V, BlockTable, KvLen, QLen, Explicit, zero,
                   s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                   s_btb, s_eb, s_eh, s_ei, s_ej,
                   Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right, units, slots,
                   Out, Lse, WsM, WsL, WsAcc, WsCount, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   BOTTOM_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PAGED: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Flat splits: the ``units`` (batch entry, kv head, row tile) of T key tiles each, laid end to end,
        are ``units * T`` tiles, cut into nearly equal runs, one per program (the P of a 1-D grid), so that
        every SM gets the same work whatever B and Hkv are. A run may end one unit and start the next: it
        stores one state per unit it touches, in slot ``p - first`` of that unit, ``first`` being the program
        whose run starts the unit; a unit inside one run is written whole (out and lse). The program of slot
        0 records the unit's run count in WsCount for the merge. Every unit sees the same keys (no lengths),
        so T is one number."""
        p = tl.program_id(0).to(tl.int64)
        P = tl.num_programs(0)
        Lk, Lq, off = tiles.lengths(KvLen, QLen, 0, zero, Nq, Nk, False, False, BOTTOM_RIGHT)
        t_lo, f_lo, f_hi, t_hi = tiles.key_tiles(zero, Lk, Lq, off, win_left, win_right, BLOCK_M, BLOCK_N,
                                                 HAS_LEFT, HAS_RIGHT)
        T = (t_hi - t_lo).to(tl.int64)
        W = T * units  # tiles in all
        Pe = tl.minimum(W, P)  # programs with work: each run at least one tile
        cols = (Hq // group) * row_tiles  # units per batch entry
        if T == 0:  # no unit sees a key: each writes its empty output
            for u in range(p, units, P):
                _run(Q, K, V, BlockTable, Explicit, (u // cols).to(tl.int32), (u % cols).to(tl.int32),
                     t_lo, t_lo, f_lo, f_hi, Lk, Lq, off, zero, slots, True,
                     s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                     s_btb, s_eb, s_eh, s_ei, s_ej,
                     Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right,
                     Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
                     BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_SIZE, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                     PAGED, False, WRITE_LSE, UPCAST, DOT_PRECISION)
                tl.store(WsCount + u, 1.0)
        elif p < Pe:
            g_lo = (p * W) // Pe  # this program's tiles [g_lo, g_hi) of all
            g_hi = ((p + 1) * W) // Pe
            for u in range(g_lo // T, (g_hi - 1) // T + 1):
                base = u * T
                first = ((base + 1) * Pe - 1) // W  # the programs whose runs hold the unit's first and last tile
                last = ((base + T) * Pe - 1) // W
                s_lo = (tl.maximum(g_lo, base) - base).to(tl.int32) + t_lo
                s_hi = (tl.minimum(g_hi, base + T) - base).to(tl.int32) + t_lo
                _run(Q, K, V, BlockTable, Explicit, (u // cols).to(tl.int32), (u % cols).to(tl.int32),
                     s_lo, s_hi, f_lo, f_hi, Lk, Lq, off, (p - first).to(tl.int32), slots, first == last,
                     s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                     s_btb, s_eb, s_eh, s_ei, s_ej,
                     Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right,
                     Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
                     BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_SIZE, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                     PAGED, False, WRITE_LSE, UPCAST, DOT_PRECISION)
                if p == first:
                    tl.store(WsCount + u, (last - first + 1).to(tl.float32))

    @triton.jit
    def _run(Q, K, V, BlockTable, Explicit, b, col, s_lo, s_hi, f_lo, f_hi, Lk, Lq, off, slot, S, final_now,
             s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
             s_btb, s_eb, s_eh, s_ei, s_ej,
             Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right,
             Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
             HAS_BIAS: tl.constexpr, PAGED: tl.constexpr, FINAL: tl.constexpr, WRITE_LSE: tl.constexpr,
             UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Key tiles [s_lo, s_hi) of unit (batch entry ``b``, column ``col`` = kv head * row_tiles + row tile):
        the packed Q tile, the three-phase loop ([f_lo, f_hi): the tiles every row sees whole), and the
        epilogue: out and lse when ``FINAL`` (or, without it, ``final_now``), else the state in ``slot`` of
        ``S`` per row."""
        zero = s_lo * 0
        kvh = col // row_tiles
        r0 = (col % row_tiles) * BLOCK_M
        a = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)  # [s_lo, a) partial, [a, c) full, [c, s_hi) partial
        c = tl.minimum(tl.maximum(f_hi, a), s_hi)

        # ---- packed rows: r = g * Nq + i is query head kvh * group + g, row i ---------------------------
        offs_m = r0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < group * Nq
        rows = offs_m % Nq
        heads = (kvh * group + offs_m // Nq).to(tl.int64)
        live_row = row_ok & (rows < Lq)

        # ---- the packed Q tile, loaded once -------------------------------------------------------------
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        b64 = b.to(tl.int64)
        q_ptrs = (Q + b64 * s_qb + heads[:, None] * s_qh + rows[:, None].to(tl.int64) * s_qn
                  + offs_d[None, :] * s_qd)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if PAGED:
            k_base = K + kvh.to(tl.int64) * s_kh
            v_base = V + kvh.to(tl.int64) * s_vh
        else:
            k_base = K + b64 * s_kb + kvh.to(tl.int64) * s_kh
            v_base = V + b64 * s_vb + kvh.to(tl.int64) * s_vh
        Bt = BlockTable + b64 * s_btb
        e_rows = Explicit + b64 * s_eb + heads * s_eh + rows.to(tl.int64) * s_ei

        m_i, l_i, acc = tiles.softmax_start(BLOCK_M, BLOCK_D, 1)
        # Paged: the block ids of the next tile are read one tile ahead, so that the K and V loads of a tile
        # never wait for its block-table read. (Dense: blk is an unused placeholder.)
        if PAGED:
            blk = _block_ids(Bt, s_lo, offs_n, Lk, num_blocks, BLOCK_SIZE, BLOCK_N)
        else:
            blk = offs_n.to(tl.int64)
        for phase in tl.static_range(3):
            t_begin, t_end = tiles.phase_range(phase, s_lo, a, c, s_hi)
            for t in range(t_begin, t_end):
                if PAGED:
                    blk_next = _block_ids(Bt, zero + t + 1, offs_n, Lk, num_blocks, BLOCK_SIZE, BLOCK_N)
                m_i, l_i, acc = _tile(
                    m_i, l_i, acc, q, zero + t, blk, k_base, v_base, e_rows, rows, row_ok, offs_n, offs_d,
                    Lk, Nk, D, off, win_left, win_right, qk_scale,
                    s_kn, s_kb, s_kd, s_vn, s_vb, s_vd, s_ej,
                    BLOCK_N, BLOCK_SIZE, phase != 1, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                    UPCAST, DOT_PRECISION,
                )
                if PAGED:
                    blk = blk_next

        # ---- epilogue: padding rows hold the empty state; a whole run normalizes, a part stores its state --
        if FINAL:
            _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                         s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, WRITE_LSE)
        elif final_now:
            _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                         s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, WRITE_LSE)
        else:
            idx = ((b64 * Hq + heads) * Nq + rows) * S + slot  # (b, h, i) of each packed row, then the slot
            tl.store(WsM + idx, tl.where(live_row, m_i, float("-inf")), mask=row_ok)
            tl.store(WsL + idx, tl.where(live_row, l_i, 0.0), mask=row_ok)
            tl.store(WsAcc + idx[:, None] * D + offs_d[None, :], tl.where(live_row[:, None], acc, 0.0),
                     mask=row_ok[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                     s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, WRITE_LSE: tl.constexpr):
        """out = acc / l and lse = (m + log2 l) * ln 2 of each packed row; rows with l = 0 (no allowed key)
        and padding rows write 0 and -inf."""
        live = live_row & (l_i != 0.0)
        l_div = tl.where(live, l_i, 1.0)
        out = tl.where(live[:, None], acc / l_div[:, None], 0.0)
        o_ptrs = (Out + b64 * s_ob + heads[:, None] * s_oh + rows[:, None].to(tl.int64) * s_on
                  + offs_d[None, :] * s_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < D)[None, :])
        if WRITE_LSE:
            lse = tl.where(live, (m_i + tl.math.log2(l_div)) * 0.6931471805599453, float("-inf"))
            tl.store(Lse + b64 * s_lb + heads * s_lh + rows.to(tl.int64) * s_ln, lse, mask=row_ok)

    @triton.jit
    def _decode_merge_kernel(
        WsM, WsL, WsAcc, WsCount, Out, Lse, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, Hq, Nq, D, S,
        group, row_tiles, rows_per_tile,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, FLAT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (b, h, i) row and BLOCK_D columns of it: combine the row's split states (S slots a
        row; flat splits: as many as WsCount says its unit has, and none when the split kernel wrote the row
        whole) with the lse rule (module docstring), BLOCK_S at a time with a running max, and write those
        columns of out (0 when no split saw an allowed key) and, from the first column block, lse (-inf
        then). Every column block of a row computes the same m and l (a few floats each: cheap), so a few rows
        with many splits still spread over many programs. With PDL it is launched before the split kernel
        ends, and waits for that kernel first."""
        if PDL:
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * Nq + i
        col = tl.program_id(1)
        i = row % Nq
        h = (row // Nq) % Hq
        b = row // (Nq * Hq)
        if FLAT:  # the row's unit: (batch entry, kv head, row tile of its packed row (h % group) * Nq + i)
            unit = (b * (Hq // group) + h // group) * row_tiles + ((h % group) * Nq + i) // rows_per_tile
            n = tl.load(WsCount + unit).to(tl.int32)
        else:
            n = S + 0 * col
        if n > 1:
            base = row * S
            offs_s = tl.arange(0, BLOCK_S)
            offs_d = col * BLOCK_D + tl.arange(0, BLOCK_D)
            m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
            l = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
            acc = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, n, BLOCK_S):
                ok = s0 + offs_s < n
                m_s = tl.load(WsM + base + s0 + offs_s, mask=ok, other=float("-inf"))
                m_new = tl.maximum(m, tl.max(m_s, 0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty: weights 0
                w = tl.math.exp2(m_s - m_safe)  # w_s = exp2(m_s - m)
                alpha = tl.math.exp2(m - m_safe)
                l_s = tl.load(WsL + base + s0 + offs_s, mask=ok, other=0.0)
                a_s = tl.load(WsAcc + (base + s0 + offs_s)[:, None] * D + offs_d[None, :],
                              mask=ok[:, None] & (offs_d < D)[None, :], other=0.0)
                l = l * alpha + tl.sum(l_s * w, 0)
                acc = acc * alpha + tl.sum(a_s * w[:, None], 0)
                m = m_new
            live = l != 0.0
            l_div = tl.where(live, l, 1.0)
            out = tl.where(live, acc / l_div, 0.0)
            tl.store(Out + b * s_ob + h * s_oh + i * s_on + offs_d * s_od, out.to(Out.dtype.element_ty),
                     mask=offs_d < D)
            if WRITE_LSE:
                if col == 0:
                    tl.store(Lse + b * s_lb + h * s_lh + i * s_ln,
                             tl.where(live, (m + tl.math.log2(l_div)) * 0.6931471805599453, float("-inf")))
