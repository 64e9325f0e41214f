// attn_softmax.cuh: the pieces of (online) softmax every kernel shares.
//
// * The empty-row rule: a row with no allowed key ends with l_i = 0; it writes out = 0 and lse = -inf.
//   Online softmax never computes (-inf) - (-inf): a running max of -inf is replaced by 0 before use.
// * exp: expf (IEEE, about 1 ulp) or __expf (fast: ex2.approx of x*log2(e), a few ulp more, flushes
//   denormals), chosen by the FAST_EXP template argument.
// * Warp reductions over aligned groups of lanes (a row's threads).
#pragma once

#include "attn_dtype.cuh"
#include "attn_params.cuh"

// ---- exp ------------------------------------------------------------------------------------------------

template <bool FAST_EXP>
__device__ __forceinline__ float softmax_exp(float x) {
    return FAST_EXP ? __expf(x) : expf(x);
}

// A running max of -inf means "no allowed key yet": use 0 instead so that exp(s - m) is exp(-inf) = 0,
// never exp(-inf - (-inf)) = NaN.
__device__ __forceinline__ float safe_max(float m) {
    return m == NEG_INF ? 0.0f : m;
}

// ---- warp reductions ----------------------------------------------------------------------------------

// Reduce over the `width` lanes of an aligned group (width a power of two <= 32) with xor shuffles:
// every lane of the group ends with the result.
__device__ __forceinline__ float group_sum(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float group_max(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// ---- finishing a row ----------------------------------------------------------------------------------

// lse of a finished row: m_i + log(l_i), or -inf for an empty row (l_i == 0). A NaN l_i (NaN in the
// inputs) is not empty: it propagates, as the contract says.
__device__ __forceinline__ float row_lse(float m_i, float l_i) {
    return l_i != 0.0f ? m_i + logf(l_i) : NEG_INF;
}

// Store the lse of row i of (batch b, head h).
__device__ __forceinline__ void store_lse(const AttnParams& args, int b, int h, int i, float value) {
    args.lse[b * args.lse_sb + h * args.lse_sh + (long long)i * args.lse_sn] = value;
}

// 1 / l_i, or 0 for an empty row so that out = acc * 0 = 0 (acc is 0 there too).
__device__ __forceinline__ float row_inv_l(float l_i) {
    return l_i != 0.0f ? 1.0f / l_i : 0.0f;
}
