// attn_rowmax.cu: the rowmax kernel. As the tiled kernel, but the softmax is updated once per K tile:
// each tile's scores are reduced to a row max first, so every score costs exactly one exp, and the
// products QK^T and PV are computed as small register tiles (outer products) instead of dot products.
//
// Tiling: one block per (batch*head bh, tile of BM = 64 query rows, key split z): grid
// (B*Hq, ceil(Nq / 64), splits), 256 threads seen as a 16 x 16 grid (ty = tid / 16, tx = tid % 16).
// K and V stream through shared memory in tiles of BN keys (64 for D <= 64, else 32). Query tiles are
// visited heaviest first (the last tile of a causal problem has the most keys), which evens out the tail.
//
// Shared memory (float32; every row is padded by 4 floats = 16 bytes, LD = DMAX + 4, so that 16-byte
// reads of 8 consecutive rows hit 8 different groups of 4 banks):
//   q_s [BM][LD]             the Q tile, pre-scaled: q_s[r][d] = scale * q[i0 + r][d]
//   k_s [STAGES][BN][LD]     K tiles as they are in memory (row = key)
//   v_s [STAGES][BN][LD]     V tiles likewise
//   p_t [BN][BM+4]           the probabilities of the tile, transposed: p_t[c][r] = p[r][c]
// STAGES = 2 (double buffering) for D <= 128; 1 for D = 256, where two stages would not fit sm_80.
//
// Thread mapping, register micro-tiles:
//   S = Q K^T: thread (ty, tx) computes the 4 x TN block s[r][c] for rows ty*4 + r and keys c*16 + tx
//     (TN = BN / 16; keys strided by 16 so that the 16 threads of a row read 16 consecutive K rows, which
//     the padding spreads over all banks). Per 4 head dims it reads 4 q float4s (the two rows of a warp
//     are broadcasts) and TN k float4s, and does 16*TN FMAs. For DMAX = 64 the 16 steps are unrolled
//     (all 64 dims, the padding being zero), so the loads of later steps overlap earlier FMAs.
//   softmax: the 16 threads of a row (same ty) hold its BN scores. Per row: tile max over the thread's
//     TN scores, then 4 xor shuffles over the 16 threads; m_new = max(m_i, tile max);
//     alpha = exp(m_i - m_new) rescales l_i and acc once per tile; p = exp(s - m_new), one exp per score.
//     l_i is kept per thread (its own keys' sum) and summed over the 16 threads only at the end.
//   O += P V: thread (ty, tx) owns the 4 x DPT block acc[r][e] of rows ty*4 + r and dims
//     d = 64*kk + tx*4 + e' (DPT = DMAX / 16). For each key c it reads 4 p's (16 bytes) and DPT v's
//     (16-byte loads) and does 4*DPT FMAs.
//
// Pipeline, two barriers per tile (D <= 128): (A) tile t has landed and every thread is done with tile
// t - 1; then tile t + 1 is issued into the stage tile t - 1 used, and tile t is computed; (B) p_t is
// complete, then O += P V. Barrier A of tile t + 1 also protects p_t and the stage from being overwritten
// while still read. With one stage (D = 256), tile t + 1 is issued after a third barrier, once t is consumed.
//
// Parameters: one `struct AttnParams` (attn_params.cuh), as for every kernel of attnlab.
//
// K/V tile loads, two paths chosen by the host (field async_copy):
//   cp.async (float32 inputs with stride_d = 1, D % 4 == 0, 16-byte aligned rows): every thread issues
//     16-byte cp.async.cg copies global -> shared (no registers, no conversion; rows past the tile's keys
//     and dims past D are zero-filled by a source size of 0). Tile t+1 is issued before tile t is
//     computed, so its latency hides behind the arithmetic.
//   element loads (any dtype, any strides): load_elem, convert to float32, store; same layout, same
//     pipeline order (still issued one tile ahead, but the loads block the issuing thread).
//
// Split keys (small grids): when B*Hq*ceil(Nq/64) blocks cannot fill the GPU, the host launches `splits`
// blocks per query tile; split z handles key tiles [z*split_tiles, (z+1)*split_tiles) of the block's key
// range and writes its unnormalized state (m_i, l_i, acc) to a float32 workspace instead of the output.
// attn_rowmax_merge then combines the states of each row (the merge rule of online softmax, notebook 04):
//   m = max_z m_z;  l = sum_z l_z exp(m_z - m);  out = sum_z acc_z exp(m_z - m) / l;  lse = m + log l.
//
// Registers: __launch_bounds__(256, 2) for D <= 128 caps a thread at 128 registers so that two blocks
// (16 warps) share a multiprocessor; D = 256 runs one block per SM and is given the registers instead
// (no spills either way: python -m attnlab compile-check).
//
// Masking: as in the tiled kernel. Key tiles run over the block's structural range [lo, hi) only; the
// per-element predicate is evaluated only in tiles that are not entirely allowed by structure or when an
// explicit mask/bias is present. A masked score is -inf, so its p is exp(-inf) = 0 (keys past the tile's
// end are zero in shared memory and masked by structure). A row whose tile holds no allowed key keeps
// m_i = -inf and is protected by safe_max.
//
// How this kernel got here, step by step with the measured figures: data/notes/rowmax_ladder.md.

#include "attn_dtype.cuh"
#include "attn_mask.cuh"
#include "attn_params.cuh"
#include "attn_softmax.cuh"

// ---- cp.async (sm_80+): 16-byte global -> shared copies that complete asynchronously -------------------

// Copy 16 bytes from global `src` to shared `dst`; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, int src_bytes) {
    const unsigned int dst_shared = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src), "r"(src_bytes)
                 : "memory");
}

// Close the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most `PENDING` committed groups are still in flight (the newest ones).
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// ---- tile shapes -------------------------------------------------------------------------------------

template <int DMAX>
struct RowmaxTiles {
    static constexpr int BM = 64;
    static constexpr int BN = DMAX <= 64 ? 64 : 32;
    static constexpr int TM = 4;             // rows per thread
    static constexpr int TN = BN / 16;       // keys per thread
    static constexpr int DPT = DMAX / 16;    // output dims per thread
    static constexpr int NTHREADS = 256;
    static constexpr int STAGES = DMAX <= 128 ? 2 : 1;
    static constexpr int LD = DMAX + 4;      // row length (leading dim) of q_s, k_s, v_s
    static constexpr int P_LD = BM + 4;      // row length of p_t
};

// Load the K and V rows of keys j0 .. j0 + n_keys - 1 into k_s, v_s ([BN][LD]); zero elsewhere (dims D ..
// DMAX - 1 too, so that the products may run over all DMAX dims).
template <int DTYPE, int DMAX>
__device__ __forceinline__ void load_kv_tile(const AttnParams& args, long long k_base, long long v_base, int j0,
                                             int n_keys, float* k_s, float* v_s)
{
    using T = RowmaxTiles<DMAX>;
    if (args.async_copy) {
        // 16-byte chunks: thread t copies chunk column t % CHUNKS (dims 4*that .. +3) of every
        // ROWS_PER_PASS-th row from t / CHUNKS on. Consecutive threads copy consecutive 16 bytes of a row.
        constexpr int CHUNKS = DMAX / 4;
        constexpr int ROWS_PER_PASS = T::NTHREADS / CHUNKS;
        const int d = (threadIdx.x % CHUNKS) * 4;
        const float* kf = static_cast<const float*>(args.k);
        const float* vf = static_cast<const float*>(args.v);
#pragma unroll
        for (int c = threadIdx.x / CHUNKS; c < T::BN; c += ROWS_PER_PASS) {
            const bool in = c < n_keys && d < args.D;
            const long long j = j0 + c;
            // Out of range: copy nothing (zero fill) from a valid address.
            const float* k_src = in ? kf + k_base + j * args.ks.n + d : kf;
            const float* v_src = in ? vf + v_base + j * args.vs.n + d : vf;
            cp_async_16(&k_s[c * T::LD + d], k_src, in ? 16 : 0);
            cp_async_16(&v_s[c * T::LD + d], v_src, in ? 16 : 0);
        }
    } else {
        // One element per thread and row: thread t handles dim t % DMAX of every ROWS_PER_PASS-th row.
        constexpr int ROWS_PER_PASS = T::NTHREADS / DMAX;
        const int d = threadIdx.x % DMAX;
        const bool d_in = d < args.D;
        for (int c = threadIdx.x / DMAX; c < T::BN; c += ROWS_PER_PASS) {
            const bool in = d_in && c < n_keys;
            const long long j = j0 + c;
            k_s[c * T::LD + d] = in ? load_elem<DTYPE>(args.k, k_base + j * args.ks.n + d * args.ks.d) : 0.0f;
            v_s[c * T::LD + d] = in ? load_elem<DTYPE>(args.v, v_base + j * args.vs.n + d * args.vs.d) : 0.0f;
        }
    }
}

template <int DTYPE, int DMAX, bool FAST_EXP>
__global__ void __launch_bounds__(256, DMAX <= 128 ? 2 : 1) attn_rowmax(const __grid_constant__ AttnParams args)
{
    using T = RowmaxTiles<DMAX>;
    static_assert(T::TM == 4, "the 16-byte loads and stores of q_s and p_t hold 4 rows");
    static_assert(T::NTHREADS % DMAX == 0 && T::NTHREADS % (DMAX / 4) == 0, "whole rows per load pass");
    constexpr int BM = T::BM, BN = T::BN, TM = T::TM, TN = T::TN, DPT = T::DPT, LD = T::LD;
    constexpr int STAGES = T::STAGES;
    const int Nq = args.Nq, D = args.D;

    extern __shared__ __align__(16) float smem[];
    float* q_s = smem;                          // [BM][LD]
    float* k_s = q_s + BM * LD;                 // [STAGES][BN][LD]
    float* v_s = k_s + STAGES * BN * LD;        // [STAGES][BN][LD]
    float* p_t = v_s + STAGES * BN * LD;        // [BN][P_LD]

    const int b = blockIdx.x / args.Hq;
    const int h = blockIdx.x % args.Hq;
    const int hk = h / args.group;
    const int i0 = (gridDim.y - 1 - blockIdx.y) * BM;  // heaviest (last) query tiles first
    const int tx = threadIdx.x % 16;
    const int ty = threadIdx.x / 16;

    // This block's keys: its split's share of the query tile's structural range [lo, hi), in whole tiles.
    const RowRule rule = row_rule(args, b);
    int lo, hi;
    key_range(rule, i0, i0 + BM, &lo, &hi);
    const int range_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;
    const int t_begin = min(range_tiles, (int)blockIdx.z * args.split_tiles);
    const int t_end = min(range_tiles, t_begin + args.split_tiles);
    const int n_tiles = t_end - t_begin;
    const int j_begin = lo + t_begin * BN;

    const long long k_base = offset4(args.ks, b, hk, 0, 0);
    const long long v_base = offset4(args.vs, b, hk, 0, 0);

    // Issue the copies of tile t into stage t % STAGES, as one cp.async group (empty past the last tile, so
    // that every wait below counts the same groups).
    auto issue_tile = [&](int t) {
        if (t < n_tiles) {
            const int j0 = j_begin + t * BN;
            const int stage = t % STAGES;
            load_kv_tile<DTYPE, DMAX>(args, k_base, v_base, j0, min(BN, hi - j0), k_s + stage * BN * LD,
                                      v_s + stage * BN * LD);
        }
        cp_async_commit();
    };
    issue_tile(0);  // on its way before Q is loaded (the copies run meanwhile)

    // Load the Q tile scaled; zero outside [0, Nq) x [0, D). Consecutive threads read consecutive d. A block
    // with no key tile (all rows padding, i0 >= Lq, among them) reads nothing: no Q here, no K or V above.
    {
        const int d = threadIdx.x % DMAX;
        const long long q_base = offset4(args.qs, b, h, 0, d);
        for (int r = threadIdx.x / DMAX; r < BM; r += T::NTHREADS / DMAX) {
            const bool in = n_tiles > 0 && d < D && i0 + r < Nq;
            const long long o = q_base + (long long)(i0 + r) * args.qs.n;
            q_s[r * LD + d] = in ? args.scale * load_elem<DTYPE>(args.q, o) : 0.0f;
        }
    }

    float m_i[TM], l_i[TM], acc[TM][DPT];
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        m_i[r] = NEG_INF;
        l_i[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPT; ++e) acc[r][e] = 0.0f;
    }
    const int d_end = (D + 3) / 4 * 4;  // head dims present (q_s and k_s are zero from D to DMAX)
    // This thread's corner of each shared array, so that the inner loops address by constant offsets.
    const float* q_row = q_s + ty * TM * LD;   // its first query row; the others follow at LD
    const float* p_col = p_t + ty * TM;        // its 4 rows of p_t (then one key per P_LD)

    // Two barriers per tile. The first (A) says: tile t has landed in shared memory, and every thread has
    // finished tile t - 1, so its stage and p_t may be overwritten. Only then is tile t + 1 issued, into the
    // stage tile t - 1 used; its copies run while tile t is computed. The second (B) says: p_t is complete.
    // With one stage (D = 256) tile t + 1 can only be issued once tile t is consumed: a third barrier.
    for (int t = 0; t < n_tiles; ++t) {
        const int j0 = j_begin + t * BN;
        const float* k_row = k_s + (t % STAGES) * BN * LD + tx * LD;  // its first key (the others: +16 rows)
        const float* v_col = v_s + (t % STAGES) * BN * LD + tx * 4;   // its 4 dims of V (per 64)
        cp_async_wait<0>();               // this thread's copies of tile t have landed ...
        __syncthreads();                  // (A) ... and everyone's (and q_s, on the first tile)
        if (STAGES == 2) issue_tile(t + 1);

        // S = Q K^T for this thread's 4 x TN micro-tile, 4 head dims per step. For DMAX = 64 the steps run
        // over all DMAX dims (q_s and k_s are zero past D), a compile-time count, and are unrolled: the shared
        // loads of later steps are issued while earlier steps' FMAs run. Larger DMAX have no registers to
        // spare for that (it spills at 128 per thread): one step at a time, over the dims present.
        float s[TM][TN];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < TN; ++c) s[r][c] = 0.0f;
        auto qk_step = [&](int d) {
            float4 qv[TM], kv[TN];
#pragma unroll
            for (int r = 0; r < TM; ++r) qv[r] = *reinterpret_cast<const float4*>(q_row + r * LD + d);
#pragma unroll
            for (int c = 0; c < TN; ++c) kv[c] = *reinterpret_cast<const float4*>(k_row + c * 16 * LD + d);
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int c = 0; c < TN; ++c) {
                    s[r][c] += qv[r].x * kv[c].x;
                    s[r][c] += qv[r].y * kv[c].y;
                    s[r][c] += qv[r].z * kv[c].z;
                    s[r][c] += qv[r].w * kv[c].w;
                }
        };
        if (DMAX <= 64) {
#pragma unroll
            for (int d = 0; d < DMAX; d += 4) qk_step(d);
        } else {
#pragma unroll 1
            for (int d = 0; d < d_end; d += 4) qk_step(d);
        }

        // Mask where needed: structure first (it keeps the mask read in bounds), then the explicit term.
        const bool check_each = args.mask_kind != 0 || !tile_fully_allowed(rule, i0, i0 + BM, j0, j0 + BN);
        if (check_each) {
#pragma unroll
            for (int r = 0; r < TM; ++r) {
                const int i = i0 + ty * TM + r;
#pragma unroll
                for (int c = 0; c < TN; ++c) {
                    const int j = j0 + c * 16 + tx;
                    s[r][c] = structure_allows(rule, i, j) ? s[r][c] + explicit_term(args, b, h, i, j) : NEG_INF;
                }
            }
        }

        // Online softmax, once per tile: tile row max, one rescale, one exp per score.
#pragma unroll
        for (int r = 0; r < TM; ++r) {
            float tile_max = s[r][0];
#pragma unroll
            for (int c = 1; c < TN; ++c) tile_max = fmaxf(tile_max, s[r][c]);
            tile_max = group_max(tile_max, 16);
            const float m_new = fmaxf(m_i[r], tile_max);
            const float m_use = safe_max(m_new);
            const float alpha = softmax_exp<FAST_EXP>(m_i[r] - m_use);
            float row_sum = 0.0f;
#pragma unroll
            for (int c = 0; c < TN; ++c) {
                s[r][c] = softmax_exp<FAST_EXP>(s[r][c] - m_use);  // s now holds p
                row_sum += s[r][c];
            }
            l_i[r] = l_i[r] * alpha + row_sum;
#pragma unroll
            for (int e = 0; e < DPT; ++e) acc[r][e] *= alpha;
            m_i[r] = m_new;
        }
        // p_t[key][row]: the thread's 4 rows of one key are contiguous, one 16-byte store per key.
#pragma unroll
        for (int c = 0; c < TN; ++c) {
            *reinterpret_cast<float4*>(&p_t[(c * 16 + tx) * T::P_LD + ty * TM]) =
                make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);
        }
        __syncthreads();  // (B) p_t complete

        // O += P V for this thread's 4 x DPT micro-tile (keys past the tile's end have p = 0 and v = 0).
#pragma unroll 8
        for (int c = 0; c < BN; ++c) {
            const float4 pv = *reinterpret_cast<const float4*>(p_col + c * T::P_LD);
            const float p[TM] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
            for (int kk = 0; kk < DPT / 4; ++kk) {
                const float4 vv = *reinterpret_cast<const float4*>(v_col + c * LD + kk * 64);
#pragma unroll
                for (int r = 0; r < TM; ++r) {
                    acc[r][kk * 4 + 0] += p[r] * vv.x;
                    acc[r][kk * 4 + 1] += p[r] * vv.y;
                    acc[r][kk * 4 + 2] += p[r] * vv.z;
                    acc[r][kk * 4 + 3] += p[r] * vv.w;
                }
            }
        }
        if (STAGES == 1) {
            __syncthreads();  // the single stage and p_t are free
            issue_tile(t + 1);
        }
    }

    // Finish: sum l_i over the row's 16 threads. One split: normalize and write (empty rows write 0 and
    // lse = -inf). Several: write the unnormalized state for attn_rowmax_merge.
    const bool split = gridDim.z > 1;
    const long long bh = blockIdx.x;
    const long long rows = (long long)gridDim.x * Nq;  // rows of one split's workspace
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const int i = i0 + ty * TM + r;
        const float l = group_sum(l_i[r], 16);
        if (i >= Nq) continue;
        const long long row = blockIdx.z * rows + bh * Nq + i;
        const float inv_l = split ? 1.0f : row_inv_l(l);
#pragma unroll
        for (int kk = 0; kk < DPT / 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int d = kk * 64 + tx * 4 + e;
                if (d >= D) continue;
                if (split) {
                    args.part_acc[row * D + d] = acc[r][kk * 4 + e];
                } else {
                    store_elem<DTYPE>(args.out, offset4(args.os, b, h, i, d), acc[r][kk * 4 + e] * inv_l);
                }
            }
        if (tx == 0) {
            if (split) {
                args.part_ml[row * 2] = m_i[r];
                args.part_ml[row * 2 + 1] = l;
            } else if (args.lse != nullptr) {
                store_lse(args, b, h, i, row_lse(m_i[r], l));
            }
        }
    }
}

// Merge the split states of every row (one warp per row, lanes over the head dims):
//   m = max_z m_z;  l = sum_z l_z exp(m_z - m);  out = sum_z acc_z exp(m_z - m) / l;  lse = m + log(l).
// A split that saw no allowed key has m_z = -inf and l_z = 0 and weighs exp(-inf) = 0; a row no split
// saw keeps m = -inf, l = 0 and writes out = 0, lse = -inf (safe_max keeps exp away from -inf - -inf).
// expf always: a handful of exps per row, so fast_exp would buy nothing. Launched with the same AttnParams
// as attn_rowmax, right after it on the same stream.
template <int DTYPE>
__global__ void attn_rowmax_merge(const __grid_constant__ AttnParams args)
{
    const long long rows = (long long)args.B * args.Hq * args.Nq;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    const int i = (int)(row % args.Nq);
    const int bh = (int)(row / args.Nq);
    const int b = bh / args.Hq, h = bh % args.Hq;
    const float* part_ml = args.part_ml;
    const float* part_acc = args.part_acc;

    float m = NEG_INF;
    for (int z = 0; z < args.splits; ++z) m = fmaxf(m, part_ml[(z * rows + row) * 2]);
    const float m_use = safe_max(m);
    float l = 0.0f;
    for (int z = 0; z < args.splits; ++z) {
        const long long zr = z * rows + row;
        l += part_ml[zr * 2 + 1] * expf(part_ml[zr * 2] - m_use);
    }
    const float inv_l = row_inv_l(l);
    for (int d = lane; d < args.D; d += 32) {
        float o = 0.0f;
        for (int z = 0; z < args.splits; ++z) {
            const long long zr = z * rows + row;
            o += part_acc[zr * args.D + d] * expf(part_ml[zr * 2] - m_use);
        }
        store_elem<DTYPE>(args.out, offset4(args.os, b, h, i, d), o * inv_l);
    }
    if (args.lse != nullptr && lane == 0) store_lse(args, b, h, i, row_lse(m, l));
}

// ---- explicit instantiation for nvcc (NVRTC instantiates by name expression instead) -------------------
#ifndef __CUDACC_RTC__
#define ATTN_ROWMAX(DT, DM, FE) \
    template __global__ void attn_rowmax<DT, DM, FE>(const __grid_constant__ AttnParams);
#define ATTN_ROWMAX_D(DT, DM) ATTN_ROWMAX(DT, DM, false) ATTN_ROWMAX(DT, DM, true)
#define ATTN_ROWMAX_DT(DT) ATTN_ROWMAX_D(DT, 64) ATTN_ROWMAX_D(DT, 128) ATTN_ROWMAX_D(DT, 256) \
    template __global__ void attn_rowmax_merge<DT>(const __grid_constant__ AttnParams);
ATTN_ROWMAX_DT(0)
ATTN_ROWMAX_DT(1)
ATTN_ROWMAX_DT(2)
#endif
