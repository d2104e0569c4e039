// The score modifier of src/semantics.rs, defined once for every kernel. From the raw dot
// product q.k of row i and key j:
//   s = scale q.k;   softcap c > 0: s = c tanh(scale q.k / c);   ALiBi: s -= slope |diag(i) - j|.
// The backward also needs ds / d(scale q.k), the chain factor of dS: 1, or 1 - tanh^2 under a
// softcap (ALiBi is a constant shift).
//
// Units: the kernels whose softmax runs on exp2 keep scores in base 2 (scale, cap and slope
// multiplied by log2 e: FlashParams::scale_log2, cap_log2, slope * LOG2E_F) and take tanh_fast;
// the exact f32 backward keeps natural-log units and takes tanhf.
#pragma once
#include "common/math.cuh"
#include "common/params.cuh"

template <bool EXACT>
__device__ __forceinline__ float tanh_of(float x) {
    return EXACT ? tanhf(x) : tanh_fast(x);
}

// The modified score; GRAD: also its chain factor into `chain`. EXACT: natural-log units and
// tanhf, `scale` the softmax scale and `slope` the ALiBi slope as given; otherwise base 2 and
// tanh_fast, from the fields of `p` (`scale` unused), `slope` times log2 e.
// The fields of `p` are read inside the branch that needs them, and the three forms order their
// steps as the kernels did when each wrote its own (cap then tanh; tanh, chain, cap; tanh, cap,
// chain): the order changes the registers ptxas assigns in the unrolled score loops, and this
// keeps every kernel's code as it was measured.
template <bool EXACT, bool GRAD>
__device__ __forceinline__ float score_mod(const FlashParams& p, float scale, float dot,
                                           float slope, int diag, int j, float& chain) {
    float s;
    if (p.softcap > 0.f) {
        if constexpr (!GRAD) {
            s = (EXACT ? p.softcap : p.cap_log2) * tanh_of<EXACT>(dot * p.scale_over_cap);
        } else {
            const float t = tanh_of<EXACT>(dot * p.scale_over_cap);
            if constexpr (EXACT) {
                s = p.softcap * t;
                chain = 1.f - t * t;
            } else {
                chain = 1.f - t * t;
                s = p.cap_log2 * t;
            }
        }
    } else {
        chain = 1.f;
        s = dot * (EXACT ? scale : p.scale_log2);
    }
    return s - slope * (float)abs(diag - j);
}

// Base 2 (the tensor-core and row-wise kernels): the score, and the score with its chain factor.
__device__ __forceinline__ float modded_score(const FlashParams& p, float dot, float slope_log2,
                                              int diag, int j) {
    float chain;
    return score_mod<false, false>(p, 0.f, dot, slope_log2, diag, j, chain);
}
__device__ __forceinline__ float modded_score(const FlashParams& p, float dot, float slope_log2,
                                              int diag, int j, float& chain) {
    return score_mod<false, true>(p, 0.f, dot, slope_log2, diag, j, chain);
}
// Natural-log units with tanhf, with the chain factor (the exact f32 backward).
__device__ __forceinline__ float modded_score_exact(const FlashParams& p, float scale, float dot,
                                                    float slope, int diag, int j, float& chain) {
    return score_mod<true, true>(p, scale, dot, slope, diag, j, chain);
}
