//! A character-level decoder-only Transformer trained with AdamW, shared by `examples/train.rs`
//! and `tests/train.rs`: what the test checks is what the example runs.
//!
//! The model is a GPT-style pre-norm stack (learned positions, RMS norm, causal GQA attention,
//! GELU MLP, output head tied to the token embedding), written with plain tensor ops so that every
//! part has a gradient in candle's autograd. Only the attention call differs between the
//! backends: `naive_attention` (autograd through the score matrix) or `FlashAttn` (the op's own
//! backward pass), both causal with the same scale.
//!
//! Weights and batches come from a seeded host-side generator (candle's CPU `randn` cannot be
//! seeded), so two trainers built from the same seed start from bitwise identical weights and see
//! the same batches on any device.

use anyhow::{ensure, Context, Result};
use candle::{DType, Device, Tensor, Var, D};
use candle_flash::{naive_attention, FlashAttn};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

/// Which attention implementation the model calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `candle_flash::naive_attention`: the full score matrix, differentiated by candle.
    Naive,
    /// `candle_flash::FlashAttn`: tiled forward, and the op's backward pass.
    Flash,
}

impl Attention {
    pub fn name(self) -> &'static str {
        match self {
            Attention::Naive => "naive",
            Attention::Flash => "flash",
        }
    }
}

/// Model shape and optimiser settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_len: usize,
    pub batch: usize,
    pub lr: f64,
    /// Steps of linear learning-rate warm-up (0: none).
    pub warmup: usize,
    pub seed: u64,
}

impl Config {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    fn validate(&self) -> Result<()> {
        ensure!(self.layers > 0, "--layers must be positive");
        ensure!(
            self.heads > 0 && self.d_model.is_multiple_of(self.heads),
            "--d-model ({}) must be a positive multiple of --heads ({})",
            self.d_model,
            self.heads
        );
        ensure!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "--heads ({}) must be a multiple of --kv-heads ({})",
            self.heads,
            self.kv_heads
        );
        ensure!(
            self.seq_len > 0 && self.batch > 0,
            "--seq-len and --batch must be positive"
        );
        Ok(())
    }
}

/// SplitMix64: a tiny, well-mixed, seedable generator. Enough for weights and batch offsets.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is irrelevant at these sizes).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The text as character ids, with the vocabulary (sorted distinct characters).
pub struct Corpus {
    pub vocab: Vec<char>,
    pub ids: Vec<u32>,
}

impl Corpus {
    pub fn new(text: &str) -> Result<Self> {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let ids = text
            .chars()
            .map(|c| vocab.binary_search(&c).map(|i| i as u32))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| anyhow::anyhow!("character missing from its own vocabulary"))?;
        Ok(Corpus { vocab, ids })
    }

    /// The first `1 - val_fraction` of the text for training, the rest held out.
    pub fn split(&self, val_fraction: f64) -> (&[u32], &[u32]) {
        let n_train = ((self.ids.len() as f64) * (1.0 - val_fraction)) as usize;
        self.ids.split_at(n_train)
    }
}

/// `batch` windows of `seq_len + 1` characters at seeded random offsets: inputs and next-character
/// targets, both `(batch, seq_len)` u32.
pub struct Batches<'a> {
    ids: &'a [u32],
    batch: usize,
    seq_len: usize,
    rng: Rng,
}

impl<'a> Batches<'a> {
    pub fn new(ids: &'a [u32], batch: usize, seq_len: usize, seed: u64) -> Result<Self> {
        ensure!(
            ids.len() > seq_len + 1,
            "the text ({} characters) is shorter than --seq-len + 2",
            ids.len()
        );
        // A stream of its own, so that changing the model size does not change the batches.
        let rng = Rng::new(seed ^ 0xBA7C_4E5D_0000_0001);
        Ok(Batches {
            ids,
            batch,
            seq_len,
            rng,
        })
    }

    pub fn next_batch(&mut self, device: &Device) -> Result<(Tensor, Tensor)> {
        let (b, s) = (self.batch, self.seq_len);
        let mut x = Vec::with_capacity(b * s);
        let mut y = Vec::with_capacity(b * s);
        for _ in 0..b {
            let o = self.rng.below(self.ids.len() - s);
            x.extend_from_slice(&self.ids[o..o + s]);
            y.extend_from_slice(&self.ids[o + 1..o + s + 1]);
        }
        Ok((
            Tensor::from_vec(x, (b, s), device)?,
            Tensor::from_vec(y, (b, s), device)?,
        ))
    }
}

/// One pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`. Matrices are stored
/// `(in, out)` so that a layer is `x.matmul(w)`.
struct Block {
    attn_norm: Var,
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
    mlp_norm: Var,
    w_up: Var,
    w_down: Var,
}

/// The decoder-only Transformer and its parameters.
pub struct CharLm {
    cfg: Config,
    attention: Attention,
    vocab: usize,
    tok_emb: Var,
    pos_emb: Var,
    blocks: Vec<Block>,
    final_norm: Var,
}

const NORM_EPS: f64 = 1e-5;
const INIT_STD: f64 = 0.02;

impl CharLm {
    /// Weights drawn from `cfg.seed` in a fixed order: N(0, 0.02) (output projections scaled by
    /// `1/sqrt(2·layers)`, as GPT-2 does), norm gains 1. The same seed gives the same weights
    /// whatever `attention` is.
    pub fn new(cfg: &Config, vocab: usize, attention: Attention, device: &Device) -> Result<Self> {
        cfg.validate()?;
        let mut rng = Rng::new(cfg.seed);
        let (d, kv) = (cfg.d_model, cfg.kv_heads * cfg.head_dim());
        let resid_std = INIT_STD / ((2 * cfg.layers) as f64).sqrt();
        let mut normal = |shape: (usize, usize), std: f64| -> Result<Var> {
            let data: Vec<f32> = (0..shape.0 * shape.1)
                .map(|_| (rng.normal() * std) as f32)
                .collect();
            Ok(Var::from_tensor(&Tensor::from_vec(data, shape, device)?)?)
        };
        let tok_emb = normal((vocab, d), INIT_STD)?;
        let pos_emb = normal((cfg.seq_len, d), INIT_STD)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            blocks.push(Block {
                attn_norm: Var::ones(d, DType::F32, device)?,
                wq: normal((d, d), INIT_STD)?,
                wk: normal((d, kv), INIT_STD)?,
                wv: normal((d, kv), INIT_STD)?,
                wo: normal((d, d), resid_std)?,
                mlp_norm: Var::ones(d, DType::F32, device)?,
                w_up: normal((d, 4 * d), INIT_STD)?,
                w_down: normal((4 * d, d), resid_std)?,
            });
        }
        let final_norm = Var::ones(d, DType::F32, device)?;
        Ok(CharLm {
            cfg: cfg.clone(),
            attention,
            vocab,
            tok_emb,
            pos_emb,
            blocks,
            final_norm,
        })
    }

    /// Every parameter with a name (`blocks.0.wq`, …), in creation order.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut v = vec![
            ("tok_emb".to_string(), self.tok_emb.clone()),
            ("pos_emb".to_string(), self.pos_emb.clone()),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            let named = [
                ("attn_norm", &b.attn_norm),
                ("wq", &b.wq),
                ("wk", &b.wk),
                ("wv", &b.wv),
                ("wo", &b.wo),
                ("mlp_norm", &b.mlp_norm),
                ("w_up", &b.w_up),
                ("w_down", &b.w_down),
            ];
            v.extend(named.map(|(n, x)| (format!("blocks.{i}.{n}"), x.clone())));
        }
        v.push(("final_norm".to_string(), self.final_norm.clone()));
        v
    }

    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    pub fn parameter_count(&self) -> usize {
        self.vars().iter().map(|v| v.elem_count()).sum()
    }

    /// Mean next-character cross-entropy of `(batch, seq)` inputs against their targets.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let (b, s) = x.dims2()?;
        let d = self.cfg.d_model;
        let tok = self.tok_emb.as_tensor();
        let pos = self.pos_emb.as_tensor().narrow(0, 0, s)?;
        let mut h = tok
            .index_select(&x.flatten_all()?, 0)?
            .reshape((b, s, d))?
            .broadcast_add(&pos)?
            .reshape((b * s, d))?;
        for block in &self.blocks {
            h = (&h + self.attention(block, &rms_norm(&h, &block.attn_norm)?, b, s)?)?;
            let up = rms_norm(&h, &block.mlp_norm)?.matmul(block.w_up.as_tensor())?;
            h = (&h + up.gelu()?.matmul(block.w_down.as_tensor())?)?;
        }
        let logits = rms_norm(&h, &self.final_norm)?.matmul(&tok.t()?)?;
        debug_assert_eq!(logits.dims(), &[b * s, self.vocab]);
        Ok(candle_nn::loss::cross_entropy(&logits, &y.flatten_all()?)?)
    }

    /// Causal multi-head attention of `(b·s, d)` rows; q `(b, s, heads, hd)` against k and v
    /// `(b, s, kv_heads, hd)`, which is the layout both backends take.
    fn attention(&self, blk: &Block, x: &Tensor, b: usize, s: usize) -> Result<Tensor> {
        let (h, hk, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim());
        let q = x.matmul(blk.wq.as_tensor())?.reshape((b, s, h, hd))?;
        let k = x.matmul(blk.wk.as_tensor())?.reshape((b, s, hk, hd))?;
        let v = x.matmul(blk.wv.as_tensor())?.reshape((b, s, hk, hd))?;
        let opts = FlashAttn::new(1.0 / (hd as f32).sqrt()).causal();
        let o = match self.attention {
            Attention::Naive => naive_attention(&q, &k, &v, &opts)?,
            Attention::Flash => opts.forward(&q, &k, &v)?,
        };
        Ok(o.reshape((b * s, h * hd))?.matmul(blk.wo.as_tensor())?)
    }
}

/// `x / rms(x) · gain` over the last dim, from differentiable primitives (candle-nn's fused
/// `rms_norm` has no backward pass).
fn rms_norm(x: &Tensor, gain: &Var) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + NORM_EPS)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(gain.as_tensor())?)
}

/// A model and its AdamW state.
pub struct Trainer {
    pub model: CharLm,
    opt: AdamW,
    lr: f64,
    warmup: usize,
    steps: usize,
}

impl Trainer {
    pub fn new(cfg: &Config, vocab: usize, attention: Attention, device: &Device) -> Result<Self> {
        let model = CharLm::new(cfg, vocab, attention, device)?;
        let params = ParamsAdamW {
            lr: cfg.lr,
            ..ParamsAdamW::default()
        };
        let opt = AdamW::new(model.vars(), params)?;
        Ok(Trainer {
            model,
            opt,
            lr: cfg.lr,
            warmup: cfg.warmup,
            steps: 0,
        })
    }

    /// One forward, backward and AdamW update; returns the loss before the update. Reading the
    /// loss back to the host also waits for the device, so the step can be timed around this
    /// call.
    pub fn step(&mut self, x: &Tensor, y: &Tensor) -> Result<f32> {
        self.steps += 1;
        if self.steps <= self.warmup {
            self.opt
                .set_learning_rate(self.lr * self.steps as f64 / self.warmup as f64);
        }
        let loss = self.model.loss(x, y)?;
        self.opt.backward_step(&loss).with_context(|| {
            format!(
                "backward pass through {} attention",
                self.model.attention.name()
            )
        })?;
        Ok(loss.to_scalar::<f32>()?)
    }
}
