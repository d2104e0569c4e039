// The split-KV decode kernel with its tile products on Hopper's warpgroup MMA (compute_90a, loaded
// on compute capability 9.0 only): decode/partial.cuh with decode/wgmma.cuh, for the instances of
// src/cuda/instances.rs marked `wg` (64 or 128 packed rows a block), bf16 and f16. Their splits
// merge as the other instances' do; the combine kernel is the decode module's.
#define FLASH_DECODE_WG
#include "decode/partial.cuh"
#include "instances.cuh"

FLASH_DECODE_WG_INSTANCES(flash_decode_bf16, __nv_bfloat16)
FLASH_DECODE_WG_INSTANCES(flash_decode_f16, __half)
