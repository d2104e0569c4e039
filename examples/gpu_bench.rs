//! GPU forward benchmark of the CUDA path.
//!
//! ```text
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --quick
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --csv bench/results/gpu-prefill.csv
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --shape 256:8192 --no-f32
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --layout bhsd --no-f32
//! cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --backward [--quick] [--shape 128:8192]
//! ```
//!
//! Part 1: bf16 and f16, head dims 64 and 128, seq 512 / 2048 / 8192 / 16384, causal and not, at
//! hidden size 2048 (heads = 2048 / d) and 16k tokens per batch (batch = 16384 / seq).
//! Part 2: the exact f32 path against candle's naive f32 attention (matmul, scale, mask, softmax,
//! matmul; the mask is built outside the clock) from seq 2048 up, with their ratio and where
//! the naive one runs out of memory.
//! `--shape D:SEQ` restricts part 1 to that head dim and sequence length (any head dim dividing
//! the hidden size, e.g. 256). Part 1's q, k and v lie in `(batch, seq, heads, d)` memory;
//! `--layout bhsd` passes `transpose(1, 2)` views of `(batch, heads, seq, d)` tensors instead,
//! PyTorch SDPA's layout (which the kernels read in place); its CSV rows name the impl
//! `candle-flash-bhsd`.
//!
//! TFLOP/s counts `4·b·h·s²·d`, halved under the causal mask. Each time is the median over
//! batches of back-to-back calls (synchronised before and after each batch) after two warm-up
//! calls; bench/torch_prefill.py times PyTorch the same way (and appends its rows to the CSV).
//!
//! `--backward` times the backward pass instead (only): bf16 and f16, d 64 and 128, the same
//! shapes, causal and not. The forward runs once outside the clock. Two timings per shape:
//! * `FlashAttn::backward` from the saved output and log-sum-exp with a random dO, what
//!   bench/torch_prefill.py times for PyTorch (`torch.autograd.grad` of SDPA's output with dO:
//!   the attention backward, no accumulation into existing gradients); impl `candle-flash`;
//! * `out.backward()` on the same graph (impl `candle-flash-autograd`), which adds candle's
//!   autograd bookkeeping: a ones dO, then a zeros tensor and an add for each of q, k and v
//!   (about 1 GiB of memory traffic at these shapes); `--no-autograd` skips it.
//!
//! TFLOP/s counts 2.5 times the forward's flops (FA's convention: five matmuls instead of two).

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_flash::FlashAttn;
use clap::Parser;

#[path = "common/timing.rs"]
mod timing;
use timing::time;

#[derive(Parser)]
struct Args {
    /// Fewer shapes and repetitions.
    #[arg(long)]
    quick: bool,
    /// Skip the f32 section.
    #[arg(long)]
    no_f32: bool,
    /// Time budget per shape, in seconds.
    #[arg(long, default_value_t = 0.4)]
    budget: f64,
    /// Also write every timing as CSV (bench/results/gpu-prefill.csv's schema; gpu-backward.csv's
    /// with --backward).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Run the portable kernels even on Hopper (`FlashAttn::portable`).
    #[arg(long)]
    portable: bool,
    /// Force this sm_90a forward variant where it applies (`PlanOverride::sm90_variant`).
    #[arg(long)]
    sm90_variant: Option<String>,
    /// Time the backward pass (only) instead of the forward.
    #[arg(long)]
    backward: bool,
    /// Only this head dim and sequence length, as `D:SEQ` (the forward's part 1, or with
    /// --backward; e.g. for a profiler).
    #[arg(long)]
    shape: Option<String>,
    /// With --backward: skip the timing through `out.backward()`.
    #[arg(long)]
    no_autograd: bool,
    /// Forward, part 1: the dtypes of q, k and v (`bf16`, `f16`, `f8e4m3`: FP8 q, k and v
    /// with a bf16 output, descales 1).
    #[arg(long, value_delimiter = ',', default_value = "bf16,f16")]
    dtype: Vec<String>,
    /// Forward, part 1: where q, k and v lie in memory. `bshd`: (batch, seq, heads, d), the
    /// layout candle-transformers' models pass; `bhsd`: (batch, heads, seq, d), PyTorch SDPA's,
    /// passed as `transpose(1, 2)` views, which the kernels read in place
    /// (bench/torch_prefill.py --layout times PyTorch on either).
    #[arg(long, value_enum, default_value_t = Layout::Bshd)]
    layout: Layout,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Layout {
    Bshd,
    Bhsd,
}

/// Columns of `--csv` after the common ones (one row per implementation and shape), as
/// bench/report.py reads them.
const COLUMNS: [&str; 10] = [
    "impl", "dtype", "mask", "batch", "seq", "heads", "kv_heads", "head_dim", "ms", "tflops",
];

/// One CSV row: `ms` empty when the implementation could not run the shape.
#[allow(clippy::too_many_arguments)]
fn row(
    imp: &str,
    dtype: &str,
    causal: bool,
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    ms: Option<f64>,
    tflops: Option<f64>,
) -> Vec<String> {
    let mask = if causal { "causal" } else { "none" };
    let f = |x: Option<f64>, p: usize| x.map_or(String::new(), |x| format!("{x:.p$}"));
    [imp, dtype, mask]
        .map(str::to_string)
        .into_iter()
        .chain([b, s, h, h, d].map(|x| x.to_string()))
        .chain([f(ms, 4), f(tflops, 3)])
        .collect()
}

#[path = "common/results.rs"]
mod results;

const HIDDEN: usize = 2048;
const TOKENS: usize = 16384;

fn flops(b: usize, h: usize, s: usize, d: usize, causal: bool) -> f64 {
    let f = 4.0 * (b * h) as f64 * (s as f64) * (s as f64) * d as f64;
    if causal {
        f / 2.0
    } else {
        f
    }
}

/// candle's naive attention on (b, h, s, d) tensors; `mask` is an additive (s, s) f32 mask.
fn naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle::Result<Tensor> {
    let s = (q.matmul(&k.t()?)? * scale)?;
    let s = match mask {
        Some(m) => s.broadcast_add(m)?,
        None => s,
    };
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    p.matmul(v)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no CUDA device ({e}); build with --features cuda,candle-nn/cuda and run on a GPU machine");
            return Ok(());
        }
    };
    // The naive f32 baseline uses candle-nn's softmax kernel, which exists on the GPU only when
    // candle-nn itself is built with its `cuda` feature.
    if !args.no_f32
        && candle_nn::ops::softmax_last_dim(&Tensor::zeros((1, 1), DType::F32, &dev)?).is_err()
    {
        anyhow::bail!("candle-nn was built without its CUDA kernels: add --features candle-nn/cuda (or pass --no-f32)")
    }
    let seqs: &[usize] = if args.quick {
        &[2048, 8192]
    } else {
        &[512, 2048, 8192, 16384]
    };
    let budget = if args.quick { 0.15 } else { args.budget };
    let shape = match &args.shape {
        None => None,
        Some(x) => {
            let (d, s) = x
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("--shape takes D:SEQ, got {x}"))?;
            Some((d.parse::<usize>()?, s.parse::<usize>()?))
        }
    };
    let mut csv = match &args.csv {
        Some(path) => Some(results::Csv::create(path, &dev, &COLUMNS)?),
        None => None,
    };
    let mut base = FlashAttn::new(1.0).portable(args.portable);
    if let Some(v) = &args.sm90_variant {
        base = base.plan_override(candle_flash::PlanOverride {
            sm90_variant: Some(v.clone()),
            ..Default::default()
        });
    }
    if args.backward {
        let opts = (budget, args.quick, shape, !args.no_autograd);
        return backward_section(&dev, &base, seqs, opts, csv.as_mut());
    }
    let (dims, seqs): (Vec<usize>, Vec<usize>) = match shape {
        Some((d, s)) if HIDDEN.is_multiple_of(d) && s > 0 => (vec![d], vec![s]),
        Some((d, s)) => anyhow::bail!("--shape {d}:{s}: the head dim must divide {HIDDEN}"),
        None => (vec![64, 128], seqs.to_vec()),
    };

    println!(
        "candle-flash CUDA forward, hidden {HIDDEN}, {TOKENS} tokens per batch, q/k/v in {} memory",
        match args.layout {
            Layout::Bshd => "(batch, seq, heads, d)",
            Layout::Bhsd => "(batch, heads, seq, d)",
        }
    );
    println!(
        "{:<6} {:>4} {:>6} {:>6} {:>4} {:>7} {:>10} {:>9}",
        "dtype", "d", "seq", "batch", "h", "causal", "ms", "TFLOP/s"
    );
    let dtypes = args
        .dtype
        .iter()
        .map(|x| match x.trim().to_ascii_lowercase().as_str() {
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            "f8e4m3" | "e4m3" => Ok(DType::F8E4M3),
            other => anyhow::bail!("--dtype {other:?}: expected bf16, f16 or f8e4m3"),
        })
        .collect::<Result<Vec<_>>>()?;
    for dtype in dtypes {
        for &d in &dims {
            for &s in &seqs {
                for causal in [false, true] {
                    let (b, h) = ((TOKENS / s).max(1), HIDDEN / d);
                    // FP8 operands are made on the host: candle has no CUDA cast to F8E4M3.
                    let at = if dtype == DType::F8E4M3 {
                        Device::Cpu
                    } else {
                        dev.clone()
                    };
                    let operand = || -> candle::Result<Tensor> {
                        match args.layout {
                            Layout::Bshd => Tensor::randn(0f32, 1.0, (b, s, h, d), &at)?
                                .to_dtype(dtype)?
                                .to_device(&dev),
                            Layout::Bhsd => Tensor::randn(0f32, 1.0, (b, h, s, d), &at)?
                                .to_dtype(dtype)?
                                .to_device(&dev)?
                                .transpose(1, 2),
                        }
                    };
                    let (q, k, v) = (operand()?, operand()?, operand()?);
                    let mut op = base.clone();
                    op.softmax_scale = 1.0 / (d as f32).sqrt();
                    if causal {
                        op = op.causal();
                    }
                    let t = time(&dev, budget, || op.forward(&q, &k, &v))?;
                    let tf = flops(b, h, s, d, causal) / t / 1e12;
                    println!(
                        "{:<6} {d:>4} {s:>6} {b:>6} {h:>4} {causal:>7} {:>10.3} {tf:>9.1}",
                        format!("{dtype:?}").to_lowercase(),
                        t * 1e3
                    );
                    let dname = format!("{dtype:?}").to_lowercase();
                    let imp = match args.layout {
                        Layout::Bhsd => "candle-flash-bhsd",
                        Layout::Bshd => "candle-flash",
                    };
                    if let Some(c) = csv.as_mut() {
                        c.row(&row(
                            imp,
                            &dname,
                            causal,
                            b,
                            s,
                            h,
                            d,
                            Some(t * 1e3),
                            Some(tf),
                        ))?;
                    }
                }
            }
        }
    }

    if !args.no_f32 {
        f32_section(&args, &dev, budget, csv.as_mut())?;
    }
    Ok(())
}

/// Part 2: the f32 path against candle's naive f32 attention; CSV rows go to `csv`.
fn f32_section(
    args: &Args,
    dev: &Device,
    budget: f64,
    mut csv: Option<&mut results::Csv>,
) -> Result<()> {
    let dev = dev.clone();
    let seqs32: &[usize] = if args.quick {
        &[2048, 8192]
    } else {
        &[2048, 4096, 8192, 16384, 32768]
    };
    println!();
    println!("f32 (exact FFMA path) vs candle naive f32 attention, hidden {HIDDEN}, batch max(1, {TOKENS}/seq)");
    println!(
        "{:>4} {:>6} {:>6} {:>7} {:>12} {:>12} {:>8}",
        "d", "seq", "batch", "causal", "flash TF/s", "naive TF/s", "ratio"
    );
    for d in [64, 128] {
        for &s in seqs32 {
            for causal in [false, true] {
                let (b, h) = ((TOKENS / s).max(1), HIDDEN / d);
                let q = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?;
                let k = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?;
                let v = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?;
                let scale = 1.0 / (d as f64).sqrt();
                let mut op = FlashAttn::new(scale as f32);
                if causal {
                    op = op.causal();
                }
                let f = flops(b, h, s, d, causal);
                let t_flash = time(&dev, budget, || op.forward(&q, &k, &v))?;
                let tf_flash = f / t_flash / 1e12;
                let (ms, tf) = (Some(t_flash * 1e3), Some(tf_flash));
                if let Some(c) = csv.as_deref_mut() {
                    c.row(&row("candle-flash", "f32", causal, b, s, h, d, ms, tf))?;
                }
                // Naive: (b, h, s, d) layout prepared outside the clock, like a model would keep it.
                let naive_t = (|| -> candle::Result<f64> {
                    let qt = q.transpose(1, 2)?.contiguous()?;
                    let kt = k.transpose(1, 2)?.contiguous()?;
                    let vt = v.transpose(1, 2)?.contiguous()?;
                    let mask = if causal {
                        let i = Tensor::arange(0u32, s as u32, &dev)?;
                        let m = i.unsqueeze(1)?.broadcast_lt(&i.unsqueeze(0)?)?;
                        let ninf = Tensor::full(f32::NEG_INFINITY, (s, s), &dev)?;
                        Some(m.where_cond(&ninf, &ninf.zeros_like()?)?)
                    } else {
                        None
                    };
                    let t = time(&dev, budget, || naive(&qt, &kt, &vt, scale, mask.as_ref()))?;
                    Ok(t)
                })();
                let (naive_s, ratio_s) = match naive_t {
                    Ok(t) => {
                        let n = f / t / 1e12;
                        if let Some(c) = csv.as_deref_mut() {
                            let (ms, tf) = (Some(t * 1e3), Some(n));
                            c.row(&row("candle-naive", "f32", causal, b, s, h, d, ms, tf))?;
                        }
                        (format!("{n:.2}"), format!("{:.1}x", tf_flash / n))
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        let why = if msg.contains("OUT_OF_MEMORY") || msg.contains("out of memory")
                        {
                            "OOM".to_string()
                        } else if b * h * s * s >= 1 << 32 {
                            // candle's CUDA kernels count elements in 32 bits: a score matrix of
                            // 2^32 elements or more is refused at launch.
                            ">2^32 scores".to_string()
                        } else {
                            format!("error: {}", msg.lines().next().unwrap_or(""))
                        };
                        if let Some(c) = csv.as_deref_mut() {
                            c.row(&row("candle-naive", "f32", causal, b, s, h, d, None, None))?;
                        }
                        (why, "-".to_string())
                    }
                };
                println!(
                    "{d:>4} {s:>6} {b:>6} {causal:>7} {tf_flash:>12.2} {naive_s:>12} {ratio_s:>8}"
                );
                dev.synchronize()?;
            }
        }
    }
    Ok(())
}

/// `--backward`: seconds per backward pass on the forward shapes, 2.5x the forward's flops.
/// `opts`: the time budget per shape, `quick` (bf16 only), one `D:SEQ` shape, whether to time
/// `out.backward()` too.
fn backward_section(
    dev: &Device,
    base: &FlashAttn,
    seqs: &[usize],
    (budget, quick, shape, autograd): (f64, bool, Option<(usize, usize)>, bool),
    mut csv: Option<&mut results::Csv>,
) -> Result<()> {
    println!("candle-flash CUDA backward, hidden {HIDDEN}, {TOKENS} tokens per batch");
    println!(
        "{:<6} {:>4} {:>6} {:>6} {:>4} {:>7} {:>10} {:>9} {:>10} {:>9}",
        "dtype", "d", "seq", "batch", "h", "causal", "ms", "TFLOP/s", "autograd", "TFLOP/s"
    );
    let dtypes: &[DType] = if quick {
        &[DType::BF16]
    } else {
        &[DType::BF16, DType::F16]
    };
    for &dtype in dtypes {
        for d in [64, 128] {
            for &s in seqs {
                if shape.is_some_and(|x| x != (d, s)) {
                    continue;
                }
                for causal in [false, true] {
                    let (b, h) = (TOKENS / s, HIDDEN / d);
                    let var = || -> candle::Result<candle::Var> {
                        candle::Var::from_tensor(
                            &Tensor::randn(0f32, 1.0, (b, s, h, d), dev)?.to_dtype(dtype)?,
                        )
                    };
                    let (q, k, v) = (var()?, var()?, var()?);
                    let mut op = base.clone();
                    op.softmax_scale = 1.0 / (d as f32).sqrt();
                    if causal {
                        op = op.causal();
                    }
                    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                    let (out, lse) = op.forward_with_lse(qt, kt, vt)?;
                    let dout = Tensor::randn(0f32, 1.0, (b, s, h, d), dev)?.to_dtype(dtype)?;
                    let t = time(dev, budget, || {
                        Ok(op.backward(qt, kt, vt, &out, &dout, &lse)?.0)
                    })?;
                    let t_autograd = match autograd {
                        false => None,
                        true => Some(time(dev, budget, || {
                            let g = out.backward()?;
                            g.get(qt)
                                .cloned()
                                .ok_or_else(|| candle::Error::Msg("no gradient reached q".into()))
                        })?),
                    };
                    let tflops = |t: f64| 2.5 * flops(b, h, s, d, causal) / t / 1e12;
                    let dname = format!("{dtype:?}").to_lowercase();
                    let (ag_ms, ag_tf) = match t_autograd {
                        Some(t) => (format!("{:.3}", t * 1e3), format!("{:.1}", tflops(t))),
                        None => ("-".into(), "-".into()),
                    };
                    println!(
                        "{dname:<6} {d:>4} {s:>6} {b:>6} {h:>4} {causal:>7} {:>10.3} {:>9.1} {ag_ms:>10} {ag_tf:>9}",
                        t * 1e3,
                        tflops(t)
                    );
                    if let Some(c) = csv.as_deref_mut() {
                        let (ms, tf) = (Some(t * 1e3), Some(tflops(t)));
                        c.row(&row("candle-flash", &dname, causal, b, s, h, d, ms, tf))?;
                        if let Some(t) = t_autograd {
                            let (ms, tf) = (Some(t * 1e3), Some(tflops(t)));
                            let imp = "candle-flash-autograd";
                            c.row(&row(imp, &dname, causal, b, s, h, d, ms, tf))?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
