// FlashAttention forward in exact f32 (FFMA on the CUDA cores, no TF32).
//
// Tiling: a block of 256 threads owns BR = 64 query rows of one (batch, head) and walks the
// visible keys BC at a time. Thread (rg, cg) = (tid / 16, tid % 16) computes the 4 x (BC / 16)
// score micro-tile of rows 4 rg.. and keys (BC / 16) cg.., and the 4 x (D / 16) output
// micro-tile of the same rows, so the online-softmax state (m, l) of its rows lives in its own
// registers; row reductions are shuffles among the 16 lanes sharing rg. Q and K are stored
// transposed in shared memory ([d][row]) so one 16-byte load feeds 4 rows; P goes through
// shared memory ([key][row]) for the P V product. Inputs are read through their strides
// directly (any layout, any head dim up to D; missing columns are zero).
// Masking, GQA and varlen follow common/mask.cuh, softcap and ALiBi common/score.cuh, bias and
// block masks common/extras.cuh, as in the tensor-core kernel.
#pragma once
#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/score.cuh"

namespace flash32 {

template <int D, int BC>
struct Traits {
    static constexpr int BR = 64;
    static constexpr int THREADS = 256;
    static constexpr int KPT = BC / 16;  // keys per thread
    static constexpr int CPT = D / 16;   // output columns per thread (groups of 4)
    static constexpr int LQ = BR + 4;    // padded row of the transposed tiles (16-byte aligned)
    static constexpr int LK = BC + 4;
    // Qt [D][LQ], Kt [D][LK], V [BC][D], Pt [BC][LQ]
    static constexpr int SMEM = (D * LQ + D * LK + BC * D + BC * LQ) * 4;
};

template <int D, int BC>
__device__ __forceinline__ void fwd(const FlashParams& p) {
    using Tr = Traits<D, BC>;
    constexpr int BR = Tr::BR, THREADS = Tr::THREADS, KPT = Tr::KPT, CPT = Tr::CPT;
    constexpr int LQ = Tr::LQ, LK = Tr::LK;
    static_assert(KPT == 2 || KPT == 4, "keys per thread must be one 8- or 16-byte load");
    extern __shared__ __align__(16) float smem[];
    float* sQt = smem;
    float* sKt = sQt + D * LQ;
    float* sV = sKt + D * LK;
    float* sPt = sV + BC * D;

    const int tid = threadIdx.x;
    const int rg = tid / 16, cg = tid % 16;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // longest (causal) tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    if (!block_geom(p, m_block, BR, h, b, g)) return;
    const int kvh = h / p.kv_group;
    const float* qg = static_cast<const float*>(p.q) + (int64_t)b * p.q_batch +
                      (g.q_row0 + g.m0) * p.q_seq + (int64_t)h * p.q_head;
    const float* kg = static_cast<const float*>(p.k) + (int64_t)b * p.k_batch +
                      g.k_row0 * p.k_seq + (int64_t)kvh * p.k_head;
    const float* vg = static_cast<const float*>(p.v) + (int64_t)b * p.v_batch +
                      g.k_row0 * p.v_seq + (int64_t)kvh * p.v_head;

    // Q tile, transposed; consecutive threads read consecutive columns (coalesced when the
    // last dim is contiguous).
    for (int i = tid; i < BR * D; i += THREADS) {
        const int r = i / D, x = i % D;
        sQt[x * LQ + r] = (r < g.rows && x < p.d_load) ? qg[r * p.q_seq + x * p.q_dim] : 0.f;
    }

    float acc[4][CPT];
    float row_m[4], row_l[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < CPT; ++c) acc[r][c] = 0.f;
        row_m[r] = -INFINITY;
        row_l[r] = 0.f;
    }
    const float slope_log2 = p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
    const bool mods = p.softcap > 0.f || slope_log2 != 0.f;
    // The band's key tiles, or under a block mask the list of those it opens.
    const auto kt = key_tiles<true>(p, g, b, h, m_block, BC);

    for (int q = kt.begin; q < kt.end; ++q) {
        const int entry = kt.entry(q);
        const int k0 = kt.tile(entry) * BC;
        const int rows_k = min(BC, g.sk - k0);
        __syncthreads();  // previous tile's K, V, P fully consumed
        for (int i = tid; i < BC * D; i += THREADS) {
            const int r = i / D, x = i % D;
            const bool ok = r < rows_k && x < p.d_load;
            sKt[x * LK + r] = ok ? kg[(int64_t)(k0 + r) * p.k_seq + x * p.k_dim] : 0.f;
            sV[r * D + x] = ok ? vg[(int64_t)(k0 + r) * p.v_seq + x * p.v_dim] : 0.f;
        }
        __syncthreads();

        float s[4][KPT];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int j = 0; j < KPT; ++j) s[r][j] = 0.f;
#pragma unroll 8
        for (int x = 0; x < D; ++x) {
            const float4 qv = *reinterpret_cast<const float4*>(sQt + x * LQ + 4 * rg);
            float kv[KPT];
            if constexpr (KPT == 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(sKt + x * LK + KPT * cg);
                kv[0] = k4.x; kv[1] = k4.y; kv[2] = k4.z; kv[3] = k4.w;
            } else {
                const float2 k2 = *reinterpret_cast<const float2*>(sKt + x * LK + KPT * cg);
                kv[0] = k2.x; kv[1] = k2.y;
            }
            const float q4[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int j = 0; j < KPT; ++j) s[r][j] = fmaf(q4[r], kv[j], s[r][j]);
        }

        const bool full = tile_is_full(p, g, k0, BC);
        const bool extras = (p.bias && kt.biased(entry)) || kt.partial(entry);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int diag = g.m0 + 4 * rg + r + g.sk - g.sq;
            float mx = row_m[r];
#pragma unroll
            for (int j = 0; j < KPT; ++j) {
                const int key = k0 + KPT * cg + j;
                float x = mods ? modded_score(p, s[r][j], slope_log2, diag, key)
                               : s[r][j] * p.scale_log2;
                if (extras)
                    x = extra_score<float>(p, x, b, h, g.m0 + 4 * rg + r, key, g.sq, g.sk,
                                           kt.partial(entry), kt.biased(entry));
                if (!full && !visible(p, diag, key, g.sk)) x = -INFINITY;
                s[r][j] = x;
                mx = fmaxf(mx, x);
            }
#pragma unroll
            for (int o = 1; o < 16; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
            const float m_use = mx == -INFINITY ? 0.f : mx;  // no -inf - -inf
            const float alpha = fast_exp2(row_m[r] - m_use);
            row_m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < KPT; ++j) {
                s[r][j] = fast_exp2(s[r][j] - m_use);
                sum += s[r][j];
            }
            row_l[r] = row_l[r] * alpha + sum;  // per-thread partial, reduced at the end
#pragma unroll
            for (int c = 0; c < CPT; ++c) acc[r][c] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < KPT; ++j)
            *reinterpret_cast<float4*>(sPt + (KPT * cg + j) * LQ + 4 * rg) =
                make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
        __syncthreads();

        // The tile's P V is summed on its own and then added: long rows sum their keys in two
        // levels (within a tile, then over tiles), so the rounding error grows with the tile
        // size plus the tile count instead of with the row length.
        float tile[4][CPT];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < CPT; ++c) tile[r][c] = 0.f;
#pragma unroll 4
        for (int j = 0; j < BC; ++j) {
            const float4 pv = *reinterpret_cast<const float4*>(sPt + j * LQ + 4 * rg);
            const float p4[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
            for (int q = 0; q < CPT / 4; ++q) {
                const float4 vv = *reinterpret_cast<const float4*>(sV + j * D + 64 * q + 4 * cg);
                const float v4[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        tile[r][4 * q + c] = fmaf(p4[r], v4[c], tile[r][4 * q + c]);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < CPT; ++c) acc[r][c] += tile[r][c];
    }

    float* og = static_cast<float*>(p.o) + (g.out_row0 + g.m0) * p.o_seq + (int64_t)h * p.o_head;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        float l = row_l[r];
#pragma unroll
        for (int o = 1; o < 16; o *= 2) l += __shfl_xor_sync(0xffffffff, l, o);
        // A NaN l (a NaN score) keeps NaN in the lse, as O keeps it.
        const RowEnd end = row_end(row_m[r], l, p.sinks, h);
        const float inv = end.inv;
        const int row = 4 * rg + r;
        if (row >= g.rows) continue;
        if (cg == 0) p.lse[g.lse0 + row] = end.lse2 * LN2_F;
#pragma unroll
        for (int q = 0; q < CPT / 4; ++q)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int col = 64 * q + 4 * cg + c;
                if (col < p.d_out) og[row * p.o_seq + col] = acc[r][4 * q + c] * inv;
            }
    }
}

}  // namespace flash32

// Entry points: FLASH_F32_INSTANCES (instances.cuh, generated by build.rs from
// src/cuda/instances.rs) expands this once per (head dim, keys per tile), with the shared-memory
// size the planner assumes.
#define FLASH_F32_INSTANCE(NAME, D, BC, SMEM_BYTES)                                      \
    static_assert(flash32::Traits<D, BC>::SMEM == SMEM_BYTES,                             \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");     \
    extern "C" __global__ void __launch_bounds__(256) NAME(const FlashParams p) {         \
        flash32::fwd<D, BC>(p);                                                           \
    }
