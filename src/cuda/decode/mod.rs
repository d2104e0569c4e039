//! Decode: few query rows per K/V head against a long cache, split over the keys so that every
//! SM streams its share of K and V, then merged through the log-sum-exps. Planned by [`plan`]
//! (which declines problems that are not decode-shaped), run by `launch`.

#[cfg(feature = "cuda")]
pub(crate) mod launch;
pub(crate) mod plan;
