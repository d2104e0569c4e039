//! What the op computes, defined once.
//!
//! Every path (the tiled CPU kernel, the CUDA launch code and the materialising
//! [`naive_attention`](crate::naive_attention)) takes its masking, causal alignment, ALiBi,
//! softcap and GQA mapping from here, so the paths cannot drift apart.
//!
//! For a query row `i` of a sequence pair with `seq_q` queries and `seq_k` keys, the
//! *diagonal* is `diag(i) = i + seq_k - seq_q` (bottom-right alignment: the last query sees the
//! last key). Then:
//!
//! * key `j` is visible iff `diag(i) - left <= j <= diag(i) + right` (`None` = unbounded);
//!   causal is `(None, Some(0))`;
//! * `s = scale * q·k`; with a softcap `c > 0`: `s = c * tanh(s / c)`; with ALiBi:
//!   `s -= slope[h] * |diag(i) - j|`;
//! * a row that sees no key outputs exactly 0 and its log-sum-exp is `-inf`;
//! * with attention sinks, the softmax of a row of head `h` has one more logit `sink[h]` that
//!   carries no value (a merge with a side without values, [`merge_weights`]): the row's lse becomes `L = log(exp(lse) + exp(sink))`
//!   and its output is scaled by `exp(lse - L)`; a row that sees no key still outputs 0, with
//!   lse `sink[h]`.
//!
//! Multimodal prefix ranges (upstream's `mm_prefix_ranges`, per sequence): inside each range
//! `[start, end)` of absolute positions, queries and keys see each other whatever the window
//! says: key `j` is also visible to row `i` when `start <= j < end` and
//! `start <= diag(i) < end` for one range with `start < end` (ranges with `start >= end` are
//! ignored). [`SeqMask`] applies both rules; with no range it is exactly the window.

/// `log2(e)`: kernels work in base 2 (`exp2`), with scores pre-multiplied by this.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// The band of keys each query row may see, relative to the bottom-right diagonal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    /// How many keys left of the diagonal are visible (`None`: all of them).
    pub left: Option<usize>,
    /// How many keys right of the diagonal are visible (`None`: all of them).
    pub right: Option<usize>,
}

impl Window {
    /// Every key visible.
    pub const FULL: Window = Window {
        left: None,
        right: None,
    };
    /// Bottom-right aligned causal mask.
    pub const CAUSAL: Window = Window {
        left: None,
        right: Some(0),
    };

    pub fn new(left: Option<usize>, right: Option<usize>) -> Self {
        Self { left, right }
    }

    /// `true` when the window is exactly the causal mask.
    pub fn is_causal(&self) -> bool {
        *self == Self::CAUSAL
    }

    /// `true` when no key is ever masked.
    pub fn is_full(&self) -> bool {
        *self == Self::FULL
    }

    /// Half-open range `[lo, hi)` of the keys query row `i` sees; empty ranges come back as
    /// `lo == hi`. Ranges are monotone in `i` (both ends never decrease), which is what lets the
    /// kernels skip whole key tiles by loop bounds.
    pub fn key_range(&self, i: usize, seq_q: usize, seq_k: usize) -> (usize, usize) {
        let diag = diagonal(i, seq_q, seq_k);
        let sk = seq_k as i64;
        let lo = match self.left {
            Some(l) => diag.saturating_sub(to_i64(l)).clamp(0, sk),
            None => 0,
        };
        let hi = match self.right {
            Some(r) => diag
                .saturating_add(to_i64(r))
                .saturating_add(1)
                .clamp(0, sk),
            None => sk,
        };
        (lo as usize, (hi.max(lo)) as usize)
    }

    /// Key range seen by any row of `rows` (the union of the per-row ranges).
    pub fn key_range_rows(
        &self,
        rows: std::ops::Range<usize>,
        seq_q: usize,
        seq_k: usize,
    ) -> (usize, usize) {
        if rows.is_empty() {
            return (0, 0);
        }
        let (lo, _) = self.key_range(rows.start, seq_q, seq_k);
        let (_, hi) = self.key_range(rows.end - 1, seq_q, seq_k);
        (lo, hi.max(lo))
    }

    /// `true` when every key in `keys` is visible to every row in `rows`: such a tile needs no
    /// per-element mask.
    pub fn covers(
        &self,
        rows: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
        seq_q: usize,
        seq_k: usize,
    ) -> bool {
        if rows.is_empty() || keys.is_empty() {
            return true;
        }
        // The lower bound grows with i (worst at the last row), the upper bound too (worst at the
        // first row).
        let (lo_last, _) = self.key_range(rows.end - 1, seq_q, seq_k);
        let (_, hi_first) = self.key_range(rows.start, seq_q, seq_k);
        lo_last <= keys.start && keys.end <= hi_first
    }

    /// Window bounds as signed offsets from the diagonal for kernels: `-1` means unbounded.
    /// Sizes are capped at [`WINDOW_CAP`] (no sequence is that long, so the cap changes no
    /// mask), which keeps `diag ± size` far from overflow in kernel arithmetic.
    pub fn as_i64(&self) -> (i64, i64) {
        let f = |w: Option<usize>| w.map_or(-1, |w| to_i64(w).min(WINDOW_CAP));
        (f(self.left), f(self.right))
    }
}

/// The mask of one sequence pair: its window plus its multimodal prefix ranges (module docs).
///
/// One row still sees one interval of keys, [`row_range`](Self::row_range): every range that
/// applies to row `i` holds `diag(i)`, and so does the window when `0 <= diag(i) < seq_k`, so
/// their union is an interval; when `diag(i) < 0` all of them that reach a key start at key 0.
/// What changes is that the ranges are no longer monotone in `i`, so
/// [`key_range_rows`](Self::key_range_rows) and [`covers`](Self::covers) take the ranges into
/// account instead of looking at the first and last row only.
#[derive(Clone, Copy, Debug)]
pub struct SeqMask<'a> {
    pub window: Window,
    /// `[start, end)` ranges of absolute positions; ranges with `start >= end` are ignored.
    pub prefix: &'a [[i64; 2]],
    pub seq_q: usize,
    pub seq_k: usize,
}

impl<'a> SeqMask<'a> {
    /// The mask of a pair with no prefix ranges: the window alone.
    pub fn window(window: Window, seq_q: usize, seq_k: usize) -> Self {
        Self {
            window,
            prefix: &[],
            seq_q,
            seq_k,
        }
    }

    /// The ranges that count (`start < end`).
    #[inline(always)]
    fn ranges(&self) -> impl Iterator<Item = (i64, i64)> + 'a {
        self.prefix
            .iter()
            .filter(|r| r[0] < r[1])
            .map(|r| (r[0], r[1]))
    }

    /// `true` when some prefix range applies (the mask may then not be a band).
    #[inline(always)]
    pub fn has_prefix(&self) -> bool {
        self.ranges().next().is_some()
    }

    /// Whether query row `i` sees key `j`.
    #[inline(always)]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let (lo, hi) = self.window.key_range(i, self.seq_q, self.seq_k);
        if lo <= j && j < hi {
            return true;
        }
        let (diag, j) = (diagonal(i, self.seq_q, self.seq_k), j as i64);
        self.ranges()
            .any(|(s, e)| s <= j && j < e && s <= diag && diag < e)
    }

    /// The keys `[lo, hi)` row `i` sees (`lo == hi`: none); exactly those `j` for which
    /// [`visible`](Self::visible) holds (see the type's docs).
    #[inline]
    pub fn row_range(&self, i: usize) -> (usize, usize) {
        if self.prefix.is_empty() {
            self.window.key_range(i, self.seq_q, self.seq_k)
        } else {
            self.key_range_rows(i..i + 1)
        }
    }

    /// Smallest interval `[lo, hi)` holding every key any row of `rows` sees.
    pub fn key_range_rows(&self, rows: std::ops::Range<usize>) -> (usize, usize) {
        let (sq, sk) = (self.seq_q, self.seq_k);
        let (mut lo, mut hi) = self.window.key_range_rows(rows.clone(), sq, sk);
        if rows.is_empty() {
            return (lo, hi);
        }
        let (d0, d1) = (diagonal(rows.start, sq, sk), diagonal(rows.end - 1, sq, sk));
        for (s, e) in self.ranges() {
            // A range counts for these rows when one of their diagonals lies inside it.
            if s.max(d0) > (e - 1).min(d1) {
                continue;
            }
            let (a, b) = (
                s.clamp(0, sk as i64) as usize,
                e.clamp(0, sk as i64) as usize,
            );
            if a >= b {
                continue;
            }
            if lo >= hi {
                (lo, hi) = (a, b);
            } else {
                (lo, hi) = (lo.min(a), hi.max(b));
            }
        }
        (lo, hi.max(lo))
    }

    /// `true` when every key in `keys` is visible to every row in `rows` (no per-element mask
    /// needed): the window covers the tile, or one prefix range holds all its rows' diagonals
    /// and all its keys.
    pub fn covers(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> bool {
        if self
            .window
            .covers(rows.clone(), keys.clone(), self.seq_q, self.seq_k)
        {
            return true;
        }
        let (d0, d1) = (
            diagonal(rows.start, self.seq_q, self.seq_k),
            diagonal(rows.end - 1, self.seq_q, self.seq_k),
        );
        let (k0, k1) = (keys.start as i64, keys.end as i64 - 1);
        self.ranges()
            .any(|(s, e)| s <= d0.min(k0) && d1.max(k1) < e)
    }
}

/// Largest window size handed to kernels; any window at least this wide sees every key.
pub const WINDOW_CAP: i64 = 1 << 40;

/// Window sizes beyond `i64::MAX` (e.g. `usize::MAX`) mean "everything", never a negative size.
#[inline(always)]
fn to_i64(w: usize) -> i64 {
    i64::try_from(w).unwrap_or(i64::MAX)
}

/// The diagonal of query row `i`: the key it is aligned with (bottom-right alignment).
#[inline(always)]
pub fn diagonal(i: usize, seq_q: usize, seq_k: usize) -> i64 {
    i as i64 + seq_k as i64 - seq_q as i64
}

/// The query heads sharing one K/V head (GQA/MQA); `heads % kv_heads == 0` is validated first.
#[inline(always)]
pub fn group_size(heads: usize, kv_heads: usize) -> usize {
    heads / kv_heads
}

/// The K/V head read by query head `h`: consecutive query heads share a K/V head.
#[inline(always)]
pub fn kv_head(h: usize, heads: usize, kv_heads: usize) -> usize {
    h / group_size(heads, kv_heads)
}

/// Score modifiers applied between `q·k` and the mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreMod {
    /// Multiplies `q·k`.
    pub scale: f32,
    /// `c > 0` caps scores smoothly to `(-c, c)`; `0` disables it.
    pub softcap: f32,
}

impl ScoreMod {
    /// The score of a visible (query `i`, key `j`) pair from its raw dot product `q·k`.
    /// `slope` is the ALiBi slope of the head (0 without ALiBi).
    #[inline(always)]
    pub fn score(
        &self,
        dot: f32,
        slope: f32,
        i: usize,
        j: usize,
        seq_q: usize,
        seq_k: usize,
    ) -> f32 {
        let s = self.cap(dot * self.scale);
        if slope == 0.0 {
            s
        } else {
            s - alibi_bias(slope, i, j, seq_q, seq_k)
        }
    }

    /// The softcap alone, on an already scaled score.
    #[inline(always)]
    pub fn cap(&self, s: f32) -> f32 {
        if self.softcap > 0.0 {
            self.softcap * (s / self.softcap).tanh()
        } else {
            s
        }
    }
}

/// The ALiBi penalty `slope * |diag(i) - j|` (subtracted from the score).
#[inline(always)]
pub fn alibi_bias(slope: f32, i: usize, j: usize, seq_q: usize, seq_k: usize) -> f32 {
    slope * (diagonal(i, seq_q, seq_k) - j as i64).unsigned_abs() as f32
}

/// The weights of a merge of two partial attentions over disjoint key sets (FlashInfer's
/// `merge_state`): from the log-sum-exps `lse_a`, `lse_b` of the two sides, the merged
/// log-sum-exp `L = log(e^lse_a + e^lse_b)` and the weights `w_a = e^(lse_a - L)`,
/// `w_b = e^(lse_b - L)` with which `o = w_a · o_a + w_b · o_b` ([`MergeWeights::value`]).
///
/// * A side with `lse = -inf` saw no key: its weight is exactly 0 and the other side's exactly
///   1; a side of weight 0 is not read (whatever it holds, zeros or not, never reaches `o`).
/// * Both `-inf`: weights 0 and 0, `L = -inf`, `o = 0`.
/// * A NaN on either side gives NaN weights and a NaN `L` (the row is poisoned, not hidden).
///
/// An attention sink is side b with no values: `L = logaddexp(lse, sink)` and `o' = w_a · o`.
/// Every merge (the CPU loop, the CUDA kernel in `kernels/merge.cu`, the ring) computes this.
#[inline(always)]
pub fn merge_weights(lse_a: f32, lse_b: f32) -> MergeWeights {
    if lse_a.is_nan() || lse_b.is_nan() {
        return MergeWeights {
            a: f32::NAN,
            b: f32::NAN,
            lse: f32::NAN,
        };
    }
    let m = lse_a.max(lse_b);
    if m == f32::NEG_INFINITY {
        return MergeWeights {
            a: 0.0,
            b: 0.0,
            lse: f32::NEG_INFINITY,
        };
    }
    // One side may be -inf here: its exponential is exactly 0 and the other's exactly 1.
    let (ea, eb) = ((lse_a - m).exp(), (lse_b - m).exp());
    let sum = ea + eb;
    MergeWeights {
        a: ea / sum,
        b: eb / sum,
        lse: m + sum.ln(),
    }
}

/// The result of [`merge_weights`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MergeWeights {
    /// Weight of side a's output.
    pub a: f32,
    /// Weight of side b's output.
    pub b: f32,
    /// The merged log-sum-exp.
    pub lse: f32,
}

impl MergeWeights {
    /// One merged output element from the two sides' elements: `a · o_a + b · o_b`, where a
    /// side of weight exactly 0 (no key there, or one far below the other) is not read.
    #[inline(always)]
    pub fn value(&self, o_a: f32, o_b: f32) -> f32 {
        let side = |w: f32, o: f32| if w == 0.0 { 0.0 } else { w * o };
        side(self.a, o_a) + side(self.b, o_b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_is_bottom_right() {
        // seq_q = 2, seq_k = 5: row 0 sees keys 0..=3, row 1 sees 0..=4.
        assert_eq!(Window::CAUSAL.key_range(0, 2, 5), (0, 4));
        assert_eq!(Window::CAUSAL.key_range(1, 2, 5), (0, 5));
        // seq_q > seq_k: leading rows see nothing.
        assert_eq!(Window::CAUSAL.key_range(0, 5, 2), (0, 0));
        assert_eq!(Window::CAUSAL.key_range(2, 5, 2), (0, 0));
        assert_eq!(Window::CAUSAL.key_range(3, 5, 2), (0, 1));
    }

    #[test]
    fn windows_clamp() {
        let w = Window::new(Some(1), Some(1));
        assert_eq!(w.key_range(0, 4, 4), (0, 2));
        assert_eq!(w.key_range(3, 4, 4), (2, 4));
        let huge = Window::new(Some(usize::MAX), Some(usize::MAX));
        assert_eq!(huge.key_range(0, 3, 7), (0, 7));
        assert_eq!(huge.as_i64(), (WINDOW_CAP, WINDOW_CAP));
        assert!(huge.covers(0..3, 0..7, 3, 7));
        assert!(!Window::CAUSAL.covers(0..2, 0..4, 4, 4));
        assert!(Window::CAUSAL.covers(2..4, 0..3, 4, 4));
    }

    #[test]
    fn prefix_ranges_open_the_mask() {
        // Causal, 6 queries over 6 keys; a prefix range [1, 4) (and an ignored empty one).
        let ranges = [[1, 4], [5, 5]];
        let m = SeqMask {
            window: Window::CAUSAL,
            prefix: &ranges,
            seq_q: 6,
            seq_k: 6,
        };
        assert_eq!(m.prefix.len(), 2);
        assert!(m.has_prefix());
        // Row 1 sees keys 0..=1 causally, and 1..4 through the range.
        assert!(m.visible(1, 3) && m.visible(1, 0) && !m.visible(1, 4));
        assert_eq!(m.row_range(1), (0, 4));
        // Row 0 lies outside the range: causal only.
        assert!(!m.visible(0, 1));
        assert_eq!(m.row_range(0), (0, 1));
        // Sliding window of 0 keys left: row 3 sees 1..=3 through the range, not key 0.
        let w = SeqMask {
            window: Window::new(Some(0), Some(0)),
            ..m
        };
        assert_eq!(w.row_range(3), (1, 4));
        assert!(!w.visible(3, 0) && w.visible(3, 1));
        assert_eq!(w.key_range_rows(0..6), (0, 6));
        assert!(w.covers(1..4, 1..4) && !w.covers(0..4, 1..4) && !w.covers(1..4, 1..5));
        // No range: exactly the window.
        let plain = SeqMask::window(Window::CAUSAL, 6, 6);
        assert!(!plain.has_prefix());
        assert_eq!(plain.row_range(2), Window::CAUSAL.key_range(2, 6, 6));
        // A range no diagonal reaches changes nothing.
        let far = [[-5i64, 0]];
        let f = SeqMask {
            prefix: &far,
            ..plain
        };
        assert_eq!(f.key_range_rows(0..6), (0, 6));
        assert!(!f.visible(0, 1));
    }

    /// `row_range` is exactly the visible set and `key_range_rows`/`covers` are sound, for
    /// every small shape, window and pair of ranges.
    #[test]
    fn prefix_row_ranges_are_exact() {
        let sizes = [None, Some(0), Some(1), Some(3)];
        let bounds = [-3i64, -1, 0, 1, 2, 4, 6, 9];
        for (sq, sk) in [(1, 1), (3, 6), (6, 6), (7, 3), (5, 9)] {
            for left in sizes {
                for right in sizes {
                    for &a in &bounds {
                        for &b in &bounds {
                            for &c in &[-1i64, 2, 5] {
                                let ranges = [[a, b], [c, c + 3]];
                                let m = SeqMask {
                                    window: Window::new(left, right),
                                    prefix: &ranges,
                                    seq_q: sq,
                                    seq_k: sk,
                                };
                                check_exact(&m);
                            }
                        }
                    }
                }
            }
        }
    }

    fn check_exact(m: &SeqMask) {
        let (sq, sk) = (m.seq_q, m.seq_k);
        for i in 0..sq {
            let (lo, hi) = m.row_range(i);
            for j in 0..sk {
                assert_eq!(m.visible(i, j), lo <= j && j < hi, "{m:?} row {i} key {j}");
            }
        }
        for r0 in 0..sq {
            for r1 in r0 + 1..=sq {
                let (lo, hi) = m.key_range_rows(r0..r1);
                for i in r0..r1 {
                    for j in 0..sk {
                        assert!(
                            !m.visible(i, j) || (lo <= j && j < hi),
                            "{m:?} rows {r0}..{r1}"
                        );
                    }
                }
                for k0 in 0..sk {
                    for k1 in k0 + 1..=sk {
                        if m.covers(r0..r1, k0..k1) {
                            assert!((r0..r1).all(|i| (k0..k1).all(|j| m.visible(i, j))));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn merge_weights_edges() {
        let inf = f32::INFINITY;
        let w = merge_weights(-inf, 1.5);
        assert_eq!((w.a, w.b, w.lse), (0.0, 1.0, 1.5));
        let w = merge_weights(0.25, -inf);
        assert_eq!((w.a, w.b, w.lse), (1.0, 0.0, 0.25));
        let w = merge_weights(-inf, -inf);
        assert_eq!((w.a, w.b, w.lse), (0.0, 0.0, -inf));
        assert!(merge_weights(f32::NAN, 1.0).lse.is_nan());
        let w = merge_weights(0.0, 0.0);
        assert_eq!((w.a, w.b), (0.5, 0.5));
        assert!((w.lse - 2f32.ln()).abs() < 1e-7);
        // Far apart: no overflow, the smaller side vanishes smoothly.
        let w = merge_weights(80.0, -80.0);
        assert!(w.lse == 80.0 && w.a == 1.0 && w.b < 1e-30);
    }

    #[test]
    fn gqa_mapping_is_consecutive() {
        let map: Vec<_> = (0..6).map(|h| kv_head(h, 6, 2)).collect();
        assert_eq!(map, [0, 0, 0, 1, 1, 1]);
    }
}
