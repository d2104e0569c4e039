//! The timing loop every GPU benchmark shares.

use std::time::Instant;

use candle::{Device, Tensor};

/// Seconds per call of `f`: two warm-up calls, then batches of back-to-back calls (enough for
/// ~20 ms each) between device synchronisations, so host-side launch overhead overlaps device
/// work as it does in a model; the median batch (at least 5, until `budget` seconds or 30).
pub fn time(
    dev: &Device,
    budget: f64,
    mut f: impl FnMut() -> candle::Result<Tensor>,
) -> candle::Result<f64> {
    for _ in 0..2 {
        drop(f()?);
    }
    dev.synchronize()?;
    let t = Instant::now();
    drop(f()?);
    dev.synchronize()?;
    let per_batch = ((0.02 / t.elapsed().as_secs_f64()).ceil() as usize).clamp(1, 200);
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed().as_secs_f64() < budget && times.len() < 30) {
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..per_batch {
            drop(f()?);
        }
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / per_batch as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}
