// The bf16 module: tensor-core forward instances (forward/mma.cuh; tiles from
// src/cuda/instances.rs via the generated instances.cuh), the split-KV decode kernels
// (decode/partial.cuh, decode/combine.cuh) and the row-wise fallback.
#include "backward/mma.cuh"
#include "decode/combine.cuh"
#include "decode/partial.cuh"
#include "forward/mma.cuh"
#include "forward/rowwise.cuh"
#include "instances.cuh"

FLASH_MMA_INSTANCES(flash_fwd_bf16, __nv_bfloat16)
FLASH_ROWWISE_INSTANCE(flash_rowwise_bf16, __nv_bfloat16)
FLASH_DECODE_INSTANCES(flash_decode_bf16, __nv_bfloat16)
FLASH_DECODE_COMBINE(flash_decode_combine_bf16, __nv_bfloat16)
FLASH_BWD_INSTANCES(flash_bwd_bf16, __nv_bfloat16)
