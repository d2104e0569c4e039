//! Chat with SmolLM2-135M-Instruct on this project's attention: the GGUF weights dequantized,
//! a Llama forward pass with a KV cache, greedy decoding, and `--attention naive|flash|both`.
//!
//! The flash backend keeps its cache in preallocated per-layer tensors that
//! `flash_attn_with_kvcache` appends to in place (one call per layer per step); the naive one
//! concatenates its cache every step and materialises the scores. `--attention both` runs the
//! two on the same prompt, checks that they pick the same greedy tokens, and prints prefill and
//! decode tokens/s side by side. `--context N` pads the prompt with repeated text to about N
//! tokens, to see how decoding scales with the length of the cache.
//!
//! ```text
//! scripts/fetch-models.sh
//! cargo run --release --features models --example smollm2 -- --prompt "What is the capital of France?"
//! cargo run --release --features models --example smollm2 -- --attention naive
//! cargo run --release --features models --example smollm2 -- --attention both --context 2048 --max-tokens 32 --ignore-stop
//! ```

#[path = "common/cli.rs"]
mod cli;
#[path = "common/paths.rs"]
mod paths;
#[path = "common/smollm2.rs"]
mod smollm2;

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};

use cli::{DTypeArg, DeviceArg};
use smollm2::{Attention, Generation, SmolLm2};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AttentionArg {
    Naive,
    Flash,
    /// Naive, then flash, on the same prompt: speeds side by side, tokens compared.
    Both,
}

#[derive(Parser)]
#[command(about = "SmolLM2-135M-Instruct greedy chat with naive or flash attention")]
struct Args {
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long, value_enum, default_value = "flash")]
    attention: AttentionArg,
    /// Pad the prompt with repeated filler text to about this many tokens (0: no padding).
    #[arg(long, default_value_t = 0)]
    context: usize,
    /// Keep generating past the end-of-turn token, so that every run decodes --max-tokens.
    #[arg(long)]
    ignore_stop: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
}

/// Padding for `--context`: neutral text the question then follows.
const FILLER: &str = "The archive keeps a ledger of every visitor: who came in, which shelves \
                      they searched, how long they stayed and what they asked the keeper. ";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The user message: `prompt` alone, or after enough filler that the whole chat prompt is
/// about `context` tokens (never fewer than the bare prompt's).
fn user_message(model: &SmolLm2, prompt: &str, context: usize) -> Result<String> {
    let bare = model.encode(&model.chat_prompt(prompt)?)?.len();
    if context <= bare {
        return Ok(prompt.to_string());
    }
    // Tokens per repetition, measured on two so that the seam between copies is counted.
    let one = model.encode(FILLER)?.len();
    let per = (model.encode(&FILLER.repeat(2))?.len() - one).max(1);
    let n = (context - bare).div_ceil(per);
    Ok(format!("{}\n\n{prompt}", FILLER.repeat(n)))
}

fn per_sec(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn run() -> Result<()> {
    let args = Args::parse();
    ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    let device = args.device.device()?;
    let path = smollm2::locate()?;
    let t = Instant::now();
    let model = SmolLm2::load(&path, args.dtype.dtype(), &device)?;
    eprintln!(
        "loaded {} ({} layers, {} heads / {} kv heads, head dim {}) in {:.1} s",
        path.display(),
        model.cfg.layers,
        model.cfg.heads,
        model.cfg.kv_heads,
        model.cfg.head_dim,
        t.elapsed().as_secs_f64()
    );

    let user = user_message(&model, &args.prompt, args.context)?;
    let ids = model.encode(&model.chat_prompt(&user)?)?;
    ensure!(
        ids.len() + args.max_tokens <= model.cfg.context,
        "prompt ({} tokens) plus --max-tokens {} exceed the model's context of {}",
        ids.len(),
        args.max_tokens,
        model.cfg.context
    );
    let backends: &[Attention] = match args.attention {
        AttentionArg::Naive => &[Attention::Naive],
        AttentionArg::Flash => &[Attention::Flash],
        AttentionArg::Both => &[Attention::Naive, Attention::Flash],
    };
    eprintln!(
        "prompt: {} tokens, attention: {:?}, up to {} new tokens",
        ids.len(),
        args.attention,
        args.max_tokens
    );

    let mut runs: Vec<(Attention, Generation)> = Vec::new();
    for &attention in backends {
        // An untimed short run first, so neither backend pays for first-touch allocations.
        let warm = model.encode(&model.chat_prompt("Hi")?)?;
        model.generate(&warm, 4, attention, true, |_| Ok(()))?;

        // Print the text as it grows (one backend only): decoding the whole answer each step
        // keeps multi-token characters intact, and only the new suffix is written.
        let stream = backends.len() == 1;
        let mut answer = Vec::new();
        let mut shown = 0;
        let g = model.generate(&ids, args.max_tokens, attention, args.ignore_stop, |id| {
            if stream {
                answer.push(id);
                let text = model.decode(&answer)?;
                if text.len() > shown && text.is_char_boundary(shown) {
                    print!("{}", &text[shown..]);
                    std::io::stdout().flush().context("writing to stdout")?;
                    shown = text.len();
                }
            }
            Ok(())
        })?;
        if stream {
            println!();
        }
        runs.push((attention, g));
    }
    if backends.len() > 1 {
        println!("{}", model.decode(&runs[runs.len() - 1].1.tokens)?);
    }

    println!(
        "{:<7} {:>8} {:>14} {:>8} {:>13}",
        "backend", "prompt", "prefill tok/s", "decoded", "decode tok/s"
    );
    for (attention, g) in &runs {
        println!(
            "{:<7} {:>8} {:>14.1} {:>8} {:>13.2}",
            format!("{attention:?}").to_lowercase(),
            ids.len(),
            per_sec(ids.len(), g.prefill),
            g.decode_steps,
            per_sec(g.decode_steps, g.decode)
        );
    }
    eprintln!("ids: {:?}", runs[0].1.tokens);
    if let [(_, naive), (_, flash)] = runs.as_slice() {
        let same = naive.tokens == flash.tokens;
        println!(
            "greedy tokens identical: {} ({} tokens); flash decode speed-up {:.2}x",
            if same { "yes" } else { "no" },
            flash.tokens.len(),
            per_sec(flash.decode_steps, flash.decode) / per_sec(naive.decode_steps, naive.decode)
        );
        if !same {
            bail!(
                "naive and flash chose different tokens: {:?} vs {:?}",
                naive.tokens,
                flash.tokens
            )
        }
    }
    Ok(())
}
