// bf16 instances of the tensor-core FlashAttention-2 forward (see flash_mma.cuh for the
// algorithm and tiling): one kernel per head dim 32, 64, ..., 256, named flash_fwd_bf16_d<D>.
#include "flash_mma.cuh"

FLASH_ALL_DIMS(flash_fwd_bf16, __nv_bfloat16)
