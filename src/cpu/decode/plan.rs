//! The split plan of the partial pass: which keys of which sequence each task streams.
//!
//! Decode is a stream over the K/V cache, so the plan balances bytes: the keys every sequence's
//! rows see are laid end to end (sequence 0's, then sequence 1's, ...), and that line is cut into
//! `tasks` stretches of equal length, a multiple of the thread count, so every thread streams
//! about the same bytes whatever the batch, the lengths and the thread count. A stretch that
//! crosses sequences becomes one item per sequence; the items of one sequence are its splits,
//! merged by log-sum-exp afterwards (only where there are several).
//!
//! The plan depends only on the shape (lengths, heads, head dim, element size) and the thread
//! count, never on timing, so results are bitwise identical from run to run.

use super::BK;
use crate::problem::Problem;

/// A task streams at least this many bytes of K and V (~3 µs at ~10 GB/s per core, well above
/// the microsecond or so of starting it and merging its partials): small enough that a short
/// call still has tasks left when the second thread wakes, tens of microseconds late on a VM.
pub(super) const MIN_TASK_BYTES: usize = 32 << 10;
/// Tasks per thread when the cache is large: more than one, so that a thread slowed by another
/// process hands its last stretch to an idle one (work stealing), and no more: each task
/// starts its stream of rows cold (the first rows a memory latency away, the prefetches not yet
/// ahead) and leaves partials to merge, which cost a call of a few hundred KiB more than the
/// balance gained (bf16 8/1 heads b1 kv1000, 2 threads: 4 tasks per thread 48-49 us, 2 tasks
/// 40 us).
pub(super) const TASKS_PER_THREAD: usize = 2;

/// One work item: keys `lo .. hi` of sequence `b`, split `split` of its `splits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Item {
    pub b: usize,
    pub split: usize,
    pub lo: usize,
    pub hi: usize,
}

/// Per sequence: the keys its rows see and how they were split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SeqPlan {
    /// The union of the key ranges of the sequence's query rows (empty: no key is seen).
    pub keys: (usize, usize),
    /// Items of this sequence (0 when it has no query row or sees no key).
    pub splits: usize,
    /// With several splits, the first row of its partials (`splits × heads × seq_q` rows,
    /// split-major, then head, then query row); unused otherwise.
    pub part_row: usize,
}

#[derive(Debug)]
pub(super) struct Plan {
    pub seqs: Vec<SeqPlan>,
    /// Items in task order; task `t` runs `items[tasks[t].clone()]`, in order.
    pub items: Vec<Item>,
    pub tasks: Vec<std::ops::Range<usize>>,
    /// Partial rows of all sequences with several splits.
    pub part_rows: usize,
}

/// How many tasks stream `total_bytes` on `threads` threads: one on one thread, else a
/// multiple of the thread count (equal bytes per thread), up to [`TASKS_PER_THREAD`] each, none
/// under `min_task` bytes ([`MIN_TASK_BYTES`] outside tests; fewer threads then, down to one
/// task).
pub(super) fn task_count(total_bytes: usize, threads: usize, min_task: usize) -> usize {
    let threads = threads.max(1);
    if threads == 1 {
        return 1;
    }
    let by_size = total_bytes / min_task.max(1);
    if by_size >= threads {
        threads * (by_size / threads).min(TASKS_PER_THREAD)
    } else {
        by_size.max(1)
    }
}

impl Plan {
    /// The plan of `p` on `threads` threads, `key_bytes` being the K and V bytes of one key
    /// (all KV heads), tasks of at least `min_task` bytes (see [`task_count`]).
    pub fn new(p: &Problem, threads: usize, key_bytes: usize, min_task: usize) -> Self {
        let keys = (0..p.batch).map(|b| {
            let seq = p.seq(b);
            let keys = p.mask(b, &seq).key_range_rows(0..seq.seq_q);
            if seq.seq_q == 0 {
                (keys.0, keys.0)
            } else {
                keys
            }
        });
        Self::from_keys(
            keys.collect(),
            p.heads,
            |b| p.seq(b).seq_q,
            threads,
            key_bytes,
            min_task,
        )
    }

    /// The plan for sequences seeing `keys[b]`, with `seq_q(b)` query rows of `heads` heads.
    pub fn from_keys(
        keys: Vec<(usize, usize)>,
        heads: usize,
        seq_q: impl Fn(usize) -> usize,
        threads: usize,
        key_bytes: usize,
        min_task: usize,
    ) -> Self {
        let len = |k: (usize, usize)| k.1 - k.0;
        let total: usize = keys.iter().map(|&k| len(k)).sum();
        let tasks = task_count(total.saturating_mul(key_bytes), threads, min_task);
        // Cut `t` of the key line, moved down to a multiple of BK keys from its sequence's first
        // key (fewer partial blocks), unless that would move it before the previous cut.
        let starts: Vec<usize> = keys
            .iter()
            .scan(0, |at, &k| {
                let s = *at;
                *at += len(k);
                Some(s)
            })
            .collect();
        let mut cuts = Vec::with_capacity(tasks + 1);
        for t in 0..=tasks {
            let x = (total as u128 * t as u128 / tasks as u128) as usize;
            // The sequence holding position x (the last one starting at or before it).
            let b = starts.partition_point(|&s| s <= x).saturating_sub(1);
            let x = match starts.get(b) {
                Some(&s) if t < tasks => {
                    (s + (x - s) / BK * BK).max(cuts.last().copied().unwrap_or(0))
                }
                _ => x,
            };
            cuts.push(x);
        }
        let mut seqs: Vec<SeqPlan> = keys
            .iter()
            .map(|&k| SeqPlan {
                keys: k,
                splits: 0,
                part_row: 0,
            })
            .collect();
        let mut items = Vec::new();
        let mut ranges = Vec::with_capacity(tasks);
        for w in cuts.windows(2) {
            let (x0, x1) = (w[0], w[1]);
            let first = items.len();
            // Sequences overlapping [x0, x1): from the one holding x0 on.
            let mut b = starts.partition_point(|&s| s <= x0).saturating_sub(1);
            while b < keys.len() && starts[b] < x1 {
                let (s, n) = (starts[b], len(keys[b]));
                let (a, e) = (x0.max(s), x1.min(s + n));
                if a < e {
                    let sp = &mut seqs[b];
                    items.push(Item {
                        b,
                        split: sp.splits,
                        lo: sp.keys.0 + (a - s),
                        hi: sp.keys.0 + (e - s),
                    });
                    sp.splits += 1;
                }
                b += 1;
            }
            if items.len() > first {
                ranges.push(first..items.len());
            }
        }
        let mut part_rows = 0;
        for (b, sp) in seqs.iter_mut().enumerate() {
            if sp.splits > 1 {
                sp.part_row = part_rows;
                part_rows += sp.splits * heads * seq_q(b);
            }
        }
        Plan {
            seqs,
            items,
            tasks: ranges,
            part_rows,
        }
    }
}
