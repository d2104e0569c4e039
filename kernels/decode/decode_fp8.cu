// Decode from FP8 (e4m3) KV caches (compute_89 PTX: the e4m3 -> f16 conversion instruction is
// sm_89's; older GPUs take the converting path): the partial pass of decode/partial.cuh over
// one-byte K and V, for bf16 and f16 queries and outputs, merging its splits as they do
// (the separate combine kernel is theirs: its partials are f32 whatever the cache holds).
#include "decode/partial.cuh"
#include "instances.cuh"

FLASH_DECODE_KV8_INSTANCES(flash_decode_bf16_kv8, __nv_bfloat16)
FLASH_DECODE_KV8_INSTANCES(flash_decode_f16_kv8, __half)
