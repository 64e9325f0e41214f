"""Backend ``triton``: one fused Triton forward kernel for the whole attention contract.

Tiling and program mapping
--------------------------
The score matrix of one (batch b, query head h) is cut into tiles of ``BLOCK_M`` query rows by
``BLOCK_N`` keys. One program owns one row tile: the grid is ``(ceil(Nq / BLOCK_M), Hq, B)``, the row
tiles of one head are neighbours in launch order (so they share that head's K/V in L2), and the row
tiles are handed out last-first so that under a causal mask the longest rows start first. A config
with ``rows_outer`` launches ``(Hq, B, ceil(Nq / BLOCK_M))`` instead: the longest row tiles of every
head first, so that a causal launch does not end on one long tile (:func:`_rows_outer`). Query head h
reads kv head ``h // group`` (GQA/MQA, grouped). The program loads its Q tile once ([BLOCK_M, BLOCK_D],
D padded to a power of two ``BLOCK_D`` >= 16 with zeros), then streams K/V tiles of ``BLOCK_N`` keys
through the online softmax and writes its [BLOCK_M, D] slice of the output and its lse once at the end.
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
the input dtype before ``P @ V`` (as FlashAttention does); for float32 both products are exact IEEE
(``input_precision="ieee"``: no TF32 rounding of the inputs) unless the caller opts into TF32 with
:func:`allow_tf32`.

Keys-major float32
------------------
float32 products are exact IEEE ones, which Triton runs on the FMA units with both operands read from
shared memory that it does not swizzle. With K as the second operand of Q K^T, a warp's threads read K
rows D floats apart, all in one bank. A ``keys_major`` config (float32 only) holds the score tile
transposed: ``S^T = K Q^T`` ([BLOCK_N, BLOCK_M]), ``O^T += V^T P^T``, the running max and sum reduced
over axis 0 (the kernel's ``KEY_AXIS``). K is then read by two threads per warp, and Q^T, built once per
program as an exact product with the identity (a dot's result is query-contiguous), by all of them
without conflict. On the H200 that made the float32 kernel 2.8x faster (B8 H16 N2048 D64 causal: 5.90
to 2.13 ms). Keys-major runs one loop over its key tiles and finds the partial ones at run time.

Block skipping
--------------
From the effective lengths and the band (causal/window, either alignment) the program computes, on the
device, the keys ``[lo, hi)`` that any of its rows may see (the same bounds as
:meth:`attnlab.masks.MaskSpec.key_range`) and, inside that, the keys ``[full_lo, full_hi)`` that *all*
its rows may see. Key tiles outside ``[lo, hi)`` are never loaded. Tiles wholly inside the full range run
a loop body without any predicate arithmetic (no bounds masks on the K/V loads, no band compares, no
-inf guard); only the partial tiles at either end pay for masking. An explicit bool mask or bias is data,
not structure: where one is given, every visited tile reads it through its broadcast strides (stride 0,
never materialized). The three phases (partial, full, partial) are one loop body specialized at compile
time by ``tl.static_range``.

Where it runs
-------------
On CUDA tensors the kernel is compiled by Triton, with a small autotune space (block sizes, warps,
stages, and for float32 the D chunk of Q K^T; :func:`candidates`) keyed on dtype, head dim, mask kind and
the sizes' powers of two (:func:`tune_key`); ``AUTOTUNE = False`` uses each space's first entry.
Repeated launches of one :class:`~attnlab.problem.Problem` (validated once with ``make_problem`` and
passed to ``TritonBackend().forward`` again and again, as the benchmark harness does) reuse its arguments
and compiled kernel and call Triton's launcher directly (:class:`_Plan`): on an H200 that cut the host
time of such a call from about 86 us to 20 us (a sdpa-flash call: 20 us), which had been the floor of
every small problem. :func:`attnlab.attention` validates its arguments into a new Problem on every call,
so it always takes the JIT path. ``FAST_LAUNCH = False`` (or ATTNLAB_TRITON_FAST_LAUNCH=0) sends every
launch through the JIT.

On CPU tensors the very same Python function runs through Triton's interpreter
(``triton.runtime.interpreter.InterpretedFunction``) with one small config, so the user sets no
``TRITON_INTERPRET``. The interpreter swaps ``triton.language``'s functions for its own while it runs;
:func:`_interpreter` routes the library's @triton.jit helpers (``tl.max``, ``tl.sum``) to interpreted
twins and restores ``triton.language`` afterwards, so interpreted and compiled launches mix in one
process. The code uses plain pointer arithmetic only (no ``tl.make_block_ptr``); its CPU tests pass with
triton 3.4, 3.6 and 3.9.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from attnlab.backend import Availability, Backend
from attnlab.problem import Problem

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # the backend reports itself unavailable
    triton, tl = None, None
    _IMPORT_ERROR = f"triton is not importable ({e})"

LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2

# ---------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _load_q(q_tile, offs_m, offs_c, rows, Nq, D, s_qn, s_qd, UPCAST: tl.constexpr):
        """Columns ``offs_c`` of the Q tile ([BLOCK_M, len(offs_c)]): rows past Nq and columns past D are 0."""
        q = tl.load(q_tile + offs_m[:, None] * s_qn + offs_c[None, :] * s_qd,
                    mask=(rows < Nq)[:, None] & (offs_c < D)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        return q

    @triton.jit
    def _load_kv(ptrs, keys, cols, Lk, D, KEYS_AT: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
                 UPCAST: tl.constexpr):
        """A K or V tile whose keys run along axis ``KEYS_AT`` and D columns ``cols`` along the other: a
        partial tile reads no key at or past Lk, a full one no predicate unless D is padded."""
        if PARTIAL:
            ok = tl.expand_dims(keys < Lk, 1 - KEYS_AT) & tl.expand_dims(cols < D, KEYS_AT)
            x = tl.load(ptrs, mask=ok, other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=tl.expand_dims(cols < D, KEYS_AT), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _band(s, keys, rows, Lk, off, win_left, win_right, KEY_AXIS: tl.constexpr, HAS_LEFT: tl.constexpr,
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

    @triton.jit
    def _attn_fwd_kernel(
        Q, K, V, Out, Lse, KvLen, QLen, Explicit,
        s_qb, s_qh, s_qn, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_on, s_od,
        s_lb, s_lh, s_ln,
        s_eb, s_eh, s_ei, s_ej,
        Nq, Nk, D, group, qk_scale, win_left, win_right,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QK_CHUNK: tl.constexpr,
        KEY_AXIS: tl.constexpr, ROWS_OUTER: tl.constexpr,
    ):
        # ---- which tile: row tile pid_m (last first), query head h, batch b; kv head h // group ----------
        if ROWS_OUTER:  # grid (Hq, B, row tiles): the longest row tiles of every head first
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

        # ---- effective lengths and the diagonal offset of this batch entry ------------------------------
        if HAS_KV_LEN:
            Lk = tl.load(KvLen + b)
        else:
            Lk = zero + Nk
        if HAS_Q_LEN:
            Lq = tl.load(QLen + b)
        else:
            Lq = zero + Nq
        if BOTTOM_RIGHT:
            off = Lk - Lq  # row i's diagonal is key i + Lk - Lq
        else:
            off = zero  # top left: row i's diagonal is key i
        i_last = tl.minimum(i0 + BLOCK_M, Lq) - 1  # last row of the tile that is not padding

        # ---- key bounds: [lo, hi) some row may see; [full_lo, full_hi) every row may see ----------------
        lo = zero
        hi = Lk
        full_lo = lo
        full_hi = hi
        if HAS_LEFT:  # j >= diag_i - left
            lo = tl.maximum(lo, i0 + off - win_left)
            full_lo = tl.maximum(lo, i_last + off - win_left)
        if HAS_RIGHT:  # j <= diag_i + right
            hi = tl.minimum(hi, i_last + off + win_right + 1)
            full_hi = tl.minimum(hi, i0 + off + win_right + 1)
        hi = tl.where(i0 < Lq, tl.maximum(hi, lo), lo)  # a tile of padding rows sees nothing
        # In key tiles (all operands non-negative, so // floors the same on the GPU and in the interpreter).
        t_lo = lo // BLOCK_N
        t_hi = tl.where(hi > lo, (hi + BLOCK_N - 1) // BLOCK_N, t_lo)
        f_lo = (tl.maximum(full_lo, 0) + BLOCK_N - 1) // BLOCK_N
        f_hi = tl.maximum(full_hi, 0) // BLOCK_N
        f_lo = tl.minimum(tl.maximum(f_lo, t_lo), t_hi)
        f_hi = tl.maximum(tl.minimum(f_hi, t_hi), f_lo)

        # ---- the Q tile, loaded once -------------------------------------------------------------------
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rows = i0 + offs_m
        # The score tile is [BLOCK_M queries, BLOCK_N keys] (KEY_AXIS = 1) or its transpose (KEY_AXIS = 0);
        # these are its query and key offsets, and the D and key offsets of the V and output tiles, laid out
        # along their axes (a V tile is [keys, D] with the first, [D, keys] with the second).
        tile_m = tl.expand_dims(offs_m, KEY_AXIS)
        tile_n = tl.expand_dims(offs_n, 1 - KEY_AXIS)
        tile_vn = tl.expand_dims(offs_n, KEY_AXIS)
        tile_d = tl.expand_dims(offs_d, 1 - KEY_AXIS)
        b64 = b.to(tl.int64)
        q_tile = Q + b64 * s_qb + h.to(tl.int64) * s_qh + i0.to(tl.int64) * s_qn
        if KEY_AXIS == 0:
            # Keys-major (float32): S^T = K Q^T and O^T = V^T P^T. Q^T is built once, 16 columns of D at a
            # time, as exact products with the identity (q * 1 + 0 * ...): a dot's result is query-fastest,
            # so the shared copy that every S^T product reads is query-contiguous. (Loaded directly, Q^T
            # would be D-contiguous, and the FMA dot's reads of it would hit one shared-memory bank.)
            q_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
            for c in tl.static_range(BLOCK_D // 16):
                offs_c = c * 16 + tl.arange(0, 16)
                qc = _load_q(q_tile, offs_m, offs_c, rows, Nq, D, s_qn, s_qd, False)
                eye = tl.where(offs_d[:, None] == offs_c[None, :], 1.0, 0.0)
                q_t = tl.dot(eye, tl.trans(qc), q_t, input_precision="ieee")
        elif QK_CHUNK == 0:
            q = _load_q(q_tile, offs_m, offs_d, rows, Nq, D, s_qn, s_qd, UPCAST_DOT)
        k_base = K + b64 * s_kb + kvh.to(tl.int64) * s_kh
        v_base = V + b64 * s_vb + kvh.to(tl.int64) * s_vh
        e_base = Explicit + b64 * s_eb + h.to(tl.int64) * s_eh + i0.to(tl.int64) * s_ei

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if KEY_AXIS == 0:
            acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)  # O^T
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # ---- three phases over key tiles: partial [t_lo, f_lo), full [f_lo, f_hi), partial [f_hi, t_hi) --
        # Keys-major runs one loop over [t_lo, t_hi) instead ("phase 0"): every K/V load carries the Lk
        # bound, and the score predicate runs behind a run-time branch, for partial tiles only. (That
        # branch also splits the loop body for ptxas: as one block, Q K^T's operand loads and P V's were
        # scheduled together, and a (64, 32) tile took 255 registers and spilled instead of 128.)
        for phase in tl.static_range(1 + 2 * KEY_AXIS):
            if KEY_AXIS == 0:
                t_begin = t_lo
                t_end = t_hi
            elif phase == 0:
                t_begin = t_lo
                t_end = f_lo
            elif phase == 1:
                t_begin = f_lo
                t_end = f_hi
            else:
                t_begin = f_hi
                t_end = t_hi
            for t in range(t_begin, t_end):
                n0 = zero + t * BLOCK_N  # (a tensor also in the interpreter, where t is an int)
                keys = n0 + offs_n
                k_ptrs = k_base + n0.to(tl.int64) * s_kn + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd
                v_ptrs = v_base + n0.to(tl.int64) * s_vn + tile_vn * s_vn + tile_d * s_vd
                # partial tiles (phase != 1) read no key past Lk; full tiles load without a predicate
                if KEY_AXIS == 1:
                    v = _load_kv(v_ptrs, keys, offs_d, Lk, D, 0, phase != 1, EVEN_D, UPCAST_DOT)
                if QK_CHUNK == 0:
                    k = _load_kv(k_ptrs, keys, offs_d, Lk, D, 0, phase != 1, EVEN_D, UPCAST_DOT)

                # s = scale * log2(e) * q k^T (+ log2(e) * bias), in base 2 (keys-major: s^T)
                if KEY_AXIS == 0:
                    s = tl.dot(k, q_t, input_precision=DOT_PRECISION)
                elif QK_CHUNK == 0:
                    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
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
                        kc = _load_kv(kc_ptrs, keys, offs_c, Lk, D, 0, phase != 1, EVEN_D, UPCAST_DOT)
                        s = tl.dot(qc, tl.trans(kc), s, input_precision=DOT_PRECISION)
                s = s * qk_scale
                if HAS_MASK or HAS_BIAS:
                    e_ptrs = e_base + n0.to(tl.int64) * s_ej + tile_m * s_ei + tile_n * s_ej
                    e_ok = tl.expand_dims(rows < Nq, KEY_AXIS) & tl.expand_dims(keys < Nk, 1 - KEY_AXIS)
                    if HAS_MASK:
                        allowed = tl.load(e_ptrs, mask=e_ok, other=0)
                        s = tl.where(allowed != 0, s, float("-inf"))
                    else:
                        bias = tl.load(e_ptrs, mask=e_ok, other=0.0)
                        s = s + bias * 1.4426950408889634
                if phase != 1:  # partial tile: the length and band predicate
                    if KEY_AXIS == 0:
                        if (t < f_lo) | (t >= f_hi):
                            s = _band(s, keys, rows, Lk, off, win_left, win_right, 0, HAS_LEFT, HAS_RIGHT)
                    else:
                        s = _band(s, keys, rows, Lk, off, win_left, win_right, 1, HAS_LEFT, HAS_RIGHT)

                # online softmax update (a row's keys run along KEY_AXIS)
                m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
                if phase != 1 or HAS_MASK or HAS_BIAS:
                    # a row with no allowed key so far: m_new = -inf; subtract 0 instead (alpha = p = 0)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_safe = m_new  # a full tile gives every row a finite score
                alpha = tl.math.exp2(m_i - m_safe)
                p = tl.math.exp2(s - tl.expand_dims(m_safe, KEY_AXIS))
                l_i = l_i * alpha + tl.sum(p, KEY_AXIS)
                acc = acc * tl.expand_dims(alpha, KEY_AXIS)
                if KEY_AXIS == 0:
                    # V^T is loaded here, after the softmax: loaded first, the FMA dot's operand registers
                    # of it stay live across Q K^T (on the H200's compiler: 255 registers and spills)
                    v = _load_kv(v_ptrs, keys, offs_d, Lk, D, 1, phase != 1, EVEN_D, UPCAST_DOT)
                    acc = tl.dot(v, p, acc, input_precision=DOT_PRECISION)  # O^T += V^T P^T
                else:
                    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
                m_i = m_new

        # ---- epilogue: normalize; empty rows and padding rows give 0 and lse = -inf --------------------
        live = (l_i != 0.0) & (rows < Lq)  # l_i = 0: no allowed key; NaN (from NaN inputs) propagates
        l_div = tl.where(live, l_i, 1.0)
        out = tl.where(tl.expand_dims(live, KEY_AXIS), acc / tl.expand_dims(l_div, KEY_AXIS), 0.0)
        o_ptrs = (Out + b64 * s_ob + h.to(tl.int64) * s_oh + i0.to(tl.int64) * s_on
                  + tile_m * s_on + tile_d * s_od)
        o_ok = tl.expand_dims(rows < Nq, KEY_AXIS) & tl.expand_dims(offs_d < D, 1 - KEY_AXIS)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_ok)
        if WRITE_LSE:
            lse = tl.where(live, (m_i + tl.math.log2(l_div)) * 0.6931471805599453, float("-inf"))
            l_ptrs = Lse + b64 * s_lb + h.to(tl.int64) * s_lh + rows * s_ln
            tl.store(l_ptrs, lse, mask=rows < Nq)


# ---------------------------------------------------------------------------------------------------
# Configs, autotuning and the interpreter
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class Config:
    """One launch configuration: tile sizes, the compiler's warps and pipeline stages, and two float32
    options: the D chunk of the Q K^T product (0: one dot over all of D) and ``keys_major`` (the score
    tile held as S^T, keys by queries; see :func:`_key_axis`)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    qk_chunk: int = 0
    keys_major: bool = False
    rows_outer: bool = False

    def __post_init__(self) -> None:
        if self.keys_major and self.qk_chunk:
            raise ValueError(f"keys_major and qk_chunk exclude each other (keys-major Q K^T is one dot); got "
                             f"qk_chunk={self.qk_chunk} with keys_major=True")

    def __repr__(self) -> str:
        chunk = f", qk_chunk={self.qk_chunk}" if self.qk_chunk else ""
        major = ", keys_major=True" if self.keys_major else ""
        outer = ", rows_outer=True" if self.rows_outer else ""
        return (f"Config(block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}{chunk}{major}{outer})")


#: The one config of the interpreter: small tiles, so that the CPU tests' short sequences still span
#: several row and key tiles (full and partial phases both run). float32 runs keys-major, as its GPU
#: candidates do (the option is ignored for float16/bfloat16).
INTERPRETER_CONFIG = Config(16, 16, 1, 1, keys_major=True, rows_outer=True)

#: Whether GPU launches autotune (set False, or ATTNLAB_TRITON_AUTOTUNE=0, to use the first candidate).
AUTOTUNE: bool = os.environ.get("ATTNLAB_TRITON_AUTOTUNE", "1") != "0"

_TF32 = False
_tuned: dict[tuple, Config] = {}
_interpreted: dict = {}
_interpreter_lock = threading.Lock()
_MISSING = object()


@contextlib.contextmanager
def allow_tf32() -> Iterator[None]:
    """Opt in to TF32 tensor-core dot products for float32 inputs inside this block (GPU only).

    TF32 keeps 10 mantissa bits, the same unit roundoff (2^-11) as float16, so a TF32 result is checked
    at float16's tolerances; without this, float32 uses exact IEEE products. The interpreter computes
    float32 products exactly in either case.
    """
    global _TF32
    old, _TF32 = _TF32, True
    try:
        yield
    finally:
        _TF32 = old


def candidates(dtype: torch.dtype, block_d: int) -> list[Config]:
    """The GPU autotune space for a dtype and padded head dim; the first entry is the untuned default.

    Sized for Hopper/Ampere shared memory (Q tile plus ``num_stages`` K and V tiles).
    """
    if dtype == torch.float32:
        # IEEE products run on the FMA units, through shared memory: keys-major tiles (see _key_axis) read it
        # without bank conflicts. H200, causal, each candidate timed beside sdpa-efficient (data/gpu_tests/
        # nvidia-h200-fp32-layouts.txt): B8 H16 N2048 D64, (64, 32, 4, 2) keys-major rows-outer 2.13 ms
        # (sdpa-efficient 2.16; the best query-major tile 3.58, with the D-chunked Q K^T 5.90); B1 H8 N1024
        # D64, (32, 64, 4, 2) keys-major 0.088 to 0.113 ms (sdpa-efficient 0.107); B4 H16 N2048 D128,
        # (32, 32, 4, 2) keys-major rows-outer 2.41 ms (query-major 6.21). One query-major candidate each
        # keeps that orientation in the space (and in the GPU tests).
        if block_d <= 64:
            return [Config(64, 32, 4, 2, keys_major=True, rows_outer=True), Config(32, 64, 4, 2, keys_major=True),
                    Config(32, 64, 4, 2, keys_major=True, rows_outer=True), Config(64, 64, 8, 2, keys_major=True),
                    Config(32, 64, 4, 2, qk_chunk=16)]
        if block_d <= 128:
            return [Config(32, 32, 4, 2, keys_major=True, rows_outer=True), Config(32, 64, 8, 2),
                    Config(32, 64, 8, 2, qk_chunk=16)]
        return [Config(16, 64, 8, 2)]
    if block_d <= 64:
        # (64, 64, 4, 2): small causal problems (H200, B8 H16 N1024 D64 causal: 0.070 ms of GPU time against
        # 0.078 for (128, 64, 4, 3) and 0.094 for (128, 128, 8, 3)).
        return [Config(128, 64, 4, 3), Config(128, 128, 8, 3), Config(128, 64, 8, 4), Config(64, 64, 4, 3),
                Config(64, 64, 4, 2)]
    if block_d <= 128:
        return [Config(128, 64, 8, 3), Config(128, 128, 8, 2), Config(64, 64, 4, 3), Config(128, 32, 4, 3)]
    return [Config(64, 32, 4, 2), Config(64, 64, 8, 2), Config(128, 64, 8, 2)]


def _pow2_bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_d(D: int) -> int:
    """The head dim the kernel works on: D padded to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, _pow2_bucket(D))


def _interpreted_fn(fn):
    """``fn`` (a @triton.jit function) wrapped in Triton's interpreter, built once per function."""
    from triton.runtime.interpreter import InterpretedFunction

    raw = fn.fn  # keyed by the Python function: hashing a JITFunction would compute its cache key
    wrapped = _interpreted.get(raw)
    if wrapped is None:
        wrapped = _interpreted[raw] = InterpretedFunction(raw)
    return wrapped


@contextlib.contextmanager
def _interpreter() -> Iterator:
    """Yield the kernel wrapped in Triton's interpreter, for CPU tensors, without TRITON_INTERPRET.

    ``TRITON_INTERPRET=1`` makes ``triton.jit`` build interpreted functions at import, for the whole
    process. Instead, the kernel's own Python function is wrapped here. The library functions it calls
    (``tl.max``, ``tl.sum``...) are themselves ``@triton.jit`` functions, which refuse to be called
    outside a compiled kernel; while the interpreter runs, such calls are routed to interpreted
    wrappers of the same functions (what TRITON_INTERPRET=1 would have built), and restored after.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    def call_interpreted(self, *args, **kwargs):
        return _interpreted_fn(self)(*args, **kwargs)

    # The kernel's loop bounds are scalar tensors, which the interpreter turns into Python ints through
    # ``tensor.__index__``. Before triton 3.7 that is ``int(data)`` on a one-element 1-D array, which
    # NumPy >= 2.5 refuses (seen with triton 3.6 + NumPy 2.5.2); ``.item()`` works with every version.
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_scalar_index(tensor, *rest, **kwargs):
        patch_tensor(tensor, *rest, **kwargs)
        scope = rest[0] if rest else kwargs.get("scope")
        index = lambda self: int(self.handle.data.item())
        if scope is not None:
            scope.set_attr(tensor, "__index__", index)  # restored with the interpreter's own patches
        else:
            tensor.__index__ = index

    with _interpreter_lock:
        # The interpreter swaps triton.language's functions for its own while it runs. Not all of that is
        # undone afterwards (patches made by nested library calls, and, before triton 3.7, none at all),
        # which breaks the next *compiled* launch in this process. Snapshot and restore it all here.
        snapshot = _language_snapshot()
        saved = JITFunction.__call__
        JITFunction.__call__ = call_interpreted
        interpreter._patch_lang_tensor = patch_tensor_scalar_index
        try:
            yield _interpreted_fn(_attn_fwd_kernel)
        finally:
            interpreter._patch_lang_tensor = patch_tensor
            JITFunction.__call__ = saved
            _language_restore(snapshot)


def _language_snapshot() -> list[tuple[object, dict]]:
    """The attribute dicts of every triton.language module and of the classes triton.language.core defines."""
    import sys

    mods = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    classes = [c for c in vars(tl.core).values() if isinstance(c, type) and c.__module__.startswith("triton.language")]
    return [(obj, dict(vars(obj))) for obj in mods + classes]


def _language_restore(snapshot: list[tuple[object, dict]]) -> None:
    """Put back every attribute changed since :func:`_language_snapshot`, and remove those added to classes.

    Names added to a module stay: they are the interpreter's helpers, which it injects into the globals of
    the library functions it rewrites (and caches), and compiled code never looks them up.
    """
    for obj, saved in snapshot:
        current = vars(obj)
        if isinstance(obj, type):
            for key in [k for k in current if k not in saved]:
                delattr(obj, key)
        for key, value in saved.items():
            if current.get(key, _MISSING) is not value:
                setattr(obj, key, value)


def _qk_chunk(cfg: Config, block_d: int) -> int:
    """The kernel's QK_CHUNK for ``cfg``: 0 (one dot) unless a chunk of at least 16 splits BLOCK_D."""
    return cfg.qk_chunk if 16 <= cfg.qk_chunk < block_d else 0


def _key_axis(cfg: Config, dtype: torch.dtype) -> int:
    """The kernel's KEY_AXIS: 0 (keys-major, S^T = K Q^T; why: the module docstring's "Keys-major
    float32") for a float32 ``keys_major`` config, else 1. Half types keep the tensor-core orientation."""
    return 0 if cfg.keys_major and dtype == torch.float32 else 1


def _arguments(prob: Problem, cfg: Config, interpret: bool, write_lse: bool) -> tuple[list, list, list, dict]:
    """The kernel's arguments for ``prob`` and ``cfg`` except those of out and lse, in signature order:
    (pointers before Out, the arguments between Lse and out's strides, those after lse's strides,
    the compile-time constants). :func:`_launch` and :class:`_Plan` put out and lse in between."""
    spec = prob.spec
    q, k, v = prob.q, prob.k, prob.v
    D = prob.D
    block_d = _block_d(D)
    explicit = spec.explicit
    if explicit is not None and explicit.dtype == torch.bool:
        explicit = explicit.view(torch.uint8)  # the kernel reads a bool mask as bytes
    e = explicit if explicit is not None else q  # a placeholder pointer when absent (never read)
    e_strides = explicit.stride() if explicit is not None else (0, 0, 0, 0)
    kv_len = spec.kv_len if spec.kv_len is not None else q
    q_len = spec.q_len if spec.q_len is not None else q
    left = spec.left if spec.left is not None else 0
    right = spec.right if spec.right is not None else 0
    if dtype_is_f32 := prob.dtype == torch.float32:
        precision = "tf32" if (_TF32 and not interpret) else "ieee"
    else:
        precision = "ieee"  # ignored for half types (their products are exact in float32)
    head = [q, k, v]
    mid = [kv_len, q_len, e, *q.stride(), *k.stride(), *v.stride()]
    tail = [*e_strides, prob.Nq, prob.Nk, D, prob.group, prob.scale * LOG2E, left, right]
    constants = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, EVEN_D=(block_d == D),
        HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
        BOTTOM_RIGHT=spec.align == "bottom_right",
        HAS_KV_LEN=spec.kv_len is not None, HAS_Q_LEN=spec.q_len is not None,
        HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
        WRITE_LSE=write_lse, DOT_PRECISION=precision,
        # The interpreter multiplies bfloat16 bit patterns (stored as uint16) as integers in tl.dot;
        # upcasting to float32 first (exact) gives the tensor cores' products.
        UPCAST_DOT=interpret and not dtype_is_f32,
        QK_CHUNK=_qk_chunk(cfg, block_d),
        KEY_AXIS=_key_axis(cfg, prob.dtype),
        ROWS_OUTER=_rows_outer(prob, cfg),
    )
    return head, mid, tail, constants


def _bind(head: Sequence, mid: Sequence, tail: Sequence, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
    """The kernel's run-time arguments in signature order: :func:`_arguments`' parts with out and lse (and
    their strides) in between; without lse, out stands in for its pointer (never written) with strides 0."""
    if lse is None:
        return (*head, out, out, *mid, *out.stride(), 0, 0, 0, *tail)
    return (*head, out, lse, *mid, *out.stride(), *lse.stride(), *tail)


def _launch(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, cfg: Config, interpret: bool):
    """Launch the kernel once with ``cfg`` through Triton's JIT (writes every element of out and lse).

    Returns what the JIT returns for a compiled launch (the compiled kernel), None in the interpreter.
    """
    head, mid, tail, constants = _arguments(prob, cfg, interpret, lse is not None)
    with _interpreter() if interpret else contextlib.nullcontext(_attn_fwd_kernel) as kernel:
        return kernel[_grid(prob, cfg)](
            *_bind(head, mid, tail, out, lse), **constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def _rows_outer(prob: Problem, cfg: Config) -> bool:
    """Whether the grid runs row tiles outermost (``cfg.rows_outer``; a grid's z extent is at most 65535).

    Under a causal mask a row tile's work grows with its index. Launched head by head (each head's
    tiles longest first), the last head's longest tile starts near the end and runs alone: a greedy
    schedule of B8 H16 N2048 (64-row tiles, 528 resident programs on an H200) ends at 1.16x the
    ideal. With row tiles outermost, the longest tiles of every head go first and the tail is short
    tiles: 1.01x. Heads then share less of their K/V in L2, which the (compute-bound) float32
    candidates afford.
    """
    return cfg.rows_outer and triton.cdiv(prob.Nq, cfg.block_m) <= 65535


def _grid(prob: Problem, cfg: Config) -> tuple[int, int, int]:
    """One program per (row tile, query head, batch entry)."""
    if _rows_outer(prob, cfg):
        return (prob.Hq, prob.B, triton.cdiv(prob.Nq, cfg.block_m))
    return (triton.cdiv(prob.Nq, cfg.block_m), prob.Hq, prob.B)


def tune_key(prob: Problem) -> tuple:
    """What a tuned config is remembered by: device, dtype, head dim, mask kind and size buckets."""
    return (
        prob.device.index, prob.dtype, _block_d(prob.D), prob.spec.kind,
        _TF32, _pow2_bucket(prob.Nq), _pow2_bucket(prob.Nk), _pow2_bucket(prob.B * prob.Hq),
    )


def _autotune(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> Config:
    """Time each candidate on this problem (outputs are overwritten by the final launch) and keep the best.

    Each candidate launches through its own :class:`_Plan` (the JIT once, then the direct launcher), so
    that the host stays ahead of the GPU and ``do_bench`` (which clears the L2 before every call) times
    the kernel rather than the host; and the median is kept, not the mean, so that one slow call cannot
    decide. (On the H200, JIT launches cost 97 us of host time, more than the L2 clear between two timed
    calls; with them and the mean, fp16 B8 H16 N1024 D64 causal was once tuned to (128, 128, 8, 3),
    0.095 ms of GPU time, over (64, 64, 4, 2), 0.070 ms.)
    """
    from triton.testing import do_bench

    best, best_ms = None, math.inf
    for cfg in candidates(prob.dtype, _block_d(prob.D)):
        plan = _Plan(prob, cfg)
        try:
            ms = do_bench(lambda plan=plan: plan.launch(prob, out, lse), warmup=5, rep=20, return_mode="median")
        except Exception as err:  # a config that does not fit (shared memory, registers) is skipped
            if "OutOfResources" in type(err).__name__ or "out of resource" in str(err).lower():
                continue
            raise
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no Triton config fits this GPU for dtype={prob.dtype}, D={prob.D}")
    return best


def config_for(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> Config:
    """The config a GPU launch uses: tuned once per :func:`tune_key`, or the default candidate."""
    if not AUTOTUNE:
        return candidates(prob.dtype, _block_d(prob.D))[0]
    key = tune_key(prob)
    cfg = _tuned.get(key)
    if cfg is None:
        cfg = _tuned[key] = _autotune(prob, out, lse)
    return cfg


# ---------------------------------------------------------------------------------------------------
# Repeated launches of one problem
# ---------------------------------------------------------------------------------------------------
#: Whether repeated GPU launches of one Problem skip Triton's JIT dispatch (ATTNLAB_TRITON_FAST_LAUNCH=0:
#: never; every launch then goes through ``kernel[grid](...)``).
FAST_LAUNCH: bool = os.environ.get("ATTNLAB_TRITON_FAST_LAUNCH", "1") != "0"

class _Plan:
    """How one :class:`Problem` is launched with one config: the compiled kernel of each out/lse layout
    seen so far, and the arguments that do not depend on out and lse (computed at the first direct launch).

    The first launch of each layout goes through Triton's JIT (``kernel[grid](...)``), which specializes,
    compiles or finds the compiled kernel, and returns it. Later launches of that layout call the compiled
    kernel's launcher directly, with the arguments the JIT would pass: the JIT's per-call work (binding
    about 45 arguments, specializing each, building the cache key) is what made small problems wait for
    the host. That is sound because everything the JIT specializes on is fixed: the problem's tensors,
    sizes, strides and constants belong to the (immutable) Problem, and the layout key holds out's and
    lse's dtypes, strides and 16-byte alignment. Launch hooks are honoured as the JIT honours them.
    """

    __slots__ = ("args", "cfg", "device", "grid", "kernels")

    def __init__(self, prob: Problem, cfg: Config) -> None:
        self.cfg = cfg
        self.grid = _grid(prob, cfg)
        self.device = prob.device.index
        self.kernels: dict[tuple, object] = {}
        self.args: dict[bool, tuple] = {}  # write_lse -> (head, mid, tail, the constants' values)

    def launch(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        if lse is None:
            key = (out.dtype, out.stride(), out.data_ptr() % 16 == 0)
        else:
            key = (out.dtype, out.stride(), out.data_ptr() % 16 == 0, lse.dtype, lse.stride(), lse.data_ptr() % 16 == 0)
        kernel = self.kernels.get(key)
        if kernel is None or not FAST_LAUNCH:
            kernel = _launch(prob, out, lse, self.cfg, interpret=False)
            if FAST_LAUNCH and _fast_launch_supported(kernel):
                self.kernels[key] = kernel
            return
        head, mid, tail, constants = self._arguments(prob, lse is not None)
        # The launcher takes every parameter in signature order, the constants (which come last) too.
        args = (*_bind(head, mid, tail, out, lse), *constants)
        grid = self.grid
        stream = _current_stream(self.device)
        hooks = triton.knobs.runtime
        # As CompiledKernel's own launcher (``kernel[grid](*args)``) and the JIT call it, in triton 3.4 to 3.9.
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *args), hooks.launch_enter_hook, hooks.launch_exit_hook,
                   *args)

    def _arguments(self, prob: Problem, write_lse: bool) -> tuple:
        got = self.args.get(write_lse)
        if got is None:
            head, mid, tail, constants = _arguments(prob, self.cfg, False, write_lse)
            got = self.args[write_lse] = (head, mid, tail, tuple(constants[n] for n in _constexpr_names()))
        return got


def _current_stream(device: int):
    """The raw handle of the current CUDA stream of ``device``, as Triton's JIT launches on it."""
    return triton.runtime.driver.active.get_current_stream(device)


@functools.cache
def _constexpr_names() -> tuple[str, ...]:
    params = _attn_fwd_kernel.params
    names = tuple(p.name for p in params if p.is_constexpr)
    assert all(p.is_constexpr for p in params[len(params) - len(names):]), "constants must come last"
    return names


def _fast_launch_supported(kernel) -> bool:
    """Whether ``kernel`` (what the JIT returned) has the launcher interface of triton 3.4 to 3.9."""
    knobs = getattr(triton, "knobs", None)
    return (kernel is not None and knobs is not None and hasattr(knobs, "runtime")
            and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")))


def _plan(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> _Plan:
    """The problem's plan for the current TF32 and autotune settings (tunes on first use, see config_for),
    kept in the problem's own cache: it lives as long as the problem and its tensors."""
    plans = prob.cache.setdefault("triton_plans", {})
    key = (_TF32, AUTOTUNE)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Plan(prob, config_for(prob, out, lse))
    return plan


# ---------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------
class TritonBackend(Backend):
    """attnlab's fused Triton forward kernel (the module docstring explains it)."""

    name = "triton"
    kernel_backward = True  # differentiated by the Triton backward kernels (attnlab.triton_bwd)
    description = (
        "fused Triton forward kernel: online softmax in exp2, block skipping, every mask, GQA; "
        "CPU tensors run through Triton's interpreter"
    )

    def availability(self) -> Availability:
        if _IMPORT_ERROR is not None:
            return Availability(False, _IMPORT_ERROR)
        return Availability(True)

    def unsupported(self, prob: Problem) -> str | None:
        if _IMPORT_ERROR is not None:
            return _IMPORT_ERROR
        if prob.device.type not in ("cuda", "cpu"):
            return f"runs on CUDA tensors (compiled) or CPU tensors (interpreter); got {prob.device}"
        if prob.B > 65535 or prob.Hq > 65535:
            return f"grid limit: B and Hq must be at most 65535; got B={prob.B}, Hq={prob.Hq}"
        if prob.device.type == "cuda" and prob.dtype == torch.bfloat16:
            major, _ = torch.cuda.get_device_capability(prob.device)
            if major < 8:
                return "bfloat16 needs compute capability 8.0 or newer"
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        if out.numel() == 0 or prob.Nk == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return
        q = prob.q
        if not q.is_cuda:
            _launch(prob, out, lse, INTERPRETER_CONFIG, interpret=True)
            return
        if torch.cuda.current_device() == q.get_device():
            _plan(prob, out, lse).launch(prob, out, lse)
        else:
            with torch.cuda.device(q.device):
                _plan(prob, out, lse).launch(prob, out, lse)
