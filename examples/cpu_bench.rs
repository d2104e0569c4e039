//! CPU benchmark: this crate's flash attention in f32, f16 and bf16 (each bf16 product path the
//! CPU has, or the ones named), with the GF/s of each beside f32 in the same run; in f32 also
//! candle's naive attention (matmul, scale, mask, softmax, matmul) and candle-nn's CPU flash
//! attention. Batch 1, 8 heads; plus the extra memory of one long (n = 16384) call.
//!
//! ```text
//! cargo run --release --example cpu_bench
//! cargo run --release --example cpu_bench -- --quick
//! cargo run --release --example cpu_bench -- --dtype f32,f16,bf16 --head-dim 64,128 --ours-only
//! cargo run --release --example cpu_bench -- --dtype f32,bf16 --cpu-matmul auto,avx512bf16,f32
//! cargo run --release --example cpu_bench -- --dtype f32,bf16 --backward
//! cargo run --release --example cpu_bench -- --csv bench/results/cpu.csv   # one row per measurement
//! ```
//!
//! Each timing is the median of `--reps` runs after one warm-up run (a warm-up over 2 s counts as
//! one of the runs); inputs are created (and, for the naive path, the causal mask built) outside
//! the clock. In `--ours-only` mode the GF/s per CPU-second of our kernel also goes to stderr, a
//! steadier figure than wall time on a machine shared with other jobs. GF/s counts `4·b·h·sq·sk·d` flops,
//! halved under the causal mask (2.5 times that for the backward pass). The `× f32` column is
//! the GF/s of a row over that of this crate's f32 path on the same shape in the same run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_flash::{CpuMatmul, FlashAttn, PlanOverride};
use candle_nn::attention::AttnMask;
use clap::Parser;

#[path = "common/results.rs"]
mod results;

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
#[command(
    about = "CPU flash attention in f32/f16/bf16 vs candle naive attention vs candle-nn CPU flash"
)]
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
    /// Head dims (several allowed: 64,128).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    head_dim: Vec<usize>,
    /// Sequence lengths (sq = sk); default 1024,4096 (256 with --quick).
    #[arg(long, value_delimiter = ',')]
    n: Vec<usize>,
    /// Element types of this crate's kernel (several allowed: f32,f16,bf16). f32 is always
    /// timed too, as the yardstick of the `× f32` column.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    dtype: Vec<Dtype>,
    /// Product paths of the bf16 rows (several allowed): `auto` (the CPU's own choice), `amx`,
    /// `avx512bf16`, `f32`, `f32avx2`, `f32portable`. The f32 and f16 rows always run `auto`;
    /// paths this CPU lacks are reported and skipped.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    cpu_matmul: Vec<Matmul>,
    /// Causal mask only (default: both, unmasked first); `--causal false` for unmasked only.
    #[arg(long)]
    causal: Option<bool>,
    /// Sequence length of the memory measurement (1 head); default 16384 (2048 with --quick);
    /// 0 skips it.
    #[arg(long)]
    mem_n: Option<usize>,
    /// Time only this crate's kernel (quick tuning runs): no naive or candle-nn rows.
    #[arg(long)]
    ours_only: bool,
    /// Also write every measurement as a row of CSV (examples/common/results.rs: date, commit,
    /// device, command, then the prefill columns of scripts/plot.py and the path, pass and ratio).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Time the backward pass instead: `loss.backward()` of `loss = Σ out ∘ g` through this
    /// crate's op against candle autograd through `candle_flash::naive_attention` and through
    /// a lean naive graph (matmul, scale, mask, `candle_nn::ops::softmax`, matmul); plus the
    /// extra memory of one long backward (`--mem-n`, 1 head).
    #[arg(long)]
    backward: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    fn dtype(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::Bf16 => DType::BF16,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Matmul {
    Auto,
    Amx,
    Avx512bf16,
    F32,
    F32avx2,
    F32portable,
}

impl Matmul {
    fn forced(self) -> Option<CpuMatmul> {
        match self {
            Matmul::Auto => None,
            Matmul::Amx => Some(CpuMatmul::Amx),
            Matmul::Avx512bf16 => Some(CpuMatmul::Avx512Bf16),
            Matmul::F32 => Some(CpuMatmul::F32),
            Matmul::F32avx2 => Some(CpuMatmul::F32Avx2),
            Matmul::F32portable => Some(CpuMatmul::F32Portable),
        }
    }
}

/// One timed configuration of this crate's kernel: element type and product path.
#[derive(Clone, Copy, Debug)]
struct Variant {
    dtype: Dtype,
    forced: Option<CpuMatmul>,
    /// Timed in the backward pass (whose own choice of path may differ).
    backward: bool,
}

impl Variant {
    /// The path that runs (the forced one, or the CPU's own choice for the dtype).
    fn path(&self) -> CpuMatmul {
        self.forced
            .unwrap_or_else(|| CpuMatmul::auto(self.dtype.dtype(), self.backward))
    }
    /// The `impl` column: `candle-flash` for the CPU's own path, else with the path forced.
    fn imp(&self) -> String {
        match self.forced {
            None => "candle-flash".into(),
            Some(m) => format!("candle-flash-{}", format!("{m:?}").to_lowercase()),
        }
    }
    fn label(&self) -> String {
        let path = format!("{:?}", self.path());
        match self.forced {
            None => format!("{} ({path})", self.dtype.name()),
            Some(_) => format!("{} forced {path}", self.dtype.name()),
        }
    }
    fn opts(&self, scale: f32, causal: bool) -> FlashAttn {
        let o = FlashAttn::new(scale);
        let o = if causal { o.causal() } else { o };
        match self.forced {
            None => o,
            Some(m) => o.plan_override(PlanOverride {
                cpu_matmul: Some(m),
                ..PlanOverride::default()
            }),
        }
    }
}

/// The variants to time: f32 first (the yardstick), then each dtype asked for; bf16 once per
/// path asked for that the CPU has.
fn variants(args: &Args) -> Vec<Variant> {
    let have = CpuMatmul::available();
    let backward = args.backward;
    let mut v = vec![Variant {
        dtype: Dtype::F32,
        forced: None,
        backward,
    }];
    for &dtype in &args.dtype {
        let paths: Vec<Option<CpuMatmul>> = if dtype == Dtype::Bf16 {
            args.cpu_matmul.iter().map(|m| m.forced()).collect()
        } else {
            vec![None]
        };
        for forced in paths {
            if let Some(m) = forced {
                if !have.contains(&m) {
                    println!(
                        "NOT RUN: {} with {m:?}: this CPU cannot run that path",
                        dtype.name()
                    );
                    continue;
                }
            }
            let new = Variant {
                dtype,
                forced,
                backward,
            };
            let dup = v
                .iter()
                .any(|x| x.dtype == dtype && x.path() == new.path() && x.forced == forced);
            if !dup {
                v.push(new);
            }
        }
    }
    v
}

/// Columns of `--csv` after the provenance ones: the cpu-prefill schema of bench/report.py
/// (`impl` is `candle-flash` for the CPU's own path, `candle-flash-<path>` for a forced one),
/// then the K/V heads, the product path and the ratio to this crate's f32 path on the same
/// shape in the same run.
const CSV_COLUMNS: [&str; 13] = [
    "impl", "dtype", "pass", "mask", "batch", "seq", "heads", "head_dim", "ms", "gflops",
    "kv_heads", "path", "x_f32",
];

/// One measurement, printed as a table row and written as a CSV row.
struct Row<'a> {
    imp: String,
    dtype: &'a str,
    path: String,
    pass: &'a str,
    d: usize,
    n: usize,
    heads: usize,
    kv_heads: usize,
    causal: bool,
    secs: f64,
    flops: f64,
    /// GF/s of this crate's f32 path on the same shape.
    f32_gfs: f64,
}

impl Row<'_> {
    fn emit(&self, csv: &mut Option<results::Csv>) -> Result<()> {
        let gfs = self.flops / self.secs / 1e9;
        let ratio = gfs / self.f32_gfs;
        let mask = if self.causal { "causal" } else { "none" };
        println!(
            "| {} | {} | {mask} | {} {} {} | {:.1} | {:.1} | {:.2}x |",
            self.d,
            self.n,
            self.imp,
            self.dtype,
            self.path,
            self.secs * 1e3,
            gfs,
            ratio
        );
        if let Some(csv) = csv {
            csv.row(&[
                self.imp.clone(),
                self.dtype.into(),
                self.pass.into(),
                mask.into(),
                "1".into(),
                self.n.to_string(),
                self.heads.to_string(),
                self.d.to_string(),
                format!("{:.4}", self.secs * 1e3),
                format!("{gfs:.2}"),
                self.kv_heads.to_string(),
                self.path.clone(),
                format!("{ratio:.3}"),
            ])?;
        }
        Ok(())
    }
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

/// Seconds beyond which a warm-up run counts as a measurement.
const LONG_RUN: f64 = 2.0;

/// CPU seconds this process has used (all threads), summed over `/proc/self/task/*/schedstat`
/// (nanoseconds on the CPU; `/proc/self/stat` counts 10 ms ticks, too coarse for one shape's
/// runs); `None` elsewhere. Threads that exited since are not counted, so only differences
/// over a stretch in which rayon's pool lives are meaningful. Tuning on a shared machine reads
/// this, since wall time there depends on the neighbours.
fn cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
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

/// The sequence lengths and masks the arguments ask for.
fn plan(args: &Args) -> (Vec<usize>, Vec<bool>) {
    let ns = match (&args.n[..], args.quick) {
        ([], true) => vec![256],
        ([], false) => vec![1024, 4096],
        (n, _) => n.to_vec(),
    };
    let masks = match args.causal {
        None => vec![false, true],
        Some(c) => vec![c],
    };
    (ns, masks)
}

/// Forward repetitions at length `n`.
fn forward_reps(args: &Args, n: usize) -> usize {
    let default = match (args.quick, n > 2048) {
        (true, _) => 2,
        (false, false) => 5,
        (false, true) => 3,
    };
    args.reps.unwrap_or(default).max(1)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::Cpu;
    let mut csv = match &args.csv {
        Some(path) => Some(results::Csv::create(path, &dev, &CSV_COLUMNS)?),
        None => None,
    };
    if args.backward {
        backward_bench(&args, &mut csv)?;
    } else {
        forward_bench(&args, &mut csv)?;
    }
    if let Some(path) = &args.csv {
        println!("CSV written to {}", path.display());
    }
    Ok(())
}

fn forward_bench(args: &Args, csv: &mut Option<results::Csv>) -> Result<()> {
    let dev = Device::Cpu;
    let (ns, masks) = plan(args);
    let reps_for = |n| forward_reps(args, n);
    let mem_n = args.mem_n.unwrap_or(if args.quick { 2048 } else { 16384 });
    let h = args.heads;
    let variants = variants(args);
    println!(
        "forward, batch 1, {h} heads, head_dim {:?}, {} threads, median of {} after 1 warm-up \
         (a warm-up over {LONG_RUN} s counts as a run); the machine may be shared",
        args.head_dim,
        rayon::current_num_threads(),
        ns.iter()
            .map(|&n| format!("{} (n = {n})", reps_for(n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let memory_line = (mem_n > 0)
        .then(|| forward_memory(mem_n, args.head_dim[0]))
        .transpose()?;
    if let Some(l) = load_average() {
        println!("load average (1 min) at start: {l}");
    }
    println!();
    println!("| d | n | mask | implementation | ms | GF/s | × f32 |");
    println!("|---|---|---|---|---:|---:|---:|");
    for &d in &args.head_dim {
        let scale = 1.0 / (d as f64).sqrt();
        for &n in &ns {
            let reps = reps_for(n);
            // (b, s, h, d) for ours and candle-nn; contiguous (b, h, s, d) copies for the naive
            // path. Each dtype's inputs are the f32 ones rounded.
            let q = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
            for &causal in &masks {
                let flops = 4.0 * (h * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
                let mut f32_gfs = f64::NAN;
                for var in &variants {
                    let dt = var.dtype.dtype();
                    let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                    let opts = var.opts(scale as f32, causal);
                    let cpu0 = cpu_seconds();
                    let t = time(reps, &mut || {
                        opts.forward(&q, &k, &v)?;
                        Ok(())
                    })?;
                    if let (true, Some(c0), Some(c1)) = (args.ours_only, cpu0, cpu_seconds()) {
                        let per_core = flops * (reps + 1) as f64 / (c1 - c0) / 1e9;
                        eprintln!(
                            "d {d} n {n} causal {causal} {}: {per_core:.1} GF/s per CPU-second",
                            var.label()
                        );
                    }
                    if var.dtype == Dtype::F32 && var.forced.is_none() {
                        f32_gfs = flops / t / 1e9;
                    }
                    Row {
                        imp: var.imp(),
                        dtype: var.dtype.name(),
                        path: format!("{:?}", var.path()),
                        pass: "forward",
                        d,
                        n,
                        heads: h,
                        kv_heads: h,
                        causal,
                        secs: t,
                        flops,
                        f32_gfs,
                    }
                    .emit(csv)?;
                }
                if args.ours_only {
                    continue;
                }
                let (qt, kt, vt) = (
                    q.transpose(1, 2)?.contiguous()?,
                    k.transpose(1, 2)?.contiguous()?,
                    v.transpose(1, 2)?.contiguous()?,
                );
                let mask = if causal {
                    Some(causal_mask(n, &dev)?)
                } else {
                    None
                };
                let base = time(reps, &mut || {
                    naive(&qt, &kt, &vt, scale, mask.as_ref())?;
                    Ok(())
                })?;
                let nn_mask = if causal {
                    AttnMask::causal()
                } else {
                    AttnMask::None
                };
                let nn = time(reps, &mut || {
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
                for (imp, t) in [("candle-naive", base), ("candle-nn-flash", nn)] {
                    Row {
                        imp: imp.into(),
                        dtype: "f32",
                        path: String::new(),
                        pass: "forward",
                        d,
                        n,
                        heads: h,
                        kv_heads: h,
                        causal,
                        secs: t,
                        flops,
                        f32_gfs,
                    }
                    .emit(csv)?;
                }
            }
        }
    }
    if let Some(line) = memory_line {
        println!();
        println!("{line}");
    }
    if let Some(l) = load_average() {
        println!("load average (1 min) at end: {l}");
    }
    Ok(())
}

/// Extra memory of one long f32 call: heap high-water mark during the call minus what was live
/// before it (the inputs). Measured first, so the per-thread scratch that the CPU path keeps
/// between calls is allocated inside it and counted. The n × n f32 score matrix a naive path
/// builds is the yardstick.
fn forward_memory(mem_n: usize, d: usize) -> Result<String> {
    let dev = Device::Cpu;
    let scale = 1.0 / (d as f64).sqrt();
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
    Ok(format!(
        "memory, n = {mem_n}, 1 head, head_dim {d}, f32, non-causal ({:.0} ms): extra heap {:.2} MiB \
         (of which the output {:.2} MiB) = 1/{:.0} of one n×n f32 matrix ({:.0} MiB); limit 1/16 = {:.0} MiB",
        secs * 1e3,
        mib(extra),
        mib(out_bytes),
        scores as f64 / extra.max(1) as f64,
        mib(scores),
        mib(scores / 16),
    ))
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

/// `--backward`: backward timings (batch 1, `heads` heads, `kv_heads` kv heads) of each variant
/// and, in f32, of the naive graphs; and the extra memory of one long flash backward.
fn backward_bench(args: &Args, csv: &mut Option<results::Csv>) -> Result<()> {
    let dev = Device::Cpu;
    let (ns, masks) = plan(args);
    let reps_for = |n: usize| {
        args.reps.unwrap_or(if args.quick { 2 } else { 3 }).max(1)
            + usize::from(n < 2048 && !args.quick) * 2
    };
    let mem_n = args.mem_n.unwrap_or(if args.quick { 2048 } else { 16384 });
    let h = args.heads;
    let hk = args.kv_heads.unwrap_or(h);
    let variants = variants(args);
    println!(
        "backward only: loss.backward() of loss = sum(out * g) on a graph built (forward run) \
         outside the clock, the same for every path; batch 1, {h} heads ({hk} kv heads), \
         head_dim {:?}, {} threads, median of {} after 1 warm-up; the machine may be shared",
        args.head_dim,
        rayon::current_num_threads(),
        ns.iter()
            .map(|&n| format!("{} (n = {n})", reps_for(n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(l) = load_average() {
        println!("load average (1 min) at start: {l}");
    }
    let memory_line = (mem_n > 0)
        .then(|| {
            backward_memory(
                mem_n,
                args.head_dim[0],
                1.0 / (args.head_dim[0] as f64).sqrt(),
            )
        })
        .transpose()?;
    println!();
    println!("| d | n | mask | implementation | bwd ms | GF/s | × f32 |");
    println!("|---|---|---|---|---:|---:|---:|");
    for &d in &args.head_dim {
        let scale = 1.0 / (d as f64).sqrt();
        for &n in &ns {
            let reps = reps_for(n);
            let q = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (1, n, hk, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (1, n, hk, d), &dev)?;
            let g = Tensor::randn(0f32, 1., (1, n, h, d), &dev)?;
            for &causal in &masks {
                // The FlashAttention convention: 2.5x the forward's 4·n²·d flops per head.
                let flops = 2.5 * 4.0 * (h * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
                let mut f32_gfs = f64::NAN;
                let row = |imp: String, dtype, path: String, secs, f32_gfs| Row {
                    imp,
                    dtype,
                    path,
                    pass: "backward",
                    d,
                    n,
                    heads: h,
                    kv_heads: hk,
                    causal,
                    secs,
                    flops,
                    f32_gfs,
                };
                for var in &variants {
                    let dt = var.dtype.dtype();
                    let (q, k, v, g) = (
                        q.to_dtype(dt)?,
                        k.to_dtype(dt)?,
                        v.to_dtype(dt)?,
                        g.to_dtype(dt)?,
                    );
                    let opts = var.opts(scale as f32, causal);
                    let flash = BackwardRun::new(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v))?;
                    let cpu0 = cpu_seconds();
                    let t = time(reps, &mut || {
                        flash.backward()?;
                        Ok(())
                    })?;
                    if let (true, Some(c0), Some(c1)) = (args.ours_only, cpu0, cpu_seconds()) {
                        let per_core = flops * (reps + 1) as f64 / (c1 - c0) / 1e9;
                        eprintln!(
                            "d {d} n {n} causal {causal} {}: backward {per_core:.1} GF/s per CPU-second",
                            var.label()
                        );
                    }
                    if var.dtype == Dtype::F32 && var.forced.is_none() {
                        f32_gfs = flops / t / 1e9;
                    }
                    row(
                        var.imp(),
                        var.dtype.name(),
                        format!("{:?}", var.path()),
                        t,
                        f32_gfs,
                    )
                    .emit(csv)?;
                }
                if args.ours_only {
                    continue;
                }
                let opts = if causal {
                    FlashAttn::new(scale as f32).causal()
                } else {
                    FlashAttn::new(scale as f32)
                };
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
                let lean_t = time(reps, &mut || {
                    lean.backward()?;
                    Ok(())
                })?;
                row(
                    "candle-naive-attention".into(),
                    "f32",
                    String::new(),
                    base,
                    f32_gfs,
                )
                .emit(csv)?;
                row(
                    "candle-naive-lean".into(),
                    "f32",
                    String::new(),
                    lean_t,
                    f32_gfs,
                )
                .emit(csv)?;
            }
        }
    }
    if let Some(line) = memory_line {
        println!();
        println!("{line}");
    }
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
