//! The additive bias and the block-sparse mask of a call, addressed per `(batch, head)` through
//! broadcast strides: the bias is read in place, in its own dtype; the block mask is copied once
//! onto the host in its own (un-broadcast) shape.

use std::ops::{Deref, Range};

use candle::{bail, CpuStorage, DType, Result, Storage, Tensor};

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::{Lanes, BC};
use crate::problem::Problem;
use crate::semantics::LOG2_E;

/// A tensor's values and its strides over `(batch, heads, rows, cols)`, 0 on broadcast
/// dimensions.
struct Broadcast<T> {
    data: Vec<T>,
    strides: [usize; 4],
}

impl<T: candle::WithDType> Broadcast<T> {
    /// `t` (rank at most 4, validated to broadcast) as `dtype`, without expanding size-1 or
    /// stride-0 dimensions.
    fn of(t: &Tensor, dtype: DType) -> Result<Self> {
        let mut t = t.clone();
        while t.rank() < 4 {
            t = t.unsqueeze(0)?;
        }
        // A stride-0 (broadcast) view holds one distinct value along that dimension.
        for dim in 0..4 {
            if t.stride()[dim] == 0 && t.dims()[dim] > 1 {
                t = t.narrow(dim, 0, 1)?;
            }
        }
        let t = t.to_dtype(dtype)?.contiguous()?;
        let dims = t.dims().to_vec();
        let mut strides = [0usize; 4];
        let mut s = 1;
        for dim in (0..4).rev() {
            strides[dim] = if dims[dim] == 1 { 0 } else { s };
            s *= dims[dim];
        }
        Ok(Self {
            data: t.flatten_all()?.to_vec1::<T>()?,
            strides,
        })
    }

    fn base(&self, b: usize, h: usize) -> usize {
        b * self.strides[0] + h * self.strides[1]
    }
}

/// The bias's values: the caller's CPU tensor read in place, in its own dtype (a full bias is
/// as large as the score matrix, and copying it cost more than adding it). The storage is held
/// for reading; `start` is the first element, `strides` run over `(batch, heads, rows, cols)`,
/// 0 on broadcast dimensions.
struct BiasValues<'p> {
    storage: Box<dyn Deref<Target = Storage> + Sync + 'p>,
    start: usize,
    strides: [usize; 4],
}

impl<'p> BiasValues<'p> {
    fn of(t: &'p Tensor) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        if !matches!(
            &*storage,
            Storage::Cpu(CpuStorage::F32(_) | CpuStorage::BF16(_) | CpuStorage::F16(_))
        ) {
            bail!("flash-attn: the CPU path takes a bias of f32, f16 or bf16 on the CPU")
        }
        let mut strides = [0usize; 4];
        let at = 4 - t.rank();
        for (dim, (&n, &st)) in t.dims().iter().zip(layout.stride()).enumerate() {
            strides[at + dim] = if n == 1 { 0 } else { st };
        }
        let start = layout.start_offset();
        Ok(Self {
            storage: Box::new(storage),
            start,
            strides,
        })
    }

    /// The values, the first element of `(b, h)`, and the row and key strides.
    fn at(&self, b: usize, h: usize) -> (BiasSlice<'_>, usize, usize, usize) {
        let data = match &**self.storage {
            Storage::Cpu(CpuStorage::BF16(v)) => BiasSlice::Bf16(v),
            Storage::Cpu(CpuStorage::F16(v)) => BiasSlice::F16(v),
            Storage::Cpu(CpuStorage::F32(v)) => BiasSlice::F32(v),
            // `of` keeps only these three.
            _ => BiasSlice::F32(&[]),
        };
        let st = self.strides;
        (data, self.start + b * st[0] + h * st[1], st[2], st[3])
    }
}

/// A bias's stored values, in the dtype they are stored in.
#[derive(Clone, Copy)]
pub(super) enum BiasSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

/// A stored bias value, read as f32.
trait Value: Copy {
    fn f32(self) -> f32;
    /// `avx2::add_rows_to_lanes` in base-2 units where the CPU has AVX2 (and F16C); `false`,
    /// having added nothing, elsewhere.
    #[inline(always)]
    fn add_rows_to_lanes(
        _d: &[Self],
        _si: usize,
        _s: &mut [Lanes],
        _rows: usize,
        _cols: usize,
    ) -> bool {
        false
    }
}

/// [`Value::add_rows_to_lanes`] for an element the AVX2 code widens.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn rows_to_lanes_avx2<T: avx2::Widen>(
    d: &[T],
    si: usize,
    s: &mut [Lanes],
    rows: usize,
    cols: usize,
) -> bool {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
        return false;
    }
    assert!(
        rows <= super::BR
            && cols <= s.len()
            && (rows == 0 || cols == 0 || (rows - 1) * si + cols <= d.len()),
        "cpu flash kernel: bias block out of bounds"
    );
    // SAFETY: avx2 and f16c were detected; the bounds were checked just above.
    unsafe { avx2::add_rows_to_lanes(d, si, s, rows, cols, LOG2_E) };
    true
}

impl Value for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn add_rows_to_lanes(d: &[Self], si: usize, s: &mut [Lanes], rows: usize, cols: usize) -> bool {
        rows_to_lanes_avx2(d, si, s, rows, cols)
    }
}

impl Value for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn add_rows_to_lanes(d: &[Self], si: usize, s: &mut [Lanes], rows: usize, cols: usize) -> bool {
        rows_to_lanes_avx2(d, si, s, rows, cols)
    }
}

impl Value for half::f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn add_rows_to_lanes(d: &[Self], si: usize, s: &mut [Lanes], rows: usize, cols: usize) -> bool {
        rows_to_lanes_avx2(d, si, s, rows, cols)
    }
}

/// [`ExtrasAt::apply_row`]'s bias: `unit ·` the bias of row `i`, keys `j0 + cols`, added to
/// `s[cols]`.
#[inline(always)]
fn add_row<T: Value>(
    d: &[T],
    (base, si, sj): (usize, usize, usize),
    s: &mut [f32],
    i: usize,
    j0: usize,
    cols: Range<usize>,
    unit: f32,
) {
    let row = base + i * si + j0 * sj;
    match sj {
        0 => {
            let b = d[row].f32() * unit;
            s[cols].iter_mut().for_each(|x| *x += b);
        }
        1 => {
            let b = &d[row + cols.start..row + cols.end];
            for (x, &b) in s[cols].iter_mut().zip(b) {
                *x += b.f32() * unit;
            }
        }
        // A strided key dimension (a view of every other key, say).
        _ => {
            for (c, x) in s.iter_mut().enumerate().take(cols.end).skip(cols.start) {
                *x += d[row + c * sj].f32() * unit;
            }
        }
    }
}

/// [`ExtrasAt::apply`]'s bias, in base-2 units, over the scores `s` of keys `j0 ..` (rows
/// `r0 .. r0 + rows` in lanes).
#[inline(always)]
fn add_tile<T: Value>(
    d: &[T],
    (base, si, sj): (usize, usize, usize),
    s: &mut [Lanes],
    r0: usize,
    rows: usize,
    j0: usize,
) {
    if si == 0 {
        for (c, s) in s.iter_mut().enumerate() {
            let b = d[base + (j0 + c) * sj].f32() * LOG2_E;
            s.0.iter_mut().for_each(|x| *x += b);
        }
        return;
    }
    let cols = s.len();
    let at = base + r0 * si + j0 * sj;
    // A full bias is stored row by row and the scores hold rows in lanes. Where the keys are
    // consecutive, blocks of 8 rows × 8 keys go through the vector transpose; the rows and
    // keys past the last whole block (and every strided bias) take the scalar path. On an
    // AVX2 EPYC (f32, 16/8 heads, d 128, 1024 × 1024 keys) the scalar transposed copy made a
    // full bias cost about a fifth of the plain call; the vector transpose with the prefetches
    // (see `ExtrasAt::prefetch`) about 5% of its CPU time.
    let (r8, c8) = (rows - rows % 8, cols - cols % 8);
    let vector = sj == 1 && T::add_rows_to_lanes(&d[at..], si, s, r8, c8);
    if vector {
        add_block(d, at + c8, (si, sj), &mut s[c8..], 0..r8);
        add_block(d, at, (si, sj), s, r8..rows);
    } else {
        add_block(d, at, (si, sj), s, 0..rows);
    }
}

/// `s[c].0[r] += LOG2_E · d[at + r · si + c · sj]` for the lanes `r` in `lanes`: sixteen rows
/// at a time are read along their keys (in memory order) into a small transposed block, which
/// is then added a vector of rows per key. Adding each score on its own was a scalar
/// read-modify-write per score.
#[inline(always)]
fn add_block<T: Value>(
    d: &[T],
    at: usize,
    (si, sj): (usize, usize),
    s: &mut [Lanes],
    lanes: Range<usize>,
) {
    const R: usize = 16;
    let mut block = [[0f32; R]; BC];
    for (cb, s) in s.chunks_mut(BC).enumerate() {
        let (j, cols) = (cb * BC, s.len());
        for rc in lanes.clone().step_by(R) {
            let n = (lanes.end - rc).min(R);
            for r in 0..n {
                let at = at + (rc + r) * si + j * sj;
                prefetch_row::<L1, _>(d, at + cols * sj, cols * sj);
                let row = &d[at..];
                for (c, b) in block[..cols].iter_mut().enumerate() {
                    b[r] = row[c * sj].f32();
                }
            }
            for (s, b) in s.iter_mut().zip(&block[..cols]) {
                for (x, &b) in s.0[rc..rc + n].iter_mut().zip(&b[..n]) {
                    *x += b * LOG2_E;
                }
            }
        }
    }
}

/// What the score loop of one `(batch, head)` reads of the extras.
#[derive(Clone, Copy)]
pub(super) struct ExtrasAt<'a> {
    /// Bias values and (base, row stride, key stride).
    pub bias: Option<(BiasSlice<'a>, usize, usize, usize)>,
    /// Block mask values, (base, row-block stride, key-block stride) and the block sizes.
    pub blocks: Option<(&'a [u8], [usize; 3], usize, usize)>,
}

impl ExtrasAt<'_> {
    /// Whether the call has a bias or a block mask.
    pub fn is_some(&self) -> bool {
        self.bias.is_some() || self.blocks.is_some()
    }

    /// For one query row `i` whose scores `s[c]` are keys `j0 + c`, `c` in `cols`: adds
    /// `unit ·` the bias and sets the keys of hidden blocks to `-inf`, a run of keys at a time.
    #[inline(always)]
    pub fn apply_row(&self, s: &mut [f32], i: usize, j0: usize, cols: Range<usize>, unit: f32) {
        if let Some((d, base, si, sj)) = self.bias {
            let (at, c) = ((base, si, sj), cols.clone());
            match d {
                BiasSlice::F32(d) => add_row(d, at, s, i, j0, c, unit),
                BiasSlice::Bf16(d) => add_row(d, at, s, i, j0, c, unit),
                BiasSlice::F16(d) => add_row(d, at, s, i, j0, c, unit),
            }
        }
        if let Some((d, [base, si, sj], bq, bk)) = self.blocks {
            let row = base + i / bq * si;
            let mut c = cols.start;
            while c < cols.end {
                let kb = (j0 + c) / bk;
                let end = ((kb + 1) * bk - j0).min(cols.end);
                if d[row + kb * sj] == 0 {
                    s[c..end].fill(f32::NEG_INFINITY);
                }
                c = end;
            }
        }
    }

    /// Adds the bias (in base-2 units, as the scores are) to the scores `s` of keys `j0 ..`
    /// (one `Lanes` per key, query rows `r0 .. r0 + rows` in lanes) and sets the keys of hidden
    /// blocks to `-inf`. A bias or block mask that does not vary over the query rows is one
    /// value per key, added to or written over the whole vector.
    #[inline(always)]
    pub fn apply(&self, s: &mut [Lanes], r0: usize, rows: usize, j0: usize) {
        if let Some((d, base, si, sj)) = self.bias {
            let at = (base, si, sj);
            match d {
                BiasSlice::F32(d) => add_tile(d, at, s, r0, rows, j0),
                BiasSlice::Bf16(d) => add_tile(d, at, s, r0, rows, j0),
                BiasSlice::F16(d) => add_tile(d, at, s, r0, rows, j0),
            }
        }
        if let Some((d, [base, si, sj], bq, bk)) = self.blocks {
            for (c, s) in s.iter_mut().enumerate() {
                let col = &d[base + (j0 + c) / bk * sj..];
                // The rows of one query block at a time.
                let mut r = 0;
                while r < rows {
                    let qb = (r0 + r) / bq;
                    let end = ((qb + 1) * bq - r0).min(rows);
                    if col[qb * si] == 0 {
                        s.0[r..end].fill(f32::NEG_INFINITY);
                    }
                    r = end;
                }
            }
        }
    }

    /// Asks for the full bias of rows `r0 .. r0 + rows`, keys `j0 .. j0 + cols` into L2, ahead
    /// of the tile's `Q Kᵀ`, whose tens of thousands of cycles then hide the memory latency
    /// (each row of a tile is a separate short run, which the hardware prefetchers do not
    /// follow). Into L2, not L1: rows a power-of-two number of bytes apart fall into the same
    /// few L1 sets and would evict the K and Q tiles the product is reading. Biases without a
    /// row dimension (small, and read again by every row tile) and strided keys are left alone.
    #[inline(always)]
    pub fn prefetch(&self, r0: usize, rows: usize, j0: usize, cols: usize) {
        let Some((d, base, si, 1)) = self.bias else {
            return;
        };
        if si == 0 {
            return;
        }
        for r in r0..r0 + rows {
            let at = base + r * si + j0;
            match d {
                BiasSlice::F32(d) => prefetch_row::<L2, _>(d, at, cols),
                BiasSlice::Bf16(d) => prefetch_row::<L2, _>(d, at, cols),
                BiasSlice::F16(d) => prefetch_row::<L2, _>(d, at, cols),
            }
        }
    }

    /// Whether the tile of `rows` × `keys` is hidden (then neither read nor computed): the
    /// block mask hides every key of it from every row, or a bias that does not vary over the
    /// rows (key padding, per-key terms) is `-inf` at every key of it, as the GPU kernels' tile
    /// lists skip such tiles.
    pub fn hides(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> bool {
        self.bias_hides(&keys) || self.blocks_hide(rows, keys)
    }

    /// Whether a bias without a row dimension is `-inf` at every key of `keys` (not empty).
    fn bias_hides(&self, keys: &std::ops::Range<usize>) -> bool {
        let Some((d, base, 0, sj)) = self.bias else {
            return false;
        };
        fn all_masked<T: Value>(d: &[T], base: usize, sj: usize, keys: &Range<usize>) -> bool {
            !keys.is_empty()
                && keys
                    .clone()
                    .all(|j| d[base + j * sj].f32() == f32::NEG_INFINITY)
        }
        match d {
            BiasSlice::F32(d) => all_masked(d, base, sj, keys),
            BiasSlice::Bf16(d) => all_masked(d, base, sj, keys),
            BiasSlice::F16(d) => all_masked(d, base, sj, keys),
        }
    }

    /// Whether the block mask hides every key of `keys` from every row of `rows`.
    fn blocks_hide(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> bool {
        let Some((d, [base, si, sj], bq, bk)) = self.blocks else {
            return false;
        };
        if rows.is_empty() || keys.is_empty() {
            return true;
        }
        let (qb, kb) = (
            rows.start / bq..(rows.end - 1) / bq + 1,
            keys.start / bk..(keys.end - 1) / bk + 1,
        );
        qb.clone()
            .all(|i| kb.clone().all(|j| d[base + i * si + j * sj] == 0))
    }
}

/// The extras of a call on the host (none for most calls), borrowing the problem's bias.
#[derive(Default)]
pub(crate) struct Extras<'p> {
    bias: Option<BiasValues<'p>>,
    blocks: Option<(Broadcast<u8>, usize, usize)>,
}

impl<'p> Extras<'p> {
    pub fn of(p: &'p Problem) -> Result<Self> {
        Ok(Self {
            bias: match &p.bias {
                Some(t) => Some(BiasValues::of(t)?),
                None => None,
            },
            blocks: match &p.block_mask {
                Some((t, bq, bk)) => Some((Broadcast::of(t, DType::U8)?, *bq, *bk)),
                None => None,
            },
        })
    }

    pub fn is_some(&self) -> bool {
        self.bias.is_some() || self.blocks.is_some()
    }

    /// The view of head `h` of sequence `b`.
    pub fn at(&self, b: usize, h: usize) -> ExtrasAt<'_> {
        ExtrasAt {
            bias: self.bias.as_ref().map(|x| x.at(b, h)),
            blocks: self.blocks.as_ref().map(|(x, bq, bk)| {
                (
                    &x.data[..],
                    [x.base(b, h), x.strides[2], x.strides[3]],
                    *bq,
                    *bk,
                )
            }),
        }
    }
}

/// Where [`prefetch_row`] asks for the lines: L1 (and L2), or L2 only.
const L1: i32 = 3;
const L2: i32 = 2;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(L1 == std::arch::x86_64::_MM_HINT_T0 && L2 == std::arch::x86_64::_MM_HINT_T1);

/// Asks for the cache lines of `d[at..at + len]` (clamped to `d`) into `LEVEL` ([`L1`] or
/// [`L2`]), ahead of their use: a full bias is read as one short run per query row and key
/// tile, dozens of rows apart in memory, which the hardware prefetchers do not follow.
#[inline(always)]
fn prefetch_row<const LEVEL: i32, T>(d: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = (at + len).min(d.len());
        let mut i = at;
        // One request per 64-byte line.
        let step = (64 / std::mem::size_of::<T>().max(1)).max(1);
        while i < end {
            // SAFETY: `i < d.len()`, so the address lies inside `d`; a prefetch reads nothing.
            unsafe { std::arch::x86_64::_mm_prefetch::<LEVEL>(d.as_ptr().add(i).cast()) };
            i += step;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (d, at, len);
}
