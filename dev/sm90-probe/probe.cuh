// Helpers shared by the Hopper probes (wgmma.cu, depth.cu).
#pragma once
#include <stdint.h>

// Shared-memory matrix descriptor with the 128-byte swizzle, as sm90::make_desc in
// kernels/sm90/fwd.cuh (which the probes do not include: it needs the build's generated headers).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned clk() {
    unsigned c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
    return c;
}
// Keeps `x` (and the work behind it) alive without a store that ever executes.
__device__ __forceinline__ void keep(float x, unsigned* out) {
    if (x == 1234.5f) out[1 << 16] = 1;
}
