//! The CUDA path against the f64 reference, the CPU path and itself. One binary, so it can travel
//! to a GPU machine; every test returns early (with a message) where no CUDA device exists.
//!
//! `CANDLE_FLASH_GPU_SMALL=1` cuts the matrix down to a few small ragged shapes, for running under
//! compute-sanitizer.

mod common;

use candle::{DType, Device, Tensor};
use candle_flash::FlashAttn;
use common::{assert_close, max_abs_err, randn, reference, reference_varlen, tolerances};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no CUDA device, skipping the GPU tests: {e}");
            None
        }
    }
}

fn small() -> bool {
    std::env::var_os("CANDLE_FLASH_GPU_SMALL").is_some()
}

#[derive(Clone, Copy, Debug)]
enum Mask {
    Full,
    Causal,
    Window(usize, usize),
    LeftOnly(usize),
}

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    mask: Mask,
    softcap: f32,
    alibi: bool,
}

impl Case {
    fn opts(&self, dev: &Device) -> candle::Result<FlashAttn> {
        let mut o = FlashAttn::new(1.0 / (self.d as f32).sqrt());
        o = match self.mask {
            Mask::Full => o,
            Mask::Causal => o.causal(),
            Mask::Window(l, r) => o.window(Some(l), Some(r)),
            Mask::LeftOnly(l) => o.window(Some(l), None),
        };
        if self.softcap > 0.0 {
            o = o.softcap(self.softcap);
        }
        if self.alibi {
            let slopes: Vec<f32> = (0..self.h).map(|i| 0.5f32.powi(i as i32 + 1)).collect();
            o = o.alibi(&Tensor::from_vec(slopes, self.h, dev)?);
        }
        Ok(o)
    }

    fn inputs(&self, seed: u64) -> candle::Result<(Tensor, Tensor, Tensor)> {
        let cpu = &Device::Cpu;
        Ok((
            randn(&[self.b, self.sq, self.h, self.d], self.dtype, seed, cpu)?,
            randn(
                &[self.b, self.sk, self.hk, self.d],
                self.dtype,
                seed + 1,
                cpu,
            )?,
            randn(
                &[self.b, self.sk, self.hk, self.d],
                self.dtype,
                seed + 2,
                cpu,
            )?,
        ))
    }
}

/// Leaves NaN behind in the allocator's pool, so an output element the kernel fails to write
/// comes back as NaN rather than a lucky zero.
fn poison_pool(dev: &Device, elems: usize) -> candle::Result<()> {
    let t = Tensor::full(f32::NAN, elems.max(1) * 2, dev)?;
    dev.synchronize()?;
    drop(t);
    Ok(())
}

/// Checks the lse: same `-inf` rows as the reference, finite ones within `tol`.
fn check_lse(what: &str, lse: &Tensor, reference: &[f64], tol: f64) {
    let l = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(l.len(), reference.len(), "{what}: lse length");
    for (i, (&a, &r)) in l.iter().zip(reference).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(
                a,
                f32::NEG_INFINITY,
                "{what}: lse[{i}] should be -inf (row sees no key)"
            );
        } else {
            assert!(
                (a as f64 - r).abs() <= tol,
                "{what}: lse[{i}] = {a}, reference {r}"
            );
        }
    }
}

/// Runs one case on the GPU and checks output and lse against the f64 reference, with the naive
/// (materialising) implementation in the same dtype on the GPU as the precision yardstick.
/// Returns the GPU output.
fn check_case(dev: &Device, c: &Case, seed: u64) -> candle::Result<Tensor> {
    let what = format!("{c:?}");
    let (q, k, v) = c.inputs(seed)?;
    let opts_cpu = c.opts(&Device::Cpu)?;
    let (ref_out, ref_lse) = reference(&q, &k, &v, &opts_cpu)?;
    let (qg, kg, vg) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?);
    let opts = c.opts(dev)?;
    poison_pool(dev, c.b * c.sq * c.h * c.d)?;
    let (out, lse) = opts.forward_with_lse(&qg, &kg, &vg)?;
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(out.dtype(), c.dtype, "{what}: output dtype");
    let naive = candle_flash::naive_attention(&qg, &kg, &vg, &opts)?;
    assert_close(&what, &out, &naive, &ref_out, true);
    check_lse(&what, &lse, &ref_lse, 1e-3);
    Ok(out)
}

fn matrix() -> Vec<Case> {
    let pairs: &[(usize, usize)] = if small() {
        &[(1, 239), (113, 203), (203, 113), (65, 65)]
    } else {
        &[
            (1, 1),
            (1, 239),
            (239, 1),
            (113, 203),
            (203, 113),
            (127, 513),
            (64, 64),
            (65, 129),
            (128, 127),
            (129, 63),
            (1023, 1024),
            (1024, 1023),
        ]
    };
    let dims: &[usize] = if small() {
        &[40, 64, 128]
    } else {
        &[24, 40, 64, 80, 96, 128, 256, 33, 160, 192, 224, 8]
    };
    let heads = [(6, 6), (6, 2), (6, 1)];
    let masks = [
        Mask::Full,
        Mask::Causal,
        Mask::Window(37, 5),
        Mask::LeftOnly(64),
        Mask::Causal,
    ];
    let mut cases = Vec::new();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (i, &(sq, sk)) in pairs.iter().enumerate() {
            for (j, &d) in dims.iter().enumerate() {
                // Walk the other axes along the diagonal of (pair, dim) so each pair meets every
                // head dim, and heads / masks / modifiers cycle through all their values.
                let n = i * dims.len() + j;
                if (sq > 1000) && j % 3 != 0 {
                    continue; // long pairs: a third of the head dims keep the f64 reference quick
                }
                let (h, hk) = heads[n % 3];
                let mods = (n / 3) % 4;
                cases.push(Case {
                    dtype,
                    b: if sq * sk > 100_000 {
                        1
                    } else {
                        [1, 4, 9][(n / 2) % 3]
                    },
                    sq,
                    sk,
                    h,
                    hk,
                    d,
                    mask: masks[(n + dtype.size_in_bytes()) % masks.len()],
                    softcap: if mods & 1 == 1 { 2.5 } else { 0.0 },
                    alibi: mods & 2 == 2,
                });
            }
        }
    }
    cases
}

#[test]
fn parity_matrix_against_f64_reference() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cases = matrix();
    for (i, c) in cases.iter().enumerate() {
        check_case(&dev, c, 1000 + i as u64)?;
    }
    eprintln!("{} GPU parity cases passed", cases.len());
    Ok(())
}

#[test]
fn decode_gqa_mqa_and_leading_empty_rows() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (h, hk) in [(6, 2), (6, 1), (8, 8)] {
            // Decode: one query against a long cache.
            let c = Case {
                dtype,
                b: 4,
                sq: 1,
                sk: 777,
                h,
                hk,
                d: 128,
                mask: Mask::Causal,
                softcap: 0.0,
                alibi: false,
            };
            check_case(&dev, &c, 7)?;
        }
        // Causal with sq > sk: the leading rows see no key (output exactly 0, lse -inf).
        let c = Case {
            dtype,
            b: 2,
            sq: 150,
            sk: 40,
            h: 6,
            hk: 2,
            d: 64,
            mask: Mask::Causal,
            softcap: 0.0,
            alibi: true,
        };
        let out = check_case(&dev, &c, 11)?;
        let lead = out
            .narrow(1, 0, 110)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert!(
            lead.iter().all(|&x| x == 0.0),
            "rows that see no key must be exactly 0"
        );
    }
    Ok(())
}

#[test]
fn varlen_against_reference() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let lens: &[(u32, u32)] = if small() {
        &[(5, 9), (70, 33), (1, 130)]
    } else {
        &[
            (5, 9),
            (130, 129),
            (0, 7),
            (1, 300),
            (257, 64),
            (64, 0),
            (33, 33),
        ]
    };
    let mut cu_q = vec![0u32];
    let mut cu_k = vec![0u32];
    for &(a, b) in lens {
        cu_q.push(cu_q.last().unwrap() + a);
        cu_k.push(cu_k.last().unwrap() + b);
    }
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let max_q = lens.iter().map(|l| l.0).max().unwrap() as usize;
    let max_k = lens.iter().map(|l| l.1).max().unwrap() as usize;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (d, mask, alibi) in [
            (64, Mask::Causal, false),
            (96, Mask::Full, true),
            (40, Mask::Window(20, 3), false),
        ] {
            let (h, hk) = (6, 2);
            let cpu = &Device::Cpu;
            let q = randn(&[tq, h, d], dtype, 5, cpu)?;
            let k = randn(&[tk, hk, d], dtype, 6, cpu)?;
            let v = randn(&[tk, hk, d], dtype, 7, cpu)?;
            let c = Case {
                dtype,
                b: lens.len(),
                sq: 0,
                sk: 0,
                h,
                hk,
                d,
                mask,
                softcap: 0.0,
                alibi,
            };
            let (ref_out, ref_lse) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, &c.opts(cpu)?)?;
            let opts = c.opts(&dev)?;
            let sq_t = Tensor::new(cu_q.as_slice(), &dev)?;
            let sk_t = Tensor::new(cu_k.as_slice(), &dev)?;
            poison_pool(&dev, tq * h * d)?;
            let (out, lse) = opts.forward_varlen_with_lse(
                &q.to_device(&dev)?,
                &k.to_device(&dev)?,
                &v.to_device(&dev)?,
                &sq_t,
                &sk_t,
                max_q,
                max_k,
            )?;
            let what = format!("varlen {dtype:?} d{d} {mask:?} alibi {alibi}");
            let err =
                max_abs_err(&out, &ref_out)?.unwrap_or_else(|| panic!("{what}: non-finite output"));
            let (_, cap) = tolerances(dtype);
            assert!(err <= cap, "{what}: max abs err {err:.3e} > {cap:.1e}");
            check_lse(&what, &lse, &ref_lse, 1e-3);
        }
    }
    Ok(())
}

#[test]
fn gpu_agrees_with_cpu_path() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for c in [
            Case {
                dtype,
                b: 2,
                sq: 200,
                sk: 333,
                h: 6,
                hk: 2,
                d: 128,
                mask: Mask::Causal,
                softcap: 0.0,
                alibi: false,
            },
            Case {
                dtype,
                b: 3,
                sq: 97,
                sk: 97,
                h: 6,
                hk: 6,
                d: 80,
                mask: Mask::Window(16, 16),
                softcap: 5.0,
                alibi: true,
            },
        ] {
            let (q, k, v) = c.inputs(42)?;
            let (cpu_out, cpu_lse) = c.opts(&Device::Cpu)?.forward_with_lse(&q, &k, &v)?;
            let (gpu_out, gpu_lse) = c.opts(&dev)?.forward_with_lse(
                &q.to_device(&dev)?,
                &k.to_device(&dev)?,
                &v.to_device(&dev)?,
            )?;
            let diff = (cpu_out.to_dtype(DType::F32)?
                - gpu_out.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
            let (_, cap) = tolerances(dtype);
            assert!(
                diff as f64 <= 2.0 * cap,
                "{c:?}: CPU and GPU differ by {diff:.3e}"
            );
            let ldiff = (cpu_lse - gpu_lse.to_device(&Device::Cpu)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                ldiff <= 1e-3,
                "{c:?}: CPU and GPU lse differ by {ldiff:.3e}"
            );
        }
    }
    Ok(())
}

fn bits(t: &Tensor) -> candle::Result<Vec<u32>> {
    Ok(match t.dtype() {
        DType::F32 => t
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::F16 => t
            .flatten_all()?
            .to_vec1::<half::f16>()?
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        _ => t
            .flatten_all()?
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
    })
}

#[test]
fn views_in_nan_buffers_match_contiguous_bitwise() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (d, mask) in [
            (64, Mask::Causal),
            (40, Mask::Full),
            (128, Mask::Window(50, 0)),
        ] {
            let c = Case {
                dtype,
                b: 2,
                sq: 77,
                sk: 150,
                h: 6,
                hk: 2,
                d,
                mask,
                softcap: 0.0,
                alibi: false,
            };
            let (q, k, v) = c.inputs(3)?;
            let (q, k, v) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
            let opts = c.opts(&dev)?;
            let base = opts.forward(&q, &k, &v)?;
            // (b, h, s, d) storage seen as (b, s, h, d): the in-place fast path with strides.
            let tq = common::transposed_view(&q)?;
            let tk = common::transposed_view(&k)?;
            let tv = common::transposed_view(&v)?;
            assert!(!tq.is_contiguous());
            let t_out = opts.forward(&tq, &tk, &tv)?;
            assert_eq!(
                bits(&base)?,
                bits(&t_out)?,
                "{c:?}: transposed views differ"
            );
            // Inside NaN-filled buffers (odd row strides: the packed path), k and v laid out
            // differently from each other.
            let nq = common::view_in_nan_buffer(&q)?;
            let nk = common::view_in_nan_buffer(&tk)?;
            let nv = common::view_in_nan_buffer(&v)?;
            let n_out = opts.forward(&nq, &nk, &nv)?;
            assert_eq!(
                bits(&base)?,
                bits(&n_out)?,
                "{c:?}: views in NaN buffers differ"
            );
            // A last dim that is not contiguous.
            let sq_ = q.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
            let s_out = opts.forward(&sq_, &k, &v)?;
            assert_eq!(
                bits(&base)?,
                bits(&s_out)?,
                "{c:?}: strided head dim differs"
            );
        }
    }
    Ok(())
}

#[test]
fn bitwise_deterministic_over_100_runs() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let runs = if small() { 3 } else { 100 };
    for dtype in [DType::BF16, DType::F32] {
        let c = Case {
            dtype,
            b: 2,
            sq: 1000,
            sk: 1000,
            h: 6,
            hk: 2,
            d: 128,
            mask: Mask::Causal,
            softcap: 0.0,
            alibi: false,
        };
        let (q, k, v) = c.inputs(9)?;
        let (q, k, v) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
        let opts = c.opts(&dev)?;
        let (o0, l0) = opts.forward_with_lse(&q, &k, &v)?;
        let (b0, lb0) = (bits(&o0)?, bits(&l0)?);
        for run in 1..runs {
            let (o, l) = opts.forward_with_lse(&q, &k, &v)?;
            assert!(
                bits(&o)? == b0 && bits(&l)? == lb0,
                "{dtype:?}: run {run} differs from run 0"
            );
        }
    }
    Ok(())
}

#[test]
fn planted_numerics() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // q = k = v large: scores far beyond exp's range, no NaN allowed.
        let big = (randn(&[1, 64, 2, 64], DType::F32, 1, &Device::Cpu)? * 30.0)?.to_dtype(dtype)?;
        let bg = big.to_device(&dev)?;
        let out = FlashAttn::new(1.0).forward(&bg, &bg, &bg)?;
        let o = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            o.iter().all(|x| x.is_finite()),
            "{dtype:?}: large q = k = v gave non-finite output"
        );
        // All scores equal: the output is the mean of V (no 0/0).
        let q = Tensor::zeros((1, 5, 1, 32), dtype, &dev)?;
        let v = randn(&[1, 300, 1, 32], dtype, 2, &Device::Cpu)?;
        let out = FlashAttn::new(1.0).forward(
            &q,
            &q.zeros_like()?.pad_with_zeros(1, 0, 295)?,
            &v.to_device(&dev)?,
        )?;
        let mean = v
            .to_dtype(DType::F32)?
            .mean(1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let got = out
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .narrow(1, 0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (a, b) in got.iter().zip(&mean) {
            assert!(
                (a - b).abs() < 2e-2,
                "{dtype:?}: equal scores should average V ({a} vs {b})"
            );
        }
    }
    Ok(())
}

/// Small ragged shapes with only the flash kernels on the device (the reference is on the host):
/// what scripts/gpu-run.sh runs under compute-sanitizer racecheck / synccheck / initcheck.
#[test]
fn sanitizer_small_ragged_shapes() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (i, &(sq, sk)) in [(1, 239), (113, 203), (203, 113), (65, 1)]
            .iter()
            .enumerate()
        {
            for (j, &d) in [40, 64, 128, 33].iter().enumerate() {
                let mask = [Mask::Full, Mask::Causal, Mask::Window(19, 2)][(i + j) % 3];
                let c = Case {
                    dtype,
                    b: 2,
                    sq,
                    sk,
                    h: 6,
                    hk: 2,
                    d,
                    mask,
                    softcap: if j == 1 { 3.0 } else { 0.0 },
                    alibi: i == 1,
                };
                let (q, k, v) = c.inputs(77 + n)?;
                let (ref_out, ref_lse) = reference(&q, &k, &v, &c.opts(&Device::Cpu)?)?;
                let (qg, kg, vg) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
                // Every other case reads k through a strided view (the pack kernel runs too).
                let kg = if n % 2 == 0 {
                    common::transposed_view(&kg)?
                } else {
                    kg
                };
                let (out, lse) = c.opts(&dev)?.forward_with_lse(&qg, &kg, &vg)?;
                let err = max_abs_err(&out, &ref_out)?
                    .unwrap_or_else(|| panic!("{c:?}: non-finite output"));
                let (_, cap) = tolerances(dtype);
                assert!(err <= cap, "{c:?}: max abs err {err:.3e} > {cap:.1e}");
                check_lse(&format!("{c:?}"), &lse, &ref_lse, 1e-3);
                n += 1;
            }
        }
    }
    eprintln!("{n} small ragged cases passed");
    Ok(())
}
