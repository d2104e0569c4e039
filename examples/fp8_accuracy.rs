//! How much FP8 attention loses: the output of attention over e4m3-quantized inputs against
//! attention over the original data, beside bf16 attention over the same data, as
//! FlashAttention-3 reports it (RMSE over every output element).
//!
//! The original data is f32; the reference is attention over it in f32 (`naive_attention`).
//! Each method quantizes it as a user would and runs `candle_flash`:
//! - `bf16`: q, k and v rounded to bf16;
//! - `fp8-kv`: q in bf16, k and v in e4m3 with one scale per (sequence, K/V head) from their
//!   absolute maximum (`descale = amax / 448`), passed as `k_descale` / `v_descale`;
//! - `fp8`: q, k and v all e4m3 that way.
//!
//! Inputs are N(0, 1) (`normal`), or N(0, 1) with one element in a thousand multiplied by 30
//! (`outliers`: a few large values set the scale, so the rest keep fewer bits).
//!
//! ```text
//! cargo run --release --example fp8_accuracy -- --csv bench/results/fp8-accuracy.csv
//! # on the GPU (its decode kernels read FP8 caches as stored):
//! cargo run --release --features cuda,candle-nn/cuda --example fp8_accuracy -- --device cuda
//! ```

#[path = "common/results.rs"]
mod results;

use anyhow::Result;
use candle::{DType, Device, Tensor, D};
use candle_flash::{naive_attention, FlashAttn};
use clap::Parser;

/// e4m3's largest finite value: the absolute maximum maps to it.
const E4M3_MAX: f64 = 448.0;

#[derive(Parser)]
struct Args {
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write the results as CSV here.
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Keys per sequence.
    #[arg(long, default_value_t = 4096)]
    seq_k: usize,
}

/// Seeded data: N(0, 1), with every 1000th element times 30 when `outliers`.
fn data(shape: (usize, usize, usize, usize), seed: u64, outliers: bool) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let (u1, u2) = (next().max(1e-300), next());
            let x = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (if outliers && i % 1000 == 7 {
                30.0 * x
            } else {
                x
            }) as f32
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `x` `(b, s, heads, d)` as e4m3 with one scale per (sequence, K/V head) of `hk` (query heads
/// grouped), and the descales `(b, hk)`. Quantized on the CPU (candle 0.11 converts to F8E4M3
/// there only).
fn quantize(x: &Tensor, hk: usize) -> Result<(Tensor, Tensor)> {
    let (b, s, h, d) = x.dims4()?;
    let g = x.reshape((b, s, hk, h / hk, d))?;
    let amax = g.abs()?.max_keepdim(1)?.max_keepdim(3)?.max_keepdim(4)?;
    let descale = (amax / E4M3_MAX)?.maximum(f32::MIN_POSITIVE as f64)?;
    let stored = g.broadcast_div(&descale)?.to_dtype(DType::F8E4M3)?;
    Ok((stored.reshape((b, s, h, d))?, descale.reshape((b, hk))?))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = match args.device.as_str() {
        "cuda" => Device::new_cuda(0)?,
        _ => Device::Cpu,
    };
    let (b, h, hk, d, sk) = (2, 32, 8, 128, args.seq_k);
    let columns = [
        "inputs", "method", "heads", "kv_heads", "head_dim", "batch", "seq_q", "seq_k", "rmse",
        "rel_rmse", "max_abs",
    ];
    let mut csv = match &args.csv {
        Some(p) => Some(results::Csv::create(p, &dev, &columns)?),
        None => None,
    };
    println!("device: {}", results::device_name(&dev));
    println!("| inputs | method | seq_q | RMSE | RMSE / RMS(out) | max abs err |");
    println!("|---|---|---:|---:|---:|---:|");
    let put = |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(&dev)?) };
    for outliers in [false, true] {
        for sq in [1, 512] {
            let seed = 17 + sq as u64 + outliers as u64;
            let q = data((b, sq, h, d), seed, outliers)?;
            let k = data((b, sk, hk, d), seed + 1, outliers)?;
            let v = data((b, sk, hk, d), seed + 2, outliers)?;
            let op = FlashAttn::new(1.0 / (d as f32).sqrt()).causal();
            let want = naive_attention(&q, &k, &v, &op)?;
            let bf = |t: &Tensor| -> Result<Tensor> { put(&t.to_dtype(DType::BF16)?) };
            let ((q8, qd), (k8, kd), (v8, vd)) =
                (quantize(&q, hk)?, quantize(&k, hk)?, quantize(&v, hk)?);
            let (k8, v8) = (put(&k8)?, put(&v8)?);
            let (kd, vd) = (put(&kd)?, put(&vd)?);
            let fp8_kv = op.clone().k_descale(&kd).v_descale(&vd);
            let outs = [
                ("bf16", op.forward(&bf(&q)?, &bf(&k)?, &bf(&v)?)?),
                ("fp8-kv", fp8_kv.forward(&bf(&q)?, &k8, &v8)?),
                (
                    "fp8",
                    fp8_kv
                        .clone()
                        .q_descale(&put(&qd)?)
                        .forward(&put(&q8)?, &k8, &v8)?,
                ),
            ];
            let rms = want.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
            for (method, out) in outs {
                let err = (out.to_device(&Device::Cpu)?.to_dtype(DType::F32)? - &want)?;
                let rmse = err.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
                let max = err
                    .abs()?
                    .flatten_all()?
                    .max(D::Minus1)?
                    .to_scalar::<f32>()?;
                let inputs = if outliers { "outliers" } else { "normal" };
                println!(
                    "| {inputs} | {method} | {sq} | {rmse:.3e} | {:.3e} | {max:.3e} |",
                    rmse / rms
                );
                if let Some(c) = csv.as_mut() {
                    c.row(&[
                        inputs.into(),
                        method.into(),
                        h.to_string(),
                        hk.to_string(),
                        d.to_string(),
                        b.to_string(),
                        sq.to_string(),
                        sk.to_string(),
                        format!("{rmse:.4e}"),
                        format!("{:.4e}", rmse / rms),
                        format!("{max:.4e}"),
                    ])?;
                }
            }
        }
    }
    Ok(())
}
