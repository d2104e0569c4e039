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
// indices never write out of bounds. One thread per element; W is the element width (u16 or u32
// bits).
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
APPEND_KV(append_kv_u16, uint16_t)
APPEND_KV(append_kv_u32, uint32_t)
