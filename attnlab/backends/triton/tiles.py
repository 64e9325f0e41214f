"""The @triton.jit pieces that the fused forward (:mod:`~.forward_kernel`), the backward (:mod:`~.backward_kernels`)
and the split-KV decode (:mod:`~.decode_kernels`) share, each written once: a tile load, the effective lengths, the
band's key range and its key tiles, the three-phase loop's bounds, the scores' transform, the explicit mask
or bias, the band predicate, and the online-softmax update. Triton inlines every one into its caller, so a
kernel compiles exactly as if the helper's body were written in place.

Plain pointer arithmetic with masks only (no ``tl.make_block_ptr``), for triton 3.4 to 3.9 and the
interpreter.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels' modules report the backend unavailable
    triton, tl = None, None

if triton is not None:

    # ---- loads --------------------------------------------------------------------------------------

    @triton.jit
    def load_tile(ptrs, idx, cols, n, D, IDX_AXIS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
                   UPCAST: tl.constexpr):
        """A tile of rows or keys ``idx`` along axis ``IDX_AXIS`` and D columns ``cols`` along the other: a
        partial tile reads nothing at or past ``n`` (nor columns past D), a full one no predicate unless D
        is padded; ``UPCAST``: made float32 (the interpreter's half-type products)."""
        if PARTIAL:
            ok = tl.expand_dims(idx < n, 1 - IDX_AXIS) & tl.expand_dims(cols < D, IDX_AXIS)
            x = tl.load(ptrs, mask=ok, other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=tl.expand_dims(cols < D, IDX_AXIS), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    # ---- lengths, the band's key range, key tiles -----------------------------------------------------

    @triton.jit
    def lengths(KvLen, QLen, b, zero, Nq, Nk, HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr,
                 BOTTOM_RIGHT: tl.constexpr):
        """(Lk, Lq, off) of batch entry b: the effective lengths, clamped to [0, Nk] and [0, Nq] whatever the
        caller passed (no load leaves the tensors), and the diagonal offset (row i's diagonal is key i + off)."""
        if HAS_KV_LEN:
            Lk = tl.minimum(tl.maximum(tl.load(KvLen + b), 0), Nk)
        else:
            Lk = zero + Nk
        if HAS_Q_LEN:
            Lq = tl.minimum(tl.maximum(tl.load(QLen + b), 0), Nq)
        else:
            Lq = zero + Nq
        if BOTTOM_RIGHT:
            off = Lk - Lq
        else:
            off = zero
        return Lk, Lq, off

    @triton.jit
    def sequence(KvLen, QLen, b, zero, Nq, Nk, Tq, Tk, VARLEN: tl.constexpr, HAS_KV_LEN: tl.constexpr,
                 HAS_Q_LEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
        """(q0, k0, Lq, Lk, off, n_rows, n_keys) of batch entry b: its first row and first key in the tensors,
        its effective lengths, its diagonal offset, and the bounds every load and store of its rows and keys
        keeps to. Unpacked, q0 = k0 = 0, the lengths are :func:`lengths`' and the bounds Nq and Nk. Packed
        (``VARLEN``), QLen and KvLen are the prefix sums cu_seqlens_q and cu_seqlens_k: sequence b's rows
        are ``[cu_q[b], cu_q[b+1])`` clamped into the Tq rows of the tensor and cut to at most Nq
        (max_seqlen_q), its keys likewise, and the bounds are its own lengths (the next sequence follows), so
        that no prefix sum makes an access leave the tensors or cross into another sequence."""
        if VARLEN:
            q0 = tl.minimum(tl.maximum(tl.load(QLen + b), 0), Tq)
            q1 = tl.minimum(tl.maximum(tl.load(QLen + b + 1), q0), Tq)
            k0 = tl.minimum(tl.maximum(tl.load(KvLen + b), 0), Tk)
            k1 = tl.minimum(tl.maximum(tl.load(KvLen + b + 1), k0), Tk)
            Lq = tl.minimum(q1 - q0, Nq)
            Lk = tl.minimum(k1 - k0, Nk)
            if BOTTOM_RIGHT:
                off = Lk - Lq
            else:
                off = zero
            n_rows = Lq
            n_keys = Lk
        else:
            q0 = zero
            k0 = zero
            Lk, Lq, off = lengths(KvLen, QLen, b, zero, Nq, Nk, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)
            n_rows = Nq
            n_keys = Nk
        return q0, k0, Lq, Lk, off, n_rows, n_keys

    @triton.jit
    def packed_tile(Cu, slot, T, BLOCK: tl.constexpr):
        """(b, t) of program ``slot`` of a packed grid over ``T`` rows (or keys) cut into tiles of ``BLOCK``:
        sequence b and its tile t, from the prefix sums ``Cu`` (cu_seqlens, read on the GPU).

        Sequence b owns the slots from ``start(b) = cu[b] // BLOCK + b`` on (cu clamped into [0, T]). Two
        neighbouring starts are at least as many slots apart as the first sequence has tiles, so ``T // BLOCK + B``
        slots (the grid the host launches, whence ``B = num_programs - T // BLOCK``) hold every tile and at most
        one idle slot per sequence, rather than ``B * ceil(max_seqlen / BLOCK)`` programs that mostly exit. b is
        the number of starts after the first that are at most ``slot``, counted 256 prefix sums at a time. A
        slot that holds no tile (past its sequence's end, or prefix sums out of order) gets a t whose rows all
        lie past T: the caller's bounds leave it idle."""
        n_seq = tl.num_programs(0) - T // BLOCK
        b = slot * 0
        for c0 in range(1, n_seq, 256):
            idx = c0 + tl.arange(0, 256)
            start = tl.minimum(tl.maximum(tl.load(Cu + idx, mask=idx < n_seq, other=0), 0), T) // BLOCK + idx
            b += tl.sum(((start <= slot) & (idx < n_seq)).to(tl.int32), 0)
        t = slot - (tl.minimum(tl.maximum(tl.load(Cu + b), 0), T) // BLOCK + b)
        return b, tl.where(t < 0, T // BLOCK + 1, t)

    @triton.jit
    def key_range(lo, i0, i_last, Lk, off, win_left, win_right, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr):
        """Keys ``[lo, hi)`` that some row of ``[i0, i_last]`` may see and ``[full_lo, full_hi)`` that every
        one of them may see (``lo``: a zero of the caller's)."""
        hi = Lk
        full_lo = lo
        full_hi = hi
        if HAS_LEFT:  # j >= i + off - left
            lo = tl.maximum(lo, i0 + off - win_left)
            full_lo = tl.maximum(lo, i_last + off - win_left)
        if HAS_RIGHT:  # j <= i + off + right
            hi = tl.minimum(hi, i_last + off + win_right + 1)
            full_hi = tl.minimum(hi, i0 + off + win_right + 1)
        return lo, hi, full_lo, full_hi

    @triton.jit
    def tile_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
        """Index ranges ``[lo, hi)`` and ``[full_lo, full_hi)`` (lo >= 0) in tiles of BLOCK:
        (t_lo, f_lo, f_hi, t_hi), with partial tiles [t_lo, f_lo) and [f_hi, t_hi), full ones [f_lo, f_hi).
        Every operand of // is non-negative, so it floors the same compiled and interpreted."""
        t_lo = lo // BLOCK
        t_hi = tl.where(hi > lo, (hi + BLOCK - 1) // BLOCK, t_lo)
        f_lo = (tl.maximum(full_lo, 0) + BLOCK - 1) // BLOCK
        f_hi = tl.maximum(full_hi, 0) // BLOCK
        f_lo = tl.minimum(tl.maximum(f_lo, t_lo), t_hi)
        f_hi = tl.maximum(tl.minimum(f_hi, t_hi), f_lo)
        return t_lo, f_lo, f_hi, t_hi

    @triton.jit
    def key_tiles(i0, Lk, Lq, off, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Key tiles of rows ``[i0, i0 + BLOCK_M)``: (t_lo, f_lo, f_hi, t_hi), [t_lo, t_hi) those some row may
        see, [f_lo, f_hi) inside them those every row sees whole."""
        i_last = tl.minimum(i0 + BLOCK_M, Lq) - 1  # the last row that is not padding
        lo, hi, full_lo, full_hi = key_range(off * 0, i0, i_last, Lk, off, win_left, win_right, HAS_LEFT,
                                              HAS_RIGHT)
        hi = tl.where(i0 < Lq, tl.maximum(hi, lo), lo)  # a tile of padding rows sees nothing
        return tile_ranges(lo, hi, full_lo, full_hi, BLOCK_N)

    @triton.jit
    def phase_range(PHASE: tl.constexpr, t_lo, f_lo, f_hi, t_hi):
        """The tiles ``[begin, end)`` of loop phase ``PHASE`` (a ``tl.static_range(3)`` index): partial
        [t_lo, f_lo), full [f_lo, f_hi), partial [f_hi, t_hi)."""
        if PHASE == 0:
            begin = t_lo
            end = f_lo
        elif PHASE == 1:
            begin = f_lo
            end = f_hi
        else:
            begin = f_hi
            end = t_hi
        return begin, end

    # ---- scores ---------------------------------------------------------------------------------------

    @triton.jit
    def score_mod(qk, qk_scale):
        """Base-2 scores of a tile of products q.k: ``qk * scale * log2(e)`` (``qk_scale``). The score modifiers
        (:func:`softcap`, then :func:`alibi`) follow, then the bias and the masks."""
        return qk * qk_scale

    @triton.jit
    def softcap(s, cap2):
        """The soft cap on base-2 scores: ``cap2 * tanh(s / cap2)`` with ``cap2 = c * log2(e)`` (the same as
        ``c * tanh(s_e / c)`` in natural units), tanh written with exp2 (saturating to +-1, never NaN for finite s)."""
        return cap2 * (1.0 - 2.0 / (1.0 + tl.math.exp2(s * (2.0 * 1.4426950408889634 / cap2))))

    @triton.jit
    def alibi(s, rows, keys, alibi_off, slope2, KEY_AXIS: tl.constexpr):
        """ALiBi on base-2 scores whose keys run along ``KEY_AXIS``: ``- slope2 * |i + Lk - Lq - j|`` (``slope2`` the
        head's slope times log2(e), ``alibi_off`` = Lk - Lq of the row's sequence, whatever the alignment).

        The positions become float32 per row and per key, before the broadcast: an int-to-float conversion per
        score would run on a slow pipe, while a float difference and its absolute value (an operand modifier) cost
        one add (docs/decisions.md, "ALiBi's distance in the kernels"). Positions below 2**24 are exact."""
        row_pos = (rows + alibi_off).to(tl.float32)
        key_pos = keys.to(tl.float32)
        dist = tl.expand_dims(row_pos, KEY_AXIS) - tl.expand_dims(key_pos, 1 - KEY_AXIS)
        return s - slope2 * tl.abs(dist)

    @triton.jit
    def with_sink(m_i, l_i, acc, sink2, KEY_AXIS: tl.constexpr):
        """The online-softmax state of a row tile merged with a sink: one more key of base-2 logit ``sink2`` and
        value 0 (the denominator grows, acc is only rescaled). A row with no key gets m = sink2, l = 1."""
        m_new = tl.maximum(m_i, sink2)
        gone = m_new == float("-inf")  # no key and a sink of -inf: the row stays empty
        alpha = tl.where(gone, 0.0, tl.math.exp2(m_i - m_new))
        l_i = l_i * alpha + tl.where(gone, 0.0, tl.math.exp2(sink2 - m_new))
        return m_new, l_i, acc * tl.expand_dims(alpha, KEY_AXIS)

    @triton.jit
    def apply_explicit(s, e_ptrs, e_ok, HAS_MASK: tl.constexpr):
        """The explicit bool mask (-inf where False) or, without one, the additive bias (read in the caller's
        dtype, made float32, times log2(e)) at ``e_ptrs`` (``e_ok``: in bounds) on base-2 scores ``s``."""
        if HAS_MASK:
            allowed = tl.load(e_ptrs, mask=e_ok, other=0)
            s = tl.where(allowed != 0, s, float("-inf"))
        else:
            bias = tl.load(e_ptrs, mask=e_ok, other=0.0).to(tl.float32)
            s = s + bias * 1.4426950408889634
        return s

    @triton.jit
    def band(s, keys, rows, Lk, off, win_left, win_right, KEY_AXIS: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr):
        """Scores -inf where a key is past Lk or outside its row's band (diagonal i + off, left/right
        widths); the score tile's keys run along ``KEY_AXIS``."""
        key_j = tl.expand_dims(keys, 1 - KEY_AXIS)
        row_i = tl.expand_dims(rows, KEY_AXIS)
        ok = tl.expand_dims(keys < Lk, 1 - KEY_AXIS) & tl.expand_dims(rows >= 0, KEY_AXIS)
        if HAS_LEFT:
            ok = ok & (key_j >= row_i + off - win_left)
        if HAS_RIGHT:
            ok = ok & (key_j <= row_i + off + win_right)
        return tl.where(ok, s, float("-inf"))

    # ---- the online softmax ---------------------------------------------------------------------------

    @triton.jit
    def softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KEY_AXIS: tl.constexpr):
        """The empty state of BLOCK_M rows: m = -inf, l = 0, acc = 0 ([BLOCK_M, BLOCK_D]; transposed when the
        keys run along axis 0)."""
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if KEY_AXIS == 0:
            acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        return m_i, l_i, acc

    @triton.jit
    def softmax_update(s, m_i, l_i, acc, KEY_AXIS: tl.constexpr, GUARD: tl.constexpr):
        """One tile of online softmax in base 2 (a row's keys run along ``KEY_AXIS``): returns (p, m_new, l_i,
        acc rescaled by alpha); the caller adds P V. ``GUARD``: the tile may hold rows with no allowed key
        so far (m_new = -inf), which subtract 0 instead (alpha = p = 0); a full tile without explicit mask
        gives every row a finite score."""
        m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
        if GUARD:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - tl.expand_dims(m_safe, KEY_AXIS))
        l_i = l_i * alpha + tl.sum(p, KEY_AXIS)
        acc = acc * tl.expand_dims(alpha, KEY_AXIS)
        return p, m_new, l_i, acc
