//! Prefetching the K and V rows a few blocks ahead of the decode kernels: the requests of a
//! step (one block, one KV head) in address order, issued a few cache lines at a time between
//! the kernels' own loads.

use super::BK;
use crate::problem::{KeyRows, Problem, Strides};

/// What the prefetches ahead of a block read: the caches as stored, and where the item ends.
pub(super) struct Ahead<'a, T> {
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) keys: KeyRows<'a>,
    /// The item's end.
    pub(super) hi: usize,
    /// How many `(block, KV head)` steps ahead.
    pub(super) steps: usize,
}

impl<T> Ahead<'_, T> {
    /// The step `self.steps` after block `j0`, KV head 0: its first key and KV head.
    #[inline(always)]
    pub(super) fn first(&self, j0: usize, heads: usize) -> (usize, usize) {
        (j0 + self.steps / heads * BK, self.steps % heads)
    }

    /// The K and V rows of the step at block `jb`, KV head `h`, to prefetch; then moves
    /// `(jb, h)` on by one step.
    #[inline(always)]
    pub(super) fn rows(&self, p: &Problem, at: &mut (usize, usize)) -> Pf {
        let (jb, h) = *at;
        *at = if h + 1 == p.kv_heads {
            (jb + BK, 0)
        } else {
            (jb, h + 1)
        };
        let mut pf = Pf::NONE;
        if self.steps == 0 || p.k.dim != 1 || p.v.dim != 1 {
            return pf;
        }
        let (a, e) = (jb.min(self.hi), (jb + BK).min(self.hi));
        let (kb, vb) = (self.k.as_ptr().cast::<u8>(), self.v.as_ptr().cast::<u8>());
        let size = std::mem::size_of::<T>();
        // Where every KV head of a key lies in one run of rows (the usual `(batch, keys, kv
        // heads, d)` cache) and the block's keys are consecutive rows, the block's K (and V)
        // rows of all heads are one range of memory: step `h` asks for the `h`-th part of that
        // range, so the requests go out in address order. (Asking for the rows of head `h`
        // instead touches every page of the range once per head, `kv_heads · d` elements
        // apart; on the 2-core Zen 3 VM the 32/8-head caches streamed at 39-53% of the read
        // bandwidth that way and at 72-76% in address order.)
        let whole = |st: &Strides| st.head == p.head_dim && st.seq == p.kv_heads * p.head_dim;
        let n = e - a;
        let row_bytes = p.head_dim * size;
        if n > 0 && whole(&p.k) && whole(&p.v) && self.keys.run(a, n) == n {
            let (b, r) = self.keys.at(a);
            let k0 = kb.wrapping_add((p.k.at(b, r, 0) + h * n * p.head_dim) * size);
            let v0 = vb.wrapping_add((p.v.at(b, r, 0) + h * n * p.head_dim) * size);
            for i in 0..n {
                pf.rows[pf.n] = k0.wrapping_add(i * row_bytes);
                pf.rows[pf.n + 1] = v0.wrapping_add(i * row_bytes);
                pf.n += 2;
            }
            pf.bytes = row_bytes;
            return pf;
        }
        for j in a..e {
            let (b, r) = self.keys.at(j);
            pf.rows[pf.n] = kb.wrapping_add(p.k.at(b, r, h) * size);
            pf.rows[pf.n + 1] = vb.wrapping_add(p.v.at(b, r, h) * size);
            pf.n += 2;
        }
        pf.bytes = p.head_dim * size;
        pf
    }
}

/// K and V rows to prefetch while a kernel runs, a few cache lines between its own loads, so
/// that the requests reach memory at an even pace rather than in bursts that stall the core.
#[derive(Clone, Copy)]
pub(super) struct Pf {
    rows: [*const u8; 2 * BK],
    n: usize,
    bytes: usize,
    /// The next row.
    next: usize,
}

impl Pf {
    pub(super) const NONE: Pf = Pf {
        rows: [std::ptr::null(); 2 * BK],
        n: 0,
        bytes: 0,
        next: 0,
    };

    /// Rows to prefetch.
    #[inline(always)]
    pub(super) fn rows(&self) -> usize {
        self.n
    }

    /// Prefetches the next `count` rows into L2, every cache line of each.
    #[inline(always)]
    pub(super) fn fetch(&mut self, count: usize) {
        let end = (self.next + count).min(self.n);
        for &row in &self.rows[self.next..end] {
            let mut off = 0;
            while off < self.bytes {
                prefetch_line(row.wrapping_add(off));
                off += 64;
            }
        }
        self.next = end;
    }

    /// Splits off the second half of the rows left, for a later kernel to prefetch: the
    /// requests of a step then spread over both of its products rather than crowd into the
    /// first (a core has few line-fill buffers; a burst of prefetches stalls it while the
    /// other product would leave them idle).
    #[inline(always)]
    pub(super) fn split(&mut self) -> Pf {
        let mid = self.next + (self.n - self.next) / 2;
        let mut later = *self;
        later.next = mid;
        self.n = mid;
        later
    }

    /// Prefetches every row left.
    #[inline(always)]
    pub(super) fn fetch_all(&mut self) {
        self.fetch(self.n);
    }
}

/// Asks the CPU to start loading the cache line at `p` into L2 (T1: the L1 is too small for
/// what is fetched ahead; T0 prefetches measured slower than none on the Zen 4 machine).
#[inline(always)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: a prefetch never faults and changes no program state, whatever the address;
        // the pointer is only computed (wrapping), never dereferenced.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
