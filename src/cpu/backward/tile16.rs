//! One (query tile, key tile) step of the bf16 backward pass: the schedule, lanes and softmax
//! of [`super::tile`] (keys in lanes), with K, V, Q and dO kept in bf16 and the five products on
//! an [`Engine`] in the pair layout of [`crate::cpu::bf16`]:
//!
//! * `S = Q Kᵀ`, `dP = dO Vᵀ`: rows are queries (Q, dO row-major bf16), the reduction runs over
//!   head-dim pairs of `Kᵀ`, `Vᵀ` (per key tile: `ktp[t]` lane `c` = `K[c][2t], K[c][2t+1]`);
//! * `P`, `dS` from the f32 code of the f32 path ([`super::tile::probabilities`]);
//! * `dVᵀ += dOᵀ P`, `dKᵀ += Qᵀ dS`: rows are head dims (`dOᵀ`, `Qᵀ` bf16, transposed once per
//!   query tile), the reduction runs over pairs of query rows of `P` and `dS`, rounded to bf16;
//! * `dQ = dS K`: rows are queries (`dS` rounded to bf16 row-major), the reduction runs over key
//!   pairs of `K` (per key tile: `kp[cp]` lane `x` = `K[2cp][x], K[2cp+1][x]`, 64 head dims per
//!   chunk). One product per query tile covers all [`KSUB`] key tiles held (their `dS` side by
//!   side, their `K` pairs one after the other), so dQ's rows are read and written once per
//!   group of key tiles, not once per step.
//!
//! `P` and `dS` are rounded to bf16 for their products as on the GPU; `D`, the lse and every
//! accumulator stay f32. Padding (to the engine's alignment of rows and of reductions) is 0 in
//! every operand, so it adds nothing.

use half::bf16;

use super::super::bf16::{
    interleave_rows, load_keys, load_rows, pack_pairs, pad, probs_pairs, round_row, rows_to_lanes,
    transpose_rows, Acc, Engine, Pairs,
};
use super::super::kernel::Avx512;
use super::super::{Lanes, BC, BR};
use super::tile::{probabilities, QuerySrc, Step, QSUB};
use crate::problem::{KeyRows, Problem};
use crate::semantics::LOG2_E;

/// `dS` rows are BC keys long, stored BR apart.
const _: () = assert!(BC == BR);

/// Query rows per step: twice the f32 tiles', so that each pass of the dK/dV accumulators
/// through the tile unit (loaded, products, stored) adds 128 query rows; with 64 their loads
/// and stores took as long as the products.
pub(super) const QT: usize = 128;

/// Key tiles held at once: twice the f32 tiles', since on a bf16 engine the loads of a query
/// tile (Q and dO, transposed) and the pass over its dQ rows cost as much as several steps'
/// products; 8 keep the dK/dV accumulators within L2 (512 KiB at head dim 128).
pub(super) const KSUB: usize = 8;
/// Keys side by side in a row of `dS` (all slots).
const DSW: usize = KSUB * BC;

/// Head dims per lane chunk of `K` pairs and of the dQ tile.
const CH: usize = BR;
/// Rows of the per-step tiles: a step's query rows, plus the padding of AMX's 16-row blocks.
const QTM: usize = QT + 16;
/// Query rows of the loaded query tiles, plus the padding of a 32-row reduction starting at
/// any row of them.
const QROWS: usize = QSUB * QT + 32;

/// Per-thread buffers of the bf16 backward.
pub(in super::super) struct Scratch16 {
    d: usize,
    /// `d` padded for the reductions over head dims (`dk`) and for rows of head dims (`dm`).
    dk: usize,
    dm: usize,
    /// The engine's alignments these buffers are padded for.
    align: (usize, usize),
    /// Lane chunks of the head dim (`⌈d / 64⌉`).
    nch: usize,
    /// One K or V tile, row-major `BC × dk` (padding 0), on its way into the pair tiles.
    tile: Vec<u16>,
    /// Per key tile slot `u < KSUB` (at `u * dk / 2`): `Kᵀ`, `Vᵀ` in pair rows of key lanes.
    ktp: Vec<Pairs>,
    vtp: Vec<Pairs>,
    /// `K` in key pairs, chunk-major: `kp[(ch · KSUB + u) · BC / 2 + cp]` lane `x` holds dim
    /// `64 ch + x` of keys `2cp`, `2cp + 1` of slot `u`, so that a chunk's pairs of all slots
    /// follow each other.
    kp: Vec<Pairs>,
    /// Keys of each slot.
    cols: [usize; KSUB],
    /// Per slot (at `u * dm`): `dKᵀ` (unscaled) and `dVᵀ`, rows of key lanes.
    dkt: Vec<Lanes>,
    dvt: Vec<Lanes>,
    /// Q and dO of the loaded query rows, row-major `QROWS × dk`, and transposed, `dm` rows of
    /// `QROWS` (columns past the loaded rows 0).
    q: Vec<u16>,
    g: Vec<u16>,
    qt: Vec<u16>,
    gt: Vec<u16>,
    /// Per loaded query row: `lse · log2 e` and `D`.
    lse2: [f32; QSUB * QT],
    delta: [f32; QSUB * QT],
    /// `S` then `P`, `dP` then `dS`: rows of key lanes.
    s: Vec<Lanes>,
    dp: Vec<Lanes>,
    /// `P` and `dS` in pairs of query rows.
    pp: Vec<Pairs>,
    dsp: Vec<Pairs>,
    /// `dS` of the query tile being grouped, rounded to bf16: `QTM` rows of `DSW` (slot `u`'s
    /// keys at `u · BC`); rows `[written[u].0, written[u].1)` of slot `u` hold its step.
    ds: Vec<u16>,
    written: [(usize, usize); KSUB],
    /// The grouped query tile: first row among the loaded ones, and rows.
    dq_base: usize,
    dq_rows: usize,
    /// `dS K` of the query tile (unscaled): `dqt[ch * QTM + r]` holds dims `64 ch ..` of row
    /// `r`.
    dqt: Vec<Lanes>,
    /// Per slot: every element of the key tile is finite.
    k_finite: [bool; KSUB],
}

impl Scratch16 {
    fn new<E: Engine>(d: usize) -> Self {
        let dk = pad(d, E::K_ALIGN);
        let dm = pad(d, E::M_ALIGN);
        let nch = d.div_ceil(CH);
        let z = Lanes::splat(0.0);
        Self {
            d,
            dk,
            dm,
            align: (E::K_ALIGN, E::M_ALIGN),
            nch,
            tile: vec![0; BC * dk],
            ktp: vec![Pairs::ZERO; KSUB * dk / 2],
            vtp: vec![Pairs::ZERO; KSUB * dk / 2],
            kp: vec![Pairs::ZERO; KSUB * nch * BC / 2],
            cols: [0; KSUB],
            dkt: vec![z; KSUB * dm],
            dvt: vec![z; KSUB * dm],
            q: vec![0; QROWS * dk],
            g: vec![0; QROWS * dk],
            qt: vec![0; dm * QROWS],
            gt: vec![0; dm * QROWS],
            lse2: [0.0; QSUB * QT],
            delta: [0.0; QSUB * QT],
            s: vec![z; QTM],
            dp: vec![z; QTM],
            pp: vec![Pairs::ZERO; QT / 2 + 16],
            dsp: vec![Pairs::ZERO; QT / 2 + 16],
            ds: vec![0; QTM * DSW],
            written: [(0, 0); KSUB],
            dq_base: 0,
            dq_rows: 0,
            dqt: vec![z; nch * QTM],
            k_finite: [true; KSUB],
        }
    }

    pub fn zero_dkdv(&mut self) {
        let z = Lanes::splat(0.0);
        self.dkt.iter_mut().for_each(|x| *x = z);
        self.dvt.iter_mut().for_each(|x| *x = z);
    }

    /// `dKᵀ` (unscaled) and `dVᵀ` of key tile slot `u` (the first `d` rows hold the head dims).
    pub fn dkdv(&self, u: usize) -> (&[Lanes], &[Lanes]) {
        let dm = self.dm;
        (
            &self.dkt[u * dm..(u + 1) * dm],
            &self.dvt[u * dm..(u + 1) * dm],
        )
    }

    /// Starts the dQ of the `rows` query rows from row `base` of the loaded ones.
    pub fn dq_begin(&mut self, base: usize, rows: usize) {
        self.dq_base = base;
        self.dq_rows = rows;
        self.written = [(0, 0); KSUB];
    }

    /// Adds row `r` of the query tile's dQ to `dst` (`d` elements).
    #[inline(always)]
    pub fn add_dq_row(&self, r: usize, dst: &mut [f32]) {
        for (ch, dst) in dst[..self.d].chunks_mut(CH).enumerate() {
            for (o, &x) in dst.iter_mut().zip(&self.dqt[ch * QTM + r].0) {
                *o += x;
            }
        }
    }
}

thread_local! {
    /// Each thread's scratch, kept between work items and calls.
    static SCRATCH: std::cell::RefCell<Option<Scratch16>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's scratch, (re)built when the head dim or the engine changed.
pub(in super::super) fn with_scratch16<E: Engine>(d: usize, f: impl FnOnce(&mut Scratch16)) {
    let fits = |s: &Scratch16| s.d == d && s.align == (E::K_ALIGN, E::M_ALIGN);
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            if !matches!(&*slot, Some(s) if fits(s)) {
                *slot = Some(Scratch16::new::<E>(d));
            }
            if let Some(s) = slot.as_mut() {
                f(s);
            }
        }
        Err(_) => f(&mut Scratch16::new::<E>(d)),
    })
}

/// Loads keys `j0 .. j0 + cols` of K/V head `kvh` into key tile slot `u`: `Kᵀ`, `Vᵀ` in pair
/// rows and (with `chunks`) `K` in key pairs. Lanes and pairs past the tile's keys are 0.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_keys_tile(
    sc: &mut Scratch16,
    u: usize,
    p: &Problem,
    k: &[bf16],
    v: &[bf16],
    keys: &KeyRows,
    j0: usize,
    cols: usize,
    kvh: usize,
    chunks: bool,
) {
    let (d, dk, nch) = (sc.d, sc.dk, sc.nch);
    let half = dk / 2;
    load_keys(&mut sc.tile, dk, k, &p.k, keys, j0, cols, kvh, d);
    sc.k_finite[u] = super::super::bf16::all_finite(&sc.tile[..cols * dk]);
    sc.cols[u] = cols;
    rows_to_lanes(&mut sc.ktp[u * half..(u + 1) * half], &sc.tile, dk, cols);
    if chunks {
        for ch in 0..nch {
            let at = (ch * KSUB + u) * BC / 2;
            let x0 = ch * CH;
            let kp = &mut sc.kp[at..at + BC / 2];
            interleave_rows(kp, &sc.tile[x0..], dk, cols, CH.min(d - x0));
        }
    }
    load_keys(&mut sc.tile, dk, v, &p.v, keys, j0, cols, kvh, d);
    rows_to_lanes(&mut sc.vtp[u * half..(u + 1) * half], &sc.tile, dk, cols);
}

/// Loads query rows `i0 .. i0 + rows` (`rows <= QSUB · QT`) of head `h` (storage row
/// `q_row + i0`, output row `out_row + i0`): Q, dO row-major and transposed, `lse · log2 e`
/// and `D`.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_queries(
    sc: &mut Scratch16,
    src: &QuerySrc<bf16>,
    b: usize,
    q_row: usize,
    out_row: usize,
    i0: usize,
    rows: usize,
    h: usize,
) {
    let (d, dk) = (sc.d, sc.dk);
    load_rows(&mut sc.q, dk, src.q, src.qs, b, q_row + i0, rows, h, d);
    for r in 0..rows {
        let at = (out_row + i0 + r) * src.heads + h;
        for (o, x) in sc.g[r * dk..r * dk + d]
            .iter_mut()
            .zip(&src.go[at * d..(at + 1) * d])
        {
            *o = x.to_bits();
        }
        sc.lse2[r] = src.lse2[at];
        sc.delta[r] = src.delta[at];
    }
    // Columns past the loaded rows are 0 as far as a reduction padded to 32 rows from any
    // of them can read: it adds 0 · 0 there.
    let (end, zero_to) = (pad(rows, 32), (pad(rows, 32) + 32).min(QROWS));
    for (src, dst) in [(&sc.q, &mut sc.qt), (&sc.g, &mut sc.gt)] {
        transpose_rows(dst, QROWS, src, dk, rows, d);
        for row in dst.chunks_exact_mut(QROWS).take(d) {
            row[end..zero_to].fill(0);
        }
    }
}

/// One step over the loaded tiles on engine `E`: `S`, `P`, `dP`, `dS`; then `dVᵀ`, `dKᵀ` (with
/// `dkdv`) and the dQ tile `dS K` (with `dq`, which needs the key pairs loaded).
#[inline(always)]
pub(super) fn step<E: Engine>(st: &Step, sc: &mut Scratch16, dkdv: bool, dq: bool) {
    let (dk, dm) = (sc.dk, sc.dm);
    let half = dk / 2;
    let (rows, cols, u, ro) = (st.rows, st.cols, st.u, st.ro);
    let mrows = pad(rows, E::M_ALIGN);
    let (ktp, vtp) = (
        &sc.ktp[u * half..(u + 1) * half],
        &sc.vtp[u * half..(u + 1) * half],
    );
    E::mm(
        &mut sc.s[..mrows],
        Acc::Zero,
        1.0,
        &sc.q[ro * dk..],
        dk,
        ktp,
        dk,
    );
    E::mm(
        &mut sc.dp[..mrows],
        Acc::Zero,
        1.0,
        &sc.g[ro * dk..],
        dk,
        vtp,
        dk,
    );
    let (lse2, delta) = (&sc.lse2[ro..], &sc.delta[ro..]);
    // P and dS, rounded to bf16 pairs of rows for dVᵀ and dKᵀ, and to bf16 rows for dQ (into
    // slot u's columns of the grouped query tile's dS rows).
    let rp = pad(rows, E::K_ALIGN);
    let colsp = pad(cols, E::K_ALIGN);
    let dr = ro.wrapping_sub(sc.dq_base);
    if dq {
        sc.written[u] = (dr, dr + rows);
    }
    let ds = dq.then(|| &mut sc.ds[dr * DSW + u * BC..]);
    let p = st.p;
    if p.score.softcap > 0.0 || st.slope != 0.0 || st.extras.is_some() {
        probabilities::<Avx512>(st, &mut sc.s[..rows], &mut sc.dp[..rows], lse2, delta);
        pack_pairs(&mut sc.pp[..rp / 2], &sc.s, rows);
        pack_pairs(&mut sc.dsp[..rp / 2], &sc.dp, rows);
        if let Some(ds) = ds {
            for (r, dp) in sc.dp[..rows].iter().enumerate() {
                round_row(&mut ds[r * DSW..r * DSW + colsp], dp);
            }
        }
    } else {
        // Tiles the band cuts through (and the key tail) need a per-element mask.
        let masked = cols < BC || !st.mask.covers(st.i0..st.i0 + rows, st.j0..st.j0 + cols);
        let mut lanes = [0u64; QT];
        if masked {
            for (r, l) in lanes[..rows].iter_mut().enumerate() {
                let (lo, hi) = st.mask.row_range(st.i0 + r);
                let a = lo.clamp(st.j0, st.j0 + cols) - st.j0;
                let b = hi.clamp(st.j0, st.j0 + cols) - st.j0;
                let below = |n: usize| if n >= 64 { !0u64 } else { (1u64 << n) - 1 };
                *l = below(b) & !below(a);
            }
        }
        let qk2 = p.score.scale * LOG2_E;
        probs_pairs(
            &sc.s,
            &sc.dp,
            lse2,
            delta,
            qk2,
            masked.then_some(&lanes[..]),
            rows,
            &mut sc.pp[..rp / 2],
            &mut sc.dsp[..rp / 2],
            ds.map(|ds| (ds, DSW)),
        );
    }
    if dkdv {
        // dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS over pairs of query rows.
        let dvt = &mut sc.dvt[u * dm..(u + 1) * dm];
        E::mm(dvt, Acc::Keep, 1.0, &sc.gt[ro..], QROWS, &sc.pp, rp);
        let dkt = &mut sc.dkt[u * dm..(u + 1) * dm];
        E::mm(dkt, Acc::Keep, 1.0, &sc.qt[ro..], QROWS, &sc.dsp, rp);
    }
}

/// The grouped dQ of the query tile started by [`Scratch16::dq_begin`]: `dS K` over key tile
/// slots `0 .. slots` in one product per head-dim chunk (the rows of `dS` that no step of a
/// slot wrote are 0 for it).
pub(super) fn dq_end<E: Engine>(sc: &mut Scratch16, slots: usize) {
    let rows = sc.dq_rows;
    let mrows = pad(rows, E::M_ALIGN);
    for (u, &(a, b)) in sc.written[..slots].iter().enumerate() {
        for r in (0..a.min(mrows)).chain(b.max(a)..mrows) {
            sc.ds[r * DSW + u * BC..r * DSW + (u + 1) * BC].fill(0);
        }
    }
    if slots == 0 {
        return;
    }
    // The reduction: every slot's keys; only the last key tile of a sequence is partial.
    let k = (slots - 1) * BC + pad(sc.cols[slots - 1], E::K_ALIGN);
    let finite = sc.k_finite[..slots].iter().all(|&f| f);
    for ch in 0..sc.nch {
        let kp = &sc.kp[ch * KSUB * BC / 2..(ch + 1) * KSUB * BC / 2];
        let out = &mut sc.dqt[ch * QTM..ch * QTM + mrows];
        if finite {
            E::mm(out, Acc::Zero, 1.0, &sc.ds, DSW, kp, k);
        } else {
            // A masked key has dS = 0, but 0 · NaN = NaN: with a NaN or infinity in a key
            // tile, the terms of zero dS are left out, so it reaches only the rows that see
            // its key (whose dS is then NaN already).
            for (r, o) in out[..rows].iter_mut().enumerate() {
                *o = Lanes::splat(0.0);
                for u in 0..slots {
                    for c in 0..sc.cols[u] {
                        let g = super::super::bf16::to_f32(sc.ds[r * DSW + u * BC + c]);
                        if g != 0.0 {
                            let kc = &kp[u * BC / 2 + c / 2];
                            for (o, &k) in o.0.iter_mut().zip(&kc.0) {
                                let k = if c % 2 == 0 {
                                    k as u16
                                } else {
                                    (k >> 16) as u16
                                };
                                *o = g.mul_add(super::super::bf16::to_f32(k), *o);
                            }
                        }
                    }
                }
            }
        }
    }
}
