//! One (query tile, key tile) step of the backward pass, keys in SIMD lanes.
//!
//! The key tile is fixed for a whole work item of the dK/dV pass, so it is the tile kept
//! transposed: `Kᵀ` and `Vᵀ` (`d` rows of `BC` key lanes) are built once per key tile, and the
//! query-side tiles (Q, dO) are plain row-major copies. Then every product of the step is a
//! register-blocked broadcast-FMA of [`Kernel::block`] with no transposed copy per step:
//!
//! * `S = Q Kᵀ` and `dP = dO Vᵀ`: row `r` is `Σ_x Q[r][x] · Kᵀ[x]` (one query row per output
//!   row, keys in lanes);
//! * `P = 2^(S·scale·log2 e - lse·log2 e)` and `dS = P ∘ (dP - D)` (`∘ (1 - tanh²)` under a
//!   softcap) are lane-wise, with one `lse` and one `D` per row;
//! * `dVᵀ += dOᵀ P` and `dKᵀ += Qᵀ dS`: row `x` gains `Σ_r dO[r][x] · P[r]`;
//! * `dQ = dS K` (the dQ step): head dims in lanes, 64 at a time (`K` kept in chunks of 64
//!   head dims per key), row `r` is `Σ_c dS[r][c] · K[c]`.
//!
//! `scale` is applied to dK and dQ once, when they are written out.

use super::super::elem::{load_keys, load_rows, Elem};
use super::super::exp2::exp2;
use super::super::extras::ExtrasAt;
use super::super::kernel::Kernel;
use super::super::{Lanes, BC, BR};
use crate::problem::{KeyRows, Problem, Strides};
use crate::semantics::{alibi_bias, SeqMask, LOG2_E};

/// Query rows per step (any size works; the lanes hold keys).
pub(super) const QT: usize = 64;
/// Key tiles held at once: each Q/dO tile load (and each pass over the dQ rows) serves this
/// many key tiles.
pub(super) const KSUB: usize = 4;
/// Query tiles held at once by the dQ pass: each key tile load serves this many.
pub(super) const QSUB: usize = 4;
/// Head dims per lane chunk of `K` and of the dQ tile.
const CH: usize = BR;

/// Adds instead of overwriting in [`Kernel::block`].
const ONES: Lanes = Lanes::splat(1.0);

thread_local! {
    /// Each thread's scratch, kept between work items and calls.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's scratch, (re)built only when the head dim changed.
pub(super) fn with_scratch(d: usize, f: impl FnOnce(&mut Scratch)) {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            if !matches!(&*slot, Some(s) if s.d == d) {
                *slot = Some(Scratch::new(d));
            }
            if let Some(s) = slot.as_mut() {
                f(s);
            }
        }
        Err(_) => f(&mut Scratch::new(d)),
    })
}

/// Per-thread buffers: a few tiles, independent of the sequence lengths.
pub(super) struct Scratch {
    d: usize,
    /// Lane chunks of the head dim (`⌈d / 64⌉`).
    nch: usize,
    /// One K or V tile, row-major `BC × d`, on its way into the transposed tiles.
    tile: Vec<f32>,
    /// Per key tile slot `u < KSUB` (at `u * d`): `Kᵀ`, `Vᵀ`, `d` rows of key lanes (lanes past
    /// the tile's keys are 0).
    kt: Vec<Lanes>,
    vt: Vec<Lanes>,
    /// Per slot (at `u * nch * BC`): `K` in head-dim chunks, `kc[ch * BC + c]` holds dims
    /// `64 ch ..` of key `c`.
    kc: Vec<Lanes>,
    /// Per slot (at `u * d`): `dKᵀ` (unscaled) and `dVᵀ`, `d` rows of key lanes.
    dkt: Vec<Lanes>,
    dvt: Vec<Lanes>,
    /// Q and dO of up to `QSUB` query tiles, row-major `QSUB · QT × d`.
    q: Vec<f32>,
    g: Vec<f32>,
    /// Per query row: `lse · log2 e` (`+inf` for rows that see no key) and `D = dO · O`.
    lse2: [f32; QSUB * QT],
    delta: [f32; QSUB * QT],
    /// `S`, then `P` in place; `dP`, then `dS` in place: `QT` rows of key lanes.
    s: Vec<Lanes>,
    dp: Vec<Lanes>,
    /// `dS K` of the step (unscaled): `dqt[ch * QT + r]` holds dims `64 ch ..` of row `r`.
    pub dqt: Vec<Lanes>,
    /// Per slot: every element of the key tile is finite.
    k_finite: [bool; KSUB],
}

impl Scratch {
    fn new(d: usize) -> Self {
        let nch = d.div_ceil(CH);
        let z = Lanes::splat(0.0);
        Self {
            d,
            nch,
            tile: vec![0.0; BC * d],
            kt: vec![z; KSUB * d],
            vt: vec![z; KSUB * d],
            kc: vec![z; KSUB * nch * BC],
            dkt: vec![z; KSUB * d],
            dvt: vec![z; KSUB * d],
            q: vec![0.0; QSUB * QT * d],
            g: vec![0.0; QSUB * QT * d],
            lse2: [0.0; QSUB * QT],
            delta: [0.0; QSUB * QT],
            s: vec![z; QT],
            dp: vec![z; QT],
            dqt: vec![z; nch * QT],
            k_finite: [true; KSUB],
        }
    }

    pub fn zero_dkdv(&mut self) {
        let z = Lanes::splat(0.0);
        self.dkt.iter_mut().for_each(|x| *x = z);
        self.dvt.iter_mut().for_each(|x| *x = z);
    }

    /// `dKᵀ` (unscaled) and `dVᵀ` of key tile slot `u`.
    pub fn dkdv(&self, u: usize) -> (&[Lanes], &[Lanes]) {
        let d = self.d;
        (&self.dkt[u * d..(u + 1) * d], &self.dvt[u * d..(u + 1) * d])
    }

    /// Adds row `r` of this step's dQ tile, times `1` (scale comes at the end), to `dst`
    /// (`d` elements).
    #[inline(always)]
    pub fn add_dq_row(&self, r: usize, dst: &mut [f32]) {
        for (ch, dst) in dst[..self.d].chunks_mut(CH).enumerate() {
            for (o, &x) in dst.iter_mut().zip(&self.dqt[ch * QT + r].0) {
                *o += x;
            }
        }
    }
}

/// Loads keys `j0 .. j0 + cols` of K/V head `kvh` as `Kᵀ`, `Vᵀ` and (with `chunks`) `K` in
/// head-dim chunks, into key tile slot `u`.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_keys_tile<T: Elem>(
    sc: &mut Scratch,
    u: usize,
    p: &Problem,
    k: &[T],
    v: &[T],
    keys: &KeyRows,
    j0: usize,
    cols: usize,
    kvh: usize,
    chunks: bool,
) {
    let d = sc.d;
    load_keys(&mut sc.tile, k, &p.k, keys, j0, cols, kvh, d);
    sc.k_finite[u] = sc.tile[..cols * d].iter().all(|x| x.is_finite());
    transpose(&sc.tile, &mut sc.kt[u * d..(u + 1) * d], cols, d);
    if chunks {
        let kc = &mut sc.kc[u * sc.nch * BC..(u + 1) * sc.nch * BC];
        for c in 0..cols {
            let row = &sc.tile[c * d..(c + 1) * d];
            for (ch, src) in row.chunks(CH).enumerate() {
                let dst = &mut kc[ch * BC + c].0;
                dst[..src.len()].copy_from_slice(src);
                dst[src.len()..].fill(0.0);
            }
        }
    }
    load_keys(&mut sc.tile, v, &p.v, keys, j0, cols, kvh, d);
    transpose(&sc.tile, &mut sc.vt[u * d..(u + 1) * d], cols, d);
}

/// `out[x][c] = tile[c][x]` for the first `cols` keys, 0 in the lanes past them.
#[inline(always)]
fn transpose(tile: &[f32], out: &mut [Lanes], cols: usize, d: usize) {
    for (x, o) in out.iter_mut().enumerate() {
        for (c, o) in o.0[..cols].iter_mut().enumerate() {
            *o = tile[c * d + x];
        }
        o.0[cols..].fill(0.0);
    }
}

/// Where the query tile of one step comes from.
pub(super) struct QuerySrc<'a, T> {
    pub q: &'a [T],
    pub qs: &'a Strides,
    /// dO, contiguous like the output.
    pub go: &'a [T],
    /// Per output row and head (`row * heads + h`): `lse · log2 e` and `D`.
    pub lse2: &'a [f32],
    pub delta: &'a [f32],
    pub heads: usize,
}

/// Loads query rows `i0 .. i0 + rows` (`rows <= QSUB · QT`) of head `h` (storage row
/// `q_row + i0`, output row `out_row + i0`): Q, dO, `lse · log2 e` and `D`.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_queries<T: Elem>(
    sc: &mut Scratch,
    src: &QuerySrc<T>,
    b: usize,
    q_row: usize,
    out_row: usize,
    i0: usize,
    rows: usize,
    h: usize,
) {
    let d = sc.d;
    load_rows(&mut sc.q, src.q, src.qs, b, q_row + i0, rows, h, d);
    for r in 0..rows {
        let at = (out_row + i0 + r) * src.heads + h;
        T::load_f32(&mut sc.g[r * d..(r + 1) * d], &src.go[at * d..(at + 1) * d]);
        sc.lse2[r] = src.lse2[at];
        sc.delta[r] = src.delta[at];
    }
}

/// What one step needs besides the tiles.
pub(super) struct Step<'a> {
    pub p: &'a Problem,
    pub mask: SeqMask<'a>,
    /// ALiBi slope of the query head (0 without ALiBi).
    pub slope: f32,
    /// The bias and block mask of the query head.
    pub extras: ExtrasAt<'a>,
    /// The step's query rows `i0 .. i0 + rows` (within the sequence pair) are rows
    /// `ro .. ro + rows` of the loaded query tile.
    pub i0: usize,
    pub rows: usize,
    pub ro: usize,
    /// Its keys `j0 .. j0 + cols`, in key tile slot `u`.
    pub j0: usize,
    pub cols: usize,
    pub u: usize,
}

/// One step over the loaded tiles: `S`, `P`, `dP`, `dS`; then `dVᵀ`, `dKᵀ` (with `dkdv`) and
/// the dQ tile `dS K` (with `dq`, which needs the key chunks loaded).
#[inline(always)]
pub(super) fn step<K: Kernel>(st: &Step, sc: &mut Scratch, dkdv: bool, dq: bool) {
    let d = sc.d;
    let (rows, cols, u) = (st.rows, st.cols, st.u);
    let (q, g) = (&sc.q[st.ro * d..], &sc.g[st.ro * d..]);
    let (kt, vt) = (&sc.kt[u * d..(u + 1) * d], &sc.vt[u * d..(u + 1) * d]);
    // S = Q Kᵀ and dP = dO Vᵀ, ROWS query rows per micro-kernel call.
    let mut r = 0;
    while r < rows {
        let n = K::ROWS.min(rows - r);
        K::block(&mut sc.s[r..r + n], None, &q[r * d..], d, 1, kt, d);
        K::block(&mut sc.dp[r..r + n], None, &g[r * d..], d, 1, vt, d);
        r += n;
    }
    let (lse2, delta) = (&sc.lse2[st.ro..], &sc.delta[st.ro..]);
    probabilities::<K>(st, &mut sc.s[..rows], &mut sc.dp[..rows], lse2, delta);
    let (q, g) = (&sc.q[st.ro * d..], &sc.g[st.ro * d..]);
    if dkdv {
        // dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS, ROWS head dims per call.
        let dvt = &mut sc.dvt[u * d..(u + 1) * d];
        let dkt = &mut sc.dkt[u * d..(u + 1) * d];
        let (p, ds) = (&sc.s[..rows], &sc.dp[..rows]);
        let mut x = 0;
        while x < d {
            let n = K::ROWS.min(d - x);
            K::block(&mut dvt[x..x + n], Some(&ONES), &g[x..], 1, d, p, rows);
            K::block(&mut dkt[x..x + n], Some(&ONES), &q[x..], 1, d, ds, rows);
            x += n;
        }
    }
    if dq {
        // dQ = dS K, head dims in lanes, ROWS query rows per call.
        let ds = flat(&sc.dp);
        let kc = &sc.kc[u * sc.nch * BC..(u + 1) * sc.nch * BC];
        for ch in 0..sc.nch {
            let kc = &kc[ch * BC..(ch + 1) * BC];
            let mut r = 0;
            while r < rows {
                let n = K::ROWS.min(rows - r);
                let out = &mut sc.dqt[ch * QT + r..ch * QT + r + n];
                if sc.k_finite[u] {
                    K::block(out, None, &ds[r * BC..], BC, 1, kc, cols);
                } else {
                    // A masked key has dS = 0, but 0 · NaN = NaN: with a NaN or infinity in
                    // the tile, the terms of zero dS are left out, so it reaches only the
                    // rows that see its key (whose dS is then NaN already).
                    for (o, ds) in out.iter_mut().zip(ds[r * BC..].chunks(BC)) {
                        *o = Lanes::splat(0.0);
                        for (&g, kc) in ds[..cols].iter().zip(kc) {
                            if g != 0.0 {
                                for (o, &k) in o.0.iter_mut().zip(&kc.0) {
                                    *o = K::fma(g, k, *o);
                                }
                            }
                        }
                    }
                }
                r += n;
            }
        }
    }
}

/// `S` → `P` and `dP` → `dS` in place, lane-wise, for the rows of the step (`s`, `dp`, and
/// the rows' `lse · log2 e` and `D` from their first). Scores go through softcap, ALiBi, the
/// bias and the block mask in the forward pass's order (`FlashAttn::bias`).
#[inline(always)]
pub(super) fn probabilities<K: Kernel>(
    st: &Step,
    s: &mut [Lanes],
    dp: &mut [Lanes],
    lse2: &[f32],
    delta: &[f32],
) {
    let p = st.p;
    let (sq, sk) = (st.mask.seq_q, st.mask.seq_k);
    let scale = p.score.scale;
    let cap = p.score.softcap;
    let qk2 = scale * LOG2_E;
    // Tiles the band cuts through (and the key tail) need a per-element mask.
    let masked = st.cols < BC
        || !st
            .mask
            .covers(st.i0..st.i0 + st.rows, st.j0..st.j0 + st.cols);
    for (r, (s, ds)) in s[..st.rows].iter_mut().zip(&mut dp[..st.rows]).enumerate() {
        let i = st.i0 + r;
        let (s, ds) = (&mut s.0, &mut ds.0);
        let (l2, dd) = (lse2[r], delta[r]);
        if cap > 0.0 {
            // d cap(z) / dz = 1 - (cap(z) / c)²; the same `cap` as the forward pass.
            let mut dcap = [0f32; BC];
            for (x, g) in s.iter_mut().zip(dcap.iter_mut()) {
                let capped = p.score.cap(*x * scale);
                let t = capped / cap;
                *g = 1.0 - t * t;
                *x = capped * LOG2_E;
            }
            subtract_alibi(s, st.slope, i, st.j0, sq, sk);
            st.extras.apply_row(s, i, st.j0, 0..st.cols, LOG2_E);
            for ((x, g), &dc) in s.iter_mut().zip(ds.iter_mut()).zip(&dcap) {
                let pr = exp2::<K>(*x - l2);
                // A key a block mask hides has no gradient, whatever dP holds (NaN included).
                let hidden = *x == f32::NEG_INFINITY;
                *x = pr;
                *g = if hidden { 0.0 } else { pr * (*g - dd) * dc };
            }
        } else if st.extras.is_some() {
            s.iter_mut().for_each(|x| *x *= qk2);
            subtract_alibi(s, st.slope, i, st.j0, sq, sk);
            st.extras.apply_row(s, i, st.j0, 0..st.cols, LOG2_E);
            for (x, g) in s.iter_mut().zip(ds.iter_mut()) {
                let hidden = *x == f32::NEG_INFINITY;
                let pr = exp2::<K>(*x - l2);
                *x = pr;
                *g = if hidden { 0.0 } else { pr * (*g - dd) };
            }
        } else {
            if st.slope != 0.0 {
                s.iter_mut().for_each(|x| *x *= qk2);
                subtract_alibi(s, st.slope, i, st.j0, sq, sk);
                s.iter_mut().for_each(|x| *x -= l2);
            } else {
                s.iter_mut().for_each(|x| *x = K::fma(*x, qk2, -l2));
            }
            for (x, g) in s.iter_mut().zip(ds.iter_mut()) {
                let pr = exp2::<K>(*x);
                *x = pr;
                *g = pr * (*g - dd);
            }
        }
        if masked {
            // The keys this row sees, as lanes `[a, b)` of the tile.
            let (lo, hi) = st.mask.row_range(i);
            let a = lo.clamp(st.j0, st.j0 + st.cols) - st.j0;
            let b = hi.clamp(st.j0, st.j0 + st.cols) - st.j0;
            let b = b.max(a);
            for (c, (x, g)) in s.iter_mut().zip(ds.iter_mut()).enumerate() {
                if c < a || c >= b {
                    *x = 0.0;
                    *g = 0.0;
                }
            }
        }
    }
}

/// `s[c] -= slope · |diag(i) - (j0 + c)| · log2 e`, the forward pass's ALiBi term.
#[inline(always)]
fn subtract_alibi(s: &mut [f32; BC], slope: f32, i: usize, j0: usize, sq: usize, sk: usize) {
    if slope != 0.0 {
        for (c, x) in s.iter_mut().enumerate() {
            *x -= alibi_bias(slope, i, j0 + c, sq, sk) * LOG2_E;
        }
    }
}

/// The lanes of `l` as one flat slice (`Lanes` is `repr(C)` `[f32; BR]`).
#[inline(always)]
fn flat(l: &[Lanes]) -> &[f32] {
    // SAFETY: `Lanes` is a `repr(C)` wrapper of `[f32; BR]` whose size (256 bytes) equals its
    // alignment multiple, so `l` is `l.len() * BR` consecutive initialised f32.
    unsafe { std::slice::from_raw_parts(l.as_ptr().cast::<f32>(), l.len() * BR) }
}
