// Merge of two partial attention states over disjoint key sets (src/merge.rs): the scalar math
// of `semantics::merge_weights`, one thread per output element. Memory-bound: each element of
// o_a and o_b is read once; the two log-sum-exps of a row are re-read by its head_dim threads
// (from cache).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Weights (wa, wb) and the merged lse L of a row, as semantics::merge_weights: NaN on either
// side poisons the row; -inf on both gives 0, 0, -inf; a side at -inf gets exactly 0 and the
// other exactly 1.
__device__ __forceinline__ void merge_weights(float la, float lb, float* wa, float* wb,
                                              float* lse) {
    if (isnan(la) || isnan(lb)) {
        *wa = *wb = *lse = __int_as_float(0x7fc00000);
        return;
    }
    const float m = fmaxf(la, lb);
    if (m == -INFINITY) {
        *wa = *wb = 0.f;
        *lse = -INFINITY;
        return;
    }
    const float ea = expf(la - m), eb = expf(lb - m);
    const float sum = ea + eb;
    *wa = ea / sum;
    *wb = eb / sum;
    *lse = m + logf(sum);
}

// o: contiguous (batch, seq, heads, d); lse: contiguous (batch, heads, seq). Strides in
// elements: o_a/o_b (batch, seq, head, dim), lse_a/lse_b (batch, head, seq).
template <typename T>
__device__ void merge_states(T* __restrict__ o, float* __restrict__ lse,
                             const T* __restrict__ oa, const float* __restrict__ la,
                             const T* __restrict__ ob, const float* __restrict__ lb,
                             int64_t batch, int64_t seq, int64_t heads, int64_t d, int64_t a_b,
                             int64_t a_s, int64_t a_h, int64_t a_x, int64_t b_b, int64_t b_s,
                             int64_t b_h, int64_t b_x, int64_t la_b, int64_t la_h, int64_t la_s,
                             int64_t lb_b, int64_t lb_h, int64_t lb_s) {
    const int64_t total = batch * seq * heads * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t x = i % d;
        int64_t rest = i / d;
        const int64_t h = rest % heads;
        rest /= heads;
        const int64_t s = rest % seq;
        const int64_t b = rest / seq;
        float wa, wb, l;
        merge_weights(la[b * la_b + h * la_h + s * la_s], lb[b * lb_b + h * lb_h + s * lb_s], &wa,
                      &wb, &l);
        // A side of weight exactly 0 is not read (MergeWeights::value).
        float acc = 0.f;
        if (wa != 0.f) acc += wa * to_f32(oa[b * a_b + s * a_s + h * a_h + x * a_x]);
        if (wb != 0.f) acc += wb * to_f32(ob[b * b_b + s * b_s + h * b_h + x * b_x]);
        o[i] = from_f32<T>(acc);
        if (x == 0) lse[(b * heads + h) * seq + s] = l;
    }
}

#define MERGE(NAME, T)                                                                          \
    extern "C" __global__ void NAME(                                                            \
        T* o, float* lse, const T* oa, const float* la, const T* ob, const float* lb,           \
        int64_t batch, int64_t seq, int64_t heads, int64_t d, int64_t a_b, int64_t a_s,         \
        int64_t a_h, int64_t a_x, int64_t b_b, int64_t b_s, int64_t b_h, int64_t b_x,           \
        int64_t la_b, int64_t la_h, int64_t la_s, int64_t lb_b, int64_t lb_h, int64_t lb_s) {   \
        merge_states<T>(o, lse, oa, la, ob, lb, batch, seq, heads, d, a_b, a_s, a_h, a_x, b_b,  \
                        b_s, b_h, b_x, la_b, la_h, la_s, lb_b, lb_h, lb_s);                     \
    }
MERGE(merge_states_f32, float)
MERGE(merge_states_f16, __half)
MERGE(merge_states_bf16, __nv_bfloat16)
