//! Trains a small character-level decoder-only Transformer with AdamW on the Tiny Shakespeare
//! excerpt in `examples/data/` (embedded in the binary, so a copied binary runs anywhere; `--data`
//! reads another text), with gradients flowing through either attention:
//! `naive_attention` (candle autograd through the score matrix) or `FlashAttn` (the op's own
//! backward pass). Everything but the attention call is shared, and weights and batches come
//! from `--seed`, so both backends start from the same weights and see the same batches.
//!
//! `--attention both` (the default) trains one model per backend in lockstep, prints the largest
//! |loss_naive - loss_flash| and fails (exit 1) if it exceeds `--tolerance` within the first
//! `--check-steps` steps, or if the loss did not fall. `--plot` writes the loss curves as SVG.
//!
//! ```text
//! cargo run --release --example train -- --plot docs/img/train-loss-cpu.svg
//! cargo run --release --example train -- --attention flash --steps 500
//! cargo run --release --features cuda,candle-nn/cuda --example train -- --device cuda --plot train-loss-cuda.svg
//! ```

#[path = "common/charlm.rs"]
mod charlm;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::Device;
use clap::{Parser, ValueEnum};

use charlm::{Attention, Batches, Config, Corpus, Trainer};

/// The default training text, `examples/data/tinyshakespeare.txt` (about 100 KB), compiled into
/// the binary so that it does not depend on the build machine's checkout.
const TINY_SHAKESPEARE: &str = include_str!("data/tinyshakespeare.txt");

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

/// Train a character-level Transformer with naive or flash attention (f32, AdamW).
#[derive(Parser, Debug)]
struct Args {
    /// Attention implementation; `both` trains one model per backend from the same weights and
    /// batches and compares their losses step by step.
    #[arg(long, value_enum, default_value_t = AttentionArg::Both)]
    attention: AttentionArg,
    /// `cuda` needs a build with `--features cuda,candle-nn/cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Optimiser steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Query heads (head dim = d_model / heads).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (GQA when fewer than --heads).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Characters per training sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// AdamW learning rate (other AdamW settings are candle-nn's defaults).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Steps of linear learning-rate warm-up.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Seeds the weights and the batch offsets.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Training text (the last 10% is held out for the final evaluation); by default the Tiny
    /// Shakespeare excerpt of examples/data/, embedded in the binary.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Write the loss curves (and, with `both`, |Δloss| per step) to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print a progress line every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// With `both`: the first this many steps must agree within --tolerance.
    #[arg(long, default_value_t = 50)]
    check_steps: usize,
    /// With `both`: largest |loss_naive - loss_flash| allowed within --check-steps.
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f64,
    /// Held-out batches evaluated after training.
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
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

/// One backend's run: its trainer, losses and timing.
struct Run {
    attention: Attention,
    trainer: Trainer,
    losses: Vec<f32>,
    /// Seconds per step.
    times: Vec<f64>,
}

impl Run {
    /// Tokens per second over the steps `from..to` (0-based).
    fn tokens_per_s(&self, tokens_per_step: usize, from: usize, to: usize) -> f64 {
        let secs: f64 = self.times[from..to].iter().sum();
        (tokens_per_step * (to - from)) as f64 / secs
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Trains and reports; `Ok(false)` when a check failed.
fn run(args: Args) -> Result<bool> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let dev = device(args.device)?;
    let (text, text_name) = match &args.data {
        Some(path) => (
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
            path.file_name().map_or(path.display().to_string(), |n| {
                n.to_string_lossy().into_owned()
            }),
        ),
        None => (TINY_SHAKESPEARE.to_string(), "tinyshakespeare.txt".into()),
    };
    let corpus = Corpus::new(&text)?;
    let (train, held_out) = corpus.split(0.1);
    let cfg = Config {
        layers: args.layers,
        d_model: args.d_model,
        heads: args.heads,
        kv_heads: args.kv_heads,
        seq_len: args.seq_len,
        batch: args.batch,
        lr: args.lr,
        warmup: args.warmup,
        seed: args.seed,
    };
    let backends = match args.attention {
        AttentionArg::Naive => vec![Attention::Naive],
        AttentionArg::Flash => vec![Attention::Flash],
        AttentionArg::Both => vec![Attention::Naive, Attention::Flash],
    };
    let mut runs = backends
        .iter()
        .map(|&a| {
            Ok(Run {
                attention: a,
                trainer: Trainer::new(&cfg, corpus.vocab.len(), a, &dev)?,
                losses: Vec::with_capacity(args.steps),
                times: Vec::with_capacity(args.steps),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens_per_step = cfg.batch * cfg.seq_len;
    println!(
        "{} layers, d_model {} ({} heads / {} kv heads × {}), {} parameters; {}-character vocab; \
         batch {} × seq {} = {} tokens/step; AdamW lr {}; seed {}; F32 on {:?}",
        cfg.layers,
        cfg.d_model,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim(),
        runs[0].trainer.model.parameter_count(),
        corpus.vocab.len(),
        cfg.batch,
        cfg.seq_len,
        tokens_per_step,
        cfg.lr,
        cfg.seed,
        args.device,
    );
    println!(
        "text: {} ({} characters: {} for training, {} held out)",
        match &args.data {
            Some(path) => path.display().to_string(),
            None => "examples/data/tinyshakespeare.txt (embedded)".into(),
        },
        corpus.ids.len(),
        train.len(),
        held_out.len()
    );

    let mut batches = Batches::new(train, cfg.batch, cfg.seq_len, cfg.seed)?;
    let mut last_log = 0;
    for step in 1..=args.steps {
        let (x, y) = batches.next_batch(&dev)?;
        for r in runs.iter_mut() {
            let t = Instant::now();
            let loss = r.trainer.step(&x, &y)?;
            r.times.push(t.elapsed().as_secs_f64());
            if !loss.is_finite() {
                bail!("{} loss is {loss} at step {step}", r.attention.name());
            }
            r.losses.push(loss);
        }
        if step == 1 || step % args.log_every.max(1) == 0 || step == args.steps {
            let mut line = format!("step {step:>5}/{}", args.steps);
            for r in &runs {
                let tps = r.tokens_per_s(tokens_per_step, last_log, step);
                let _ = write!(
                    line,
                    "  {} loss {:.4} {:>8.0} tok/s",
                    r.attention.name(),
                    r.losses[step - 1],
                    tps
                );
            }
            if let [a, b] = &runs[..] {
                let d = (a.losses[step - 1] - b.losses[step - 1]).abs();
                let _ = write!(line, "  |Δ| {d:.2e}");
            }
            println!("{line}");
            last_log = step;
        }
    }

    let mut ok = true;
    for r in &runs {
        let held = held_out_loss(&r.trainer, held_out, &cfg, args.eval_batches, &dev)?;
        // Step 1 compiles/allocates for the first time: leave it out of the rate when possible.
        let from = usize::from(args.steps > 1);
        let first = r.losses[0];
        let tail = &r.losses[args.steps - (args.steps / 2).clamp(1, 10)..];
        let tail_mean = tail.iter().sum::<f32>() / tail.len() as f32;
        println!(
            "{}: loss {:.4} at step 1, {:.4} at step {} (mean of the last {}: {:.4}); held-out loss \
             {}; {:.0} tokens/s (steps {}..{})",
            r.attention.name(),
            first,
            r.losses[args.steps - 1],
            args.steps,
            tail.len(),
            tail_mean,
            held.map_or("not evaluated".into(), |l| format!("{l:.4}")),
            r.tokens_per_s(tokens_per_step, from, args.steps),
            from + 1,
            args.steps
        );
        if args.steps >= 10 && tail_mean >= first {
            println!("FAIL: {} loss did not fall", r.attention.name());
            ok = false;
        }
    }
    if let [a, b] = &runs[..] {
        let deltas: Vec<f64> = a
            .losses
            .iter()
            .zip(&b.losses)
            .map(|(x, y)| (*x as f64 - *y as f64).abs())
            .collect();
        let checked = args.check_steps.min(args.steps);
        let max_checked = deltas[..checked].iter().fold(0f64, |m, &d| m.max(d));
        let max_all = deltas.iter().fold(0f64, |m, &d| m.max(d));
        println!(
            "max |loss_naive - loss_flash|: {max_checked:.3e} over steps 1..{checked} (tolerance \
             {:.0e}), {max_all:.3e} over all {} steps",
            args.tolerance, args.steps
        );
        // Every loss was checked finite when it was recorded, so no NaN hides in these maxima.
        if max_checked > args.tolerance {
            println!("FAIL: naive and flash losses differ by more than the tolerance");
            ok = false;
        }
        let speed =
            |r: &Run| r.tokens_per_s(tokens_per_step, usize::from(args.steps > 1), args.steps);
        println!("flash / naive tokens/s: {:.2}x", speed(b) / speed(a));
    }
    if let Some(path) = &args.plot {
        let title = [
            format!(
                "char-level Transformer on {}, f32 on {:?}",
                text_name, args.device
            ),
            format!(
                "{} layers, d_model {}, {}/{} heads, seq {} × batch {}, AdamW lr {} \
                 (warm-up {}), seed {}",
                cfg.layers,
                cfg.d_model,
                cfg.heads,
                cfg.kv_heads,
                cfg.seq_len,
                cfg.batch,
                cfg.lr,
                cfg.warmup,
                cfg.seed
            ),
        ];
        let curves: Vec<(&str, &[f32])> = runs
            .iter()
            .map(|r| (r.attention.name(), &r.losses[..]))
            .collect();
        let svg = svg::loss_plot(&title, &curves, args.tolerance);
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
        println!("plot: {}", path.display());
    }
    Ok(ok)
}

/// Mean loss over `n` seeded batches of the held-out text (no update); `None` when `n` is 0 or
/// the held-out text is too short.
fn held_out_loss(
    trainer: &Trainer,
    ids: &[u32],
    cfg: &Config,
    n: usize,
    dev: &Device,
) -> Result<Option<f32>> {
    if n == 0 || ids.len() <= cfg.seq_len + 1 {
        return Ok(None);
    }
    let mut batches = Batches::new(ids, cfg.batch, cfg.seq_len, cfg.seed.wrapping_add(1))?;
    let mut sum = 0f32;
    for _ in 0..n {
        let (x, y) = batches.next_batch(dev)?;
        sum += trainer.model.loss(&x, &y)?.to_scalar::<f32>()?;
    }
    Ok(Some(sum / n as f32))
}

/// A hand-written SVG line plot: two panels side by side, the losses of each backend (naive
/// solid, flash dashed on top of it) and, with two backends, |Δloss| per step on a log scale
/// with the tolerance drawn in. A plotting crate would add its dependency tree to every
/// `cargo test` build (examples are built by it) for two polylines and some ticks.
mod svg {
    use std::fmt::Write as _;

    const PANEL_W: f64 = 520.0;
    const PANEL_H: f64 = 360.0;
    const TITLE_H: f64 = 46.0;
    /// Left, right, top, bottom margins of the plotting area inside a panel.
    const MARGIN: (f64, f64, f64, f64) = (68.0, 18.0, 34.0, 46.0);
    const COLORS: [&str; 2] = ["#1f77b4", "#ff7f0e"];

    /// A plotting area: data ranges mapped onto pixels.
    struct Frame {
        x0: f64,
        y0: f64,
        xs: (f64, f64),
        ys: (f64, f64),
    }

    impl Frame {
        fn new(panel: usize, xs: (f64, f64), ys: (f64, f64)) -> Self {
            Frame {
                x0: panel as f64 * PANEL_W + MARGIN.0,
                y0: TITLE_H + MARGIN.2,
                xs,
                ys,
            }
        }
        fn w(&self) -> f64 {
            PANEL_W - MARGIN.0 - MARGIN.1
        }
        fn h(&self) -> f64 {
            PANEL_H - MARGIN.2 - MARGIN.3
        }
        fn px(&self, x: f64) -> f64 {
            self.x0 + (x - self.xs.0) / (self.xs.1 - self.xs.0) * self.w()
        }
        fn py(&self, y: f64) -> f64 {
            self.y0 + self.h() - (y - self.ys.0) / (self.ys.1 - self.ys.0) * self.h()
        }
    }

    /// A step of 1, 2 or 5 × 10^k giving about `n` intervals over `span`.
    fn nice_step(span: f64, n: f64) -> f64 {
        let raw = span / n;
        let mag = 10f64.powf(raw.log10().floor());
        let m = raw / mag;
        mag * if m < 1.5 {
            1.0
        } else if m < 3.5 {
            2.0
        } else if m < 7.5 {
            5.0
        } else {
            10.0
        }
    }

    fn esc(s: &str) -> String {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    }

    /// Axes box, ticks with labels (`ylabel` formats a y tick), titles.
    fn axes(
        out: &mut String,
        f: &Frame,
        yticks: &[f64],
        ylabel: impl Fn(f64) -> String,
        title: &str,
        ytitle: &str,
    ) {
        let (w, h) = (f.w(), f.h());
        let _ = writeln!(
            out,
            r##"<rect x="{:.1}" y="{:.1}" width="{w:.1}" height="{h:.1}" fill="none" stroke="#444"/>"##,
            f.x0, f.y0
        );
        let xstep = nice_step(f.xs.1 - f.xs.0, 6.0).max(1.0);
        let mut x = (f.xs.0 / xstep).ceil() * xstep;
        while x <= f.xs.1 + 1e-9 {
            let px = f.px(x);
            let _ = writeln!(
                out,
                r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#ddd"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{x}</text>"##,
                f.y0,
                f.y0 + h,
                f.y0 + h + 16.0
            );
            x += xstep;
        }
        for &y in yticks {
            let py = f.py(y);
            let _ = writeln!(
                out,
                r##"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                f.x0,
                f.x0 + w,
                f.x0 - 6.0,
                py + 4.0,
                ylabel(y)
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14">{}</text>"#,
            f.x0 + w / 2.0,
            f.y0 - 12.0,
            esc(title)
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
            f.x0 + w / 2.0,
            f.y0 + h + 36.0
        );
        let (tx, ty) = (f.x0 - 52.0, f.y0 + h / 2.0);
        let _ = writeln!(
            out,
            r#"<text x="{tx:.1}" y="{ty:.1}" text-anchor="middle" transform="rotate(-90 {tx:.1} {ty:.1})">{}</text>"#,
            esc(ytitle)
        );
    }

    fn polyline(out: &mut String, f: &Frame, ys: &[f64], color: &str, extra: &str) {
        let mut pts = String::new();
        for (i, &y) in ys.iter().enumerate() {
            let _ = write!(pts, "{:.1},{:.1} ", f.px((i + 1) as f64), f.py(y));
        }
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" {extra}/>"#,
            pts.trim_end()
        );
    }

    fn legend(out: &mut String, f: &Frame, entries: &[(&str, &str, &str)]) {
        let (x, mut y) = (f.x0 + f.w() - 150.0, f.y0 + 18.0);
        for (label, color, extra) in entries {
            let _ = writeln!(
                out,
                r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" {extra}/><text x="{:.1}" y="{:.1}">{}</text>"#,
                x + 28.0,
                x + 34.0,
                y + 4.0,
                esc(label)
            );
            y += 18.0;
        }
    }

    /// The figure: loss curves (panel 1) and, for two curves, their |difference| (panel 2).
    pub fn loss_plot(title: &[String], curves: &[(&str, &[f32])], tolerance: f64) -> String {
        let n = curves.iter().map(|c| c.1.len()).max().unwrap_or(1).max(2);
        let panels = if curves.len() == 2 { 2 } else { 1 };
        let width = PANEL_W * panels as f64;
        let height = TITLE_H + PANEL_H;
        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
        );
        out.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
        out.push('\n');
        for (i, line) in title.iter().enumerate() {
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{}" text-anchor="middle" font-size="13">{}</text>"#,
                width / 2.0,
                18 + 17 * i,
                esc(line)
            );
        }

        // Panel 1: the losses, linear scale.
        let all = curves.iter().flat_map(|c| c.1.iter().map(|&v| v as f64));
        let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let (lo, hi) = if lo < hi {
            (lo, hi)
        } else {
            (lo - 1.0, lo + 1.0)
        };
        let ystep = nice_step(hi - lo, 5.0);
        let ys = ((lo / ystep).floor() * ystep, (hi / ystep).ceil() * ystep);
        let f = Frame::new(0, (1.0, n as f64), ys);
        let ticks: Vec<f64> = (0..)
            .map(|i| ys.0 + i as f64 * ystep)
            .take_while(|&y| y <= ys.1 + ystep * 1e-6)
            .collect();
        let decimals = (-ystep.log10().floor()).max(0.0) as usize;
        axes(
            &mut out,
            &f,
            &ticks,
            |y| format!("{y:.decimals$}"),
            "training loss",
            "cross-entropy (nats / character)",
        );
        let styles = [
            r#"stroke-width="2.5""#,
            r#"stroke-width="1.5" stroke-dasharray="6 4""#,
        ];
        let mut entries = Vec::new();
        for (i, (name, losses)) in curves.iter().enumerate() {
            let ys: Vec<f64> = losses.iter().map(|&v| v as f64).collect();
            polyline(&mut out, &f, &ys, COLORS[i % 2], styles[i % 2]);
            entries.push((*name, COLORS[i % 2], styles[i % 2]));
        }
        legend(&mut out, &f, &entries);

        // Panel 2: |Δloss| per step, log scale; exact zeros sit on the bottom edge.
        if let [(a_name, a), (b_name, b)] = curves {
            let d: Vec<f64> = a
                .iter()
                .zip(b.iter())
                .map(|(x, y)| (*x as f64 - *y as f64).abs())
                .collect();
            let pos = d.iter().copied().filter(|&v| v > 0.0);
            let min_pos = pos.clone().fold(f64::INFINITY, f64::min);
            let max_pos = pos.fold(0f64, f64::max);
            let top = max_pos.max(tolerance).log10().floor() + 1.0;
            let bottom = if min_pos.is_finite() {
                min_pos.log10().floor()
            } else {
                top - 6.0
            }
            .min(top - 2.0);
            let f = Frame::new(1, (1.0, n as f64), (bottom, top));
            let ticks: Vec<f64> = (bottom as i32..=top as i32).map(f64::from).collect();
            axes(
                &mut out,
                &f,
                &ticks,
                |e| format!("1e{e}"),
                &format!("|loss_{a_name} − loss_{b_name}| per step"),
                "absolute difference (log scale)",
            );
            let logs: Vec<f64> = d
                .iter()
                .map(|&v| if v > 0.0 { v.log10() } else { bottom })
                .collect();
            polyline(&mut out, &f, &logs, "#2ca02c", r#"stroke-width="1.5""#);
            let ty = f.py(tolerance.log10());
            let _ = writeln!(
                out,
                r##"<line x1="{:.1}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#d62728" stroke-dasharray="3 3"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#d62728">tolerance {tolerance:.0e}</text>"##,
                f.x0,
                f.x0 + f.w(),
                f.x0 + f.w() - 6.0,
                ty - 5.0
            );
            if d.contains(&0.0) {
                let _ = writeln!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" fill="#555">steps with Δ = 0 drawn on the bottom edge</text>"##,
                    f.x0 + 6.0,
                    f.y0 + 16.0
                );
            }
        }
        out.push_str("</svg>\n");
        out
    }
}
