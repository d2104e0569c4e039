// Decode attention, combine step (flash-decoding's second pass) in two forms, the planner
// choosing per call (src/cuda/decode/plan.rs):
// - fused: the partial kernel (decode/partial.cuh) itself merges. Each block counts itself done
//   on a per-group counter (zeroed by the host before the launch) after its partials are
//   visible device-wide; the block that brings the count to the number of splits reads them all
//   back and merges its packed rows, one warp per row. No second launch, but one block per
//   group does the whole merge: for few rows and splits.
// - a kernel of its own, launched after the partial pass: one to four warps per (query row,
//   head), four warps a block, with a width's registers, so that calls with many rows and heads
//   merge them many at a time and calls with few read each row's splits with more warps; for
//   groups with many rows or splits.
// Both merge a row with merge_row: lse = log2-sum-exp2 over the splits,
// O = sum_s 2^(lse_s - lse) O_s, written in the output dtype with the natural-log lse; the
// splits are added in a fixed order, so results are bitwise reproducible (whichever block is
// last), and the two forms agree bit for bit where the kernel gives a row one warp. Splits that
// saw no key carry lse -inf and weigh 0 (not read); a NaN partial makes the row NaN, as in the
// unsplit kernel.
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

// Merges the splits of one (output row, head) with `wpr` warps (1, 2 or 4): each computes the
// weights itself (lane t holds the lse of splits t, t + 32, ...; their max and sum are reduced by
// a butterfly, the weights go to `sh_w`, COMBINE_MAX_SPLITS floats of shared memory, the warp's
// own), then warp `pw` of them adds splits pw, pw + wpr, ... in order, its lanes one column each
// (32 apart), COMBINE_UNROLL splits' loads in flight at a time. With more than one warp their
// sums meet in `sh_o` (wpr x D floats) behind named barrier `bar` (the group's 32 wpr threads)
// and are added in warp order by warp 0, which writes the row's output and its natural-log lse
// at `li`. A row's result depends on wpr (the order of its additions), which the planner derives
// from the shape and the device. D: the widest head (d_out <= D).
template <typename T, int D>
__device__ __forceinline__ void merge_row(const FlashParams& p, int64_t row_g, int h, int64_t li,
                                          float* sh_w, int pw = 0, int wpr = 1,
                                          float* sh_o = nullptr, int bar = 0) {
    constexpr int SPL = COMBINE_MAX_SPLITS / 32;  // splits per lane
    constexpr int CPL = D / 32;                   // columns per lane
    const int lane = threadIdx.x % 32;
    const int ns = p.num_splits;  // <= COMBINE_MAX_SPLITS (the planner's MAX_SPLITS)
    const int64_t split_stride = (int64_t)p.total_q * p.o_seq;
    float l[SPL];
    bool any_nan = false;
    float m = -INFINITY;
#pragma unroll
    for (int u = 0; u < SPL; ++u) {
        const int s = lane + 32 * u;
        l[u] = s < ns ? __ldcg(p.lse_part + ((int64_t)s * p.heads + h) * p.total_q + row_g)
                      : -INFINITY;
        any_nan |= l[u] != l[u];
        m = fmaxf(m, l[u]);
    }
    // A NaN partial (a NaN score) makes the row NaN, as in the unsplit kernel.
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
    // The splits' sum against their max m is a row's l against its m2: the sink, if any, joins
    // it here (the partial pass left it out).
    const RowEnd end = row_end(m, sum, p.sinks, h);
#pragma unroll
    for (int u = 0; u < SPL; ++u)
        if (lane + 32 * u < ns) sh_w[lane + 32 * u] = l[u] * end.inv;
    __syncwarp();
    // A split that saw no key has weight 0 and O = 0: it is not read (unless the row is NaN,
    // which every split then carries into the sum).
    float acc[CPL];
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc[c] = 0.f;
    const float* part = p.o_part + row_g * p.o_seq + (int64_t)h * p.o_head;
    for (int s0 = pw; s0 < ns; s0 += COMBINE_UNROLL * wpr) {
        float xs[COMBINE_UNROLL][CPL];
        float w[COMBINE_UNROLL];
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            const int s = s0 + u * wpr;
            w[u] = s < ns ? sh_w[s] : 0.f;
            const bool read = s < ns && (w[u] != 0.f || nan);
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int col = lane + 32 * c;
                xs[u][c] = read && col < p.d_out ? __ldcg(part + s * split_stride + col) : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u)
#pragma unroll
            for (int c = 0; c < CPL; ++c) acc[c] += w[u] * xs[u][c];
    }
    if (wpr > 1) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) sh_o[pw * D + lane + 32 * c] = acc[c];
        asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(32 * wpr) : "memory");
        if (pw != 0) return;
        for (int w = 1; w < wpr; ++w)
#pragma unroll
            for (int c = 0; c < CPL; ++c) acc[c] += sh_o[w * D + lane + 32 * c];
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
        const int col = lane + 32 * c;
        if (col < p.d_out)
            static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)h * p.o_head + col] =
                rowwise::from_f32<T>(acc[c]);
    }
    if (lane == 0) {
        float lse2 = m == -INFINITY ? -INFINITY : m + log2f(sum);
        if (p.sinks) lse2 = end.lse2;
        if (nan) lse2 = NAN;
        p.lse[li] = lse2 * LN2_F;
    }
    // The next row's weights overwrite these.
    __syncwarp();
}

// Merges the splits of packed rows [0, ROWS) of the block whose first packed row is m0 (those
// that exist), warp w taking rows w, w + WARPS, ...; `sh` holds WARPS x COMBINE_MAX_SPLITS
// floats of shared memory. D: the instance width (d_out <= D).
template <typename T, int D, int ROWS, int WARPS>
__device__ __forceinline__ void combine_rows(const FlashParams& p, int m0, int kvh, int b,
                                             const BlockGeom& g, float* sh) {
    const int warp = threadIdx.x / 32;
    for (int r = warp; r < ROWS; r += WARPS) {
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        if (!x.valid) continue;
        const int64_t row_g = g.out_row0 + x.i;
        const int64_t li = p.cu_q || p.q_uniform ? (int64_t)x.h * p.lse_head + row_g
                                                 : ((int64_t)b * p.heads + x.h) * p.seq_q + x.i;
        merge_row<T, D>(p, row_g, x.h, li, sh + warp * COMBINE_MAX_SPLITS);
    }
}

// The separate combine kernel: the widest head it merges (the widest decode instance), and its
// warps per block.
constexpr int COMBINE_MAX_D = 256;
constexpr int COMBINE_WARPS = 4;

// Block (x, h) merges COMBINE_WARPS / wpr rows of head h (rows x COMBINE_WARPS / wpr, ...),
// `wpr` warps each (p.combine_warps: 1, 2 or 4; merge_row): more warps a row where the call has
// too few rows and heads to fill the GPU, so each row's splits are read in fewer round trips;
// one where it has many, merged many at a time with few registers a thread.
template <typename T, int D>
__device__ __forceinline__ void combine_kernel(const FlashParams& p) {
    __shared__ float sh_w[COMBINE_WARPS][COMBINE_MAX_SPLITS];
    __shared__ float sh_o[COMBINE_WARPS][D];
    const int wpr = p.combine_warps == 2 || p.combine_warps == 4 ? p.combine_warps : 1;
    const int warp = threadIdx.x / 32, group = warp / wpr;
    const int64_t row_g = (int64_t)blockIdx.x * (COMBINE_WARPS / wpr) + group;
    const int h = blockIdx.y;
    // A group's warps leave together (none of them reaches its barrier).
    if (row_g >= p.total_q) return;
    // lse output index: dense (b, h, i) or varlen (h, row).
    int64_t li;
    if (p.cu_q || p.q_uniform) {
        li = (int64_t)h * p.lse_head + row_g;
    } else {
        const int64_t bb = row_g / p.seq_q, i = row_g % p.seq_q;
        li = (bb * p.heads + h) * p.seq_q + i;
    }
    // Barrier 0 is __syncthreads'; a group's is 1 + its index.
    merge_row<T, D>(p, row_g, h, li, sh_w[warp], warp % wpr, wpr, sh_o[group * wpr], 1 + group);
}

}  // namespace decode

// One combine kernel per decode width (NAME_d64, NAME_d128, NAME_d256): a lane's columns, and
// its registers, are the width's.
#define FLASH_DECODE_COMBINE_D(NAME, T, D)                                                     \
    extern "C" __global__ void __launch_bounds__(decode::COMBINE_WARPS * 32) NAME##_d##D(     \
        const FlashParams p) {                                                                 \
        decode::combine_kernel<T, D>(p);                                                       \
    }
#define FLASH_DECODE_COMBINE(NAME, T)    \
    FLASH_DECODE_COMBINE_D(NAME, T, 64)  \
    FLASH_DECODE_COMBINE_D(NAME, T, 128) \
    FLASH_DECODE_COMBINE_D(NAME, T, 256)
