//! CPU forward benchmark: this crate's flash attention against candle's naive attention
//! (matmul, scale, mask, softmax, matmul) and candle-nn's own CPU flash attention, f32, batch 1,
//! 8 heads, head_dim 64; plus the extra memory of one long (n = 16384) call.
//!
//! ```text
//! cargo run --release --example cpu_bench
//! cargo run --release --example cpu_bench -- --quick
//! cargo run --release --example cpu_bench -- --csv bench/cpu.csv   # also write CSV for scripts/plot.py
//! ```
//!
//! Each timing is the median of `--reps` runs after one warm-up run (a warm-up over 2 s counts as
//! one of the runs); inputs are created (and, for the naive path, the causal mask built) outside
//! the clock. In `--ours-only` mode the GF/s per CPU-second of our kernel also goes to stderr, a
//! steadier figure than wall time on a machine shared with other jobs. GF/s counts `4·b·h·sq·sk·d` flops,
//! halved under the causal mask.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_nn::attention::AttnMask;
use clap::Parser;

/// Counts live heap bytes and their high-water mark, to measure the extra memory of one call.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Parser)]
#[command(about = "CPU flash attention vs candle naive attention vs candle-nn CPU flash (f32)")]
struct Args {
    /// Small smoke run: n = 256 only, 2 repetitions, memory line at n = 2048.
    #[arg(long)]
    quick: bool,
    /// Timed repetitions per measurement (median reported); default 5 up to n = 2048 and 3
    /// beyond (candle-nn's flash takes seconds per call there), 2 with --quick.
    #[arg(long)]
    reps: Option<usize>,
    /// Query heads (= kv heads).
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// K/V heads of `--backward` (GQA/MQA; default: as many as query heads). The naive paths
    /// repeat K/V per query head.
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Sequence lengths (sq = sk); default 1024,4096 (256 with --quick).
    #[arg(long, value_delimiter = ',')]
    n: Vec<usize>,
    /// Sequence length of the memory measurement (1 head); default 16384 (2048 with --quick).
    #[arg(long)]
    mem_n: Option<usize>,
    /// Time only this crate's kernel (quick tuning runs); the ratio columns are left empty.
    #[arg(long)]
    ours_only: bool,
    /// Also write the timings as CSV (the prefill schema of scripts/plot.py).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Time the backward pass instead: `loss.backward()` of `loss = Σ out ∘ g` through this
    /// crate's op against candle autograd through `candle_flash::naive_attention` and through
    /// a lean naive graph (matmul, scale, mask, `candle_nn::ops::softmax`, matmul); plus the
    /// extra memory of one long backward (`--mem-n`, 1 head).
    #[arg(long)]
    backward: bool,
}

/// Median wall time of `reps` runs after one warm-up, in seconds. A warm-up longer than
/// [`LONG_RUN`] counts as the first run: nothing is left to warm in a call that long, and
/// candle-nn's flash at n = 4096 would otherwise cost the default run a minute.
fn time(reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    f()?;
    let warm = start.elapsed().as_secs_f64();
    let mut t = Vec::with_capacity(reps);
    if warm > LONG_RUN {
        t.push(warm);
    }
    while t.len() < reps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Columns of `--csv` (one row per implementation and shape), as scripts/plot.py reads them.
const CSV_HEADER: &str = "impl,dtype,d,seq,batch,heads,causal,ms,tflops,note\n";

/// Seconds beyond which a warm-up run counts as a measurement.
const LONG_RUN: f64 = 2.0;

/// CPU seconds this process has used (all threads), from `/proc/self/stat`; `None` elsewhere.
/// Tuning on a shared machine reads this, since wall time there depends on the neighbours.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// The 1-minute load average (`/proc/loadavg`), printed so that runs on a shared machine can be
/// judged; `None` elsewhere.
fn load_average() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next().map(str::to_owned)
}

/// The baseline a model without flash attention runs: q, k, v are `(b, h, s, d)`.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: Option<&Tensor>) -> Result<Tensor> {
    let mut att = (q.matmul(&k.t()?)? * scale)?;
    if let Some(mask) = mask {
        att = att.broadcast_add(mask)?;
    }
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    Ok(att.matmul(v)?)
}

fn causal_mask(n: usize, dev: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n * n)
        .map(|x| {
            if x % n > x / n {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, n), dev)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.backward {
        return backward_bench(&args);
    }
    let dev = Device::Cpu;
    let reps_for = |n: usize| {
        let default = match (args.quick, n > 2048) {
            (true, _) => 2,
            (false, false) => 5,
            (false, true) => 3,
        };
        args.reps.unwrap_or(default).max(1)
    };
    let ns = match (&args.n[..], args.quick) {
        ([], true) => vec![256],
        ([], false) => vec![1024, 4096],
        (n, _) => n.to_vec(),
    };
    let mem_n = args.mem_n.unwrap_or(if args.quick { 2048 } else { 16384 });
    let (h, d) = (args.heads, args.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    println!(
        "f32, batch 1, {h} heads, head_dim {d}, {} threads, median of {} after 1 warm-up \
         (a warm-up over {LONG_RUN} s counts as a run)",
        rayon::current_num_threads(),
        ns.iter()
            .map(|&n| format!("{} (n = {n})", reps_for(n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Extra memory of one long call: heap high-water mark during the call minus what was live
    // before it (the inputs). Measured first, so the per-thread scratch that the CPU path keeps
    // between calls is allocated inside it and counted. The n × n f32 score matrix a naive path
    // builds is the yardstick.
    let (q, k, v) = (
        Tensor::randn(0f32, 1., (1, mem_n, 1, d), &dev)?,
        Tensor::randn(0f32, 1., (1, mem_n, 1, d), &dev)?,
        Tensor::randn(0f32, 1., (1, mem_n, 1, d), &dev)?,
    );
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let start = Instant::now();
    let out = candle_flash::flash_attn(&q, &k, &v, scale as f32, false)?;
    let secs = start.elapsed().as_secs_f64();
    let extra = PEAK.load(Ordering::Relaxed) - before;
    let out_bytes = out.elem_count() * DType::F32.size_in_bytes();
    let scores = mem_n * mem_n * 4;
    let mib = |x: usize| x as f64 / (1 << 20) as f64;
    let memory_line = format!(
        "memory, n = {mem_n}, 1 head, head_dim {d}, non-causal ({:.0} ms): extra heap {:.2} MiB \
         (of which the output {:.2} MiB) = 1/{:.0} of one n×n f32 matrix ({:.0} MiB); limit 1/16 = {:.0} MiB",
        secs * 1e3,
        mib(extra),
        mib(out_bytes),
        scores as f64 / extra.max(1) as f64,
        mib(scores),
        mib(scores / 16),
    );
    drop((q, k, v, out));

    if let Some(l) = load_average() {
        println!("load average (1 min) at start: {l}");
    }
    println!();
    println!(
        "| n | mask | ours ms | ours GF/s | naive ms | naive GF/s | candle-nn flash ms | candle-nn GF/s | naive / ours | candle-nn / ours |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut csv = String::from(CSV_HEADER);
    for &n in &ns {
        let reps = reps_for(n);
        // (b, s, h, d) for ours and candle-nn; contiguous (b, h, s, d) copies for the naive path.
        let q = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
        let (qt, kt, vt) = (
            q.transpose(1, 2)?.contiguous()?,
            k.transpose(1, 2)?.contiguous()?,
            v.transpose(1, 2)?.contiguous()?,
        );
        for causal in [false, true] {
            let flops = 4.0 * (h * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
            let mask = if causal {
                Some(causal_mask(n, &dev)?)
            } else {
                None
            };
            let cpu0 = cpu_seconds();
            let ours = time(reps, &mut || {
                candle_flash::flash_attn(&q, &k, &v, scale as f32, causal)?;
                Ok(())
            })?;
            if let (true, Some(c0), Some(c1)) = (args.ours_only, cpu0, cpu_seconds()) {
                let per_core = flops * (reps + 1) as f64 / (c1 - c0) / 1e9;
                eprintln!("n {n} causal {causal}: ours {per_core:.1} GF/s per CPU-second");
            }
            let skip = |t: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
                if args.ours_only {
                    Ok(f64::NAN)
                } else {
                    time(reps, t)
                }
            };
            let base = skip(&mut || {
                naive(&qt, &kt, &vt, scale, mask.as_ref())?;
                Ok(())
            })?;
            let nn_mask = if causal {
                AttnMask::causal()
            } else {
                AttnMask::None
            };
            let nn = skip(&mut || {
                candle_nn::attention::flash_attn::<f32>(
                    &q,
                    &k,
                    &v,
                    scale as f32,
                    nn_mask.clone(),
                    None,
                    None,
                )?;
                Ok(())
            })?;
            let gfs = |t: f64| flops / t / 1e9;
            for (name, t) in [
                ("candle-flash", ours),
                ("candle-naive", base),
                ("candle-nn-flash", nn),
            ] {
                if t.is_finite() {
                    csv.push_str(&format!(
                        "{name},f32,{d},{n},1,{h},{causal},{:.4},{:.6},\n",
                        t * 1e3,
                        flops / t / 1e12
                    ));
                }
            }
            println!(
                "| {n} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.2}x |",
                if causal { "causal" } else { "none" },
                ours * 1e3,
                gfs(ours),
                base * 1e3,
                gfs(base),
                nn * 1e3,
                gfs(nn),
                base / ours,
                nn / ours,
            );
        }
    }

    if let Some(path) = &args.csv {
        std::fs::write(path, csv)?;
        println!("CSV written to {}", path.display());
    }
    println!();
    println!("{memory_line}");
    if let Some(l) = load_average() {
        println!("load average (1 min) at end: {l}");
    }
    Ok(())
}

/// Gradients of q, k and v through `loss = Σ f(q, k, v) ∘ g`: the graph is built once (forward
/// outside the clock), then [`time`] runs `loss.backward()` alone.
struct BackwardRun {
    loss: Tensor,
    vars: [candle::Var; 3],
}

impl BackwardRun {
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        f: impl Fn(&Tensor, &Tensor, &Tensor) -> candle::Result<Tensor>,
    ) -> Result<Self> {
        let vars = [
            candle::Var::from_tensor(q)?,
            candle::Var::from_tensor(k)?,
            candle::Var::from_tensor(v)?,
        ];
        let out = f(
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
        )?;
        let loss = (out * g)?.sum_all()?;
        Ok(Self { loss, vars })
    }

    /// One backward pass; fails unless q, k and v all get a gradient.
    fn backward(&self) -> Result<candle::backprop::GradStore> {
        let grads = self.loss.backward()?;
        for v in &self.vars {
            anyhow::ensure!(grads.get(v.as_tensor()).is_some(), "a gradient is missing");
        }
        Ok(grads)
    }
}

/// The lean baseline graph with autograd: q, k, v `(b, s, h, d)` are transposed inside (K/V
/// repeated per query head under GQA), so that all three paths take the same inputs.
fn lean_naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle::Result<Tensor> {
    let (b, s, h, d) = q.dims4()?;
    let (sk, hk) = (k.dim(1)?, k.dim(2)?);
    let repeat = |t: &Tensor| -> candle::Result<Tensor> {
        let t = t.transpose(1, 2)?;
        if hk == h {
            return t.contiguous();
        }
        t.unsqueeze(2)?
            .expand((b, hk, h / hk, sk, d))?
            .reshape((b, h, sk, d))
    };
    let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, repeat(k)?, repeat(v)?);
    debug_assert_eq!(q.dim(2)?, s);
    let mut att = (q.matmul(&k.t()?)? * scale)?;
    if let Some(mask) = mask {
        att = att.broadcast_add(mask)?;
    }
    let att = candle_nn::ops::softmax(&att, candle::D::Minus1)?;
    att.matmul(&v)?.transpose(1, 2)
}

/// `--backward`: backward timings (f32, batch 1, `heads` heads, `kv_heads` kv heads) and the extra memory
/// of one long flash backward.
fn backward_bench(args: &Args) -> Result<()> {
    let dev = Device::Cpu;
    let reps_for = |n: usize| {
        args.reps.unwrap_or(if args.quick { 2 } else { 3 }).max(1)
            + usize::from(n < 2048 && !args.quick) * 2
    };
    let ns = match (&args.n[..], args.quick) {
        ([], true) => vec![256],
        ([], false) => vec![1024, 4096],
        (n, _) => n.to_vec(),
    };
    let mem_n = args.mem_n.unwrap_or(if args.quick { 2048 } else { 16384 });
    let (h, d) = (args.heads, args.head_dim);
    let hk = args.kv_heads.unwrap_or(h);
    let scale = 1.0 / (d as f64).sqrt();
    println!(
        "backward only: loss.backward() of loss = sum(out * g) on a graph built (forward run) \
         outside the clock, the same for every path; f32, batch 1, {h} heads ({hk} kv heads), \
         head_dim {d}, {} threads, median of {} after 1 warm-up",
        rayon::current_num_threads(),
        ns.iter()
            .map(|&n| format!("{} (n = {n})", reps_for(n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(l) = load_average() {
        println!("load average (1 min) at start: {l}");
    }
    let memory_line = backward_memory(mem_n, d, scale)?;
    println!();
    println!(
        "| n | mask | flash bwd ms | flash GF/s | naive_attention bwd ms | naive_attention / flash | lean naive bwd ms | lean / flash |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for &n in &ns {
        let reps = reps_for(n);
        let q = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, n, hk, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, n, hk, d), &dev)?;
        let g = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
        for causal in [false, true] {
            // The FlashAttention convention: 2.5x the forward's 4·n²·d flops per head.
            let flops = 2.5 * 4.0 * (h * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
            let opts = if causal {
                candle_flash::FlashAttn::new(scale as f32).causal()
            } else {
                candle_flash::FlashAttn::new(scale as f32)
            };
            let flash = BackwardRun::new(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v))?;
            let cpu0 = cpu_seconds();
            let ours = time(reps, &mut || {
                flash.backward()?;
                Ok(())
            })?;
            if let (true, Some(c0), Some(c1)) = (args.ours_only, cpu0, cpu_seconds()) {
                let per_core = flops * (reps + 1) as f64 / (c1 - c0) / 1e9;
                eprintln!(
                    "n {n} causal {causal}: flash backward {per_core:.1} GF/s per CPU-second"
                );
            }
            drop(flash);
            let (base, lean) = if args.ours_only {
                (f64::NAN, f64::NAN)
            } else {
                let naive = BackwardRun::new(&q, &k, &v, &g, |q, k, v| {
                    candle_flash::naive_attention(q, k, v, &opts)
                })?;
                let base = time(reps, &mut || {
                    naive.backward()?;
                    Ok(())
                })?;
                drop(naive);
                let mask = if causal {
                    Some(causal_mask(n, &dev)?)
                } else {
                    None
                };
                let lean = BackwardRun::new(&q, &k, &v, &g, |q, k, v| {
                    lean_naive(q, k, v, scale, mask.as_ref())
                })?;
                let t = time(reps, &mut || {
                    lean.backward()?;
                    Ok(())
                })?;
                (base, t)
            };
            println!(
                "| {n} | {} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.2}x |",
                if causal { "causal" } else { "none" },
                ours * 1e3,
                flops / ours / 1e9,
                base * 1e3,
                base / ours,
                lean * 1e3,
                lean / ours,
            );
        }
    }
    println!();
    println!("{memory_line}");
    if let Some(l) = load_average() {
        println!("load average (1 min) at end: {l}");
    }
    Ok(())
}

/// Extra heap of one flash backward at `n` (1 head, non-causal): the heap high-water mark
/// during `loss.backward()` minus what was live before it (inputs, output, lse, g) and minus
/// the three gradients it returns. Candle's autograd adds its own tensors around the op (dO,
/// gradient accumulators), so the same measurement of a control graph whose op is a plain
/// elementwise `q + k + v` (same shapes, same loss) is printed too: the difference is the
/// attention backward's own.
fn backward_memory(n: usize, d: usize, scale: f64) -> Result<String> {
    let dev = Device::Cpu;
    let mk = || Tensor::randn(0f32, 1., (1, n, 1, d), &dev);
    let (q, k, v, g) = (mk()?, mk()?, mk()?, mk()?);
    let grad_bytes = 3 * n * d * DType::F32.size_in_bytes();
    let measure = |run: &BackwardRun| -> Result<(usize, f64)> {
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let start = Instant::now();
        let grads = run.backward()?;
        let secs = start.elapsed().as_secs_f64();
        let peak = PEAK.load(Ordering::Relaxed);
        drop(grads);
        Ok((peak.saturating_sub(before + grad_bytes), secs))
    };
    let opts = candle_flash::FlashAttn::new(scale as f32);
    let flash = BackwardRun::new(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v))?;
    let (extra, secs) = measure(&flash)?;
    drop(flash);
    let control = BackwardRun::new(&q, &k, &v, &g, |q, k, v| (q + k)? + v)?;
    let (control_extra, _) = measure(&control)?;
    let scores = n * n * 4;
    let mib = |x: usize| x as f64 / (1 << 20) as f64;
    Ok(format!(
        "memory, n = {n}, 1 head, head_dim {d}, non-causal, backward ({:.0} ms): heap peak during \
         loss.backward() beyond its inputs and the three gradients: flash {:.2} MiB, control \
         graph (q + k + v) {:.2} MiB, difference {:.2} MiB = 1/{:.0} of one n×n f32 matrix \
         ({:.0} MiB); limit 1/16 = {:.0} MiB",
        secs * 1e3,
        mib(extra),
        mib(control_extra),
        mib(extra.saturating_sub(control_extra)),
        scores as f64 / extra.saturating_sub(control_extra).max(1) as f64,
        mib(scores),
        mib(scores / 16),
    ))
}
