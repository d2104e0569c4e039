// The by-value parameter struct of the backward kernels: `BwdParams` in
// `kernels/backward/params.cuh` is its C twin. The forward call's parameters come first, whole
// (`fwd`, laid out and checked as the forward's `Params`), then the backward's own fields;
// `build.rs` computes their C offsets and emits `static_assert`s on each offset and on the size
// into the generated `bwd_params_layout.cuh`. 8-byte fields, then 4-byte ones.

use super::super::params::Params;

/// Launch parameters of the backward kernels, mirrored field for field by `BwdParams` in C.
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
pub const BWD_PARAMS_SIZE: usize = super::super::params::PARAMS_SIZE + 8 * 7 + 4 * 2;
const _: () = assert!(std::mem::size_of::<BwdParams>() == BWD_PARAMS_SIZE);
