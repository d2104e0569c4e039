// The exact backward pass: any dtype (f32 arithmetic throughout), any head dim up to 512, any
// operand strides. Three kernels, each deterministic (fixed summation order, no atomics):
//   bwd_dsum : D_i = rowsum(dO_i * O_i), one warp per (row, head), laid out like the lse
//   bwd_dkdv : one warp per key j of one K/V head: for every query head h of its group and every
//              row i that sees j, recompute s_ij and P_ij = exp(s_ij - lse_i), then
//              dV_j += P_ij dO_i and dK_j += dS_ij q_i, with dS_ij = P_ij (dO_i . v_j - D_i)
//              (times 1 - tanh^2 under a softcap, and the softmax scale)
//   bwd_dq   : one warp per query row i: dQ_i = scale * sum_j dS_ij k_j over the row's keys
// A bias and a block mask (common/extras.cuh) enter s_ij after the score modifier.
// Lane t holds columns t, t + 32, ... (NT of them) of every row vector; dot products are
// per-lane partial sums reduced by shuffles, so every lane ends with the same value.
#pragma once
#include "backward/common.cuh"
#include "backward/params.cuh"
#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/score.cuh"
#include "forward/rowwise.cuh"

namespace bwd {

constexpr int GENERIC_WARPS = 4;  // BWD_GENERIC_WARPS in src/cuda/backward/instances.rs

using rowwise::from_f32;
using rowwise::to_f32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// D_i = sum_x dO[i, h, x] * O[i, h, x] over the contiguous output rows.
template <typename T>
__device__ __forceinline__ void dsum(const BwdParams& bp) {
    const FlashParams& p = bp.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t r = (int64_t)blockIdx.x * GENERIC_WARPS + warp;
    const int h = blockIdx.y;
    if (r >= p.total_q) return;
    const T* o = static_cast<const T*>(p.o) + r * p.o_seq + (int64_t)h * p.o_head;
    const T* g = static_cast<const T*>(bp.dout) + r * p.o_seq + (int64_t)h * p.o_head;
    float acc = 0.f;
    for (int x = lane; x < p.d_out; x += 32) acc += to_f32(o[x]) * to_f32(g[x]);
    acc = warp_sum(acc);
    if (lane == 0) {
        const int64_t idx = p.cu_q ? (int64_t)h * p.lse_head + r
                                   : ((r / p.seq_q) * p.heads + h) * p.seq_q + r % p.seq_q;
        bp.dsum[idx] = acc;
    }
}

// dK_j and dV_j of one key of K/V head blockIdx.y, summed over the group's query heads.
template <typename T, int NT>
__device__ __forceinline__ void dkdv(const BwdParams& bp) {
    const FlashParams& p = bp.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kvh = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    seq_lengths<false>(p, b, g);
    const int j = blockIdx.x * GENERIC_WARPS + warp;
    if (j >= g.sk) return;
    const int d = p.d_out;
    const T* kp = static_cast<const T*>(p.k) + (int64_t)b * p.k_batch + (g.k_row0 + j) * p.k_seq +
                  (int64_t)kvh * p.k_head;
    const T* vp = static_cast<const T*>(p.v) + (int64_t)b * p.v_batch + (g.k_row0 + j) * p.v_seq +
                  (int64_t)kvh * p.v_head;
    float k[NT], v[NT], dk[NT], dv[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        k[t] = x < d ? to_f32(kp[x * p.k_dim]) : 0.f;
        v[t] = x < d ? to_f32(vp[x * p.v_dim]) : 0.f;
        dk[t] = dv[t] = 0.f;
    }
    // Rows that see key j: diag(i) = i + off, visible iff diag - left <= j <= diag + right.
    const int64_t off = (int64_t)g.sk - g.sq;
    int64_t i_lo = 0, i_hi = g.sq;
    if (p.win_right >= 0) i_lo = max((int64_t)0, j - off - p.win_right);
    if (p.win_left >= 0) i_hi = min((int64_t)g.sq, j - off + p.win_left + 1);
    const bool extras = p.bias != nullptr || p.block_mask != nullptr;
    for (int hh = 0; hh < p.kv_group; ++hh) {
        const int h = kvh * p.kv_group + hh;
        const float slope = p.alibi ? p.alibi[b * p.alibi_batch + h] : 0.f;
        const T* qp = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch + g.q_row0 * p.q_seq +
                      (int64_t)h * p.q_head;
        const T* gp = static_cast<const T*>(bp.dout) + g.out_row0 * p.o_seq + (int64_t)h * p.o_head;
        const int64_t l0 = lse_index(p, b, h, g.q_row0, 0);
        for (int64_t i = i_lo; i < i_hi; ++i) {
            const float lse = p.lse[l0 + i];
            // A row that sees no key has no gradient (and lse = -inf would give exp(+inf)).
            if (lse == -INFINITY) continue;
            const T* qi = qp + i * p.q_seq;
            const T* gi = gp + i * p.o_seq;
            float q[NT], go[NT], dot = 0.f, dp = 0.f;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int x = lane + 32 * t;
                q[t] = x < d ? to_f32(qi[x * p.q_dim]) : 0.f;
                go[t] = x < d ? to_f32(gi[x]) : 0.f;
                dot += q[t] * k[t];
                dp += go[t] * v[t];
            }
            dot = warp_sum(dot);
            dp = warp_sum(dp);
            float chain;
            float s = modded_score_exact(p, bp.scale, dot, slope, (int)(i + off), j, chain);
            if (extras)
                s = extra_score<T>(p, s, b, h, (int)i, j, g.sq, g.sk, p.block_mask != nullptr,
                                   true, true);
            const float pij = expf(s - lse);
            const float ds = pij * (dp - bp.dsum[l0 + i]) * chain;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                dv[t] += pij * go[t];
                dk[t] += ds * q[t];
            }
        }
    }
    const int64_t row = (int64_t)b * bp.dkv_batch + (g.k_row0 + j) * bp.dkv_seq + (int64_t)kvh * d;
    T* dkp = static_cast<T*>(bp.dk) + row;
    T* dvp = static_cast<T*>(bp.dv) + row;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        if (x < d) {
            dkp[x] = from_f32<T>(dk[t] * bp.scale);
            dvp[x] = from_f32<T>(dv[t]);
        }
    }
}

// dQ_i of one query row of head blockIdx.y over the row's visible keys.
template <typename T, int NT>
__device__ __forceinline__ void dq(const BwdParams& bp) {
    const FlashParams& p = bp.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    if (!block_geom(p, blockIdx.x, GENERIC_WARPS, h, b, g) || warp >= g.rows) return;
    const int i = g.m0 + warp;
    const int d = p.d_out;
    const int kvh = h / p.kv_group;
    const T* qi = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch + (g.q_row0 + i) * p.q_seq +
                  (int64_t)h * p.q_head;
    const T* gi = static_cast<const T*>(bp.dout) + (g.out_row0 + i) * p.o_seq + (int64_t)h * p.o_head;
    const T* kp = static_cast<const T*>(p.k) + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq +
                  (int64_t)kvh * p.k_head;
    const T* vp = static_cast<const T*>(p.v) + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq +
                  (int64_t)kvh * p.v_head;
    const int64_t li = lse_index(p, b, h, g.q_row0, i);
    const float lse = p.lse[li];
    const float dsum_i = bp.dsum[li];
    const float slope = p.alibi ? p.alibi[g.slope_idx] : 0.f;
    float q[NT], go[NT], acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        q[t] = x < d ? to_f32(qi[x * p.q_dim]) : 0.f;
        go[t] = x < d ? to_f32(gi[x]) : 0.f;
        acc[t] = 0.f;
    }
    const int diag = i + g.sk - g.sq;
    int lo, hi;
    row_keys(p, b, diag, g.sk, lo, hi);
    if (lse == -INFINITY) hi = lo;
    const bool extras = p.bias != nullptr || p.block_mask != nullptr;
    for (int j = lo; j < hi; ++j) {
        const T* kj = kp + (int64_t)j * p.k_seq;
        const T* vj = vp + (int64_t)j * p.v_seq;
        float k[NT], dot = 0.f, dp = 0.f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int x = lane + 32 * t;
            k[t] = x < d ? to_f32(kj[x * p.k_dim]) : 0.f;
            const float v = x < d ? to_f32(vj[x * p.v_dim]) : 0.f;
            dot += q[t] * k[t];
            dp += go[t] * v;
        }
        dot = warp_sum(dot);
        dp = warp_sum(dp);
        float chain;
        float s = modded_score_exact(p, bp.scale, dot, slope, diag, j, chain);
        if (extras)
            s = extra_score<T>(p, s, b, h, i, j, g.sq, g.sk, p.block_mask != nullptr, true, true);
        const float ds = expf(s - lse) * (dp - dsum_i) * chain;
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] += ds * k[t];
    }
    T* dqi = static_cast<T*>(bp.dq) + (g.out_row0 + i) * p.o_seq + (int64_t)h * p.o_head;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        if (x < d) dqi[x] = from_f32<T>(acc[t] * bp.scale);
    }
}

}  // namespace bwd

// Entry points of one dtype: the D pass and the exact dK/dV and dQ kernels for heads up to
// 64, 128, 256 and 512 columns (NT = 2, 4, 8, 16 per lane).
#define FLASH_BWD_GENERIC_NT(PREFIX, T, NT)                                                   \
    extern "C" __global__ void __launch_bounds__(bwd::GENERIC_WARPS * 32, 1)                   \
        PREFIX##_dkdv_generic_##NT(const BwdParams p) {                                       \
        bwd::dkdv<T, NT>(p);                                                                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bwd::GENERIC_WARPS * 32, 1)                   \
        PREFIX##_dq_generic_##NT(const BwdParams p) {                                         \
        bwd::dq<T, NT>(p);                                                                    \
    }
#define FLASH_BWD_GENERIC_INSTANCES(PREFIX, T)                                                \
    extern "C" __global__ void __launch_bounds__(bwd::GENERIC_WARPS * 32, 1)                   \
        PREFIX##_dsum(const BwdParams p) {                                                    \
        bwd::dsum<T>(p);                                                                      \
    }                                                                                         \
    FLASH_BWD_GENERIC_NT(PREFIX, T, 2)                                                        \
    FLASH_BWD_GENERIC_NT(PREFIX, T, 4)                                                        \
    FLASH_BWD_GENERIC_NT(PREFIX, T, 8)                                                        \
    FLASH_BWD_GENERIC_NT(PREFIX, T, 16)
