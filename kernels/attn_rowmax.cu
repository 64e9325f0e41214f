// attn_rowmax.cu: the rowmax kernel. As the tiled kernel, but the softmax is updated once per K tile:
// each tile's scores are reduced to a row max first, so every score costs exactly one exp, and the
// products QK^T and PV are computed as small register tiles (outer products) instead of dot products.
//
// Tiling: one block per (batch*head bh, tile of BM = 64 query rows): grid (B*Hq, ceil(Nq / 64)),
// 256 threads seen as a 16 x 16 grid (ty = tid / 16, tx = tid % 16). K and V stream through shared
// memory in tiles of BN keys (64 for D <= 64, else 32, to keep shared memory under ~100 KB per block so
// that two or three blocks share a multiprocessor). Query tiles are visited heaviest first (the last tile
// of a causal problem has the most keys), which evens out the tail of the grid.
//
// Shared memory (float32; "+4" pads each row by 16 bytes so that 16-byte reads stay aligned):
//   q_t [DMAX][BM+4]  the Q tile, transposed and pre-scaled: q_t[d][r] = scale * q[i0 + r][d]
//   k_t [DMAX][BN+4]  the K tile, transposed: k_t[d][c] = k[j0 + c][d]
//   v_s [BN][DMAX]    the V tile as is
//   p_t [BN][BM+4]    the probabilities of the tile, transposed: p_t[c][r] = p[r][c]
//
// Thread mapping, register micro-tiles:
//   S = Q K^T: thread (ty, tx) computes the 4 x TN block s[r][c] for rows ty*4 + r and keys tx*TN + c
//     (TN = BN / 16). For each d it reads 4 q's (one 16-byte load) and TN k's and does 4*TN FMAs: an outer
//     product, so each shared-memory value read feeds several FMAs.
//   softmax: the 16 threads of a row (same ty) hold its BN scores. Per row: tile max over the thread's
//     TN scores, then 4 xor shuffles over the 16 threads; m_new = max(m_i, tile max);
//     alpha = exp(m_i - m_new) rescales l_i and acc once per tile; p = exp(s - m_new), one exp per score.
//     l_i is kept per thread (its own keys' sum) and summed over the 16 threads only at the end.
//   O += P V: thread (ty, tx) owns the 4 x DPT block acc[r][e] of rows ty*4 + r and dims
//     d = 64*kk + tx*4 + e' (DPT = DMAX / 16). For each key c it reads 4 p's (16 bytes) and DPT v's
//     (16-byte loads) and does 4*DPT FMAs.
//
// Registers: __launch_bounds__(256, 2) for D <= 128 caps a thread at 128 registers so that two blocks
// (16 warps) share a multiprocessor; D = 256 needs ~145 KB of shared memory, one block per SM, so it is
// given the registers instead (no spills either way: python -m attnlab compile-check).
//
// Masking: as in the tiled kernel. Key tiles run over the block's structural range [lo, hi) only; the
// per-element predicate is evaluated only in tiles that are not entirely allowed by structure or when an
// explicit mask/bias is present. A masked score is -inf, so its p is exp(-inf) = 0. A row whose tile holds
// no allowed key keeps m_i = -inf and is protected by safe_max.

template <int TN>
__device__ __forceinline__ void load_floats(const float* p, float (&x)[TN]) {
    if constexpr (TN == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p);
        x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
    } else {
        static_assert(TN == 2, "TN is 2 or 4");
        const float2 t = *reinterpret_cast<const float2*>(p);
        x[0] = t.x; x[1] = t.y;
    }
}

template <int DMAX>
struct RowmaxTiles {
    static constexpr int BM = 64;
    static constexpr int BN = DMAX <= 64 ? 64 : 32;
    static constexpr int TM = 4;             // rows per thread
    static constexpr int TN = BN / 16;       // keys per thread
    static constexpr int DPT = DMAX / 16;    // output dims per thread
    static constexpr int NTHREADS = 256;
    static constexpr int Q_LD = BM + 4;      // row lengths (leading dims) of the shared arrays
    static constexpr int K_LD = BN + 4;
    static constexpr int P_LD = BM + 4;
};

template <int DTYPE, int DMAX, bool FAST_EXP>
__global__ void __launch_bounds__(256, DMAX <= 128 ? 2 : 1) attn_rowmax(
    const void* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v,
    void* __restrict__ out, float* __restrict__ lse,
    const int* __restrict__ q_len, const int* __restrict__ kv_len,
    const void* __restrict__ mask, int mask_kind,
    int Hq, int group, int Nq, int Nk, int D, float scale,
    int left, int right, int bottom_right,
    long long q_sb, long long q_sh, long long q_sn, long long q_sd,
    long long k_sb, long long k_sh, long long k_sn, long long k_sd,
    long long v_sb, long long v_sh, long long v_sn, long long v_sd,
    long long o_sb, long long o_sh, long long o_sn, long long o_sd,
    long long lse_sb, long long lse_sh, long long lse_sn,
    long long m_sb, long long m_sh, long long m_sn, long long m_sk)
{
    using T = RowmaxTiles<DMAX>;
    static_assert(T::TM == 4, "the 16-byte loads and stores of q_t and p_t hold 4 rows");
    constexpr int BM = T::BM, BN = T::BN, TM = T::TM, TN = T::TN, DPT = T::DPT, NTHREADS = T::NTHREADS;
    const Strides4 qs = {q_sb, q_sh, q_sn, q_sd}, ks = {k_sb, k_sh, k_sn, k_sd};
    const Strides4 vs = {v_sb, v_sh, v_sn, v_sd}, os = {o_sb, o_sh, o_sn, o_sd};
    const Strides4 ms = {m_sb, m_sh, m_sn, m_sk};

    extern __shared__ __align__(16) float smem[];
    float* q_t = smem;                       // [DMAX][Q_LD]
    float* k_t = q_t + DMAX * T::Q_LD;       // [DMAX][K_LD]
    float* v_s = k_t + DMAX * T::K_LD;       // [BN][DMAX]
    float* p_t = v_s + BN * DMAX;            // [BN][P_LD]

    const int b = blockIdx.x / Hq;
    const int h = blockIdx.x % Hq;
    const int hk = h / group;
    const int i0 = (gridDim.y - 1 - blockIdx.y) * BM;  // heaviest (last) query tiles first
    const int tx = threadIdx.x % 16;
    const int ty = threadIdx.x / 16;

    const RowRule rule = row_rule(q_len, kv_len, b, Nq, Nk, left, right, bottom_right);
    int lo, hi;
    key_range(rule, i0, i0 + BM, &lo, &hi);

    // Tile loads: thread t always loads head dim ld_d = t % DMAX, of rows (or keys) t / DMAX, then every
    // ROWS_PER_PASS-th after it. Consecutive threads read consecutive d (coalesced when stride_d is 1), and
    // the per-element address is one multiply-add on a precomputed base.
    constexpr int ROWS_PER_PASS = NTHREADS / DMAX;  // 4, 2 or 1
    static_assert(NTHREADS % DMAX == 0, "each thread keeps one head dim in the tile loads");
    const int ld_d = threadIdx.x % DMAX;
    const int ld_row = threadIdx.x / DMAX;
    const bool ld_d_in = ld_d < D;
    const long long q_base = offset4(qs, b, h, 0, ld_d);
    const long long k_base = offset4(ks, b, hk, 0, ld_d);
    const long long v_base = offset4(vs, b, hk, 0, ld_d);

    // Load the Q tile transposed and scaled; zero outside [0, Nq) x [0, D).
    for (int r = ld_row; r < BM; r += ROWS_PER_PASS) {
        const bool in = ld_d_in && i0 + r < Nq;
        q_t[ld_d * T::Q_LD + r] = in ? scale * load_elem<DTYPE>(q, q_base + (long long)(i0 + r) * q_sn) : 0.0f;
    }

    float m_i[TM], l_i[TM], acc[TM][DPT];
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        m_i[r] = NEG_INF;
        l_i[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPT; ++e) acc[r][e] = 0.0f;
    }

    for (int j0 = lo; j0 < hi; j0 += BN) {
        const int n_keys = min(BN, hi - j0);
        __syncthreads();  // the previous tile's k_t, v_s and p_t are no longer read
        for (int c = ld_row; c < BN; c += ROWS_PER_PASS) {
            const bool in = ld_d_in && c < n_keys;
            const long long j = j0 + c;
            k_t[ld_d * T::K_LD + c] = in ? load_elem<DTYPE>(k, k_base + j * k_sn) : 0.0f;
            v_s[c * DMAX + ld_d] = in ? load_elem<DTYPE>(v, v_base + j * v_sn) : 0.0f;
        }
        __syncthreads();

        // S = Q K^T for this thread's 4 x TN micro-tile (only the first D dims: the rest are zero).
        float s[TM][TN];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < TN; ++c) s[r][c] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; ++d) {
            float qv[TM], kv[TN];
            load_floats<TM>(&q_t[d * T::Q_LD + ty * TM], qv);
            load_floats<TN>(&k_t[d * T::K_LD + tx * TN], kv);
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int c = 0; c < TN; ++c) s[r][c] += qv[r] * kv[c];
        }

        // Mask where needed: structure first (it keeps the mask read in bounds), then the explicit term.
        const bool check_each = mask_kind != 0 || !tile_fully_allowed(rule, i0, i0 + BM, j0, j0 + BN);
        if (check_each) {
#pragma unroll
            for (int r = 0; r < TM; ++r) {
                const int i = i0 + ty * TM + r;
#pragma unroll
                for (int c = 0; c < TN; ++c) {
                    const int j = j0 + tx * TN + c;
                    s[r][c] = structure_allows(rule, i, j)
                                  ? s[r][c] + explicit_term(mask, mask_kind, ms, b, h, i, j)
                                  : NEG_INF;
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
            *reinterpret_cast<float4*>(&p_t[(tx * TN + c) * T::P_LD + ty * TM]) =
                make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);
        }
        __syncthreads();  // p_t complete

        // O += P V for this thread's 4 x DPT micro-tile.
#pragma unroll 2
        for (int c = 0; c < n_keys; ++c) {
            float pv[TM];
            load_floats<TM>(&p_t[c * T::P_LD + ty * TM], pv);
#pragma unroll
            for (int kk = 0; kk < DPT / 4; ++kk) {
                float vv[4];
                load_floats<4>(&v_s[c * DMAX + kk * 64 + tx * 4], vv);
#pragma unroll
                for (int r = 0; r < TM; ++r)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[r][kk * 4 + e] += pv[r] * vv[e];
            }
        }
    }

    // Finish: sum l_i over the row's 16 threads, normalize, write. Empty rows write 0 and lse = -inf.
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const int i = i0 + ty * TM + r;
        const float l = group_sum(l_i[r], 16);
        if (i < Nq) {
            const float inv_l = row_inv_l(l);
#pragma unroll
            for (int kk = 0; kk < DPT / 4; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = kk * 64 + tx * 4 + e;
                    if (d < D) store_elem<DTYPE>(out, offset4(os, b, h, i, d), acc[r][kk * 4 + e] * inv_l);
                }
            if (lse != nullptr && tx == 0) lse[b * lse_sb + h * lse_sh + (long long)i * lse_sn] = row_lse(m_i[r], l);
        }
    }
}
