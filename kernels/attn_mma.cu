// attn_mma.cu: the tensor-core kernel. The rowmax kernel's online softmax, with both products on the tensor
// cores (mma.sync m16n8k16, float16 or bfloat16 inputs, float32 accumulators) and the tiles moved by cp.async
// into a swizzled shared-memory layout that ldmatrix reads without bank conflicts.
//
// Tiling (FlashAttention-2's split): one block per (batch*head bh, tile of BM = 128 query rows): grid
// (B*Hq, ceil(Nq / 128)), heaviest (last) query tiles first. 128 threads = 4 warps; warp w owns MB = 2 m-blocks
// of 16 rows (rows 32w .. 32w+31) for the whole kernel. K and V stream through shared memory in tiles of BN keys,
// one buffer each, overlapped as FlashAttention-2 does: the V tile travels while Q K^T runs, the next K tile
// while the softmax and P V run. DMAX (64 or 128) is the head dim the arrays are sized for; D <= DMAX is padded
// with zeros. Registers: a thread holds 4 * MB * DMAX / 8 accumulators of O and 4 * MB * BN / 8 scores, under
// the 255 a thread may have. So BN is 64 for DMAX 64 and 32 for DMAX 128 (D128: 128 + 32), except in the WIDE
// kernel, which takes FlashAttention-2's tiles, 128 keys at DMAX 64 and 64 at DMAX 128 (128 + 64): it has no
// scaling pass (below), whose registers make those tiles spill, and at DMAX 128 it loads each slice's Q
// fragments as the slice starts instead of one slice ahead. The host launches it only where that pass is not
// needed and ptxas keeps it free of spills (attnlab.backends.cuda.variant.mma_wide_ok: sm_90 with ex2.approx).
//
// Shared memory (16-bit elements, rows of DMAX elements, no padding; declared 1024-byte aligned, which holds while
// the kernel has no static shared memory: the lane addresses below assume rows start at multiples of their size):
//   q_s [BM][DMAX]    the Q tile (its fragments re-read for each 16-column slice), then the output tile
//   k_s [BN][DMAX]    the K tile, row = key
//   v_s [BN][DMAX]    the V tile, row = key
// Swizzle: a row is DMAX / 8 chunks of 16 bytes; logical chunk c of row r is stored at chunk c ^ (r % 8).
// ldmatrix has 8 lanes each read one 16-byte row of an 8 x 8 matrix, and the 8 rows of a matrix are 8
// consecutive tile rows at the same logical chunk. Unswizzled, rows DMAX * 2 bytes apart (a multiple of 128)
// would put all 8 reads in the same 4 banks (8-way conflict); XORed with r % 8 they land in 8 different
// chunks of one 128-byte line: all 32 banks, one pass. Every row a lane addresses has the same row % 8, so its
// address for 16-column slice kk is its slice-0 address XOR 32 * kk bytes (chunk ^ 2kk): one instruction per step.
//
// The tensor-core instruction, mma.sync.m16n8k16.row.col: D[16x8] += A[16x16] * B[16x8], one warp. With
// lane = 4 * g + t (g = lane / 4 the "group", t = lane % 4 the thread in the group), each thread holds
//   A (4 registers of two 16-bit values): a0 = A[g][2t, 2t+1],   a1 = A[g+8][2t, 2t+1],
//                                         a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (2 registers):                      b0 = B[2t, 2t+1][g],   b1 = B[2t+8, 2t+9][g]
//   C and D (4 floats):                   c0, c1 = C[g][2t, 2t+1],   c2, c3 = C[g+8][2t, 2t+1]
// So each thread holds the accumulators of rows g and g+8 of each of its warp's m-blocks, at columns 2t and
// 2t+1 of every 8-column block; the 4 threads of a group share those two rows.
//
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit values; lanes 8m .. 8m+7 give the row addresses of matrix m
// and every thread receives, per matrix, the two values at row g, columns 2t and 2t+1: exactly an A or B
// register. With .trans it receives rows 2t and 2t+1 of column g instead.
//   Q (A of S = Q K^T, row-major [row][d]): matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15),
//     (rows 8-15, d 8-15) are a0 .. a3 of one 16-column slice of D.
//   K (B of S = Q K^T, B[d][key] = K[key][d]): stored key-major, which is B's column-major: plain ldmatrix;
//     one x4 gives b0, b1 of two 8-key blocks.
//   V (B of O += P V, B[key][d] = V[key][d]): stored key-major = B's row-major, so ldmatrix.trans; one x4
//     gives b0, b1 of two 8-dim blocks.
// Each K or V fragment feeds both of the warp's m-blocks: one ldmatrix per 2 x 2 MMAs, and 16 (S) or 32 (P V)
// independent accumulators per 16-wide step of the reduction, which keeps the tensor pipe fed.
//
// Online softmax on the accumulator fragments (per tile, as rowmax): S arrives as float32 fragments s[mb][n][0..3]
// (m-block mb, key block n). A thread takes the max over its 2 x 2 values per key block, then over the 4 threads
// of its group with two xor shuffles (distance 1 and 2): the tile's row max, known to all four, times the scale
// once (a positive factor keeps the order). m_new = max(m_i, tile max); alpha = exp(m_i - m_new) rescales acc and
// l_i; p = exp(s * scale - m_new), one FFMA before the exp, as FlashAttention does. l_i is kept per thread (its
// own keys' share) and summed over the group once, at the end. At DMAX 128 a warp skips the rescale of acc when no
// row max of its 32 rows moved (alpha = 1 exactly, the common case once a row has met its largest scores): a
// uniform branch on a warp vote. At DMAX 64 it always rescales, so that the exponentials and P V share one block
// of code for the compiler to interleave.
// P stays in registers: the C fragments of key blocks 2k and 2k+1 are, value for value, the A fragment of the
// 16-key slice k of P V (c0 c1 of block 2k = a0, c2 c3 = a1, block 2k+1's = a2, a3), so each pair is converted to
// 16 bits (round to nearest, as the Triton kernel and FlashAttention do) and packed into one register.
// With FAST_EXP (this kernel's default: p is rounded to 16 bits right after) the softmax runs in base 2 (scores
// times log2 e, ex2.approx); else in base e with expf.
//
// Pipeline, per key tile t (two barriers, FlashAttention-2's order; one K and one V buffer):
//   (A) wait for every copy, barrier: K_t has landed and every warp is done with V_{t-1};
//       issue V_t into v_s; S = Q K_t^T (V_t travels meanwhile);
//   (B) wait for every copy, barrier: V_t has landed and every warp is done with K_t;
//       issue K_{t+1} into k_s; softmax; O += P V_t (K_{t+1} travels meanwhile).
// Masking: a wholly allowed tile goes straight to the softmax step. A partial tile (the band's edges, lengths)
// first sets the keys outside each row's range [lo, hi) to -inf (key_range of the row: two compares per score).
// With an explicit mask or bias, or a scale outside (0, 1] in the softmax's unit (the max trick above needs
// scale > 0; above 1 a score times it may overflow), a pass scales every score, adds its explicit term or -inf,
// and the step takes the result with a factor of 1. The branches are uniform, and one softmax step serves all
// three.
//
// Loads: each thread copies the same 16-byte column chunk of rows r0, r0 + R, r0 + 2R, ... of a tile (R = 128 /
// (DMAX / 8) rows apart, a multiple of 8: the same row % 8, so one swizzled offset), by 16-byte cp.async.cg
// copies (no registers on the way) when the host says the rows allow it (args.async_copy: D a multiple of 8, unit
// stride on D, 16-byte aligned rows): a tile's copies are one address and a row step per thread. Else element
// by element (any strides), same layout. Rows past the tensor and dims past D are zero.
//
// Stores (FlashAttention-2's epilogue): a thread's accumulators are two neighbouring columns of a row in each
// 8-column block, so stored from registers every warp instruction would scatter over 8 rows. Instead each warp
// writes its normalized rows, two columns to a 32-bit word, into its own rows of q_s (only it ever reads them, and
// no copy targets q_s after the key loop), then copies them out 16 bytes per lane, whole rows per instruction
// (store_rows). A chunk that is not whole inside D or not 16-byte aligned goes out as 32-bit pairs, so the output
// must have unit stride on D, 4-byte aligned rows and room for column D when D is odd (that column gets V's zero
// padding). The host passes a staging buffer where the output is not so (attnlab.backends.cuda.variant.
// pair_stores_ok) and copies from it.
//
// Masking, lengths, windows, GQA, lse: as in the other kernels (attn_mask.cuh, attn_softmax.cuh). Key tiles run
// over the block's structural range [lo, hi) only (causal and window tiles are skipped by construction).
//
// Parameters: one `struct AttnParams` (attn_params.cuh), as for every kernel of attnlab. Needs sm_80 (cp.async,
// ldmatrix, bfloat16 MMA).

#include "attn_dtype.cuh"
#include "attn_mask.cuh"
#include "attn_params.cuh"
#include "attn_softmax.cuh"

// ---- tile shapes -------------------------------------------------------------------------------------

template <int DMAX, bool WIDE = false>
struct MmaTiles {
    static constexpr int WARPS = 4;
    static constexpr int MB = 2;                  // 16-row m-blocks per warp (FlashAttention-2's 32 rows)
    static constexpr int BM = 16 * MB * WARPS;    // query rows per block (128)
    // keys per K/V tile (the registers' limit, see the header): FlashAttention-2's tiles in the wide kernel
    static constexpr int BN = WIDE ? (DMAX <= 64 ? 128 : 64) : (DMAX <= 64 ? 64 : 32);
    static constexpr int NTHREADS = 32 * WARPS;
    static constexpr int CHUNKS = DMAX / 8;       // 16-byte chunks per row
    static constexpr int ROW_STEP = NTHREADS / CHUNKS;  // rows between a thread's chunks in a tile (8 or 16)
    static constexpr int KN = BN / 8;             // 8-key blocks of S
    static constexpr int DN = DMAX / 8;           // 8-dim blocks of O
    static constexpr int DK = DMAX / 16;          // 16-dim slices of Q K^T
    static_assert(ROW_STEP % 8 == 0, "a thread's rows share row % 8 (one swizzled offset)");
};

// ---- shared memory: the swizzled address of (row, 8-element chunk) --------------------------------------

template <int DMAX>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * DMAX + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ unsigned int shared_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// ---- cp.async (sm_80+) ---------------------------------------------------------------------------------

// 16 bytes from global `src` to shared `dst`; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void copy_16(unsigned short* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void copies_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void copies_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// ---- ldmatrix and mma ------------------------------------------------------------------------------------

// `address`: a shared-memory address (shared_address), this lane's row of its matrix.
__device__ __forceinline__ void ldmatrix_x4(unsigned int r[4], unsigned int address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int r[4], unsigned int address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// d += a * b for one m16n8k16 tile (DTYPE 1: float16, 2: bfloat16), float32 accumulators.
template <int DTYPE>
__device__ __forceinline__ void mma_16816(float d[4], const unsigned int a[4], unsigned int b0, unsigned int b1) {
    if constexpr (DTYPE == 1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two float32 values rounded to 16 bits and packed: lo in the low half (the lower column), as ldmatrix packs.
template <int DTYPE>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int r;
    if constexpr (DTYPE == 1) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// ---- the exponential's unit ----------------------------------------------------------------------------

// With FAST_EXP the scores are kept in base 2 (multiplied by log2 e once, with the scale) and exponentiated by
// the hardware's ex2.approx, which is all __expf does after its own multiply; without it, in base e by expf.
template <bool FAST_EXP>
__device__ __forceinline__ float unit_exp(float x) {
    if constexpr (FAST_EXP) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
        return y;
    } else {
        return expf(x);
    }
}

// Scores per nat in that unit: log2 e in base 2, 1 in base e.
template <bool FAST_EXP>
__device__ __forceinline__ float units_per_nat() {
    return FAST_EXP ? 1.4426950408889634f : 1.0f;
}

// ---- tile loads ----------------------------------------------------------------------------------------

// Where this thread's chunks of a tile go and come from: its column chunk c (fixed), its first row r0, the
// swizzled shared offset of (r0, c) in elements (rows r0 + k * ROW_STEP keep it: the same row % 8), and
// whether the chunk holds dims below D.
template <int DMAX>
struct ChunkSlot {
    int r0, c, smem;
    bool in_d;
    __device__ __forceinline__ ChunkSlot(int D) {
        using T = MmaTiles<DMAX>;
        r0 = threadIdx.x / T::CHUNKS;
        c = threadIdx.x % T::CHUNKS;
        smem = swizzled<DMAX>(r0, c);
        in_d = c * 8 < D;
    }
};

// Rows [0, ROWS) of a tile: tensor rows first + r (r < n_rows; rows past it are zero), all DMAX dims (zero
// past D), into the swizzled `dst`. `base`: the tensor's offset of (b, head, row 0, dim 0); `s`: its strides.
template <int DMAX, int ROWS>
__device__ __forceinline__ void load_tile(const AttnParams& args, const ChunkSlot<DMAX>& slot, const void* tensor,
                                          long long base, const Strides4& s, int first, int n_rows,
                                          unsigned short* dst)
{
    using T = MmaTiles<DMAX>;
    const unsigned short* src = static_cast<const unsigned short*>(tensor);
    if (args.async_copy) {  // unit stride on D, D % 8 == 0: a chunk is wholly in or out
        const unsigned short* from = src + base + (long long)(first + slot.r0) * s.n + slot.c * 8;
#pragma unroll
        for (int k = 0; k < ROWS / T::ROW_STEP; ++k) {
            const bool in = slot.in_d && slot.r0 + k * T::ROW_STEP < n_rows;
            copy_16(dst + slot.smem + k * T::ROW_STEP * DMAX, in ? from + (long long)k * T::ROW_STEP * s.n : src,
                    in ? 16 : 0);
        }
    } else {
#pragma unroll 1
        for (int k = 0; k < ROWS / T::ROW_STEP; ++k) {
            const int r = slot.r0 + k * T::ROW_STEP;
            const long long row_off = base + (long long)(first + r) * s.n;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int d = slot.c * 8 + e;
                dst[slot.smem + k * T::ROW_STEP * DMAX + e] =
                    r < n_rows && d < args.D ? __ldg(src + row_off + (long long)d * s.d) : (unsigned short)0;
            }
        }
    }
}

// ---- one key tile ---------------------------------------------------------------------------------------

// What a warp carries through the key tiles: its rows' online-softmax state and output accumulators, and where
// its lanes' ldmatrix reads start.
template <int DMAX>
struct WarpState {
    float m_i[MmaTiles<DMAX>::MB][2], l_i[MmaTiles<DMAX>::MB][2];  // l_i: this thread's share (its keys)
    float acc[MmaTiles<DMAX>::MB][MmaTiles<DMAX>::DN][4];
};

// S = Q K^T for the tile in k_s: s[mb][n] is the 16 x 8 block of m-block mb and keys 8n .. 8n+7. Steps (16-dim
// slice kk, key pair n2): each K fragment feeds both m-blocks; K fragments are loaded two steps ahead (a ring of
// 3) and, with Q_AHEAD, each slice's Q fragments one slice ahead, so that no MMA waits on the ldmatrix just
// issued. Without it (where the registers run out) a slice's Q fragments are loaded as the slice starts.
template <int DTYPE, int DMAX, bool Q_AHEAD, int KN>
__device__ __forceinline__ void scores(float (&s)[MmaTiles<DMAX>::MB][KN][4], unsigned int q_lane,
                                       unsigned int k_lane)
{
    using T = MmaTiles<DMAX>;
    constexpr int MB = T::MB, DK = T::DK;
    constexpr unsigned int ROW_BYTES = DMAX * 2;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int n = 0; n < KN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mb][n][e] = 0.0f;
    constexpr int STEPS = DK * (KN / 2);
    // Q matrices 0..3 of slice kk, m-block mb: rows 0-7, rows 8-15 (dims 0-7), then the same rows at dims 8-15
    auto q_frag = [&](unsigned int r[4], int kk, int mb) { ldmatrix_x4(r, (q_lane ^ (kk << 5)) + 16 * mb * ROW_BYTES); };
    // K matrices 0..3 of step st: dims 0-7, dims 8-15 (keys 0-7 of the pair), then the same dims at keys 8-15
    auto k_frag = [&](unsigned int r[4], int st) {
        const int kk = st / (KN / 2), n2 = st % (KN / 2);
        ldmatrix_x4(r, (k_lane ^ (kk << 5)) + 16 * n2 * ROW_BYTES);
    };
    unsigned int qa[Q_AHEAD ? 2 : 1][MB][4], kb[3][4];
    if constexpr (Q_AHEAD) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) q_frag(qa[0][mb], 0, mb);
    }
    k_frag(kb[0], 0);
    k_frag(kb[1], 1);
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
        const int kk = st / (KN / 2), n2 = st % (KN / 2);
        const int qs = Q_AHEAD ? kk % 2 : 0;  // where this slice's Q fragments are
        if constexpr (Q_AHEAD) {
            if (n2 == 0 && kk + 1 < DK) {
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) q_frag(qa[(kk + 1) % 2][mb], kk + 1, mb);
            }
        } else if (n2 == 0) {
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) q_frag(qa[0][mb], kk, mb);
        }
        if (st + 2 < STEPS) k_frag(kb[(st + 2) % 3], st + 2);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
            mma_16816<DTYPE>(s[mb][2 * n2], qa[qs][mb], kb[st % 3][0], kb[st % 3][1]);
            mma_16816<DTYPE>(s[mb][2 * n2 + 1], qa[qs][mb], kb[st % 3][2], kb[st % 3][3]);
        }
    }
}

// The masking passes, on the S fragments before the softmax step, for the tiles that need one (uniform branches
// in the kernel). Row i = row0 + 16 mb + g + 8r holds values 2r, 2r+1 of each key block n, keys j0 + 8n + 2t + e.

// Row i's allowed keys [lo, hi) (key_range of the row) shifted to this thread's first key of the tile, j0 + 2t, so
// that its value e of key block n (key j0 + 8n + 2t + e) is allowed iff lo <= 8n + e < hi: two compares with
// constants.
__device__ __forceinline__ void thread_key_range(const RowRule& rule, int i, int j0, int t, int* lo, int* hi) {
    key_range(rule, i, i + 1, lo, hi);
    *lo -= j0 + 2 * t;
    *hi -= j0 + 2 * t;
}

// Keys outside each row's allowed range become -inf; the scores stay raw.
template <int DMAX, int KN>
__device__ __forceinline__ void mask_structure(float (&s)[MmaTiles<DMAX>::MB][KN][4],
                                               const RowRule& rule, int row0, int j0)
{
    using T = MmaTiles<DMAX>;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mb = 0; mb < T::MB; ++mb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int lo, hi;
            thread_key_range(rule, row0 + 16 * mb + g + 8 * r, j0, t, &lo, &hi);
#pragma unroll
            for (int n = 0; n < KN; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (!(8 * n + e >= lo && 8 * n + e < hi)) s[mb][n][2 * r + e] = NEG_INF;
        }
}

// With an explicit mask or bias, or a scale outside (0, 1] in the softmax's unit (not positive: the max trick
// fails; above 1: a finite score times it may overflow, which the FFMA form would hide): every score scaled and
// given its explicit term, or -inf outside the row's range. The step then takes them as they are.
template <int DMAX, int KN>
__device__ __forceinline__ void scale_and_mask(float (&s)[MmaTiles<DMAX>::MB][KN][4],
                                               const AttnParams& args, const RowRule& rule, int b, int h, int row0,
                                               int j0, float scale_u, float units)
{
    using T = MmaTiles<DMAX>;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mb = 0; mb < T::MB; ++mb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = row0 + 16 * mb + g + 8 * r;
            int lo, hi;
            thread_key_range(rule, i, j0, t, &lo, &hi);
#pragma unroll
            for (int n = 0; n < KN; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = 8 * n + e;
                    const float x = s[mb][n][2 * r + e] * scale_u;
                    s[mb][n][2 * r + e] =
                        c >= lo && c < hi ? x + units * explicit_term(args, b, h, i, j0 + 2 * t + c) : NEG_INF;
                }
        }
}

// The softmax step of one tile on the fragments, scores s * mul (mul > 0: the scale in the softmax's unit for
// raw scores, 1 for scores the pass above scaled). The row max is taken over s and multiplied once (mul > 0
// keeps the order; -inf stays -inf), the exponent is one FFMA, s * mul - m_new. Updates m_i and l_i, rescales
// acc, and leaves p in s.
template <int DMAX, bool FAST_EXP, int KN>
__device__ __forceinline__ void softmax_step(WarpState<DMAX>& w, float (&s)[MmaTiles<DMAX>::MB][KN][4],
                                             float mul)
{
    using T = MmaTiles<DMAX>;
    float alpha[T::MB][2];
    bool moved = false;  // whether some row max of this thread's rows moved (alpha != 1)
#pragma unroll
    for (int mb = 0; mb < T::MB; ++mb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // row g (values 0, 1 of each block), row g + 8 (values 2, 3)
            float tile_max = NEG_INF;
#pragma unroll
            for (int n = 0; n < KN; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) tile_max = fmaxf(tile_max, s[mb][n][2 * r + e]);
            tile_max = group_max(tile_max * mul, 4);  // the 4 threads of the group hold the row
            const float m_new = fmaxf(w.m_i[mb][r], tile_max);
            const float m_use = safe_max(m_new);
            alpha[mb][r] = unit_exp<FAST_EXP>(w.m_i[mb][r] - m_use);
            // (A row whose max is still -inf holds acc = 0, or NaN from 0 times a non-finite value: its alpha of 0
            // would leave either as it is, so it need not force the rescale.)
            moved |= alpha[mb][r] != 1.0f && w.m_i[mb][r] != NEG_INF;
            float row_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < KN; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = unit_exp<FAST_EXP>(fmaf(s[mb][n][2 * r + e], mul, -m_use));
                    s[mb][n][2 * r + e] = p;
                    row_sum += p;
                }
            w.l_i[mb][r] = w.l_i[mb][r] * alpha[mb][r] + row_sum;
            w.m_i[mb][r] = m_new;
        }
    // Rescaling by exactly 1 changes nothing. At DMAX 128 the warp skips it when no row max of its 32 rows moved
    // (the common case once a row has met its largest scores), a uniform branch on a warp vote: without it ptxas
    // spills the wide kernel. At DMAX 64 it always rescales: the branch would end the block of code in which
    // ptxas overlaps this tile's exponentials with its P V products.
    if (DMAX == 64 || __any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mb = 0; mb < T::MB; ++mb)
#pragma unroll
            for (int n = 0; n < T::DN; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) w.acc[mb][n][e] *= alpha[mb][e / 2];
    }
}

// O += P V for the tile in v_s, P's A fragments straight from the S fragments. Steps (16-key slice kk, dim pair
// n2), V fragments two steps ahead as for K, each feeding both m-blocks.
template <int DTYPE, int DMAX, int KN>
__device__ __forceinline__ void accumulate(WarpState<DMAX>& w, const float (&s)[MmaTiles<DMAX>::MB][KN][4],
                                           unsigned int v_lane)
{
    using T = MmaTiles<DMAX>;
    constexpr int MB = T::MB, DN = T::DN;
    constexpr unsigned int ROW_BYTES = DMAX * 2;
    unsigned int p_frag[MB][KN / 2][4];  // keys 16kk .. 16kk+15
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int kk = 0; kk < KN / 2; ++kk) {
            p_frag[mb][kk][0] = pack2<DTYPE>(s[mb][2 * kk][0], s[mb][2 * kk][1]);
            p_frag[mb][kk][1] = pack2<DTYPE>(s[mb][2 * kk][2], s[mb][2 * kk][3]);
            p_frag[mb][kk][2] = pack2<DTYPE>(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
            p_frag[mb][kk][3] = pack2<DTYPE>(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
        }
    constexpr int STEPS = (KN / 2) * (DN / 2);
    // V matrices 0..3 of step st, transposed: keys 0-7, keys 8-15 (dims 0-7 of the pair), then the same keys at
    // dims 8-15
    auto v_frag = [&](unsigned int r[4], int st) {
        const int kk = st / (DN / 2), n2 = st % (DN / 2);
        ldmatrix_x4_trans(r, (v_lane ^ (n2 << 5)) + 16 * kk * ROW_BYTES);
    };
    unsigned int vb[3][4];
    v_frag(vb[0], 0);
    v_frag(vb[1], 1);
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
        if (st + 2 < STEPS) v_frag(vb[(st + 2) % 3], st + 2);
        const int kk = st / (DN / 2), n2 = st % (DN / 2);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
            mma_16816<DTYPE>(w.acc[mb][2 * n2], p_frag[mb][kk], vb[st % 3][0], vb[st % 3][1]);
            mma_16816<DTYPE>(w.acc[mb][2 * n2 + 1], p_frag[mb][kk], vb[st % 3][2], vb[st % 3][3]);
        }
    }
}

// ---- the epilogue's stores ------------------------------------------------------------------------------

// Copy the warp's rows [warp_row, warp_row + 16 MB) of the finished tile (rows of the tile, not of the tensor;
// 16-bit values in the swizzled layout of q_s) to the output rows i0 + row: one 16-byte chunk per lane per step,
// CHUNKS lanes to a row, so a warp's store instruction writes whole rows. A chunk that is not whole inside D or not
// 16-byte aligned goes out as 32-bit pairs (the host's rule for the output: unit stride on D, 4-byte aligned rows,
// room for column D when D is odd). Called by one warp for the rows only it wrote.
template <int DMAX>
__device__ __forceinline__ void store_rows(const AttnParams& args, const unsigned short* tile, int warp_row,
                                           int b, int h, int i0)
{
    using T = MmaTiles<DMAX>;
    const int lane = threadIdx.x % 32, c = lane % T::CHUNKS;
    constexpr int ROWS_PER_STEP = 32 / T::CHUNKS;  // 4 rows of 8 chunks (DMAX 64) or 2 rows of 16 (DMAX 128)
    if (c * 8 >= args.D) return;                   // the zero padding past D
#pragma unroll
    for (int k = lane / T::CHUNKS; k < 16 * T::MB; k += ROWS_PER_STEP) {
        const int row = warp_row + k, i = i0 + row;
        if (i >= args.Nq) break;
        const uint4 chunk = *reinterpret_cast<const uint4*>(tile + swizzled<DMAX>(row, c));
        unsigned short* at = static_cast<unsigned short*>(args.out) + offset4(args.os, b, h, i, c * 8);
        if (c * 8 + 8 <= args.D && (reinterpret_cast<unsigned long long>(at) & 15) == 0) {
            *reinterpret_cast<uint4*>(at) = chunk;
        } else {
            const unsigned int pairs[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
            for (int p = 0; p < 4; ++p)
                if (c * 8 + 2 * p < args.D) *reinterpret_cast<unsigned int*>(at + 2 * p) = pairs[p];
        }
    }
}

// ---- the kernel ----------------------------------------------------------------------------------------

template <int DTYPE, int DMAX, bool FAST_EXP, bool WIDE>
__global__ void __launch_bounds__(128) attn_mma(const __grid_constant__ AttnParams args)
{
    static_assert(DTYPE == 1 || DTYPE == 2, "the tensor-core kernel takes float16 or bfloat16");
    static_assert(DMAX == 64 || DMAX == 128, "head dims 64 and 128");
    using T = MmaTiles<DMAX, WIDE>;
    constexpr bool Q_AHEAD = !(WIDE && DMAX == 128);  // the wide D 128 kernel's registers: see scores
    constexpr int BM = T::BM, BN = T::BN, MB = T::MB, DN = T::DN;

    extern __shared__ __align__(1024) unsigned short smem_mma[];  // rows at multiples of ROW_BYTES (header)
    unsigned short* q_s = smem_mma;         // [BM][DMAX]
    unsigned short* k_s = q_s + BM * DMAX;  // [BN][DMAX]
    unsigned short* v_s = k_s + BN * DMAX;  // [BN][DMAX]

    const int b = blockIdx.x / args.Hq;
    const int h = blockIdx.x % args.Hq;
    const int hk = h / args.group;
    const int i0 = (gridDim.y - 1 - blockIdx.y) * BM;  // heaviest (last) query tiles first
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int row0 = i0 + warp * 16 * MB;  // the warp's first row; m-block mb starts 16 mb rows later
    const int mat = lane / 8, mrow = lane % 8;  // the ldmatrix matrix this lane addresses, and its row in it
    // This lane's ldmatrix addresses of the first step, in bytes of shared memory. Every row the lane addresses
    // has row % 8 = mrow, so a later step's swizzled chunk is the first one XOR 2 * (its 16-column slice), and its
    // rows 16 rows further on add a whole number of rows: address = (first ^ (slice << 5)) + rows * ROW_BYTES
    // (rows start at multiples of ROW_BYTES, 128 or 256, and 32 * kk < ROW_BYTES, so the XOR stays inside the
    // row). See the header: which matrix (mat) covers which rows and columns.
    const unsigned int q_lane = shared_address(q_s + swizzled<DMAX>(warp * 16 * MB + mrow + 8 * (mat & 1), mat >> 1));
    const unsigned int k_lane = shared_address(k_s + swizzled<DMAX>(mrow + 8 * (mat >> 1), mat & 1));
    const unsigned int v_lane = shared_address(v_s + swizzled<DMAX>(mrow + 8 * (mat & 1), mat >> 1));
    const ChunkSlot<DMAX> slot(args.D);

    const RowRule rule = row_rule(args, b);
    int lo, hi;
    key_range(rule, i0, i0 + BM, &lo, &hi);
    const int n_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;

    const long long q_base = offset4(args.qs, b, h, 0, 0);
    const long long k_base = offset4(args.ks, b, hk, 0, 0);
    const long long v_base = offset4(args.vs, b, hk, 0, 0);

    // Q and K_0 on their way at once (one group). A block with no key tile reads nothing.
    if (n_tiles > 0) {
        load_tile<DMAX, BM>(args, slot, args.q, q_base, args.qs, i0, min(BM, args.Nq - i0), q_s);
        load_tile<DMAX, BN>(args, slot, args.k, k_base, args.ks, lo, min(BN, hi - lo), k_s);
    }
    copies_commit();

    WarpState<DMAX> w;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
        w.m_i[mb][0] = w.m_i[mb][1] = NEG_INF;
        w.l_i[mb][0] = w.l_i[mb][1] = 0.0f;
#pragma unroll
        for (int n = 0; n < DN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) w.acc[mb][n][e] = 0.0f;
    }
    const float units = units_per_nat<FAST_EXP>();  // m_i, l_i and the scores are in this unit
    const float scale_u = args.scale * units;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int j0 = lo + tile * BN;
        copies_wait_all();
        __syncthreads();  // (A) K_tile in k_s (and Q); every warp done with V_{tile-1}
        load_tile<DMAX, BN>(args, slot, args.v, v_base, args.vs, j0, min(BN, hi - j0), v_s);
        copies_commit();
        float s[MB][T::KN][4];
        scores<DTYPE, DMAX, Q_AHEAD>(s, q_lane, k_lane);
        copies_wait_all();
        __syncthreads();  // (B) V_tile in v_s; every warp done with K_tile
        if (tile + 1 < n_tiles) {
            load_tile<DMAX, BN>(args, slot, args.k, k_base, args.ks, j0 + BN, min(BN, hi - j0 - BN), k_s);
        }
        copies_commit();
        // A masking pass only where the tile needs one (uniform branches), then the one softmax step. The wide
        // kernel has no scaling pass: the host launches it only without an explicit term and with 0 < scale_u <= 1.
        float mul = scale_u;
        if (!WIDE && (args.mask_kind != 0 || !(scale_u > 0.0f && scale_u <= 1.0f))) {
            scale_and_mask<DMAX>(s, args, rule, b, h, row0, j0, scale_u, units);
            mul = 1.0f;
        } else if (!tile_fully_allowed(rule, i0, i0 + BM, j0, j0 + BN)) {
            mask_structure<DMAX>(s, rule, row0, j0);
        }
        softmax_step<DMAX, FAST_EXP>(w, s, mul);
        accumulate<DTYPE, DMAX>(w, s, v_lane);
    }

    // ---- epilogue: the row sums over the group, normalize into q_s, store (empty rows: 0 and lse = -inf) ------
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp * 16 * MB + 16 * mb + g + 8 * r;  // in the tile (and in q_s)
            const float l = group_sum(w.l_i[mb][r], 4);
            const float inv_l = row_inv_l(l);
#pragma unroll
            for (int n = 0; n < DN; ++n)
                *reinterpret_cast<unsigned int*>(q_s + swizzled<DMAX>(row, n) + 2 * t) =
                    pack2<DTYPE>(w.acc[mb][n][2 * r] * inv_l, w.acc[mb][n][2 * r + 1] * inv_l);
            if (t == 0 && args.lse != nullptr && i0 + row < args.Nq)
                store_lse(args, b, h, i0 + row, row_lse(w.m_i[mb][r] / units, l));
        }
    __syncwarp();
    store_rows<DMAX>(args, q_s, warp * 16 * MB, b, h, i0);
}

// ---- explicit instantiation for nvcc (NVRTC instantiates by name expression instead) -------------------
#ifndef __CUDACC_RTC__
template __global__ void attn_mma<1, 64, false, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<1, 64, true, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<1, 64, true, true>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<1, 128, false, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<1, 128, true, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<1, 128, true, true>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 64, false, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 64, true, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 64, true, true>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 128, false, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 128, true, false>(const __grid_constant__ AttnParams);
template __global__ void attn_mma<2, 128, true, true>(const __grid_constant__ AttnParams);
#endif
