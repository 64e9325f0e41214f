// attn_tiled.cu: the tiled kernel. K and V are read once per query tile instead of once per query row,
// and the softmax is computed online, one key at a time.
//
// Tiling: one block per (batch*head bh, tile of BM = 16 query rows): grid (B*Hq, ceil(Nq / 16)),
// 128 threads. The Q tile is loaded once into shared memory, multiplied by the softmax scale on the way
// (so scores need no extra multiply), then each thread copies its slice into registers. K and V stream
// through shared memory in tiles of BN = 32 keys.
//
// Thread mapping: 8 threads per query row (16 rows x 8 = 128). Thread g of a row owns the head dims
// d = g + 8*c (c < DMAX / 8): its slice of q_i, of the accumulator acc and of every k_j, v_j it reads.
// DMAX is the compiled bucket of D (32, 64, 128 or 256); dims D .. DMAX-1 are zero in shared memory.
// A score s_ij is the 8 threads' partial dot products summed by 3 xor shuffles.
//
// Online softmax, per element: for each key j of the tile, in order,
//   m_new = max(m_i, s_ij);  corr = exp(m_i - m_new);  p = exp(s_ij - m_new)
//   l_i = l_i * corr + p;    acc = acc * corr + p * v_j;  m_i = m_new
// Two exps and a rescale of acc per score: the cost the rowmax kernel removes.
//
// Masking: key tiles run over the block's structural range [lo, hi) only (lengths, causal, window), so
// tiles that are empty by construction are never loaded. Inside a tile the per-element predicate is
// evaluated only when the tile is not entirely allowed by structure or an explicit mask/bias is present.
// A masked key is skipped (it would contribute exp(-inf) = 0).

#include "attn_dtype.cuh"
#include "attn_mask.cuh"
#include "attn_params.cuh"
#include "attn_softmax.cuh"

template <int DTYPE, int DMAX, bool FAST_EXP>
__global__ void __launch_bounds__(128, 4) attn_tiled(const __grid_constant__ AttnParams args)
{
    constexpr int BM = 16;               // query rows per block
    constexpr int BN = 32;               // keys per K/V tile
    constexpr int GROUP = 8;             // threads per query row
    constexpr int NTHREADS = BM * GROUP;
    constexpr int DPT = DMAX / GROUP;    // head dims per thread
    const int Hq = args.Hq, Nq = args.Nq, D = args.D;
    const Strides4 qs = args.qs, ks = args.ks, vs = args.vs, os = args.os;

    // Dynamic shared memory: Q tile [BM][DMAX], K tile [BN][DMAX], V tile [BN][DMAX], all float32.
    extern __shared__ float smem[];
    float* q_tile = smem;
    float* k_tile = q_tile + BM * DMAX;
    float* v_tile = k_tile + BN * DMAX;

    const int b = blockIdx.x / Hq;
    const int h = blockIdx.x % Hq;
    const int hk = h / args.group;
    const int i0 = blockIdx.y * BM;
    const int row = threadIdx.x / GROUP;  // this thread's row in the tile
    const int g = threadIdx.x % GROUP;    // this thread's place in the row's group
    const int i = i0 + row;

    const RowRule rule = row_rule(args, b);
    int lo, hi;
    key_range(rule, i0, i0 + BM, &lo, &hi);

    // Load the Q tile, scaled, zero outside [0, Nq) x [0, D). Consecutive threads read consecutive d. A tile
    // with no key to visit (all rows padding, i0 >= Lq, among them) reads nothing: no Q here, no K or V below.
    for (int idx = threadIdx.x; idx < BM * DMAX; idx += NTHREADS) {
        const int r = idx / DMAX, d = idx % DMAX;
        const bool in = lo < hi && i0 + r < Nq && d < D;
        q_tile[idx] = in ? args.scale * load_elem<DTYPE>(args.q, offset4(qs, b, h, i0 + r, d)) : 0.0f;
    }
    __syncthreads();
    float q_reg[DPT];
#pragma unroll
    for (int c = 0; c < DPT; ++c) q_reg[c] = q_tile[row * DMAX + g + GROUP * c];

    float m_i = NEG_INF;  // running max of this row's scores
    float l_i = 0.0f;     // running sum of exp(s - m_i)
    float acc[DPT];       // running sum of exp(s - m_i) * v, this thread's dims
#pragma unroll
    for (int c = 0; c < DPT; ++c) acc[c] = 0.0f;

    for (int j0 = lo; j0 < hi; j0 += BN) {
        const int n_keys = min(BN, hi - j0);
        // Load the K and V tiles (keys j0 .. j0 + n_keys - 1), zero-padded.
        __syncthreads();  // the previous tile is no longer read
        for (int idx = threadIdx.x; idx < BN * DMAX; idx += NTHREADS) {
            const int jj = idx / DMAX, d = idx % DMAX;
            const bool in = jj < n_keys && d < D;
            k_tile[idx] = in ? load_elem<DTYPE>(args.k, offset4(ks, b, hk, j0 + jj, d)) : 0.0f;
            v_tile[idx] = in ? load_elem<DTYPE>(args.v, offset4(vs, b, hk, j0 + jj, d)) : 0.0f;
        }
        __syncthreads();

        const bool check_each = args.mask_kind != 0 || !tile_fully_allowed(rule, i0, i0 + BM, j0, j0 + BN);
        for (int jj = 0; jj < n_keys; ++jj) {
            const int j = j0 + jj;
            float part = 0.0f;
#pragma unroll
            for (int c = 0; c < DPT; ++c) part += q_reg[c] * k_tile[jj * DMAX + g + GROUP * c];
            float s = group_sum(part, GROUP);
            if (check_each) {
                // Structure first: it keeps the mask read inside [0, Nq) x [0, Nk).
                s = structure_allows(rule, i, j) ? s + explicit_term(args, b, h, i, j) : NEG_INF;
            }
            // A masked key (s = -inf) changes nothing: skip it rather than compute exp(-inf - -inf).
            if (s != NEG_INF) {
                const float m_new = fmaxf(m_i, s);
                const float corr = softmax_exp<FAST_EXP>(m_i - m_new);  // m_i = -inf the first time: 0
                const float p = softmax_exp<FAST_EXP>(s - m_new);
                l_i = l_i * corr + p;
#pragma unroll
                for (int c = 0; c < DPT; ++c) acc[c] = acc[c] * corr + p * v_tile[jj * DMAX + g + GROUP * c];
                m_i = m_new;
            }
        }
    }

    // Normalize and write; an empty row (l_i = 0) writes zeros and lse = -inf.
    if (i < Nq) {
        const float inv_l = row_inv_l(l_i);
#pragma unroll
        for (int c = 0; c < DPT; ++c) {
            const int d = g + GROUP * c;
            if (d < D) store_elem<DTYPE>(args.out, offset4(os, b, h, i, d), acc[c] * inv_l);
        }
        if (args.lse != nullptr && g == 0) store_lse(args, b, h, i, row_lse(m_i, l_i));
    }
}

// ---- explicit instantiation for nvcc (NVRTC instantiates by name expression instead) -------------------
#ifndef __CUDACC_RTC__
#define ATTN_TILED(DT, DM, FE) \
    template __global__ void attn_tiled<DT, DM, FE>(const __grid_constant__ AttnParams);
#define ATTN_TILED_D(DT, DM) ATTN_TILED(DT, DM, false) ATTN_TILED(DT, DM, true)
#define ATTN_TILED_DT(DT) ATTN_TILED_D(DT, 32) ATTN_TILED_D(DT, 64) ATTN_TILED_D(DT, 128) ATTN_TILED_D(DT, 256)
ATTN_TILED_DT(0)
ATTN_TILED_DT(1)
ATTN_TILED_DT(2)
#endif
