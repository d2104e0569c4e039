//! SmolLM2-135M-Instruct (Llama architecture) from its GGUF file: weights dequantized at load,
//! a tokenizer rebuilt from the GGUF vocabulary, and a forward pass with a KV cache whose
//! attention is either the materialising reference (over a cache grown by concatenation) or
//! flash attention (one `flash_attn_with_kvcache` call per layer per step, appending to a
//! preallocated cache in place).
//!
//! Causal masking is bottom-right aligned (query `i` of a `t`-token step at cache offset `p`
//! sees keys `0..=p+i`), so one forward over the whole prompt, a chunked prefill and
//! token-by-token decoding all compute the same thing.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle::quantized::gguf_file::{Content, Value};
use candle::{DType, Device, Tensor, D};
use candle_flash::FlashAttn;
use candle_nn::{Linear, Module};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::paths::{find_file, models_dir};

/// Which attention the forward pass uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Attention {
    /// `candle_flash::naive_attention` over a cache grown by concatenation: the full score
    /// matrix (K/V heads repeated for GQA), masked and soft-maxed.
    Naive,
    /// `candle_flash::flash_attn_with_kvcache`: tiled, online softmax, against a preallocated
    /// cache appended to in place.
    Flash,
}

/// The GGUF installed by `scripts/fetch-models.sh`.
pub fn locate() -> Result<PathBuf> {
    find_file(&models_dir().join("smollm2"), "*.gguf", |n| {
        n.ends_with(".gguf")
    })
}

#[derive(Debug, Clone)]
pub struct Config {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub context: usize,
}

struct Block {
    attn_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Per-layer keys and values of everything seen so far, kept the way each backend wants them.
pub struct Cache {
    /// Tokens already processed.
    len: usize,
    /// Positions the cache can hold.
    max_len: usize,
    layers: Vec<LayerKv>,
}

enum LayerKv {
    /// Naive: `(1, len, kv_heads, head_dim)`, a new tensor concatenated every step.
    Concat(Option<(Tensor, Tensor)>),
    /// Flash: preallocated `(1, max_len, kv_heads, head_dim)`, appended to in place by
    /// `flash_attn_with_kvcache`; rows past `len` are never read.
    Fixed { k: Tensor, v: Tensor },
}

impl Cache {
    /// Number of tokens already processed.
    pub fn len(&self) -> usize {
        self.len
    }
}

/// What [`SmolLm2::generate`] produced, and how long its two phases took.
pub struct Generation {
    pub tokens: Vec<u32>,
    /// The prompt's one forward pass.
    pub prefill: Duration,
    /// Every one-token forward pass after it.
    pub decode: Duration,
    pub decode_steps: usize,
}

/// Model, tokenizer and chat template, all read from one GGUF file.
pub struct SmolLm2 {
    pub cfg: Config,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    pub tokenizer: Tokenizer,
    chat_template: Option<String>,
    /// Tokens that end the assistant's turn.
    stop: Vec<u32>,
}

fn md<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .with_context(|| format!("GGUF metadata has no {key}"))
}

fn md_usize(c: &Content, key: &str) -> Result<usize> {
    Ok(md(c, key)?
        .to_u32()
        .with_context(|| format!("{key} is not a u32"))? as usize)
}

fn md_f32(c: &Content, key: &str) -> Result<f32> {
    md(c, key)?
        .to_f32()
        .with_context(|| format!("{key} is not an f32"))
}

fn md_strings<'a>(c: &'a Content, key: &str) -> Result<Vec<&'a str>> {
    md(c, key)?
        .to_vec()
        .with_context(|| format!("{key} is not an array"))?
        .iter()
        .map(|v| {
            Ok(v.to_string()
                .with_context(|| format!("{key} holds a non-string"))?
                .as_str())
        })
        .collect()
}

impl SmolLm2 {
    pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let mut file = BufReader::new(
            File::open(path).with_context(|| format!("opening {}", path.display()))?,
        );
        let c = Content::read(&mut file)
            .with_context(|| format!("reading GGUF header of {}", path.display()))?;
        let arch = md(&c, "general.architecture")?.to_string()?;
        ensure!(
            arch == "llama",
            "expected a llama GGUF, {} is {arch}",
            path.display()
        );
        let heads = md_usize(&c, "llama.attention.head_count")?;
        let kv_heads = md_usize(&c, "llama.attention.head_count_kv")?;
        let hidden = md_usize(&c, "llama.embedding_length")?;
        ensure!(
            heads > 0 && kv_heads > 0 && hidden % heads == 0 && heads % kv_heads == 0,
            "inconsistent head counts: hidden {hidden}, heads {heads}, kv heads {kv_heads}"
        );
        let cfg = Config {
            layers: md_usize(&c, "llama.block_count")?,
            hidden,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            rms_eps: md_f32(&c, "llama.attention.layer_norm_rms_epsilon")? as f64,
            rope_theta: md_f32(&c, "llama.rope.freq_base")?,
            context: md_usize(&c, "llama.context_length")?,
        };

        ensure!(
            !c.tensor_infos.contains_key("output.weight"),
            "this GGUF has a separate output.weight; only tied embeddings are implemented"
        );
        // Partial rotary embeddings (rope dim < head dim) are not implemented.
        if let Ok(rope_dim) = md_usize(&c, "llama.rope.dimension_count") {
            ensure!(
                rope_dim == cfg.head_dim && rope_dim % 2 == 0,
                "rope dimension {rope_dim} must equal the (even) head dim {}",
                cfg.head_dim
            );
        }

        // Every weight is expanded to a plain float tensor on the CPU first: candle's Q4_1
        // matmul on the CPU was seen to give wrong answers, and the float weights are what the
        // attention comparison needs anyway.
        let mut weight = |name: &str| -> Result<Tensor> {
            let q = c
                .tensor(&mut file, name, &Device::Cpu)
                .with_context(|| format!("reading tensor {name}"))?;
            Ok(q.dequantize(&Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?)
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let mut w = |part: &str| weight(&format!("blk.{i}.{part}.weight"));
            let mut lin = |part: &str| -> Result<Linear> { Ok(Linear::new(w(part)?, None)) };
            blocks.push(Block {
                q: lin("attn_q")?,
                k: lin("attn_k")?,
                v: lin("attn_v")?,
                o: lin("attn_output")?,
                gate: lin("ffn_gate")?,
                up: lin("ffn_up")?,
                down: lin("ffn_down")?,
                attn_norm: w("attn_norm")?,
                ffn_norm: w("ffn_norm")?,
            });
        }
        let embed = weight("token_embd.weight")?;
        let norm = weight("output_norm.weight")?;
        let (cos, sin) = rope_tables(&cfg, dtype, device)?;
        let tokenizer = tokenizer_from_gguf(&c)?;
        let chat_template = md(&c, "tokenizer.chat_template")
            .ok()
            .and_then(|v| v.to_string().ok().cloned());
        let mut stop = vec![md(&c, "tokenizer.ggml.eos_token_id")?.to_u32()?];
        // The chat model ends its turn with <|im_end|>; <|endoftext|> ends a document.
        for t in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(t) {
                stop.push(id);
            }
        }
        Ok(Self {
            cfg,
            embed,
            blocks,
            norm,
            cos,
            sin,
            tokenizer,
            chat_template,
            stop,
        })
    }

    /// An empty cache for `max_len` tokens (prompt and generated) with `attention`. The flash
    /// cache is allocated here at its full size, two `(1, max_len, kv_heads, head_dim)` tensors
    /// per layer; the naive one grows by concatenation.
    pub fn new_cache(&self, attention: Attention, max_len: usize) -> Result<Cache> {
        let cfg = &self.cfg;
        ensure!(
            max_len <= cfg.context,
            "a cache of {max_len} tokens exceeds the model's context of {}",
            cfg.context
        );
        let layers = (0..cfg.layers)
            .map(|_| -> Result<LayerKv> {
                Ok(match attention {
                    Attention::Naive => LayerKv::Concat(None),
                    Attention::Flash => {
                        let shape = (1, max_len, cfg.kv_heads, cfg.head_dim);
                        let (dtype, device) = (self.embed.dtype(), self.embed.device());
                        LayerKv::Fixed {
                            k: Tensor::zeros(shape, dtype, device)?,
                            v: Tensor::zeros(shape, dtype, device)?,
                        }
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(Cache {
            len: 0,
            max_len,
            layers,
        })
    }

    /// Runs `tokens` after whatever `cache` holds, with the cache's attention, and returns the
    /// f32 logits `(vocab,)` of the last of them.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (t, pos) = (tokens.len(), cache.len());
        ensure!(t > 0, "forward needs at least one token");
        ensure!(
            pos + t <= cache.max_len,
            "the cache holds {} tokens: {pos} cached plus {t} new do not fit",
            cache.max_len
        );
        let device = self.embed.device();
        let ids = Tensor::new(tokens, device)?;
        let mut x = self.embed.index_select(&ids, 0)?.unsqueeze(0)?; // (1, t, hidden)
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let eps = cfg.rms_eps as f32;
        // The flash cache's length before this step, shared by every layer.
        let seqlens = Tensor::new(&[pos as u32], device)?;
        for (b, slot) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, eps)?;
            let q = rope(&b.q.forward(&h)?, cfg.heads, cfg.head_dim, &cos, &sin)?;
            let k = rope(&b.k.forward(&h)?, cfg.kv_heads, cfg.head_dim, &cos, &sin)?;
            let v =
                b.v.forward(&h)?
                    .reshape((1, t, cfg.kv_heads, cfg.head_dim))?;
            let a = match slot {
                LayerKv::Concat(kv) => {
                    let (k, v) = match kv.take() {
                        None => (k, v),
                        Some((pk, pv)) => {
                            (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?)
                        }
                    };
                    let a =
                        candle_flash::naive_attention(&q, &k, &v, &FlashAttn::new(scale).causal())?;
                    *kv = Some((k, v));
                    a
                }
                // One call appends this step's rows at `pos` and attends over `pos + t` keys.
                LayerKv::Fixed { k: kc, v: vc } => candle_flash::flash_attn_with_kvcache(
                    &q,
                    kc,
                    vc,
                    Some(&k),
                    Some(&v),
                    &seqlens,
                    None,
                    scale,
                    true,
                )?,
            };
            x = (x + b.o.forward(&a.reshape((1, t, cfg.hidden))?)?)?;
            let h = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
            let f = (candle_nn::ops::silu(&b.gate.forward(&h)?)? * b.up.forward(&h)?)?;
            x = (x + b.down.forward(&f)?)?;
        }
        cache.len += t;
        // Only the last position predicts the next token; the head is the embedding (tied).
        let last = candle_nn::ops::rms_norm(&x.get(0)?.get(t - 1)?, &self.norm, eps)?;
        let logits = self.embed.matmul(&last.unsqueeze(1)?)?.squeeze(1)?;
        Ok(logits.to_dtype(DType::F32)?)
    }

    /// The prompt text for one user message, following the GGUF's ChatML chat template
    /// (including its default system message). No Jinja engine: templates that are not ChatML
    /// are refused rather than rendered wrongly.
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        const SYSTEM_OPEN: &str = "<|im_start|>system\n";
        let mut out = String::new();
        if let Some(tpl) = &self.chat_template {
            ensure!(
                tpl.contains("<|im_start|>"),
                "the GGUF's chat template is not ChatML; only ChatML is supported"
            );
            if let Some(start) = tpl.find(SYSTEM_OPEN) {
                let rest = &tpl[start + SYSTEM_OPEN.len()..];
                let end = rest
                    .find("<|im_end|>")
                    .context("unterminated system message in template")?;
                out.push_str(&format!("{SYSTEM_OPEN}{}<|im_end|>\n", &rest[..end]));
            }
        }
        out.push_str(&format!(
            "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        ));
        Ok(out)
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // No special tokens are added: the chat template already spells them out.
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(anyhow::Error::msg)?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(anyhow::Error::msg)
    }

    /// Greedy generation: one prefill of `prompt`, then one token per step until a stop token
    /// (unless `ignore_stop`) or `max_tokens`. `on_token` sees each new token as it is chosen.
    /// The cache is sized for `prompt.len() + max_tokens`.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        attention: Attention,
        ignore_stop: bool,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let mut cache = self.new_cache(attention, prompt.len() + max_tokens)?;
        let mut tokens = Vec::new();
        let t = Instant::now();
        let mut logits = self.forward(prompt, &mut cache)?;
        // Reading the logits back (argmax) waits for the device, so the clock is honest.
        let mut next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        let prefill = t.elapsed();
        let mut decode = Duration::ZERO;
        let mut decode_steps = 0;
        while tokens.len() < max_tokens && (ignore_stop || !self.stop.contains(&next)) {
            tokens.push(next);
            on_token(next)?;
            // No forward pass for a token whose successor is not wanted.
            if tokens.len() == max_tokens {
                break;
            }
            let t = Instant::now();
            logits = self.forward(&[next], &mut cache)?;
            next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
            decode += t.elapsed();
            decode_steps += 1;
        }
        Ok(Generation {
            tokens,
            prefill,
            decode,
            decode_steps,
        })
    }
}

/// `(b, t, heads * d)` projections to rotated `(1, t, heads, d)`. The GGUF stores q and k with
/// the pairs of each rotation adjacent (llama.cpp's layout), hence the interleaved `rope_i`.
fn rope(x: &Tensor, heads: usize, d: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let t = x.dim(1)?;
    let x = x.reshape((1, t, heads, d))?.transpose(1, 2)?.contiguous()?;
    let x = candle_nn::rotary_emb::rope_i(&x, cos, sin)?;
    Ok(x.transpose(1, 2)?.contiguous()?)
}

/// cos and sin of `position * theta^(-2i/d)`, `(context, d/2)`, computed in f32 and then
/// stored in the model dtype (rope_i wants all three operands alike).
fn rope_tables(cfg: &Config, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.head_dim as f32))
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos = Tensor::arange(0u32, cfg.context as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((cfg.context, 1))?;
    let angles = pos.broadcast_mul(&inv)?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}

/// GPT-2 style byte-level BPE from `tokenizer.ggml.*`. SmolLM's pre-tokenizer ("smollm" in
/// llama.cpp) splits every digit apart, then applies the GPT-2 regex; no prefix space is added,
/// which is what keeps `decode(encode(s)) == s`.
fn tokenizer_from_gguf(c: &Content) -> Result<Tokenizer> {
    let model = md(c, "tokenizer.ggml.model")?.to_string()?;
    ensure!(
        model == "gpt2",
        "expected a gpt2 (byte-level BPE) tokenizer, found {model}"
    );
    let tokens = md_strings(c, "tokenizer.ggml.tokens")?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = md_strings(c, "tokenizer.ggml.merges")?
        .iter()
        .map(|m| {
            let (a, b) = m
                .split_once(' ')
                .with_context(|| format!("malformed merge {m:?}"))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(anyhow::Error::msg)
        .context("building the BPE model")?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tok.with_decoder(Some(ByteLevel::default()));
    // Control tokens (type 3: <|im_start|>, <|im_end|>, ...) must match as whole tokens in the
    // prompt instead of being split into bytes.
    let types = md(c, "tokenizer.ggml.token_type")?.to_vec()?;
    ensure!(
        types.len() == tokens.len(),
        "token_type and tokens differ in length"
    );
    let special: Vec<AddedToken> = types
        .iter()
        .zip(&tokens)
        .filter(|(ty, _)| matches!(ty.to_i32(), Ok(3)))
        .map(|(_, t)| AddedToken::from(t.to_string(), true))
        .collect();
    if special.is_empty() {
        bail!("the GGUF vocabulary marks no control tokens; the chat template needs them");
    }
    tok.add_special_tokens(&special);
    Ok(tok)
}
