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

// The end of a finished row of query head h: from its base-2 running max m2 and sum
// l = sum_j 2^(s_j - m2) (l = 0 for a row that saw no key), the factor that normalises the
// row's accumulated O and its base-2 log-sum-exp (-inf for a row that saw no key; a NaN l stays
// NaN). With attention sinks (`sinks` non-null) the row's softmax has one more term, the sink
// s2 = sinks[h] log2(e), which carries no value: it joins the sum against M = max(m2, s2), so
// that neither side overflows (src/semantics.rs, merge_weights, is the same rule in natural log).
struct RowEnd {
    float inv;
    float lse2;
};

__device__ __forceinline__ RowEnd row_end(float m2, float l, const float* sinks, int h) {
    if (sinks == nullptr || l != l)
        return {l > 0.f ? 1.f / l : 0.f, l > 0.f || l != l ? m2 + __log2f(l) : -INFINITY};
    const float s2 = sinks[h] * LOG2E_F;
    const float m = l > 0.f ? m2 : -INFINITY;
    const float top = fmaxf(m, s2);
    if (top == -INFINITY) return {0.f, -INFINITY};
    const float a = exp2f(m - top);
    const float sum = fmaf(l, a, exp2f(s2 - top));
    return {a / sum, top + __log2f(sum)};
}
