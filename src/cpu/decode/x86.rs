//! The x86 decode kernels behind [`Ops`]: head-dim elements in SIMD lanes, 16 at a time with
//! AVX-512 and 8 with AVX2, several query rows sharing every K and V load. The bounds the
//! unsafe kernels rely on are checked here, once per block and KV head.

mod amx;
mod avx2;
mod avx512;

pub(super) use amx::{pack_q, MAX_Q_TILES, TILE_D, TILE_ROWS, TILE_WORDS};

use super::scratch::TileQ;
use super::{kind, Kind, Ops, Pf, Rows, TileUse, BK};
use crate::cpu::bf16::amx::{Amx, Tiles};
use crate::cpu::elem::Elem;
use crate::cpu::kernel::{Avx512, Fused};

/// Checks what the unsafe kernels rely on: keys inside the block, whose rows of `d` elements lie
/// inside `r.src`.
#[inline(always)]
fn check_rows<T>(r: &Rows<T>, keys: &std::ops::Range<usize>, d: usize) {
    assert!(keys.end <= BK, "decode: a block holds at most BK keys");
    for c in keys.clone() {
        assert!(
            r.off[c]
                .checked_add(r.shift)
                .and_then(|o| o.checked_add(d))
                .is_some_and(|e| e <= r.src.len()),
            "decode: K/V row out of bounds"
        );
    }
}

/// Checks the query side of [`Ops::scores`]: `rows` rows of `d` in `q` and a score row each.
#[inline(always)]
fn check_scores(q: usize, rows: usize, d: usize, s: usize) {
    assert!(
        rows.checked_mul(d).is_some_and(|n| q >= n) && s >= rows,
        "decode: query rows out of bounds"
    );
}

/// Checks the output side of [`Ops::pv`]: `rows` rows of `d` in `o`, a correction and a
/// probability row each, and columns inside the block.
#[inline(always)]
fn check_pv(
    o: usize,
    rows: usize,
    d: usize,
    corr: Option<usize>,
    p: usize,
    cols: &std::ops::Range<usize>,
) {
    assert!(
        rows.checked_mul(d).is_some_and(|n| o >= n)
            && corr.is_none_or(|c| c >= rows)
            && p >= rows
            && cols.end <= BK,
        "decode: output rows out of bounds"
    );
}

/// Checks the bounds of [`Ops::softmax_rows`]: `n` rows of statistics and visible columns
/// inside the block.
#[inline(always)]
fn check_softmax(n: usize, cols: &[(usize, usize)], m: usize, l: usize, corr: usize) {
    assert!(
        cols.len() >= n
            && m >= n
            && l >= n
            && corr >= n
            && cols[..n].iter().all(|&(c0, c1)| c0 <= c1 && c1 <= BK),
        "decode: softmax rows out of bounds"
    );
}

/// Loads the tile configuration (`on`) or releases it, on this thread, for the tile unit `u`.
pub(super) fn tiles_on(u: TileUse, on: bool) {
    fn go<T: Tiles>(on: bool) {
        // SAFETY: a `TileUse` other than `Off` is only chosen where the tile unit may be used
        // (`forward_with`: AMX present and granted to the process, or the software model).
        unsafe {
            if on {
                T::configure()
            } else {
                T::release()
            }
        }
    }
    match u {
        TileUse::Off => {}
        TileUse::Amx => go::<Amx>(on),
        #[cfg(test)]
        TileUse::Model => go::<crate::cpu::bf16::amx::Soft>(on),
    }
}

/// [`Ops::scores`] of bf16 rows on the tile unit `u` (configured by [`tiles_on`], the query
/// rows of the item packed into `tq`): all `rows` query rows of KV head `kvh` against a whole
/// block whose 16 K rows lie one stride apart. Returns `false`, having done nothing, for any
/// other block (a partial one, or rows not one stride apart), which the caller then runs on the
/// vector kernels.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn tile_scores<T: 'static>(
    u: TileUse,
    tq: &mut TileQ,
    kvh: usize,
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) -> bool {
    type Run = unsafe fn(
        Option<&[u32]>,
        usize,
        *const u8,
        usize,
        usize,
        usize,
        &mut [[f32; BK]; BK],
        &mut [[f32; BK]],
        &mut Pf,
    );
    let run: Run = match u {
        TileUse::Off => return false,
        TileUse::Amx => run::<Amx>,
        #[cfg(test)]
        TileUse::Model => run::<crate::cpu::bf16::amx::Soft>,
    };
    if kind::<T>() != Kind::Bf16 || keys != (0..BK) || rows == 0 {
        return false;
    }
    let stride = k.row(1).wrapping_sub(k.row(0));
    if (2..BK).any(|c| k.row(c) != k.row(0).wrapping_add(c.wrapping_mul(stride))) {
        return false;
    }
    let chunks = d / TILE_D;
    check_rows(k, &keys, d);
    let per = chunks * TILE_WORDS;
    assert!(
        d.is_multiple_of(TILE_D)
            && (1..=MAX_Q_TILES).contains(&chunks)
            && chunks == tq.tiles
            && rows.div_ceil(TILE_ROWS) == tq.row_chunks
            && tq.heads >= 1
            && (tq.row_chunks == 1 || tq.heads == 1)
            && tq.heads * rows.min(TILE_ROWS) <= TILE_ROWS
            && tq.q.len() >= (kvh / tq.heads + 1) * tq.row_chunks * per
            && s.len() >= rows,
        "decode: tile operands out of bounds"
    );
    let kp = k.src.as_ptr().wrapping_add(k.row(0)).cast::<u8>();
    let stride = stride.wrapping_mul(std::mem::size_of::<T>());
    for rc in 0..tq.row_chunks {
        let (set, col, n) = tq.slot(kvh, rc, rows);
        let s = &mut s[rc * TILE_ROWS..rc * TILE_ROWS + n];
        let load = (tq.loaded != Some(set)).then(|| &tq.q[set * per..(set + 1) * per]);
        // SAFETY: configured (`tiles_on`, where the item began, and `u` is not `Off`, so on
        // AMX or its model, with avx512f: `forward_with`); the set's `chunks` tiles lie inside
        // `tq.q` and `col + n <= 16` (both checked above); the 16 K rows at `kp`, `stride`
        // bytes apart, are the block's, each with `d = 32 · chunks` elements in bounds
        // (`check_rows`).
        unsafe { run(load, chunks, kp, stride, col, n, &mut tq.st.0, s, pf) };
        tq.loaded = Some(set);
    }
    true
}

/// One chunk of query rows of [`tile_scores`] on the tile unit `U`, loading their tiles first
/// where `load` has them.
///
/// # Safety
/// The tile unit is configured (`tiles_on`) on a CPU with avx512f; `load`, where given, holds
/// `1 <= chunks <= MAX_Q_TILES` packed tiles, and otherwise those of these rows are loaded;
/// `col + n <= 16`; `s` holds `n` rows; the 16 rows of `chunks · 64` bytes at `kp`, `stride`
/// apart, are readable.
#[allow(clippy::too_many_arguments)]
unsafe fn run<U: Tiles>(
    load: Option<&[u32]>,
    chunks: usize,
    kp: *const u8,
    stride: usize,
    col: usize,
    n: usize,
    st: &mut [[f32; BK]; BK],
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    // SAFETY: the caller's.
    unsafe {
        if let Some(q) = load {
            amx::load_q::<U>(q, chunks);
        }
        amx::scores::<U>(chunks, kp, stride, col, n, st, s, pf)
    }
}

/// `O += P V` on the tile unit `u` (see `amx::pv`) for the `rows` rows of a KV head that all see
/// every key of a whole block whose 16 V rows lie one stride apart: `o` holds them pair-split,
/// in chunks of 16 rows ([`TILE_ROWS`], the last padded), each first scaled by its correction
/// `corr[t]`; `p` holds their probabilities, rounded to bf16 on the way. Returns `false`,
/// having done nothing, for any other block, which the caller then runs on the vector kernels.
/// The query tiles are overwritten (`tq.loaded` is cleared).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn tile_pv<T: 'static>(
    u: TileUse,
    tq: &mut TileQ,
    o: &mut [f32],
    rows: usize,
    d: usize,
    corr: &[f32],
    p: &[[f32; BK]],
    v: &Rows<T>,
    pf: &mut Pf,
) -> bool {
    type Run = unsafe fn(usize, *mut u8, usize, *const u8, *const u8, *const u8, usize, &mut Pf);
    let run: Run = match u {
        TileUse::Off => return false,
        TileUse::Amx => amx::pv::<Amx>,
        #[cfg(test)]
        TileUse::Model => amx::pv::<crate::cpu::bf16::amx::Soft>,
    };
    if kind::<T>() != Kind::Bf16 || rows == 0 {
        return false;
    }
    let stride = v.row(1).wrapping_sub(v.row(0));
    if (2..BK).any(|c| v.row(c) != v.row(0).wrapping_add(c.wrapping_mul(stride))) {
        return false;
    }
    let chunks = d / TILE_D;
    check_rows(v, &(0..BK), d);
    assert!(
        d.is_multiple_of(TILE_D)
            && chunks >= 1
            && o.len() >= rows.next_multiple_of(TILE_ROWS) * d
            && corr.len() >= rows
            && p.len() >= rows,
        "decode: tile operands out of bounds"
    );
    let vp = v.src.as_ptr().wrapping_add(v.row(0)).cast::<u8>();
    let stride = stride.wrapping_mul(std::mem::size_of::<T>());
    for r0 in (0..rows).step_by(TILE_ROWS) {
        let n = TILE_ROWS.min(rows - r0);
        let o = &mut o[r0 * d..(r0 + TILE_ROWS) * d];
        // SAFETY: avx512f with every tile unit (`forward_with`); `p` holds rows r0 .. r0 + n and
        // `o` and `corr` the n rows (checked above).
        unsafe {
            avx512::p_tiles(&p[r0..], n, &mut tq.pe.0, &mut tq.po.0);
            avx512::scale_rows(o, d, &corr[r0..], n);
        }
        let (pe, po) = (tq.pe.0.as_ptr().cast::<u8>(), tq.po.0.as_ptr().cast());
        // SAFETY: configured (`tiles_on`, where the item began; `u` is not `Off`); `pe` and
        // `po` are tiles; `o` holds 16 rows of `d` f32 (4 · d = chunks · 128 bytes, checked
        // above); the 16 V rows at `vp`, `stride` bytes apart, are the block's, each with
        // `d = 32 · chunks` elements in bounds (`check_rows`).
        unsafe { run(chunks, o.as_mut_ptr().cast(), 4 * d, pe, po, vp, stride, pf) };
    }
    tq.loaded = None;
    true
}

impl Ops for Avx512 {
    #[inline(always)]
    fn reads<T: 'static>() -> bool {
        kind::<T>() != Kind::Other
    }

    #[inline(always)]
    fn softmax_rows(
        s: &mut [[f32; BK]],
        cols: &[(usize, usize)],
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        check_softmax(s.len(), cols, m.len(), l.len(), corr.len());
        // SAFETY: avx512f/bw/vl detected as for the products; the bounds were checked above.
        unsafe { avx512::softmax_rows(s, cols, scale, m, l, corr) }
    }

    #[inline(always)]
    fn scores<T: Elem>(
        dot: bool,
        q: &[f32],
        qh: &[u16],
        rows: usize,
        d: usize,
        k: &Rows<T>,
        keys: std::ops::Range<usize>,
        s: &mut [[f32; BK]],
        pf: &mut Pf,
    ) {
        if rows == 0 || keys.is_empty() {
            return pf.fetch_all();
        }
        check_rows(k, &keys, d);
        if dot && kind::<T>() == Kind::Bf16 {
            check_scores(q.len(), rows, d, s.len());
            let dq = d.next_multiple_of(2);
            assert!(qh.len() >= rows * dq, "decode: query rows out of bounds");
            // Groups of eight rows against the transposed block, the rest (fewer than eight)
            // four at a time.
            let r8 = rows / 8 * 8;
            // SAFETY (both calls): `dot` is only set where avx512bf16 (with avx512f/bw/vl) was
            // detected (`forward_with`); `T` is bf16; the bounds were checked just above.
            unsafe {
                if r8 > 0 {
                    avx512::scores_bf16_t8(qh, r8, d, k, keys.clone(), s, pf);
                }
                if r8 < rows {
                    avx512::scores_bf16(&qh[r8 * dq..], rows - r8, d, k, keys, &mut s[r8..], pf);
                }
            }
        } else {
            check_scores(q.len(), rows, d, s.len());
            // SAFETY: only reached through `item_avx512`, i.e. with avx512f/bw/vl detected; the
            // bounds were checked just above.
            unsafe { avx512::scores(q, rows, d, k, keys, s, pf) }
        }
    }

    #[inline(always)]
    fn pv<T: Elem>(
        dot: bool,
        split: bool,
        o: &mut [f32],
        rows: usize,
        d: usize,
        corr: Option<&[f32]>,
        p: &[[f32; BK]],
        v: &Rows<T>,
        cols: std::ops::Range<usize>,
        pf: &mut Pf,
    ) {
        if rows == 0 || cols.is_empty() {
            return;
        }
        check_pv(o.len(), rows, d, corr.map(<[f32]>::len), p.len(), &cols);
        check_rows(v, &cols, d);
        assert!(
            !split || (kind::<T>() == Kind::Bf16 && d.is_multiple_of(TILE_D)),
            "decode: pair-split rows of O are bf16 products over whole 32-element steps"
        );
        // SAFETY (each call): avx512f/bw/vl detected as above; the bounds were checked just
        // above, and pair-split rows only with bf16 rows of whole 32-element steps.
        unsafe {
            match (dot && kind::<T>() == Kind::Bf16, split) {
                (true, true) => avx512::pv::<T, true, true>(o, rows, d, corr, p, v, cols, pf),
                (true, false) => avx512::pv::<T, true, false>(o, rows, d, corr, p, v, cols, pf),
                (false, true) => avx512::pv::<T, false, true>(o, rows, d, corr, p, v, cols, pf),
                (false, false) => avx512::pv::<T, false, false>(o, rows, d, corr, p, v, cols, pf),
            }
        }
    }
}

impl Ops for Fused {
    #[inline(always)]
    fn reads<T: 'static>() -> bool {
        kind::<T>() != Kind::Other
    }

    const PACKS_Q: bool = true;

    #[inline(always)]
    fn q_len(rows: usize, d: usize) -> usize {
        avx2::packed_len(rows, d)
    }

    #[inline(always)]
    fn pack_q<U: 'static>(q: &[f32], rows: usize, d: usize, out: &mut [f32]) {
        avx2::pack_q::<U>(q, rows, d, out)
    }

    #[inline(always)]
    fn softmax_rows(
        s: &mut [[f32; BK]],
        cols: &[(usize, usize)],
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        check_softmax(s.len(), cols, m.len(), l.len(), corr.len());
        // SAFETY: only reached through `item_avx2`, i.e. with avx2 and fma detected; the
        // bounds were checked just above.
        unsafe { avx2::softmax_rows(s, cols, scale, m, l, corr) }
    }

    #[inline(always)]
    fn scores<T: Elem>(
        _dot: bool,
        q: &[f32],
        _qh: &[u16],
        rows: usize,
        d: usize,
        k: &Rows<T>,
        keys: std::ops::Range<usize>,
        s: &mut [[f32; BK]],
        pf: &mut Pf,
    ) {
        if rows == 0 || keys.is_empty() {
            return pf.fetch_all();
        }
        check_rows(k, &keys, d);
        assert!(
            q.len() >= avx2::packed_len(rows, d) && s.len() >= rows,
            "decode: query rows out of bounds"
        );
        // SAFETY: only reached through `item_avx2`, i.e. with avx2, fma and f16c detected; the
        // bounds were checked just above.
        unsafe { avx2::scores(q, rows, d, k, keys, s, pf) }
    }

    #[inline(always)]
    fn pv<T: Elem>(
        _dot: bool,
        split: bool,
        o: &mut [f32],
        rows: usize,
        d: usize,
        corr: Option<&[f32]>,
        p: &[[f32; BK]],
        v: &Rows<T>,
        cols: std::ops::Range<usize>,
        pf: &mut Pf,
    ) {
        assert!(!split, "decode: pair-split rows of O only on AVX-512");
        pf.fetch_all();
        if rows == 0 || cols.is_empty() {
            return;
        }
        check_pv(o.len(), rows, d, corr.map(<[f32]>::len), p.len(), &cols);
        check_rows(v, &cols, d);
        // SAFETY: avx2, fma and f16c detected as above; the bounds were checked just above.
        unsafe { avx2::pv(o, rows, d, corr, p, v, cols) }
    }
}
