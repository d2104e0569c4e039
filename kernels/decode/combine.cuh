// Decode attention, combine step (flash-decoding's second pass) in two forms, the planner
// choosing per call (src/cuda/decode/plan.rs):
// - fused: the partial kernel (decode/partial.cuh) itself merges. Each block counts itself done
//   on a per-group counter (zeroed by the host before the launch) after its partials are
//   visible device-wide; the block that brings the count to the number of splits reads them all
//   back and merges its packed rows, one warp per row. No second launch, but one block per
//   group does the whole merge: for few rows and splits.
// - a kernel of its own, launched after the partial pass: one block per (query row, head), its
//   warps taking the splits in turn; for groups with many rows or splits.
// Both: lse = log2-sum-exp2 over the splits, O = sum_s 2^(lse_s - lse) O_s, written in the
// output dtype with the natural-log lse; the splits are added in a fixed order, so results are
// bitwise reproducible (whichever block is last). Splits that saw no key carry lse -inf and
// weigh 0 (not read); a NaN partial makes the row NaN, as in the unsplit kernel.
//
// Fused merge, per packed row: lane t holds the lse of splits t, t + 32, ...; the max and sum
// are reduced by a butterfly, the weights go to shared memory and the lanes (one column each, 32
// apart) add the splits in order, eight splits' loads in flight at a time.
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/params.cuh"
#include "decode/rows.cuh"
#include "forward/rowwise.cuh"

namespace decode {

// Most splits of one call (the planner's MAX_SPLITS): eight a lane in the merge.
constexpr int COMBINE_MAX_SPLITS = 256;
// Splits whose partials a lane loads together.
constexpr int COMBINE_UNROLL = 8;

// Counts this block's split of its group done; true in the one block that finishes the group.
// Every thread calls it after storing its partials. `sh_last`: a shared int, written only after
// the block's barrier (it may alias shared memory that the block reads until then).
__device__ __forceinline__ bool last_split(const FlashParams& p, int& sh_last) {
    // Each thread's partial stores are visible device-wide before its block is counted.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int64_t group = (int64_t)blockIdx.z * gridDim.x + blockIdx.x;
        sh_last = atomicAdd(p.split_sem + group, 1u) == (unsigned)p.num_splits - 1;
    }
    __syncthreads();
    // Acquire: the other blocks' partials (behind their fences) are read after the count.
    if (sh_last) __threadfence();
    return sh_last;
}

// Merges the splits of packed rows [0, ROWS) of the block whose first packed row is m0 (those
// that exist), warp w taking rows w, w + WARPS, ...; `sh` holds WARPS x COMBINE_MAX_SPLITS
// floats of shared memory. D: the instance width (d_out <= D).
template <typename T, int D, int ROWS, int WARPS>
__device__ __forceinline__ void combine_rows(const FlashParams& p, int m0, int kvh, int b,
                                             const BlockGeom& g, float* sh) {
    constexpr int SPL = COMBINE_MAX_SPLITS / 32;  // splits per lane
    constexpr int CPL = D / 32;                   // columns per lane
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int ns = p.num_splits;  // <= COMBINE_MAX_SPLITS (the planner's MAX_SPLITS)
    float* sh_w = sh + warp * COMBINE_MAX_SPLITS;
    const int64_t split_stride = (int64_t)p.total_q * p.o_seq;
    for (int r = warp; r < ROWS; r += WARPS) {
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        if (!x.valid) continue;
        const int64_t row_g = g.out_row0 + x.i;
        float l[SPL];
        bool any_nan = false;
        float m = -INFINITY;
#pragma unroll
        for (int u = 0; u < SPL; ++u) {
            const int s = lane + 32 * u;
            l[u] = s < ns ? __ldcg(p.lse_part + ((int64_t)s * p.heads + x.h) * p.total_q + row_g)
                          : -INFINITY;
            any_nan |= l[u] != l[u];
            m = fmaxf(m, l[u]);
        }
        const bool nan = __any_sync(0xffffffff, any_nan);
#pragma unroll
        for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < SPL; ++u) {
            l[u] = lane + 32 * u < ns && m != -INFINITY ? exp2f(l[u] - m) : 0.f;
            sum += l[u];
        }
#pragma unroll
        for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
        // The splits' sum against their max m is a row's l against its m2: the sink, if any,
        // joins it here (the partial pass left it out).
        const RowEnd end = row_end(m, sum, p.sinks, x.h);
#pragma unroll
        for (int u = 0; u < SPL; ++u)
            if (lane + 32 * u < ns) sh_w[lane + 32 * u] = l[u] * end.inv;
        __syncwarp();
        float acc[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) acc[c] = 0.f;
        const float* part = p.o_part + row_g * p.o_seq + (int64_t)x.h * p.o_head;
        for (int s0 = 0; s0 < ns; s0 += COMBINE_UNROLL) {
            float xs[COMBINE_UNROLL][CPL];
            float w[COMBINE_UNROLL];
#pragma unroll
            for (int u = 0; u < COMBINE_UNROLL; ++u) {
                const int s = s0 + u;
                w[u] = s < ns ? sh_w[s] : 0.f;
                const bool read = s < ns && (w[u] != 0.f || nan);
#pragma unroll
                for (int c = 0; c < CPL; ++c) {
                    const int col = lane + 32 * c;
                    xs[u][c] =
                        read && col < p.d_out ? __ldcg(part + s * split_stride + col) : 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < COMBINE_UNROLL; ++u)
#pragma unroll
                for (int c = 0; c < CPL; ++c) acc[c] += w[u] * xs[u][c];
        }
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            const int col = lane + 32 * c;
            if (col < p.d_out)
                static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)x.h * p.o_head + col] =
                    rowwise::from_f32<T>(acc[c]);
        }
        if (lane == 0) {
            float lse2 = m == -INFINITY ? -INFINITY : m + log2f(sum);
            if (p.sinks) lse2 = end.lse2;
            if (nan) lse2 = NAN;
            const int64_t li = p.cu_q || p.q_uniform
                                   ? (int64_t)x.h * p.lse_head + row_g
                                   : ((int64_t)b * p.heads + x.h) * p.seq_q + x.i;
            p.lse[li] = lse2 * LN2_F;
        }
        // The next row's weights overwrite these.
        __syncwarp();
    }
}

// The separate combine kernel: the widest head it merges (the widest decode instance) and its
// threads per block.
constexpr int COMBINE_MAX_D = 256;
constexpr int COMBINE_THREADS = 128;

// One block of COMBINE_THREADS per (output row, head): merges the splits' partials.
template <typename T>
__device__ __forceinline__ void combine_kernel(const FlashParams& p) {
    constexpr int WARPS = COMBINE_THREADS / 32;
    constexpr int CPL = COMBINE_MAX_D / 32;  // columns per lane
    const int64_t row_g = blockIdx.x;
    const int h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    constexpr int SPT = COMBINE_MAX_SPLITS / COMBINE_THREADS;  // splits per thread
    const int ns = p.num_splits;  // <= COMBINE_MAX_SPLITS (the planner's MAX_SPLITS)
    __shared__ float sh_w[COMBINE_MAX_SPLITS];
    __shared__ float sh_red[2][WARPS];
    __shared__ float sh_o[WARPS][COMBINE_MAX_D];

    // Thread t holds the base-2 lse of splits t, t + THREADS, ...: M = max, sum = sum_s
    // 2^(lse_s - M), both reduced in a fixed order (a thread's splits in order, lanes by a
    // butterfly, then warps in order).
    float l[SPT];
    bool any_nan = false;
    float m = -INFINITY;
#pragma unroll
    for (int u = 0; u < SPT; ++u) {
        const int s = tid + u * COMBINE_THREADS;
        l[u] = s < ns ? p.lse_part[((int64_t)s * p.heads + h) * p.total_q + row_g] : -INFINITY;
        any_nan |= l[u] != l[u];
        m = fmaxf(m, l[u]);
    }
    // A NaN partial (a NaN score) makes the row NaN, as in the unsplit kernel.
    const bool nan = __syncthreads_or(any_nan);
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (lane == 0) sh_red[0][warp] = m;
    __syncthreads();
    m = sh_red[0][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = fmaxf(m, sh_red[0][w]);
    float e[SPT], sum = 0.f;
#pragma unroll
    for (int u = 0; u < SPT; ++u) {
        e[u] = tid + u * COMBINE_THREADS < ns && m != -INFINITY ? exp2f(l[u] - m) : 0.f;
        sum += e[u];
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) sh_red[1][warp] = sum;
    __syncthreads();
    sum = sh_red[1][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) sum += sh_red[1][w];
    // The splits' sum against their max m is a row's l against its m2: the sink, if any,
    // joins it here (the partial pass left it out).
    const RowEnd end = row_end(m, sum, p.sinks, h);
    const float inv = end.inv;
#pragma unroll
    for (int u = 0; u < SPT; ++u) sh_w[tid + u * COMBINE_THREADS] = e[u] * inv;
    if (tid == 0) {
        float lse2 = m == -INFINITY ? -INFINITY : m + log2f(sum);
        if (p.sinks) lse2 = end.lse2;
        if (nan) lse2 = NAN;
        // lse output index: dense (b, h, i) or varlen (h, row).
        int64_t li;
        if (p.cu_q || p.q_uniform) {
            li = (int64_t)h * p.lse_head + row_g;
        } else {
            const int64_t bb = row_g / p.seq_q, i = row_g % p.seq_q;
            li = (bb * p.heads + h) * p.seq_q + i;
        }
        p.lse[li] = lse2 * LN2_F;
    }
    __syncthreads();

    // Warp w sums splits w, w + WARPS, ... for columns lane + 32 c; COMBINE_UNROLL splits per
    // step, so their loads are in flight together (the planner counts a round trip per
    // WARPS x COMBINE_UNROLL splits). A split that saw no key has weight 0 and O = 0: it is
    // not read (unless the row is NaN, which every split then carries into the sum).
    float acc[CPL];
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc[c] = 0.f;
    const float* part = p.o_part + row_g * p.o_seq + (int64_t)h * p.o_head;
    const int64_t split_stride = (int64_t)p.total_q * p.o_seq;
    for (int s0 = warp; s0 < ns; s0 += COMBINE_UNROLL * WARPS) {
        float x[COMBINE_UNROLL][CPL];
        float w[COMBINE_UNROLL];
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            const int s = s0 + u * WARPS;
            w[u] = s < ns ? sh_w[s] : 0.f;
            const bool read = s < ns && (w[u] != 0.f || nan);
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int col = lane + 32 * c;
                x[u][c] = read && col < p.d_out ? part[s * split_stride + col] : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u)
#pragma unroll
            for (int c = 0; c < CPL; ++c) acc[c] += w[u] * x[u][c];
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c) sh_o[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    for (int col = tid; col < p.d_out; col += COMBINE_THREADS) {
        float o = sh_o[0][col];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) o += sh_o[w][col];
        static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)h * p.o_head + col] =
            rowwise::from_f32<T>(o);
    }
}

}  // namespace decode

#define FLASH_DECODE_COMBINE(NAME, T)                                                 \
    extern "C" __global__ void __launch_bounds__(decode::COMBINE_THREADS) NAME(         \
        const FlashParams p) {                                                          \
        decode::combine_kernel<T>(p);                                                   \
    }
