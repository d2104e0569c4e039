// Decode attention: few query rows per K/V head against a long KV cache, f16/bf16 on tensor
// cores (mma.sync m16n8k16, f32 accumulation), in flash-decoding's two passes within one launch:
// each block computes one split of the keys; the last block of a group to finish merges the
// splits, or a combine kernel does (decode/combine.cuh).
//
// Grid (kv_heads * row_blocks, splits, batch). One block reads the keys of one split of one K/V
// head of one sequence once, for every query row that uses them. The blocks of one key range
// launch side by side, one per K/V head and row block: in a (keys, kv_heads, d) cache the heads
// of a key share one run of memory, which those blocks then read at about the same time rather
// than a split's length apart, and the row blocks of a head find its tiles in the L2.
// - GQA packing: the query heads sharing the K/V head and all their seq_q rows form the packed
//   rows of the block (packed row r -> query i = r / group, head kvh * group + r % group), up to
//   ROWS = 16 RG of them, RG 16-row mma tiles.
// - Warps: RG x KG. Warp (rg, kg) owns the 16 rows of tile rg and keys [kg KW, kg KW + KW) of
//   every K/V tile of BC = KG KW keys. With one row tile (RG 1) the warps split the keys, so a
//   single sequence's tile still keeps four warps busy; with more rows each warp takes whole key
//   tiles for its own rows (KG 1) and no merge is needed.
// - K/V tiles stream through a STAGES-deep cp.async ring; STAGES - 1 tiles are in flight while
//   one is computed, which is what keeps a block's bytes in flight above the memory latency.
//   Paged caches load the block-table entries of a tile two iterations before its copies are
//   issued (one in the FP8 twins), into registers, then shared memory, shared by K and V.
// - Per tile and warp: S = Q K^T (Q, K by ldmatrix), the online softmax in the S registers
//   (scale * log2 e folded into exp2; softcap / ALiBi in the `_mods` instances), O += P V with P
//   straight from the S registers and V by ldmatrix.trans. The `wg` instances (sm_90a,
//   decode/wgmma.cuh) run both products per warpgroup of four row tiles on wgmma instead, from
//   tiles in its swizzled layout; the softmax and everything after it are the same.
// - After the loop the KG warps of a row tile merge (m, l, O) through shared memory in warp
//   order (bitwise deterministic). With one split the block writes the output and lse;
//   otherwise O / l (f32) and its base-2 log-sum-exp go to the split scratch, and the group's
//   last block (or the combine kernel) merges them.
// Masking (causal, windows, prefix ranges), softcap and ALiBi follow src/semantics.rs through
// common/.
//
// FP8 caches (KV8): K and V stream as stored (e4m3, one byte per element) through a ring of half
// the size, and the products run in f16 (e4m3 converts to it exactly: by one instruction per
// pair on sm_89 and later, by a few integer and f16 operations before it). With one row tile
// (RG 1, DIRECT) each warp converts the bytes of its own keys in registers, straight into the
// mma fragments, which is half the instructions of converting a tile in shared memory and needs
// no barrier between conversion and products: a thread reads whole runs of bytes, so the head
// dim is permuted (the same permutation of Q's and K's columns, which leaves Q K^T unchanged,
// and one of V's columns, undone where O is written: `direct_col`). With more row tiles every
// warp reads every key, and each tile is converted once in shared memory into f16 tiles that
// the warps read as above. Q, read in T, becomes f16
// scaled by a power of two 2^-e per block so that its largest value stays below 2^15 (f16's
// range; the scaling is exact), and the scores are taken times 2^e and the call's q·k descale of
// the block's (sequence, K/V head); its v descale scales the block's output.
#pragma once
#include <cuda_fp8.h>

#include <type_traits>

#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "common/swizzle.cuh"
#include "decode/combine.cuh"
#include "decode/rows.cuh"
#include "forward/rowwise.cuh"
#ifdef FLASH_DECODE_WG
#include "decode/wgmma.cuh"
#endif

namespace decode {

using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::ldsm_x4;
using flash::ldsm_x4_t;
using flash::Mma;
using flash::swz;
using flash::SwzRow;

template <typename T, int D, int RG, int KG, int BC, int STAGES, bool KV8 = false,
          bool WG = false>
struct Traits {
    static constexpr int WARPS = RG * KG;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS = 16 * RG;  // packed rows per block
    static constexpr int KW = BC / KG;    // keys per warp and tile
    static constexpr int DT = D / 8;      // n8 tiles of O
    // Bytes of one stored K (or V) tile, and of the f16 pair an FP8 tile is converted into.
    static constexpr int TILE = BC * D * (KV8 ? 1 : (int)sizeof(T));
    // FP8 tiles converted in registers (one row tile) or through shared memory (more).
    static constexpr bool DIRECT = KV8 && RG == 1;
    static constexpr int WORK = KV8 && !DIRECT ? 2 * BC * D * 2 : 0;
    // The key loop's block-table entries and staged key bias (two tiles of each, 4-byte values)
    // go after the rest where their BC-wide rows would outgrow the static shared memory the
    // planner reserves (STATIC_SMEM_RESERVE, 1 KB).
    static constexpr int SIDE = BC > 64 ? 2 * 2 * BC * 4 : 0;
    // Q tile (2-byte elements), then STAGES (K, V) tiles, then the converted pair (KV8), then
    // the side arrays. The f32 merge buffer (KG > 1) reuses the ring and the pair.
    // WG (warpgroup MMA, decode/wgmma.cuh): the tiles start on a 1024-byte swizzle atom, the
    // dynamic base rounded up to one.
    static constexpr int ALIGN = WG ? 1024 : 0;
    static constexpr int SMEM = ROWS * D * 2 + STAGES * 2 * TILE + WORK + SIDE + ALIGN;
    static_assert(!WG || (KG == 1 && RG % 4 == 0 && D % 64 == 0 && BC % 16 == 0 && !KV8),
                  "warpgroups of whole row tiles and keys, 2-byte tiles of 64-column chunks");
    static_assert(KW % 16 == 0, "a warp's keys are whole k16 steps");
    static_assert(KG == 1 || ROWS * D * 4 <= STAGES * 2 * TILE + WORK,
                  "the merge buffer fits in the ring");
    static_assert(WARPS * COMBINE_MAX_SPLITS * 4 <= STAGES * 2 * TILE + WORK,
                  "the combine's split weights fit in the ring");
};

// Element offset of 16-byte chunk c of row r in an R-row tile of 2-byte elements: swizzled for
// ldmatrix, or (CANON) as the warpgroup MMA reads it (decode/wgmma.cuh).
template <int D, int R, bool CANON>
__device__ __forceinline__ int tile_off(int r, int c) {
#ifdef FLASH_DECODE_WG
    if constexpr (CANON) return canon_off<R>(r, c);
#endif
    return swz<D>(r, c);
}

// Copies the block's ROWS x D packed rows of Q (per-row addresses) into a swizzled tile,
// zero-filling rows past the packed length and columns past d_load.
template <typename T, int D, int ROWS, int THREADS, bool CANON = false>
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
        flash::cp_async16(sQ + tile_off<D, ROWS, CANON>(r, c), src, ok ? 16 : 0);
    }
}

// Byte offset of 16-byte chunk c of row r in an FP8 tile (D bytes a row): chunks XOR-permuted
// by the row, so that the register conversion's reads (a quad's runs of one K row; one run of
// four rows of V per thread) and the shared-memory conversion's hit distinct bank groups.
template <int D>
__device__ __forceinline__ int kv8_chunk(int r, int c) {
    constexpr int C = D / 16;
    return r * D + (c ^ (r & (C - 1))) * 16;
}

// Copies keys [key0, key0 + TILE) of one K/V head, 16-byte chunks of elements E, into the K and
// V tiles: swizzled for 2-byte elements (read by ldmatrix), rows of D bytes for e4m3 (chunks
// permuted by kv8_chunk; their head dim is a multiple of 16, whole chunks, the
// planner sends others to the converting path). Contiguous caches (blk null) read row j at kg /
// vg (the sequence's first row) plus j rows; paged caches read row j % page of block
// blk[j - key0], the tile's block-table entries fetched beforehand (-1 for rows past the
// sequence), or, where `dense`, the cache row blk[j - key0] (table_row). Rows past
// `rows_valid`, columns past d_load and blocks outside the cache are zero-filled.
//
// Each thread keeps one column chunk and steps down the rows, RPI at a time. The decode loop is
// bound by the instructions it issues, not by the bytes in flight, so the contiguous path
// advances two pointers per row instead of recomputing 64-bit addresses, and the paged path
// (one table entry per row) is a loop of its own rather than a branch in every row. The row
// loops unroll twice only: a block of four warps has one warp per scheduler and nothing to run
// while that warp waits for instructions, and fully unrolled copies made the key loop outgrow
// the instruction cache (measured with its code cold: 3.7 of the 8.7 cycles between a warp's
// instructions waiting on the fetch, 0.4 with the loops unrolled twice).
template <typename E, int D, int TILE, int THREADS, bool CANON = false>
__device__ __forceinline__ void load_kv(E* sK, E* sV, const FlashParams& p, const E* kg,
                                        const E* vg, int64_t k_head_off, int64_t v_head_off,
                                        int key0, int rows_valid, const int* blk, bool dense) {
    constexpr int EPC = 16 / (int)sizeof(E);  // elements per chunk
    constexpr int C = D / EPC;
    constexpr int RPI = THREADS / C;
    static_assert(RPI >= 1, "a row must fit in one pass of the block");
    const int r0 = threadIdx.x / C, c = threadIdx.x % C;
    if (r0 >= RPI) return;
    // Columns past d_load read nothing: as if every row were past the sequence.
    if (c * EPC >= p.d_load) rows_valid = 0;
    const E* kc = static_cast<const E*>(p.k);
    const E* vc = static_cast<const E*>(p.v);
    constexpr int N = (TILE + RPI - 1) / RPI;
    auto dst = [&](int r) {
        return sizeof(E) == 1 ? kv8_chunk<D>(r, c) : tile_off<D, TILE, CANON>(r, c);
    };
    if (!blk) {
        const int64_t step_k = (int64_t)RPI * p.k_seq, step_v = (int64_t)RPI * p.v_seq;
        const E* ks = kg + (int64_t)(key0 + r0) * p.k_seq + c * EPC;
        const E* vs = vg + (int64_t)(key0 + r0) * p.v_seq + c * EPC;
#pragma unroll 2
        for (int it = 0; it < N; ++it) {
            const int r = r0 + it * RPI;
            if (TILE % RPI != 0 && r >= TILE) break;
            const bool ok = r < rows_valid;
            // A zero-byte copy reads nothing; point it at the cache base, which is always mapped.
            flash::cp_async16(sK + dst(r), ok ? ks : kc, ok ? 16 : 0);
            flash::cp_async16(sV + dst(r), ok ? vs : vc, ok ? 16 : 0);
            ks += step_k;
            vs += step_v;
        }
        return;
    }
    if (dense) {
        // The entries are cache rows (table_row): one index, and one 32 x 32 -> 64-bit
        // multiply-add per operand (the row strides fit 32 bits where the host sets
        // page_dense). A row past the keys copies nothing from row 0 of the chunk, a column
        // chunk past d_load nothing from the cache base: both mapped.
        const bool col_ok = c * EPC < p.d_load;
        const char* kb = reinterpret_cast<const char*>(col_ok ? kc + k_head_off + c * EPC : kc);
        const char* vb = reinterpret_cast<const char*>(col_ok ? vc + v_head_off + c * EPC : vc);
        const uint32_t k_row = (uint32_t)p.k_seq * (uint32_t)sizeof(E);
        const uint32_t v_row = (uint32_t)p.v_seq * (uint32_t)sizeof(E);
#pragma unroll 2
        for (int it = 0; it < N; ++it) {
            const int r = r0 + it * RPI;
            if (TILE % RPI != 0 && r >= TILE) break;
            const int row = blk[r];
            const bool ok = col_ok && row >= 0;
            const uint32_t at = ok ? (uint32_t)row : 0u;
            flash::cp_async16(sK + dst(r), kb + (uint64_t)at * k_row, ok ? 16 : 0);
            flash::cp_async16(sV + dst(r), vb + (uint64_t)at * v_row, ok ? 16 : 0);
        }
        return;
    }
#pragma unroll 2
    for (int it = 0; it < N; ++it) {
        const int r = r0 + it * RPI;
        if (TILE % RPI != 0 && r >= TILE) break;
        const int j = key0 + r;
        const E* ks = nullptr;
        const E* vs = nullptr;
        const int bi = blk[r];
        if (r < rows_valid && bi >= 0 && bi < p.num_blocks) {
            // Power-of-two pages (vLLM's 16, most of upstream's) mask instead of divide.
            const int row = p.page_shift >= 0 ? j & (p.page - 1) : j % p.page;
            ks = kc + (int64_t)bi * p.k_batch + (int64_t)row * p.k_seq + k_head_off + c * EPC;
            vs = vc + (int64_t)bi * p.v_batch + (int64_t)row * p.v_seq + v_head_off + c * EPC;
        }
        flash::cp_async16(sK + dst(r), ks ? ks : kc, ks ? 16 : 0);
        flash::cp_async16(sV + dst(r), vs ? vs : vc, vs ? 16 : 0);
    }
}

// Two e4m3 values (low byte first) as an f16 pair, exactly; NaN stays NaN. sm_89 and later
// convert a pair in one instruction. Before it, bits: e4m3 (bias 7, 3 mantissa bits) placed in
// f16's fields (bias 15, 10 bits), sign | magnitude << 7, is the value times 2^-8 for every
// finite input, e4m3's subnormals included (they land on f16 normals or subnormals, exactly);
// one f16 multiply by 2^8 restores it. e4m3's NaN (magnitude 0x7f; it has no infinities) comes
// out as 480, above its largest finite value (448), and is then made f16's NaN.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t x) {
#if __CUDA_ARCH__ >= 890
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
#else
    // Byte i in the high byte of half i, then its magnitude shifted down by one.
    const uint32_t w = __byte_perm((uint32_t)x, 0, 0x1404);
    const uint32_t bits = (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
    const __half two8 = __ushort_as_half(0x5c00);  // 2^8
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), __half2half2(two8));
    const unsigned nan = __hgt2_mask(__habs2(v), __half2half2(__ushort_as_half(0x5f40)));  // 464
    return *reinterpret_cast<const uint32_t*>(&v) | (nan & 0x7e007e00u);
#endif
}

// Converts a stored (K, V) FP8 tile pair (row-major, D bytes a row) into the swizzled f16
// tiles the warps read: each 16-byte chunk once, into two 8-element chunks.
template <int D, int BC, int THREADS>
__device__ __forceinline__ void convert_kv8(__half* wK, const uint8_t* sK) {
    constexpr int C = D / 16;
    for (int idx = threadIdx.x; idx < 2 * BC * C; idx += THREADS) {
        const int which = idx / (BC * C), rc = idx % (BC * C);
        const int r = rc / C, c = rc % C;
        const uint8_t* src = sK + which * BC * D + kv8_chunk<D>(r, c);
        const uint4 raw = *reinterpret_cast<const uint4*>(src);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t h[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            h[2 * i] = e4m3x2_to_f16x2((uint16_t)(w[i] & 0xffff));
            h[2 * i + 1] = e4m3x2_to_f16x2((uint16_t)(w[i] >> 16));
        }
        __half* dst = wK + which * BC * D;
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
    }
}

// The column of K's bytes (and Q's) that column `col` of the mma fragments holds where a KV8
// warp converts its keys in registers: in k16 step kk, the quad's thread t holds columns
// 16 kk + 2 t + {0, 1} and + 8 of its key; they are bytes 4 kk .. 4 kk + 3 of the thread's run
// of D / 4 bytes, so that it reads its key's bytes in whole 16-byte chunks.
template <int D>
__device__ __forceinline__ int direct_k_col(int col) {
    const int kk = col / 16, h = (col / 8) % 2, t = (col / 2) % 4, e = col % 2;
    return (D / 4) * t + 4 * kk + 2 * h + e;
}

// The column of O (and of V's bytes) that column n of O's n8 tile j holds in that case: the
// thread that loads n's fragment of V reads a run of D / 8 bytes (one per tile) of each key.
template <int D>
__device__ __forceinline__ int direct_col(int j, int n) {
    return n * (D / 8) + j;
}

// Q of a KV8 block, loaded in T into sQ, becomes f16 times 2^-e, e >= 0 the least keeping
// every |value| below 2^15; returns 2^e (the factor of every score). PERMUTE: column c of the
// result holds Q's column direct_k_col(c). Every thread takes part (two barriers).
template <typename T, int D, int ROWS, int THREADS, bool PERMUTE>
__device__ __forceinline__ float q_to_f16(void* sQ) {
    __shared__ float sh_amax[THREADS / 32];
    constexpr int N = ROWS * D;
    // PERMUTE (one row tile: D / 8 or D / 4 values a thread) moves values between threads, so
    // they wait in registers for the barrier; otherwise each converts its own values in place.
    constexpr int HELD = PERMUTE ? N / THREADS : 1;
    static_assert(!PERMUTE || N % THREADS == 0, "every thread holds as many values");
    T* qt = static_cast<T*>(sQ);
    // Logical element i (row-major) of the result, and where its value is in the loaded tile.
    auto at = [](int i, bool src) {
        const int r = i / D, c = i % D;
        const int col = src ? direct_k_col<D>(c) : c;
        return flash::swz<D>(r, col / 8) + col % 8;
    };
    T held[HELD];
    float amax = 0.f;
    if constexpr (PERMUTE) {
#pragma unroll
        for (int k = 0; k < HELD; ++k) {
            held[k] = qt[at(threadIdx.x + k * THREADS, true)];
            amax = fmaxf(amax, fabsf(rowwise::to_f32(held[k])));
        }
    } else {
        for (int i = threadIdx.x; i < N; i += THREADS)
            amax = fmaxf(amax, fabsf(rowwise::to_f32(qt[i])));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    if (threadIdx.x % 32 == 0) sh_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) amax = fmaxf(amax, sh_amax[w]);
    // 2^e with amax / 2^e < 2^15 (a NaN or infinite Q keeps e = 0 and its value).
    int e = 0;
    if (amax >= 32768.f && amax <= 3.4e38f) e = ilogbf(amax) - 14;
    const float down = exp2f((float)-e);
    __half* qh = static_cast<__half*>(sQ);
    if constexpr (PERMUTE) {
#pragma unroll
        for (int k = 0; k < HELD; ++k)
            qh[at(threadIdx.x + k * THREADS, false)] =
                __float2half_rn(rowwise::to_f32(held[k]) * down);
    } else {
        for (int i = threadIdx.x; i < N; i += THREADS)
            qh[i] = __float2half_rn(rowwise::to_f32(qt[i]) * down);
    }
    __syncthreads();
    return exp2f((float)e);
}

// The block-table entry of key j of sequence b (paged caches), or -1 past the sequence's sk
// keys. Only the load is issued here: the value is first used when it is stored to shared
// memory, after a tile's compute (an iteration of the key loop later, but in the FP8 twins),
// so the load's latency hides behind it.
__device__ __forceinline__ int table_entry(const FlashParams& p, int b, int j, int sk) {
    int blk = -1;
    if (j < sk) {
        const int pg = p.page_shift >= 0 ? j >> p.page_shift : j / p.page;
        blk = p.block_table[(int64_t)b * p.max_blocks + pg];
    }
    return blk;
}

// A table entry as the row of k and v it names for key j where the blocks are dense
// (FlashParams::page_dense: row j % page of block blk is row blk * page + j % page), or -1 for an
// entry past the keys or outside [0, num_blocks). Computed when the entry is stored, so the
// copies of every row need one product per operand instead of two and the bounds tests.
__device__ __forceinline__ int table_row(const FlashParams& p, int blk, int j) {
    if (blk < 0 || blk >= p.num_blocks) return -1;
    return blk * p.page + (p.page_shift >= 0 ? j & (p.page - 1) : j % p.page);
}

// The keys [n_lo, n_hi) this block reads: the union of the windows of the query rows its packed
// rows touch (both window ends grow with the row), cut to this split's slice. Prefix ranges
// widen rows' windows: such blocks walk every key (the rows' own ranges mask them).
__device__ __forceinline__ void split_keys(const FlashParams& p, int split, int i_first,
                                           int i_last, BlockGeom& g) {
    const int64_t diag_first = (int64_t)i_first + g.sk - g.sq;
    const int64_t diag_last = (int64_t)i_last + g.sk - g.sq;
    int64_t lo = 0, hi = g.sk;
    if (p.win_left >= 0 && !p.prefix)
        lo = max((int64_t)0, min((int64_t)g.sk, diag_first - p.win_left));
    if (p.win_right >= 0 && !p.prefix)
        hi = max((int64_t)0, min((int64_t)g.sk, diag_last + p.win_right + 1));
    const int64_t s_lo = (int64_t)split * p.split_keys, s_hi = s_lo + p.split_keys;
    g.n_lo = (int)max(lo, min(s_lo, (int64_t)g.sk));
    g.n_hi = (int)max((int64_t)g.n_lo, min(hi, s_hi));
    g.m0 = i_first;
    g.rows = i_last - i_first + 1;
}

// One warp's running state for its 16 rows: O (16 x D over the mma C layout), the row maxima
// and sums of this thread's two rows (lane / 4 and lane / 4 + 8), in units of the raw score.
template <int D>
struct WarpState {
    float o[D / 8][4];
    float m[2], l[2];
};

// The scores s of one tile (this warp's keys from `k0`) through the score modifiers (MODS) and
// masks into the online softmax: the rows' maxima and sums in w move on, s becomes P (f32), and
// alpha gets the factors O must be rescaled by (exactly 1 where a row's maximum did not move).
// The arguments are warp_tile's.
template <typename TB, int D, int NT, bool MODS>
__device__ __forceinline__ void softmax_tile(WarpState<D>& w, float (&s)[NT][4], float (&alpha)[2],
                                             const FlashParams& p, int k0,
                                             const int (&row_lo)[2], const int (&row_hi)[2],
                                             const int (&diag)[2], const float (&slope_log2)[2],
                                             float unit, const int64_t (&bias_off)[2], int sk,
                                             float qscale, const float* sBias) {
    constexpr int KW = NT * 8;
    const int lane = threadIdx.x % 32;
    const int col = k0 + 2 * (lane % 4);
    if constexpr (MODS) {
        // (qscale: the power of two a KV8 block's Q was scaled down by; exactly 1 otherwise.)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[j][e] = modded_score(p, s[j][e] * qscale, slope_log2[e / 2], diag[e / 2],
                                       col + j * 8 + e % 2);
        if (sBias) {
            // One key vector for every row of the block, staged per tile (sBias: this warp's
            // first key): two adjacent keys per read, for both of the thread's rows.
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const float2 x = *reinterpret_cast<const float2*>(sBias + col - k0 + j * 8);
                s[j][0] += x.x * LOG2E_F;
                s[j][1] += x.y * LOG2E_F;
                s[j][2] += x.x * LOG2E_F;
                s[j][3] += x.y * LOG2E_F;
            }
        } else if (p.bias) {
            const char* base = static_cast<const char*>(p.bias);
            const int esize = p.bias_f32 ? 4 : 2;
            // Rows with one offset (a key-padding bias, or one query row) read each key once.
            if (bias_off[0] == bias_off[1]) {
                add_bias_row<TB, NT>(p, &s[0][0], base + bias_off[0] * esize, col, sk, LOG2E_F,
                                     true);
            } else {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    add_bias_row<TB, NT>(p, &s[0][0] + 2 * hf, base + bias_off[hf] * esize, col,
                                         sk, LOG2E_F, false);
            }
        }
    }
    // Keys outside the row's visible range within this split are masked; the split bounds are
    // in that range, so two splits never count one key twice. Tiles inside every range of the
    // warp's rows (most of them) skip the comparisons.
    const bool inside = k0 >= max(row_lo[0], row_lo[1]) && k0 + KW <= min(row_hi[0], row_hi[1]);
    if (!__all_sync(0xffffffff, inside)) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = col + j * 8 + e % 2;
                if (key < row_lo[e / 2] || key >= row_hi[e / 2]) s[j][e] = -INFINITY;
            }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float mx = w.m[hf];
#pragma unroll
        for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hf], s[j][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_scaled = mx == -INFINITY ? 0.f : mx * unit;
        alpha[hf] = fast_exp2(fmaf(w.m[hf], unit, -m_scaled));
        w.m[hf] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pv = fast_exp2(fmaf(s[j][2 * hf + e], unit, -m_scaled));
                s[j][2 * hf + e] = pv;
                sum += pv;
            }
        w.l[hf] = w.l[hf] * alpha[hf] + sum;
    }
}

// O times alpha, row by row: only where a row's maximum moved (alpha is exactly 1 elsewhere, and
// O times 1 is O): after the first tiles that is rare, and O is D / 2 registers a thread.
template <int D>
__device__ __forceinline__ void rescale_o(WarpState<D>& w, const float (&alpha)[2]) {
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            w.o[j][0] *= alpha[0];
            w.o[j][1] *= alpha[0];
            w.o[j][2] *= alpha[1];
            w.o[j][3] *= alpha[1];
        }
    }
}

// P (f32 in the S layout) as the A fragments of the P V products: the keys of k16 step ks.
// The C layout of two n8 tiles is the A layout of one.
template <typename T, int NT>
__device__ __forceinline__ void pack_p_step(uint32_t (&pa)[4], const float (&s)[NT][4], int ks) {
    pa[0] = Mma<T>::pack(s[2 * ks][0], s[2 * ks][1]);
    pa[1] = Mma<T>::pack(s[2 * ks][2], s[2 * ks][3]);
    pa[2] = Mma<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pa[3] = Mma<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
}

// S = Q K^T, softmax update and O += P V for this warp's KW keys of one tile, whose first key is
// `k0`. Masks with the rows' visible ranges [row_lo, row_hi) (within this split). MODS: softcap,
// ALiBi and the bias first: staged in shared memory (`sBias`, f32) where the block's rows share
// one key vector, else read at the rows' offsets (`bias_row`, keys < sk); a 2-byte bias has the
// dtype of q, TB, which is not T where an FP8 cache's tiles are converted to f16. DIRECT: sK and
// sV are the stored FP8 tiles (kv8_chunk), converted here into the fragments (the columns of Q
// permuted by direct_k_col, those of O by direct_col); `kw0` is the warp's first row in them.
// WG: the warpgroup's products by wgmma (decode/wgmma.cuh; every warp of it calls this, KW is
// the whole tile), its rows from row `q_row0` of the ROWS-row Q tile.
template <typename T, typename TB, int D, int KW, bool MODS, bool DIRECT = false,
          bool WG = false, int ROWS = 16>
__device__ __forceinline__ void warp_tile(WarpState<D>& w, const FlashParams& p, const T* sQ,
                                          const T* sK, const T* sV, const SwzRow<D>& q_off,
                                          const SwzRow<D>& k_off, const SwzRow<D>& v_off, int k0,
                                          const int (&row_lo)[2], const int (&row_hi)[2],
                                          const int (&diag)[2], const float (&slope_log2)[2],
                                          float unit, const int64_t (&bias_off)[2], int sk,
                                          float qscale, const float* sBias, int kw0,
                                          int q_row0) {
    constexpr int NT = KW / 8;
    const int lane = threadIdx.x % 32;
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
    if constexpr (WG) {
#ifdef FLASH_DECODE_WG
        sm90::wg_fence();
        wg_scores_issue<T, D, ROWS, KW>(s, sQ, q_row0, sK);
        wg_settle<0>(s);
#endif
    } else if constexpr (DIRECT) {
        // Key 8 j + lane / 4 of the warp's: the thread's run of D / 4 bytes, word kk holding
        // its (b0 b1, b2 b3) pair of k16 step kk.
        constexpr int KB = D / 4;
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(sK);
        uint32_t kw[NT][KB / 4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int r = kw0 + 8 * j + lane / 4;
#pragma unroll
            for (int q = 0; q < KB / 16; ++q) {
                const uint4 x = *reinterpret_cast<const uint4*>(
                    k8 + kv8_chunk<D>(r, (KB / 16) * (lane % 4) + q));
                kw[j][4 * q] = x.x;
                kw[j][4 * q + 1] = x.y;
                kw[j][4 * q + 2] = x.z;
                kw[j][4 * q + 3] = x.w;
            }
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4];
            ldsm_x4(qa, sQ + q_off.at(0, kk));
#pragma unroll
            for (int j = 0; j < NT; ++j)
                Mma<T>::run(s[j], qa, e4m3x2_to_f16x2((uint16_t)(kw[j][kk] & 0xffff)),
                            e4m3x2_to_f16x2((uint16_t)(kw[j][kk] >> 16)));
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4];
            ldsm_x4(qa, sQ + q_off.at(0, kk));
#pragma unroll
            for (int np = 0; np < KW / 16; ++np) {
                uint32_t kb[4];
                ldsm_x4(kb, sK + k_off.at(np, kk));
                Mma<T>::run(s[2 * np], qa, kb[0], kb[1]);
                Mma<T>::run(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }
    }
    float alpha[2];
    softmax_tile<TB, D, NT, MODS>(w, s, alpha, p, k0, row_lo, row_hi, diag, slope_log2, unit,
                                  bias_off, sk, qscale, sBias);
    rescale_o(w, alpha);
    // O += P V, one k16 step per 16 keys: the C layout of two n8 tiles is the A layout of one.
    if constexpr (WG) {
#ifdef FLASH_DECODE_WG
        uint32_t pa[KW / 16][4];
#pragma unroll
        for (int ks = 0; ks < KW / 16; ++ks) pack_p_step<T, NT>(pa[ks], s, ks);
        sm90::wg_fence();
        wg_pv_issue<T, D, KW>(w.o, pa, sV);
        wg_settle<0>(w.o);
#endif
        return;
    }
#pragma unroll
    for (int ks = 0; ks < KW / 16; ++ks) {
        uint32_t pa[4];
        pack_p_step<T, KW / 8>(pa, s, ks);
        if constexpr (DIRECT) {
            // Keys 2 t + {0, 1} and + 8 of the step (t = lane % 4), bytes j of the run of
            // D / 8 that column lane / 4 of every n8 tile j of O holds (direct_col): byte j of
            // two rows makes one (b0 b1) pair.
            constexpr int VB = D / 8;
            const uint8_t* v8 = reinterpret_cast<const uint8_t*>(sV);
            const int r0 = kw0 + 16 * ks + 2 * (lane % 4);
            uint32_t vw[4][VB / 4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + (i % 2) + 8 * (i / 2);
                const int byte = VB * (lane / 4);
#pragma unroll
                for (int q = 0; q < (VB + 15) / 16; ++q) {
                    const uint8_t* src = v8 + kv8_chunk<D>(r, (byte + 16 * q) / 16) + byte % 16;
                    if constexpr (VB >= 16) {
                        const uint4 x = *reinterpret_cast<const uint4*>(src);
                        vw[i][4 * q] = x.x;
                        vw[i][4 * q + 1] = x.y;
                        vw[i][4 * q + 2] = x.z;
                        vw[i][4 * q + 3] = x.w;
                    } else {
                        const uint2 x = *reinterpret_cast<const uint2*>(src);
                        vw[i][0] = x.x;
                        vw[i][1] = x.y;
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < VB / 4; ++q) {
                // (row 2t, row 2t + 1) and (+ 8, + 9): bytes 4 q + {0, 1} then + {2, 3}.
                const uint32_t lo01 = __byte_perm(vw[0][q], vw[1][q], 0x5140);
                const uint32_t hi01 = __byte_perm(vw[0][q], vw[1][q], 0x7362);
                const uint32_t lo89 = __byte_perm(vw[2][q], vw[3][q], 0x5140);
                const uint32_t hi89 = __byte_perm(vw[2][q], vw[3][q], 0x7362);
                const uint32_t pr[2][2] = {{lo01, lo89}, {hi01, hi89}};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int sh = 16 * (u % 2);
                    Mma<T>::run(w.o[4 * q + u], pa,
                                e4m3x2_to_f16x2((uint16_t)(pr[u / 2][0] >> sh)),
                                e4m3x2_to_f16x2((uint16_t)(pr[u / 2][1] >> sh)));
                }
            }
        } else {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];
                ldsm_x4_t(vb, sV + v_off.at(ks, dp));
                Mma<T>::run(w.o[2 * dp], pa, vb[0], vb[1]);
                Mma<T>::run(w.o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
    }
}

// The first element of one packed row in the output (one split) and in the split scratch (f32).
template <typename T>
__device__ __forceinline__ T* out_row(const FlashParams& p, const PackedRow& x, int64_t row_g) {
    return static_cast<T*>(p.o) + row_g * p.o_seq + (int64_t)x.h * p.o_head;
}
__device__ __forceinline__ float* part_row(const FlashParams& p, const PackedRow& x,
                                           int64_t row_g, int split) {
    return p.o_part + ((int64_t)split * p.total_q + row_g) * p.o_seq + (int64_t)x.h * p.o_head;
}

// Writes one packed row's value (already normalised) to the output, or to the split scratch.
template <typename T>
__device__ __forceinline__ void store(const FlashParams& p, const PackedRow& x, int64_t row_g,
                                      int split, int c, float val) {
    if (p.num_splits == 1)
        out_row<T>(p, x, row_g)[c] = rowwise::from_f32<T>(val);
    else
        part_row(p, x, row_g, split)[c] = val;
}

// threadIdx.x, blockIdx.x and blockIdx.z read anew (volatile: not merged with an earlier read,
// so a value derived from them need not stay live in between).
__device__ __forceinline__ int fresh_tid_x() {
    int v;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
    return v;
}
__device__ __forceinline__ int fresh_ctaid_x() {
    int v;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v));
    return v;
}
__device__ __forceinline__ int fresh_ctaid_z() {
    int v;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v));
    return v;
}

// Writes this thread's columns of one packed row of a warp's O (fragment half hf, times inv)
// from `dst`, the row's first element in the output (T) or the split scratch (f32): one row
// pointer, where per-element addresses of both destinations, hoisted by the compiler, spilled
// at d 256.
template <typename E, int D, bool DIRECT>
__device__ __forceinline__ void store_frag_row(E* dst, int d_out, const float (&o)[D / 8][4],
                                               int hf, float inv) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int n = 2 * (lane % 4) + e;
            const int c = DIRECT ? direct_col<D>(j, n) : 8 * j + n;
            if (c < d_out) dst[c] = rowwise::from_f32<E>(o[j][2 * hf + e] * inv);
        }
}

// Writes one packed row's base-2 log-sum-exp: natural-log lse (one split) or the scratch.
__device__ __forceinline__ void store_lse(const FlashParams& p, const PackedRow& x, int b,
                                          int64_t row_g, int split, float lse2) {
    if (p.num_splits == 1) {
        const int64_t li = p.cu_q || p.q_uniform ? (int64_t)x.h * p.lse_head + row_g
                                                 : ((int64_t)b * p.heads + x.h) * p.seq_q + x.i;
        p.lse[li] = lse2 * LN2_F;
    } else {
        p.lse_part[((int64_t)split * p.heads + x.h) * p.total_q + row_g] = lse2;
    }
}

// T: the dtype of q and the output (and of a 2-byte bias). KV8: K and V are e4m3 (then the tiles
// and products are f16, `Tc`).
// WG: the tile products by warpgroup MMA (sm_90a; decode/wgmma.cuh).
template <typename T, int D, int RG, int KG, int BC, int STAGES, bool MODS, bool KV8 = false,
          bool WG = false>
__device__ __forceinline__ void partial(const FlashParams& p) {
    using Tr = Traits<T, D, RG, KG, BC, STAGES, KV8, WG>;
    using Tc = typename std::conditional<KV8, __half, T>::type;
    constexpr int THREADS = Tr::THREADS, ROWS = Tr::ROWS, KW = Tr::KW, DT = Tr::DT;
    constexpr int WARPS = Tr::WARPS;
    constexpr bool DIRECT = Tr::DIRECT;
    extern __shared__ __align__(128) unsigned char smem_dyn[];
    // (WG: up to the next Tr::ALIGN-byte boundary.)
    constexpr int AM = Tr::ALIGN > 0 ? Tr::ALIGN - 1 : 0;
    unsigned char* smem_raw =
        smem_dyn + ((AM + 1 - (__cvta_generic_to_shared(smem_dyn) & AM)) & AM);
    Tc* sQ = reinterpret_cast<Tc*>(smem_raw);
    // Stage s: K at sKV + 2 s TILE bytes, V right after; KV8: the converted f16 pair after the
    // ring.
    unsigned char* sKV = smem_raw + ROWS * D * 2;
    Tc* sWork = reinterpret_cast<Tc*>(sKV + STAGES * 2 * Tr::TILE);

    // (Not const: read again after the key loop, see there.)
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int rg = warp / KG, kg = warp % KG;
    const int split = blockIdx.y;
    const int kvh = blockIdx.x / p.m_tiles;
    const int b = blockIdx.z;
    int m0 = (blockIdx.x % p.m_tiles) * ROWS;  // first packed row of the block

    BlockGeom g;
    if (!block_geom<true>(p, 0, 1, 0, b, g)) return;  // empty sequence: no rows
    const int i_first = m0 / p.kv_group;
    if (i_first >= g.sq) return;
    split_keys(p, split, i_first, min(g.sq - 1, (m0 + ROWS - 1) / p.kv_group), g);

    using Ts = typename std::conditional<KV8, uint8_t, T>::type;  // K/V as stored
    const Ts* kg_ptr = static_cast<const Ts*>(p.k) + (int64_t)b * p.k_batch +
                       g.k_row0 * p.k_seq + (int64_t)kvh * p.k_head;
    const Ts* vg_ptr = static_cast<const Ts*>(p.v) + (int64_t)b * p.v_batch +
                       g.k_row0 * p.v_seq + (int64_t)kvh * p.v_head;

    // This thread's two packed rows: diagonal, visible keys (within this split), ALiBi slope.
    int diag[2], row_lo[2], row_hi[2];
    float slope_log2[2];
    int64_t bias_off[2] = {0, 0};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const PackedRow x = packed_row(p, m0, 16 * rg + lane / 4 + 8 * hf, kvh, g.sq);
        diag[hf] = x.i + g.sk - g.sq;
        row_keys(p, b, diag[hf], g.sk, row_lo[hf], row_hi[hf]);
        row_lo[hf] = max(row_lo[hf], g.n_lo);
        row_hi[hf] = min(row_hi[hf], g.n_hi);
        slope_log2[hf] = (MODS && p.alibi) ? p.alibi[b * p.alibi_batch + x.h] * LOG2E_F : 0.f;
        if (MODS && p.bias) bias_off[hf] = bias_row(p, b, x.h, x.i, g.sq);
    }
    WarpState<D> w;
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) w.o[j][e] = 0.f;
    w.m[0] = w.m[1] = -INFINITY;
    w.l[0] = w.l[1] = 0.f;

    const SwzRow<D> q_off(16 * rg + lane % 16, lane / 16);
    const SwzRow<D> k_off(KW * kg + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<D> v_off(KW * kg + lane % 16, lane / 16);

    // A warp whose row tile holds no packed row (an instance wider than the call's rows) skips
    // the tile products: it still copies its share of each tile, but issues nothing else that
    // the busy warps of its SM would wait behind. One row tile always holds a row (the block
    // returned above otherwise): no test, and no register, in those instances. The loop tests
    // the warp's end of keys: the block's, or 0 (keys are not negative) without rows.
    // WG: a warpgroup's warps issue its products together, so they test its first row
    // (wg_row0, in the block's Q tile).
    const int wg_row0 = 64 * (rg / 4);
    const bool has_rows = RG == 1 || m0 + (WG ? wg_row0 : 16 * rg) < g.sq * p.kv_group;
    const int warp_hi = has_rows ? g.n_hi : 0;

    const int t_begin = g.n_lo / BC;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BC - 1) / BC : t_begin;

    // During the key loop: the block-table entries of two consecutive K/V tiles (paged caches,
    // tile t in blk[t % 2]) and the staged key bias of two (tile t in bias[t % 2]). In the merge
    // after it (KG > 1): the warps' row maxima, sums and factors, and the rows' results. Static
    // shared memory stays within the planner's reserve (STATIC_SMEM_RESERVE, 1 KB): one union,
    // with the loop's arrays of tiles wider than 64 keys in the side region (Tr::SIDE) instead.
    constexpr int MW = KG > 1 ? WARPS : 1;
    // (The FP8-cache twins read the bias from global memory: at their register cap, and with
    // their static shared memory at the reserve, the staging spilled.)
    constexpr bool STAGE_BIAS = MODS && !KV8;
    // The loop's arrays: static below, or in the side region (Tr::SIDE) for wide tiles.
    constexpr int LBC = Tr::SIDE ? 1 : BC;
    __shared__ union {
        struct {
            int blk[2][LBC];
            float bias[STAGE_BIAS ? 2 : 1][LBC];
        } loop;
        struct {
            float m[MW][16], l[MW][16], scale[MW][16];
            float inv[KG > 1 ? ROWS : 1], lse2[KG > 1 ? ROWS : 1];
        } ml;
        int last;  // last_split's flag, after the merge
    } sh_u;
    unsigned char* side = sKV + STAGES * 2 * Tr::TILE + Tr::WORK;
    int(*sh_blk)[BC] = Tr::SIDE ? reinterpret_cast<int(*)[BC]>(side)
                                : reinterpret_cast<int(*)[BC]>(sh_u.loop.blk);
    float(*sh_bias)[BC] = Tr::SIDE ? reinterpret_cast<float(*)[BC]>(side + 2 * BC * 4)
                                   : reinterpret_cast<float(*)[BC]>(sh_u.loop.bias);
    const bool paged = p.block_table != nullptr;
    // Thread tid < BC fetches the table entry of key tid of tile t (-1 elsewhere), and stores it
    // (as a cache row where the blocks are dense).
    auto fetch = [&](int t) {
        return paged && tid < BC && t < t_end ? table_entry(p, b, t * BC + tid, g.sk) : -1;
    };
    // Dense blocks' entries are stored as cache rows (table_row), but in the FP8-cache twins:
    // at their register cap, the second copy loop made them spill.
    const bool dense = !KV8 && p.page_dense;
    // Only tiles the loop will issue: the buffer of a later one may still be read.
    auto put = [&](int t, int blk) {
        if (paged && tid < BC && t < t_end)
            sh_blk[t % 2][tid] = dense ? table_row(p, blk, t * BC + tid) : blk;
    };
    // Issues the copies of tile t into ring stage `stage` (the table entries of a paged tile
    // must be in shared memory, behind a barrier).
    auto issue = [&](int t, int stage) {
        unsigned char* st = sKV + stage * 2 * Tr::TILE;
        load_kv<Ts, D, BC, THREADS, WG>(reinterpret_cast<Ts*>(st),
                                    reinterpret_cast<Ts*>(st + Tr::TILE), p, kg_ptr, vg_ptr,
                                    (int64_t)kvh * p.k_head, (int64_t)kvh * p.v_head, t * BC,
                                    min(BC, g.sk - t * BC), paged ? sh_blk[t % 2] : nullptr,
                                    dense);
    };

    // A bias that is one key vector for every row of the block (no head or row stride, such as
    // a key-padding mask) is staged a tile at a time in shared memory, as the table entries are:
    // thread tid < BC loads key tid of the tile after the one in hand, and stores it after that
    // tile's compute; the scores then read it without a round trip to global memory.
    const bool key_bias = STAGE_BIAS && p.bias && p.bias_h == 0 && (p.bias_q == 0 || g.sq == 1);
    // (The row's address is rebuilt from the parameters at each load: the d 256 instances have
    // no registers to hold it.)
    auto bias_of = [&](int t) {
        const int key = t * BC + tid;
        if (!key_bias || tid >= BC || t >= t_end || key >= g.sk) return 0.f;
        const int esize = p.bias_f32 ? 4 : 2;
        const char* row = static_cast<const char*>(p.bias) + (int64_t)b * p.bias_b * esize;
        return bias_elem<T>(p, row, (int64_t)key * p.bias_k);
    };
    if (key_bias && tid < BC)
        sh_bias[STAGE_BIAS ? t_begin % 2 : 0][tid] = bias_of(t_begin);

    load_q<T, D, ROWS, THREADS, WG>(reinterpret_cast<T*>(sQ), p, b, g, m0, kvh);
    // KV8: Q in a group of its own, converted once the first tiles are on their way.
    if constexpr (KV8) cp_async_commit();
    // Paged: the table entries of the first STAGES tiles are loaded together (one round trip
    // before the first copy, not one per tile), then stored and issued a tile at a time through
    // the two buffers; and the entries stored after each tile's compute were loaded an
    // iteration earlier, so that a tile's compute need not cover a round trip of its own. (The
    // FP8-cache twins, at their register cap, load each tile's entries where they are stored:
    // holding them longer made them spill.)
    constexpr bool EARLY_TABLE = !KV8;
    int first_blk[STAGES];
#pragma unroll
    for (int s = 0; s < STAGES; ++s) first_blk[s] = EARLY_TABLE ? fetch(t_begin + s) : -1;
    auto first = [&](int s) { return EARLY_TABLE ? first_blk[s] : fetch(t_begin + s); };
    int ahead = EARLY_TABLE ? fetch(t_begin + STAGES) : -1;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int t = t_begin + s;
        if (t < t_end) {
            if (paged) {
                put(t, first(s));
                __syncthreads();
            }
            issue(t, s);
        }
        cp_async_commit();
    }
    // The first tile the loop issues: its table entries are in place before its first barrier.
    put(t_begin + STAGES - 1, first(STAGES - 1));
    float qscale = 1.f;
    // KV8: the descales of this (sequence, K/V head), folded into the scores' factor and the
    // output's (FlashParams::qk_descale, v_descale; absent: 1).
    float vscale = 1.f;
    if constexpr (KV8) {
        cp_async_wait<STAGES - 1>();
        __syncthreads();
        qscale = q_to_f16<T, D, ROWS, THREADS, DIRECT>(sQ);
        const int64_t bk = (int64_t)b * (p.heads / p.kv_group) + kvh;
        if (p.qk_descale) qscale *= p.qk_descale[bk];
        if (p.v_descale) vscale = p.v_descale[bk];
    }
    const float unit = MODS ? 1.f : p.scale_log2 * qscale;

    for (int t = t_begin; t < t_end; ++t) {
        const int it = t - t_begin;
        cp_async_wait<STAGES - 2>();
#ifdef FLASH_DECODE_WG
        if constexpr (WG) fence_copies();
#endif
        __syncthreads();
        const int tn = t + STAGES - 1;
        if (tn < t_end) issue(tn, (it + STAGES - 1) % STAGES);
        cp_async_commit();
        // The table entries of the tile after (loaded an iteration ago, or now in the FP8
        // twins), stored after this tile's compute (its buffer was last read by the copies of
        // tile tn - 1, before the barrier above); those of the tile after it are loaded now.
        const int next_blk = EARLY_TABLE ? ahead : fetch(tn + 1);
        if constexpr (EARLY_TABLE) ahead = fetch(tn + 2);
        const float next_bias = bias_of(t + 1);
        // The tiles the warps read: the stage's (as stored; DIRECT: FP8 bytes), or their
        // conversion.
        const unsigned char* stage = sKV + (it % STAGES) * 2 * Tr::TILE;
        const Tc* sK = reinterpret_cast<const Tc*>(stage);
        const Tc* sV = reinterpret_cast<const Tc*>(stage + Tr::TILE);
        if constexpr (KV8 && !DIRECT) {
            convert_kv8<D, BC, THREADS>(sWork, stage);
            __syncthreads();
            sK = sWork;
            sV = sWork + BC * D;
        }
        const int k0 = t * BC + KW * kg;  // this warp's first key
        const int bt = STAGE_BIAS ? t % 2 : 0, bn = STAGE_BIAS ? (t + 1) % 2 : 0;
        if (k0 < warp_hi && k0 + KW > g.n_lo)
            warp_tile<Tc, T, D, KW, MODS, DIRECT, WG, ROWS>(
                w, p, sQ, sK, sV, q_off, k_off, v_off, k0,
                row_lo, row_hi, diag, slope_log2, unit, bias_off, g.sk, qscale,
                key_bias ? &sh_bias[bt][KW * kg] : nullptr, KW * kg, wg_row0);
        put(tn + 1, next_blk);
        // Its buffer was last read by the compute of tile t - 1, before the barrier above.
        if (key_bias && tid < BC) sh_bias[bn][tid] = next_bias;
    }
    cp_async_wait<0>();
    __syncthreads();
    // The thread's indices, the block's first row and its sequence's first output row, derived
    // again from the special registers rather than held across the key loop, where at their
    // register caps (d 64 at 128 registers, d 128 at 168, d 256 at 255) ptxas spilled them.
    tid = fresh_tid_x();
    warp = tid / 32;
    lane = tid % 32;
    rg = warp / KG;
    kg = warp % KG;
    m0 = (fresh_ctaid_x() % p.m_tiles) * ROWS;
    g.out_row0 = out_row0(p, fresh_ctaid_z());

    // Row sums over the quad (each thread summed its own columns).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        w.l[hf] += __shfl_xor_sync(0xffffffff, w.l[hf], 1);
        w.l[hf] += __shfl_xor_sync(0xffffffff, w.l[hf], 2);
    }
    if constexpr (KG == 1) {
        // Each warp holds whole rows: normalise and write straight from the registers.
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = 16 * rg + lane / 4 + 8 * hf;
            const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
            if (!x.valid) continue;
            const float l = w.l[hf];
            const float m_scaled = w.m[hf] == -INFINITY ? 0.f : w.m[hf] * unit;
            // A sink joins a row once: here with one split, else in the merge (decode/combine.cuh).
            const RowEnd end = row_end(m_scaled, l, p.num_splits == 1 ? p.sinks : nullptr, x.h);
            const float inv = KV8 ? end.inv * vscale : end.inv;
            const int64_t row_g = g.out_row0 + x.i;
            if (p.num_splits == 1)
                store_frag_row<T, D, DIRECT>(out_row<T>(p, x, row_g), p.d_out, w.o, hf, inv);
            else
                store_frag_row<float, D, DIRECT>(part_row(p, x, row_g, split), p.d_out, w.o, hf,
                                                 inv);
            // A NaN l (a NaN score) keeps NaN in the lse, as O keeps it.
            if (lane % 4 == 0) store_lse(p, x, b, row_g, split, end.lse2);
        }
    } else {
        // Merge the KG warps of each row tile in warp order: M = max of their maxima, each
        // warp's O and l scaled by 2^(m_w - M), summed in shared memory.
        float(*sh_m)[16] = sh_u.ml.m;
        float(*sh_l)[16] = sh_u.ml.l;
        float(*sh_scale)[16] = sh_u.ml.scale;
        float* sh_inv = sh_u.ml.inv;
        float* sh_lse2 = sh_u.ml.lse2;
        if (lane % 4 == 0) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                sh_m[warp][lane / 4 + 8 * hf] = w.m[hf];
                sh_l[warp][lane / 4 + 8 * hf] = w.l[hf];
            }
        }
        __syncthreads();
        if (tid < ROWS) {
            const int grp = tid / 16, r = tid % 16;
            float m = -INFINITY;
#pragma unroll
            for (int k = 0; k < KG; ++k) m = fmaxf(m, sh_m[grp * KG + k][r]);
            const float m_scaled = m == -INFINITY ? 0.f : m * unit;
            float l = 0.f;
#pragma unroll
            for (int k = 0; k < KG; ++k) {
                const float s = fast_exp2(fmaf(sh_m[grp * KG + k][r], unit, -m_scaled));
                sh_scale[grp * KG + k][r] = s;
                l += sh_l[grp * KG + k][r] * s;
            }
            const PackedRow x = packed_row(p, m0, tid, kvh, g.sq);
            const RowEnd end =
                row_end(m_scaled, l, p.num_splits == 1 && x.valid ? p.sinks : nullptr, x.h);
            sh_inv[tid] = KV8 ? end.inv * vscale : end.inv;
            sh_lse2[tid] = end.lse2;
        }
        __syncthreads();
        float* sO = reinterpret_cast<float*>(sKV);  // ROWS x D f32, the ring is drained
        for (int k = 0; k < KG; ++k) {
            if (kg == k) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = lane / 4 + 8 * hf;
                    const float s = sh_scale[warp][r];
#pragma unroll
                    for (int j = 0; j < DT; ++j) {
                        float2* dst = reinterpret_cast<float2*>(sO + (16 * rg + r) * D + j * 8 +
                                                                2 * (lane % 4));
                        float2 v = make_float2(w.o[j][2 * hf] * s, w.o[j][2 * hf + 1] * s);
                        if (k > 0) {
                            v.x += dst->x;
                            v.y += dst->y;
                        }
                        *dst = v;
                    }
                }
            }
            __syncthreads();
        }
        // Warp w writes rows w, w + WARPS, ...: one packed-row lookup (a division) per row, and
        // the lanes' stores of a row are contiguous.
        for (int r = warp; r < ROWS; r += WARPS) {
            const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
            if (!x.valid) continue;
            for (int c = lane; c < p.d_out; c += 32) {
                // (sO is in the fragments' column order: column n of tile j at 8 j + n.)
                const int at = DIRECT ? 8 * (c % DT) + c / DT : c;
                store<T>(p, x, g.out_row0 + x.i, split, c, sO[r * D + at] * sh_inv[r]);
            }
        }
        if (tid < ROWS) {
            const PackedRow x = packed_row(p, m0, tid, kvh, g.sq);
            if (x.valid) store_lse(p, x, b, g.out_row0 + x.i, split, sh_lse2[tid]);
        }
    }
    // Split calls with a fused merge (counters given): the group's last block merges the
    // splits (the ring is drained and its threads past the merge above). Not in the FP8-cache
    // twins that convert through shared memory: their registers are full (ptxas spills), and
    // the planner gives them the kernel.
    if constexpr (!KV8 || DIRECT)
        if (p.split_sem && last_split(p, sh_u.last))
            combine_rows<T, D, ROWS, WARPS>(p, m0, kvh, b, g, reinterpret_cast<float*>(sKV));
}

}  // namespace decode

// Entry points of the table in src/cuda/instances.rs (DECODE_INSTANCES), expanded by build.rs
// into FLASH_DECODE_INSTANCES with the shared-memory size the planner assumes.
#define FLASH_DECODE_INSTANCE(NAME, T, D, RG, KG, BC, STAGES, SMEM_BYTES)                        \
    static_assert(decode::Traits<T, D, RG, KG, BC, STAGES>::SMEM == SMEM_BYTES,                  \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");            \
    static_assert(D <= decode::COMBINE_MAX_D, "the combine kernel merges heads up to 256");      \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32) NAME(const FlashParams p) {       \
        decode::partial<T, D, RG, KG, BC, STAGES, false>(p);                                     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32) NAME##_mods(const FlashParams p) { \
        decode::partial<T, D, RG, KG, BC, STAGES, true>(p);                                      \
    }

// The FP8-cache twins of the table's instances (kernels/decode/decode_fp8.cu). (One block per SM
// at least: without it ptxas holds the d 64 twins to 96 registers, and they spill.)
#define FLASH_DECODE_KV8_INSTANCE(NAME, T, D, RG, KG, BC, STAGES, SMEM_BYTES)                    \
    static_assert(decode::Traits<T, D, RG, KG, BC, STAGES, true>::SMEM == SMEM_BYTES,            \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");            \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32, 1) NAME(const FlashParams p) {    \
        decode::partial<T, D, RG, KG, BC, STAGES, false, true>(p);                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32, 1)                                \
        NAME##_mods(const FlashParams p) {                                                       \
        decode::partial<T, D, RG, KG, BC, STAGES, true, true>(p);                                \
    }

// The warpgroup-MMA instances (kernels/decode/decode_sm90.cu, sm_90a), from the same table.
#define FLASH_DECODE_WG_INSTANCE(NAME, T, D, RG, KG, BC, STAGES, SMEM_BYTES)                     \
    static_assert(decode::Traits<T, D, RG, KG, BC, STAGES, false, true>::SMEM == SMEM_BYTES,     \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");            \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32, 1) NAME(const FlashParams p) {    \
        decode::partial<T, D, RG, KG, BC, STAGES, false, false, true>(p);                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(RG * KG * 32, 1)                                \
        NAME##_mods(const FlashParams p) {                                                       \
        decode::partial<T, D, RG, KG, BC, STAGES, true, false, true>(p);                         \
    }
