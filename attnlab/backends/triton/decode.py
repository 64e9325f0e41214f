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
  are neighbours in launch order. ``S`` follows from B, Hkv, Nk and the SM count (:func:`num_splits`).
* **Online softmax** per packed row, in base 2 as in the fused forward: ``m_i`` (running max of
  ``s = scale * log2(e) * q.k (+ log2(e) * bias)``), ``l_i`` (sum of ``exp2(s - m_i)``) and ``acc`` (sum of
  ``exp2(s - m_i) * v``), float32. Within a split, key tiles that every row sees in full run without any
  predicate; the partial tiles at the ends of the band and the length pay for the masks.
* **Merge.** Each split stores its unnormalized state (m, l, acc) in a float32 workspace, and a second
  kernel combines the S states of each (batch, query head, row) with the lse rule: ``m = max_s m_s``,
  ``l = sum_s l_s * exp2(m_s - m)``, ``out = sum_s acc_s * exp2(m_s - m) / l``, ``lse = (m + log2 l) * ln 2``;
  l = 0 (no allowed key anywhere) gives out = 0 and lse = -inf. With S = 1 the split kernel normalizes and
  writes out and lse itself, and no merge runs.
* **Paged KV cache** (FlashAttention's ``flash_attn_with_kvcache`` convention): caches
  ``[num_blocks, block_size, Hkv, D]`` and an int32 ``block_table [B, max_blocks]``; logical key j of batch
  b is read at ``cache[block_table[b, j // block_size], j % block_size]``. Block ids are clamped to
  ``[0, num_blocks)`` and no block-table entry at or past kv_len is read, so a bad table never reads out of
  bounds.

Plain pointer arithmetic with masks only (never ``tl.make_block_ptr``): the same functions compile with
triton 3.4 to 3.9 and run through Triton's interpreter on CPU tensors (``attnlab.backends.triton.interpreter``'s
``interpreter``), where BLOCK_M = BLOCK_N = 16 so small tests span several tiles, row tiles and splits.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from attnlab.backends.triton import interpreter as _interp
from attnlab.backends.triton import kernel as _kern
from attnlab.backends.triton import launch as _launch
from attnlab.backends.triton.kernel import tl, triton
from attnlab.paged import PagedKV, paged_kv
from attnlab.problem import Problem

#: The decode path is for at most this many query rows (larger Nq is a prefill: the fused forward).
MAX_DECODE_NQ = 16
#: Most packed rows one program holds; more are cut into row tiles (each re-reads K/V, mostly from L2).
MAX_BLOCK_M = 64
#: The most splits of one (batch, kv head, row tile), and the fewest key tiles a split should own.
MAX_SPLITS = 256
MIN_TILES_PER_SPLIT = 4
#: Programs aimed for per SM when choosing the split count: 4, from the H200 sweep (graph replay, bf16 D128)
#: in data/gpu_tests/nvidia-h200-decode-profile-2026-12-01.txt.
PROGRAMS_PER_SM = 4
#: The interpreter's fixed split count when none is forced (so CPU runs exercise the merge).
INTERPRETER_SPLITS = 3

# ---------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------
if triton is not None:
    from attnlab.backends.triton import tiles

    @triton.jit
    def _key_offsets(Bt, keys, Lk, num_blocks, block_size, s_kn, s_kblk, s_vn, s_vblk,
                     PAGED: tl.constexpr, PARTIAL: tl.constexpr):
        """int64 offsets of ``keys``' rows in K and V: dense, key * key stride (the batch is in the base
        pointer); paged, through the block table row ``Bt`` (ids clamped; entries past Lk never read)."""
        if PAGED:
            if PARTIAL:
                blk = tl.load(Bt + keys // block_size, mask=keys < Lk, other=0)
            else:
                blk = tl.load(Bt + keys // block_size)
            blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
            slot = (keys % block_size).to(tl.int64)
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
                s = s + tl.load(e_ptrs, mask=e_ok, other=0.0) * 1.4426950408889634
        if PARTIAL:
            ok = (keys < Lk)[None, :] & row_ok[:, None]
            if HAS_LEFT:  # j >= diag_i - left
                ok = ok & (keys[None, :] >= (rows + off - win_left)[:, None])
            if HAS_RIGHT:  # j <= diag_i + right
                ok = ok & (keys[None, :] <= (rows + off + win_right)[:, None])
            s = tl.where(ok, s, float("-inf"))
        return s

    @triton.jit
    def _tile(m_i, l_i, acc, q, t, k_base, v_base, Bt, e_rows, rows, row_ok, offs_n, offs_d,
              Lk, Nk, D, off, win_left, win_right, qk_scale, num_blocks, block_size,
              s_kn, s_kblk, s_kd, s_vn, s_vblk, s_vd, s_ej,
              BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Key tile ``t`` of the split: load K and V (dense or through the block table), score, update."""
        keys = t * BLOCK_N + offs_n
        k_off, v_off = _key_offsets(Bt, keys, Lk, num_blocks, block_size, s_kn, s_kblk, s_vn, s_vblk,
                                    PAGED, PARTIAL)
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
        Hq, Nq, Nk, D, group, row_tiles, num_blocks, block_size, qk_scale, win_left, win_right,
        Out, Lse, WsM, WsL, WsAcc, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_KV_LEN: tl.constexpr, HAS_Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
        PAGED: tl.constexpr, FINAL: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # ---- which program: split, (kv head, row tile), batch entry ------------------------------------
        split = tl.program_id(0)
        S = tl.num_programs(0)
        kvh = tl.program_id(1) // row_tiles
        r0 = (tl.program_id(1) % row_tiles) * BLOCK_M
        b = tl.program_id(2)
        zero = split * 0  # an int32 scalar tensor: keeps every bound a tensor

        # ---- lengths (clamped: a device length is never trusted for addressing) and the diagonal -------
        Lk, Lq, off = tiles.lengths(KvLen, QLen, b, zero, Nq, Nk, HAS_KV_LEN, HAS_Q_LEN, BOTTOM_RIGHT)

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

        m_i, l_i, acc = tiles.softmax_start(BLOCK_M, BLOCK_D, 1)
        for phase in tl.static_range(3):
            t_begin, t_end = tiles.phase_range(phase, s_lo, a, c, s_hi)
            for t in range(t_begin, t_end):
                m_i, l_i, acc = _tile(
                    m_i, l_i, acc, q, zero + t, k_base, v_base, Bt, e_rows, rows, row_ok, offs_n, offs_d,
                    Lk, Nk, D, off, win_left, win_right, qk_scale, num_blocks, block_size,
                    s_kn, s_kb, s_kd, s_vn, s_vb, s_vd, s_ej,
                    BLOCK_N, phase != 1, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST,
                    DOT_PRECISION,
                )

        # ---- epilogue: padding rows hold the empty state; one split normalizes, several store states ---
        ws_row = (b64 * Hq + heads) * Nq + rows  # (b, h, i) of each packed row
        d_ok = row_ok[:, None] & (offs_d < D)[None, :]
        if FINAL:
            _store_final(Out, Lse, b64, heads, rows, offs_d, row_ok, live_row, m_i, l_i, acc, D,
                         s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, WRITE_LSE)
        else:
            idx = ws_row * S + split
            tl.store(WsM + idx, tl.where(live_row, m_i, float("-inf")), mask=row_ok)
            tl.store(WsL + idx, tl.where(live_row, l_i, 0.0), mask=row_ok)
            tl.store(WsAcc + idx[:, None] * D + offs_d[None, :], tl.where(live_row[:, None], acc, 0.0), mask=d_ok)

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
        WsM, WsL, WsAcc, Out, Lse, s_ob, s_oh, s_on, s_od, s_lb, s_lh, s_ln, Hq, Nq, D, S,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr,
    ):
        """One program per (b, h, i): combine the S split states with the lse rule (module docstring)."""
        row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * Nq + i
        i = row % Nq
        h = (row // Nq) % Hq
        b = row // (Nq * Hq)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        base = row * S
        m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        for s0 in range(0, S, BLOCK_S):  # m = max_s m_s
            m = tl.maximum(m, tl.max(tl.load(WsM + base + s0 + offs_s, mask=s0 + offs_s < S,
                                             other=float("-inf")), 0))
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0
        l = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, S, BLOCK_S):  # l = sum_s l_s w_s, acc = sum_s acc_s w_s, w_s = exp2(m_s - m)
            ok = s0 + offs_s < S
            w = tl.math.exp2(tl.load(WsM + base + s0 + offs_s, mask=ok, other=float("-inf")) - m_safe)
            l += tl.sum(tl.load(WsL + base + s0 + offs_s, mask=ok, other=0.0) * w, 0)
            a_ptrs = WsAcc + (base + s0 + offs_s)[:, None] * D + offs_d[None, :]
            a_s = tl.load(a_ptrs, mask=ok[:, None] & (offs_d < D)[None, :], other=0.0)
            acc += tl.sum(a_s * w[:, None], 0)
        live = l != 0.0
        l_div = tl.where(live, l, 1.0)
        out = tl.where(live, acc / l_div, 0.0)
        tl.store(Out + b * s_ob + h * s_oh + i * s_on + offs_d * s_od, out.to(Out.dtype.element_ty),
                 mask=offs_d < D)
        if WRITE_LSE:
            tl.store(Lse + b * s_lb + h * s_lh + i * s_ln,
                     tl.where(live, (m + tl.math.log2(l_div)) * 0.6931471805599453, float("-inf")))


# ---------------------------------------------------------------------------------------------------
# Host side: configs, the split count, the paged cache, launches
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Key tile, warps and pipeline stages of the split kernel (BLOCK_M follows from the packed rows)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


#: The interpreter's config: 16-key tiles, so short CPU sequences span several tiles per split.
INTERPRETER_CONFIG = DecodeConfig(16, 1, 1)


def default_config(dtype: torch.dtype, D: int) -> DecodeConfig:
    """The GPU config for a dtype and head dim. bf16 D128 on the H200: (64, 4, 2) within a few percent of the
    best on every shape swept (data/gpu_tests/nvidia-h200-decode-run1.txt and -decode-profile-2026-12-01.txt:
    graph replay, where the GPU and not the host sets the time)."""
    block_d = _block_d(D)
    if dtype == torch.float32:
        return DecodeConfig(32, 4, 2) if block_d <= 128 else DecodeConfig(16, 4, 2)
    return DecodeConfig(64, 4, 2) if block_d <= 128 else DecodeConfig(32, 4, 2)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_d(D: int) -> int:
    return max(16, _pow2(D))


def block_m(prob: Problem, interpret: bool = False) -> int:
    """Packed rows per program: group * Nq rounded up to a power of two, at least 16 (tl.dot's minimum),
    at most MAX_BLOCK_M (16 in the interpreter, so CPU tests also run several row tiles)."""
    return 16 if interpret else min(MAX_BLOCK_M, max(16, _pow2(prob.group * prob.Nq)))


def row_tiles(prob: Problem, interpret: bool = False) -> int:
    bm = block_m(prob, interpret)
    return (prob.group * prob.Nq + bm - 1) // bm


def num_splits(prob: Problem, cfg: DecodeConfig, sm_count: int, interpret: bool = False) -> int:
    """How many splits each (batch entry, kv head, row tile) gets: enough programs for about
    PROGRAMS_PER_SM per SM, each split at least MIN_TILES_PER_SPLIT key tiles, then evened out so that the
    tiles divide nearly equally (a host-side choice: device lengths are not read back)."""
    tiles = max(1, (prob.Nk + cfg.block_n - 1) // cfg.block_n)
    base = max(1, prob.B * prob.Hkv * row_tiles(prob, interpret))
    want = (PROGRAMS_PER_SM * sm_count + base - 1) // base
    s = max(1, min(want, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    per = (tiles + s - 1) // s
    return (tiles + per - 1) // per


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def workspace_bytes(prob: Problem, splits: int) -> int:
    """Extra device memory of the split states: m, l and acc (float32) per (b, h, i, split); 0 for one."""
    return 0 if splits <= 1 else prob.B * prob.Hq * prob.Nq * splits * (prob.D + 2) * 4


def decode_supported(prob: Problem) -> str | None:
    """Why the decode path cannot (or should not) run ``prob``, or None when it can."""
    if _kern._IMPORT_ERROR is not None:
        return _kern._IMPORT_ERROR
    if prob.device.type not in ("cuda", "cpu"):
        return f"runs on CUDA tensors (compiled) or CPU tensors (interpreter); got {prob.device}"
    if prob.Nq > MAX_DECODE_NQ:
        return f"the decode path takes Nq <= {MAX_DECODE_NQ} query rows; got Nq={prob.Nq} (a prefill)"
    if prob.B > 65535 or prob.Hkv * row_tiles(prob) > 65535:
        return f"grid limit: B and Hkv * row tiles must be at most 65535; got B={prob.B}, Hkv={prob.Hkv}"
    if prob.device.type == "cuda" and prob.dtype == torch.bfloat16:
        if torch.cuda.get_device_capability(prob.device)[0] < 8:
            return "bfloat16 needs compute capability 8.0 or newer"
    return None


def decode_forward(
    prob: Problem,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    splits: int | None = None,
    config: DecodeConfig | None = None,
) -> None:
    """Split-KV decode of ``prob`` into ``out`` ([B, Hq, Nq, D] view, q's dtype) and ``lse`` ([B, Hq, Nq]
    float32, or None), writing every element (the backend contract of :meth:`attnlab.backends.Backend.forward`).

    Paged cache: pass ``k_cache``, ``v_cache`` ([num_blocks, block_size, Hkv, D]) and ``block_table`` (int32
    [B, max_blocks]) together; ``prob`` then supplies q, the masks, the scale and the shapes (Hkv, D and
    Nk = max_blocks * block_size), and its k and v are never read (they may be stride-0 placeholders).
    ``block_size`` is optional (it is the caches' second dim). ``splits`` forces the split count (default:
    :func:`num_splits`; a fixed INTERPRETER_SPLITS on CPU); ``config`` the GPU tile config.

    GPU calls of one signature share a launch plan (:func:`gpu_plan`), launched without Triton's JIT dispatch.
    """
    paged = None
    given = [x is not None for x in (k_cache, v_cache, block_table)]
    if any(given):
        if not all(given):
            raise ValueError("a paged cache needs k_cache, v_cache and block_table together")
        paged = paged_kv(k_cache, v_cache, block_table, B=prob.B, Hkv=prob.Hkv, D=prob.D, Nk=prob.Nk,
                         dtype=prob.dtype, device=prob.device, block_size=block_size, kv_len=prob.spec.kv_len)
    if out.numel() == 0 or prob.Nk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    interpret = not prob.q.is_cuda
    if interpret:
        cfg = config or INTERPRETER_CONFIG
        n_split = splits or INTERPRETER_SPLITS
    else:
        cfg = config or default_config(prob.dtype, prob.D)
        n_split = splits if splits is not None else num_splits(prob, cfg, _sm_count(prob.device.index or 0))
    if n_split < 1:
        raise ValueError(f"splits must be at least 1; got {n_split}")
    if interpret:
        _Plan(prob, cfg, n_split, paged, True).launch(prob, paged, out, lse)
        return
    with torch.cuda.device(prob.device):
        gpu_plan(prob, cfg, n_split, paged).launch(prob, paged, out, lse)


def gpu_plan(prob: Problem, cfg: DecodeConfig | None = None, n_split: int | None = None,
             paged: PagedKV | None = None) -> _Plan:
    """The plan of ``prob``'s call signature (attnlab.attention makes a new Problem per call): what the fused
    forward's plans are keyed by, plus the decode config, the split count and the paged caches' layout."""
    cfg = cfg or default_config(prob.dtype, prob.D)
    n_split = n_split if n_split is not None else num_splits(prob, cfg, _sm_count(prob.device.index or 0))
    key = (_launch._signature(prob), cfg, n_split, None if paged is None else tuple(
        (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)
        for t in (paged.k_cache, paged.v_cache, paged.block_table)))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _launch.MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        plan = _PLANS[key] = _Plan(prob, cfg, n_split, paged, False)
    return plan


_PLANS: dict[tuple, _Plan] = {}  # decode plans by call signature (bounded like the fused forward's)


class _Kernel:
    """One kernel on one grid with fixed constants: the first launch of each specialization (``key``: what
    the JIT specializes the per-call arguments on) goes through Triton's JIT, later ones call the compiled
    kernel's launcher directly, as the fused forward's plans do (the launcher takes the constants too)."""

    def __init__(self, fn, grid: tuple[int, int, int], constants: dict, num_warps: int, num_stages: int):
        self.fn, self.grid, self.constants = fn, grid, constants
        self.options = dict(num_warps=num_warps, num_stages=num_stages)
        self.compiled: dict[tuple, object] = {}

    def direct(self, key: tuple):
        """``go(stream, args)``: the compiled kernel of ``key`` launched directly (None before it exists)."""
        kernel = self.compiled.get(key)
        if kernel is None or not _launch.FAST_LAUNCH:
            return None
        grid, constants = self.grid, tuple(self.constants[p.name] for p in self.fn.params if p.is_constexpr)
        launcher, function, packed, hooks = kernel.run, kernel.function, kernel.packed_metadata, triton.knobs.runtime

        def go(stream, args):
            full, enter = (*args, *constants), hooks.launch_enter_hook
            meta = None if enter is None else kernel.launch_metadata(grid, stream, *full)
            launcher(*grid, stream, function, packed, meta, enter, hooks.launch_exit_hook, *full)

        return go

    def launch(self, args: tuple, key: tuple, device: int) -> None:
        kernel = self.compiled.get(key)
        if kernel is None or not _launch.FAST_LAUNCH:
            kernel = self.fn[self.grid](*args, **self.constants, **self.options)
            if _launch.FAST_LAUNCH and _launch._fast_launch_supported(kernel):
                self.compiled[key] = kernel
            return
        full = (*args, *(self.constants[p.name] for p in self.fn.params if p.is_constexpr))
        stream = _launch._current_stream(device)
        hooks = triton.knobs.runtime
        kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(self.grid, stream, *full), hooks.launch_enter_hook,
                   hooks.launch_exit_hook, *full)


def _layout_key(*tensors: torch.Tensor) -> tuple:
    """What the JIT specializes tensors on (dtype, strides, 16-byte alignment)."""
    return tuple((t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in tensors)


def _explicit(prob: Problem) -> torch.Tensor | None:
    """The explicit mask (as bytes) or bias, or None."""
    spec = prob.spec
    explicit = spec.mask if spec.mask is not None else spec.bias
    return explicit.view(torch.uint8) if explicit is not None and explicit.dtype == torch.bool else explicit


def _tensors(prob: Problem, paged: PagedKV | None) -> tuple:
    """The split kernel's seven tensor arguments (placeholders stand in for absent ones; never read)."""
    spec, q = prob.spec, prob.q
    k, v, bt = (prob.k, prob.v, q) if paged is None else (paged.k_cache, paged.v_cache, paged.block_table)
    e = _explicit(prob)
    return (q, k, v, bt, spec.kv_len if spec.kv_len is not None else q,
            spec.q_len if spec.q_len is not None else q, e if e is not None else q)


class _Plan:
    """The launches of one problem with one config, split count and cache: the split kernel and, with more
    than one split, the merge. The workspace is allocated per call (stream-ordered by torch's allocator)."""

    def __init__(self, prob: Problem, cfg: DecodeConfig, n_split: int, paged: PagedKV | None, interpret: bool):
        spec, q = prob.spec, prob.q
        self.n_split, self.interpret, self.merge_rows = n_split, interpret, prob.B * prob.Hq * prob.Nq
        if paged is None:
            k, v = prob.k, prob.v
            k_strides, v_strides, s_bt, nb, bs = k.stride(), v.stride(), 0, 1, 1
        else:
            k, v, bt = paged.k_cache, paged.v_cache, paged.block_table
            # caches [block, slot, head, d], passed as (block, head, slot, d): the dense argument order
            (k0, k1, k2, k3), (v0, v1, v2, v3) = k.stride(), v.stride()
            k_strides, v_strides = (k0, k2, k1, k3), (v0, v2, v1, v3)
            s_bt, nb, bs = bt.stride(0), paged.num_blocks, paged.block_size
        e_strides = (0, 0, 0, 0) if _explicit(prob) is None else _explicit(prob).stride()
        n_rt = row_tiles(prob, interpret)
        # Everything but the seven tensors, which change from call to call (see _tensors).
        self.fixed = (
            *q.stride(), *k_strides, *v_strides, s_bt, *e_strides,
            prob.Hq, prob.Nq, prob.Nk, prob.D, prob.group, n_rt, nb, bs, prob.scale * _kern.LOG2E,
            spec.left if spec.left is not None else 0, spec.right if spec.right is not None else 0,
        )
        self.block_d = _block_d(prob.D)
        self.constants = dict(
            BLOCK_M=block_m(prob, interpret), BLOCK_N=cfg.block_n, BLOCK_D=self.block_d,
            EVEN_D=self.block_d == prob.D, HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
            BOTTOM_RIGHT=spec.align == "bottom_right", HAS_KV_LEN=spec.kv_len is not None,
            HAS_Q_LEN=spec.q_len is not None, HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
            PAGED=paged is not None, FINAL=n_split == 1,
            # the interpreter multiplies bfloat16 bit patterns as integers in tl.dot: upcast first (exact)
            UPCAST=interpret and prob.dtype != torch.float32, DOT_PRECISION="ieee",
        )
        self.cfg, self.grid = cfg, (n_split, prob.Hkv * n_rt, prob.B)
        self.kernels: dict[bool, tuple[_Kernel, _Kernel]] = {}  # write_lse -> (split, merge)

    def _kernels(self, write_lse: bool) -> tuple[_Kernel, _Kernel]:
        got = self.kernels.get(write_lse)
        if got is None:
            cfg = self.cfg
            split_fn, merge_fn = _decode_split_kernel, _decode_merge_kernel
            if self.interpret:
                split_fn, merge_fn = _interp._interpreted_fn(split_fn), _interp._interpreted_fn(merge_fn)
            split = _Kernel(split_fn, self.grid, dict(self.constants, WRITE_LSE=write_lse), cfg.num_warps,
                            cfg.num_stages)
            merge = _Kernel(merge_fn, (self.merge_rows, 1, 1),
                            dict(BLOCK_S=min(64, _pow2(self.n_split)), BLOCK_D=self.block_d, WRITE_LSE=write_lse),
                            4 if self.block_d >= 128 else 2, 1)
            got = self.kernels[write_lse] = (split, merge)
        return got

    def _workspace(self, prob: Problem, out: torch.Tensor) -> tuple:
        """The split states m, l, acc (float32 views of one allocation); out stands in with one split."""
        if self.n_split == 1:
            return out, out, out
        rows = self.merge_rows * self.n_split
        ws = torch.empty(rows * (prob.D + 2), dtype=torch.float32, device=prob.device)
        return ws[:rows], ws[rows:2 * rows], ws[2 * rows:]

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
        """As the fused forward's :meth:`attnlab.backends.triton.launch._Plan.fast_call`: ``(q, k, v, kv_len,
        q_len, mask, block_table) -> (out, lse or None)``, allocating as :meth:`launch` does; with a paged cache
        k and v are the caches."""
        write_lse = lse is not None
        split, merge = self._kernels(write_lse)
        lse_arg = lse if write_lse else out
        key = _layout_key(out, lse_arg, *self._workspace(prob, out))
        go_split, go_merge = split.direct(key), merge.direct(key)
        if go_split is None or (self.n_split > 1 and go_merge is None):
            return None
        shape = (prob.B, prob.Hq, prob.Nq, prob.D) if prob.layout == "bhnd" else (prob.B, prob.Nq, prob.Hq, prob.D)
        strides = (*out.stride(), *(lse.stride() if write_lse else (0, 0, 0)))
        lse_shape, dev, index, fixed = (prob.B, prob.Hq, prob.Nq), prob.device, prob.device.index, self.fixed
        merge_tail = (prob.Hq, prob.Nq, prob.D, self.n_split)
        current_stream = triton.runtime.driver.active.get_current_stream

        def call(q, k, v, kv_len, q_len, mask, block_table):
            o = torch.empty(shape, dtype=q.dtype, device=dev)
            m = torch.empty(lse_shape, dtype=torch.float32, device=dev) if write_lse else None
            l_arg = o if m is None else m
            ws_m, ws_l, ws_acc = self._workspace(prob, o)
            stream = current_stream(index)
            bt = q if block_table is None else block_table
            go_split(stream, (q, k, v, bt, q if kv_len is None else kv_len, q if q_len is None else q_len,
                              q if mask is None else mask, *fixed, o, l_arg, ws_m, ws_l, ws_acc, *strides))
            if go_merge is not None and self.n_split > 1:
                go_merge(stream, (ws_m, ws_l, ws_acc, o, l_arg, *strides, *merge_tail))
            return o, m

        return call

    def launch(self, prob: Problem, paged: PagedKV | None, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Launch for ``prob`` (of this plan's signature: only its tensors differ from the plan's first)."""
        S = self.n_split
        split, merge = self._kernels(lse is not None)
        lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
        l_strides = lse.stride() if lse is not None else (0, 0, 0)
        ws_m, ws_l, ws_acc = self._workspace(prob, out)
        per_call = (out, lse_arg, ws_m, ws_l, ws_acc, *out.stride(), *l_strides)
        key = _layout_key(out, lse_arg, ws_m, ws_l, ws_acc)
        device = prob.device.index or 0
        with _interp.interpreter(_decode_merge_kernel) if self.interpret else contextlib.nullcontext():
            split.launch((*_tensors(prob, paged), *self.fixed, *per_call), key, device)
            if S > 1:
                merge.launch((ws_m, ws_l, ws_acc, out, lse_arg, *out.stride(), *l_strides, prob.Hq, prob.Nq,
                              prob.D, S), key, device)
