// The bf16 module (compute_80 PTX, JIT-compiled for any GPU from sm_80 on; Hopper runs the
// sm_90a modules where they apply): the tensor-core forward (forward/mma.cuh: 16-row mma.sync
// slices per warp, keys streamed through a cp.async ring), the row-wise fallback
// (forward/rowwise.cuh: one query row per warp), the split-KV decode (decode/partial.cuh: one
// pass over a K/V head's keys for all its packed query rows, the splits merged by the last
// block of each group or by a combine kernel, decode/combine.cuh) and the backward (backward/mma.cuh: dK/dV then dQ on tensor cores;
// backward/generic.cuh: exact, any head dim). Tiles come from src/cuda/instances.rs and
// src/cuda/backward/instances.rs through the headers build.rs generates.
#include "backward/mma.cuh"
#include "decode/partial.cuh"
#include "forward/mma.cuh"
#include "forward/rowwise.cuh"
#include "instances.cuh"

FLASH_MMA_INSTANCES(flash_fwd_bf16, __nv_bfloat16)
FLASH_ROWWISE_INSTANCE(flash_rowwise_bf16, __nv_bfloat16)
FLASH_DECODE_INSTANCES(flash_decode_bf16, __nv_bfloat16)
FLASH_DECODE_COMBINE(flash_decode_combine_bf16, __nv_bfloat16)
FLASH_BWD_INSTANCES(flash_bwd_bf16, __nv_bfloat16)
