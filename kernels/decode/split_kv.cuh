// Decode attention (few query rows per KV head against a long KV cache), f16/bf16 on tensor
// cores, in two passes as in flash-decoding:
//
// 1. Partial pass (`decode_partial`), grid (num_splits, kv_heads * m_tiles, batch):
//    - GQA packing: the query heads sharing one K/V head and all their seq_q rows form one
//      16-row mma tile (packed row r -> query i = r / group, head kvh * group + r % group), so each
//      K/V row is read from memory once per tile instead of once per query head.
//    - Split-KV: blockIdx.x takes one slice of `split_keys` keys of the sequence, so a batch of
//      few sequences still fills every SM.
//    - The block streams its keys BC = 16 * WARPS at a time through a STAGES-deep cp.async ring;
//      warp w computes S = Q K^T for keys [16 w, 16 w + 16) of each tile (mma m16n8k16, Q and K
//      by ldmatrix), runs the online softmax on its 16 x 16 scores and accumulates O += P V in
//      registers (P straight from the S registers, V by ldmatrix.trans), as the prefill kernel.
//    - After the loop the warps' (m, l, O) are merged through shared memory in warp order (a
//      fixed order: bitwise deterministic). With one split the block writes the output and lse
//      directly; otherwise it writes O / l (f32) and its base-2 log-sum-exp to the split scratch.
// 2. Combine (`decode_combine`), one block per (query row, head): lse = log2-sum-exp2 over the
//    splits, O = sum_s 2^(lse_s - lse) O_s, written in the output dtype with the natural-log lse.
//    Splits that saw no key carry lse -inf and weigh 0; a row no split saw outputs 0, lse -inf.
// Masking (causal, windows), softcap and ALiBi follow src/semantics.rs through common/.
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "forward/mma.cuh"
#include "forward/rowwise.cuh"

namespace decode {

using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::ldsm_x4;
using flash::ldsm_x4_t;
using flash::Mma;
using flash::swz;
using flash::SwzRow;

constexpr int ROWS = 16;  // packed rows per tile: one mma M tile

template <typename T, int D, int WARPS, int STAGES>
struct Traits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int BC = 16 * WARPS;  // keys per K/V tile, 16 per warp
    static constexpr int DT = D / 8;       // n8 tiles of O
    // Q tile, then STAGES (K, V) tiles. The f32 merge buffer of the epilogue reuses the ring.
    static constexpr int SMEM = (ROWS * D + STAGES * 2 * BC * D) * (int)sizeof(T);
    static_assert(ROWS * D * 4 <= STAGES * 2 * BC * D * (int)sizeof(T), "merge buffer fits");
};

// Where a packed row of the tile lives: query row i of head h, or nothing (r >= group * sq).
struct PackedRow {
    int i, h;
    bool valid;
};
__device__ __forceinline__ PackedRow packed_row(const FlashParams& p, int m0, int r, int kvh,
                                                int sq) {
    const int pr = m0 + r;
    PackedRow x;
    x.i = pr / p.kv_group;
    x.h = kvh * p.kv_group + pr % p.kv_group;
    x.valid = x.i < sq;
    return x;
}

// Copies ROWS x D of Q (packed rows, per-row addresses) into a swizzled tile, zero-filling rows
// past the packed length and columns past d_load.
template <typename T, int D, int THREADS>
__device__ __forceinline__ void load_q(T* sQ, const FlashParams& p, int b, const BlockGeom& g,
                                       int m0, int kvh) {
    constexpr int C = D / 8;
    for (int idx = threadIdx.x; idx < ROWS * C; idx += THREADS) {
        const int r = idx / C, c = idx % C;
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        const bool ok = x.valid && c * 8 < p.d_load;
        const T* src = static_cast<const T*>(p.q);
        if (ok)
            src += (int64_t)b * p.q_batch + (g.q_row0 + x.i) * p.q_seq + (int64_t)x.h * p.q_head +
                   c * 8;
        flash::cp_async16(sQ + swz<D>(r, c), src, ok ? 16 : 0);
    }
}

// Copies keys [key0, key0 + TILE) of one K or V head into a swizzled tile, row by row through
// `key_row` (the block table for paged caches). Rows past `rows_valid`, columns past d_load and
// rows of blocks outside the cache are zero-filled.
template <typename T, int D, int TILE, int THREADS>
__device__ __forceinline__ void load_kv(T* smem, const FlashParams& p, const T* base, const T* cache,
                                        int64_t batch_stride, int64_t seq_stride, int64_t head_off,
                                        int b, int key0, int rows_valid) {
    constexpr int C = D / 8;
    constexpr int RPI = THREADS / C;
    static_assert(RPI >= 1, "a row must fit in one pass of the block");
    const int r0 = threadIdx.x / C, c = threadIdx.x % C;
    if (r0 >= RPI) return;
    const bool col_ok = c * 8 < p.d_load;
    constexpr int N = (TILE + RPI - 1) / RPI;
    // Addresses first, copies second: for paged caches each address waits on a block-table
    // load, and issuing all of a thread's table loads before its first copy overlaps them.
    const T* src[N];
#pragma unroll
    for (int it = 0; it < N; ++it) {
        const int r = r0 + it * RPI;
        src[it] = nullptr;
        if ((TILE % RPI == 0 || r < TILE) && col_ok && r < rows_valid)
            src[it] = key_row(p, base, cache, batch_stride, seq_stride, head_off, b, key0 + r);
    }
#pragma unroll
    for (int it = 0; it < N; ++it) {
        const int r = r0 + it * RPI;
        if (TILE % RPI != 0 && r >= TILE) break;
        // A zero-byte copy reads nothing; point it at the cache base, which is always mapped.
        flash::cp_async16(smem + swz<D>(r, c), src[it] ? src[it] + c * 8 : cache, src[it] ? 16 : 0);
    }
}

template <typename T, int D, int WARPS, int STAGES, bool MODS>
__device__ __forceinline__ void partial(const FlashParams& p) {
    using Tr = Traits<T, D, WARPS, STAGES>;
    constexpr int THREADS = Tr::THREADS, BC = Tr::BC, DT = Tr::DT;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + ROWS * D;  // stage s: K at sKV + 2 s BC D, V right after

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / p.m_tiles, mt = blockIdx.y % p.m_tiles;
    const int b = blockIdx.z;
    const int m0 = mt * ROWS;

    // Sequence geometry (the row range passed to block_geom is that of the query rows the
    // packed tile touches, so its key range is the union of theirs).
    BlockGeom g;
    const int i_first = m0 / p.kv_group;
    {
        BlockGeom g0;
        if (!block_geom<true>(p, 0, 1, 0, b, g0)) return;  // empty sequence: no rows
        g = g0;
    }
    if (i_first >= g.sq) return;
    const int i_last = min(g.sq - 1, (m0 + ROWS - 1) / p.kv_group);
    {
        // Key range of rows i_first..i_last (both window ends grow with the row).
        const int64_t diag_first = (int64_t)i_first + g.sk - g.sq;
        const int64_t diag_last = (int64_t)i_last + g.sk - g.sq;
        int64_t lo = 0, hi = g.sk;
        // Prefix ranges widen rows' windows: such blocks walk every key (the rows' own ranges
        // mask them below).
        if (p.win_left >= 0 && !p.prefix)
            lo = max((int64_t)0, min((int64_t)g.sk, diag_first - p.win_left));
        if (p.win_right >= 0 && !p.prefix)
            hi = max((int64_t)0, min((int64_t)g.sk, diag_last + p.win_right + 1));
        // This split's slice of the keys.
        const int64_t s_lo = (int64_t)split * p.split_keys, s_hi = s_lo + p.split_keys;
        g.n_lo = (int)max(lo, min(s_lo, (int64_t)g.sk));
        g.n_hi = (int)max((int64_t)g.n_lo, min(hi, s_hi));
        g.m0 = i_first;
        g.rows = i_last - i_first + 1;
    }

    const T* kc = static_cast<const T*>(p.k);
    const T* vc = static_cast<const T*>(p.v);
    const T* kg = kc + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq + (int64_t)kvh * p.k_head;
    const T* vg = vc + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq + (int64_t)kvh * p.v_head;

    // This thread's two packed rows (lane / 4 and lane / 4 + 8): diagonal, visible keys (within
    // this split) and ALiBi slope.
    int diag[2], row_lo[2], row_hi[2];
    float slope_log2[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const PackedRow x = packed_row(p, m0, lane / 4 + 8 * hf, kvh, g.sq);
        diag[hf] = x.i + g.sk - g.sq;
        row_keys(p, b, diag[hf], g.sk, row_lo[hf], row_hi[hf]);
        row_lo[hf] = max(row_lo[hf], g.n_lo);
        row_hi[hf] = min(row_hi[hf], g.n_hi);
        slope_log2[hf] =
            (MODS && p.alibi) ? p.alibi[b * p.alibi_batch + x.h] * LOG2E_F : 0.f;
    }

    float acc_o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
    float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
    const float unit = MODS ? 1.f : p.scale_log2;

    const SwzRow<D> q_off(lane % 16, lane / 16);
    const SwzRow<D> k_off(16 * warp + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<D> v_off(16 * warp + lane % 16, lane / 16);

    const int t_begin = g.n_lo / BC;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BC - 1) / BC : t_begin;

    load_q<T, D, THREADS>(sQ, p, b, g, m0, kvh);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int t = t_begin + s;
        if (t < t_end) {
            T* sK = sKV + s * 2 * BC * D;
            const int rows = min(BC, g.sk - t * BC);
            load_kv<T, D, BC, THREADS>(sK, p, kg, kc, p.k_batch, p.k_seq,
                                       (int64_t)kvh * p.k_head, b, t * BC, rows);
            load_kv<T, D, BC, THREADS>(sK + BC * D, p, vg, vc, p.v_batch, p.v_seq,
                                       (int64_t)kvh * p.v_head, b, t * BC, rows);
        }
        cp_async_commit();
    }

    for (int t = t_begin; t < t_end; ++t) {
        const int it = t - t_begin;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int tn = t + STAGES - 1;
            if (tn < t_end) {
                T* sK = sKV + ((it + STAGES - 1) % STAGES) * 2 * BC * D;
                const int rows = min(BC, g.sk - tn * BC);
                load_kv<T, D, BC, THREADS>(sK, p, kg, kc, p.k_batch, p.k_seq,
                                           (int64_t)kvh * p.k_head, b, tn * BC, rows);
                load_kv<T, D, BC, THREADS>(sK + BC * D, p, vg, vc, p.v_batch, p.v_seq,
                                           (int64_t)kvh * p.v_head, b, tn * BC, rows);
            }
            cp_async_commit();
        }
        const T* sK = sKV + (it % STAGES) * 2 * BC * D;
        const T* sV = sK + BC * D;
        const int k0 = t * BC + 16 * warp;  // this warp's first key
        if (k0 >= g.n_hi || k0 + 16 <= g.n_lo) continue;

        // S = Q K^T: 16 rows x this warp's 16 keys (two n8 tiles).
        float acc_s[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4], kb[4];
            ldsm_x4(qa, sQ + q_off.at(0, kk));
            ldsm_x4(kb, sK + k_off.at(0, kk));
            Mma<T>::run(acc_s[0], qa, kb[0], kb[1]);
            Mma<T>::run(acc_s[1], qa, kb[2], kb[3]);
        }

        const int col = k0 + 2 * (lane % 4);
        if constexpr (MODS) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[j][e] = modded_score(p, acc_s[j][e], slope_log2[e / 2], diag[e / 2],
                                               col + j * 8 + e % 2);
        }
        // Keys outside the row's visible range within this split are masked; the split bounds
        // are in that range, so two splits never count one key twice.
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = col + j * 8 + e % 2;
                if (key < row_lo[e / 2] || key >= row_hi[e / 2]) acc_s[j][e] = -INFINITY;
            }

#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float mx = row_m[hf];
#pragma unroll
            for (int j = 0; j < 2; ++j)
                mx = fmaxf(mx, fmaxf(acc_s[j][2 * hf], acc_s[j][2 * hf + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_scaled = mx == -INFINITY ? 0.f : mx * unit;
            const float alpha = fast_exp2(fmaf(row_m[hf], unit, -m_scaled));
            row_m[hf] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = fast_exp2(fmaf(acc_s[j][2 * hf + e], unit, -m_scaled));
                    acc_s[j][2 * hf + e] = pv;
                    sum += pv;
                }
            row_l[hf] = row_l[hf] * alpha + sum;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                acc_o[j][2 * hf] *= alpha;
                acc_o[j][2 * hf + 1] *= alpha;
            }
        }
        // O += P V (one k16 step: this warp's 16 keys).
        uint32_t pa[4];
        pa[0] = Mma<T>::pack(acc_s[0][0], acc_s[0][1]);
        pa[1] = Mma<T>::pack(acc_s[0][2], acc_s[0][3]);
        pa[2] = Mma<T>::pack(acc_s[1][0], acc_s[1][1]);
        pa[3] = Mma<T>::pack(acc_s[1][2], acc_s[1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t vb[4];
            ldsm_x4_t(vb, sV + v_off.at(0, dp));
            Mma<T>::run(acc_o[2 * dp], pa, vb[0], vb[1]);
            Mma<T>::run(acc_o[2 * dp + 1], pa, vb[2], vb[3]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- merge the warps' partial states, in warp order -------------------------------------
    __shared__ float sh_m[WARPS][ROWS], sh_l[WARPS][ROWS];
    __shared__ float sh_scale[WARPS][ROWS];  // 2^(m_w - M) per warp and row
    __shared__ float sh_inv[ROWS], sh_lse2[ROWS];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = row_l[hf];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (lane % 4 == 0) {
            sh_m[warp][lane / 4 + 8 * hf] = row_m[hf];
            sh_l[warp][lane / 4 + 8 * hf] = l;
        }
    }
    __syncthreads();
    if (tid < ROWS) {
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sh_m[w][tid]);
        const float m_scaled = m == -INFINITY ? 0.f : m * unit;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float s = fast_exp2(fmaf(sh_m[w][tid], unit, -m_scaled));
            sh_scale[w][tid] = s;
            l += sh_l[w][tid] * s;
        }
        sh_inv[tid] = l > 0.f ? 1.f / l : 0.f;
        // A NaN l (a NaN score) keeps NaN in the lse, as O keeps it.
        sh_lse2[tid] = l > 0.f || l != l ? m_scaled + __log2f(l) : -INFINITY;
    }
    __syncthreads();
    float* sO = reinterpret_cast<float*>(sKV);  // ROWS x D f32, the ring is drained
    for (int w = 0; w < WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = lane / 4 + 8 * hf;
                const float s = sh_scale[w][r];
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    float2* dst = reinterpret_cast<float2*>(sO + r * D + j * 8 + 2 * (lane % 4));
                    float2 v = make_float2(acc_o[j][2 * hf] * s, acc_o[j][2 * hf + 1] * s);
                    if (w > 0) {
                        v.x += dst->x;
                        v.y += dst->y;
                    }
                    *dst = v;
                }
            }
        }
        __syncthreads();
    }

    // ---- write: the output (one split) or this split's normalised partial -------------------
    const bool final_out = p.num_splits == 1;
    for (int idx = tid; idx < ROWS * D; idx += THREADS) {
        const int r = idx / D, c = idx % D;
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        if (!x.valid || c >= p.d_out) continue;
        const float val = sO[idx] * sh_inv[r];
        const int64_t row_g = g.out_row0 + x.i;
        if (final_out) {
            static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)x.h * p.o_head + c] =
                rowwise::from_f32<T>(val);
        } else {
            p.o_part[((int64_t)split * p.total_q + row_g) * p.o_seq + (int64_t)x.h * p.o_head + c] =
                val;
        }
    }
    if (tid < ROWS) {
        const PackedRow x = packed_row(p, m0, tid, kvh, g.sq);
        if (x.valid) {
            const int64_t row_g = g.out_row0 + x.i;
            if (final_out) {
                const int64_t li = p.cu_q ? (int64_t)x.h * p.lse_head + row_g
                                          : ((int64_t)b * p.heads + x.h) * p.seq_q + x.i;
                p.lse[li] = sh_lse2[tid] * LN2_F;
            } else {
                p.lse_part[((int64_t)split * p.heads + x.h) * p.total_q + row_g] = sh_lse2[tid];
            }
        }
    }
}

// One block per (output row, head): merges the splits' partials.
template <typename T>
__device__ __forceinline__ void combine(const FlashParams& p) {
    const int64_t row_g = blockIdx.x;
    const int h = blockIdx.y;
    __shared__ float sh_w[128];
    __shared__ float sh_lse;
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        bool nan = false;
        for (int s = 0; s < p.num_splits; ++s) {
            const float l = p.lse_part[((int64_t)s * p.heads + h) * p.total_q + row_g];
            nan |= l != l;
            m = fmaxf(m, l);
        }
        float sum = 0.f;
        for (int s = 0; s < p.num_splits; ++s) {
            const float l = p.lse_part[((int64_t)s * p.heads + h) * p.total_q + row_g];
            const float w = m == -INFINITY ? 0.f : exp2f(l - m);
            sh_w[s] = w;
            sum += w;
        }
        const float lse2 = nan ? NAN : (m == -INFINITY ? -INFINITY : m + log2f(sum));
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int s = 0; s < p.num_splits; ++s) sh_w[s] *= inv;
        sh_lse = lse2;
        // lse output index: dense (b, h, i) or varlen (h, row).
        int64_t li;
        if (p.cu_q) {
            li = (int64_t)h * p.lse_head + row_g;
        } else {
            const int64_t bb = row_g / p.seq_q, i = row_g % p.seq_q;
            li = (bb * p.heads + h) * p.seq_q + i;
        }
        p.lse[li] = lse2 * LN2_F;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < p.d_out; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < p.num_splits; ++s) {
            const float w = sh_w[s];
            // A split that saw no key has weight 0 and O = 0: skip it so nothing of it is read.
            if (w != 0.f || sh_lse != sh_lse)
                acc += w * p.o_part[((int64_t)s * p.total_q + row_g) * p.o_seq +
                                    (int64_t)h * p.o_head + c];
        }
        static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)h * p.o_head + c] =
            rowwise::from_f32<T>(acc);
    }
}

}  // namespace decode

// Entry points of the table in src/cuda/instances.rs (DECODE_INSTANCES), expanded by build.rs
// into FLASH_DECODE_INSTANCES with the shared-memory size the planner assumes.
#define FLASH_DECODE_INSTANCE(NAME, T, D, WARPS, STAGES, SMEM_BYTES)                           \
    static_assert(decode::Traits<T, D, WARPS, STAGES>::SMEM == SMEM_BYTES,                      \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const FlashParams p) {        \
        decode::partial<T, D, WARPS, STAGES, false>(p);                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME##_mods(const FlashParams p) { \
        decode::partial<T, D, WARPS, STAGES, true>(p);                                          \
    }

#define FLASH_DECODE_COMBINE(NAME, T) \
    extern "C" __global__ void __launch_bounds__(128) NAME(const FlashParams p) { decode::combine<T>(p); }
