//! Tiled CPU forward pass (FlashAttention-2 loop order), queries in SIMD lanes.
//!
//! Work items are `(batch, head, block of query rows)`, run in parallel with rayon; a block is up
//! to `QSUB` sub-tiles of `BR` rows that share every K/V tile. Each sub-tile is kept
//! *transposed*: `Qᵀ` (`d × BR`), the scores `Sᵀ = K Qᵀ` (`BC × BR`) and the output accumulator
//! `Oᵀ` (`d × BR`) all have one query per lane. That layout makes
//!
//! * both products register-blocked broadcast-FMAs with no transposed copy of K or V: `Sᵀ` row
//!   `c` is `Σ_x K[c][x] · Qᵀ[x]`, and `Oᵀ` row `x` gains `Σ_c V[c][x] · Pᵀ[c]`;
//! * the online softmax purely element-wise: the running max `m`, sum `l` and correction of every
//!   query are vectors over lanes, updated with no horizontal reduction.
//!
//! The Q tile is transposed once per item, the K and V tiles are only copied (or converted from
//! f16/bf16) into dense f32 scratch, and `Oᵀ` is normalised once and transposed on the way out.
//! Extra memory is a few tiles per thread, independent of the sequence lengths.
//!
//! The micro-kernel is dispatched at run time: AVX-512 intrinsics, else AVX2+FMA intrinsics
//! (the rest of the tile code compiled with AVX2+FMA enabled), else plain portable loops (any
//! architecture). bf16 inputs may instead keep their tiles in bf16 and run both products on a
//! bf16 engine (AMX tiles or AVX512-BF16 dot products, [`bf16`]); [`dispatch`] chooses, and
//! [`CpuMatmul`] forces a choice.
//!
//! The backward pass (`backward/`) reuses the same micro-kernels with the *keys* in lanes (the
//! key tile is what a dK/dV work item keeps); see its module docs.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod backward;
#[cfg(target_arch = "x86_64")]
mod bf16;
mod decode;
mod dispatch;
mod elem;
mod exp2;
mod extras;
mod kernel;
mod prefill;
mod scratch;

pub use dispatch::CpuMatmul;

/// Runs the whole problem with the kernel that suits it: [`decode`] when there are few query rows
/// per KV head (one or a few new tokens against a cache), else [`prefill`] (or its bf16 version
/// [`bf16::prefill`], see [`dispatch`]).
pub(crate) fn forward<T: elem::Elem>(
    p: &crate::problem::Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> candle::Result<(Vec<T>, Vec<f32>)> {
    with_sinks(p, forward_rows(p, slopes, q, k, v)?)
}

/// Whether the FP8 (e4m3) K and V of `p` are read as stored ([`forward_kv8`]): in decode calls.
pub(crate) fn kv8_decode(p: &crate::problem::Problem) -> bool {
    decode::is_decode(p)
}

/// [`forward`] of a decode-shaped call over an FP8 (e4m3) cache: f32 queries (already scaled by
/// their descales, see `op::fp8`), K and V read as stored, one byte per element, and converted
/// a block of keys at a time. Other calls convert K and V before they come here.
pub(crate) fn forward_kv8(
    p: &crate::problem::Problem,
    slopes: Option<&[f32]>,
    q: &[f32],
    k: &[float8::F8E4M3],
    v: &[float8::F8E4M3],
) -> candle::Result<(Vec<f32>, Vec<f32>)> {
    if !decode::is_decode(p) {
        candle::bail!("flash-attn: the CPU reads F8E4M3 k and v as stored in decode calls only")
    }
    let extras = extras::Extras::of(p)?;
    with_sinks(p, decode::forward(p, slopes, q, k, v, &extras))
}

/// The finished rows with each head's sink folded in, where the call has sinks.
fn with_sinks<T: elem::Elem>(
    p: &crate::problem::Problem,
    (mut out, mut lse): (Vec<T>, Vec<f32>),
) -> candle::Result<(Vec<T>, Vec<f32>)> {
    if let Some(sinks) = &p.sinks {
        let sinks = sinks.to_vec1::<f32>()?;
        fold_sinks(p, &sinks, &mut out, &mut lse);
    }
    Ok((out, lse))
}

/// Folds each head's sink into its finished rows (a merge with a side that has no values,
/// [`merge_weights`](crate::semantics::merge_weights)):
/// one pass over the output, which costs little next to the attention that produced it.
fn fold_sinks<T: elem::Elem>(
    p: &crate::problem::Problem,
    sinks: &[f32],
    out: &mut [T],
    lse: &mut [f32],
) {
    let (h, d, stride) = (p.heads, p.head_dim, p.lse_head_stride());
    for b in 0..p.batch {
        let seq = p.seq(b);
        for i in 0..seq.seq_q {
            let row = &mut out[(seq.out_row + i) * h * d..][..h * d];
            for (hh, o) in row.chunks_exact_mut(d).enumerate() {
                let l = &mut lse[seq.lse_base + hh * stride + i];
                let w = crate::semantics::merge_weights(*l, sinks[hh]);
                *l = w.lse;
                o.iter_mut()
                    .for_each(|x| *x = T::from_f32(w.value(x.to_f32(), 0.0)));
            }
        }
    }
}

/// The attention of every row, before sinks.
fn forward_rows<T: elem::Elem>(
    p: &crate::problem::Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> candle::Result<(Vec<T>, Vec<f32>)> {
    let path = dispatch::choose::<T>(p, false)?;
    // The bias and block mask, which every path's score pass applies.
    let extras = extras::Extras::of(p)?;
    if decode::is_decode(p) {
        return Ok(decode::forward(p, slopes, q, k, v, &extras));
    }
    Ok(match path {
        dispatch::Path::F32(isa) => prefill::forward_with(isa, p, slopes, q, k, v, &extras),
        #[cfg(target_arch = "x86_64")]
        dispatch::Path::Bf16(engine) => {
            let same = elem::same_slice::<T, half::bf16>;
            match (same(q), same(k), same(v)) {
                (Some(q), Some(k), Some(v)) => {
                    let (out, lse) = bf16::prefill::forward(engine, p, slopes, q, k, v, &extras);
                    (elem::same_vec(out).unwrap_or_default(), lse)
                }
                // `choose` picks an engine for bf16 inputs only.
                _ => prefill::forward_with(kernel::Isa::detect(), p, slopes, q, k, v, &extras),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        dispatch::Path::Bf16(_) => {
            prefill::forward_with(kernel::Isa::detect(), p, slopes, q, k, v, &extras)
        }
    })
}

pub(crate) use backward::backward;

/// Query rows per work item: the lanes of every tile (four AVX-512 vectors).
const BR: usize = 64;
/// Keys per inner tile.
const BC: usize = 64;
/// Most BR-row sub-tiles per work item. Each K/V tile copy serves all sub-tiles of an item: K and V
/// rows of one head lie `heads · d` elements apart and do not stay in L2 for long sequences, so
/// every copy waits on L3 (and the TLB), and sharing it is what keeps that wait small (with one
/// sub-tile the copies took 22% of the time at n = 1024 and 4096, 8 heads, d = 64; with four,
/// 10% at n = 4096). Tried and dropped, as each only moved that time elsewhere: software
/// prefetching the next tile into L2, copying it a few rows at a time between micro-kernel calls
/// (double buffering), and reading f32 K/V in place without a copy.
const QSUB: usize = 4;

/// One value per query of the tile; aligned so the AVX-512 loads never split a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([f32; BR]);

impl Lanes {
    const fn splat(x: f32) -> Self {
        Self([x; BR])
    }
}

/// Raw output pointer shared by the work items, which write disjoint rows.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: every work item writes a disjoint set of elements (its own rows of its own head).
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}
