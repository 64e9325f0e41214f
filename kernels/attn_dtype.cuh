// attn_dtype.cuh: element loads and stores for float32 / float16 / bfloat16, and -inf.
//
// The half types are read as raw 16-bit words (unsigned short) and converted with one PTX instruction each
// way, so the kernels need no CUDA headers (NVRTC from pip has none). Arithmetic is always float32.
// DTYPE template argument: 0 = float32, 1 = float16, 2 = bfloat16.
#pragma once

// -inf without <math.h> (NVRTC has no system headers): the float32 bit pattern 0xff800000.
#define NEG_INF __int_as_float((int)0xff800000u)

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
