//! A small pre-norm Transformer stack (GQA attention with rotary embeddings, MLP, residuals) on
//! candle-nn, whose attention is picked at run time: the materialising reference
//! (`naive_attention`) or candle-flash (`FlashAttn`). With `--attention both` the same weights
//! and input go through both and a table shows that the outputs agree and what each costs.
//!
//! `--decode N` generates instead: a prefill of the `--seq-len` prompt into a KV cache, then N
//! steps of one new token each. Flash keeps a preallocated cache that `forward_kvcache` appends
//! to in place (one call per layer per step); naive concatenates its cache every step and
//! materialises the scores. Every step's input is a fixed seeded random embedding (not the
//! model's own output), so both backends see identical inputs at every step. `--kv-dtype
//! f8e4m3` keeps flash's cache in FP8 (e4m3) with one descale per (sequence, kv head), set from
//! the prompt's keys and values; naive keeps its cache in `--dtype`, so the comparison shows
//! what the FP8 cache costs in accuracy.
//!
//! ```text
//! cargo run --release --example transformer                      # CPU, defaults below
//! cargo run --release --example transformer -- --seq-len 4096 --causal false
//! cargo run --release --example transformer -- --seq-len 4096 --decode 64
//! cargo run --release --example transformer -- --seq-len 1024 --sinks
//! cargo run --release --example transformer -- --dtype bf16 --decode 64 --kv-dtype f8e4m3
//! cargo run --release --features cuda,candle-nn/cuda --example transformer -- --device cuda --dtype bf16
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Module, Tensor};
use candle_flash::{naive_attention, FlashAttn, MAX_HEAD_DIM};
use candle_nn::{linear_no_bias, Linear, VarBuilder, VarMap};
use clap::{Parser, ValueEnum};

/// Counts live heap bytes and their high-water mark, so that the table can show the memory a
/// forward pass needs on top of what already exists (weights, input): naive attention's
/// `seq × seq` score matrix shows up here, flash attention's tiles do not.
struct PeakAlloc {
    live: AtomicUsize,
    peak: AtomicUsize,
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counters are only
// bookkeeping and never influence the memory handed out.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) };
        self.live.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                self.grow(new_size - layout.size());
            } else {
                self.live
                    .fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

impl PeakAlloc {
    fn grow(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Starts a measurement: returns the live bytes now and makes them the peak.
    fn reset_peak(&self) -> usize {
        let now = self.live.load(Ordering::Relaxed);
        self.peak.store(now, Ordering::Relaxed);
        now
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc {
    live: AtomicUsize::new(0),
    peak: AtomicUsize::new(0),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AttentionArg {
    Naive,
    Flash,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvDTypeArg {
    /// The activations' dtype (`--dtype`).
    Same,
    /// FP8 e4m3 with a descale per (sequence, kv head).
    F8e4m3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum NormArg {
    Rms,
    Layer,
}

/// A pre-norm Transformer block stack (GQA + rotary embeddings) on seeded random weights, with
/// naive or flash attention; `--attention both` compares the two on the same weights and input.
#[derive(Parser, Debug)]
struct Args {
    /// Attention implementation; `both` runs the same weights and input through each and compares.
    #[arg(long, value_enum, default_value_t = AttentionArg::Both)]
    attention: AttentionArg,
    /// `cuda` needs the crate's `cuda` feature.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Dtype of weights and activations (the naive softmax runs in f32 either way).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Causal (decoder) attention; `--causal false` for an encoder.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    causal: bool,
    /// Learnable attention sinks (one logit per head with no value, as in gpt-oss) in every
    /// layer, for both backends.
    #[arg(long)]
    sinks: bool,
    /// Transformer blocks (attention + MLP each).
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Query heads (d_model = heads × head_dim).
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (grouped-query attention); must divide --heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Per-head dimension (even, at most 512).
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Pre-norm flavour: RMSNorm or LayerNorm.
    #[arg(long, value_enum, default_value_t = NormArg::Rms)]
    norm: NormArg,
    /// Timed forward passes per backend (after one untimed warm-up pass).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Decode this many tokens after a prefill of the --seq-len prompt, through a KV cache, and
    /// compare decode speed instead of full forward passes (0: full forward passes).
    #[arg(long, default_value_t = 0)]
    decode: usize,
    /// Element type of flash's KV cache in --decode runs: `f8e4m3` stores keys and values in FP8
    /// (one byte each) with a descale per (sequence, kv head) of twice the prompt's absolute
    /// maximum over 448 (needs --dtype bf16 or f16).
    #[arg(long, value_enum, default_value_t = KvDTypeArg::Same)]
    kv_dtype: KvDTypeArg,
    /// Seed of the weights and the input.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
}

impl Args {
    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("--seq-len", self.seq_len),
            ("--batch", self.batch),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
            ("--iters", self.iters),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1")
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            bail!(
                "--kv-heads {} must divide --heads {}",
                self.kv_heads,
                self.heads
            )
        }
        if self.kv_dtype == KvDTypeArg::F8e4m3 && (self.decode == 0 || self.dtype == DTypeArg::F32)
        {
            bail!("--kv-dtype f8e4m3 needs --decode N and --dtype bf16 or f16 (FP8 caches take 16-bit queries)")
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > MAX_HEAD_DIM {
            bail!(
                "--head-dim must be even (rotary embeddings rotate pairs) and at most {MAX_HEAD_DIM}, got {}",
                self.head_dim
            )
        }
        Ok(())
    }
}

/// Which attention a forward pass uses; the weights do not depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttentionBackend {
    Naive,
    Flash,
}

impl AttentionBackend {
    fn name(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::Flash => "flash",
        }
    }

    /// q `(b, t, heads, d)`, k/v `(b, t, kv_heads, d)` → `(b, t, heads, d)`.
    fn attend(self, q: &Tensor, k: &Tensor, v: &Tensor, op: &FlashAttn) -> candle::Result<Tensor> {
        match self {
            Self::Naive => naive_attention(q, k, v, op),
            Self::Flash => op.forward(q, k, v),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Config {
    d_model: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    mlp_hidden: usize,
    layers: usize,
    norm: NormArg,
    causal: bool,
    sinks: bool,
}

enum Norm {
    Rms(candle_nn::RmsNorm),
    Layer(candle_nn::LayerNorm),
}

impl Norm {
    fn new(kind: NormArg, size: usize, vb: VarBuilder) -> candle::Result<Self> {
        Ok(match kind {
            NormArg::Rms => Self::Rms(candle_nn::rms_norm(size, 1e-5, vb)?),
            NormArg::Layer => Self::Layer(candle_nn::layer_norm(size, 1e-5, vb)?),
        })
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> candle::Result<Tensor> {
        match self {
            Self::Rms(n) => n.forward(x),
            Self::Layer(n) => n.forward(x),
        }
    }
}

struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    op: FlashAttn,
    cfg: Config,
}

impl Attention {
    fn new(cfg: Config, vb: VarBuilder) -> candle::Result<Self> {
        let (d, kv) = (cfg.d_model, cfg.kv_heads * cfg.head_dim);
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let op = if cfg.causal {
            FlashAttn::new(scale).causal()
        } else {
            FlashAttn::new(scale)
        };
        // Learnable attention sinks: one f32 logit per head, drawn like the other weights.
        let op = if cfg.sinks {
            let init = candle_nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            };
            let sinks = vb.get_with_hints(cfg.heads, "sinks", init)?;
            op.sinks(&sinks.to_dtype(DType::F32)?)
        } else {
            op
        };
        Ok(Self {
            wq: linear_no_bias(d, d, vb.pp("q"))?,
            wk: linear_no_bias(d, kv, vb.pp("k"))?,
            wv: linear_no_bias(d, kv, vb.pp("v"))?,
            wo: linear_no_bias(d, d, vb.pp("o"))?,
            op,
            cfg,
        })
    }

    /// `x` holds positions `pos..pos + t`. Without a cache it attends over itself; with one it
    /// attends over everything the cache holds plus itself, and adds itself to the cache
    /// (`seqlens`: `(batch,)` u32, all `pos`).
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        pos: usize,
        backend: AttentionBackend,
        cache: Option<(&mut LayerCache, &Tensor)>,
    ) -> candle::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let c = &self.cfg;
        // Both backends take the (batch, seq, heads, head_dim) layout the projections produce,
        // so no transpose is needed on either path.
        let q = self.wq.forward(x)?.reshape((b, t, c.heads, c.head_dim))?;
        let k = self
            .wk
            .forward(x)?
            .reshape((b, t, c.kv_heads, c.head_dim))?;
        let v = self
            .wv
            .forward(x)?
            .reshape((b, t, c.kv_heads, c.head_dim))?;
        let (cos, sin) = (rope.cos.narrow(0, pos, t)?, rope.sin.narrow(0, pos, t)?);
        let q = candle_nn::rotary_emb::rope_thd(&q, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_thd(&k, &cos, &sin)?;
        let y = match cache {
            None => backend.attend(&q, &k, &v, &self.op)?,
            Some((LayerCache::Concat(kv), _)) => {
                let (k, v) = match kv.take() {
                    None => (k, v),
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
                };
                let y = backend.attend(&q, &k, &v, &self.op)?;
                *kv = Some((k, v));
                y
            }
            // One call: this step's rows are written at `pos`, then `pos + t` keys attended.
            Some((
                LayerCache::Fixed {
                    k: kc,
                    v: vc,
                    descales,
                },
                seqlens,
            )) => {
                if kc.dtype() != DType::F8E4M3 {
                    self.op
                        .forward_kvcache(&q, kc, vc, seqlens, Some((&k, &v)))?
                } else {
                    // An FP8 cache: the descales come from the first call's rows (the prompt).
                    if descales.is_none() {
                        *descales = Some((fp8_descale(&k)?, fp8_descale(&v)?));
                    }
                    let (kd, vd) = descales.as_ref().expect("set above");
                    let op = self.op.clone().k_descale(kd).v_descale(vd);
                    op.forward_kvcache(&q, kc, vc, seqlens, Some((&k, &v)))?
                }
            }
        };
        self.wo.forward(&y.reshape((b, t, c.d_model))?)
    }
}

struct Block {
    norm1: Norm,
    attn: Attention,
    norm2: Norm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn new(cfg: Config, vb: VarBuilder) -> candle::Result<Self> {
        Ok(Self {
            norm1: Norm::new(cfg.norm, cfg.d_model, vb.pp("norm1"))?,
            attn: Attention::new(cfg, vb.pp("attn"))?,
            norm2: Norm::new(cfg.norm, cfg.d_model, vb.pp("norm2"))?,
            fc1: linear_no_bias(cfg.d_model, cfg.mlp_hidden, vb.pp("fc1"))?,
            fc2: linear_no_bias(cfg.mlp_hidden, cfg.d_model, vb.pp("fc2"))?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        pos: usize,
        backend: AttentionBackend,
        cache: Option<(&mut LayerCache, &Tensor)>,
    ) -> candle::Result<Tensor> {
        let h = self.norm1.forward(x)?;
        let x = (x + self.attn.forward(&h, rope, pos, backend, cache)?)?;
        let h = self.fc1.forward(&self.norm2.forward(&x)?)?.gelu()?;
        x + self.fc2.forward(&h)?
    }
}

struct Model {
    blocks: Vec<Block>,
    norm: Norm,
}

impl Model {
    fn new(cfg: Config, vb: VarBuilder) -> candle::Result<Self> {
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(cfg, vb.pp(format!("layer{i}"))))
            .collect::<candle::Result<_>>()?;
        Ok(Self {
            blocks,
            norm: Norm::new(cfg.norm, cfg.d_model, vb.pp("norm"))?,
        })
    }

    /// `after_layer(i)` runs after each block, for the progress line.
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        backend: AttentionBackend,
        mut after_layer: impl FnMut(usize),
    ) -> candle::Result<Tensor> {
        let mut x = x.clone();
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, rope, 0, backend, None)?;
            after_layer(i);
        }
        self.norm.forward(&x)
    }

    /// Runs `x` `(batch, t, d_model)` after everything `cache` holds, adding it to the cache.
    fn forward_cached(
        &self,
        x: &Tensor,
        rope: &Rope,
        backend: AttentionBackend,
        cache: &mut KvCache,
    ) -> candle::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let pos = cache.len;
        // The length before this step, the same for every layer and sequence.
        let seqlens = Tensor::new(vec![pos as u32; b], x.device())?;
        let mut x = x.clone();
        for (block, layer) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            x = block.forward(&x, rope, pos, backend, Some((layer, &seqlens)))?;
        }
        cache.len += t;
        self.norm.forward(&x)
    }
}

/// One layer's keys and values, in the form each backend's decode path keeps them.
enum LayerCache {
    /// Naive: `(batch, len, kv_heads, head_dim)`, concatenated anew with every step's rows.
    Concat(Option<(Tensor, Tensor)>),
    /// Flash: `(batch, max_len, kv_heads, head_dim)`, allocated once and appended to in place by
    /// `forward_kvcache`; rows past the current length are never read. An FP8 cache keeps the
    /// key and value descales `(batch, kv_heads)` set by its first call.
    Fixed {
        k: Tensor,
        v: Tensor,
        descales: Option<(Tensor, Tensor)>,
    },
}

/// The FP8 descale `(batch, kv_heads)` of rows `x` `(batch, t, kv_heads, head_dim)`: twice their
/// absolute maximum over e4m3's largest value (448), so that later rows up to twice as large
/// still fit; stored values are `x / descale`.
fn fp8_descale(x: &Tensor) -> candle::Result<Tensor> {
    // Detached: the weights are trainable variables, and FP8 attention is inference only.
    let amax = x.detach().to_dtype(DType::F32)?.abs()?.max(3)?.max(1)?;
    (amax * (2.0 / 448.0))?.maximum(1e-12)
}

struct KvCache {
    /// Positions already processed.
    len: usize,
    layers: Vec<LayerCache>,
}

impl KvCache {
    fn new(
        cfg: &Config,
        backend: AttentionBackend,
        batch: usize,
        max_len: usize,
        dtype: DType,
        dev: &Device,
    ) -> candle::Result<Self> {
        // Flash's cache may be FP8 (`dtype` F8E4M3 then); naive's concatenated rows keep the
        // activations' dtype.
        let layers = (0..cfg.layers)
            .map(|_| {
                Ok(match backend {
                    AttentionBackend::Naive => LayerCache::Concat(None),
                    AttentionBackend::Flash => {
                        let shape = (batch, max_len, cfg.kv_heads, cfg.head_dim);
                        LayerCache::Fixed {
                            k: Tensor::zeros(shape, dtype, dev)?,
                            v: Tensor::zeros(shape, dtype, dev)?,
                            descales: None,
                        }
                    }
                })
            })
            .collect::<candle::Result<_>>()?;
        Ok(Self { len: 0, layers })
    }
}

/// Rotary embedding tables `(seq, head_dim / 2)` for positions `0..seq`.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(seq: usize, head_dim: usize, dtype: DType, dev: &Device) -> candle::Result<Self> {
        let half = head_dim / 2;
        let mut angles = Vec::with_capacity(seq * half);
        for pos in 0..seq {
            for i in 0..half {
                let inv_freq = 10_000f64.powf(-((2 * i) as f64) / head_dim as f64);
                angles.push((pos as f64 * inv_freq) as f32);
            }
        }
        let angles = Tensor::from_vec(angles, (seq, half), dev)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
        })
    }
}

/// Deterministic N(0, 1) samples (SplitMix64 + Box–Muller): candle's CPU generator cannot be
/// seeded, and the two backends must see the very same weights and input on every run.
struct Normal(u64);

impl Normal {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn sample(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    fn tensor(&mut self, dims: &[usize], std: f32) -> candle::Result<Tensor> {
        let n = dims.iter().product();
        let data = (0..n).map(|_| self.sample() * std).collect::<Vec<_>>();
        Tensor::from_vec(data, dims, &Device::Cpu)
    }
}

/// Builds the model once in f32 on the CPU through a VarMap (which creates every weight), then
/// overwrites each matrix with seeded samples scaled by `1/sqrt(fan_in)` (norm gains stay 1,
/// biases 0), and loads the result in the requested dtype on the requested device.
fn build_model(cfg: Config, seed: u64, dtype: DType, dev: &Device) -> Result<Model> {
    let varmap = VarMap::new();
    Model::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
    // Sorted names: the HashMap's order must not decide which samples a weight gets.
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut rng = Normal(seed);
    let mut weights = HashMap::new();
    for name in names {
        let var = &vars[name];
        let t = match var.dims() {
            [_, fan_in] => rng.tensor(var.dims(), 1.0 / (*fan_in as f32).sqrt())?,
            _ => var.as_tensor().clone(),
        };
        weights.insert(name.clone(), t);
    }
    Ok(Model::new(
        cfg,
        VarBuilder::from_tensors(weights, dtype, dev),
    )?)
}

/// A single stderr line rewritten in place, shown only once a run has lasted a second.
struct Progress {
    start: Instant,
    last: Option<Instant>,
    tty: bool,
}

impl Progress {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, msg: &str) {
        let now = Instant::now();
        // Off a terminal a rewritten line becomes a log; keep those updates sparse.
        let every = if self.tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let due = self.last.is_none_or(|t| now - t >= every);
        if now - self.start < Duration::from_secs(1) || !due {
            return;
        }
        self.last = Some(now);
        let elapsed = (now - self.start).as_secs_f64();
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{msg} ({elapsed:.0} s)");
        } else {
            let _ = writeln!(err, "{msg} ({elapsed:.0} s)");
        }
        let _ = err.flush();
    }

    fn finish(&self) {
        if self.tty && self.last.is_some() {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

struct Measured {
    backend: AttentionBackend,
    output: Tensor,
    secs_per_forward: f64,
    peak_bytes: Option<usize>,
}

fn measure(
    model: &Model,
    x: &Tensor,
    rope: &Rope,
    backend: AttentionBackend,
    args: &Args,
    progress: &mut Progress,
) -> Result<Measured> {
    let dev = x.device();
    let layers = args.layers;
    let total = args.iters + 1;
    let mut forward_once = |iter: usize| -> Result<Tensor> {
        let label = if iter == 0 {
            "warm-up".to_string()
        } else {
            format!("{iter}/{}", args.iters)
        };
        let out = model.forward(x, rope, backend, |layer| {
            progress.show(&format!(
                "{} forward {label}, layer {}/{layers}",
                backend.name(),
                layer + 1
            ))
        })?;
        dev.synchronize()?;
        Ok(out)
    };
    // The warm-up pass is also the memory measurement: the heap counter sees host memory only.
    let base = HEAP.reset_peak();
    let output = forward_once(0)?;
    let peak_bytes = dev.is_cpu().then(|| HEAP.peak().saturating_sub(base));
    let start = Instant::now();
    for iter in 1..total {
        forward_once(iter)?;
    }
    let secs_per_forward = start.elapsed().as_secs_f64() / args.iters as f64;
    Ok(Measured {
        backend,
        output,
        secs_per_forward,
        peak_bytes,
    })
}

struct Decoded {
    backend: AttentionBackend,
    prefill_secs: f64,
    decode_secs: f64,
    /// The last step's output `(batch, 1, d_model)`.
    last: Tensor,
}

/// One generation: `prompt` `(batch, seq, d_model)` prefilled into a fresh cache (flash's of
/// `kv_dtype`), then one step per tensor of `steps` (each `(batch, 1, d_model)`), timed
/// separately.
#[allow(clippy::too_many_arguments)]
fn measure_decode(
    model: &Model,
    cfg: &Config,
    prompt: &Tensor,
    steps: &[Tensor],
    rope: &Rope,
    backend: AttentionBackend,
    kv_dtype: DType,
    progress: &mut Progress,
) -> Result<Decoded> {
    let dev = prompt.device();
    let (batch, seq, _) = prompt.dims3()?;
    let dtype = kv_dtype;
    // Untimed warm-up: a short prefill and two steps, so that neither backend pays for
    // first-touch allocations in the timed run.
    let warm = prompt.narrow(1, 0, seq.min(16))?;
    let mut cache = KvCache::new(cfg, backend, batch, warm.dim(1)? + 2, dtype, dev)?;
    model.forward_cached(&warm, rope, backend, &mut cache)?;
    for x in steps.iter().take(2) {
        model.forward_cached(x, rope, backend, &mut cache)?;
    }
    dev.synchronize()?;

    // The cache is made before the clock starts: a generation allocates it once (flash: at its
    // full length), and what is timed is what every step costs.
    let mut cache = KvCache::new(cfg, backend, batch, seq + steps.len(), dtype, dev)?;
    let start = Instant::now();
    model.forward_cached(prompt, rope, backend, &mut cache)?;
    dev.synchronize()?;
    let prefill_secs = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut last = None;
    for (i, x) in steps.iter().enumerate() {
        last = Some(model.forward_cached(x, rope, backend, &mut cache)?);
        progress.show(&format!(
            "{} decode step {}/{}",
            backend.name(),
            i + 1,
            steps.len()
        ));
    }
    dev.synchronize()?;
    let decode_secs = start.elapsed().as_secs_f64();
    Ok(Decoded {
        backend,
        prefill_secs,
        decode_secs,
        last: last.context("no decode steps")?,
    })
}

/// `--decode N`: prefill, N one-token steps, and a table of both phases' speeds.
fn run_decode(
    args: &Args,
    cfg: &Config,
    model: &Model,
    backends: &[AttentionBackend],
    dtype: DType,
    dev: &Device,
) -> Result<()> {
    let n = args.decode;
    let rope = Rope::new(args.seq_len + n, args.head_dim, dtype, dev)?;
    let mut rng = Normal(args.seed ^ 0x5EED);
    let prompt = rng
        .tensor(&[args.batch, args.seq_len, cfg.d_model], 1.0)?
        .to_dtype(dtype)?
        .to_device(dev)?;
    // Each step's input is a fixed seeded embedding, the same for both backends.
    let mut rng = Normal(args.seed ^ 0xDEC0DE);
    let steps = (0..n)
        .map(|_| {
            rng.tensor(&[args.batch, 1, cfg.d_model], 1.0)?
                .to_dtype(dtype)?
                .to_device(dev)
        })
        .collect::<candle::Result<Vec<_>>>()?;
    let kv_dtype = match args.kv_dtype {
        KvDTypeArg::Same => dtype,
        KvDTypeArg::F8e4m3 => DType::F8E4M3,
    };
    println!(
        "decode: prefill of {} tokens, then {n} steps of one token (a fixed random embedding each) \
         per sequence; flash's KV cache in {kv_dtype:?}",
        args.seq_len
    );
    let mut progress = Progress::new();
    let mut results = Vec::new();
    for &backend in backends {
        results.push(measure_decode(
            model,
            cfg,
            &prompt,
            &steps,
            &rope,
            backend,
            kv_dtype,
            &mut progress,
        )?);
    }
    progress.finish();

    let (prompt_tokens, new_tokens) = ((args.batch * args.seq_len) as f64, (args.batch * n) as f64);
    println!(
        "{:<8} {:>11} {:>14} {:>15} {:>13}",
        "backend", "prefill ms", "prefill tok/s", "decode ms/step", "decode tok/s"
    );
    for r in &results {
        println!(
            "{:<8} {:>11.1} {:>14.0} {:>15.2} {:>13.1}",
            r.backend.name(),
            r.prefill_secs * 1e3,
            prompt_tokens / r.prefill_secs,
            r.decode_secs * 1e3 / n as f64,
            new_tokens / r.decode_secs
        );
    }
    if let [naive, flash] = results.as_slice() {
        let (diff, scale) = max_diff(&naive.last, &flash.last)?;
        println!(
            "max |naive - flash| over the last step's output: {diff:.3e} (max |output| {scale:.2})"
        );
        println!(
            "flash decode speed-up over naive: {:.2}x",
            naive.decode_secs / flash.decode_secs
        );
        if !diff.is_finite() {
            bail!("the outputs differ by {diff}: NaN or Inf in one backend's output")
        }
    }
    Ok(())
}

fn device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda if cfg!(feature = "cuda") => {
            let dev = Device::new_cuda(0).context("opening CUDA device 0")?;
            // The norms and rotary embeddings are candle-nn kernels, which exist on the GPU only
            // when candle-nn itself is built with its `cuda` feature.
            let probe = Tensor::zeros((1, 1), DType::F32, &dev)?;
            if candle_nn::ops::softmax_last_dim(&probe).is_err() {
                bail!(
                    "candle-nn was built without its CUDA kernels: \
                     cargo run --release --features cuda,candle-nn/cuda --example transformer -- --device cuda"
                )
            }
            Ok(dev)
        }
        DeviceArg::Cuda => bail!(
            "--device cuda needs the `cuda` feature: \
             cargo run --release --features cuda,candle-nn/cuda --example transformer -- --device cuda"
        ),
    }
}

fn main() -> std::process::ExitCode {
    // Errors are reported as one line (with their causes), not as a Debug dump with a backtrace.
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    args.validate()?;
    let dev = device(args.device)?;
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::F16 => DType::F16,
        DTypeArg::Bf16 => DType::BF16,
    };
    let d_model = args.heads * args.head_dim;
    let cfg = Config {
        d_model,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        mlp_hidden: 4 * d_model,
        layers: args.layers,
        norm: args.norm,
        causal: args.causal,
        sinks: args.sinks,
    };
    let backends: &[AttentionBackend] = match args.attention {
        AttentionArg::Naive => &[AttentionBackend::Naive],
        AttentionArg::Flash => &[AttentionBackend::Flash],
        AttentionArg::Both => &[AttentionBackend::Naive, AttentionBackend::Flash],
    };

    let model = build_model(cfg, args.seed, dtype, &dev)?;
    if args.decode > 0 {
        println!(
            "{} layers, d_model {d_model} ({} heads / {} kv heads × {}), {:?} norm, {}; batch {}, {:?} on {:?}",
            args.layers,
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.norm,
            mask_name(&args),
            args.batch,
            dtype,
            dev.location()
        );
        return run_decode(&args, &cfg, &model, backends, dtype, &dev);
    }
    let rope = Rope::new(args.seq_len, args.head_dim, dtype, &dev)?;
    let mut rng = Normal(args.seed ^ 0x5EED);
    let x32 = rng
        .tensor(&[args.batch, args.seq_len, d_model], 1.0)?
        .to_device(&dev)?;
    let x = x32.to_dtype(dtype)?;

    println!(
        "{} layers, d_model {d_model} ({} heads / {} kv heads × {}), {:?} norm, {}; batch {} × seq {}, {:?} on {:?}",
        args.layers,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.norm,
        mask_name(&args),
        args.batch,
        args.seq_len,
        dtype,
        dev.location()
    );
    let mut progress = Progress::new();
    let mut results = Vec::new();
    for &backend in backends {
        results.push(measure(&model, &x, &rope, backend, &args, &mut progress)?);
    }
    progress.finish();

    let tokens = (args.batch * args.seq_len) as f64;
    println!(
        "{:<8} {:>14} {:>12} {:>16}",
        "backend", "ms / forward", "tokens/s", "peak heap Δ MiB"
    );
    for r in &results {
        let mem = r.peak_bytes.map_or("n/a".to_string(), |b| {
            format!("{:.1}", b as f64 / (1 << 20) as f64)
        });
        println!(
            "{:<8} {:>14.1} {:>12.0} {:>16}",
            r.backend.name(),
            r.secs_per_forward * 1e3,
            tokens / r.secs_per_forward,
            mem
        );
    }
    if let [naive, flash] = results.as_slice() {
        let (diff, scale) = max_diff(&naive.output, &flash.output)?;
        println!("max |naive - flash| over the output: {diff:.3e} (max |output| {scale:.2})");
        println!(
            "flash speed-up over naive: {:.2}x",
            naive.secs_per_forward / flash.secs_per_forward
        );
        if !diff.is_finite() {
            bail!("the outputs differ by {diff}: NaN or Inf in one backend's output")
        }
        if dtype != DType::F32 {
            // In half precision both backends round; an f32 run of the same weights shows that
            // flash is no further from the exact result than naive is.
            let reference = build_model(cfg, args.seed, DType::F32, &dev)?.forward(
                &x32,
                &Rope::new(args.seq_len, args.head_dim, DType::F32, &dev)?,
                AttentionBackend::Naive,
                |_| {},
            )?;
            println!(
                "max error vs an f32 naive run: naive {:.3e}, flash {:.3e}",
                max_diff(&naive.output, &reference)?.0,
                max_diff(&flash.output, &reference)?.0
            );
        }
    }
    Ok(())
}

/// Largest `|a - b|` and largest `|a|`, folded on the host so that a NaN shows (candle's `max`
/// drops any NaN that is not the first element).
fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let host = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (a, b) = (host(a)?, host(b)?);
    let fold = |m: f32, x: f32| if x.is_nan() || x > m { x } else { m };
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, fold);
    let scale = a.iter().map(|x| x.abs()).fold(0.0, fold);
    Ok((diff, scale))
}

/// The mask (and sinks) of the run, for the header line.
fn mask_name(args: &Args) -> &'static str {
    match (args.causal, args.sinks) {
        (true, false) => "causal",
        (false, false) => "non-causal",
        (true, true) => "causal, sinks",
        (false, true) => "non-causal, sinks",
    }
}
