// attn_mask.cuh: the mask rule of docs/contract.md, once for every kernel. For batch b, row i, key j:
//     j < Lk_b  and  i < Lq_b  and  diag_i - left <= j <= diag_i + right  and  mask[b, h, i, j]
// with diag_i = i + off_b, off_b = Lk_b - Lq_b (bottom_right) or 0 (top_left). "Unbounded" window sides
// arrive as NO_BOUND (attn_params.cuh). An additive bias adds to the score; -inf there removes the key like
// a False in a bool mask. The host's twin is attnlab.masks.MaskSpec.
#pragma once

#include "attn_dtype.cuh"
#include "attn_params.cuh"

// The structure of one batch entry: effective lengths, the diagonal offset and the window.
struct RowRule {
    int lq;     // rows i >= lq are padding
    int lk;     // keys j >= lk are masked
    int off;    // diag_i = i + off
    int left;   // allowed: diag_i - left <= j
    int right;  //          j <= diag_i + right
};

// Lengths are clamped to [0, Nq] and [0, Nk] here too (the host clamps GPU lengths already), so that no
// load leaves the tensors whatever a caller passes.
__device__ __forceinline__ RowRule row_rule(const AttnParams& args, int b) {
    RowRule r;
    r.lq = args.q_len ? min(max(args.q_len[b], 0), args.Nq) : args.Nq;
    r.lk = args.kv_len ? min(max(args.kv_len[b], 0), args.Nk) : args.Nk;
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

// One bias element, read in the caller's dtype (args.bias_dtype) and returned as float32.
__device__ __forceinline__ float load_bias(const AttnParams& args, long long o) {
    switch (args.bias_dtype) {
        case 1: return load_elem<1>(args.mask, o);
        case 2: return load_elem<2>(args.mask, o);
        case 3: return (float)__ldg(static_cast<const double*>(args.mask) + o);
        default: return load_elem<0>(args.mask, o);
    }
}

// The explicit mask's contribution to score (b, h, i, j): 0 or -inf for a bool mask (kind 1), the bias
// value for an additive bias (kind 2), 0 when there is none (kind 0). Broadcast dims have stride 0.
__device__ __forceinline__ float explicit_term(const AttnParams& args, int b, int h, int i, int j) {
    if (args.mask_kind == 0) return 0.0f;
    long long o = offset4(args.ms, b, h, i, j);
    if (args.mask_kind == 1) return __ldg(static_cast<const unsigned char*>(args.mask) + o) ? 0.0f : NEG_INF;
    return load_bias(args, o);
}
