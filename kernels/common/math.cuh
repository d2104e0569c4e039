// Scalar math shared by the kernels: exp2 for the base-2 online softmax and a light tanh for the
// softcap (the score modifier itself is common/score.cuh).
#pragma once

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ float fast_exp2(float x) {
    // ex2.approx: ~2 ulp, exp2(-inf) = +0, which is what masked scores need.
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh(x) = 1 - 2 / (exp(2x) + 1). The absolute error stays near f32 epsilon over the whole
// range (what matters for a score), and it is far lighter on registers than tanhf when unrolled
// over a whole score tile. exp(2x) overflowing to inf gives exactly 1, underflowing to 0 gives -1.
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * LOG2E_F)) + 1.f);
}
