// Copy kernels. pack_b16 gathers a strided (batch, seq, heads, d) view of 16-bit elements into a contiguous
// (batch, seq, heads, dp) buffer, zero-filling columns d..dp. The tensor-core kernel reads rows
// with 16-byte cp.async, so it needs a unit dim stride, 16-byte aligned rows and a head dim that
// is a multiple of 8; views that are not (transposed last dims, odd offsets, head dim 40+1...)
// are packed by this kernel first. It is the slow path: one thread per output element.
#include <stdint.h>

extern "C" __global__ void pack_b16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst,
                                    int64_t batch, int64_t seq, int64_t heads, int64_t d,
                                    int64_t dp, int64_t s_batch, int64_t s_seq, int64_t s_head,
                                    int64_t s_dim) {
    const int64_t total = batch * seq * heads * dp;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t x = i % dp;
        int64_t rest = i / dp;
        const int64_t h = rest % heads;
        rest /= heads;
        const int64_t s = rest % seq;
        const int64_t b = rest / seq;
        dst[i] = x < d ? src[b * s_batch + s * s_seq + h * s_head + x * s_dim] : (uint16_t)0;
    }
}

// Appends new keys or values (batch, seq_new, heads, d) to a KV cache in place: row (b, t, h)
// goes to position start[b] + t of sequence b, i.e. row (pos % page) of block
// table[b][pos / page]; a contiguous cache is one block per sequence and passes no table.
// Positions past the table's capacity and blocks outside the cache are skipped, so bad lengths or
// indices never write out of bounds. One thread per element; W is the element width (u8, u16 or
// u32 bits).
template <typename W>
__device__ void append_kv(W* __restrict__ cache, const W* __restrict__ src,
                          const int32_t* __restrict__ table, const uint32_t* __restrict__ start,
                          int64_t batch, int64_t seq_new, int64_t heads, int64_t d,
                          int64_t max_blocks, int64_t page, int64_t num_blocks, int64_t c_batch,
                          int64_t c_seq, int64_t c_head, int64_t c_dim, int64_t s_batch,
                          int64_t s_seq, int64_t s_head, int64_t s_dim) {
    const int64_t total = batch * seq_new * heads * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t x = i % d;
        int64_t rest = i / d;
        const int64_t h = rest % heads;
        rest /= heads;
        const int64_t t = rest % seq_new;
        const int64_t b = rest / seq_new;
        const int64_t pos = (int64_t)start[b] + t;
        if (pos >= max_blocks * page) continue;
        // No table: a contiguous cache, one block per sequence (max_blocks = 1).
        const int64_t blk = table ? (int64_t)table[b * max_blocks + pos / page] : b;
        if (blk < 0 || blk >= num_blocks) continue;
        cache[blk * c_batch + (pos % page) * c_seq + h * c_head + x * c_dim] =
            src[b * s_batch + t * s_seq + h * s_head + x * s_dim];
    }
}

#define APPEND_KV(NAME, W)                                                                      \
    extern "C" __global__ void NAME(W* cache, const W* src, const int32_t* table,               \
                                    const uint32_t* start, int64_t batch, int64_t seq_new,      \
                                    int64_t heads, int64_t d, int64_t max_blocks, int64_t page, \
                                    int64_t num_blocks, int64_t c_batch, int64_t c_seq,         \
                                    int64_t c_head, int64_t c_dim, int64_t s_batch,             \
                                    int64_t s_seq, int64_t s_head, int64_t s_dim) {             \
        append_kv<W>(cache, src, table, start, batch, seq_new, heads, d, max_blocks, page,      \
                     num_blocks, c_batch, c_seq, c_head, c_dim, s_batch, s_seq, s_head, s_dim); \
    }
APPEND_KV(append_kv_u8, uint8_t)
APPEND_KV(append_kv_u16, uint16_t)
APPEND_KV(append_kv_u32, uint32_t)

// FP8 (e4m3) conversions of FP8 calls, over a strided rank-4 (n0, n1, n2, n3) view into a
// contiguous buffer: e4m3 -> f16/bf16/f32 (exact), and f16/bf16 -> e4m3 as
// saturate(x / descale[i0][i2]) with an f32 (n0, n2) descale table (null: 1), NaN kept. (candle
// 0.11's own CUDA casts of F8E4M3 look up kernels under names its kernel library does not
// define.) One thread per element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

struct View4 {
    int64_t n0, n1, n2, n3, s0, s1, s2, s3;
};

// The source offset of contiguous element i, and its (i0, i2) indices.
__device__ __forceinline__ int64_t view_at(const View4& v, int64_t i, int64_t& i0, int64_t& i2) {
    const int64_t i3 = i % v.n3;
    int64_t rest = i / v.n3;
    i2 = rest % v.n2;
    rest /= v.n2;
    const int64_t i1 = rest % v.n1;
    i0 = rest / v.n1;
    return i0 * v.s0 + i1 * v.s1 + i2 * v.s2 + i3 * v.s3;
}

__device__ __forceinline__ float e4m3_to_f32(uint8_t x) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x, __NV_E4M3)));
}

__device__ __forceinline__ void store_f32(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f32(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_f32(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ float load_f32(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }

#define E4M3_TO(NAME, T)                                                                       \
    extern "C" __global__ void NAME(const uint8_t* __restrict__ src, T* __restrict__ dst,      \
                                    int64_t n0, int64_t n1, int64_t n2, int64_t n3, int64_t s0, \
                                    int64_t s1, int64_t s2, int64_t s3) {                      \
        const View4 v{n0, n1, n2, n3, s0, s1, s2, s3};                                         \
        const int64_t total = v.n0 * v.n1 * v.n2 * v.n3;                                       \
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;            \
             i += (int64_t)gridDim.x * blockDim.x) {                                           \
            int64_t i0, i2;                                                                    \
            store_f32(dst + i, e4m3_to_f32(src[view_at(v, i, i0, i2)]));                       \
        }                                                                                      \
    }
E4M3_TO(e4m3_to_f32, float)
E4M3_TO(e4m3_to_f16, __half)
E4M3_TO(e4m3_to_bf16, __nv_bfloat16)

// The same for a contiguous source whose start is 8-byte aligned (the usual case): eight
// elements a thread, one 8-byte load and 16-byte stores, no index arithmetic (the 64-bit
// divisions of view_at cost more than the bytes move). Element groups*8 .. n, the tail, go to
// the first n % 8 threads of the grid.
#define E4M3_TO_FLAT(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const uint8_t* __restrict__ src, T* __restrict__ dst,      \
                                    int64_t n) {                                               \
        constexpr int CHUNKS = 8 * (int)sizeof(T) / 16;                                        \
        const int64_t groups = n / 8;                                                          \
        const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;                     \
        for (int64_t g = id; g < groups; g += (int64_t)gridDim.x * blockDim.x) {               \
            const uint2 x = reinterpret_cast<const uint2*>(src)[g];                            \
            const uint8_t* b = reinterpret_cast<const uint8_t*>(&x);                           \
            union {                                                                            \
                T e[8];                                                                        \
                uint4 c[CHUNKS];                                                               \
            } out;                                                                             \
            _Pragma("unroll") for (int e = 0; e < 8; ++e)                                      \
                store_f32(out.e + e, e4m3_to_f32(b[e]));                                       \
            uint4* d = reinterpret_cast<uint4*>(dst + g * 8);                                  \
            _Pragma("unroll") for (int c = 0; c < CHUNKS; ++c) d[c] = out.c[c];                \
        }                                                                                      \
        if (id < n - groups * 8)                                                               \
            store_f32(dst + groups * 8 + id, e4m3_to_f32(src[groups * 8 + id]));              \
    }
E4M3_TO_FLAT(e4m3_to_f32_flat, float)
E4M3_TO_FLAT(e4m3_to_f16_flat, __half)
E4M3_TO_FLAT(e4m3_to_bf16_flat, __nv_bfloat16)

#define TO_E4M3(NAME, T)                                                                       \
    extern "C" __global__ void NAME(const T* __restrict__ src, uint8_t* __restrict__ dst,      \
                                    const float* __restrict__ descale, int64_t n0, int64_t n1, \
                                    int64_t n2, int64_t n3, int64_t s0, int64_t s1, int64_t s2, \
                                    int64_t s3) {                                              \
        const View4 v{n0, n1, n2, n3, s0, s1, s2, s3};                                         \
        const int64_t total = v.n0 * v.n1 * v.n2 * v.n3;                                       \
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;            \
             i += (int64_t)gridDim.x * blockDim.x) {                                           \
            int64_t i0, i2;                                                                    \
            float x = load_f32(src + view_at(v, i, i0, i2));                                   \
            if (descale) x = x / descale[i0 * v.n2 + i2];                                      \
            dst[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);                      \
        }                                                                                      \
    }
TO_E4M3(f16_to_e4m3, __half)
TO_E4M3(bf16_to_e4m3, __nv_bfloat16)

// The sm_90a FP8 forward's V: e4m3 rows (batch, seq, heads, d) as Vt (batch, heads, d, keys),
// each head's keys padded with zeros to `keys` (a multiple of 128) and, within each 32, in the
// order of the P fragments the kernel builds (kernels/sm90/fwd_mainloop.cuh, pack_p): position
// c of a 32-key step holds key fp8_v_key(c). 8-bit wgmma reads both operands K-major, so P V
// needs V with its keys contiguous. One block per (128 keys, head, batch): the keys' rows
// (16-byte chunks, d a multiple of 16 and at most 256, rows 16-byte aligned) into shared memory,
// then D rows of 128 bytes out.
__device__ __forceinline__ int fp8_v_key(int c) {
    return (c & 16) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1);
}

extern "C" __global__ void e4m3_v_transpose(const uint8_t* __restrict__ src,
                                            uint8_t* __restrict__ dst, int64_t seq,
                                            int64_t heads, int64_t d, int64_t keys,
                                            int64_t s_batch, int64_t s_seq, int64_t s_head) {
    // 16 bytes of padding per key row: the column reads below then spread over the banks.
    __shared__ __align__(16) uint8_t tile[128][256 + 16];
    const int64_t k0 = (int64_t)blockIdx.x * 128;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    const int chunks = (int)(d / 16);
    for (int i = threadIdx.x; i < 128 * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i % chunks;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (k0 + r < seq)
            x = *reinterpret_cast<const uint4*>(src + b * s_batch + (k0 + r) * s_seq +
                                                h * s_head + c * 16);
        *reinterpret_cast<uint4*>(&tile[r][c * 16]) = x;
    }
    __syncthreads();
    uint8_t* out = dst + ((b * heads + h) * d) * keys + k0;
    for (int i = threadIdx.x; i < (int)d * 8; i += blockDim.x) {
        const int row = i / 8, seg = i % 8;  // 16 key positions of column `row`
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t x = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pos = seg * 16 + j * 4 + e;
                x |= (uint32_t)tile[(pos & ~31) | fp8_v_key(pos & 31)][row] << (8 * e);
            }
            w[j] = x;
        }
        *reinterpret_cast<uint4*>(out + (int64_t)row * keys + seg * 16) =
            make_uint4(w[0], w[1], w[2], w[3]);
    }
}
