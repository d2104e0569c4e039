// The launch parameters of every forward kernel. Its Rust twin is `Params` in
// src/cuda/params.rs; build.rs generates params_layout.cuh from that struct, whose static_asserts
// fail the build if a field's offset or the size differs between the two.
#pragma once
#include <stddef.h>
#include <stdint.h>

// One struct instead of dozens of positional arguments. 8-byte fields first, so the C and Rust
// (`#[repr(C)]`) layouts agree without relying on padding rules.
struct FlashParams {
    const void* q;  // element (0, 0, 0, 0) of each operand (view offset already applied)
    const void* k;
    const void* v;
    void* o;               // contiguous (rows, heads, d_out)
    float* lse;            // natural-log log-sum-exp, f32
    const float* alibi;    // slopes or null
    const uint32_t* cu_q;  // varlen cumulative lengths (batch + 1) or null (dense, q_uniform)
    const uint32_t* cu_k;
    float* o_part;         // split-KV decode: f32 partial O (splits, total_q, heads, d) or null
    float* lse_part;       // split-KV decode: base-2 partial lse (splits, heads, total_q) or null
    const int32_t* block_table;  // paged K/V: (batch, max_blocks) block indices, or null
    const int32_t* seqused_k;    // per-sequence key counts (KV cache, before k_add), or null
    const int32_t* prefix;       // multimodal prefix ranges (batch, max_ranges, 2), or null
    const float* sinks;          // attention sinks (heads,), or null
    const void* bias;            // additive score bias (f32 or T, see bias_f32), or null
    const uint8_t* block_mask;   // block-sparse mask, or null
    const int32_t* tiles;        // key tiles per query tile under the block mask, or null
    const int32_t* tile_count;   // entries of each list in `tiles`
    const float* qk_descale;     // FP8 K/V decode: q_descale k_descale (batch, kv_heads), or null
    const float* v_descale;      // FP8 K/V decode: v_descale (batch, kv_heads), or null
    uint32_t* split_sem;         // split-KV decode, fused merge: blocks done per group (zeroed), or null
    // Element strides (64-bit: large tensors overflow 32-bit offsets).
    int64_t q_batch, q_seq, q_head, q_dim;
    int64_t k_batch, k_seq, k_head, k_dim;
    int64_t v_batch, v_seq, v_head, v_dim;
    int64_t o_seq, o_head;  // output strides (o_dim is 1)
    int64_t lse_head;       // distance between heads in lse
    int64_t win_left;       // keys visible left of the diagonal, -1 = unbounded
    int64_t win_right;      // keys visible right of the diagonal, -1 = unbounded
    // Strides of the bias and the block mask over (batch, head, row or row block, key or key
    // block), 0 along broadcast dimensions.
    int64_t bias_b, bias_h, bias_q, bias_k;
    int64_t bm_b, bm_h, bm_q, bm_k;
    int32_t seq_q, seq_k;   // dense lengths (varlen reads cu_q / cu_k)
    int32_t heads;
    int32_t kv_group;       // heads / kv_heads: query heads sharing one K/V head
    int32_t d_load;         // columns read from q/k/v (the rest of the tile is zero-filled)
    int32_t d_out;          // columns written to o
    float scale_log2;       // softmax_scale * log2(e): scores live in base 2
    float softcap;          // 0 = off
    float scale_over_cap;   // softmax_scale / softcap
    float cap_log2;         // softcap * log2(e)
    int32_t alibi_batch;    // batch stride of the slopes (0 = per head)
    int32_t dv_splits;      // blocks splitting the V/O columns of one query tile (>= 1)
    int32_t num_splits;     // split-KV decode: slices of the key range (1 = write O directly)
    int32_t split_keys;     // split-KV decode: keys per slice
    int32_t m_tiles;        // split-KV decode: 16-row packed tiles per KV head
    int32_t total_q;        // rows of the output
    int32_t total_k;        // rows of packed (varlen) k and v
    int32_t page;           // paged K/V: rows per block
    int32_t max_blocks;     // paged K/V: columns of the block table
    int32_t num_blocks;     // paged K/V: blocks in k and v
    int32_t k_add;          // keys appended by this call on top of seqused_k
    int32_t max_ranges;     // prefix ranges per sequence
    int32_t page_shift;     // paged K/V: log2(page) for power-of-two pages, else -1
    int32_t q_uniform;      // varlen q with cu_q null: sequence b is rows [b seq_q, (b + 1) seq_q)
    int32_t batch;          // sequences (the persistent sm_90a kernels count their tiles from it)
    int32_t bias_f32;       // 1: the bias is f32; 0: it has the inputs' type
    int32_t block_q;        // block mask: rows per block
    int32_t block_k;        // block mask: keys per block
    int32_t tiles_b;        // tile lists: lists per batch (0: shared by all batches)
    int32_t tiles_h;        // tile lists: lists per head (0: shared by all heads)
    int32_t q_tiles;        // tile lists: query tiles per (batch, head)
    int32_t k_tiles;        // tile lists: entries per list
    int32_t page_dense;     // paged K/V: 1 when row r of block i is row i * page + r of k and v
    int32_t combine_warps;  // split-KV decode, combine kernel: warps merging one (row, head)
};


#include "params_layout.cuh"
