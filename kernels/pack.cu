// Gathers a strided (batch, seq, heads, d) view of 16-bit elements into a contiguous
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
