//! Chat with SmolLM2-135M-Instruct on this project's attention: the GGUF weights dequantized,
//! a Llama forward pass with a KV cache, greedy decoding, and `--attention naive|flash`.
//!
//! ```text
//! scripts/fetch-models.sh
//! cargo run --release --features models --example smollm2 -- --prompt "What is the capital of France?"
//! cargo run --release --features models --example smollm2 -- --attention naive
//! ```

#[path = "common/cli.rs"]
mod cli;
#[path = "common/paths.rs"]
mod paths;
#[path = "common/smollm2.rs"]
mod smollm2;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;

use cli::{DTypeArg, DeviceArg};
use smollm2::{Attention, SmolLm2};

#[derive(Parser)]
#[command(about = "SmolLM2-135M-Instruct greedy chat with naive or flash attention")]
struct Args {
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long, value_enum, default_value = "flash")]
    attention: Attention,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
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

    let prompt = model.chat_prompt(&args.prompt)?;
    let ids = model.encode(&prompt)?;
    eprintln!(
        "prompt: {} tokens, attention: {:?}",
        ids.len(),
        args.attention
    );

    // Print the text as it grows: decoding the whole answer each step keeps multi-token
    // characters intact, and only the new suffix is written.
    let mut answer = Vec::new();
    let mut shown = 0;
    let t = Instant::now();
    let tokens = model.generate(&ids, args.max_tokens, args.attention, |id| {
        answer.push(id);
        let text = model.decode(&answer)?;
        if text.len() > shown && text.is_char_boundary(shown) {
            print!("{}", &text[shown..]);
            std::io::stdout().flush().context("writing to stdout")?;
            shown = text.len();
        }
        Ok(())
    })?;
    let secs = t.elapsed().as_secs_f64();
    println!();
    eprintln!(
        "{} tokens in {:.2} s ({:.1} tokens/s, prefill included); ids: {:?}",
        tokens.len(),
        secs,
        tokens.len() as f64 / secs,
        tokens
    );
    Ok(())
}
