// The by-value parameter structs of the kernels: `FlashParams` in `kernels/common/params.cuh` is
// the forward's C twin, `BwdParams` in `kernels/backward/params.cuh` the backward's. `build.rs`
// `include!`s this file, computes the C layout of the fields below from their types, checks it
// against each struct's `size_of`, and emits a `static_assert` on the size and on every field's
// offset into the generated `params_layout.cuh` and `bwd_params_layout.cuh`, so a field added,
// moved or retyped on one side only fails the build. Plain fields of 8-byte then 4-byte types,
// so no padding rule is involved.

/// Launch parameters of the forward kernels, mirrored field for field by `FlashParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub alibi: u64,
    pub cu_q: u64,
    pub cu_k: u64,
    /// Split-KV decode: f32 partial outputs `(splits, total_q, heads, d)` and base-2 partial
    /// log-sum-exps `(splits, heads, total_q)`; 0 elsewhere.
    pub o_part: u64,
    pub lse_part: u64,
    /// Paged K/V block table `(batch, max_blocks)` i32, per-sequence key counts `(batch,)` i32
    /// (KV caches; `k_add` more keys are counted), prefix ranges `(batch, max_ranges, 2)` i32:
    /// device addresses or 0.
    pub block_table: u64,
    pub seqused_k: u64,
    pub prefix: u64,
    /// Attention sinks, f32 `(heads,)`, or 0.
    pub sinks: u64,
    /// Additive score bias (f32 or the inputs' dtype, see `bias_f32`) read through the
    /// `bias_*` strides, or 0.
    pub bias: u64,
    /// Block-sparse mask, u8, read through the `bm_*` strides, or 0.
    pub block_mask: u64,
    /// The key tiles each query tile computes under the block mask (kernels/tiles.cu): i32
    /// lists of `k_tiles` entries and their lengths; 0 where the kernel walks its key range.
    pub tiles: u64,
    pub tile_count: u64,
    /// FP8 K/V decode: `q_descale · k_descale` and `v_descale`, f32 `(batch, kv_heads)`, or 0.
    pub qk_descale: u64,
    pub v_descale: u64,
    /// Split-KV decode: blocks done per (sequence, K/V head, row block), zeroed before the
    /// launch; the last block of a group merges its splits.
    pub split_sem: u64,
    pub q_batch: i64,
    pub q_seq: i64,
    pub q_head: i64,
    pub q_dim: i64,
    pub k_batch: i64,
    pub k_seq: i64,
    pub k_head: i64,
    pub k_dim: i64,
    pub v_batch: i64,
    pub v_seq: i64,
    pub v_head: i64,
    pub v_dim: i64,
    pub o_seq: i64,
    pub o_head: i64,
    pub lse_head: i64,
    pub win_left: i64,
    pub win_right: i64,
    /// Element strides of the bias and the block mask over (batch, head, query row or block,
    /// key or key block); 0 along broadcast dimensions.
    pub bias_b: i64,
    pub bias_h: i64,
    pub bias_q: i64,
    pub bias_k: i64,
    pub bm_b: i64,
    pub bm_h: i64,
    pub bm_q: i64,
    pub bm_k: i64,
    pub seq_q: i32,
    pub seq_k: i32,
    pub heads: i32,
    pub kv_group: i32,
    pub d_load: i32,
    pub d_out: i32,
    pub scale_log2: f32,
    pub softcap: f32,
    pub scale_over_cap: f32,
    pub cap_log2: f32,
    pub alibi_batch: i32,
    pub dv_splits: i32,
    /// Split-KV decode: splits of the key range, keys per split, 16-row packed tiles per KV head,
    /// and the rows of the output.
    pub num_splits: i32,
    pub split_keys: i32,
    pub m_tiles: i32,
    pub total_q: i32,
    pub total_k: i32,
    pub page: i32,
    pub max_blocks: i32,
    pub num_blocks: i32,
    pub k_add: i32,
    pub max_ranges: i32,
    /// `log2(page)` for power-of-two pages (shifts instead of divisions), else -1.
    pub page_shift: i32,
    /// Varlen q whose sequences all hold `seq_q` rows, passed without `cu_q` (null): sequence
    /// `b` is rows `b * seq_q ..` of q and of the output, lse in the varlen layout. 0 or 1.
    pub q_uniform: i32,
    /// Sequences (the persistent sm_90a kernels count their tiles from it).
    pub batch: i32,
    /// 1 when the bias is f32, 0 when it has the inputs' dtype.
    pub bias_f32: i32,
    /// Block-sparse mask: rows and keys per block.
    pub block_q: i32,
    pub block_k: i32,
    /// Tile lists: lists per batch and per head (0 where the mask is broadcast), query tiles
    /// per (batch, head), and entries per list.
    pub tiles_b: i32,
    pub tiles_h: i32,
    pub q_tiles: i32,
    pub k_tiles: i32,
    /// Paged K/V: 1 when row `r` of block `i` is row `i * page + r` of k and of v (blocks
    /// `page` rows apart, `k_batch = page * k_seq`, likewise v), every such row index fits an
    /// i32 and a row's stride in bytes (2-byte elements) a u32, so the decode kernels address a
    /// row from one index by one 32 x 32 -> 64-bit multiply-add; else 0.
    pub page_dense: i32,
    /// Split-KV decode, combine kernel: warps merging one (query row, head): 1, 2 or 4.
    pub combine_warps: i32,
}

/// The size both sides agree on (also asserted in C by the generated header): 46 eight-byte
/// fields, then 34 four-byte ones (no tail padding).
pub const PARAMS_SIZE: usize = (8 * 46 + 4 * 34_usize).next_multiple_of(8);
const _: () = assert!(std::mem::size_of::<Params>() == PARAMS_SIZE);

/// Launch parameters of the backward kernels, mirrored field for field by `BwdParams` in C. The
/// forward call's parameters come first, whole (`fwd`, the C side's `f`), then the backward's
/// own fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BwdParams {
    pub fwd: Params,
    pub dout: u64,
    pub dsum: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dkv_seq: i64,
    pub dkv_batch: i64,
    pub scale: f32,
    pub kv_heads: i32,
}

/// The size both sides agree on (also asserted in C by the generated header).
pub const BWD_PARAMS_SIZE: usize = PARAMS_SIZE + 8 * 7 + 4 * 2;
const _: () = assert!(std::mem::size_of::<BwdParams>() == BWD_PARAMS_SIZE);
