//! The CUDA backward pass: gradients of q, k and v through `FlashAttn` on the GPU against the f64
//! analytic reference (`common::grad`), with candle autograd through `naive_attention` on the
//! GPU (same dtype) as the precision yardstick; bitwise determinism; layouts. One binary, so it
//! can travel to a GPU machine. Compiled only with the `cuda` feature; with it, a machine where
//! no CUDA device answers FAILS every test, unless `CANDLE_FLASH_SKIP_GPU_TESTS=1` says to skip
//! them (each test then prints that it skipped).
//!
//! `CANDLE_FLASH_GPU_SMALL=1` keeps a few small ragged shapes, for compute-sanitizer.
#![cfg(feature = "cuda")]

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{naive_attention, FlashAttn};
use common::gpu::{gpu, poison_pool, ragged, small, Ragged};
use common::grad::{autograd, reference_grads, reference_grads_varlen, Grads, RefGrads};
use common::{
    assert_bitwise_eq, max_abs_err_slice, max_err_beyond, naive_varlen, randn, scale_of,
    tolerances, transposed_view, values, SCALE_FLOOR,
};

/// FlashAttention's rule on each gradient, per element:
/// `|fast - ref| <= 2 · naive_err + u · |ref| + SCALE_FLOOR · scale`, `scale` the largest
/// |reference| over dq, dk and dv together (one gradient can be exactly 0 while the rounding of
/// its terms is not). `naive_err` is the error of candle autograd through `naive_attention` in
/// the same dtype on the GPU, over its finite elements; where it has none, the dtype's relative
/// backstop stands in. NaN or Inf in the fast
/// gradients where the reference is finite always fails.
fn check_grads(what: &str, fast: &Grads, naive: Option<&Grads>, r: &RefGrads, like: [&Tensor; 3]) {
    let scale = [&r.dq, &r.dk, &r.dv]
        .iter()
        .map(|x| scale_of(x))
        .fold(0f64, f64::max);
    let naive: [Option<&Tensor>; 3] = match naive {
        Some(n) => [Some(&n.0), Some(&n.1), Some(&n.2)],
        None => [None; 3],
    };
    let parts = [
        ("dq", &fast.0, naive[0], &r.dq),
        ("dk", &fast.1, naive[1], &r.dk),
        ("dv", &fast.2, naive[2], &r.dv),
    ];
    for ((name, f, n, r), t) in parts.into_iter().zip(like) {
        let what = format!("{what} {name}");
        assert_eq!(f.dims(), t.dims(), "{what}: shape");
        assert_eq!(f.dtype(), t.dtype(), "{what}: dtype");
        let (floor, rel_backstop, _) = tolerances(f.dtype());
        let actual = values(f).unwrap();
        let err = max_abs_err_slice(&actual, r)
            .unwrap_or_else(|| panic!("{what}: non-finite gradient where the reference is finite"));
        let beyond = max_err_beyond(&actual, r, floor).unwrap();
        let naive_err = n.map(|n| {
            values(n)
                .unwrap()
                .iter()
                .zip(r.iter())
                .filter(|(n, _)| n.is_finite())
                .fold(0f64, |m, (n, r)| m.max((n - r).abs()))
        });
        let allowed = match naive_err {
            Some(e) if e > 0.0 => 2.0 * e + SCALE_FLOOR * scale,
            _ => rel_backstop * scale,
        };
        if std::env::var_os("CANDLE_FLASH_TOL_REPORT").is_some() {
            let s = scale.max(f64::MIN_POSITIVE);
            eprintln!(
                "tol-report {:?} err/scale {:.3e} naive/scale {:.3e} | {what}",
                f.dtype(),
                err / s,
                naive_err.unwrap_or(f64::NAN) / s
            );
        }
        assert!(
            beyond <= allowed,
            "{what}: max abs err {err:.3e} ({beyond:.3e} beyond {floor:.2e} |ref|) > allowed \
             {allowed:.3e} (naive err {naive_err:?}, scale {scale:.3e})"
        );
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
}

fn case(b: usize, sq: usize, sk: usize, h: usize, hk: usize, d: usize, dtype: DType) -> Case {
    Case {
        b,
        sq,
        sk,
        h,
        hk,
        d,
        dtype,
    }
}

/// q, k, v and the output gradient of a case, on `dev`.
fn inputs(c: Case, seed: u64, dev: &Device) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    Ok((
        randn(&[c.b, c.sq, c.h, c.d], c.dtype, seed, dev)?,
        randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 1, dev)?,
        randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 2, dev)?,
        randn(&[c.b, c.sq, c.h, c.d], c.dtype, seed + 3, dev)?,
    ))
}

fn grad_bytes(c: Case) -> [usize; 3] {
    let e = c.dtype.size_in_bytes();
    [
        c.b * c.sq * c.h * c.d * e,
        c.b * c.sk * c.hk * c.d * e,
        c.b * c.sk * c.hk * c.d * e,
    ]
}

/// Slopes or other tensors of `opts` moved to `dev`.
fn on(opts: &FlashAttn, dev: &Device) -> FlashAttn {
    let mut o = opts.clone();
    if let Some(s) = &o.alibi_slopes {
        o.alibi_slopes = Some(s.to_device(dev).unwrap());
    }
    o
}

/// Flash gradients on the GPU against the reference, naive GPU autograd as the yardstick.
/// Returns the flash gradients.
fn check(dev: &Device, c: Case, opts: &FlashAttn, seed: u64) -> Grads {
    let what = format!("{c:?} {opts:?}");
    let opts = on(opts, dev);
    let (q, k, v, g) = inputs(c, seed, dev).unwrap();
    poison_pool(dev, &grad_bytes(c)).unwrap();
    let fast = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &opts)).unwrap();
    let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
    check_grads(&what, &fast, Some(&naive), &r, [&q, &k, &v]);
    fast
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// Odd lengths both ways, causal or not, on the tensor-core head dims (64, 128) and on the
/// exact kernels (f32, d 40).
#[test]
fn odd_lengths_both_ways() {
    let Some(dev) = gpu() else { return };
    let pairs: &[(usize, usize)] = if small() {
        &[(1, 1), (113, 203), (203, 113)]
    } else {
        &[
            (1, 1),
            (1, 239),
            (239, 1),
            (113, 203),
            (203, 113),
            (127, 513),
            (65, 64),
            (64, 129),
            (128, 128),
        ]
    };
    for &(sq, sk) in pairs {
        for causal in [false, true] {
            for (d, dtype) in [
                (64, DType::BF16),
                (128, DType::BF16),
                (128, DType::F16),
                (64, DType::F16),
                (40, DType::F32),
            ] {
                let mut opts = FlashAttn::new(scale(d));
                if causal {
                    opts = opts.causal();
                }
                check(&dev, case(2, sq, sk, 4, 2, d, dtype), &opts, sq as u64);
            }
        }
    }
}

/// GQA with 6 query heads over 6, 3, 2 and 1 K/V heads (dk, dv summed over each group).
#[test]
fn gqa_6_3_2_1() {
    let Some(dev) = gpu() else { return };
    for hk in [6, 3, 2, 1] {
        for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (80, DType::BF16)] {
            let opts = FlashAttn::new(scale(d)).causal();
            check(&dev, case(1, 97, 150, 6, hk, d, dtype), &opts, hk as u64);
        }
    }
}

/// Head dims off the tensor-core path (and f32 everywhere): the exact kernels, up to 512.
#[test]
fn other_head_dims() {
    let Some(dev) = gpu() else { return };
    let dims: &[usize] = if small() {
        &[24, 96]
    } else {
        &[1, 8, 24, 40, 80, 96, 128, 200, 256, 320, 512]
    };
    for &d in dims {
        for dtype in DTYPES {
            let opts = FlashAttn::new(scale(d)).causal();
            check(&dev, case(1, 70, 90, 4, 2, d, dtype), &opts, d as u64);
        }
    }
}

/// Sliding windows, ALiBi (per head and per batch) and softcap, alone and together.
#[test]
fn windows_alibi_softcap() {
    let Some(dev) = gpu() else { return };
    let cpu = Device::Cpu;
    let per_head = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &cpu).unwrap();
    let per_batch = Tensor::new(&[[0.3f32, 0.1, 0.05, 0.0], [0.2, 0.4, 0.0, 0.01]], &cpu).unwrap();
    for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (40, DType::F32)] {
        let s = scale(d);
        let cases = [
            FlashAttn::new(s).window(Some(30), Some(5)),
            FlashAttn::new(s).window(Some(0), Some(0)),
            FlashAttn::new(s).window(None, Some(7)),
            FlashAttn::new(s).window(Some(3), None),
            FlashAttn::new(s).window(Some(100), Some(0)),
            FlashAttn::new(s).alibi(&per_head),
            FlashAttn::new(s).causal().alibi(&per_batch),
            FlashAttn::new(s).softcap(2.0),
            FlashAttn::new(s).softcap(5.0).window(Some(50), Some(10)),
            FlashAttn::new(s).causal().softcap(3.0).alibi(&per_batch),
        ];
        for (n, opts) in cases.iter().enumerate() {
            check(&dev, case(2, 130, 201, 4, 2, d, dtype), opts, 10 + n as u64);
        }
    }
}

/// Decode-shaped calls: a few queries against many keys, GQA.
#[test]
fn decode_shaped() {
    let Some(dev) = gpu() else { return };
    for (b, sq, sk, h, hk) in [(3, 1, 300, 8, 2), (1, 4, 517, 8, 1), (2, 16, 700, 6, 6)] {
        for (d, dtype) in [(128, DType::BF16), (64, DType::F16), (64, DType::F32)] {
            check(
                &dev,
                case(b, sq, sk, h, hk, d, dtype),
                &FlashAttn::new(scale(d)).causal(),
                30,
            );
        }
    }
}

/// Causal with more queries than keys: the leading rows see no key; their dq is exactly 0, and
/// nothing anywhere is NaN. A window that leaves rows and keys out entirely too.
#[test]
fn fully_masked_rows_give_zero_gradients() {
    let Some(dev) = gpu() else { return };
    for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (32, DType::F32)] {
        let (sq, sk, h) = (150, 40, 4);
        let g = check(
            &dev,
            case(1, sq, sk, h, 2, d, dtype),
            &FlashAttn::new(scale(d)).causal(),
            40,
        );
        let dq = values(&g.0).unwrap();
        let masked = sq - sk;
        assert!(
            dq[..masked * h * d].iter().all(|&x| x == 0.0),
            "{dtype:?} d {d}: masked rows"
        );
        assert!(dq[masked * h * d..].iter().any(|&x| x != 0.0));
        check(
            &dev,
            case(1, 60, 200, 2, 1, d, dtype),
            &FlashAttn::new(0.25).window(Some(0), Some(0)),
            41,
        );
    }
}

/// Non-contiguous q, k, v: transposed `(b, h, s, d)` storage seen as `(b, s, h, d)` gives bits
/// equal to the contiguous call (both take the same kernels); a view at an odd element offset
/// (not 16-byte aligned: the exact kernels) still matches the reference.
#[test]
fn non_contiguous_layouts() {
    let Some(dev) = gpu() else { return };
    for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (40, DType::F32)] {
        let c = case(2, 77, 130, 4, 2, d, dtype);
        let opts = FlashAttn::new(scale(d)).causal();
        let (q, k, v, g) = inputs(c, 50, &dev).unwrap();
        let dense = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        let (qt, kt, vt) = (
            transposed_view(&q).unwrap(),
            transposed_view(&k).unwrap(),
            transposed_view(&v).unwrap(),
        );
        let strided = autograd(&qt, &kt, &vt, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        let what = format!("transposed {dtype:?} d {d}");
        assert_bitwise_eq(&format!("{what} dq"), &dense.0, &strided.0);
        assert_bitwise_eq(&format!("{what} dk"), &dense.1, &strided.1);
        assert_bitwise_eq(&format!("{what} dv"), &dense.2, &strided.2);

        // k at element offset 1 of a larger buffer (misaligned for 16-byte loads).
        let n = c.b * c.sk * c.hk * d;
        let flat = randn(&[n + 1], dtype, 51, &dev).unwrap();
        let ko = flat
            .narrow(0, 1, n)
            .unwrap()
            .reshape((c.b, c.sk, c.hk, d))
            .unwrap();
        let fast = autograd(&q, &ko, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        let naive = autograd(&q, &ko, &v, &g, |q, k, v| naive_attention(q, k, v, &opts)).unwrap();
        let r = reference_grads(&q, &ko, &v, &g, &opts).unwrap();
        check_grads(
            &format!("offset k {dtype:?} d {d}"),
            &fast,
            Some(&naive),
            &r,
            [&q, &ko, &v],
        );
    }
}

/// Packed varlen calls with the lengths left on the GPU: empty sequences, odd lengths, more
/// queries than keys; dk / dv rows of unused keys are 0.
#[test]
fn varlen_against_reference() {
    let Some(dev) = gpu() else { return };
    let Ragged {
        cu_q,
        cu_k,
        total_q: tq,
        total_k: tk,
        max_q,
        max_k,
        ..
    } = ragged();
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.1, 0.05, 0.3], &Device::Cpu).unwrap();
    for (d, dtype) in [
        (64, DType::BF16),
        (128, DType::F16),
        (96, DType::BF16),
        (40, DType::F32),
    ] {
        for opts in [
            FlashAttn::new(scale(d)).causal(),
            FlashAttn::new(scale(d)).alibi(&slopes).softcap(4.0),
            FlashAttn::new(scale(d)).window(Some(20), Some(3)),
        ] {
            let (h, hk) = (6, 2);
            let opts = on(&opts, &dev);
            let q = randn(&[tq, h, d], dtype, 5, &dev).unwrap();
            let k = randn(&[tk, hk, d], dtype, 6, &dev).unwrap();
            let v = randn(&[tk, hk, d], dtype, 7, &dev).unwrap();
            let g = randn(&[tq, h, d], dtype, 8, &dev).unwrap();
            let sq_t = Tensor::new(cu_q.as_slice(), &dev).unwrap();
            let sk_t = Tensor::new(cu_k.as_slice(), &dev).unwrap();
            let e = dtype.size_in_bytes();
            poison_pool(&dev, &[tq * h * d * e, tk * hk * d * e, tk * hk * d * e]).unwrap();
            let fast = autograd(&q, &k, &v, &g, |q, k, v| {
                opts.forward_varlen(q, k, v, &sq_t, &sk_t, max_q, max_k)
            })
            .unwrap();
            let naive = autograd(&q, &k, &v, &g, |q, k, v| {
                naive_varlen(q, k, v, &cu_q, &cu_k, &opts)
            })
            .unwrap();
            let r = reference_grads_varlen(&q, &k, &v, &g, &cu_q, &cu_k, &opts).unwrap();
            check_grads(
                &format!("varlen {dtype:?} d {d} {opts:?}"),
                &fast,
                Some(&naive),
                &r,
                [&q, &k, &v],
            );
        }
    }
}

/// Packed sequences stay independent: NaN in every element of one sequence (q, k, v and the
/// output gradient) leaves its neighbours' outputs and gradients bitwise unchanged. The Hopper
/// kernels load whole tiles with the tensor copy engine, across sequence ends; the next
/// sequence's rows must not reach this one's products (0 * NaN is NaN). Lengths put a partial
/// tile at every tile size the kernels use; the poisoned sequence sits between two others.
#[test]
fn nan_in_one_sequence_stays_there() {
    let Some(dev) = gpu() else { return };
    let lens = [100usize, 77, 203];
    let cu: Vec<u32> = std::iter::once(0)
        .chain(lens.iter().scan(0u32, |a, &l| {
            *a += l as u32;
            Some(*a)
        }))
        .collect();
    let total = cu[3] as usize;
    let max = *lens.iter().max().unwrap();
    let (p0, p1) = (cu[1] as usize, cu[2] as usize);
    let cu_t = Tensor::new(cu.as_slice(), &dev).unwrap();
    for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (128, DType::BF16)] {
        for opts in [FlashAttn::new(scale(d)), FlashAttn::new(scale(d)).causal()] {
            let opts = on(&opts, &dev);
            let (h, hk) = (4, 2);
            let clean = [
                randn(&[total, h, d], dtype, 21, &dev).unwrap(),
                randn(&[total, hk, d], dtype, 22, &dev).unwrap(),
                randn(&[total, hk, d], dtype, 23, &dev).unwrap(),
                randn(&[total, h, d], dtype, 24, &dev).unwrap(),
            ];
            // Rows p0..p1 (sequence 1) replaced by NaN.
            let poison = |t: &Tensor| {
                let (_, heads, d) = t.dims3().unwrap();
                let nan = Tensor::full(f32::NAN, (p1 - p0, heads, d), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                Tensor::cat(
                    &[
                        &t.narrow(0, 0, p0).unwrap(),
                        &nan,
                        &t.narrow(0, p1, total - p1).unwrap(),
                    ],
                    0,
                )
                .unwrap()
            };
            let dirty: Vec<Tensor> = clean.iter().map(poison).collect();
            let run = |t: &[Tensor]| {
                let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    opts.forward_varlen(q, k, v, &cu_t, &cu_t, max, max)
                };
                let out = f(&t[0], &t[1], &t[2]).unwrap();
                let (dq, dk, dv) = autograd(&t[0], &t[1], &t[2], &t[3], f).unwrap();
                [out, dq, dk, dv]
            };
            let (a, b) = (run(&clean), run(&dirty));
            for (name, x, y) in [
                ("out", &a[0], &b[0]),
                ("dq", &a[1], &b[1]),
                ("dk", &a[2], &b[2]),
                ("dv", &a[3], &b[3]),
            ] {
                for (seq, (lo, hi)) in [(0, (0, p0)), (2, (p1, total))] {
                    assert_bitwise_eq(
                        &format!("{dtype:?} d {d} {opts:?}: {name} of sequence {seq}"),
                        &x.narrow(0, lo, hi - lo).unwrap(),
                        &y.narrow(0, lo, hi - lo).unwrap(),
                    );
                }
            }
        }
    }
}

/// Tests that read or set `CANDLE_FLASH_BWD_DETERMINISTIC` take this lock (the variable is
/// process-wide and tests may run in parallel).
static MODE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The default backward is deterministic: repeated runs give the same bits, on the
/// tensor-core kernels (causal and not, GQA) and on the exact ones.
#[test]
fn deterministic_by_default() {
    let Some(dev) = gpu() else { return };
    let _mode = MODE.lock().unwrap_or_else(|e| e.into_inner());
    let runs = if small() { 2 } else { 20 };
    // Causal, plain, and a sliding window over several key tiles.
    for (c, causal, window) in [
        (case(2, 1000, 1100, 8, 2, 128, DType::BF16), true, None),
        (case(1, 700, 513, 6, 3, 64, DType::F16), false, None),
        (
            case(1, 900, 1000, 4, 2, 64, DType::BF16),
            false,
            Some((Some(300), Some(40))),
        ),
        (case(1, 200, 300, 4, 1, 96, DType::BF16), true, None),
        (case(1, 100, 150, 4, 2, 40, DType::F32), false, None),
    ] {
        let mut opts = FlashAttn::new(scale(c.d));
        if causal {
            opts = opts.causal();
        }
        if let Some((l, r)) = window {
            opts = opts.window(l, r);
        }
        let (q, k, v, g) = inputs(c, 60, &dev).unwrap();
        let first = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        for run in 1..runs {
            let again = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
            let what = format!("{c:?} run {run}");
            assert_bitwise_eq(&format!("{what} dq"), &first.0, &again.0);
            assert_bitwise_eq(&format!("{what} dk"), &first.1, &again.1);
            assert_bitwise_eq(&format!("{what} dv"), &first.2, &again.2);
        }
    }
}

/// Large equal scores in bf16 (q = k = v large): no NaN or Inf anywhere.
#[test]
fn large_scores_stay_finite() {
    let Some(dev) = gpu() else { return };
    for d in [64, 128] {
        let x = (randn(&[1, 64, 2, d], DType::F32, 70, &dev).unwrap() * 30.0)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let g = randn(&[1, 64, 2, d], DType::BF16, 71, &dev).unwrap();
        let opts = FlashAttn::new(scale(d)).causal();
        let (dq, dk, dv) = autograd(&x, &x, &x, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        for (n, t) in [("dq", dq), ("dk", dk), ("dv", dv)] {
            assert!(
                values(&t).unwrap().iter().all(|x| x.is_finite()),
                "d {d} {n}: non-finite"
            );
        }
    }
}

/// `CANDLE_FLASH_BWD_DETERMINISTIC=0`: the tensor-core dK/dV kernel adds dQ with f32 atomics;
/// same parity rules (odd lengths, GQA, softcap / ALiBi / windows, masked rows, varlen).
#[test]
fn atomic_dq_mode() {
    let Some(dev) = gpu() else { return };
    let _mode = MODE.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("CANDLE_FLASH_BWD_DETERMINISTIC", "0");
    let cpu = Device::Cpu;
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625, 0.3, 0.2], &cpu).unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for (d, dtype) in [
            (64, DType::BF16),
            (128, DType::BF16),
            (128, DType::F16),
            (64, DType::F16),
        ] {
            let s = scale(d);
            for (c, opts) in [
                (case(2, 113, 203, 6, 2, d, dtype), FlashAttn::new(s)),
                (
                    case(2, 203, 113, 6, 3, d, dtype),
                    FlashAttn::new(s).causal(),
                ),
                (case(1, 150, 40, 6, 1, d, dtype), FlashAttn::new(s).causal()),
                (case(1, 1, 239, 6, 6, d, dtype), FlashAttn::new(s).causal()),
                (
                    case(2, 130, 201, 6, 2, d, dtype),
                    FlashAttn::new(s)
                        .window(Some(30), Some(5))
                        .softcap(4.0)
                        .alibi(&slopes),
                ),
            ] {
                check(&dev, c, &opts, 90);
            }
        }
    }));
    std::env::remove_var("CANDLE_FLASH_BWD_DETERMINISTIC");
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// A handful of small ragged calls covering every backward kernel family (tensor-core d 64 / 128,
/// plain and `_mods`, deterministic and atomic, on Hopper the sm_90a kernels; the exact
/// kernels), for compute-sanitizer:
/// `compute-sanitizer --tool racecheck gpu_backward sanitizer_`.
#[test]
fn sanitizer_shapes() {
    let Some(dev) = gpu() else { return };
    let _mode = MODE.lock().unwrap_or_else(|e| e.into_inner());
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu).unwrap();
    let cases = |dtype: DType, d: usize| {
        let s = scale(d);
        [
            (case(1, 37, 70, 4, 2, d, dtype), FlashAttn::new(s).causal()),
            (
                case(1, 70, 33, 4, 1, d, dtype),
                FlashAttn::new(s)
                    .window(Some(9), Some(2))
                    .softcap(3.0)
                    .alibi(&slopes),
            ),
            // Several query steps and key tiles per block, over a GQA group: every stage of
            // the pipelines' rings is refilled more than once.
            (case(1, 300, 333, 4, 2, d, dtype), FlashAttn::new(s)),
        ]
    };
    for atomic in [false, true] {
        if atomic {
            std::env::set_var("CANDLE_FLASH_BWD_DETERMINISTIC", "0");
        }
        for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (40, DType::F32)] {
            for (c, opts) in cases(dtype, d) {
                check(&dev, c, &opts, 95);
            }
        }
    }
    std::env::remove_var("CANDLE_FLASH_BWD_DETERMINISTIC");
}

/// `FlashAttn::backward` (no autograd) gives bitwise the gradients of `loss.backward()` on the
/// GPU (the Hopper kernels there for bf16), and refuses saved results that do not fit the call.
#[test]
fn explicit_backward_matches_autograd() {
    let Some(dev) = gpu() else { return };
    common::grad::explicit_backward_matches_autograd(&dev, &[DType::F32, DType::BF16]);
}
