"""Split-KV Triton decode path: a few query rows against a long (optionally paged) KV cache.

Why a separate path
-------------------
Decoding reads K and V once and does almost no arithmetic per byte, so its speed is the rate at which the
GPU streams the KV cache. The fused forward (:mod:`attnlab.backends.triton.forward_kernel`) runs one program per (row
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
* **Score modifiers** (:mod:`attnlab.score_mods`): the split kernel caps the scores and adds ALiBi per packed row
  (each row its head's slope); a sink is counted once per row, by the merge as one more state (m = the sink,
  l = 1, acc = 0), or by the split kernel itself when it runs alone.
* **KV append** (``HAS_APPEND``, :mod:`attnlab.kv_append`): KvLen holds the lengths before the append, and
  the sequence's keys are ``Lk = min(kv_len + n_new, Nk)``. The splits share the cached keys ``[0, kv_len)``
  as above; the last split of each row tile then reads the appended keys ``[kv_len, Lk)`` from KNew and VNew
  (always as partial tiles), and the program of row tile 0 among them also stores them to the cache (dense,
  or through the block table), positions no program reads from the cache in this launch. The call's new keys
  thus cost one extra tile of the last split and no launch of their own.
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

from attnlab.backends.triton.forward_kernel import tl, triton

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
    def _block_ids(Bt, keys, Lk, num_blocks, BLOCK_SIZE: tl.constexpr):
        """The cache block of each of ``keys`` (int64), read from the block table row ``Bt``: ids clamped to
        [0, num_blocks), and no entry at or past Lk read (0 there)."""
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
                cap2, slope2, alibi_off,
                PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
        """Base-2 scores of one tile, [BLOCK_M packed rows, BLOCK_N keys]: the soft cap and ALiBi (``slope2``:
        each packed row's head's slope, base 2), then -inf where the explicit mask, the length or (partial tiles
        only) the band forbids the key. ``rows`` are query row indices."""
        s = tiles.score_mod(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale)
        if HAS_SOFTCAP:
            s = tiles.softcap(s, cap2)
        if HAS_ALIBI:
            s = tiles.alibi(s, rows, keys, alibi_off, slope2[:, None], 1)
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
              s_kn, s_kblk, s_kd, s_vn, s_vblk, s_vd, s_ej, cap2, slope2, alibi_off,
              BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
              PAGED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
        """Key tile ``t`` of the split: load K and V (dense, or paged through the tile's blocks ``blk``),
        score, update."""
        keys = t * BLOCK_N + offs_n
        k_off, v_off = _key_offsets(blk, keys, s_kn, s_kblk, s_vn, s_vblk, BLOCK_SIZE, PAGED)
        k = tiles.load_tile(k_base + k_off[:, None] + offs_d[None, :] * s_kd, keys, offs_d, Lk, D, 0, PARTIAL, EVEN_D,
                       UPCAST)
        v = tiles.load_tile(v_base + v_off[:, None] + offs_d[None, :] * s_vd, keys, offs_d, Lk, D, 0, PARTIAL, EVEN_D,
                       UPCAST)
        s = _scores(q, k, e_rows, keys, rows, row_ok, Lk, Nk, off, win_left, win_right, qk_scale, s_ej,
                    cap2, slope2, alibi_off, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, DOT_PRECISION,
                    HAS_SOFTCAP, HAS_ALIBI)
        p, m_i, l_i, acc = tiles.softmax_update(s, m_i, l_i, acc, 1, PARTIAL or HAS_MASK or HAS_BIAS)
        return m_i, l_i, tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _new_tile(m_i, l_i, acc, q, keys, kn_base, vn_base, k_base, v_base, Bt, r0, e_rows, rows, row_ok,
                  offs_d, Lk_cache, Lk, Nk, D, off, win_left, win_right, qk_scale, num_blocks,
                  s_knt, s_knd, s_vnt, s_vnd, s_kn, s_kblk, s_kd, s_vn, s_vblk, s_vd, s_ej, cap2, slope2, alibi_off,
                  BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
        """Appended keys ``keys`` (cache positions in [Lk_cache, Lk)): read from the new K and V (row
        ``key - Lk_cache``), written to the cache by the program of row tile 0 (``r0`` its first packed row: one
        program per kv head), scored, updated."""
        ok = (keys < Lk)[:, None] & (offs_d < D)[None, :]
        j = (keys - Lk_cache).to(tl.int64)
        k = tl.load(kn_base + j[:, None] * s_knt + offs_d[None, :] * s_knd, mask=ok, other=0.0)
        v = tl.load(vn_base + j[:, None] * s_vnt + offs_d[None, :] * s_vnd, mask=ok, other=0.0)
        if PAGED:
            blk = _block_ids(Bt, keys, Lk, num_blocks, BLOCK_SIZE)
        else:
            blk = keys.to(tl.int64)  # (unused)
        k_off, v_off = _key_offsets(blk, keys, s_kn, s_kblk, s_vn, s_vblk, BLOCK_SIZE, PAGED)
        store = ok & ((keys * 0 + r0) == 0)[:, None]  # (a vector: the interpreter takes no scalar mask)
        tl.store(k_base + k_off[:, None] + offs_d[None, :] * s_kd, k, mask=store)
        tl.store(v_base + v_off[:, None] + offs_d[None, :] * s_vd, v, mask=store)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = _scores(q, k, e_rows, keys, rows, row_ok, Lk, Nk, off, win_left, win_right, qk_scale, s_ej,
                    cap2, slope2, alibi_off, True, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, DOT_PRECISION,
                    HAS_SOFTCAP, HAS_ALIBI)
        p, m_i, l_i, acc = tiles.softmax_update(s, m_i, l_i, acc, 1, True)
        return m_i, l_i, tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def decode_split_kernel(
        Q, K, V, BlockTable, KvLen, QLen, Explicit, Alibi, Sinks, KNew, VNew,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_btb, s_eb, s_eh, s_ei, s_ej, s_ab, s_ah,
        s_knb, s_knh, s_knt, s_knd, s_vnb, s_vnh, s_vnt, s_vnd,
        Hq, Nq, Nk, D, group, row_tiles, num_blocks, qk_scale, win_left, win_right, cap2, n_new,
        Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        PAGED: tl.constexpr, FINAL: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_SINKS: tl.constexpr, HAS_APPEND: tl.constexpr,
    ):
        if PDL:  # the merge may launch now: it waits for this whole kernel before it reads a state
            gdc_launch_dependents()
        # ---- which program: split, (kv head, row tile), batch entry ------------------------------------
        split = tl.program_id(0)
        S = tl.num_programs(0)
        kvh = tl.program_id(1) // row_tiles
        r0 = (tl.program_id(1) % row_tiles) * BLOCK_M
        b = tl.program_id(2)
        zero = split * 0  # an int32 scalar tensor: keeps every bound a tensor

        # ---- lengths (clamped: a device length is never trusted for addressing) and the diagonal -------
        Lk, Lq, off = tiles.lengths(KvLen, QLen, b, zero, Nq, Nk, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
        # ---- KV append: KvLen holds the lengths before it; keys [0, Lk_cache) are read from the cache, the
        # appended ones [Lk_cache, Lk) from KNew/VNew by the last split, which also writes them to the cache
        Lk_cache = Lk
        if HAS_APPEND:
            Lk = tl.minimum(Lk_cache + n_new, Nk)
            if BOTTOM_RIGHT:
                off = Lk - Lq

        # ---- packed rows: r = g * Nq + i is query head kvh * group + g, row i ---------------------------
        offs_m = r0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < group * Nq
        rows = offs_m % Nq
        heads = (kvh * group + offs_m // Nq).to(tl.int64)
        live_row = row_ok & (rows < Lq)
        i_last = tl.minimum(Lq, Nq) - 1  # the last live row of any packed head (-1: none)

        # ---- keys [lo, hi) some row may see, [full_lo, full_hi) every row sees; this split's tiles ------
        lo, hi, full_lo, full_hi = tiles.key_range(zero, zero, i_last, Lk, off, win_left, win_right, HAS_LEFT,
                                                   HAS_RIGHT)
        hi = tl.where(i_last >= 0, tl.maximum(hi, lo), lo)
        hi = tl.maximum(tl.minimum(hi, Lk_cache), lo)  # the splits share the cached keys
        full_hi = tl.minimum(full_hi, Lk_cache)
        t_lo = lo // BLOCK_N
        t_hi = tl.where(hi > lo, (hi + BLOCK_N - 1) // BLOCK_N, t_lo)
        n_tiles = t_hi - t_lo
        s_lo = t_lo + (n_tiles * split) // S  # nearly equal runs of whole tiles
        s_hi = t_lo + (n_tiles * (split + 1)) // S
        f_lo = (tl.maximum(full_lo, 0) + BLOCK_N - 1) // BLOCK_N
        f_hi = tl.maximum(full_hi, 0) // BLOCK_N
        a = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)  # [s_lo, a) partial, [a, c) full, [c, s_hi) partial
        c = tl.minimum(tl.maximum(f_hi, a), s_hi)

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
        slope2 = tl.zeros([BLOCK_M], tl.float32)
        if HAS_ALIBI:  # each packed row's head's slope, base 2
            slope2 = tl.load(Alibi + b64 * s_ab + heads * s_ah, mask=row_ok, other=0.0) * 1.4426950408889634
        alibi_off = Lk - Lq

        m_i, l_i, acc = tiles.softmax_start(BLOCK_M, BLOCK_D, 1)
        # Paged: the block ids of the next tile are read one tile ahead, so that the K and V loads of a tile
        # never wait for its block-table read. (Dense: blk is an unused placeholder.)
        if PAGED:
            blk = _block_ids(Bt, (zero + s_lo) * BLOCK_N + offs_n, Lk_cache, num_blocks, BLOCK_SIZE)
        else:
            blk = offs_n.to(tl.int64)
        for phase in tl.static_range(0 if HAS_LEFT else 1, 3):  # phase 0 needs a band's left edge: else empty
            t_begin, t_end = tiles.phase_range(phase, s_lo, a, c, s_hi)
            for t in range(t_begin, t_end):
                if PAGED:
                    blk_next = _block_ids(Bt, (zero + t + 1) * BLOCK_N + offs_n, Lk_cache, num_blocks,
                                          BLOCK_SIZE)
                m_i, l_i, acc = _tile(
                    m_i, l_i, acc, q, zero + t, blk, k_base, v_base, e_rows, rows, row_ok, offs_n, offs_d,
                    Lk_cache, Nk, D, off, win_left, win_right, qk_scale,
                    s_kn, s_kb, s_kd, s_vn, s_vb, s_vd, s_ej, cap2, slope2, alibi_off,
                    BLOCK_N, BLOCK_SIZE, phase != 1, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                    UPCAST, DOT_PRECISION, HAS_SOFTCAP, HAS_ALIBI,
                )
                if PAGED:
                    blk = blk_next
        if HAS_APPEND:  # the appended keys: the last split only (the others' range is empty)
            kn_base = KNew + b64 * s_knb + kvh.to(tl.int64) * s_knh
            vn_base = VNew + b64 * s_vnb + kvh.to(tl.int64) * s_vnh
            for j0 in range(tl.where(split == S - 1, Lk_cache, Lk), Lk, BLOCK_N):
                m_i, l_i, acc = _new_tile(
                    m_i, l_i, acc, q, j0 + offs_n, kn_base, vn_base, k_base, v_base, Bt, r0, e_rows, rows,
                    row_ok, offs_d, Lk_cache, Lk, Nk, D, off, win_left, win_right, qk_scale, num_blocks,
                    s_knt, s_knd, s_vnt, s_vnd, s_kn, s_kb, s_kd, s_vn, s_vb, s_vd, s_ej, cap2, slope2, alibi_off,
                    BLOCK_SIZE, PAGED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, DOT_PRECISION,
                    HAS_SOFTCAP, HAS_ALIBI,
                )

        # ---- epilogue: padding rows hold the empty state; one split normalizes, several store states ---
        ws_row = (b64 * Hq + heads) * Nq + rows  # (b, h, i) of each packed row
        d_ok = row_ok[:, None] & (offs_d < D)[None, :]
        if FINAL:
            sink2 = tl.zeros([BLOCK_M], tl.float32)
            if HAS_SINKS:  # each packed row's head's sink, base 2 (with several splits the merge adds it, once)
                sink2 = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                         s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, sink2, WRITE_LSE, HAS_SINKS)
        else:
            idx = ws_row * S + split
            tl.store(WsM + idx, tl.where(live_row, m_i, float("-inf")), mask=row_ok)
            tl.store(WsL + idx, tl.where(live_row, l_i, 0.0), mask=row_ok)
            tl.store(WsAcc + idx[:, None] * D + offs_d[None, :], tl.where(live_row[:, None], acc, 0.0), mask=d_ok)

    @triton.jit
    def _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                     s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, sink2, WRITE_LSE: tl.constexpr,
                     HAS_SINKS: tl.constexpr):
        """out = acc / l and lse = (m + log2 l) * ln 2 of each packed row, a sink merged first; rows with l = 0
        (no allowed key) and padding rows write 0 and -inf (with a sink: the sink)."""
        if HAS_SINKS:
            m_i = tl.where(live_row, m_i, float("-inf"))  # a padding row: the sink alone
            l_i = tl.where(live_row, l_i, 0.0)
            acc = tl.where(live_row[:, None], acc, 0.0)
            m_i, l_i, acc = tiles.with_sink(m_i, l_i, acc, sink2, 1)
            live_row = row_ok
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
    def decode_merge_kernel(
        WsM, WsL, WsAcc, Out, Lse, Sinks, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, Hq, Nq, D, S,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        """One program per (b, h, i) row and BLOCK_D columns of it: combine the row's S split states with the
        lse rule (module docstring), BLOCK_S splits at a time with a running max, and write those columns of
        out (0 when no split saw an allowed key) and, from the first column block, lse (-inf then). Every
        column block of a row computes the same m and l (S floats each: cheap), so a few rows with many
        splits still spread over many programs. With PDL it is launched before the split kernel ends, and
        waits for that kernel first."""
        if PDL:
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * Nq + i
        col = tl.program_id(1)
        i = row % Nq
        h = (row // Nq) % Hq
        b = row // (Nq * Hq)
        base = row * S
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = col * BLOCK_D + tl.arange(0, BLOCK_D)
        m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            ok = s0 + offs_s < S
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
        if HAS_SINKS:  # the row's head's sink, once: one more state of m = sink, l = 1, acc = 0
            sink2 = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m, sink2)
            gone = m_new == float("-inf")
            alpha = tl.where(gone, 0.0, tl.math.exp2(m - m_new))
            l = l * alpha + tl.where(gone, 0.0, tl.math.exp2(sink2 - m_new))
            acc = acc * alpha
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
