//! Tiled CPU forward pass (FlashAttention-2 loop order).
//!
//! Work items are `(batch, head, query tile of BR rows)`, run in parallel with rayon. Each item
//! converts its Q tile to f32 once, then walks the key tiles (BC keys) its rows can see: scores
//! `S = Q Kᵀ` for the tile, online softmax (running max `m` and sum `l` per row, in base 2),
//! `O += P V`, and one normalisation `O / l` at the end. Extra memory is a few tiles per thread.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::problem::Problem;
use crate::semantics::{kv_head, LOG2_E};

/// Query rows per work item.
const BR: usize = 64;
/// Keys per inner tile.
const BC: usize = 64;

/// Element types the CPU path reads and writes; all arithmetic is f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Raw output pointer shared by the work items, which write disjoint rows.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: every work item writes a disjoint set of elements (its own rows of its own head).
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

/// Runs the whole problem; returns the contiguous output and the log-sum-exp.
pub(crate) fn forward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    let d = p.head_dim;
    let mut out = vec![T::from_f32(0.0); p.total_q * p.heads * d];
    let mut lse = vec![f32::NEG_INFINITY; p.total_q * p.heads];
    let items: Vec<(usize, usize, usize)> = (0..p.batch)
        .flat_map(|b| {
            let tiles = p.seq(b).seq_q.div_ceil(BR);
            (0..p.heads).flat_map(move |h| (0..tiles).map(move |t| (b, h, t)))
        })
        .collect();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let lse_ptr = SyncPtr(lse.as_mut_ptr());
    items.into_par_iter().for_each_init(
        || Scratch::new(d),
        |scratch, (b, h, t)| {
            let slope = slopes.map_or(0.0, |s| s[b * p.alibi_batch_stride + h]);
            tile(p, scratch, q, k, v, slope, b, h, t, out_ptr, lse_ptr);
        },
    );
    (out, lse)
}

/// Per-thread buffers, reused across work items.
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            q: vec![0.0; BR * d],
            k: vec![0.0; BC * d],
            v: vec![0.0; BC * d],
            s: vec![0.0; BR * BC],
            o: vec![0.0; BR * d],
            m: vec![0.0; BR],
            l: vec![0.0; BR],
        }
    }
}

/// Copies `rows` rows of one head into a dense f32 tile (`rows x d`), scaled by `scale`.
#[inline]
#[allow(clippy::too_many_arguments)]
fn gather<T: Elem>(
    dst: &mut [f32],
    src: &[T],
    strides: &crate::problem::Strides,
    b: usize,
    row0: usize,
    rows: usize,
    head: usize,
    d: usize,
    scale: f32,
) {
    for r in 0..rows {
        let base = strides.at(b, row0 + r, head);
        let dst = &mut dst[r * d..(r + 1) * d];
        if strides.dim == 1 {
            for (o, x) in dst.iter_mut().zip(&src[base..base + d]) {
                *o = x.to_f32() * scale;
            }
        } else {
            for (x, o) in dst.iter_mut().enumerate() {
                *o = src[base + x * strides.dim].to_f32() * scale;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn tile<T: Elem>(
    p: &Problem,
    sc: &mut Scratch,
    q: &[T],
    k: &[T],
    v: &[T],
    slope: f32,
    b: usize,
    h: usize,
    t: usize,
    out: SyncPtr<T>,
    lse: SyncPtr<f32>,
) {
    let d = p.head_dim;
    let seq = p.seq(b);
    let (sq, sk) = (seq.seq_q, seq.seq_k);
    let i0 = t * BR;
    let rows = BR.min(sq - i0);
    let kvh = kv_head(h, p.heads, p.kv_heads);
    let softcap = p.score.softcap > 0.0;
    // Without softcap the scale and log2(e) fold into Q once; with it, tanh needs the true score.
    let q_scale = if softcap { p.score.scale } else { p.score.scale * LOG2_E };
    gather(&mut sc.q, q, &p.q, b, seq.q_row + i0, rows, h, d, q_scale);
    sc.o[..rows * d].fill(0.0);
    sc.m[..rows].fill(f32::NEG_INFINITY);
    sc.l[..rows].fill(0.0);

    let (lo, hi) = p.window.key_range_rows(i0..i0 + rows, sq, sk);
    let mut j0 = lo;
    while j0 < hi {
        let cols = BC.min(hi - j0);
        gather(&mut sc.k, k, &p.k, b, seq.k_row + j0, cols, kvh, d, 1.0);
        gather(&mut sc.v, v, &p.v, b, seq.k_row + j0, cols, kvh, d, 1.0);
        let full = p.window.covers(i0..i0 + rows, j0..j0 + cols, sq, sk);
        for r in 0..rows {
            let i = i0 + r;
            let qr = &sc.q[r * d..(r + 1) * d];
            let s = &mut sc.s[r * BC..r * BC + cols];
            for (c, s) in s.iter_mut().enumerate() {
                *s = dot(qr, &sc.k[c * d..(c + 1) * d]);
            }
            if softcap || slope != 0.0 {
                for (c, s) in s.iter_mut().enumerate() {
                    let raw = if softcap { p.score.cap(*s) } else { *s / LOG2_E };
                    let bias = if slope != 0.0 {
                        crate::semantics::alibi_bias(slope, i, j0 + c, sq, sk)
                    } else {
                        0.0
                    };
                    *s = (raw - bias) * LOG2_E;
                }
            }
            if !full {
                let (rlo, rhi) = p.window.key_range(i, sq, sk);
                for (c, s) in s.iter_mut().enumerate() {
                    let j = j0 + c;
                    if j < rlo || j >= rhi {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            // Online softmax update for row r.
            // NaN must propagate (a NaN query poisons its row), so no f32::max here.
            let m_tile = s
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, |a, x| if x > a || x.is_nan() { x } else { a });
            let m_new = sc.m[r].max(m_tile);
            if m_new == f32::NEG_INFINITY {
                continue; // nothing visible yet: keep O = 0, l = 0
            }
            let corr = (sc.m[r] - m_new).exp2();
            let mut sum = 0.0;
            for s in s.iter_mut() {
                *s = (*s - m_new).exp2();
                sum += *s;
            }
            sc.l[r] = sc.l[r] * corr + sum;
            sc.m[r] = m_new;
            let o = &mut sc.o[r * d..(r + 1) * d];
            if corr != 1.0 {
                o.iter_mut().for_each(|x| *x *= corr);
            }
            for (c, &pr) in s.iter().enumerate() {
                let vr = &sc.v[c * d..(c + 1) * d];
                for (o, &x) in o.iter_mut().zip(vr) {
                    *o += pr * x;
                }
            }
        }
        j0 += cols;
    }

    let row_stride = p.heads * d;
    let lse_h = p.lse_head_stride();
    for r in 0..rows {
        let l = sc.l[r];
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        let base = (seq.out_row + i0 + r) * row_stride + h * d;
        for x in 0..d {
            // SAFETY: element (row, h, x) belongs to this work item alone and is in bounds of the
            // output allocated by `forward` (total_q * heads * d elements).
            unsafe { *out.0.add(base + x) = T::from_f32(sc.o[r * d + x] * inv) };
        }
        let row_lse = if l > 0.0 {
            (sc.m[r] + l.log2()) / LOG2_E
        } else {
            f32::NEG_INFINITY
        };
        // SAFETY: as above, for the row's log-sum-exp.
        unsafe { *lse.0.add(seq.lse_base + h * lse_h + i0 + r) = row_lse };
    }
}

/// Dot product with independent partial sums so the compiler can vectorise it.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let (ca, ra) = a.split_at(a.len() - a.len() % L);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(L).zip(cb.chunks_exact(L)) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
