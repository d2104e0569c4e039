//! Sentence embeddings with all-MiniLM-L6-v2 through this project's own BERT encoder, whose
//! attention is `candle_flash::flash_attn_varlen` over the packed sentences (no padding, no mask).
//! `--compare` also runs candle-transformers' `BertModel` and checks that both agree; `--padded`
//! also runs the padded batch with a key-padding bias (`FlashAttn::bias`) and checks that it gives
//! the varlen run's embeddings.
//!
//! ```text
//! scripts/fetch-models.sh
//! cargo run --release --features models --example bert -- --compare
//! cargo run --release --features models --example bert -- --compare --dtype bf16
//! cargo run --release --features models --example bert -- --padded
//! ```

#[path = "common/bert.rs"]
mod bert;
#[path = "common/cli.rs"]
mod cli;
#[path = "common/paths.rs"]
mod paths;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use candle::DType;
use clap::Parser;

use bert::{row_cosines, tokenize, Baseline, Files, FlashBert};
use cli::{DTypeArg, DeviceArg};

/// Agreement required between our embeddings and the baseline's.
const MIN_COSINE: f32 = 0.9999;

#[derive(Parser)]
#[command(about = "all-MiniLM-L6-v2 sentence embeddings with flash attention (varlen, no padding)")]
struct Args {
    /// Also run candle-transformers' BertModel and print the cosine per sentence; exits
    /// non-zero if any is below 0.9999.
    #[arg(long)]
    compare: bool,
    /// Also embed the sentences as a padded batch with a key-padding bias and print its cosine
    /// to the varlen run per sentence; exits non-zero if any is below 0.9999.
    #[arg(long)]
    padded: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Sentences to embed (repeat the flag); a built-in set of unequal lengths by default.
    #[arg(long = "sentence")]
    sentences: Vec<String>,
}

fn default_sentences() -> Vec<String> {
    [
        "The cat sits on the mat.",
        "A cat is sitting on a rug.",
        "Flash attention computes exact attention tile by tile, never storing the full score matrix.",
        "Paris is the capital of France.",
        "What is the capital city of France?",
        "Stock markets fell sharply on Monday after the central bank raised interest rates \
         by half a percentage point, surprising analysts who had expected a smaller move.",
    ]
    .map(String::from)
    .to_vec()
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Ok(false) when `--compare` found a disagreement.
fn run() -> Result<bool> {
    let args = Args::parse();
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    let sentences = if args.sentences.is_empty() {
        default_sentences()
    } else {
        args.sentences
    };
    let files = Files::locate()?;
    let ids = tokenize(&files, &sentences)?;

    let ours = FlashBert::load(&files, dtype, &device)?;
    let t = Instant::now();
    let emb = ours.embed(&ids)?;
    println!(
        "ours (flash_attn_varlen, {dtype:?}): {} sentences, {} tokens, {:.1} ms",
        ids.len(),
        ids.iter().map(Vec::len).sum::<usize>(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut padded_ok = true;
    if args.padded {
        let t = Instant::now();
        let padded = ours.embed_padded(&ids)?;
        let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
        println!(
            "ours (padded batch of {} x {longest} with a key-padding bias, {dtype:?}): {:.1} ms",
            ids.len(),
            t.elapsed().as_secs_f64() * 1e3
        );
        let cos = row_cosines(&padded, &emb)?;
        for (c, s) in cos.iter().zip(&sentences) {
            println!("  {c:.7}  {}", short(s));
        }
        padded_ok = cos.iter().all(|c| *c >= MIN_COSINE);
        let worst = cos.iter().copied().fold(f32::INFINITY, f32::min);
        println!(
            "min cosine(padded, varlen) {worst:.7}: {}",
            if padded_ok { "OK" } else { "FAILED (< 0.9999)" }
        );
    }
    if !args.compare {
        if args.padded {
            return Ok(padded_ok);
        }
        // Without a baseline, show that the embeddings mean something: pairwise similarities.
        let sim = emb.matmul(&emb.t()?)?.to_vec2::<f32>()?;
        for (i, s) in sentences.iter().enumerate() {
            let row: Vec<String> = sim[i].iter().map(|c| format!("{c:5.2}")).collect();
            println!("{}  {}", row.join(" "), short(s));
        }
        return Ok(true);
    }

    let mut base = Baseline::load(&files, dtype, &device)?.embed(&ids)?;
    let mut base_dtype = dtype;
    let values = base.flatten_all()?.to_vec1::<f32>()?;
    let nans = values.iter().filter(|x| x.is_nan()).count();
    if dtype != DType::F32 && values.iter().any(|x| !x.is_finite()) {
        // BertModel builds its mask as (1 - mask) * f32::MIN in the model dtype; f32::MIN
        // rounds to -inf in bf16 and 0 * -inf = NaN, so the shipped model cannot run in bf16.
        println!(
            "baseline BertModel in {dtype:?}: {nans} of {} embedding values are NaN (its f32::MIN \
             mask becomes -inf, 0*-inf = NaN); comparing against the baseline in F32 instead",
            values.len()
        );
        base = Baseline::load(&files, DType::F32, &device)?.embed(&ids)?;
        base_dtype = DType::F32;
    }
    let cos = row_cosines(&emb, &base)?;
    println!("cosine(ours {dtype:?}, candle-transformers BertModel {base_dtype:?}) per sentence:");
    for ((c, s), id) in cos.iter().zip(&sentences).zip(&ids) {
        println!("  {c:.7}  ({:3} tokens) {}", id.len(), short(s));
    }
    let worst = cos.iter().copied().fold(f32::INFINITY, f32::min);
    // NaN compares false, so a NaN cosine fails as well.
    let ok = cos.iter().all(|c| *c >= MIN_COSINE);
    println!(
        "min cosine {worst:.7}: {}",
        if ok { "OK" } else { "FAILED (< 0.9999)" }
    );
    Ok(ok && padded_ok)
}

fn short(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
