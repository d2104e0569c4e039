//! What the GPU test binaries (tests/gpu.rs, tests/gpu_backward.rs) share: the device or an
//! explicit skip, the small-shape switch for compute-sanitizer, the pool poison and the ragged
//! varlen batch.

use candle::{Device, Result, Tensor};

/// The CUDA device, or `None` (after printing that the test skipped) when none answers and
/// `CANDLE_FLASH_SKIP_GPU_TESTS=1` is set. Without that opt-out, no device is a failure: a GPU
/// test that ran nothing must not read as a pass.
pub fn gpu() -> Option<Device> {
    // cudarc panics (rather than erring) when the driver library itself is missing.
    let err = match std::panic::catch_unwind(|| Device::new_cuda(0)) {
        Ok(Ok(d)) => return Some(d),
        // First line only: candle appends a backtrace to device errors.
        Ok(Err(e)) => e.to_string().lines().next().unwrap_or_default().to_string(),
        Err(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic while opening the device".into()),
    };
    if std::env::var("CANDLE_FLASH_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED (CANDLE_FLASH_SKIP_GPU_TESTS=1): no CUDA device: {err}");
        return None;
    }
    panic!(
        "no usable CUDA device ({err}); the GPU tests did not run. \
         Set CANDLE_FLASH_SKIP_GPU_TESTS=1 to skip them explicitly."
    );
}

/// `CANDLE_FLASH_GPU_SMALL=1`: a few small ragged shapes only, for compute-sanitizer.
pub fn small() -> bool {
    std::env::var_os("CANDLE_FLASH_GPU_SMALL").is_some()
}

/// Leaves 0xFF bytes (NaN in f32, f16 and bf16 alike) behind in the allocator's pool, one block
/// of each byte count given, so the next allocations of those sizes (the op's outputs) reuse
/// them and an element a kernel fails to write comes back as NaN rather than a lucky zero. (An
/// f32 NaN pattern would read as +0.0 in every other f16/bf16 element.)
pub fn poison_pool(dev: &Device, bytes: &[usize]) -> Result<()> {
    let blocks = bytes
        .iter()
        .map(|&n| Tensor::full(255u8, n.max(1), dev))
        .collect::<Result<Vec<_>>>()?;
    dev.synchronize()?;
    drop(blocks);
    Ok(())
}

/// The ragged packed batch of the varlen GPU tests: empty sequences, odd lengths, more queries
/// than keys and the reverse ([`small`] keeps three short ones).
pub struct Ragged {
    /// (queries, keys) of each sequence.
    pub lens: &'static [(u32, u32)],
    /// Cumulative lengths, `lens.len() + 1` entries from 0.
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    pub total_q: usize,
    pub total_k: usize,
    pub max_q: usize,
    pub max_k: usize,
}

pub fn ragged() -> Ragged {
    let lens: &'static [(u32, u32)] = if small() {
        &[(5, 9), (70, 33), (1, 130)]
    } else {
        &[
            (5, 9),
            (130, 129),
            (0, 7),
            (1, 300),
            (257, 64),
            (64, 0),
            (33, 33),
        ]
    };
    let mut cu_q = vec![0u32];
    let mut cu_k = vec![0u32];
    for &(a, b) in lens {
        cu_q.push(cu_q[cu_q.len() - 1] + a);
        cu_k.push(cu_k[cu_k.len() - 1] + b);
    }
    Ragged {
        lens,
        total_q: cu_q[lens.len()] as usize,
        total_k: cu_k[lens.len()] as usize,
        max_q: lens.iter().map(|l| l.0).max().unwrap_or(0) as usize,
        max_k: lens.iter().map(|l| l.1).max().unwrap_or(0) as usize,
        cu_q,
        cu_k,
    }
}
