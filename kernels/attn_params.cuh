// attn_params.cuh: the one argument every attention kernel takes, and how a tensor is addressed.
//
// * Index math: every tensor is addressed as base + b*s_b + h*s_h + n*s_n + d*s_d with int64 strides in
//   elements, so any view works (transposed layouts, stride(-1) != 1, stride 0 on broadcast dims).
//   GQA/MQA: query head h reads kv head h / group.
// * "Unbounded" window sides arrive as NO_BOUND (2^30), larger than any distance between a row and a key,
//   so the mask rule (attn_mask.cuh) needs no special case.
#pragma once

#define NO_BOUND (1 << 30)

// ---- strided tensors ----------------------------------------------------------------------------------

struct Strides4 {
    long long b, h, n, d;
};

__device__ __forceinline__ long long offset4(const Strides4& s, int b, int h, long long n, long long d) {
    return (long long)b * s.b + (long long)h * s.h + n * s.n + d * s.d;
}

// ---- kernel parameters --------------------------------------------------------------------------------

// Everything a launch tells the kernels, passed as ONE argument by value (the naive, tiled and rowmax kernels
// and rowmax's merge all take it). attnlab/backends/cuda/params.py builds the same bytes from a numpy
// structured dtype (PARAMS_DTYPE, align=True: C's layout rules); tests/test_cuda.py checks every field's
// offset and the size against this declaration, compiled. Keep the order: 8-byte fields first, then 4-byte
// ones, so that no padding hides between fields. Pointers are device addresses, 0 for an absent tensor;
// strides are in elements.
struct AttnParams {
    const void* q;          // [B, Hq, Nq, D]
    const void* k;          // [B, Hkv, Nk, D]
    const void* v;          // [B, Hkv, Nk, D]
    void* out;              // [B, Hq, Nq, D], q's dtype
    float* lse;             // [B, Hq, Nq] float32, or 0
    const int* q_len;       // [B] int32, or 0 (every row is real)
    const int* kv_len;      // [B] int32, or 0 (every key is real)
    const void* mask;       // bool mask as bytes (mask_kind 1) or bias in bias_dtype (mask_kind 2), or 0
    float* part_acc;        // rowmax split keys: acc of each split [splits][B*Hq*Nq][D], or 0
    float* part_ml;         //                    (m, l) of each split [splits][B*Hq*Nq][2], or 0
    Strides4 qs, ks, vs, os, ms;             // q, k, v, out, mask (ms: stride 0 on broadcast dims)
    long long lse_sb, lse_sh, lse_sn;
    int B, Hq, group, Nq, Nk, D;             // group = Hq / Hkv (GQA: query head h reads kv head h / group)
    float scale;
    int mask_kind;                           // 0 none, 1 bool, 2 additive bias
    int left, right, bottom_right;           // the window (causal: right = 0), NO_BOUND when unbounded
    int async_copy;                          // rowmax: K/V tiles by cp.async (1) or element loads (0)
    int split_tiles;                         // rowmax: key tiles per split (NO_BOUND: one split)
    int splits;                              // rowmax: number of splits (grid z), read by the merge
    int bias_dtype;                          // the bias's dtype: 0 float32, 1 float16, 2 bfloat16, 3 float64
};
