//! The additive bias and the block-sparse mask of a call, read once onto the host in their own
//! (un-broadcast) shape, and addressed per `(batch, head)` through broadcast strides.

use std::ops::Range;

use candle::{DType, Result, Tensor};

use super::Lanes;
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

/// What the score loop of one `(batch, head)` reads of the extras.
#[derive(Clone, Copy)]
pub(super) struct ExtrasAt<'a> {
    /// Bias values and (base, row stride, key stride).
    pub bias: Option<(&'a [f32], usize, usize, usize)>,
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
            let row = base + i * si + j0 * sj;
            if sj == 1 {
                let b = &d[row + cols.start..row + cols.end];
                for (x, &b) in s[cols.clone()].iter_mut().zip(b) {
                    *x += b * unit;
                }
            } else {
                let b = d[row] * unit;
                s[cols.clone()].iter_mut().for_each(|x| *x += b);
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
            if si == 0 {
                for (c, s) in s.iter_mut().enumerate() {
                    let b = d[base + (j0 + c) * sj] * LOG2_E;
                    s.0.iter_mut().for_each(|x| *x += b);
                }
            } else {
                // Row by row: each row's bias is read along its keys, in memory order.
                for r in 0..rows {
                    let row = &d[base + (r0 + r) * si + j0 * sj..];
                    for (c, s) in s.iter_mut().enumerate() {
                        s.0[r] += row[c * sj] * LOG2_E;
                    }
                }
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

    /// Whether the block mask hides every key of `keys` from every row of `rows` (a tile that
    /// is then neither read nor computed).
    pub fn hides(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> bool {
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

/// The extras of a call on the host (none for most calls).
#[derive(Default)]
pub(crate) struct Extras {
    bias: Option<Broadcast<f32>>,
    blocks: Option<(Broadcast<u8>, usize, usize)>,
}

impl Extras {
    pub fn of(p: &Problem) -> Result<Self> {
        Ok(Self {
            bias: match &p.bias {
                Some(t) => Some(Broadcast::of(t, DType::F32)?),
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
            bias: self
                .bias
                .as_ref()
                .map(|x| (&x.data[..], x.base(b, h), x.strides[2], x.strides[3])),
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
