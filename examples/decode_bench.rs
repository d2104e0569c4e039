//! Decode benchmark: one decode step (one new query per sequence, causal) of
//! `candle_flash::flash_attn` against candle's naive attention with K/V repeated to the query
//! heads (as candle-transformers models run it), next to the copy bandwidth measured in the
//! same run.
//!
//! ```text
//! cargo run --release --example decode_bench -- --batch 1,8 --kv 4096,16384
//! cargo run --release --features cuda --example decode_bench -- --device cuda --dtype bf16
//! ```
//!
//! Each timing is the median of `--reps` runs after one warm-up; inputs are built outside the
//! clock, and the device is synchronised before the clock stops. "GB/s" counts the bytes a decode
//! step must move: K and V read once, plus q and the output. The copy bandwidth is that of one
//! large buffer copy (bytes read + written), via candle's own tensor copy.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

#[derive(Parser)]
#[command(
    about = "One decode step: flash attention vs candle naive attention, with copy bandwidth"
)]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// KV cache lengths.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384")]
    kv: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Timed repetitions per measurement (median reported).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Also write the results as CSV to this path.
    #[arg(long)]
    csv: Option<String>,
    /// Also time the same cache in pages of this many rows over a shuffled block table.
    #[arg(long)]
    page: Option<usize>,
}

fn device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda if !cfg!(feature = "cuda") => {
            bail!("--device cuda needs a build with the crate's `cuda` feature (--features cuda)")
        }
        DeviceArg::Cuda => Ok(Device::new_cuda(0)?),
    }
}

/// Median time of one call over `reps` runs after one warm-up, in seconds; the device is
/// synchronised before each clock stops. On a GPU each run is a batch of back-to-back calls
/// (divided out), so launch and synchronisation latency do not dominate calls of microseconds.
fn time(dev: &Device, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let inner = if dev.is_cpu() { 1 } else { 50 };
    f()?;
    dev.synchronize()?;
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            for _ in 0..inner {
                f()?;
            }
            dev.synchronize()?;
            Ok(start.elapsed().as_secs_f64() / inner as f64)
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The 1-minute load average (`/proc/loadavg`); `None` elsewhere.
fn load_average() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next().map(str::to_owned)
}

/// Copy bandwidth in GB/s (bytes read + written) of one 256 MiB buffer copy. On the CPU: into a
/// destination allocated and touched before the clock starts, split over the rayon threads as
/// the kernel is (candle's CPU copy allocates its output inside the clock and runs on one
/// thread). On CUDA: candle's own tensor copy.
fn copy_gbps(dev: &Device, reps: usize) -> Result<f64> {
    let n = 64 << 20;
    let secs = if dev.is_cpu() {
        use rayon::prelude::*;
        let src = vec![1f32; n];
        let mut dst = vec![0f32; n];
        let chunk = n.div_ceil(rayon::current_num_threads() * 4);
        time(dev, reps, &mut || {
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            std::hint::black_box(&mut dst);
            Ok(())
        })?
    } else {
        let src = Tensor::ones(n, DType::F32, dev)?;
        time(dev, reps, &mut || {
            let _dst = src.copy()?;
            Ok(())
        })?
    };
    Ok(2.0 * (n * 4) as f64 / secs / 1e9)
}

/// The baseline a model without flash attention runs: q `(b, h, 1, d)`, k/v already repeated to
/// the query heads, contiguous `(b, h, s, d)`. One query at the end of the cache sees every key,
/// so the causal mask is empty.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let att = (q.matmul(&k.t()?)? * scale)?;
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    Ok(att.matmul(v)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = device(args.device)?;
    let dtype = args.dtype.dtype();
    let (h, hk, d) = (args.heads, args.kv_heads, args.head_dim);
    if hk == 0 || h % hk != 0 {
        bail!("--heads must be a multiple of --kv-heads")
    }
    let scale = 1.0 / (d as f64).sqrt();
    let esize = dtype.size_in_bytes();
    let copy = copy_gbps(&dev, args.reps)?;
    println!(
        "{:?} {:?}, {h} heads / {hk} kv heads, head_dim {d}, seq_q 1 causal, median of {} after \
         1 warm-up; {} threads; load average (1 min) {}",
        args.device,
        dtype,
        args.reps,
        rayon::current_num_threads(),
        load_average().unwrap_or_else(|| "n/a".into()),
    );
    println!("copy bandwidth (read + write): {copy:.1} GB/s");
    println!();
    match args.page {
        None => {
            println!("| batch | kv | ours us | GB/s | % of copy | naive us | naive / ours |");
            println!("|---:|---:|---:|---:|---:|---:|---:|");
        }
        Some(page) => {
            println!(
                "| batch | kv | ours us | GB/s | % of copy | naive us | naive / ours | paged \
                 ({page}-row pages, shuffled) us | paged / contiguous |"
            );
            println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        }
    }
    let mut csv = match &args.csv {
        Some(path) => {
            let mut f = std::fs::File::create(path)?;
            writeln!(
                f,
                "impl,dtype,batch,heads,kv_heads,d,kv_len,us,gbps,copy_gbps"
            )?;
            Some(f)
        }
        None => None,
    };
    for &b in &args.batch {
        for &s in &args.kv {
            let q = Tensor::randn(0f32, 1., (b, 1, h, d), &dev)?.to_dtype(dtype)?;
            let k = Tensor::randn(0f32, 1., (b, s, hk, d), &dev)?.to_dtype(dtype)?;
            let v = Tensor::randn(0f32, 1., (b, s, hk, d), &dev)?.to_dtype(dtype)?;
            let ours = time(&dev, args.reps, &mut || {
                candle_flash::flash_attn(&q, &k, &v, scale as f32, true)?;
                Ok(())
            })?;
            // The naive path's inputs, built outside the clock (which flatters it: a model also
            // pays for `repeat_kv` every step): (b, h, 1, d) and K/V repeated to the query heads
            // as candle-transformers' `repeat_kv` does, contiguous (b, h, s, d).
            let rep = |t: &Tensor| -> Result<Tensor> {
                let (b, s, _, d) = t.dims4()?;
                let t = t.transpose(1, 2)?.contiguous()?; // (b, hk, s, d)
                Ok(t.unsqueeze(2)?
                    .expand((b, hk, h / hk, s, d))?
                    .reshape((b, h, s, d))?)
            };
            let (qt, kt, vt) = (q.transpose(1, 2)?.contiguous()?, rep(&k)?, rep(&v)?);
            let base = time(&dev, args.reps, &mut || {
                naive(&qt, &kt, &vt, scale)?;
                Ok(())
            })?;
            // The same cache in pages of `--page` rows over a shuffled block table, read in the
            // kernel through `flash_attn_varlen_paged_windowed`.
            let paged = match args.page {
                None => None,
                Some(page) => {
                    let blocks = s.div_ceil(page);
                    let pad = blocks * page - s;
                    let to_pages = |t: &Tensor| -> Result<Tensor> {
                        let t = if pad > 0 {
                            t.pad_with_zeros(1, 0, pad)?
                        } else {
                            t.clone()
                        };
                        Ok(t.reshape((b * blocks, page, hk, d))?)
                    };
                    let (kp, vp) = (to_pages(&k)?, to_pages(&v)?);
                    // Physical block p holds logical block (b, j) = order[p]: a fixed shuffle.
                    let n = b * blocks;
                    let mut order: Vec<usize> = (0..n).collect();
                    let mut state = 0x9E37_79B9u64;
                    for i in (1..n).rev() {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                        order.swap(i, (state >> 33) as usize % (i + 1));
                    }
                    let shuffle = Tensor::new(
                        order
                            .iter()
                            .map(|&x| x as u32)
                            .collect::<Vec<_>>()
                            .as_slice(),
                        &dev,
                    )?;
                    let (kp, vp) = (kp.index_select(&shuffle, 0)?, vp.index_select(&shuffle, 0)?);
                    let mut table = vec![0u32; n];
                    for (phys, &logical) in order.iter().enumerate() {
                        table[logical] = phys as u32;
                    }
                    let table = Tensor::from_vec(table, (b, blocks), &dev)?;
                    let cu_q = Tensor::new((0..=b as u32).collect::<Vec<_>>().as_slice(), &dev)?;
                    let cu_k = Tensor::new(
                        (0..=b as u32)
                            .map(|i| i * s as u32)
                            .collect::<Vec<_>>()
                            .as_slice(),
                        &dev,
                    )?;
                    let qp = q.reshape((b, h, d))?;
                    let t = time(&dev, args.reps, &mut || {
                        candle_flash::flash_attn_varlen_paged_windowed(
                            &qp,
                            &kp,
                            &vp,
                            &cu_q,
                            &cu_k,
                            &table,
                            None,
                            1,
                            s,
                            scale as f32,
                            None,
                            Some(0),
                            page,
                            None,
                        )?;
                        Ok(())
                    })?;
                    Some(t)
                }
            };
            let bytes = (2 * b * s * hk * d + 2 * b * h * d) * esize;
            let gbps = |t: f64| bytes as f64 / t / 1e9;
            println!(
                "| {b} | {s} | {:.0} | {:.1} | {:.0}% | {:.0} | {:.2}x |{}",
                ours * 1e6,
                gbps(ours),
                100.0 * gbps(ours) / copy,
                base * 1e6,
                base / ours,
                paged.map_or(String::new(), |t| format!(
                    " {:.0} | {:.3} |",
                    t * 1e6,
                    t / ours
                )),
            );
            if let Some(f) = csv.as_mut() {
                let paged_row = paged.map(|t| ("flash_paged", t));
                for (name, t) in [("flash", ours), ("naive", base)]
                    .into_iter()
                    .chain(paged_row)
                {
                    writeln!(
                        f,
                        "{name},{dtype:?},{b},{h},{hk},{d},{s},{:.1},{:.2},{copy:.2}",
                        t * 1e6,
                        gbps(t)
                    )?;
                }
            }
        }
    }
    if let Some(l) = load_average() {
        println!();
        println!("load average (1 min) at end: {l}");
    }
    Ok(())
}
