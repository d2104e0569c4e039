// Attention with one query row per warp and no shared memory: the fallback for what the tiled
// kernels cannot fit on a device (f32 heads wider than the f32 tiles allow, up to d 512), for
// any dtype.
//
// Tiling: a block of ROWWISE_WARPS warps takes that many consecutive query rows of one
// (batch, head). Lane t holds columns t, t + 32, ... of its row's q and O (up to 16 each, so
// d <= 512). The warp walks the row's visible keys [lo, hi) one at a time: the dot product is a
// per-lane partial sum reduced by shuffles, then the online softmax updates the running max m,
// sum l and O in registers; O is normalised once at the end. Keys outside the row's window are
// never read. Every operand is read through its strides (any layout).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/score.cuh"

namespace rowwise {

constexpr int WARPS = 4;  // ROWWISE_WARPS in src/cuda/instances.rs
constexpr int NT = 16;    // columns per lane: d <= 32 * NT = ROWWISE_MAX_D

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ void fwd(const FlashParams& p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    if (!block_geom<true>(p, blockIdx.x, WARPS, h, b, g) || warp >= g.rows) return;
    const int i = g.m0 + warp;
    const int kvh = h / p.kv_group;
    const T* qp = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch +
                  (g.q_row0 + i) * p.q_seq + (int64_t)h * p.q_head;
    const T* kc = static_cast<const T*>(p.k);
    const T* vc = static_cast<const T*>(p.v);
    const T* kp = kc + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq + (int64_t)kvh * p.k_head;
    const T* vp = vc + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq + (int64_t)kvh * p.v_head;

    float q[NT], o[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        q[t] = x < p.d_load ? to_f32(qp[x * p.q_dim]) : 0.f;
        o[t] = 0.f;
    }
    // This row's visible keys (SeqMask::row_range).
    const int diag = i + g.sk - g.sq;
    int lo, hi;
    row_keys(p, b, diag, g.sk, lo, hi);
    const float slope_log2 = p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
    const bool mods = p.softcap > 0.f || slope_log2 != 0.f;

    float m = -INFINITY, l = 0.f;
    for (int j = lo; j < hi; ++j) {
        // Paged rows through the block table; a block outside the cache reads as zeros.
        const T* kr = key_row(p, kp, kc, p.k_batch, p.k_seq, (int64_t)kvh * p.k_head, b, j);
        const T* vr = key_row(p, vp, vc, p.v_batch, p.v_seq, (int64_t)kvh * p.v_head, b, j);
        float dot = 0.f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int x = lane + 32 * t;
            if (x < p.d_load && kr) dot = fmaf(q[t], to_f32(kr[x * p.k_dim]), dot);
        }
#pragma unroll
        for (int s = 16; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffff, dot, s);
        float sc = mods ? modded_score(p, dot, slope_log2, diag, j) : dot * p.scale_log2;
        // Bias and block mask (dense calls): the key's bias added, a hidden block's key masked.
        if (p.bias || p.block_mask)
            sc = extra_score<T>(p, sc, b, h, i, j, g.sq, g.sk, p.block_mask != nullptr);
        // fmaxf drops a NaN score from the max, but its p below is NaN and poisons l and O.
        const float m_new = fmaxf(m, sc);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no -inf - -inf
        const float alpha = fast_exp2(m - m_use);
        const float pj = fast_exp2(sc - m_use);
        m = m_new;
        l = l * alpha + pj;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int x = lane + 32 * t;
            const float vx = x < p.d_load && vr ? to_f32(vr[x * p.v_dim]) : 0.f;
            o[t] = fmaf(pj, vx, o[t] * alpha);
        }
    }

    const RowEnd end = row_end(m, l, p.sinks, h);
    const float inv = end.inv;
    if (lane == 0) p.lse[g.lse0 + warp] = end.lse2 * LN2_F;
    T* op = static_cast<T*>(p.o) + (g.out_row0 + i) * p.o_seq + (int64_t)h * p.o_head;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        if (x < p.d_out) op[x] = from_f32<T>(o[t] * inv);
    }
}

}  // namespace rowwise

#define FLASH_ROWWISE_INSTANCE(NAME, T)                                                        \
    extern "C" __global__ void __launch_bounds__(rowwise::WARPS * 32) NAME(const FlashParams p) { \
        rowwise::fwd<T>(p);                                                                     \
    }
