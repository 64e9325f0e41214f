// attn_naive.cu: the naive kernel. Three passes over the keys, recomputing every score each time.
//
// Thread mapping: one block per (query row i, batch*head bh): grid (Nq, B*Hq), 128 threads = 4 warps.
// Inside a warp the 32 lanes split the head dim D: lane owns dims d = lane + 32*c (c < 8, so D <= 256).
// The 4 warps split the keys: warp w takes keys lo + w, lo + w + 4, ...
//
// A score s_ij = q_i . k_j is a warp-wide dot product: each lane multiplies its dims, then 5 xor shuffles
// sum the 32 partial products, and every lane holds s_ij. The three passes:
//   1. m_i = max_j s_ij                          (per warp, then across the 4 warps through shared memory)
//   2. l_i = sum_j exp(s_ij - m_i)               (likewise)
//   3. acc = sum_j exp(s_ij - m_i) * v_j          (lane-owned dims; the 4 warps' acc summed in shared memory)
// out_i = acc / l_i, lse_i = m_i + log(l_i). Keys outside the row's structural range [lo, hi) (lengths,
// causal, window) are never visited; the explicit mask or bias is applied per score.
//
// Nothing is reused between rows: every query reads all of K three times and V once. That is the point of
// this kernel: the tiled kernels exist to remove exactly this traffic.

#include "attn_dtype.cuh"
#include "attn_mask.cuh"
#include "attn_params.cuh"
#include "attn_softmax.cuh"

template <int DTYPE, bool FAST_EXP>
__global__ void __launch_bounds__(128) attn_naive(const __grid_constant__ AttnParams args)
{
    constexpr int WARPS = 4;
    constexpr int DIMS_PER_LANE = 8;  // 8 * 32 = 256 = the largest D
    const void* q = args.q;
    const void* k = args.k;
    const void* v = args.v;
    const int Hq = args.Hq, D = args.D;
    const Strides4 qs = args.qs, ks = args.ks, vs = args.vs, os = args.os;

    const int i = blockIdx.x;
    const int b = blockIdx.y / Hq;
    const int h = blockIdx.y % Hq;
    const int hk = h / args.group;  // GQA: the kv head this query head reads
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;

    __shared__ float warp_part[WARPS];
    __shared__ float acc_part[WARPS][DIMS_PER_LANE * 32];

    const RowRule rule = row_rule(args, b);
    int lo, hi;
    key_range(rule, i, i + 1, &lo, &hi);  // for one row this is exactly its allowed structure

    // This lane's slice of q_i, pre-multiplied by the softmax scale. A row with no key to visit (a padding
    // row i >= Lq among them) reads nothing: no q here, and the loops below read no K or V.
    float q_reg[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const int d = lane + 32 * c;
        q_reg[c] = d < D && lo < hi ? args.scale * load_elem<DTYPE>(q, offset4(qs, b, h, i, d)) : 0.0f;
    }

    // s_ij (+ bias, or -inf where the explicit mask removes key j), the same value in every lane.
    auto score = [&](int j) {
        float part = 0.0f;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) {
            const int d = lane + 32 * c;
            if (d < D) part += q_reg[c] * load_elem<DTYPE>(k, offset4(ks, b, hk, j, d));
        }
        return group_sum(part, 32) + explicit_term(args, b, h, i, j);
    };

    // Pass 1: the row max m_i.
    float m_i = NEG_INF;
    for (int j = lo + warp; j < hi; j += WARPS) m_i = fmaxf(m_i, score(j));
    if (lane == 0) warp_part[warp] = m_i;
    __syncthreads();
    m_i = fmaxf(fmaxf(warp_part[0], warp_part[1]), fmaxf(warp_part[2], warp_part[3]));
    __syncthreads();  // warp_part is reused below
    const float m_use = safe_max(m_i);  // an empty row keeps m_i = -inf

    // Pass 2: the normalizer l_i.
    float l_i = 0.0f;
    for (int j = lo + warp; j < hi; j += WARPS) l_i += softmax_exp<FAST_EXP>(score(j) - m_use);
    if (lane == 0) warp_part[warp] = l_i;
    __syncthreads();
    l_i = (warp_part[0] + warp_part[1]) + (warp_part[2] + warp_part[3]);

    // Pass 3: acc = sum_j p_ij v_j over this warp's keys, for this lane's dims.
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    for (int j = lo + warp; j < hi; j += WARPS) {
        const float p = softmax_exp<FAST_EXP>(score(j) - m_use);
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) {
            const int d = lane + 32 * c;
            if (d < D) acc[c] += p * load_elem<DTYPE>(v, offset4(vs, b, hk, j, d));
        }
    }
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc_part[warp][lane + 32 * c] = acc[c];
    __syncthreads();

    // Sum the 4 warps' partial accumulators and normalize; an empty row (l_i = 0) writes zeros.
    const float inv_l = row_inv_l(l_i);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float o = (acc_part[0][d] + acc_part[1][d]) + (acc_part[2][d] + acc_part[3][d]);
        store_elem<DTYPE>(args.out, offset4(os, b, h, i, d), o * inv_l);
    }
    if (args.lse != nullptr && threadIdx.x == 0) store_lse(args, b, h, i, row_lse(m_i, l_i));
}

// ---- explicit instantiation for nvcc (NVRTC instantiates by name expression instead) -------------------
#ifndef __CUDACC_RTC__
#define ATTN_NAIVE(DT, FE) template __global__ void attn_naive<DT, FE>(const __grid_constant__ AttnParams);
#define ATTN_NAIVE_DT(DT) ATTN_NAIVE(DT, false) ATTN_NAIVE(DT, true)
ATTN_NAIVE_DT(0)
ATTN_NAIVE_DT(1)
ATTN_NAIVE_DT(2)
#endif
