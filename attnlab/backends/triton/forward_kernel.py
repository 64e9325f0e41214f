"""The fused Triton forward kernel: one kernel for the whole attention contract (backend ``triton``).

Tiling and program mapping
--------------------------
The score matrix of one (batch b, query head h) is cut into tiles of ``BLOCK_M`` query rows by
``BLOCK_N`` keys. One program owns one row tile: the grid is ``(ceil(Nq / BLOCK_M), Hq, B)``, the row
tiles of one head are neighbours in launch order (so they share that head's K/V in L2), and the row
tiles are handed out last-first so that under a causal mask the longest rows start first. A config
with ``rows_outer`` launches ``(Hq, B, ceil(Nq / BLOCK_M))`` instead: the longest row tiles of every
head first, so that a causal launch does not end on one long tile (:mod:`~attnlab.backends.triton.forward`).
Query head h reads kv head ``h // group`` (GQA/MQA, grouped). The program loads its Q tile once ([BLOCK_M, BLOCK_D],
D padded to a power of two ``BLOCK_D`` >= 16 with zeros), then streams K/V tiles of ``BLOCK_N`` keys
through the online softmax and writes its [BLOCK_M, D] slice of the output and its lse once at the end.
v may have its own head dim ``Dv`` (padded to ``BLOCK_DV``): Q K^T runs over D, P V and the output over Dv.

Packed sequences (``VARLEN``, :func:`attnlab.attention_varlen`): the grid is ``(Tq // BLOCK_M + B, Hq, 1)``,
packed slots rather than ``B * ceil(max_seqlen_q / BLOCK_M)`` programs that mostly exit: :func:`tiles.packed_tile`
finds a slot's sequence and row tile (the last slot first). ``Nq``/``Nk`` are the bounds
``max_seqlen_q``/``max_seqlen_k``, and the kernel reads the prefix sums where it reads the lengths otherwise. A
program finds its sequence's first row and key and its lengths (:func:`tiles.sequence`, clamped into the
tensors), adds the first row and key to its bases (batch strides are 0), and from then on treats the sequence's
lengths as the row and key bounds, so no load or store crosses into the next sequence. A slot past its
sequence's end exits at once.
Every address is computed from the caller's strides (any layout, transposed views, a non-unit D
stride); the large parts of an offset (batch, head, the tile's first row or key) are 64-bit scalars, the
in-tile parts 32-bit vectors.

Online softmax in base 2
------------------------
Scores are kept in the log2 domain: ``s = (q . k) * scale * log2(e) (+ bias * log2(e))``, so every
exponential is one ``exp2``. Per row the program carries ``m_i`` (running max of s), ``l_i`` (running sum
of ``exp2(s - m_i)``) and ``acc`` (running sum of ``exp2(s - m_i) * v``, float32). A new tile with
row max ``m_new = max(m_i, max_j s_ij)`` rescales the old state by ``alpha = exp2(m_i - m_new)``. A row
that has seen no allowed key yet has ``m_new = -inf``; ``exp2(-inf - (-inf))`` would be NaN, so the
subtraction uses ``m_safe = 0`` there, which makes both ``alpha`` and every ``p`` exactly 0. At the end
``out = acc / l_i`` and ``lse = (m_i + log2 l_i) * ln 2``; rows with ``l_i = 0`` (no allowed key) and
padding rows (``i >= Lq_b``) write out = 0 and lse = -inf. For float16/bfloat16 inputs P is rounded to
the input dtype before ``P @ V`` (as FlashAttention does), for float8_e4m3fn (``FP8``) to e4m3, with the
head's descales of q and k folded into the score scale and v's applied to ``acc`` at the end; for float32 both
products are exact IEEE
(``input_precision="ieee"``: no TF32 rounding of the inputs) unless the caller opts into TF32 with
:func:`~attnlab.backends.triton.configs.allow_tf32`.

Keys-major float32
------------------
float32 products are exact IEEE ones, which Triton runs on the FMA units with both operands read from
shared memory that it does not swizzle. With K as the second operand of Q K^T, a warp's threads read K
rows D floats apart, all in one bank. A ``keys_major`` config (float32 only) holds the score tile
transposed: ``S^T = K Q^T`` ([BLOCK_N, BLOCK_M]), ``O^T += V^T P^T``, the running max and sum reduced
over axis 0 (the kernel's ``KEY_AXIS``). K is then read by two threads per warp, and Q^T, built once per
program as an exact product with the identity (a dot's result is query-contiguous), by all of them
without conflict (docs/decisions.md, "float32 tiles"). Keys-major runs one loop over its key tiles and finds
the partial ones at run time.

Block skipping
--------------
From the effective lengths and the band (causal/window, either alignment) the program computes, on the
device, the keys ``[lo, hi)`` that any of its rows may see (the same bounds as
:meth:`attnlab.masks.MaskSpec.key_range`) and, inside that, the keys ``[full_lo, full_hi)`` that *all*
its rows may see. Key tiles outside ``[lo, hi)`` are never loaded. Tiles wholly inside the full range run
a loop body without any predicate arithmetic (no bounds masks on the K/V loads, no band compares, no
-inf guard); only the partial tiles at either end pay for masking. A row tile of padding rows only
(``i0 >= Lq_b``) writes its zeros and lse = -inf and returns before it reads anything of Q, K or V. The
lengths are clamped to ``[0, N]`` as they are loaded, so no length makes an access leave the tensors. An
explicit bool mask or bias is data, not structure: where one is given, every visited tile reads it through
its broadcast strides (stride 0, never materialized), a bias in the caller's dtype (converted in
registers). The three phases (partial, full, partial) are one loop body specialized at compile time by
``tl.static_range``; the first is compiled only for a band with a left edge (without one it is empty).

Where it runs
-------------
On CUDA tensors the kernel is compiled by Triton with one config, from a small space (block sizes, warps,
stages, and for float32 the D chunk of Q K^T: :func:`~attnlab.backends.triton.configs.candidates`) keyed on
dtype, head dim, mask kind and the sizes' powers of two (:func:`~attnlab.backends.triton.configs.tune_key`): a
config tuned on this machine, else the shipped table's (:mod:`~attnlab.backends.triton.tuned_table`), else the
first candidate. Tuning happens on request (:func:`attnlab.tune`, or ``ATTNLAB_AUTOTUNE=1``); tuned configs
persist on disk per GPU model, Triton version and kernel source (:mod:`~attnlab.backends.triton.tune_cache`,
``$ATTNLAB_CACHE_DIR`` or ``~/.cache/attnlab``). Launches of one call signature (shapes, strides, dtypes, mask
kind, alignment: :func:`~attnlab.backends.triton.runtime.call_signature`) share a plan
(:mod:`~attnlab.backends.triton.forward`): its arguments and compiled kernel, with Triton's launcher called
directly rather than through the JIT's per-call binding. :func:`attnlab.attention` goes further for a
signature it has seen (:mod:`attnlab.fast_calls`): the plan's fast call allocates the output and launches,
with nothing validated or looked up again (docs/decisions.md, "Host time of small calls").
``FAST_LAUNCH = False`` (or ATTNLAB_TRITON_FAST_LAUNCH=0) sends every launch through the JIT.

On CPU tensors the very same Python function runs through Triton's interpreter
(``triton.runtime.interpreter.InterpretedFunction``) with one small config, so the user sets no
``TRITON_INTERPRET``. The interpreter swaps ``triton.language``'s functions for its own while it runs;
:func:`~attnlab.backends.triton.interpreter.interpreter` routes the library's @triton.jit helpers
(``tl.max``, ``tl.sum``) to interpreted twins and restores ``triton.language`` afterwards, so interpreted
and compiled launches mix in one process. The code uses plain pointer arithmetic only (no
``tl.make_block_ptr``); its CPU tests pass with triton 3.4, 3.6 and 3.9.

The kernel is read in the pieces the Triton tutorial's fused attention reads in: one inner loop per
orientation (query-major, keys-major) and the epilogue, strung together by :func:`attn_fwd_kernel`; every helper
is a ``@triton.jit`` function that Triton inlines. The pieces the backward and the decode kernels use too
(loads, lengths and key tiles, the scores, the band, the softmax update) are in
:mod:`~attnlab.backends.triton.tiles`.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except ImportError as e:  # the backend reports itself unavailable
    triton, tl = None, None
    IMPORT_ERROR = (
        "triton is not installed (PyPI has it for Linux only: pip install 'triton>=3.4')"
        if isinstance(e, ModuleNotFoundError) and e.name == "triton" else f"triton is not importable ({e})")

LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2

if triton is not None:
    from attnlab.backends.triton import tiles

    # ---- loads and the explicit mask ------------------------------------------------------------------

    @triton.jit
    def _load_q(q_tile, offs_m, offs_c, rows, Nq, D, s_qn, s_qd, UPCAST: tl.constexpr):
        """Columns ``offs_c`` of the Q tile ([BLOCK_M, len(offs_c)]): rows past Nq and columns past D are 0."""
        return tiles.load_tile(q_tile + offs_m[:, None] * s_qn + offs_c[None, :] * s_qd, rows, offs_c, Nq, D, 0, True,
                          False, UPCAST)

    @triton.jit
    def _explicit(s, e_base, n0, tile_m, tile_n, rows, keys, Nq, Nk, s_ei, s_ej, KEY_AXIS: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The explicit bool mask (-inf where False) or additive bias (times log2(e)) on a score tile; read
        through its broadcast strides, bounded by [0, Nq) x [0, Nk), the bias in the caller's dtype and made
        float32 here. ``tile_m``, ``tile_n``: the tile's query and key offsets laid out along the score
        tile's axes."""
        if HAS_MASK or HAS_BIAS:
            e_ptrs = e_base + n0.to(tl.int64) * s_ej + tile_m * s_ei + tile_n * s_ej
            e_ok = tl.expand_dims(rows < Nq, KEY_AXIS) & tl.expand_dims(keys < Nk, 1 - KEY_AXIS)
            s = tiles.apply_explicit(s, e_ptrs, e_ok, HAS_MASK)
        return s

    @triton.jit
    def _modified(s, rows, keys, cap2, slope2, alibi_off, KEY_AXIS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr):
        """The score modifiers on a base-2 score tile: the soft cap, then ALiBi (:mod:`attnlab.score_mods`)."""
        if HAS_SOFTCAP:
            s = tiles.softcap(s, cap2)
        if HAS_ALIBI:
            s = tiles.alibi(s, rows, keys, alibi_off, slope2, KEY_AXIS)
        return s

    @triton.jit
    def _round_e4m3(p):
        """Non-negative float32 ``p`` rounded to the nearest e4m3 value (ties to even, subnormals below 2^-6), as
        float32: the GPU's conversion, for the interpreter, whose own drops the carry when a value rounds up to
        the next power of two (triton 3.9: 0.49 became 0.25)."""
        e = tl.maximum(tl.floor(tl.math.log2(tl.maximum(p, 1e-30))), -6.0)  # p's binade, at least the subnormals
        ulp = tl.math.exp2(e - 3.0)  # three mantissa bits
        return ((p / ulp + 8388608.0) - 8388608.0) * ulp  # (adding 2^23 rounds to an integer, ties to even)

    @triton.jit
    def _e4m3_nan(x, FIX: tl.constexpr):
        """``FIX``: the interpreter's widened e4m3 tile with its NaN codes (0x7f, 0xff) made NaN again (triton 3.9's
        interpreter widens them to +-480, past e4m3's largest finite value, 448); the GPU's conversion keeps them."""
        if FIX:
            x = tl.where(tl.abs(x) > 448.0, float("nan"), x)
        return x

    # ---- query-major: S = Q K^T [BLOCK_M, BLOCK_N], O += P V --------------------------------------------

    @triton.jit
    def _query_major_loop(q_tile, k_base, v_base, e_base, offs_m, offs_n, offs_d, offs_dv, rows, zero,
                          Lk, off, t_lo, t_hi, f_lo, f_hi,
                          Nq, Nk, D, Dv, qk_scale, win_left, win_right, s_qn, s_qd, s_kn, s_kd, s_vn, s_vd, s_ei,
                          s_ej, cap2, slope2, alibi_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                          HAS_RIGHT: tl.constexpr,
                          HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          UPCAST_DOT: tl.constexpr, QK_CHUNK: tl.constexpr, FP8: tl.constexpr):
        """Three phases over key tiles: partial [t_lo, f_lo), full [f_lo, f_hi), partial [f_hi, t_hi), one loop
        body specialized at compile time by ``tl.static_range``; returns (m_i, l_i, acc [BLOCK_M, BLOCK_DV])."""
        tile_m = offs_m[:, None]
        tile_n = offs_n[None, :]
        if QK_CHUNK == 0:
            q = _e4m3_nan(_load_q(q_tile, offs_m, offs_d, rows, Nq, D, s_qn, s_qd, UPCAST_DOT), FP8 and UPCAST_DOT)
        m_i, l_i, acc = tiles.softmax_start(BLOCK_M, BLOCK_DV, 1)
        for phase in tl.static_range(0 if HAS_LEFT else 1, 3):  # phase 0 needs a band's left edge: else empty
            t_begin, t_end = tiles.phase_range(phase, t_lo, f_lo, f_hi, t_hi)
            for t in range(t_begin, t_end):
                n0 = zero + t * BLOCK_N  # (a tensor also in the interpreter, where t is an int)
                keys = n0 + offs_n
                k_ptrs = k_base + n0.to(tl.int64) * s_kn + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd
                v_ptrs = v_base + n0.to(tl.int64) * s_vn + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd
                # partial tiles (phase != 1) read no key past Lk; full tiles load without a predicate
                v = tiles.load_tile(v_ptrs, keys, offs_dv, Lk, Dv, 0, phase != 1, EVEN_DV, UPCAST_DOT)
                v = _e4m3_nan(v, FP8 and UPCAST_DOT)
                # s = scale * log2(e) * q k^T (+ log2(e) * bias), in base 2
                if QK_CHUNK == 0:
                    k = tiles.load_tile(k_ptrs, keys, offs_d, Lk, D, 0, phase != 1, EVEN_D, UPCAST_DOT)
                    s = tl.dot(q, _e4m3_nan(tl.trans(k), FP8 and UPCAST_DOT), input_precision=DOT_PRECISION)
                else:
                    # D in chunks of QK_CHUNK columns, Q's re-read from L1 each tile: the FMA lowering of a
                    # float32 dot keeps a thread's operand rows for the whole reduction in registers, so a
                    # short reduction lets each thread own more scores without spilling.
                    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    for c in tl.static_range(BLOCK_D // QK_CHUNK):
                        offs_c = c * QK_CHUNK + tl.arange(0, QK_CHUNK)
                        qc = _load_q(q_tile, offs_m, offs_c, rows, Nq, D, s_qn, s_qd, UPCAST_DOT)
                        kc_ptrs = (k_base + n0.to(tl.int64) * s_kn + offs_n[:, None] * s_kn
                                   + offs_c[None, :] * s_kd)
                        kc = tiles.load_tile(kc_ptrs, keys, offs_c, Lk, D, 0, phase != 1, EVEN_D, UPCAST_DOT)
                        s = tl.dot(qc, tl.trans(kc), s, input_precision=DOT_PRECISION)
                s = _modified(tiles.score_mod(s, qk_scale), rows, keys, cap2, slope2, alibi_off, 1, HAS_SOFTCAP,
                              HAS_ALIBI)
                s = _explicit(s, e_base, n0, tile_m, tile_n, rows, keys, Nq, Nk, s_ei, s_ej, 1, HAS_MASK, HAS_BIAS)
                if phase != 1:  # partial tile: the length and band predicate
                    s = tiles.band(s, keys, rows, Lk, off, win_left, win_right, 1, HAS_LEFT, HAS_RIGHT)
                p, m_i, l_i, acc = tiles.softmax_update(s, m_i, l_i, acc, 1, (phase != 1) | HAS_MASK | HAS_BIAS)
                if FP8:  # P in e4m3, as the FP8 MMA takes it
                    if UPCAST_DOT:  # the interpreter: rounded by arithmetic, and kept float32 as V was widened
                        p = _round_e4m3(p)
                    else:
                        p = p.to(tl.float8e4nv)
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return m_i, l_i, acc

    # ---- keys-major (float32): S^T = K Q^T [BLOCK_N, BLOCK_M], O^T += V^T P^T -----------------------------

    @triton.jit
    def _keys_major_loop(q_tile, k_base, v_base, e_base, offs_m, offs_n, offs_d, offs_dv, rows, zero,
                         Lk, off, t_lo, t_hi, f_lo, f_hi,
                         Nq, Nk, D, Dv, qk_scale, win_left, win_right, s_qn, s_qd, s_kn, s_kd, s_vn, s_vd, s_ei,
                         s_ej, cap2, slope2, alibi_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr,
                         HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One loop over [t_lo, t_hi): every K/V load carries the Lk bound, and the band predicate runs behind
        a run-time branch, for partial tiles only. (That branch also splits the loop body for ptxas: as one
        block, Q K^T's operand loads and P V's were scheduled together, and a (64, 32) tile took 255
        registers and spilled instead of 128.) Returns (m_i, l_i, acc^T [BLOCK_DV, BLOCK_M])."""
        tile_m = offs_m[None, :]
        tile_n = offs_n[:, None]
        # Q^T is built once, 16 columns of D at a time, as exact products with the identity (q * 1 + 0 * ...):
        # a dot's result is query-fastest, so the shared copy that every S^T product reads is query-contiguous.
        # (Loaded directly, Q^T would be D-contiguous, and the FMA dot's reads of it would hit one bank.)
        q_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
        for c in tl.static_range(BLOCK_D // 16):
            offs_c = c * 16 + tl.arange(0, 16)
            qc = _load_q(q_tile, offs_m, offs_c, rows, Nq, D, s_qn, s_qd, False)
            eye = tl.where(offs_d[:, None] == offs_c[None, :], 1.0, 0.0)
            q_t = tl.dot(eye, tl.trans(qc), q_t, input_precision="ieee")
        m_i, l_i, acc = tiles.softmax_start(BLOCK_M, BLOCK_DV, 0)  # acc: O^T
        for t in range(t_lo, t_hi):
            n0 = zero + t * BLOCK_N  # (a tensor also in the interpreter, where t is an int)
            keys = n0 + offs_n
            k_ptrs = k_base + n0.to(tl.int64) * s_kn + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd
            v_ptrs = v_base + n0.to(tl.int64) * s_vn + offs_n[None, :] * s_vn + offs_dv[:, None] * s_vd
            k = tiles.load_tile(k_ptrs, keys, offs_d, Lk, D, 0, True, EVEN_D, False)
            s = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # s^T, in base 2 after the scale
            s = _modified(tiles.score_mod(s, qk_scale), rows, keys, cap2, slope2, alibi_off, 0, HAS_SOFTCAP,
                          HAS_ALIBI)
            s = _explicit(s, e_base, n0, tile_m, tile_n, rows, keys, Nq, Nk, s_ei, s_ej, 0, HAS_MASK, HAS_BIAS)
            if (t < f_lo) | (t >= f_hi):  # partial tile: the length and band predicate
                s = tiles.band(s, keys, rows, Lk, off, win_left, win_right, 0, HAS_LEFT, HAS_RIGHT)
            p, m_i, l_i, acc = tiles.softmax_update(s, m_i, l_i, acc, 0, True)
            # V^T is loaded here, after the softmax: loaded first, the FMA dot's operand registers of it stay
            # live across Q K^T (sm_90, triton 3.6: 255 registers and spills)
            v = tiles.load_tile(v_ptrs, keys, offs_dv, Lk, Dv, 1, True, EVEN_DV, False)
            acc = tl.dot(v, p, acc, input_precision=DOT_PRECISION)  # O^T += V^T P^T
        return m_i, l_i, acc

    # ---- epilogue ---------------------------------------------------------------------------------------

    @triton.jit
    def _epilogue(acc, m_i, l_i, offs_m, offs_dv, rows, Lq, Out, Lse, b64, h, q0, i0, Nq, Dv, s_ob, s_oh, s_on,
                  s_od, s_lb, s_lh, s_ln, sink2,
                  KEY_AXIS: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Normalize and store the output tile (transposed when keys-major) and lse; empty rows and padding
        rows give 0 and lse = -inf (with a sink: the sink, merged into the state here). Row i of the tile is row
        ``q0 + i0 + i`` of the tensors (q0: the first row of a packed sequence, else 0)."""
        if HAS_SINKS:
            m_i, l_i, acc = tiles.with_sink(m_i, l_i, acc, sink2, KEY_AXIS)
        live = (l_i != 0.0) & (rows < Lq)  # l_i = 0: no allowed key; NaN (from NaN inputs) propagates
        l_div = tl.where(live, l_i, 1.0)
        out = tl.where(tl.expand_dims(live, KEY_AXIS), acc / tl.expand_dims(l_div, KEY_AXIS), 0.0)
        tile_m = tl.expand_dims(offs_m, KEY_AXIS)
        tile_d = tl.expand_dims(offs_dv, 1 - KEY_AXIS)
        o_ptrs = (Out + b64 * s_ob + h.to(tl.int64) * s_oh + (q0 + i0).to(tl.int64) * s_on
                  + tile_m * s_on + tile_d * s_od)
        o_ok = tl.expand_dims(rows < Nq, KEY_AXIS) & tl.expand_dims(offs_dv < Dv, 1 - KEY_AXIS)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_ok)
        if WRITE_LSE:
            if HAS_SINKS:
                dead = sink2 * 0.6931471805599453  # a row with no key (or a padding row): the sink alone
            else:
                dead = float("-inf")
            lse = tl.where(live, (m_i + tl.math.log2(l_div)) * 0.6931471805599453, dead)
            l_ptrs = Lse + b64 * s_lb + h.to(tl.int64) * s_lh + (q0.to(tl.int64) + rows) * s_ln
            tl.store(l_ptrs, lse, mask=rows < Nq)

    # ---- the kernel ---------------------------------------------------------------------------------------

    @triton.jit
    def attn_fwd_kernel(
        Q, K, V, Out, Lse, KvLen, QLen, Explicit, Alibi, Sinks, Descale,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_on, s_od,
        s_lb, s_lh, s_ln,
        s_eb, s_eh, s_ei, s_ej,
        s_ab, s_ah,
        s_zb, s_zh,
        Nq, Nk, D, Dv, Tq, Tk, group, qk_scale, win_left, win_right, cap2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QK_CHUNK: tl.constexpr,
        KEY_AXIS: tl.constexpr, ROWS_OUTER: tl.constexpr, VARLEN: tl.constexpr, FP8: tl.constexpr,
    ):
        # ---- which tile: row tile pid_m (last first), query head h, batch b; kv head h // group ----------
        if VARLEN:  # grid (packed slots, Hq, 1): the last sequence's last row tile first
            b, pid_m = tiles.packed_tile(QLen, tl.num_programs(0) - 1 - tl.program_id(0), Tq, BLOCK_M)
            h = tl.program_id(1)
        elif ROWS_OUTER:  # grid (Hq, B, row tiles): the longest row tiles of every head first
            pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
            h = tl.program_id(0)
            b = tl.program_id(1)
        else:  # grid (row tiles, Hq, B): a head's row tiles side by side (they share its K/V in L2)
            pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
            h = tl.program_id(1)
            b = tl.program_id(2)
        kvh = h // group
        i0 = pid_m * BLOCK_M
        zero = i0 * 0  # an int32 scalar tensor: keeps every bound below a tensor (also when Nk == 1)
        # (Nq, Nk become the bounds of this program's rows and keys: a packed sequence's own lengths)
        q0, k0, Lq, Lk, off, Nq, Nk = tiles.sequence(KvLen, QLen, b, zero, Nq, Nk, Tq, Tk, VARLEN, HAS_KV_LEN,
                                                     HAS_Q_LEN, BOTTOM_RIGHT)
        t_lo, f_lo, f_hi, t_hi = tiles.key_tiles(i0, Lk, Lq, off, win_left, win_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                            HAS_RIGHT)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = i0 + offs_m
        b64 = b.to(tl.int64)
        slope2 = 0.0
        if HAS_ALIBI:  # the head's slope, in base 2
            slope2 = tl.load(Alibi + b64 * s_ab + h.to(tl.int64) * s_ah) * 1.4426950408889634
        sink2 = 0.0
        if HAS_SINKS:  # the head's sink logit, in base 2
            sink2 = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        v_descale = 1.0
        if FP8:  # the head's descales: q's and k's scale the scores, v's the output
            z = Descale + b64 * s_zb + h.to(tl.int64) * s_zh
            qk_scale = qk_scale * tl.load(z) * tl.load(z + 1)
            v_descale = tl.load(z + 2)
        alibi_off = Lk - Lq

        # ---- a tile of padding rows (i0 >= Lq): zeros and lse = -inf, and nothing of Q, K, V read --------
        if i0 >= Lq:
            if KEY_AXIS == 0:
                no_acc = tl.zeros([BLOCK_DV, BLOCK_M], tl.float32)
            else:
                no_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            no_rows = tl.zeros([BLOCK_M], tl.float32)  # l_i = 0: no allowed key
            _epilogue(no_acc, no_rows - float("inf"), no_rows, offs_m, offs_dv, rows, Lq, Out, Lse, b64, h, q0, i0,
                      Nq, Dv, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, sink2, KEY_AXIS, WRITE_LSE, HAS_SINKS)
            return

        # ---- the tile's bases: 64-bit scalars; in-tile offsets stay 32-bit vectors -----------------------
        offs_n = tl.arange(0, BLOCK_N)
        q_tile = Q + b64 * s_qb + h.to(tl.int64) * s_qh + (q0 + i0).to(tl.int64) * s_qn
        k_base = K + b64 * s_kb + kvh.to(tl.int64) * s_kh + k0.to(tl.int64) * s_kn
        v_base = V + b64 * s_vb + kvh.to(tl.int64) * s_vh + k0.to(tl.int64) * s_vn
        e_base = Explicit + b64 * s_eb + h.to(tl.int64) * s_eh + i0.to(tl.int64) * s_ei

        # ---- the key tiles, in one orientation ---------------------------------------------------------
        if KEY_AXIS == 0:
            m_i, l_i, acc = _keys_major_loop(
                q_tile, k_base, v_base, e_base, offs_m, offs_n, offs_d, offs_dv, rows, zero, Lk, off, t_lo, t_hi,
                f_lo, f_hi, Nq, Nk, D, Dv, qk_scale,
                win_left, win_right, s_qn, s_qd, s_kn, s_kd, s_vn, s_vd, s_ei, s_ej, cap2, slope2, alibi_off,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
                HAS_MASK, HAS_BIAS, DOT_PRECISION)
        else:
            m_i, l_i, acc = _query_major_loop(
                q_tile, k_base, v_base, e_base, offs_m, offs_n, offs_d, offs_dv, rows, zero, Lk, off, t_lo, t_hi,
                f_lo, f_hi, Nq, Nk, D, Dv, qk_scale,
                win_left, win_right, s_qn, s_qd, s_kn, s_kd, s_vn, s_vd, s_ei, s_ej, cap2, slope2, alibi_off,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
                HAS_MASK, HAS_BIAS, DOT_PRECISION, UPCAST_DOT, QK_CHUNK, FP8)
        if FP8:
            acc = acc * v_descale

        _epilogue(acc, m_i, l_i, offs_m, offs_dv, rows, Lq, Out, Lse, b64, h, q0, i0, Nq, Dv, s_ob, s_oh, s_on,
                  s_od, s_lb, s_lh, s_ln, sink2, KEY_AXIS, WRITE_LSE, HAS_SINKS)
