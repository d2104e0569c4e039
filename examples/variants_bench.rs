//! What the attention variants cost: each variant's forward beside the plain forward on the same
//! inputs, in one process, timed alternately (plain, variant, plain) so that clock and thermal
//! drift fall on both sides; the ratio is the variant's time over the mean of the two plain
//! ones.
//!
//! ```text
//! cargo run --release --features cuda,candle-nn/cuda --example variants_bench
//! cargo run --release --features cuda,candle-nn/cuda --example variants_bench -- --csv bench/results/gpu-variants.csv
//! cargo run --release --example variants_bench -- --cpu --quick
//! ```
//!
//! Prefill: bf16 (f32 on the CPU), d 128, 16 query heads over 8 K/V heads, seq 4096 to 32768 at
//! 32k tokens per batch, causal and not. Decode: one query row per sequence, 32/8 heads, d 128,
//! batch 8 against 8192 keys, and batch 1 against 32768. Variants: `sinks` (one learnable logit
//! per head), `pad-bias` (a `(batch, 1, 1, seq_k)` f32 key-padding bias, its last quarter of keys
//! at `-inf`: less visible work than the plain call), `key-bias` (a `(batch, 1, 1, seq_k)` f32
//! bias of N(0, 1) values: the cost of adding one vector per batch to every score), `bias` (a full `(1, heads, seq_q, seq_k)` bias in the inputs' dtype, up to 2 GiB),
//! `blocks` (a block mask of ones, 64 x 64 blocks on the CPU and 128 x 128 on the GPU: the same
//! visible work as the plain call); on the GPU also `sparse-0.1`, `-0.25` and `-0.5` (128 x 128
//! blocks open at random with that probability, per head) and `docs-8` (8 equal documents, each
//! query block seeing its own document's key blocks).

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_flash::FlashAttn;
use clap::Parser;

#[path = "common/results.rs"]
mod results;
#[path = "common/timing.rs"]
mod timing;
use timing::time;

#[derive(Parser)]
struct Args {
    /// Run on the CPU (small shapes) instead of CUDA device 0.
    #[arg(long)]
    cpu: bool,
    /// Fewer shapes.
    #[arg(long)]
    quick: bool,
    /// Time budget per measurement, in seconds.
    #[arg(long, default_value_t = 0.3)]
    budget: f64,
    /// Also write every row as CSV (bench/results/gpu-variants.csv's schema).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

/// One shape: batch, query rows, keys, heads, K/V heads, head dim, causal.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = if args.cpu {
        Device::Cpu
    } else {
        Device::new_cuda(0)?
    };
    let dtype = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let mut shapes = Vec::new();
    let seqs: &[usize] = match (dev.is_cpu(), args.quick) {
        (true, _) => &[512, 1024],
        (false, true) => &[4096, 16384],
        (false, false) => &[4096, 8192, 16384, 32768],
    };
    let tokens = if dev.is_cpu() { 1024 } else { 32768 };
    for &s in seqs {
        for causal in [false, true] {
            let b = (tokens / s).max(1);
            shapes.push(Shape {
                b,
                sq: s,
                sk: s,
                h: 16,
                hk: 8,
                d: 128,
                causal,
            });
        }
    }
    let decode: &[(usize, usize)] = if dev.is_cpu() {
        &[(4, 4096)]
    } else {
        &[(8, 8192), (1, 32768)]
    };
    for &(b, sk) in decode {
        shapes.push(Shape {
            b,
            sq: 1,
            sk,
            h: 32,
            hk: 8,
            d: 128,
            causal: true,
        });
    }
    let mut csv = match &args.csv {
        Some(p) => Some(results::Csv::create(
            p,
            &dev,
            &[
                "variant",
                "dtype",
                "head_dim",
                "heads",
                "kv_heads",
                "batch",
                "seq_q",
                "seq_k",
                "causal",
                "plain_ms",
                "variant_ms",
                "ratio",
            ],
        )?),
        None => None,
    };
    println!("device: {}", results::device_name(&dev));
    println!(
        "{:<11} {:>5} {:>7} {:>7} {:>6} {:>10} {:>10} {:>7}",
        "variant", "batch", "seq_q", "seq_k", "causal", "plain ms", "var. ms", "ratio"
    );
    for s in shapes {
        let q = Tensor::randn(0f32, 1., (s.b, s.sq, s.h, s.d), &dev)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 1., (s.b, s.sk, s.hk, s.d), &dev)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1., (s.b, s.sk, s.hk, s.d), &dev)?.to_dtype(dtype)?;
        let scale = 1.0 / (s.d as f32).sqrt();
        let plain = if s.causal {
            FlashAttn::new(scale).causal()
        } else {
            FlashAttn::new(scale)
        };
        let sinks = Tensor::randn(0f32, 1., s.h, &dev)?;
        let mut variants = vec![("sinks".to_string(), plain.clone().sinks(&sinks))];
        let pad: Vec<f32> = (0..s.b * s.sk)
            .map(|i| {
                if i % s.sk >= s.sk * 3 / 4 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let pad = Tensor::from_vec(pad, (s.b, 1, 1, s.sk), &dev)?;
        variants.push(("pad-bias".into(), plain.clone().bias(&pad)));
        let key = Tensor::randn(0f32, 1., (s.b, 1, 1, s.sk), &dev)?;
        variants.push(("key-bias".into(), plain.clone().bias(&key)));
        // A full bias in the inputs' dtype, where it fits in 2 GiB.
        if s.sq > 1 && s.h * s.sq * s.sk * dtype.size_in_bytes() <= 2 << 30 {
            let full = Tensor::randn(0f32, 1., (1, s.h, s.sq, s.sk), &dev)?.to_dtype(dtype)?;
            variants.push(("bias".into(), plain.clone().bias(&full)));
        }
        if s.sq > 1 {
            let bs = if dev.is_cpu() { 64 } else { 128 };
            let (nq, nk) = (s.sq.div_ceil(bs), s.sk.div_ceil(bs));
            let ones = Tensor::ones((1, 1, nq, nk), DType::U8, &dev)?;
            variants.push(("blocks".into(), plain.clone().block_mask(&ones, bs, bs)));
            if !dev.is_cpu() {
                for density in [0.1, 0.25, 0.5] {
                    let m = random_blocks((s.h, nq, nk), density, &dev)?;
                    variants.push((
                        format!("sparse-{density}"),
                        plain.clone().block_mask(&m, bs, bs),
                    ));
                }
                let docs = document_blocks(nq, nk, 8, &dev)?;
                variants.push(("docs-8".into(), plain.clone().block_mask(&docs, bs, bs)));
            }
        }
        for (name, op) in variants {
            let run_plain = || plain.forward(&q, &k, &v);
            let run_variant = || op.forward(&q, &k, &v);
            let p1 = time(&dev, args.budget, run_plain)?;
            let t = time(&dev, args.budget, run_variant)?;
            let p2 = time(&dev, args.budget, run_plain)?;
            let p = (p1 + p2) / 2.0;
            println!(
                "{name:<11} {:>5} {:>7} {:>7} {:>6} {:>10.4} {:>10.4} {:>7.3}",
                s.b,
                s.sq,
                s.sk,
                s.causal,
                p * 1e3,
                t * 1e3,
                t / p
            );
            if let Some(csv) = csv.as_mut() {
                csv.row(&[
                    name.clone(),
                    format!("{dtype:?}").to_lowercase(),
                    s.d.to_string(),
                    s.h.to_string(),
                    s.hk.to_string(),
                    s.b.to_string(),
                    s.sq.to_string(),
                    s.sk.to_string(),
                    s.causal.to_string(),
                    format!("{:.5}", p * 1e3),
                    format!("{:.5}", t * 1e3),
                    format!("{:.4}", t / p),
                ])?;
            }
        }
    }
    Ok(())
}

/// A `(1, heads, nq, nk)` block mask whose blocks are open with probability `density`, drawn
/// per head from a fixed seed.
fn random_blocks((h, nq, nk): (usize, usize, usize), density: f64, dev: &Device) -> Result<Tensor> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let v: Vec<u8> = (0..h * nq * nk)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64) < density
        })
        .map(u8::from)
        .collect();
    Ok(Tensor::from_vec(v, (1, h, nq, nk), dev)?)
}

/// A block mask of `docs` equal documents: a query block sees the key blocks of its document.
fn document_blocks(nq: usize, nk: usize, docs: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<u8> = (0..nq * nk)
        .map(|x| u8::from((x / nk) * docs / nq == (x % nk) * docs / nk))
        .collect();
    Ok(Tensor::from_vec(v, (1, 1, nq, nk), dev)?)
}
