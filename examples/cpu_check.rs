//! Quick agreement check of the CPU flash path against `candle_flash::naive_attention` over odd
//! shapes and every option (causal, windows, softcap, ALiBi, GQA, f16/bf16, strided q), plus the
//! log-sum-exp against a scalar f64 reference and the NaN / empty-row rules. Exits non-zero on
//! the first disagreement.
//!
//! ```text
//! cargo run --release --example cpu_check
//! ```

use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use candle_flash::semantics::{alibi_bias, kv_head, ScoreMod, Window};
use candle_flash::{naive_attention, FlashAttn};
use clap::Parser;

#[derive(Parser)]
#[command(about = "CPU flash attention vs the naive reference over odd shapes and options")]
struct Args {
    /// Print every case, not only failures.
    #[arg(long)]
    verbose: bool,
}

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
    window: Window,
    softcap: f32,
    alibi: bool,
    /// q stored as (b, h, s, d) and seen as (b, s, h, d).
    strided_q: bool,
    /// k stored with the head dim strided (a transposed (b, s, d, h) seen as (b, s, h, d)).
    strided_k: bool,
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 4e-3,
        _ => 2.5e-2,
    }
}

/// f64 log-sum-exp of every `(b, h, i)` straight from the definitions in `semantics`.
fn lse_reference(q: &[f32], k: &[f32], c: &Case, sm: ScoreMod, slopes: &[f32]) -> Vec<f64> {
    let (sq, sk, h, hk, d) = (c.sq, c.sk, c.h, c.hk, c.d);
    let mut out = vec![f64::NEG_INFINITY; c.b * h * sq];
    for b in 0..c.b {
        for hh in 0..h {
            let kh = kv_head(hh, h, hk);
            let slope = if c.alibi { slopes[hh] } else { 0.0 };
            for i in 0..sq {
                let (lo, hi) = c.window.key_range(i, sq, sk);
                let mut s = Vec::new();
                for j in lo..hi {
                    let mut dot = 0.0f64;
                    for x in 0..d {
                        dot += q[((b * sq + i) * h + hh) * d + x] as f64
                            * k[((b * sk + j) * hk + kh) * d + x] as f64;
                    }
                    let mut v = sm.cap((dot * sm.scale as f64) as f32) as f64;
                    if slope != 0.0 {
                        v -= alibi_bias(slope, i, j, sq, sk) as f64;
                    }
                    s.push(v);
                }
                if s.is_empty() {
                    continue;
                }
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                out[(b * h + hh) * sq + i] = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            }
        }
    }
    out
}

fn run(c: &Case, dev: &Device) -> Result<(f32, f32)> {
    let q32 = Tensor::randn(0f32, 1., (c.b, c.sq, c.h, c.d), dev)?;
    let k32 = Tensor::randn(0f32, 1., (c.b, c.sk, c.hk, c.d), dev)?;
    let v32 = Tensor::randn(0f32, 1., (c.b, c.sk, c.hk, c.d), dev)?;
    // Round once to the test dtype; the reference works from the rounded values.
    let (q, k, v) = (
        q32.to_dtype(c.dtype)?,
        k32.to_dtype(c.dtype)?,
        v32.to_dtype(c.dtype)?,
    );
    let q = if c.strided_q {
        q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?
    } else {
        q
    };
    let k = if c.strided_k {
        k.transpose(2, 3)?.contiguous()?.transpose(2, 3)?
    } else {
        k
    };
    let slopes: Vec<f32> = (0..c.h).map(|x| 0.5f32.powi(x as i32 + 1)).collect();
    let mut opts = FlashAttn::new(1.0 / (c.d as f32).sqrt()).window(c.window.left, c.window.right);
    if c.softcap > 0.0 {
        opts = opts.softcap(c.softcap);
    }
    if c.alibi {
        opts = opts.alibi(&Tensor::new(slopes.as_slice(), dev)?);
    }
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    let f32s = |t: &Tensor| t.to_dtype(DType::F32);
    let reference = naive_attention(&f32s(&q)?, &f32s(&k)?, &f32s(&v)?, &opts)?;
    let got = f32s(&out)?.flatten_all()?.to_vec1::<f32>()?;
    let want = reference.flatten_all()?.to_vec1::<f32>()?;
    let mut err = 0f32;
    for (g, w) in got.iter().zip(&want) {
        if !g.is_finite() {
            bail!("non-finite output {g} where the reference is {w}");
        }
        err = err.max((g - w).abs());
    }
    let sm = ScoreMod {
        scale: opts.softmax_scale,
        softcap: c.softcap,
    };
    let qv = f32s(&q)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let kv = f32s(&k)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let lse_want = lse_reference(&qv, &kv, c, sm, &slopes);
    let lse_got = lse.flatten_all()?.to_vec1::<f32>()?;
    let mut lse_err = 0f32;
    for (g, w) in lse_got.iter().zip(&lse_want) {
        if w.is_infinite() {
            if *g != f32::NEG_INFINITY {
                bail!("lse {g} for a row that sees no key");
            }
        } else {
            lse_err = lse_err.max((*g as f64 - w).abs() as f32);
        }
    }
    // Rows that see no key output exactly zero.
    for b in 0..c.b {
        for i in 0..c.sq {
            let (lo, hi) = c.window.key_range(i, c.sq, c.sk);
            if lo == hi {
                let row = (b * c.sq + i) * c.h * c.d;
                if got[row..row + c.h * c.d].iter().any(|&x| x != 0.0) {
                    bail!("row {i} sees no key but is not 0");
                }
            }
        }
    }
    Ok((err, lse_err))
}

/// A NaN in one query row poisons that row (output and lse) and nothing else.
fn nan_row(dev: &Device) -> Result<()> {
    for causal in [false, true] {
        let (sq, sk, h, d) = (70, 90, 2, 40);
        let mut qv = Tensor::randn(0f32, 1., (1, sq, h, d), dev)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let bad = 66;
        qv[(bad * h) * d + 3] = f32::NAN;
        let q = Tensor::from_vec(qv, (1, sq, h, d), dev)?;
        let k = Tensor::randn(0f32, 1., (1, sk, h, d), dev)?;
        let v = Tensor::randn(0f32, 1., (1, sk, h, d), dev)?;
        let mut op = FlashAttn::new(0.2);
        if causal {
            op = op.causal();
        }
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        let out = out.squeeze(0)?.to_vec3::<f32>()?;
        let lse = lse.squeeze(0)?.to_vec2::<f32>()?;
        for (i, row) in out.iter().enumerate() {
            for (hh, x) in row.iter().enumerate() {
                let poisoned = i == bad && hh == 0;
                if poisoned != x.iter().all(|x| x.is_nan())
                    || (!poisoned && x.iter().any(|x| x.is_nan()))
                {
                    bail!("NaN query row {bad}: row {i} head {hh} wrong (causal {causal})");
                }
                if poisoned != lse[hh][i].is_nan() {
                    bail!("NaN query row {bad}: lse of row {i} head {hh} wrong");
                }
            }
        }
    }
    Ok(())
}

/// Packed varlen sequences give what each sequence gives on its own (through the naive path).
fn varlen(dev: &Device) -> Result<()> {
    let lens_q = [1usize, 130, 0, 77, 300];
    let lens_k = [5usize, 129, 4, 300, 77];
    let (h, hk, d) = (6, 2, 40);
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    let q = Tensor::randn(0f32, 1., (tq, h, d), dev)?;
    let k = Tensor::randn(0f32, 1., (tk, hk, d), dev)?;
    let v = Tensor::randn(0f32, 1., (tk, hk, d), dev)?;
    let cum = |l: &[usize]| -> Vec<u32> {
        std::iter::once(0)
            .chain(l.iter().scan(0u32, |a, &x| {
                *a += x as u32;
                Some(*a)
            }))
            .collect()
    };
    let (cq, ck) = (cum(&lens_q), cum(&lens_k));
    for causal in [false, true] {
        let opts = if causal {
            FlashAttn::new(0.15).causal()
        } else {
            FlashAttn::new(0.15)
        };
        let out = opts.forward_varlen(
            &q,
            &k,
            &v,
            &Tensor::new(cq.as_slice(), dev)?,
            &Tensor::new(ck.as_slice(), dev)?,
            300,
            300,
        )?;
        for (b, (&lq, &lk)) in lens_q.iter().zip(&lens_k).enumerate() {
            if lq == 0 {
                continue;
            }
            let (q0, k0) = (cq[b] as usize, ck[b] as usize);
            let want = naive_attention(
                &q.narrow(0, q0, lq)?.unsqueeze(0)?,
                &k.narrow(0, k0, lk)?.unsqueeze(0)?,
                &v.narrow(0, k0, lk)?.unsqueeze(0)?,
                &opts,
            )?
            .squeeze(0)?;
            let got = out.narrow(0, q0, lq)?;
            let err = (got - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            if err.is_nan() || err > 1e-4 {
                bail!("varlen sequence {b} (causal {causal}): max error {err}");
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::Cpu;
    let seqs = [1usize, 17, 113, 239, 1025];
    let dims = [8usize, 24, 40, 64, 80, 96, 128, 256];
    let windows = [
        Window::FULL,
        Window::CAUSAL,
        Window::new(Some(37), Some(0)),
        Window::new(Some(5), Some(70)),
        Window::new(None, Some(3)),
        Window::new(Some(0), Some(0)),
    ];
    let heads = [(6usize, 6usize), (6, 2), (6, 1), (2, 2)];
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    let mut cases = Vec::new();
    let mut n = 0usize;
    for &sq in &seqs {
        for &sk in &seqs {
            for w in 0..3 {
                n += 1;
                let (h, hk) = heads[n % heads.len()];
                let big = sq * sk > 200_000;
                cases.push(Case {
                    b: if big { 1 } else { 1 + n % 3 },
                    sq,
                    sk,
                    h: if big { 2 } else { h },
                    hk: if big { 1 } else { hk },
                    d: dims[n % dims.len()],
                    dtype: dtypes[(n / 2) % dtypes.len()],
                    window: windows[(n + w) % windows.len()],
                    softcap: if n % 5 == 1 { 20.0 } else { 0.0 },
                    alibi: n % 7 == 3,
                    strided_q: n % 4 == 1,
                    strided_k: n % 6 == 5,
                });
            }
        }
    }
    // Every head dim under every option at one ragged shape.
    for (x, &d) in dims.iter().enumerate() {
        for (y, &window) in windows.iter().enumerate() {
            cases.push(Case {
                b: 2,
                sq: 113,
                sk: 203,
                h: 6,
                hk: [6, 2, 1][(x + y) % 3],
                d,
                dtype: dtypes[(x + y) % 3],
                window,
                softcap: if y % 2 == 0 { 5.0 } else { 0.0 },
                alibi: x % 2 == 1,
                strided_q: y % 3 == 0,
                strided_k: y % 3 == 1,
            });
        }
    }
    let mut worst = 0f32;
    for c in &cases {
        let (err, lse_err) = run(c, &dev)?;
        let ok = err <= tol(c.dtype) && lse_err <= 1e-3;
        if args.verbose || !ok {
            println!("{c:?}: max |out - naive| = {err:.2e}, max |lse - f64| = {lse_err:.2e}");
        }
        if !ok {
            bail!("disagreement beyond tolerance");
        }
        worst = worst.max(err / tol(c.dtype));
    }
    nan_row(&dev)?;
    varlen(&dev)?;
    println!(
        "{} cases agree (worst error {:.0}% of its tolerance); NaN rows propagate; varlen agrees",
        cases.len(),
        worst * 100.0
    );
    Ok(())
}
