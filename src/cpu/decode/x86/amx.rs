//! `q·k` of bf16 caches on the AMX tile unit: a block's scores are computed transposed,
//! `Sᵀ = K Qᵀ`, so that its 16 K rows are the `A` tile exactly as they lie in the cache (one
//! `TILELOADD` per 32 head-dim elements, at the cache's row stride) and only the query rows, which
//! every block of an item reuses, are brought into the `B` layout, once per item ([`pack_q`]).
//! The `B` tiles of a KV head stay in the tile registers while its blocks run; the 16 × 16 `C`
//! tile (keys × query rows) is stored and transposed into the rows of scores that the softmax
//! and `P V` kernels read.
//!
//! Each `TDPBF16PS` multiplies 16 keys by 16 query rows over 32 head-dim elements (8192
//! products) in the time `vdpbf16ps` takes for a few hundred: `q·k` of a bf16 block then costs
//! little more than loading its K rows, whatever the number of query rows up to 16.

use std::arch::x86_64::*;

use super::super::{Pf, BK};
use super::avx512::transpose16;
use crate::cpu::bf16::amx::Tiles;

const _: () = assert!(BK == 16, "a block of keys is the 16 rows of one tile");

/// Query rows per `B` tile (its 16 columns of bf16 pairs).
pub(in crate::cpu::decode) const TILE_ROWS: usize = 16;
/// Head-dim elements per tile step: 32 bf16 (64 bytes) per tile row.
pub(in crate::cpu::decode) const TILE_D: usize = 32;
/// `B` tiles that can stay loaded: tile 0 holds the scores and tile 1 the K rows, tiles 2..8
/// the query chunks, so head dims up to 6 · 32 = 192 keep their query rows in the tile unit.
pub(in crate::cpu::decode) const MAX_Q_TILES: usize = 6;
/// u32 words of one packed `B` tile: 16 pair rows × 16 columns.
pub(in crate::cpu::decode) const TILE_WORDS: usize = 256;

/// Packs query rows `q[t]` (`t < rows`, bf16 bits, `dq` apart, even `d` elements each) into
/// columns `col .. col + rows` (at most 16) of the `B` layout of `d / 32` tiles in `out`: word
/// `(c, i, col + t)` (tile `c`, pair row `i`) holds elements `32c + 2i` and `32c + 2i + 1` of
/// row `t`. The other columns are left as they are.
pub(in crate::cpu::decode) fn pack_q(
    q: &[u16],
    dq: usize,
    rows: usize,
    d: usize,
    col: usize,
    out: &mut [u32],
) {
    for t in 0..rows {
        let row = &q[t * dq..t * dq + d];
        for (e, pair) in row.chunks_exact(2).enumerate() {
            let (c, i) = (e / (TILE_D / 2), e % (TILE_D / 2));
            out[c * TILE_WORDS + i * TILE_ROWS + col + t] = pair[0] as u32 | (pair[1] as u32) << 16;
        }
    }
}

/// Loads the `chunks` packed query tiles at `q` into tiles 2, 3, ...
///
/// # Safety
/// Configured; `chunks <= MAX_Q_TILES`; `q` holds `chunks` tiles of [`TILE_WORDS`].
#[inline(always)]
pub(in crate::cpu::decode) unsafe fn load_q<T: Tiles>(q: &[u32], chunks: usize) {
    let p = q.as_ptr().cast::<u8>();
    let at = |c: usize| p.wrapping_add(c * TILE_WORDS * 4);
    // SAFETY (each load): tile `c < chunks` of 1 KiB lies inside `q` (caller); configured.
    unsafe {
        macro_rules! load {
            ($c:literal, $t:literal) => {
                if $c < chunks {
                    T::load::<$t>(at($c), 64);
                }
            };
        }
        T::load::<2>(at(0), 64);
        load!(1, 3);
        load!(2, 4);
        load!(3, 5);
        load!(4, 6);
        load!(5, 7);
    }
}

/// `s[t][c] = q[t] · K[c]` for the query rows in columns `col .. col + rows` (at most 16) of
/// the loaded tiles (tiles 2.., [`load_q`]) and the 16 keys whose rows start at `k`, `stride`
/// bytes apart, `chunks · 32` bf16 each; `st` receives the transposed scores on the way (the
/// other columns' products, of other KV heads' rows, are computed and dropped: a tile costs
/// the same whatever its columns hold). Prefetches `pf` between the steps.
///
/// # Safety
/// Configured, the query tiles of these rows loaded; avx512f; `1 <= chunks <= MAX_Q_TILES`;
/// `col + rows <= 16`; the 16 rows of `chunks · 64` bytes at `k`, `stride` apart, are
/// readable; `s` holds `rows` rows.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(in crate::cpu::decode) unsafe fn scores<T: Tiles>(
    chunks: usize,
    k: *const u8,
    stride: usize,
    col: usize,
    rows: usize,
    st: &mut [[f32; BK]; BK],
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    let per = pf.rows().div_ceil(chunks);
    // SAFETY: the caller's: configured, tiles 2 .. 2 + chunks loaded, the K rows readable.
    unsafe {
        T::zero::<0>();
        macro_rules! step {
            ($c:literal, $t:literal) => {
                if $c < chunks {
                    T::load::<1>(k.wrapping_add($c * 64), stride);
                    T::dp::<0, 1, $t>();
                    pf.fetch(per);
                }
            };
        }
        step!(0, 2);
        step!(1, 3);
        step!(2, 4);
        step!(3, 5);
        step!(4, 6);
        step!(5, 7);
        T::store::<0>(st.as_mut_ptr().cast(), 64);
    }
    pf.fetch_all();
    // Row c of `st` is key c's scores over the query rows; transpose to rows of keys.
    let r: [__m512i; 16] = std::array::from_fn(|c| {
        // SAFETY: a row of `st` holds 16 floats.
        unsafe { _mm512_loadu_si512(st[c].as_ptr().cast()) }
    });
    let t = transpose16(&r);
    for (s, t) in s[..rows].iter_mut().zip(&t[col..]) {
        // SAFETY: a score row holds 16 floats.
        unsafe { _mm512_storeu_si512(s.as_mut_ptr().cast(), *t) };
    }
}

/// `O += P V` for one chunk of up to 16 query rows and a whole block of 16 keys, `O` held
/// pair-split: in each 32 head-dim elements of a row, the 16 even elements, then the 16 odd
/// ones. The V rows are loaded as they lie in the cache, 32 elements (64 bytes) of the 16 keys
/// per tile, so that tile row `c` holds the pairs `(V[c][2n], V[c][2n + 1])` of its 16 columns
/// `n`. `P` enters twice, as `pe` (each probability, rounded to bf16, in the low half of a pair,
/// 0 in the high half) and `po` (in the high half): `C += pe · V` then sums `p V[c][2n]`, the even
/// elements, and `C += po · V` the odd ones (the other half of each pair times 0). No V byte
/// is moved, and the two products cost what one packed product per 16 elements would.
///
/// Tiles: `pe` in 6, `po` in 7; two 32-element steps at a time, their V rows in 0 and 1 and
/// their four `C` tiles (`O` loaded, accumulated, stored back) in 2 to 5. The query tiles of
/// [`load_q`] are overwritten.
///
/// # Safety
/// Configured; `1 <= chunks`; `pe` and `po` are tiles (16 rows of 64 bytes); `o` holds 16 rows
/// of `chunks · 128` bytes, `o_stride` bytes apart; the 16 rows of `chunks · 64` bytes at `v`,
/// `v_stride` apart, are readable.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu::decode) unsafe fn pv<T: Tiles>(
    chunks: usize,
    o: *mut u8,
    o_stride: usize,
    pe: *const u8,
    po: *const u8,
    v: *const u8,
    v_stride: usize,
    pf: &mut Pf,
) {
    let per = pf.rows().div_ceil(chunks.div_ceil(2));
    // The even and odd halves of step c of a row of `O`.
    let at = |c: usize, half: usize| o.wrapping_add(c * 128 + half * 64);
    // SAFETY (every tile access): configured; steps c < chunks of the V rows and of the `O`
    // rows lie inside them (caller).
    unsafe {
        T::load::<6>(pe, 64);
        T::load::<7>(po, 64);
        let mut c = 0;
        while c < chunks {
            let two = c + 1 < chunks;
            T::load::<0>(v.wrapping_add(c * 64), v_stride);
            T::load::<2>(at(c, 0), o_stride);
            T::load::<3>(at(c, 1), o_stride);
            if two {
                T::load::<1>(v.wrapping_add((c + 1) * 64), v_stride);
                T::load::<4>(at(c + 1, 0), o_stride);
                T::load::<5>(at(c + 1, 1), o_stride);
            }
            T::dp::<2, 6, 0>();
            T::dp::<3, 7, 0>();
            if two {
                T::dp::<4, 6, 1>();
                T::dp::<5, 7, 1>();
            }
            pf.fetch(per);
            T::store::<2>(at(c, 0), o_stride);
            T::store::<3>(at(c, 1), o_stride);
            if two {
                T::store::<4>(at(c + 1, 0), o_stride);
                T::store::<5>(at(c + 1, 1), o_stride);
            }
            c += 2;
        }
    }
    pf.fetch_all();
}
