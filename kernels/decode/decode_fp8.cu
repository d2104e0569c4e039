// Decode from FP8 (e4m3) KV caches: the partial pass of decode/partial.cuh over one-byte K and
// V, for bf16 and f16 queries and outputs, merging its splits as they do (the separate combine
// kernel is theirs: its partials are f32 whatever the cache holds). Built twice: compute_89
// PTX, with sm_89's e4m3 -> f16 conversion instruction, and compute_80 PTX for the GPUs before
// it (and the portable path), converting in integer and f16 arithmetic (e4m3x2_to_f16x2).
#include "decode/partial.cuh"
#include "instances.cuh"

FLASH_DECODE_KV8_INSTANCES(flash_decode_bf16_kv8, __nv_bfloat16)
FLASH_DECODE_KV8_INSTANCES(flash_decode_f16_kv8, __half)
