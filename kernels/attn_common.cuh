// attn_common.cuh: what the three attention kernels (naive, tiled, rowmax) share.
//
// * Element loads and stores for float32 / float16 / bfloat16. The half types are read as raw 16-bit words
//   (unsigned short) and converted with one PTX instruction each way, so the kernels need no CUDA headers
//   (NVRTC from pip has none). Arithmetic is always float32.
// * Index math: every tensor is addressed as base + b*s_b + h*s_h + n*s_n + d*s_d with int64 strides in
//   elements, so any view works (transposed layouts, stride(-1) != 1, stride 0 on broadcast dims).
//   GQA/MQA: query head h reads kv head h / group.
// * The mask rule (docs/contract.md, "Masks"). For batch b, row i, key j:
//       j < Lk_b  and  i < Lq_b  and  diag_i - left <= j <= diag_i + right  and  mask[b, h, i, j]
//   with diag_i = i + off_b, off_b = Lk_b - Lq_b (bottom_right) or 0 (top_left). "Unbounded" window sides
//   arrive as NO_BOUND (2^30), larger than any distance between a row and a key, so no special case.
//   An additive bias adds to the score; -inf there removes the key like a False in a bool mask.
// * The empty-row rule: a row with no allowed key ends with l_i = 0; it writes out = 0 and lse = -inf.
//   Online softmax never computes (-inf) - (-inf): a running max of -inf is replaced by 0 before use.
// * exp: expf (IEEE, about 1 ulp) or __expf (fast: ex2.approx of x*log2(e), a few ulp more, flushes
//   denormals), chosen by the FAST_EXP template argument.

#define NO_BOUND (1 << 30)

// -inf without <math.h> (NVRTC has no system headers): the float32 bit pattern 0xff800000.
#define NEG_INF __int_as_float((int)0xff800000u)

// ---- dtypes -------------------------------------------------------------------------------------------
// DTYPE template argument: 0 = float32, 1 = float16, 2 = bfloat16.

__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
    // bfloat16 is the top half of a float32: shift it back into place.
    return __int_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
    // Round to nearest even (sm_80+ instruction; NaN stays NaN).
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Inputs are read through the read-only data path (__ldg): they do not change while a kernel runs.
template <int DTYPE>
__device__ __forceinline__ float load_elem(const void* base, long long offset) {
    if (DTYPE == 0) {
        return __ldg(static_cast<const float*>(base) + offset);
    } else if (DTYPE == 1) {
        return half_bits_to_float(__ldg(static_cast<const unsigned short*>(base) + offset));
    } else {
        return bf16_bits_to_float(__ldg(static_cast<const unsigned short*>(base) + offset));
    }
}

template <int DTYPE>
__device__ __forceinline__ void store_elem(void* base, long long offset, float x) {
    if (DTYPE == 0) {
        static_cast<float*>(base)[offset] = x;
    } else if (DTYPE == 1) {
        static_cast<unsigned short*>(base)[offset] = float_to_half_bits(x);
    } else {
        static_cast<unsigned short*>(base)[offset] = float_to_bf16_bits(x);
    }
}

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

// ---- strided tensors ----------------------------------------------------------------------------------

struct Strides4 {
    long long b, h, n, d;
};

__device__ __forceinline__ long long offset4(const Strides4& s, int b, int h, long long n, long long d) {
    return (long long)b * s.b + (long long)h * s.h + n * s.n + d * s.d;
}

// ---- kernel parameters --------------------------------------------------------------------------------

// Everything a launch tells the kernels, passed as ONE argument by value (the naive, tiled and rowmax kernels
// and rowmax's merge all take it). attnlab/cuda.py builds the same bytes from a numpy structured dtype
// (PARAMS_DTYPE, align=True: C's layout rules); tests/test_cuda.py checks every field's offset and the size
// against this declaration, compiled. Keep the order: 8-byte fields first, then 4-byte ones, so that no
// padding hides between fields. Pointers are device addresses, 0 for an absent tensor; strides are in elements.
struct AttnParams {
    const void* q;          // [B, Hq, Nq, D]
    const void* k;          // [B, Hkv, Nk, D]
    const void* v;          // [B, Hkv, Nk, D]
    void* out;              // [B, Hq, Nq, D], q's dtype
    float* lse;             // [B, Hq, Nq] float32, or 0
    const int* q_len;       // [B] int32, or 0 (every row is real)
    const int* kv_len;      // [B] int32, or 0 (every key is real)
    const void* mask;       // bool mask as bytes (mask_kind 1) or float32 bias (mask_kind 2), or 0
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
};

// ---- the mask rule ------------------------------------------------------------------------------------

// The structure of one batch entry: effective lengths, the diagonal offset and the window.
struct RowRule {
    int lq;     // rows i >= lq are padding
    int lk;     // keys j >= lk are masked
    int off;    // diag_i = i + off
    int left;   // allowed: diag_i - left <= j
    int right;  //          j <= diag_i + right
};

__device__ __forceinline__ RowRule row_rule(const AttnParams& args, int b) {
    RowRule r;
    r.lq = args.q_len ? args.q_len[b] : args.Nq;
    r.lk = args.kv_len ? args.kv_len[b] : args.Nk;
    r.off = args.bottom_right ? r.lk - r.lq : 0;
    r.left = args.left;
    r.right = args.right;
    return r;
}

// Keys [lo, hi) that rows i0 .. i1-1 may attend by structure (lengths and band); lo >= hi: none.
// The same bounds as MaskSpec.key_range on the host. Loops run over these only, so tiles that are empty
// by construction are never loaded.
__device__ __forceinline__ void key_range(const RowRule& r, int i0, int i1, int* lo, int* hi) {
    i1 = min(i1, r.lq);
    if (i0 >= i1) {
        *lo = 0;
        *hi = 0;
        return;
    }
    *lo = max(0, i0 + r.off - r.left);
    *hi = min(r.lk, i1 - 1 + r.off + r.right + 1);
}

// Whether key j is allowed for row i by structure (lengths and band); the explicit mask is separate.
__device__ __forceinline__ bool structure_allows(const RowRule& r, int i, int j) {
    int diag = i + r.off;
    return i < r.lq && j < r.lk && j >= diag - r.left && j <= diag + r.right;
}

// Whether every (row, key) of rows [i0, i1) x keys [j0, j1) is allowed by structure, so the per-element
// predicate can be skipped for that tile. The tightest rows are the last (left side) and the first (right).
__device__ __forceinline__ bool tile_fully_allowed(const RowRule& r, int i0, int i1, int j0, int j1) {
    return i1 <= r.lq && j1 <= r.lk && j0 >= (i1 - 1) + r.off - r.left && (j1 - 1) <= i0 + r.off + r.right;
}

// The explicit mask's contribution to score (b, h, i, j): 0 or -inf for a bool mask (kind 1), the bias
// value for an additive bias (kind 2), 0 when there is none (kind 0). Broadcast dims have stride 0.
__device__ __forceinline__ float explicit_term(const AttnParams& args, int b, int h, int i, int j) {
    if (args.mask_kind == 0) return 0.0f;
    long long o = offset4(args.ms, b, h, i, j);
    if (args.mask_kind == 1) return __ldg(static_cast<const unsigned char*>(args.mask) + o) ? 0.0f : NEG_INF;
    return __ldg(static_cast<const float*>(args.mask) + o);
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
