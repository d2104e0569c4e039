//! Decode benchmark, one binary for the CPU and (built with `--features cuda,candle-nn/cuda`)
//! the GPU: one decode step (`seq_q` new query rows per sequence, causal, bottom-right aligned,
//! scale `1/sqrt(d)`) of `candle_flash` against candle's naive attention, next to a bandwidth
//! reference measured in the same process.
//!
//! ```text
//! # A readable table for a few shapes:
//! cargo run --release --example decode_bench -- --batch 1,8 --kv 4096,16384 --dtype f32,bf16
//! # The CPU acceptance grid, as CSV (bench/results/cpu-decode.csv):
//! cargo run --release --example decode_bench -- --sweep
//! # The GPU grid (bench/results/gpu-decode.csv), or a small part of it while iterating:
//! cargo run --release --features cuda,candle-nn/cuda --example decode_bench -- --device cuda --sweep
//! cargo run --release --features cuda,candle-nn/cuda --example decode_bench -- --device cuda --quick
//! # Decode from an FP8 (e4m3) cache beside a bf16 one (bench/results/gpu-fp8-decode.csv):
//! cargo run --release --features cuda,candle-nn/cuda --example decode_bench -- --device cuda \
//!     --dtype bf16,f8e4m3 --batch 1,8 --kv 4096,32768,131072 --seq-q 1,4 --naive off
//! # Exactly the shapes of another CSV (columns heads, kv_heads, head_dim, batch, seq_q, kv,
//! # dtype, layout, in any order, among others):
//! cargo run --release --example decode_bench -- --device cuda --shapes-csv torch.csv
//! ```
//!
//! Every row is timed the same way: inputs built outside the clock; warm-up; then the median of
//! `--reps` runs, each a batch of back-to-back calls on the GPU (divided out), the device
//! synchronised before the clock stops. Where K and V are smaller than twice the last-level
//! cache (the GPU's 50 MB L2, the CPU's L3), the calls rotate over enough input sets to cover
//! twice that cache, so no call finds its cache already there (a model's other layers evict it).
//!
//! CSV columns, after `date,commit,device,command`:
//! `impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,ref_gbps`, with `impl`
//! `candle-flash` or `candle-naive`, `layout` `contiguous`, `headmajor` (K and V stored
//! `(batch, kv_heads, kv, head_dim)`, passed as a view) or `paged<N>` (pages of N rows over a
//! shuffled block table), `us` the median time of one call, `gbps` the bytes one decode step
//! must move (K and V read once, plus q and the output) per second, whichever the
//! implementation, and `ref_gbps` the reference measured just before the row: on the CPU a
//! multi-threaded (rayon) sum over a 1 GiB buffer (bytes read), on the GPU a 1 GiB
//! device-to-device copy (bytes read plus written).

#[path = "common/results.rs"]
mod results;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};

/// The CSV columns after the four common ones.
const COLUMNS: [&str; 12] = [
    "impl", "dtype", "layout", "heads", "kv_heads", "head_dim", "batch", "seq_q", "kv", "us",
    "gbps", "ref_gbps",
];
/// The GPU's last-level cache: the H100's L2 (50 MB); rotating over twice it also covers the
/// smaller L2 of other GPUs.
const GPU_CACHE_BYTES: usize = 50_000_000;
/// The CPU's last-level cache when sysfs does not say (a 32 MiB L3).
const CPU_CACHE_BYTES: usize = 32 << 20;
/// Input sets are rotated up to this many (tiny shapes; their sum covers twice the cache).
const MAX_SETS: usize = 512;
/// Bytes of the reference buffer: far larger than any cache.
const REF_BYTES: usize = 1 << 30;
/// On the GPU a timed run is a batch of calls lasting at least this long, so launch and
/// synchronisation latency do not count for calls of a few microseconds and a run of the
/// longest calls (about 1.5 ms) still holds several; one untimed run of that length goes first.
/// (Against runs of 1 ms without it, on an H200, the same times within 1% from 14 us to 1.4 ms.)
const GPU_RUN_SECS: f64 = 5e-3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum NaiveArg {
    /// On the CPU, and on the GPU outside sweeps and --shapes-csv.
    Auto,
    On,
    Off,
}

#[derive(Parser)]
#[command(
    about = "One decode step: candle-flash vs candle naive attention, beside a bandwidth \
                   reference measured in the same run"
)]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Time the device's grid (see the module docs) and write CSV.
    #[arg(long, conflicts_with_all = ["quick", "shapes_csv"])]
    sweep: bool,
    /// A small part of the grid, for iterating.
    #[arg(long, conflicts_with = "shapes_csv")]
    quick: bool,
    /// Time exactly the shapes of this CSV (columns heads, kv_heads, head_dim, batch, seq_q,
    /// kv, dtype, layout; others ignored; repeated shapes timed once).
    #[arg(long)]
    shapes_csv: Option<PathBuf>,
    /// Where the CSV goes (default with --sweep: bench/results/<cpu|gpu>-decode.csv).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Element types, e.g. `f32,bf16` (default f32 on the CPU, bf16 on the GPU).
    #[arg(long, value_delimiter = ',')]
    dtype: Vec<String>,
    /// Batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// KV cache lengths.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384")]
    kv: Vec<usize>,
    /// New query rows per sequence.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    seq_q: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Also time the cache in pages of this many rows over a shuffled block table.
    #[arg(long)]
    page: Option<usize>,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 11)]
    reps: usize,
    /// Skip shapes whose K and V hold more than this many GB.
    #[arg(long, default_value_t = 16.0)]
    max_gb: f64,
    /// Reuse one input set whatever its size (K and V may then be served from the cache): the
    /// kernels' compute speed rather than the memory's.
    #[arg(long)]
    hot: bool,
    /// Also time the decode kernel at these forced split counts of the keys (rows
    /// `candle-flash-s<N>`): the planner's choice beside its alternatives.
    #[arg(long, value_delimiter = ',')]
    splits: Vec<usize>,
    /// Also time these decode kernel instances (`r1_k2_c32_s2`, see `PlanOverride`), each at
    /// the planner's split count for it or at every count of --splits.
    #[arg(long, value_delimiter = ',')]
    instances: Vec<String>,
    /// Time candle's naive attention too.
    #[arg(long, value_enum, default_value = "auto")]
    naive: NaiveArg,
    /// Skip the naive baseline where its K and V repeated to the query heads hold more than
    /// this many GB.
    #[arg(long, default_value_t = 5.0)]
    naive_max_gb: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Contiguous,
    /// K and V stored `(b, kv_heads, kv, d)` (each head's keys together, as PyTorch lays out
    /// its caches) and passed as the `(b, kv, kv_heads, d)` view of that storage.
    HeadMajor,
    /// Pages of this many rows over a shuffled block table.
    Paged(usize),
}

impl Layout {
    fn name(self) -> String {
        match self {
            Layout::Contiguous => "contiguous".into(),
            Layout::HeadMajor => "headmajor".into(),
            Layout::Paged(n) => format!("paged{n}"),
        }
    }

    fn parse(s: &str) -> Result<Self> {
        match s {
            "contiguous" => Ok(Layout::Contiguous),
            "headmajor" => Ok(Layout::HeadMajor),
            _ => match s.strip_prefix("paged").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(Layout::Paged(n)),
                _ => bail!("layout {s:?}: expected contiguous, headmajor or paged<N>"),
            },
        }
    }
}

/// A dtype of the queries, or `f8e4m3` for an FP8 (e4m3) K/V cache under bf16 queries (the
/// output is bf16; the cache's descales are 1).
fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f8e4m3" | "e4m3" => Ok(DType::F8E4M3),
        _ => bail!("dtype {s:?}: expected f32, f16, bf16 or f8e4m3"),
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F8E4M3 => "f8e4m3",
        _ => "other",
    }
}

/// One decode problem.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    batch: usize,
    seq_q: usize,
    kv: usize,
    dtype: DType,
    layout: Layout,
}

impl Shape {
    /// The queries' (and output's) dtype: bf16 over an FP8 cache.
    fn q_dtype(&self) -> DType {
        match self.dtype {
            DType::F8E4M3 => DType::BF16,
            d => d,
        }
    }

    /// Bytes of K and V.
    fn kv_bytes(&self) -> usize {
        2 * self.batch * self.kv * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes a decode step must move: K and V read once, q read, the output written.
    fn step_bytes(&self) -> usize {
        let q = self.batch * self.seq_q * self.heads * self.head_dim;
        self.kv_bytes() + 2 * q * self.q_dtype().size_in_bytes()
    }

    /// Bytes of the naive baseline's K and V, repeated to the query heads.
    fn naive_bytes(&self) -> usize {
        self.kv_bytes() / self.kv_heads * self.heads
    }

    fn check(&self) -> Result<()> {
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            bail!(
                "heads {} must be a multiple of kv_heads {}",
                self.heads,
                self.kv_heads
            )
        }
        if self.batch == 0 || self.seq_q == 0 || self.head_dim == 0 {
            bail!("batch, seq_q and head_dim must be positive: {self:?}")
        }
        Ok(())
    }
}

/// The CPU acceptance grid: f32 and bf16, 32/8 and 8/1 heads, d 128, batch 1, 3 and 8, one
/// query row, cache lengths from 1000 to 65536 (most not powers of two).
fn cpu_grid(quick: bool) -> Vec<Shape> {
    let (batches, kvs): (&[usize], &[usize]) = if quick {
        (&[1, 8], &[1000, 16384])
    } else {
        (&[1, 3, 8], &[1000, 3000, 4096, 10000, 16384, 40000, 65536])
    };
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for (heads, kv_heads) in [(32, 8), (8, 1)] {
            for &batch in batches {
                for &kv in kvs {
                    v.push(Shape {
                        heads,
                        kv_heads,
                        head_dim: 128,
                        batch,
                        seq_q: 1,
                        kv,
                        dtype,
                        layout: Layout::Contiguous,
                    });
                }
            }
        }
    }
    v
}

/// The GPU grid: every head configuration over the full (kv × batch × seq_q) grid in bf16
/// contiguous, and a cross-section (seq_q 1 and 4, batch 1, 8 and 32, every kv) in f16 and in
/// bf16 paged16. `quick`: a few of its points.
fn gpu_grid(quick: bool) -> Vec<Shape> {
    // (heads, kv_heads, head_dim): GQA 4, 8, MHA, d 64, MQA at d 256, and an odd group of 7.
    const HEADS: [(usize, usize, usize); 6] = [
        (32, 8, 128),
        (64, 8, 128),
        (32, 32, 128),
        (16, 2, 64),
        (8, 1, 256),
        (28, 4, 128),
    ];
    const KV: [usize; 8] = [512, 1000, 2048, 4096, 6000, 16384, 32768, 131072];
    const BATCH: [usize; 7] = [1, 2, 3, 8, 16, 32, 64];
    const SEQ_Q: [usize; 5] = [1, 2, 4, 8, 16];
    let shape =
        |(heads, kv_heads, head_dim): (usize, usize, usize), batch, seq_q, kv, dtype, layout| {
            Shape {
                heads,
                kv_heads,
                head_dim,
                batch,
                seq_q,
                kv,
                dtype,
                layout,
            }
        };
    let mut v = Vec::new();
    if quick {
        for h in [HEADS[0], HEADS[4]] {
            for kv in [4096, 32768] {
                for batch in [1, 8] {
                    for seq_q in [1, 4] {
                        v.push(shape(h, batch, seq_q, kv, DType::BF16, Layout::Contiguous));
                    }
                }
            }
        }
        v.push(shape(HEADS[0], 8, 1, 32768, DType::BF16, Layout::Paged(16)));
        v.push(shape(HEADS[0], 8, 1, 32768, DType::F16, Layout::Contiguous));
        return v;
    }
    for h in HEADS {
        for kv in KV {
            for batch in BATCH {
                for seq_q in SEQ_Q {
                    v.push(shape(h, batch, seq_q, kv, DType::BF16, Layout::Contiguous));
                }
            }
        }
    }
    for (dtype, layout) in [
        (DType::F16, Layout::Contiguous),
        (DType::BF16, Layout::Paged(16)),
    ] {
        for h in HEADS {
            for kv in KV {
                for batch in [1, 8, 32] {
                    for seq_q in [1, 4] {
                        v.push(shape(h, batch, seq_q, kv, dtype, layout));
                    }
                }
            }
        }
    }
    v
}

/// Splits one CSV line into fields (RFC 4180 quoting).
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}

/// The shapes of a CSV with (at least) the shape columns, in file order, each once.
fn shapes_from_csv(path: &PathBuf) -> Result<Vec<Shape>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = csv_fields(lines.next().context("empty shapes CSV")?);
    let col = |name: &str| -> Result<usize> {
        header
            .iter()
            .position(|h| h.trim() == name)
            .with_context(|| format!("{}: no column {name:?}", path.display()))
    };
    let cols = [
        "heads", "kv_heads", "head_dim", "batch", "seq_q", "kv", "dtype", "layout",
    ]
    .map(col);
    let [h, hk, d, b, sq, kv, dt, lay] = {
        let mut out = [0; 8];
        for (o, c) in out.iter_mut().zip(cols) {
            *o = c?;
        }
        out
    };
    let mut shapes: Vec<Shape> = Vec::new();
    for (n, line) in lines.enumerate() {
        let f = csv_fields(line);
        let get = |i: usize| -> Result<&str> {
            f.get(i)
                .map(|s| s.trim())
                .with_context(|| format!("{}: line {} is short", path.display(), n + 2))
        };
        let num = |i: usize| -> Result<usize> {
            get(i)?
                .parse()
                .with_context(|| format!("{}: line {}: column {i}", path.display(), n + 2))
        };
        let s = Shape {
            heads: num(h)?,
            kv_heads: num(hk)?,
            head_dim: num(d)?,
            batch: num(b)?,
            seq_q: num(sq)?,
            kv: num(kv)?,
            dtype: parse_dtype(get(dt)?)?,
            layout: Layout::parse(get(lay)?)?,
        };
        s.check()?;
        if !shapes.contains(&s) {
            shapes.push(s);
        }
    }
    Ok(shapes)
}

fn device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda if !cfg!(feature = "cuda") => {
            bail!("--device cuda needs a build with --features cuda,candle-nn/cuda")
        }
        DeviceArg::Cuda => Ok(Device::new_cuda(0)?),
    }
}

/// The last-level cache K and V must outgrow (see the module docs).
fn cache_bytes(dev: &Device) -> usize {
    if !dev.is_cpu() {
        return GPU_CACHE_BYTES;
    }
    // The largest cache sysfs lists for CPU 0 ("32768K").
    let size = |i: usize| -> Option<usize> {
        let s =
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()?;
        let s = s.trim();
        let (num, mult) = match s.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (s, 1),
            },
        };
        num.parse::<usize>().ok().map(|n| n * mult)
    };
    (0..8).filter_map(size).max().unwrap_or(CPU_CACHE_BYTES)
}

/// Input sets to rotate over so that the sets of `bytes` each cover twice the cache.
fn set_count(bytes: usize, cache: usize) -> usize {
    if bytes >= 2 * cache {
        1
    } else {
        (2 * cache).div_ceil(bytes.max(1)).clamp(2, MAX_SETS)
    }
}

/// Median seconds per call of `f(i)` (call `i` of the run, for rotating inputs): `sets` warm-up
/// calls (on the GPU then one untimed run), then `reps` timed runs of back-to-back calls (one on
/// the CPU; on the GPU as many as last [`GPU_RUN_SECS`]), the device synchronised before each
/// clock stops. Also the median seconds per call the host took to issue them (before the
/// synchronisation): where it is close to the first, the host's issue rate, not the device,
/// sets the pace.
fn time_calls(
    dev: &Device,
    reps: usize,
    sets: usize,
    f: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<(f64, f64)> {
    let mut call = 0;
    for _ in 0..sets.max(1) {
        f(call)?;
        call += 1;
    }
    dev.synchronize()?;
    let inner = if dev.is_cpu() {
        1
    } else {
        let start = Instant::now();
        f(call)?;
        call += 1;
        dev.synchronize()?;
        let one = start.elapsed().as_secs_f64();
        let inner = ((GPU_RUN_SECS / one.max(1e-9)).ceil() as usize).clamp(1, 5000);
        for _ in 0..inner {
            f(call)?;
            call += 1;
        }
        dev.synchronize()?;
        inner
    };
    let mut t = Vec::with_capacity(reps);
    let mut host = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        for _ in 0..inner {
            f(call)?;
            call += 1;
        }
        host.push(start.elapsed().as_secs_f64() / inner as f64);
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64() / inner as f64);
    }
    t.sort_by(f64::total_cmp);
    host.sort_by(f64::total_cmp);
    Ok((t[t.len() / 2], host[host.len() / 2]))
}

/// The bandwidth reference: on the CPU a multi-threaded sum over a 1 GiB buffer (bytes read),
/// on the GPU a 1 GiB device-to-device copy (bytes read plus written).
enum Reference {
    Cpu(Vec<f32>),
    /// Source and destination, both allocated once (a fresh 1 GiB destination per copy would
    /// time the allocator too), copied by the driver's device-to-device copy: the fastest copy
    /// the GPU does, not a strided-copy kernel.
    #[cfg(feature = "cuda")]
    Gpu(
        std::sync::Arc<candle::cuda_backend::cudarc::driver::CudaStream>,
        candle::cuda_backend::cudarc::driver::CudaSlice<f32>,
        std::cell::RefCell<candle::cuda_backend::cudarc::driver::CudaSlice<f32>>,
    ),
}

impl Reference {
    fn new(dev: &Device) -> Result<Self> {
        let n = REF_BYTES / 4;
        match dev {
            // Written in full here, so every page is mapped before the first timing.
            Device::Cpu => Ok(Reference::Cpu((0..n).map(|i| (i % 251) as f32).collect())),
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => {
                let stream = cuda.cuda_stream();
                let src = stream.alloc_zeros::<f32>(n).map_err(candle::Error::wrap)?;
                let dst = stream.alloc_zeros::<f32>(n).map_err(candle::Error::wrap)?;
                Ok(Reference::Gpu(stream, src, std::cell::RefCell::new(dst)))
            }
            _ => bail!("decode_bench: no bandwidth reference for {dev:?}"),
        }
    }

    /// GB/s, the median of `reps` runs.
    fn gbps(&self, dev: &Device, reps: usize) -> Result<f64> {
        match self {
            Reference::Cpu(buf) => {
                let (secs, _) = time_calls(dev, reps, 1, &mut |_| {
                    std::hint::black_box(parallel_sum(buf));
                    Ok(())
                })?;
                Ok(REF_BYTES as f64 / secs / 1e9)
            }
            #[cfg(feature = "cuda")]
            Reference::Gpu(stream, src, dst) => {
                let (secs, _) = time_calls(dev, reps, 1, &mut |_| {
                    let mut dst = dst.borrow_mut();
                    stream
                        .memcpy_dtod(src, &mut *dst)
                        .map_err(candle::Error::wrap)?;
                    Ok(())
                })?;
                Ok(2.0 * REF_BYTES as f64 / secs / 1e9)
            }
        }
    }
}

/// Sum of `buf` over the rayon threads, each summing contiguous stretches in 64 independent
/// lanes (vector registers, no dependency chain that would slow the reads).
fn parallel_sum(buf: &[f32]) -> f32 {
    use rayon::prelude::*;
    let chunk = buf.len().div_ceil(rayon::current_num_threads() * 4).max(64);
    buf.par_chunks(chunk)
        .map(|c| {
            let mut acc = [0f32; 64];
            let mut it = c.chunks_exact(64);
            for x in &mut it {
                for (a, &x) in acc.iter_mut().zip(x) {
                    *a += x;
                }
            }
            acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
        })
        .sum()
}

/// A fixed shuffle of `0..n` (physical block `p` holds logical block `order[p]`).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..n).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (state >> 33) as usize % (i + 1));
    }
    order
}

/// The inputs of one call of `candle_flash`.
struct FlashInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Paged: block table, cumulative query and key lengths.
    paged: Option<(Tensor, Tensor, Tensor)>,
}

fn randn(shape: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    if dtype == DType::F8E4M3 {
        // candle 0.11 converts to F8E4M3 on the CPU only.
        let t = Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)?;
        return Ok(t.to_device(dev)?);
    }
    Ok(Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype)?)
}

fn flash_inputs(s: &Shape, dev: &Device, seed: u64) -> Result<FlashInputs> {
    let (b, h, hk, d) = (s.batch, s.heads, s.kv_heads, s.head_dim);
    Ok(match s.layout {
        Layout::Contiguous | Layout::HeadMajor => {
            // `(b, kv, kv_heads, d)`, stored so or as the view of head-major storage.
            let cache = || -> Result<Tensor> {
                Ok(match s.layout {
                    Layout::HeadMajor => randn(&[b, hk, s.kv, d], s.dtype, dev)?.transpose(1, 2)?,
                    _ => randn(&[b, s.kv, hk, d], s.dtype, dev)?,
                })
            };
            FlashInputs {
                q: randn(&[b, s.seq_q, h, d], s.q_dtype(), dev)?,
                k: cache()?,
                v: cache()?,
                paged: None,
            }
        }
        Layout::Paged(page) => {
            let per_seq = s.kv.div_ceil(page);
            let blocks = b * per_seq;
            let order = shuffled(blocks, seed);
            let mut table = vec![0u32; blocks];
            for (phys, &logical) in order.iter().enumerate() {
                table[logical] = phys as u32;
            }
            let cu = |step: usize| -> Result<Tensor> {
                let v: Vec<u32> = (0..=b).map(|i| (i * step) as u32).collect();
                Ok(Tensor::new(v.as_slice(), dev)?)
            };
            FlashInputs {
                q: randn(&[b * s.seq_q, h, d], s.q_dtype(), dev)?,
                k: randn(&[blocks, page, hk, d], s.dtype, dev)?,
                v: randn(&[blocks, page, hk, d], s.dtype, dev)?,
                paged: Some((
                    Tensor::from_vec(table, (b, per_seq), dev)?,
                    cu(s.seq_q)?,
                    cu(s.kv)?,
                )),
            }
        }
    })
}

/// A forced decode plan: an instance by name and a split count, each or both.
type Forced = (Option<String>, Option<usize>);

fn flash_call(s: &Shape, x: &FlashInputs, forced: &Forced) -> Result<()> {
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let mut op = candle_flash::FlashAttn::new(scale).causal();
    if forced.0.is_some() || forced.1.is_some() {
        op = op.plan_override(candle_flash::PlanOverride {
            decode_instance: forced.0.clone(),
            decode_splits: forced.1,
            ..Default::default()
        });
    }
    let out = match (&x.paged, s.layout) {
        (Some((table, cu_q, cu_k)), Layout::Paged(page)) => op
            .paged(table, page)
            .forward_varlen(&x.q, &x.k, &x.v, cu_q, cu_k, s.seq_q, s.kv)?,
        _ => op.forward(&x.q, &x.k, &x.v)?,
    };
    std::hint::black_box(out);
    Ok(())
}

/// The naive baseline's inputs: q `(b, h, sq, d)`, K and V `(b, h, kv, d)` repeated to the
/// query heads from a `(b, hk, kv, d)` cache as candle-transformers' `repeat_kv` does, and the
/// causal mask of the last `sq` positions (none for one row, which sees every key).
struct NaiveInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Option<Tensor>,
}

fn naive_inputs(s: &Shape, dev: &Device) -> Result<NaiveInputs> {
    let (b, h, hk, d) = (s.batch, s.heads, s.kv_heads, s.head_dim);
    let rep = |t: Tensor| -> Result<Tensor> {
        let n = h / hk;
        Ok(Tensor::cat(&vec![&t; n], 2)?.reshape((b, h, s.kv, d))?)
    };
    let mask = if s.seq_q > 1 {
        let m: Vec<f32> = (0..s.seq_q)
            .flat_map(|i| {
                (0..s.kv).map(move |j| {
                    if j + s.seq_q > i + s.kv {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        Some(Tensor::from_vec(m, (1, 1, s.seq_q, s.kv), dev)?.to_dtype(s.dtype)?)
    } else {
        None
    };
    Ok(NaiveInputs {
        q: randn(&[b, h, s.seq_q, d], s.dtype, dev)?,
        k: rep(randn(&[b, hk, s.kv, d], s.dtype, dev)?)?,
        v: rep(randn(&[b, hk, s.kv, d], s.dtype, dev)?)?,
        mask,
    })
}

/// Attention as a model without flash attention runs it: matmul, softmax, matmul.
fn naive_call(s: &Shape, x: &NaiveInputs) -> Result<()> {
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    let att = (x.q.matmul(&x.k.t()?)? * scale)?;
    let att = match &x.mask {
        Some(m) => att.broadcast_add(m)?,
        None => att,
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    std::hint::black_box(att.matmul(&x.v)?);
    Ok(())
}

/// One measured row.
struct Measured {
    imp: String,
    /// Seconds per call the host took to issue the calls (see [`time_calls`]).
    host: f64,
    shape: Shape,
    secs: f64,
    ref_gbps: f64,
}

impl Measured {
    fn gbps(&self) -> f64 {
        self.shape.step_bytes() as f64 / self.secs / 1e9
    }

    fn csv(&self) -> Vec<String> {
        let s = &self.shape;
        vec![
            self.imp.clone(),
            dtype_name(s.dtype).into(),
            s.layout.name(),
            s.heads.to_string(),
            s.kv_heads.to_string(),
            s.head_dim.to_string(),
            s.batch.to_string(),
            s.seq_q.to_string(),
            s.kv.to_string(),
            format!("{:.2}", self.secs * 1e6),
            format!("{:.2}", self.gbps()),
            format!("{:.2}", self.ref_gbps),
        ]
    }
}

/// Times one shape: the bandwidth reference, candle-flash, and the naive baseline when asked
/// (contiguous layouts only; it has no paged form) and its inputs fit `naive_max`.
#[allow(clippy::too_many_arguments)]
fn measure(
    s: &Shape,
    dev: &Device,
    reference: &Reference,
    reps: usize,
    hot: bool,
    forced: &[Forced],
    naive: bool,
    naive_max: f64,
    seed: u64,
) -> Result<Vec<Measured>> {
    let cache = if hot { 0 } else { cache_bytes(dev) };
    let ref_gbps = reference.gbps(dev, 5)?;
    let sets = set_count(s.kv_bytes(), cache);
    let inputs = (0..sets)
        .map(|i| flash_inputs(s, dev, seed + i as u64))
        .collect::<Result<Vec<_>>>()?;
    let (secs, host) = time_calls(dev, reps, sets, &mut |i| {
        flash_call(s, &inputs[i % sets], &(None, None))
    })?;
    let mut rows = vec![Measured {
        imp: "candle-flash".into(),
        shape: *s,
        secs,
        host,
        ref_gbps,
    }];
    for f in forced {
        let (secs, host) = time_calls(dev, reps, sets, &mut |i| {
            flash_call(s, &inputs[i % sets], f)
        })?;
        let mut imp = String::from("candle-flash");
        if let Some(name) = &f.0 {
            imp += &format!("-{name}");
        }
        if let Some(n) = f.1 {
            imp += &format!("-s{n}");
        }
        rows.push(Measured {
            imp,
            shape: *s,
            secs,
            host,
            ref_gbps,
        });
    }
    drop(inputs);
    if naive
        && s.dtype != DType::F8E4M3
        && s.layout == Layout::Contiguous
        && s.naive_bytes() as f64 <= naive_max * 1e9
    {
        let sets = set_count(s.naive_bytes(), cache);
        let inputs = (0..sets)
            .map(|_| naive_inputs(s, dev))
            .collect::<Result<Vec<_>>>()?;
        // A slow baseline (seconds per call on the CPU in bf16) gets fewer runs.
        let start = Instant::now();
        naive_call(s, &inputs[0])?;
        dev.synchronize()?;
        let reps = if start.elapsed().as_secs_f64() > 0.5 {
            3.min(reps)
        } else {
            reps
        };
        let (secs, host) = time_calls(dev, reps, sets, &mut |i| naive_call(s, &inputs[i % sets]))?;
        rows.push(Measured {
            imp: "candle-naive".into(),
            shape: *s,
            secs,
            host,
            ref_gbps,
        });
    }
    Ok(rows)
}

/// The 1-minute load average (`/proc/loadavg`), to tell a loaded machine; `None` elsewhere.
fn load_average() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next().map(str::to_owned)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = device(args.device)?;
    let gpu = args.device == DeviceArg::Cuda;
    let grid = args.sweep || args.quick;
    let shapes: Vec<Shape> = if let Some(path) = &args.shapes_csv {
        shapes_from_csv(path)?
    } else if grid {
        if gpu {
            gpu_grid(args.quick)
        } else {
            cpu_grid(args.quick)
        }
    } else {
        let dtypes = if args.dtype.is_empty() {
            vec![if gpu { DType::BF16 } else { DType::F32 }]
        } else {
            args.dtype
                .iter()
                .map(|s| parse_dtype(s))
                .collect::<Result<_>>()?
        };
        let layouts: Vec<Layout> = std::iter::once(Layout::Contiguous)
            .chain(args.page.map(Layout::Paged))
            .collect();
        let mut v = Vec::new();
        for &dtype in &dtypes {
            for &batch in &args.batch {
                for &seq_q in &args.seq_q {
                    for &kv in &args.kv {
                        for &layout in &layouts {
                            let s = Shape {
                                heads: args.heads,
                                kv_heads: args.kv_heads,
                                head_dim: args.head_dim,
                                batch,
                                seq_q,
                                kv,
                                dtype,
                                layout,
                            };
                            s.check()?;
                            v.push(s);
                        }
                    }
                }
            }
        }
        v
    };
    let naive = match args.naive {
        NaiveArg::On => true,
        NaiveArg::Off => false,
        NaiveArg::Auto => !gpu || !(grid || args.shapes_csv.is_some()),
    };
    let out = args.out.clone().or_else(|| {
        args.sweep.then(|| {
            PathBuf::from(format!(
                "bench/results/{}-decode.csv",
                if gpu { "gpu" } else { "cpu" }
            ))
        })
    });
    let mut csv = match &out {
        Some(path) => Some(results::Csv::create(path, &dev, &COLUMNS)?),
        None => None,
    };
    let instances: Vec<Option<String>> = if args.instances.is_empty() {
        vec![None]
    } else {
        args.instances.iter().cloned().map(Some).collect()
    };
    let splits: Vec<Option<usize>> = if args.splits.is_empty() {
        vec![None]
    } else {
        args.splits.iter().copied().map(Some).collect()
    };
    let forced: Vec<Forced> = instances
        .iter()
        .flat_map(|i| splits.iter().map(move |&n| (i.clone(), n)))
        .filter(|f| f.0.is_some() || f.1.is_some())
        .collect();
    let reference = Reference::new(&dev)?;
    println!(
        "{}; {} rayon threads; load average (1 min) {}; {} shapes; median of {} runs; \
         reference: {}",
        results::device_name(&dev),
        rayon::current_num_threads(),
        load_average().unwrap_or_else(|| "n/a".into()),
        shapes.len(),
        args.reps,
        if gpu {
            "1 GiB device copy, read + written"
        } else {
            "multi-threaded sum over 1 GiB, read"
        },
    );
    println!();
    println!(
        "| impl | dtype | layout | heads | d | batch | seq_q | kv | us | GB/s | ref GB/s | % of ref | naive / flash | host us |"
    );
    println!("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut skipped = 0;
    for (n, s) in shapes.iter().enumerate() {
        if s.kv_bytes() as f64 > args.max_gb * 1e9 {
            skipped += 1;
            continue;
        }
        let rows = measure(
            s,
            &dev,
            &reference,
            args.reps,
            args.hot,
            &forced,
            naive,
            args.naive_max_gb,
            n as u64 * 1000,
        )?;
        let flash = rows[0].secs;
        for r in &rows {
            let sh = &r.shape;
            println!(
                "| {} | {} | {} | {}/{} | {} | {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.0}% | {} | {:.1} |",
                r.imp,
                dtype_name(sh.dtype),
                sh.layout.name(),
                sh.heads,
                sh.kv_heads,
                sh.head_dim,
                sh.batch,
                sh.seq_q,
                sh.kv,
                r.secs * 1e6,
                r.gbps(),
                r.ref_gbps,
                100.0 * r.gbps() / r.ref_gbps,
                if r.imp == "candle-naive" {
                    format!("{:.2}x", r.secs / flash)
                } else {
                    String::new()
                },
                r.host * 1e6,
            );
            if let Some(c) = csv.as_mut() {
                c.row(&r.csv())?;
            }
        }
        std::io::stdout().flush()?;
    }
    if skipped > 0 {
        println!(
            "\n{skipped} shapes skipped: K and V above --max-gb {}",
            args.max_gb
        );
    }
    if let Some(l) = load_average() {
        println!("load average (1 min) at end: {l}");
    }
    if let Some(path) = out {
        println!("CSV: {}", path.display());
    }
    Ok(())
}
