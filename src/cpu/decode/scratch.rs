//! The per-thread buffers of the decode partial pass.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use super::prefetch::Pf;
use super::BK;

thread_local! {
    /// Each thread's decode scratch; it only grows, and is separate from the prefill scratch so
    /// alternating prefill and decode calls rebuild neither.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
}

pub(super) fn with_scratch(f: impl FnOnce(&mut Scratch)) {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        // Only if an item ever ran inside another on this thread; stay correct regardless.
        Err(_) => f(&mut Scratch::new()),
    })
}

/// Per-thread buffers of the partial pass.
pub(super) struct Scratch {
    /// Query rows (as f32, and as bf16 bits for `vdpbf16ps`), `O`, `m`, `l` of every row of a
    /// sequence, rows ordered `(kv head, query i, head within the group)`.
    pub(super) q: Vec<f32>,
    pub(super) qh: Vec<u16>,
    /// The query rows of each KV head as the kernels read them, where they pack them.
    pub(super) qp: Vec<f32>,
    /// Cache-line aligned, so that the tile rows of `O` (`x86::tile_pv`) never straddle two
    /// lines (a tile load or store of straddling rows takes about three times as long).
    pub(super) o: Aligned<f32>,
    pub(super) m: Vec<f32>,
    pub(super) l: Vec<f32>,
    /// Per query index: the keys it sees; then the part of the current block it sees; the
    /// latter per row.
    pub(super) range: Vec<(usize, usize)>,
    pub(super) cols: Vec<(usize, usize)>,
    pub(super) rcols: Vec<(usize, usize)>,
    /// Scores, then probabilities, and corrections of every row against one block.
    pub(super) s: Vec<[f32; BK]>,
    pub(super) corr: Vec<f32>,
    /// K and V blocks converted to f32 (`BK × kv_heads × d`), when the kernels cannot read
    /// them in place.
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// The query rows in the tile unit's layout, where `q·k` runs on tiles.
    pub(super) tq: TileQ,
    /// Per KV head: the prefetches its `P V` issues.
    pub(super) pf: Vec<Pf>,
}

/// The query rows of an item packed for the tile unit, and which of them its registers hold.
pub(super) struct TileQ {
    /// Sets of `B` tiles, one tile per 32 head-dim elements, each set holding the rows of
    /// [`heads`](Self::heads) KV heads side by side (16 columns), or one chunk of 16 rows of a
    /// KV head with more.
    pub(super) q: Aligned<u32>,
    /// Chunks of 16 rows per KV head (1 where its rows fit one tile), KV heads per set, and
    /// tiles per set.
    pub(super) row_chunks: usize,
    pub(super) heads: usize,
    pub(super) tiles: usize,
    /// The set whose tiles are loaded.
    pub(super) loaded: Option<usize>,
    /// A block's transposed scores (keys × query rows), as the tile unit stores them.
    pub(super) st: Tile<f32>,
    /// The probabilities of up to 16 rows as the two `A` tiles of the pair-split `P V`.
    pub(super) pe: Tile<u32>,
    pub(super) po: Tile<u32>,
}

/// One tile in memory: 16 rows of 64 bytes, cache-line aligned.
#[repr(C, align(64))]
pub(super) struct Tile<T>(pub(super) [[T; BK]; BK]);

/// 64 bytes, cache-line aligned: the unit of [`Aligned`].
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// The element types of [`Aligned`]: 4-byte numbers, valid for any bit pattern (zero included).
pub(super) trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u32 {}

/// A growable buffer of `T` whose first element starts a cache line.
pub(super) struct Aligned<T> {
    lines: Vec<Line>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Plain> Aligned<T> {
    const fn new() -> Self {
        Self {
            lines: Vec::new(),
            len: 0,
            _t: std::marker::PhantomData,
        }
    }

    /// Grows to `n` elements, the new ones `x`; never shrinks.
    pub(super) fn resize(&mut self, n: usize, x: T) {
        if n <= self.len {
            return;
        }
        let lines = (n * std::mem::size_of::<T>()).div_ceil(64);
        self.lines.resize(lines, Line([0; 64]));
        let old = self.len;
        self.len = n;
        self[old..].fill(x);
    }
}

impl<T: Plain> Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len` elements of `T` (`resize`), which is valid for
        // any bytes (`Plain`) and needs at most the lines' alignment.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl<T: Plain> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, through the unique borrow.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

impl TileQ {
    /// Where the rows of KV head `kvh`, row chunk `rc`, lie: their set, first column and count,
    /// for `rows` rows per KV head.
    pub(super) fn slot(&self, kvh: usize, rc: usize, rows: usize) -> (usize, usize, usize) {
        /// Columns of a tile.
        const COLS: usize = 16;
        if self.row_chunks == 1 {
            (kvh / self.heads, kvh % self.heads * rows, rows)
        } else {
            let n = (rows - rc * COLS).min(COLS);
            (kvh * self.row_chunks + rc, 0, n)
        }
    }
}

impl Scratch {
    pub(super) const fn new() -> Self {
        Self {
            q: Vec::new(),
            qh: Vec::new(),
            qp: Vec::new(),
            o: Aligned::new(),
            m: Vec::new(),
            l: Vec::new(),
            range: Vec::new(),
            cols: Vec::new(),
            rcols: Vec::new(),
            s: Vec::new(),
            corr: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            tq: TileQ {
                q: Aligned::new(),
                row_chunks: 0,
                heads: 0,
                tiles: 0,
                loaded: None,
                st: Tile([[0.0; BK]; BK]),
                pe: Tile([[0; BK]; BK]),
                po: Tile([[0; BK]; BK]),
            },
            pf: Vec::new(),
        }
    }

    /// Room for `rows` query rows of `d` (`packed` elements packed), `o_rows` rows of `O`
    /// (`rows`, or more where each KV head's are padded to whole tiles), `sq` query indices and
    /// blocks of `block` elements.
    pub(super) fn reserve(
        &mut self,
        rows: usize,
        o_rows: usize,
        packed: usize,
        sq: usize,
        block: usize,
        d: usize,
    ) {
        fn grow<X: Copy>(v: &mut Vec<X>, n: usize, x: X) {
            if v.len() < n {
                v.resize(n, x);
            }
        }
        grow(&mut self.q, rows * d, 0.0);
        grow(&mut self.qh, rows * d.next_multiple_of(2), 0);
        grow(&mut self.qp, packed, 0.0);
        self.o.resize(o_rows * d, 0.0);
        grow(&mut self.m, rows, 0.0);
        grow(&mut self.l, rows, 0.0);
        grow(&mut self.range, sq, (0, 0));
        grow(&mut self.cols, sq, (0, 0));
        grow(&mut self.rcols, rows, (0, 0));
        grow(&mut self.s, rows, [0.0; BK]);
        grow(&mut self.corr, rows, 0.0);
        grow(&mut self.k, block, 0.0);
        grow(&mut self.v, block, 0.0);
    }
}
