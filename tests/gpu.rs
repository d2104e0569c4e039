//! The CUDA path against the f64 reference, the CPU path and itself. One binary, so it can travel
//! to a GPU machine. Compiled only with the `cuda` feature; with it, a machine where no CUDA
//! device answers FAILS every test, unless `CANDLE_FLASH_SKIP_GPU_TESTS=1` says to skip them
//! (each test then prints that it skipped).
//!
//! `CANDLE_FLASH_GPU_SMALL=1` cuts the matrix down to a few small ragged shapes, for running under
//! compute-sanitizer.
#![cfg(feature = "cuda")]

mod common;

use candle::{DType, Device, IndexOp, Tensor};
use candle_flash::FlashAttn;
use common::gpu::{gpu, poison_pool, ragged, small, Ragged};
use common::{
    assert_bitwise_eq, assert_close, bits, check_mask_probe, mask_probe, max_abs_err_slice,
    naive_err, naive_varlen, planted_winner, randn, reference, reference_varlen, scale_of,
    tolerance, values, PROBE_WINDOWS,
};

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

/// Byte counts of the output and the lse of attention over `rows` query rows (all sequences) of
/// `h` heads of dim `d`: what [`poison_pool`] poisons before a call.
fn out_and_lse_bytes(dtype: DType, rows: usize, h: usize, d: usize) -> [usize; 2] {
    [rows * h * d * dtype.size_in_bytes(), rows * h * 4]
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
    let (q, k, v) = c.inputs(seed)?;
    check_inputs(
        dev,
        &format!("{c:?}"),
        &q,
        &k,
        &v,
        &c.opts(&Device::Cpu)?,
        &c.opts(dev)?,
    )
}

/// [`check_case`] on given CPU inputs; `opts_cpu` and `opts` are the same options with their
/// ALiBi slopes on the CPU and the GPU.
fn check_inputs(
    dev: &Device,
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts_cpu: &FlashAttn,
    opts: &FlashAttn,
) -> candle::Result<Tensor> {
    let (b, sq, h, d) = q.dims4()?;
    let (ref_out, ref_lse) = reference(q, k, v, opts_cpu)?;
    let (qg, kg, vg) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?);
    poison_pool(dev, &out_and_lse_bytes(q.dtype(), b * sq, h, d))?;
    let (out, lse) = opts.forward_with_lse(&qg, &kg, &vg)?;
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    let naive = candle_flash::naive_attention(&qg, &kg, &vg, opts)?;
    assert_close(what, &out, &naive, &ref_out, true);
    check_lse(what, &lse, &ref_lse, 1e-3);
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
    let Ragged {
        lens,
        cu_q,
        cu_k,
        total_q: tq,
        total_k: tk,
        max_q,
        max_k,
    } = ragged();
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
            let (qg, kg, vg) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
            poison_pool(&dev, &out_and_lse_bytes(dtype, tq, h, d))?;
            let (out, lse) =
                opts.forward_varlen_with_lse(&qg, &kg, &vg, &sq_t, &sk_t, max_q, max_k)?;
            let what = format!("varlen {dtype:?} d{d} {mask:?} alibi {alibi}");
            let naive = naive_varlen(&qg, &kg, &vg, &cu_q, &cu_k, &opts)?;
            assert_close(&what, &out, &naive, &ref_out, true);
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
            let what = format!("{c:?}");
            let (ref_out, _) = reference(&q, &k, &v, &c.opts(&Device::Cpu)?)?;
            let opts_cpu = c.opts(&Device::Cpu)?;
            let (cpu_out, cpu_lse) = opts_cpu.forward_with_lse(&q, &k, &v)?;
            let (qg, kg, vg) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
            let opts = c.opts(&dev)?;
            let (gpu_out, gpu_lse) = opts.forward_with_lse(&qg, &kg, &vg)?;
            // Each path within the rule against the reference, with its own naive yardstick.
            let cpu_naive = candle_flash::naive_attention(&q, &k, &v, &opts_cpu)?;
            let gpu_naive = candle_flash::naive_attention(&qg, &kg, &vg, &opts)?;
            assert_close(&format!("CPU {what}"), &cpu_out, &cpu_naive, &ref_out, true);
            assert_close(&format!("GPU {what}"), &gpu_out, &gpu_naive, &ref_out, true);
            // And against each other (NaN-propagating): within the sum of both tolerances.
            let scale = scale_of(&ref_out);
            let tol = tolerance(dtype, naive_err(&what, &cpu_naive, &ref_out), scale)
                + tolerance(dtype, naive_err(&what, &gpu_naive, &ref_out), scale);
            let diff = max_abs_err_slice(&values(&gpu_out)?, &values(&cpu_out)?)
                .unwrap_or_else(|| panic!("{what}: CPU and GPU disagree on NaN/Inf"));
            assert!(
                diff <= tol,
                "{what}: CPU and GPU differ by {diff:.3e} > {tol:.3e}"
            );
            let ldiff = max_abs_err_slice(&values(&gpu_lse)?, &values(&cpu_lse)?)
                .unwrap_or_else(|| panic!("{what}: CPU and GPU lse disagree on NaN/Inf"));
            assert!(
                ldiff <= 1e-3,
                "{what}: CPU and GPU lse differ by {ldiff:.3e}"
            );
        }
    }
    Ok(())
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
            assert_bitwise_eq(&format!("{c:?}: transposed views"), &t_out, &base);
            // Inside NaN-filled buffers (odd row strides: the packed path), k and v laid out
            // differently from each other.
            let nq = common::view_in_nan_buffer(&q)?;
            let nk = common::view_in_nan_buffer(&tk)?;
            let nv = common::view_in_nan_buffer(&v)?;
            let n_out = opts.forward(&nq, &nk, &nv)?;
            assert_bitwise_eq(&format!("{c:?}: views in NaN buffers"), &n_out, &base);
            // A last dim that is not contiguous.
            let sq_ = q.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
            let s_out = opts.forward(&sq_, &k, &v)?;
            assert_bitwise_eq(&format!("{c:?}: strided head dim"), &s_out, &base);
            // Broadcast views (stride 0 over batch and kv heads) against their contiguous copies.
            let bk = k.i((0..1, .., 0..1, ..))?.broadcast_as(k.dims())?;
            let bv = v.i((0..1, .., 1..2, ..))?.broadcast_as(v.dims())?;
            let b_out = opts.forward(&q, &bk, &bv)?;
            let c_out = opts.forward(&q, &bk.contiguous()?, &bv.contiguous()?)?;
            assert_bitwise_eq(&format!("{c:?}: broadcast k and v"), &b_out, &c_out);
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
    let cpu = &Device::Cpu;
    let (wq, wk, wv, winner) = planted_winner()?;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // One winning key with scores around 1e4: every row is exactly that key's value row.
        let (q, k, v) = (
            wq.to_dtype(dtype)?.to_device(&dev)?,
            wk.to_dtype(dtype)?.to_device(&dev)?,
            wv.to_dtype(dtype)?.to_device(&dev)?,
        );
        let out = FlashAttn::new(1.0).forward(&q, &k, &v)?;
        let want = v.i((0, winner, 0))?;
        for i in 0..q.dim(1)? {
            assert_bitwise_eq(
                &format!("{dtype:?}: winner row {i}"),
                &out.i((0, i, 0))?,
                &want,
            );
        }
        // q = k = v large: scores far beyond exp's range, no NaN allowed.
        let big = (randn(&[1, 64, 2, 64], DType::F32, 1, cpu)? * 30.0)?.to_dtype(dtype)?;
        let bg = big.to_device(&dev)?;
        for opts in [FlashAttn::new(1.0), FlashAttn::new(1.0).causal()] {
            let o = values(&opts.forward(&bg, &bg, &bg)?)?;
            assert!(
                o.iter().all(|x| x.is_finite()),
                "{dtype:?} {opts:?}: large q = k = v gave non-finite output"
            );
        }
        // All scores equal and large: the output is the mean of V (no 0/0).
        let q = Tensor::full(30f32, (1, 3, 1, 8), cpu)?.to_dtype(dtype)?;
        let k = Tensor::full(30f32, (1, 300, 1, 8), cpu)?.to_dtype(dtype)?;
        let v = randn(&[1, 300, 1, 8], dtype, 62, cpu)?;
        let opts = FlashAttn::new(1.0);
        check_inputs(
            &dev,
            &format!("equal large scores {dtype:?}"),
            &q,
            &k,
            &v,
            &opts,
            &opts,
        )?;
    }
    Ok(())
}

/// Every (row, key) visibility for many windows against `semantics::Window::key_range`, through the
/// mask probe of tests/common (q = 0, one-hot V: output = 1/count on visible keys, exactly 0
/// elsewhere). d = 128 so the 64 keys span two 32-key tiles of the mma kernels; sq up to 130
/// spans two 128-row query tiles.
#[test]
fn mask_visibility_matches_semantics() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let shapes: &[(usize, usize)] = if small() {
        &[(9, 17), (17, 9), (130, 33)]
    } else {
        &[
            (1, 1),
            (1, 64),
            (5, 1),
            (9, 17),
            (17, 9),
            (63, 64),
            (64, 64),
            (65, 64),
            (130, 33),
            (33, 50),
            (129, 64),
        ]
    };
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(sq, sk) in shapes {
            for left in PROBE_WINDOWS {
                for right in PROBE_WINDOWS {
                    let p = mask_probe(sq, sk, 2, 1, 128, left, right, dtype)?;
                    let (q, k, v) = (
                        p.q.to_device(&dev)?,
                        p.k.to_device(&dev)?,
                        p.v.to_device(&dev)?,
                    );
                    poison_pool(&dev, &out_and_lse_bytes(dtype, sq, 2, 128))?;
                    let (out, lse) = p.opts.forward_with_lse(&q, &k, &v)?;
                    check_mask_probe(
                        &format!("{dtype:?} sq {sq} sk {sk} window ({left:?}, {right:?})"),
                        &p,
                        &out,
                        &lse,
                    );
                    n += 1;
                }
            }
        }
    }
    eprintln!("{n} mask probes passed");
    Ok(())
}

/// The guard that makes unwritten output visible: after [`poison_pool`], the next allocations of
/// those byte counts (made the way the op makes its output and lse) hold 0xFF bytes. If this
/// fails, the pool does not hand the poisoned blocks back and the NaN guard of every other test
/// is void on this machine.
#[test]
fn poison_reaches_the_next_allocation() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let Device::Cuda(cuda) = &dev else {
        unreachable!("gpu() returns a CUDA device")
    };
    for (dtype, rows, h, d) in [
        (DType::BF16, 203, 6, 40),
        (DType::F16, 1, 6, 128),
        (DType::F32, 2 * 113, 6, 64),
    ] {
        let sizes = out_and_lse_bytes(dtype, rows, h, d);
        poison_pool(&dev, &sizes)?;
        for n in sizes {
            // SAFETY: u8 has no invalid bit patterns; the bytes are only copied to the host.
            let slice = unsafe { cuda.alloc::<u8>(n)? };
            let host = cuda.clone_dtoh(&slice)?;
            let clean = host.iter().filter(|&&x| x != 0xFF).count();
            assert_eq!(
                clean, 0,
                "{dtype:?}: a fresh {n}-byte allocation after poison_pool has {clean} bytes that are not 0xFF"
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
                poison_pool(&dev, &out_and_lse_bytes(dtype, 2 * sq, 6, d))?;
                let (out, lse) = c.opts(&dev)?.forward_with_lse(&qg, &kg, &vg)?;
                // The yardstick runs on the host, so only flash kernels run under the sanitizer.
                let naive = candle_flash::naive_attention(&q, &k, &v, &c.opts(&Device::Cpu)?)?;
                assert_close(&format!("{c:?}"), &out, &naive, &ref_out, true);
                check_lse(&format!("{c:?}"), &lse, &ref_lse, 1e-3);
                n += 1;
            }
        }
    }
    eprintln!("{n} small ragged cases passed");
    Ok(())
}

/// Decode shapes (few query rows per K/V head) take the split-KV kernel: one to sixteen queries
/// against caches from 1 to 5000 keys, batch 1 (many splits) and 3, GQA 32/8, 8/1, 6/6, 6/2,
/// every option, against the f64 reference.
#[test]
fn decode_split_kv_against_reference() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let masks = [
        Mask::Causal,
        Mask::Full,
        Mask::Window(300, 0),
        Mask::LeftOnly(77),
    ];
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for &(b, sq, sk) in &[
            (1, 1, 5000),
            (3, 1, 777),
            (1, 2, 1),
            (3, 4, 63),
            (1, 16, 1500),
            (2, 3, 2049),
        ] {
            for &(h, hk) in &[(32, 8), (8, 1), (6, 6), (6, 2)] {
                if sq * h / hk > 64 {
                    continue;
                }
                let d = [128, 64, 40, 256][n % 4];
                let c = Case {
                    dtype,
                    b,
                    sq,
                    sk,
                    h,
                    hk,
                    d,
                    mask: masks[n % masks.len()],
                    softcap: if n % 3 == 1 { 4.0 } else { 0.0 },
                    alibi: n % 5 == 2,
                };
                check_case(&dev, &c, 500 + n as u64)?;
                n += 1;
            }
        }
    }
    eprintln!("{n} decode cases passed");
    Ok(())
}

/// A split-KV decode call gives the same bits every time (fixed splits, fixed merge order).
#[test]
fn decode_split_kv_is_bitwise_deterministic() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let c = Case {
        dtype: DType::BF16,
        b: 1,
        sq: 1,
        sk: 20000,
        h: 32,
        hk: 8,
        d: 128,
        mask: Mask::Causal,
        softcap: 0.0,
        alibi: false,
    };
    let (q, k, v) = c.inputs(3)?;
    let (q, k, v) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
    let opts = c.opts(&dev)?;
    let (o0, l0) = opts.forward_with_lse(&q, &k, &v)?;
    let (b0, lb0) = (bits(&o0)?, bits(&l0)?);
    for run in 1..if small() { 3 } else { 50 } {
        let (o, l) = opts.forward_with_lse(&q, &k, &v)?;
        assert!(bits(&o)? == b0 && bits(&l)? == lb0, "run {run} differs");
    }
    Ok(())
}

/// Small split-KV decode shapes for compute-sanitizer (many splits, ragged tails, GQA).
#[test]
fn sanitizer_decode_split_kv() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (n, &(dtype, sq, sk, d)) in [
        (DType::BF16, 1, 1500, 128),
        (DType::F16, 3, 333, 40),
        (DType::BF16, 2, 1, 64),
    ]
    .iter()
    .enumerate()
    {
        let c = Case {
            dtype,
            b: 2,
            sq,
            sk,
            h: 8,
            hk: 2,
            d,
            mask: [Mask::Causal, Mask::Window(50, 0), Mask::Full][n],
            softcap: if n == 1 { 3.0 } else { 0.0 },
            alibi: n == 2,
        };
        let (q, k, v) = c.inputs(900 + n as u64)?;
        let (ref_out, ref_lse) = reference(&q, &k, &v, &c.opts(&Device::Cpu)?)?;
        let (qg, kg, vg) = (q.to_device(&dev)?, k.to_device(&dev)?, v.to_device(&dev)?);
        poison_pool(&dev, &out_and_lse_bytes(dtype, 2 * sq, 8, d))?;
        let (out, lse) = c.opts(&dev)?.forward_with_lse(&qg, &kg, &vg)?;
        let naive = candle_flash::naive_attention(&q, &k, &v, &c.opts(&Device::Cpu)?)?;
        assert_close(&format!("{c:?}"), &out, &naive, &ref_out, true);
        check_lse(&format!("{c:?}"), &lse, &ref_lse, 1e-3);
    }
    Ok(())
}

/// Heads wider than 256 (up to 512): the tensor-core kernels split V/O by columns, f32 takes the
/// row-wise kernel where its tiles do not fit; against the f64 reference.
#[test]
fn wide_heads_320_and_512() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (d, sq, sk, mask) in [
            (320, 77, 130, Mask::Causal),
            (512, 130, 77, Mask::Full),
            (296, 1, 300, Mask::Causal),
            (512, 65, 65, Mask::Window(20, 3)),
        ] {
            let c = Case {
                dtype,
                b: 2,
                sq,
                sk,
                h: 4,
                hk: 2,
                d,
                mask,
                softcap: if n % 3 == 2 { 5.0 } else { 0.0 },
                alibi: n % 4 == 1,
            };
            check_case(&dev, &c, 700 + n as u64)?;
            n += 1;
        }
    }
    Ok(())
}

/// Heads of 129..=256 in f16 and bf16: on Hopper the sm_90a d 256 instance (128-row tiles,
/// 80-key tiles, O staged in Q's buffer), elsewhere the portable kernel. Several query tiles,
/// key counts off the 80-key grid, every mask, GQA, softcap and ALiBi; against the f64
/// reference.
#[test]
fn heads_129_to_256_multi_tile() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for (d, sq, sk, mask) in [
            (256, 300, 517, Mask::Full),
            (256, 517, 300, Mask::Causal),
            (136, 257, 401, Mask::Window(100, 20)),
            (200, 129, 161, Mask::LeftOnly(90)),
            (248, 384, 384, Mask::Causal),
            (256, 80, 81, Mask::Full),
        ] {
            let c = Case {
                dtype,
                b: 2,
                sq,
                sk,
                h: 4,
                hk: if n % 2 == 0 { 2 } else { 4 },
                d,
                mask,
                softcap: if n % 3 == 1 { 5.0 } else { 0.0 },
                alibi: n % 4 == 2,
            };
            check_case(&dev, &c, 900 + n as u64)?;
            n += 1;
        }
    }
    Ok(())
}

/// Scores that grow along the keys (key j scaled by up to `top`, geometrically): later key tiles
/// pass the rows' reference max, with `top` 60 by more than exp2's range (scores up to ~200).
/// The sm_90a kernels that rescale lazily take a tile's exps against the current max first and
/// must redo, exactly, the tiles where that guess fails; `top` 4 leaves tiles near the
/// rescaling margin.
#[test]
fn growing_scores_move_the_max() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = &Device::Cpu;
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for (d, sq, sk, mask, top) in [
            (128, 300, 700, Mask::Full, 60.0f32),
            (128, 257, 900, Mask::Causal, 60.0),
            (128, 300, 1100, Mask::Full, 4.0),
            (128, 200, 600, Mask::Window(300, 0), 60.0),
            (64, 200, 700, Mask::Full, 60.0),
            (256, 130, 500, Mask::Causal, 60.0),
        ] {
            let c = Case {
                dtype,
                b: 1,
                sq,
                sk,
                h: 2,
                hk: 2,
                d,
                mask,
                softcap: 0.0,
                alibi: false,
            };
            let (q, k, v) = c.inputs(1000 + n)?;
            let growth: Vec<f32> = (0..sk)
                .map(|j| top.powf(j as f32 / (sk - 1) as f32))
                .collect();
            let growth = Tensor::from_vec(growth, (1, sk, 1, 1), cpu)?;
            let k = k
                .to_dtype(DType::F32)?
                .broadcast_mul(&growth)?
                .to_dtype(dtype)?;
            check_inputs(
                &dev,
                &format!("growing scores, top {top}: {c:?}"),
                &q,
                &k,
                &v,
                &c.opts(cpu)?,
                &c.opts(&dev)?,
            )?;
            n += 1;
        }
    }
    Ok(())
}

/// Persistent Hopper blocks (d 64 and 128, causal or unmasked) run several query tiles each,
/// with the next tile's Q loaded into a second buffer during this one. These shapes give each
/// block about two tiles (b 4, 8 heads, 9 query tiles each) and, under a bottom-right causal
/// mask with far fewer keys than queries, tiles without any key before tiles with keys; a window
/// skips the first key tiles of later query tiles. scripts/gpu-run.sh also runs it with
/// `CANDLE_FLASH_SM90_VARIANT=wg2p:3` (three blocks take every tile).
#[test]
fn persistent_tiles_with_and_without_keys() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut n = 0;
    // Causal with 50 keys: 8 of 9 query tiles without a key (1,100 rows), or under
    // compute-sanitizer (CANDLE_FLASH_GPU_SMALL: two batches of four heads) 1 of 3 (300 rows).
    let (b, h, long) = if small() { (2, 4, 300) } else { (4, 8, 1100) };
    for dtype in [DType::BF16, DType::F16] {
        for (d, sq, sk, mask) in [
            (128, long, 50, Mask::Causal),
            (64, long, 50, Mask::Causal),
            (128, long, 300, Mask::Full),
            (128, long * 2 / 3, long, Mask::Window(long / 7, 0)),
        ] {
            let c = Case {
                dtype,
                b,
                sq,
                sk,
                h,
                hk: 2,
                d,
                mask,
                softcap: 0.0,
                alibi: false,
            };
            check_case(&dev, &c, 2000 + n)?;
            n += 1;
        }
    }
    Ok(())
}

/// Operands with no element on the GPU (made as views, since candle cannot allocate an empty
/// CUDA buffer): batch 0 and seq_q 0 give empty outputs and lse; seq_k 0 gives zeros and
/// lse -inf; under autograd with seq_k 0, dq is exactly 0 and the empty k and v get no gradient
/// entry (candle would seed one with a zero-byte allocation, which the driver refuses).
#[test]
fn empty_operands() -> candle::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let empty = |s: &[usize], dtype: DType| -> candle::Result<Tensor> {
        let grown: Vec<usize> = s.iter().map(|&d| d.max(1)).collect();
        let mut t = randn(&grown, dtype, 7, &dev)?;
        for (dim, &len) in s.iter().enumerate() {
            if len == 0 {
                t = t.narrow(dim, 0, 0)?;
            }
        }
        Ok(t)
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let kv = randn(&[2, 9, 2, 64], dtype, 8, &dev)?;
        for (q, causal) in [
            (empty(&[0, 4, 2, 64], dtype)?, true),
            (empty(&[2, 0, 4, 64], dtype)?, false),
        ] {
            let kv = kv.narrow(0, 0, q.dim(0)?)?;
            let opts = FlashAttn::new(0.125);
            let opts = if causal { opts.causal() } else { opts };
            let (out, lse) = opts.forward_with_lse(&q, &kv, &kv)?;
            assert_eq!(out.dims(), q.dims(), "{dtype:?}");
            assert_eq!(lse.dims(), &[q.dim(0)?, q.dim(2)?, q.dim(1)?], "{dtype:?}");
        }
        let q = candle::Var::from_tensor(&randn(&[2, 3, 4, 64], dtype, 9, &dev)?)?;
        let k = candle::Var::from_tensor(&empty(&[2, 0, 2, 64], dtype)?)?;
        let v = candle::Var::from_tensor(&empty(&[2, 0, 2, 64], dtype)?)?;
        let (out, lse) = FlashAttn::new(0.125).forward_with_lse(&q, &k, &v)?;
        assert_eq!(out.dims(), q.dims());
        assert!(values(&out)?.iter().all(|&x| x == 0.0), "{dtype:?}: out");
        assert!(
            values(&lse)?.iter().all(|&x| x == f64::NEG_INFINITY),
            "{dtype:?}: lse"
        );
        let g = randn(q.dims(), dtype, 10, &dev)?;
        let grads = (out * g)?.sum_all()?.backward()?;
        let dq = grads.get(&q).expect("q gets a gradient");
        assert_eq!(dq.dims(), q.dims());
        assert!(values(dq)?.iter().all(|&x| x == 0.0), "{dtype:?}: dq");
        assert!(grads.get(&k).is_none() && grads.get(&v).is_none());
    }
    Ok(())
}
