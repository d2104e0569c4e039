//! Ring attention across GPUs: one attention layer (causal by default), forward and backward,
//! over N GPUs with NCCL (one thread per GPU, see `candle_flash::ring::NcclRing`), at each
//! sequence length given. Prints the time per forward and per forward+backward (the slowest
//! rank's, median of `--iters`), tokens/s, the device memory in use per GPU (the driver's view:
//! candle's pool included), and, at lengths up to `--single-up-to`, the same layer on one GPU
//! with the speed-up; at lengths up to `--compare-up-to`, the largest difference of the ring's
//! output, log-sum-exp and gradients to the single-GPU op's, and whether a second ring run is
//! bitwise identical to the first.
//!
//! ```text
//! cargo build --release --features nccl,candle-nn/cuda --example long_context
//! NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=<folder of libnccl.so.2> \
//!     target/release/examples/long_context --gpus 2 --seq 32768,131072 [--csv gpu-ring.csv]
//! ```
//!
//! `--comm loopback` runs the ranks as threads on GPU 0 over the in-process loopback instead of
//! NCCL: the same ring algorithm on one GPU (a correctness check that needs no NCCL).

#[path = "common/results.rs"]
mod results;

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use candle_flash::ring::{self, Communicator, Loopback, NcclRing};
use candle_flash::FlashAttn;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CommArg {
    Nccl,
    Loopback,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DtypeArg {
    Bf16,
    F16,
    F32,
}

/// Ring attention over N GPUs: forward and backward of one attention layer.
#[derive(Parser, Debug)]
struct Args {
    /// Ranks (GPUs 0..N with NCCL; threads on GPU 0 with the loopback).
    #[arg(long, default_value_t = 2)]
    gpus: usize,
    /// Sequence lengths (each a multiple of 2 x gpus), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32768,65536,131072")]
    seq: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    dtype: DtypeArg,
    /// Full (unmasked) attention instead of causal.
    #[arg(long)]
    full: bool,
    /// Timed iterations per length (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Time the single-GPU op at lengths up to this (on GPU 0).
    #[arg(long, default_value_t = 131072)]
    single_up_to: usize,
    /// Compare with the single-GPU op and check reruns at lengths up to this.
    #[arg(long, default_value_t = 32768)]
    compare_up_to: usize,
    #[arg(long, value_enum, default_value_t = CommArg::Nccl)]
    comm: CommArg,
    /// Also append every length's row to this CSV (bench/results/gpu-ring.csv's schema).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

/// Columns of `--csv` after the common ones.
const CSV_COLUMNS: [&str; 20] = [
    "gpus",
    "comm",
    "dtype",
    "heads",
    "kv_heads",
    "head_dim",
    "mask",
    "seq",
    "fwd_ms",
    "fwd_bwd_ms",
    "tokens_per_s",
    "gib_per_gpu",
    "single_fwd_ms",
    "single_fwd_bwd_ms",
    "diff_out",
    "diff_lse",
    "diff_dq",
    "diff_dk",
    "diff_dv",
    "rerun_identical",
];

/// One rank's shards of the outputs and gradients, on the host.
type Shards = [Tensor; 5];

/// One rank's timings at one length: forward and forward+backward seconds per iteration.
struct Times {
    fwd: Vec<f64>,
    fwd_bwd: Vec<f64>,
    mem_gib: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// Device memory in use, GiB (the driver's count on `dev`'s GPU).
fn mem_in_use(dev: &Device) -> Result<f64> {
    use candle::cuda_backend::cudarc::driver::result::mem_get_info;
    let d = dev.as_cuda_device()?;
    d.cuda_stream().context().bind_to_thread()?;
    let (free, total) = mem_get_info()?;
    Ok((total - free) as f64 / (1u64 << 30) as f64)
}

/// Random q, k, v and output gradient of `s` tokens, drawn from `seed`.
fn inputs(a: &Args, s: usize, seed: u64, dtype: DType, dev: &Device) -> Result<[Tensor; 4]> {
    dev.set_seed(seed)?;
    let (h, hk, d) = (a.heads, a.kv_heads, a.head_dim);
    let t = |heads: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., (1, s, heads, d), dev)?.to_dtype(dtype)?)
    };
    Ok([t(h)?, t(hk)?, t(hk)?, t(h)?])
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?;
    // NaN-propagating: a NaN anywhere reports NaN.
    let v = d.to_vec1::<f32>()?;
    Ok(v.iter().fold(0f32, |m, &x| {
        if x.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(x)
        }
    }))
}

/// What rank 0 reports per length, and the others send it.
enum Report {
    Times(Times),
    Shards(Shards),
    /// Whether the rank's rerun was bitwise identical to its first run.
    Rerun(bool),
}

#[allow(clippy::too_many_arguments)]
fn rank_main(
    a: &Args,
    mut comm: Box<dyn Communicator + '_>,
    dev: Device,
    op: &FlashAttn,
    dtype: DType,
    barrier: &Barrier,
    to_rank0: mpsc::Sender<(usize, Report)>,
    from_ranks: Option<mpsc::Receiver<(usize, Report)>>,
) -> Result<()> {
    let (r, w) = (comm.rank(), comm.world_size());
    let mut csv = match (&a.csv, r) {
        (Some(path), 0) => Some(results::Csv::create(path, &dev, &CSV_COLUMNS)?),
        _ => None,
    };
    let name = match &dev {
        Device::Cuda(d) => d.cuda_stream().context().name()?,
        _ => "cpu".into(),
    };
    if r == 0 {
        println!(
            "ring attention over {w} ranks ({:?}), {dtype:?}, {}/{} heads, d {}, {}; {name}",
            a.comm,
            a.heads,
            a.kv_heads,
            a.head_dim,
            if a.full { "full" } else { "causal" }
        );
        println!(
            "{:>8} {:>9} {:>11} {:>12} {:>8} {:>10} {:>12} {:>8} {:>8}  max |ring - 1 GPU| out / lse / dq / dk / dv; rerun",
            "seq", "fwd ms", "fwd+bwd ms", "tok/s f+b", "GiB/GPU", "1GPU fwd", "1GPU f+b", "x fwd", "x f+b"
        );
    }
    for &s in &a.seq {
        if s % (2 * w) != 0 {
            bail!("--seq {s} is not a multiple of 2 x {w}")
        }
        // Lengths compared with, or timed on, one GPU shard one set of full inputs; beyond them
        // each rank draws only its own shard (timing does not depend on the values), so the
        // longest length is set by the ring's memory, not by full copies on every GPU.
        let whole = s <= a.single_up_to || s <= a.compare_up_to;
        let (qs, ks, vs, gs, full_inputs) = if whole {
            let [q, k, v, g] = inputs(a, s, s as u64, dtype, &dev)?;
            let shard = |t: &Tensor| ring::zigzag_shard(t, 1, r, w);
            let (qs, ks, vs, gs) = (shard(&q)?, shard(&k)?, shard(&v)?, shard(&g)?);
            (qs, ks, vs, gs, (r == 0).then_some([q, k, v, g]))
        } else {
            let [q, k, v, g] = inputs(a, s / w, (s * w + r) as u64, dtype, &dev)?;
            (q, k, v, g, None)
        };
        let run = |comm: &mut Box<dyn Communicator + '_>| -> Result<(Shards, f64, f64)> {
            sync(&dev)?;
            let t0 = Instant::now();
            let (out, lse) = ring::ring_attention_forward(comm.as_mut(), op, &qs, &ks, &vs)?;
            sync(&dev)?;
            let t1 = t0.elapsed().as_secs_f64();
            let (dq, dk, dv) =
                ring::ring_attention_backward(comm.as_mut(), op, &qs, &ks, &vs, &out, &gs, &lse)?;
            sync(&dev)?;
            Ok(([out, lse, dq, dk, dv], t1, t0.elapsed().as_secs_f64()))
        };
        run(&mut comm)?; // warm-up
        let mut times = Times {
            fwd: vec![],
            fwd_bwd: vec![],
            mem_gib: 0.0,
        };
        let mut first = None;
        for _ in 0..a.iters.max(1) {
            barrier.wait();
            let (shards, f, fb) = run(&mut comm)?;
            times.fwd.push(f);
            times.fwd_bwd.push(fb);
            first.get_or_insert(shards);
        }
        times.mem_gib = mem_in_use(&dev)?;
        let first = first.expect("one iteration at least");
        // Reruns: a further run must be bitwise identical to the first.
        let mut rerun_same = true;
        let compare = s <= a.compare_up_to;
        if compare {
            barrier.wait();
            let (again, _, _) = run(&mut comm)?;
            for (x, y) in first.iter().zip(&again) {
                rerun_same &= max_diff(x, y)? == 0.0;
            }
        }
        if r != 0 {
            to_rank0.send((r, Report::Times(times)))?;
            if compare {
                let host = first.each_ref().map(|t| t.to_device(&Device::Cpu));
                let [a0, a1, a2, a3, a4] = host;
                to_rank0.send((r, Report::Shards([a0?, a1?, a2?, a3?, a4?])))?;
                to_rank0.send((r, Report::Rerun(rerun_same)))?;
            }
            // Rank 0 runs the single-GPU layer alone.
            barrier.wait();
            continue;
        }
        // Rank 0: gather, then the single-GPU layer.
        let rx = from_ranks.as_ref().expect("rank 0 receives");
        let mut all_times = vec![times];
        let mut shards: Vec<Option<Shards>> = (0..w).map(|_| None).collect();
        let mut reruns_ok = rerun_same;
        let host = first.each_ref().map(|t| t.to_device(&Device::Cpu));
        if compare {
            let [a0, a1, a2, a3, a4] = host;
            shards[0] = Some([a0?, a1?, a2?, a3?, a4?]);
        }
        let expected = (w - 1) * if compare { 3 } else { 1 };
        let mut got_times = 0;
        for _ in 0..expected {
            let (from, rep) = rx.recv()?;
            match rep {
                Report::Rerun(same) => reruns_ok &= same,
                Report::Times(t) => {
                    all_times.push(t);
                    got_times += 1;
                }
                Report::Shards(sh) => shards[from] = Some(sh),
            }
        }
        debug_assert_eq!(got_times, w - 1);
        // The ring is as slow as its slowest rank, per iteration.
        let iters = all_times[0].fwd.len();
        let worst = |f: fn(&Times) -> &Vec<f64>| {
            let mut v: Vec<f64> = (0..iters)
                .map(|i| all_times.iter().map(|t| f(t)[i]).fold(0f64, f64::max))
                .collect();
            median(&mut v)
        };
        let (fwd, fwd_bwd) = (worst(|t| &t.fwd), worst(|t| &t.fwd_bwd));
        let mem = all_times.iter().map(|t| t.mem_gib).fold(0f64, f64::max);
        let mut single_ms = None;
        let mut checked = None;
        let mut line = format!(
            "{s:>8} {:>9.1} {:>11.1} {:>12.0} {mem:>8.1}",
            fwd * 1e3,
            fwd_bwd * 1e3,
            s as f64 / fwd_bwd
        );
        if let Some([q, k, v, g]) = &full_inputs {
            if s <= a.single_up_to || compare {
                let one = || -> Result<([Tensor; 5], f64, f64)> {
                    sync(&dev)?;
                    let t0 = Instant::now();
                    let (o, l) = op.forward_with_lse(q, k, v)?;
                    sync(&dev)?;
                    let t1 = t0.elapsed().as_secs_f64();
                    let (dq, dk, dv) = op.backward(q, k, v, &o, g, &l)?;
                    sync(&dev)?;
                    Ok(([o, l, dq, dk, dv], t1, t0.elapsed().as_secs_f64()))
                };
                one()?;
                let (mut f1, mut fb1) = (vec![], vec![]);
                let mut single = None;
                for _ in 0..a.iters.max(1) {
                    let (res, f, fb) = one()?;
                    f1.push(f);
                    fb1.push(fb);
                    single.get_or_insert(res);
                }
                let (f1, fb1) = (median(&mut f1), median(&mut fb1));
                single_ms = Some((f1, fb1));
                write_cols(&mut line, f1, fb1, fwd, fwd_bwd);
                if compare {
                    let single = single.expect("one iteration at least");
                    let shards: Vec<Shards> = shards
                        .into_iter()
                        .collect::<Option<_>>()
                        .expect("every rank's shards");
                    let mut diffs = vec![];
                    for (i, t) in single.iter().enumerate() {
                        let dim = if i == 1 { 2 } else { 1 };
                        let parts: Vec<Tensor> = shards.iter().map(|s| s[i].clone()).collect();
                        let ring_t = ring::zigzag_unshard(&parts, dim)?;
                        diffs.push(max_diff(&ring_t, &t.to_device(&Device::Cpu)?)?);
                    }
                    checked = Some((diffs.clone(), reruns_ok));
                    line += &format!(
                        "  {:.2e} / {:.2e} / {:.2e} / {:.2e} / {:.2e}; {}",
                        diffs[0],
                        diffs[1],
                        diffs[2],
                        diffs[3],
                        diffs[4],
                        if reruns_ok {
                            "bitwise identical"
                        } else {
                            "DIFFERS"
                        }
                    );
                }
            }
        }
        println!("{line}");
        if let Some(csv) = csv.as_mut() {
            let opt = |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map(f).unwrap_or_default();
            let ms = |x: f64| format!("{:.3}", x * 1e3);
            let sci = |x: f64| format!("{x:.3e}");
            let diff = |i: usize| opt(checked.as_ref().map(|c| f64::from(c.0[i])), &sci);
            csv.row(&[
                w.to_string(),
                format!("{:?}", a.comm).to_lowercase(),
                format!("{dtype:?}").to_lowercase(),
                a.heads.to_string(),
                a.kv_heads.to_string(),
                a.head_dim.to_string(),
                if a.full { "full" } else { "causal" }.to_string(),
                s.to_string(),
                ms(fwd),
                ms(fwd_bwd),
                format!("{:.0}", s as f64 / fwd_bwd),
                format!("{mem:.2}"),
                opt(single_ms.map(|x| x.0), &ms),
                opt(single_ms.map(|x| x.1), &ms),
                diff(0),
                diff(1),
                diff(2),
                diff(3),
                diff(4),
                checked.as_ref().map_or(String::new(), |c| c.1.to_string()),
            ])?;
        }
        drop(full_inputs);
        barrier.wait();
    }
    Ok(())
}

fn write_cols(line: &mut String, f1: f64, fb1: f64, fwd: f64, fwd_bwd: f64) {
    *line += &format!(
        " {:>10.1} {:>12.1} {:>8.2} {:>8.2}",
        f1 * 1e3,
        fb1 * 1e3,
        f1 / fwd,
        fb1 / fwd_bwd
    );
}

fn main() -> Result<()> {
    let a = Args::parse();
    let w = a.gpus;
    if w == 0 {
        bail!("--gpus must be at least 1")
    }
    let dtype = match a.dtype {
        DtypeArg::Bf16 => DType::BF16,
        DtypeArg::F16 => DType::F16,
        DtypeArg::F32 => DType::F32,
    };
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    let op = match a.full {
        true => FlashAttn::new(scale),
        false => FlashAttn::new(scale).causal(),
    };
    let barrier = Arc::new(Barrier::new(w));
    let (tx, rx) = mpsc::channel();
    let mut rx = Some(rx);
    let nccl = match a.comm {
        CommArg::Nccl => Some(NcclRing::new(w)?),
        CommArg::Loopback => None,
    };
    let mut loopback = Loopback::ring(w).into_iter();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..w)
            .map(|r| {
                let (a, op, barrier, tx) = (&a, &op, barrier.clone(), tx.clone());
                let from_ranks = if r == 0 { rx.take() } else { None };
                let lb = loopback.next().expect("one loopback end per rank");
                let nccl = nccl.clone();
                s.spawn(move || {
                    let body = || -> Result<()> {
                        let gpu = if nccl.is_some() { r } else { 0 };
                        let dev = Device::new_cuda(gpu)?;
                        let comm: Box<dyn Communicator> = match &nccl {
                            Some(ring) => Box::new(ring.join(r, &dev)?),
                            None => Box::new(lb),
                        };
                        rank_main(a, comm, dev, op, dtype, &barrier, tx, from_ranks)
                    };
                    if let Err(e) = body() {
                        // A rank that fails leaves the others waiting at a barrier: end the
                        // process (the ring itself reports failures to every rank).
                        eprintln!("rank {r}: {e:#}");
                        std::process::exit(1);
                    }
                })
            })
            .collect();
        for h in handles {
            if h.join().is_err() {
                eprintln!("a rank panicked");
                std::process::exit(1);
            }
        }
    });
    Ok(())
}
