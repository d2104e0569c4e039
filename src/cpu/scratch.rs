//! Per-thread scratch of the prefill kernel, kept across work items and calls.

use super::{Lanes, BC, QSUB};

thread_local! {
    /// Each thread's scratch, kept between work items and calls: with one item per rayon job,
    /// `for_each_init` would allocate and zero it for every item.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's scratch, (re)built only when the head dim changed. It always
/// holds `QSUB` sub-tiles, so calls of different sizes (a long prefill, then one-row decode steps
/// that use fewer sub-tiles per item) share it instead of rebuilding it on every switch.
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
        // Only if an item ever ran inside another on this thread; stay correct regardless.
        Err(_) => f(&mut Scratch::new(d)),
    })
}

/// The running state of one BR-row query sub-tile.
pub(super) struct SubTile {
    /// `Qᵀ`, pre-scaled: `d` rows of lanes.
    pub qt: Vec<Lanes>,
    /// `Oᵀ`, unnormalised: `d` rows of lanes.
    pub ot: Vec<Lanes>,
    /// Running max (of base-2 scores) and running sum of every query.
    pub m: Lanes,
    pub l: Lanes,
}

/// Per-thread buffers, reused across work items.
pub(super) struct Scratch {
    /// The head dim the buffers are sized for.
    pub d: usize,
    pub sub: Vec<SubTile>,
    /// `Sᵀ`, then `Pᵀ` in place: `BC` rows of lanes.
    pub s: Vec<Lanes>,
    /// K and V tiles, dense `BC × d` f32.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// One strided or converted row on its way into `Qᵀ`.
    pub row: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            d,
            sub: (0..QSUB)
                .map(|_| SubTile {
                    qt: vec![Lanes::splat(0.0); d],
                    ot: vec![Lanes::splat(0.0); d],
                    m: Lanes::splat(f32::NEG_INFINITY),
                    l: Lanes::splat(0.0),
                })
                .collect(),
            s: vec![Lanes::splat(0.0); BC],
            k: vec![0.0; BC * d],
            v: vec![0.0; BC * d],
            row: vec![0.0; d],
        }
    }
}
