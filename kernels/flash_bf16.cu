// The bf16 module (compute_80 PTX, JIT-compiled for any GPU from sm_80 on; Hopper runs the
// sm_90a modules where they apply): the tensor-core forward (forward/mma.cuh: 16-row mma.sync
// slices per warp, keys streamed through a cp.async ring), the row-wise fallback
// (forward/rowwise.cuh: one query row per warp) and the backward (backward/mma.cuh: dK/dV then
// dQ on tensor cores; backward/generic.cuh: exact, any head dim). The decode kernels are a
// module of their own (flash_decode_bf16.cu): the driver compiles a module's PTX whole when it
// is first loaded, so a call loads only the kernels of its kind. Tiles come from
// src/cuda/instances.rs and src/cuda/backward/instances.rs through the headers build.rs
// generates.
#include "backward/mma.cuh"
#include "forward/mma.cuh"
#include "forward/rowwise.cuh"
#include "instances.cuh"

FLASH_MMA_INSTANCES(flash_fwd_bf16, __nv_bfloat16)
FLASH_ROWWISE_INSTANCE(flash_rowwise_bf16, __nv_bfloat16)
FLASH_BWD_INSTANCES(flash_bwd_bf16, __nv_bfloat16)
