// FlashAttention-2 forward for f16/bf16 on tensor cores (sm_80+ mma.sync), f32 accumulation.
//
// Tiling: one thread block computes BR = 16 * MT * WARPS query rows of one (batch, head) against
// all visible keys, BC keys at a time. Each warp owns MT slices of 16 rows (FA2 split: no
// inter-warp reduction); its O accumulator, row max m and row sum l stay in registers for the
// whole loop and O is normalised once at the end.
//   S = Q K^T : mma.m16n8k16, A = Q from shared memory (ldmatrix), B = K (ldmatrix)
//   P = exp2(S * scale * log2 e - m) : computed in the S registers, rounded to T and fed directly
//       as the A operand of the next mma (the C fragment layout of two n8 tiles is exactly the A
//       layout of one k16 step), so P never touches shared memory
//   O += P V   : B = V (ldmatrix.trans)
// K/V tiles stream through a STAGES-deep cp.async ring; the load of tile t+STAGES-1 is issued
// before tile t is computed. Shared memory rows are 16-byte chunks permuted by an XOR swizzle so
// that the 8 rows an ldmatrix reads hit distinct banks (see `swz`).
// Causal / sliding-window tiles outside the band are skipped by the loop bounds; only tiles the
// band cuts (or the key tail) run the per-element mask. The plain instance folds scale * log2 e
// into the exp2 FFMA; the `_mods` instance applies softcap, ALiBi and the bias in the score
// registers, and walks the block mask's list of key tiles (common/extras.cuh).
// Rows that see no key end with l = 0 and are written as 0 with lse = -inf.
// Heads wider than 256 would not fit O in registers: such instances keep Q and K whole (D) but
// give each block DV < D columns of V and O, blockIdx.x / q_tiles choosing which.
#pragma once
#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "common/swizzle.cuh"

namespace flash {

// ---- the kernel -----------------------------------------------------------------------------

// D: head dim of Q and K in shared memory; DV: the V/O columns this block computes (D for heads
// up to 256; wider heads are split by columns across blocks, each recomputing S over all of D).
template <typename T, int D, int DV, int MT, int BC, int WARPS, int STAGES>
struct Traits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int BR = 16 * MT * WARPS;  // query rows per block
    static constexpr int NT = BC / 8;           // n8 tiles of S per 16-row slice
    static constexpr int DT = DV / 8;           // n8 tiles of O per 16-row slice
    static constexpr int KV = BC * (D + DV);    // elements of one K + V stage
    static constexpr int SMEM = (BR * D + STAGES * KV) * (int)sizeof(T);
};

template <typename T, int D, int DV, int MT, int BC, int WARPS, int STAGES, bool MODS>
__device__ __forceinline__ void flash_fwd(const FlashParams& p) {
    using Tr = Traits<T, D, DV, MT, BC, WARPS, STAGES>;
    constexpr int BR = Tr::BR, NT = Tr::NT, DT = Tr::DT, THREADS = Tr::THREADS;
    constexpr int KV = Tr::KV;
    static_assert(BC % 16 == 0 && D % 16 == 0 && DV % 16 == 0, "tiles are whole mma steps");
    static_assert(DV <= D, "O is staged in the Q tile");
    static_assert(STAGES >= 2, "the ring needs a buffer in flight");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + BR * D;  // stage s: K (BC x D) at sKV + s KV, V (BC x DV) right after

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Reverse tile order: with causal masks the last query tiles have the most keys, so the
    // longest blocks start first and the short ones fill the tail of the grid.
    // Column blocks of V/O are the slow part of blockIdx.x.
    // With DV == D there is no split: v_col0 is the constant 0, so no register carries it through
    // the loop and the instance compiles to the unsplit kernel.
    const int q_tiles = DV == D ? (int)gridDim.x : (int)gridDim.x / p.dv_splits;
    const int m_block = q_tiles - 1 - (int)(DV == D ? blockIdx.x : blockIdx.x % q_tiles);
    const int v_col0 = DV == D ? 0 : (int)(blockIdx.x / q_tiles) * DV;
    // Without a column split V's columns are K's, so both loads share one column predicate; a
    // separate run-time bound cost the d 128 loop ~20 predicate ops per tile (2-4% measured).
    const int dv_load = DV == D ? p.d_load : min(DV, p.d_load - v_col0);
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    if (!block_geom(p, m_block, BR, h, b, g)) return;
    const int kvh = h / p.kv_group;

    const T* qg = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch +
                  (g.q_row0 + g.m0) * p.q_seq + (int64_t)h * p.q_head;
    const T* kg = static_cast<const T*>(p.k) + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq +
                  (int64_t)kvh * p.k_head;
    const T* vg = static_cast<const T*>(p.v) + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq +
                  (int64_t)kvh * p.v_head + v_col0;
    // Block-uniform values the key loop needs once per tile live in shared memory rather than
    // registers: at d 128 the O and S accumulators leave no room for them (ptxas spilled them).
    // They are read right after the loop's barrier, so their live ranges stay short.
    __shared__ const T* sh_kg;
    __shared__ const T* sh_vg;
    __shared__ int sh_sk;
    __shared__ int sh_dv_load;
    if (tid == 0) {
        sh_kg = kg;
        sh_vg = vg;
        sh_sk = g.sk;
        sh_dv_load = dv_load;
    }

    // Per-thread rows: slice mt of this warp, rows (lane / 4) and (lane / 4 + 8) of the slice.
    const int row_base = warp * 16 * MT + lane / 4;
    float acc_o[MT][DT][4];
    float row_m[MT][2], row_l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < DT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][j][e] = 0.f;
        row_m[mt][0] = row_m[mt][1] = -INFINITY;
        row_l[mt][0] = row_l[mt][1] = 0.f;
    }

    const SwzRow<D> q_off(warp * 16 * MT + lane % 16, lane / 16);
    const SwzRow<D> k_off((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<DV> v_off(lane % 16, lane / 16);
    // Diagonal of this thread's first row; its other rows are 8 and 16 further.
    const int diag_t = g.m0 + row_base + g.sk - g.sq;

    // The band's key tiles, or under a block mask (MODS instances) the list of those it opens.
    const auto kt = key_tiles<MODS>(p, g, b, h, m_block, BC);
    const float slope_log2 = p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
    const float unit = MODS ? 1.f : p.scale_log2;  // base-2 logit per unit of row_m / acc_s

    // Prologue: Q plus the first STAGES-1 K/V tiles, one commit group per tile.
    load_tile<T, D, BR, THREADS>(sQ, qg, p.q_seq, g.rows, p.d_load);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int q = kt.begin + s;
        if (q < kt.end) {
            const int t = kt.tile(kt.entry(q));
            T* sK = sKV + s * KV;
            const int rows = min(BC, g.sk - t * BC);
            load_tile<T, D, BC, THREADS>(sK, kg + (int64_t)t * BC * p.k_seq, p.k_seq, rows,
                                         p.d_load);
            load_tile<T, DV, BC, THREADS>(sK + BC * D, vg + (int64_t)t * BC * p.v_seq, p.v_seq,
                                          rows, dv_load);
        }
        cp_async_commit();
    }

    for (int q = kt.begin; q < kt.end; ++q) {
        const int it = q - kt.begin;
        const int entry = kt.entry(q), t = kt.tile(entry);
        cp_async_wait<STAGES - 2>();  // tile t (and Q) have landed for this thread...
        __syncthreads();              // ...and for all; everyone is done with tile t-1's buffer
        {
            const int qn = q + STAGES - 1;
            if (qn < kt.end) {
                const int tn = kt.tile(kt.entry(qn));
                T* sK = sKV + ((it + STAGES - 1) % STAGES) * KV;
                const int rows = min(BC, sh_sk - tn * BC);
                load_tile<T, D, BC, THREADS>(sK, sh_kg + (int64_t)tn * BC * p.k_seq, p.k_seq, rows,
                                             p.d_load);
                load_tile<T, DV, BC, THREADS>(sK + BC * D, sh_vg + (int64_t)tn * BC * p.v_seq,
                                              p.v_seq, rows, DV == D ? p.d_load : sh_dv_load);
            }
            cp_async_commit();
        }
        const T* sK = sKV + (it % STAGES) * KV;
        const T* sV = sK + BC * D;

        // S = Q K^T for this warp's MT x 16 rows and BC keys.
        float acc_s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], sQ + q_off.at(mt, kk));
#pragma unroll
            for (int np = 0; np < BC / 16; ++np) {
                uint32_t kb[4];
                // matrices: (keys 0-7, k lo) (keys 0-7, k hi) (keys 8-15, k lo) (keys 8-15, k hi)
                ldsm_x4(kb, sK + k_off.at(np, kk));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc_s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    Mma<T>::run(acc_s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }

        // Softcap / ALiBi / bias turn the scores into base-2 logits here (unit 1). The plain kernel
        // keeps raw dot products (unit scale * log2 e, > 0 by the host's choice of kernel) and
        // folds the scale into the exponent's FFMA below, as max(s) * u = max(s * u) for u > 0.
        const int k0 = t * BC;
        const int col = k0 + 2 * (lane % 4);  // key of element e = 0 of n-tile 0
        if constexpr (MODS) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int diag = diag_t + mt * 16 + (e / 2) * 8;
                        acc_s[mt][j][e] =
                            modded_score(p, acc_s[mt][j][e], slope_log2, diag, col + j * 8 + e % 2);
                    }
            // Bias, and the block mask where a hidden block cuts this tile.
            if ((p.bias && kt.biased(entry)) || kt.partial(entry))
                tile_extras<T, MT, NT>(p, &acc_s[0][0][0], b, h, g.m0 + row_base, col, k0, g.sq,
                                       g.sk, kt.partial(entry), LOG2E_F, kt.biased(entry));
        }
        // Per-element mask only where the band or the key tail cuts this tile.
        if (!tile_is_full(p, g, k0, BC)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    // The row's visible keys relative to col: each element compares its column
                    // offset (a constant) against two bounds.
                    const KeySpan ks = key_span(p, diag_t + mt * 16 + hf * 8, g.sk, col);
                    const int lo = ks.lo, hi = ks.hi;
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = j * 8 + e;
                            if (c < lo || c >= hi) acc_s[mt][j][2 * hf + e] = -INFINITY;
                        }
                }
        }

        // Online softmax: new running max, rescale O and l, exponentiate in place.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float mx = row_m[mt][hf];
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][j][2 * hf], acc_s[mt][j][2 * hf + 1]));
                // The 4 threads of a quad hold the same row.
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                // A row that has seen only masked keys keeps max -inf; subtracting 0 instead
                // keeps exp2 at 0 rather than NaN (-inf - -inf).
                const float m_scaled = mx == -INFINITY ? 0.f : mx * unit;
                const float alpha = fast_exp2(fmaf(row_m[mt][hf], unit, -m_scaled));
                row_m[mt][hf] = mx;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = fast_exp2(fmaf(acc_s[mt][j][2 * hf + e], unit, -m_scaled));
                        acc_s[mt][j][2 * hf + e] = pv;
                        sum += pv;
                    }
                // l stays a per-thread partial sum (quad-reduced once at the end).
                row_l[mt][hf] = row_l[mt][hf] * alpha + sum;
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    acc_o[mt][j][2 * hf] *= alpha;
                    acc_o[mt][j][2 * hf + 1] *= alpha;
                }
            }
        // O += P V, P straight from the S registers: the C layout of n-tiles (2 kk, 2 kk + 1)
        // is the A layout of k-step kk once rounded to T.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Mma<T>::pack(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
                pa[mt][1] = Mma<T>::pack(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
                pa[mt][2] = Mma<T>::pack(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
                pa[mt][3] = Mma<T>::pack(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < DV / 16; ++dp) {
                uint32_t vb[4];
                // matrices: (keys 0-7, d lo) (keys 8-15, d lo) (keys 0-7, d hi) (keys 8-15, d hi)
                ldsm_x4_t(vb, sV + v_off.at(kk, dp));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc_o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    Mma<T>::run(acc_o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    }
    // Only empty groups can remain after the loop, but a block that saw no key never waited for
    // Q: drain every copy and let all threads finish before sQ is reused for the output.
    cp_async_wait<0>();
    __syncthreads();

    // Epilogue: one normalisation, lse, then stage the tile in sQ for 16-byte coalesced stores.
    // Each warp overwrites only its own Q rows, which no other warp reads. The geometry is
    // recomputed (after the barrier above, so nothing is carried through the loop).
    block_geom(p, m_block, BR, h, b, g);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = row_l[mt][hf];
            l += __shfl_xor_sync(0xffffffff, l, 1);
            l += __shfl_xor_sync(0xffffffff, l, 2);
            const RowEnd end = row_end(row_m[mt][hf] * unit, l, p.sinks, h);
            const float inv = end.inv;
            const int r = row_base + mt * 16 + hf * 8;
            if (lane % 4 == 0 && r < g.rows && v_col0 == 0) p.lse[g.lse0 + r] = end.lse2 * LN2_F;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                const int c = j * 8 + 2 * (lane % 4);
                *reinterpret_cast<uint32_t*>(sQ + swz<DV>(r, c / 8) + c % 8) =
                    Mma<T>::pack(acc_o[mt][j][2 * hf] * inv, acc_o[mt][j][2 * hf + 1] * inv);
            }
        }
    __syncthreads();
    T* og = static_cast<T*>(p.o) + (g.out_row0 + g.m0) * p.o_seq + (int64_t)h * p.o_head + v_col0;
    constexpr int C = DV / 8;
    const int d_out = min(DV, p.d_out - v_col0);
    if (p.d_out % 8 == 0) {
#pragma unroll
        for (int it = 0; it < BR * C / THREADS; ++it) {
            const int i = tid + it * THREADS;
            const int r = i / C, c = i % C;
            if (r < g.rows && c * 8 < d_out)
                *reinterpret_cast<uint4*>(og + r * p.o_seq + c * 8) =
                    *reinterpret_cast<const uint4*>(sQ + swz<DV>(r, c));
        }
    } else {
        // Head dims that are not a multiple of 8 (inputs were padded by the pack kernel).
        for (int i = tid; i < BR * d_out; i += THREADS) {
            const int r = i / d_out, c = i % d_out;
            if (r < g.rows) og[r * p.o_seq + c] = sQ[swz<DV>(r, c / 8) + c % 8];
        }
    }
}

// Blocks whose band holds no key never enter the loop: they fall through to the epilogue with
// l = 0 and write zeros / -inf, which is the contract for rows that see nothing.

}  // namespace flash

// One extern "C" entry point per (dtype, instance) of the table in src/cuda/instances.rs, which
// build.rs expands into FLASH_MMA_INSTANCES (instances.cuh) together with the shared-memory size
// the Rust planner assumes for it; the static_assert ties that figure to Traits::SMEM.
// Softcap, ALiBi, bias and block masks get their own `_mods` entry: fused into the plain kernel
// they would cost it registers (and spills at d 128) even when off.
#define FLASH_MMA_INSTANCE(NAME, T, D, DV, MT, BC, WARPS, STAGES, MINB, SMEM_BYTES)            \
    static_assert(flash::Traits<T, D, DV, MT, BC, WARPS, STAGES>::SMEM == SMEM_BYTES,           \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) NAME(const FlashParams p) {  \
        flash::flash_fwd<T, D, DV, MT, BC, WARPS, STAGES, false>(p);                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                              \
        NAME##_mods(const FlashParams p) {                                                      \
        flash::flash_fwd<T, D, DV, MT, BC, WARPS, STAGES, true>(p);                             \
    }
