//! Backward pass on the CPU: gradients of q, k and v against the f64 analytic reference
//! (`common::grad`, itself checked against central differences) and against candle autograd
//! through `naive_attention`.
//!
//! ```text
//! cargo test --release --test backward
//! ```

mod common;

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::{naive_attention, FlashAttn};

use common::grad::{
    autograd, check_grads, finite_where, reference_grads, reference_grads_varlen, Grads, RefGrads,
};
use common::{assert_bitwise_eq, max_abs_err_slice, randn, reference, transposed_view, values};

/// `Σ reference(q, k, v) ∘ g` in f64.
fn ref_loss(q: &Tensor, k: &Tensor, v: &Tensor, g: &[f64], opts: &FlashAttn) -> Result<f64> {
    let (out, _) = reference(q, k, v, opts)?;
    Ok(out.iter().zip(g).map(|(a, b)| a * b).sum())
}

/// The analytic reference agrees with central differences of the f64 forward reference, with
/// every option on (causal window, softcap, ALiBi, GQA, a row that sees no key).
#[test]
fn reference_matches_central_differences() -> Result<()> {
    let dev = Device::Cpu;
    let (b, sq, sk, h, hk, d) = (1, 5, 4, 4, 2, 3);
    let slopes = Tensor::new(&[0.3f32, 0.1, 0.5, 0.05], &dev)?;
    let cases = [
        FlashAttn::new(0.7),
        FlashAttn::new(0.7)
            .window(Some(1), Some(0))
            .softcap(1.5)
            .alibi(&slopes),
    ];
    for opts in cases {
        let q = randn(&[b, sq, h, d], DType::F64, 1, &dev)?;
        let k = randn(&[b, sk, hk, d], DType::F64, 2, &dev)?;
        let v = randn(&[b, sk, hk, d], DType::F64, 3, &dev)?;
        let g = randn(&[b, sq, h, d], DType::F64, 4, &dev)?;
        let gv = common::values(&g)?;
        let RefGrads { dq, dk, dv } = reference_grads(&q, &k, &v, &g, &opts)?;
        let eps = 1e-6;
        let numeric = |t: &Tensor, which: usize| -> Result<Vec<f64>> {
            let base = common::values(t)?;
            let mut out = Vec::with_capacity(base.len());
            for n in 0..base.len() {
                let f = |delta: f64| -> Result<f64> {
                    let mut x = base.clone();
                    x[n] += delta;
                    let x = Tensor::from_vec(x, t.shape(), &dev)?;
                    let (qq, kk, vv) = match which {
                        0 => (&x, &k, &v),
                        1 => (&q, &x, &v),
                        _ => (&q, &k, &x),
                    };
                    ref_loss(qq, kk, vv, &gv, &opts)
                };
                out.push((f(eps)? - f(-eps)?) / (2.0 * eps));
            }
            Ok(out)
        };
        for (name, analytic, t, which) in
            [("dq", &dq, &q, 0), ("dk", &dk, &k, 1), ("dv", &dv, &v, 2)]
        {
            let num = numeric(t, which)?;
            let err = common::max_abs_err_slice(analytic, &num).expect("finite");
            assert!(
                err < 1e-6,
                "{name}: analytic vs central differences {err:.3e}"
            );
        }
        // With the window, query row 0 (diag -1) sees no key: its gradient is exactly 0.
        if opts.window_size_left.is_some() {
            assert!(dq[..h * d].iter().all(|&x| x == 0.0));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Gradient parity.

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

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

/// q, k, v and the output gradient of a case.
fn inputs(c: Case, seed: u64) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    Ok((
        randn(&[c.b, c.sq, c.h, c.d], c.dtype, seed, &dev)?,
        randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 1, &dev)?,
        randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 2, &dev)?,
        randn(&[c.b, c.sq, c.h, c.d], c.dtype, seed + 3, &dev)?,
    ))
}

/// Flash gradients (through `FlashAttn::forward`) against the reference, with naive autograd
/// as the yardstick. Returns the flash gradients.
fn check(c: Case, opts: &FlashAttn, seed: u64) -> Grads {
    let what = format!("{c:?} {opts:?}");
    let (q, k, v, g) = inputs(c, seed).unwrap();
    let fast = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, opts)).unwrap();
    let r = reference_grads(&q, &k, &v, &g, opts).unwrap();
    // Also where rows see no key: naive autograd must stay finite wherever the reference is.
    assert!(
        finite_where(&naive, &r),
        "{what}: naive autograd is not finite"
    );
    check_grads(&what, &fast, &naive, &r, [&q, &k, &v]);
    fast
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

#[test]
fn odd_lengths_both_ways() {
    for (sq, sk) in [
        (1, 1),
        (1, 239),
        (239, 1),
        (113, 203),
        (203, 113),
        (65, 64),
        (64, 129),
    ] {
        for causal in [false, true] {
            let mut opts = FlashAttn::new(scale(40));
            if causal {
                opts = opts.causal();
            }
            check(case(2, sq, sk, 4, 2, 40, DType::F32), &opts, sq as u64);
        }
    }
}

#[test]
fn gqa_6_3_2_1_and_head_dims() {
    for (hk, d) in [(6, 24), (3, 64), (2, 80), (1, 200), (6, 1), (2, 512)] {
        let opts = FlashAttn::new(scale(d)).causal();
        check(case(1, 97, 150, 6, hk, d, DType::F32), &opts, hk as u64);
    }
}

#[test]
fn windows_alibi_softcap() {
    let dev = Device::Cpu;
    let per_head = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &dev).unwrap();
    let per_batch = Tensor::new(&[[0.3f32, 0.1, 0.05, 0.0], [0.2, 0.4, 0.0, 0.01]], &dev).unwrap();
    let s = scale(40);
    let cases = [
        FlashAttn::new(s).window(Some(30), Some(5)),
        FlashAttn::new(s).window(Some(0), Some(0)),
        FlashAttn::new(s).window(None, Some(7)),
        FlashAttn::new(s).window(Some(3), None),
        FlashAttn::new(s).alibi(&per_head),
        FlashAttn::new(s).causal().alibi(&per_batch),
        FlashAttn::new(s).softcap(2.0),
        FlashAttn::new(s).softcap(5.0).window(Some(50), Some(10)),
        FlashAttn::new(s).causal().softcap(3.0).alibi(&per_batch),
    ];
    for (n, opts) in cases.iter().enumerate() {
        check(case(2, 130, 101, 4, 2, 40, DType::F32), opts, 10 + n as u64);
    }
}

#[test]
fn half_precision() {
    let dev = Device::Cpu;
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625, 0.03, 0.01], &dev).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let cases = [
            (
                case(1, 113, 203, 6, 2, 40, dtype),
                FlashAttn::new(scale(40)).causal(),
            ),
            (case(2, 90, 70, 6, 3, 64, dtype), FlashAttn::new(scale(64))),
            (
                case(1, 100, 140, 6, 1, 96, dtype),
                FlashAttn::new(scale(96))
                    .window(Some(40), Some(3))
                    .softcap(4.0)
                    .alibi(&slopes),
            ),
        ];
        for (c, opts) in &cases {
            check(*c, opts, 20);
        }
    }
}

/// Many key and query tiles (sums over dozens of tiles in dq and dk/dv).
#[test]
fn long_sequence() {
    check(
        case(1, 1500, 1700, 2, 1, 64, DType::F32),
        &FlashAttn::new(0.125).causal(),
        35,
    );
    check(
        case(1, 1100, 900, 2, 2, 64, DType::BF16),
        &FlashAttn::new(0.125),
        36,
    );
}

#[test]
fn decode_shaped() {
    for (b, sq, sk, h, hk) in [(3, 1, 300, 8, 2), (1, 4, 517, 8, 1), (2, 16, 700, 6, 6)] {
        check(
            case(b, sq, sk, h, hk, 64, DType::F32),
            &FlashAttn::new(0.125).causal(),
            30,
        );
    }
}

/// Causal with more queries than keys: the leading rows see no key; their dq is exactly 0 and
/// nothing anywhere is NaN.
#[test]
fn fully_masked_rows_give_zero_gradients() {
    for dtype in DTYPES {
        let (sq, sk, h, d) = (150, 40, 4, 32);
        let g = check(
            case(1, sq, sk, h, 2, d, dtype),
            &FlashAttn::new(scale(d)).causal(),
            40,
        );
        let dq = values(&g.0).unwrap();
        let masked = sq - sk;
        assert!(
            dq[..masked * h * d].iter().all(|&x| x == 0.0),
            "{dtype:?}: masked rows"
        );
        assert!(dq[masked * h * d..].iter().any(|&x| x != 0.0));
        for t in [&g.0, &g.1, &g.2] {
            assert!(
                values(t).unwrap().iter().all(|x| x.is_finite()),
                "{dtype:?}: NaN"
            );
        }
    }
    // A window that leaves some rows (and keys) out entirely.
    check(
        case(1, 60, 200, 2, 1, 16, DType::F32),
        &FlashAttn::new(0.25).window(Some(0), Some(0)),
        41,
    );
}

/// Varlen (with an empty query sequence and a sequence with no keys) against the reference,
/// with naive autograd per sequence as the yardstick.
#[test]
fn varlen() {
    let dev = Device::Cpu;
    let cu_q = [0u32, 37, 37, 140, 141, 300];
    let cu_k = [0u32, 50, 61, 61, 200, 333];
    let (h, hk, d) = (4, 2, 40);
    let slopes = Tensor::new(
        &[
            [0.1f32, 0.2, 0.3, 0.4],
            [0.0, 0.1, 0.0, 0.1],
            [0.5, 0.5, 0.5, 0.5],
            [0.01, 0.02, 0.03, 0.04],
            [0.2, 0.0, 0.2, 0.0],
        ],
        &dev,
    )
    .unwrap();
    let cases = [
        FlashAttn::new(scale(d)),
        FlashAttn::new(scale(d)).causal(),
        FlashAttn::new(scale(d))
            .window(Some(20), Some(0))
            .softcap(3.0)
            .alibi(&slopes),
    ];
    for dtype in DTYPES {
        for (n, opts) in cases.iter().enumerate() {
            let (tq, tk) = (cu_q[5] as usize, cu_k[5] as usize);
            let seed = 50 + n as u64;
            let q = randn(&[tq, h, d], dtype, seed, &dev).unwrap();
            let k = randn(&[tk, hk, d], dtype, seed + 1, &dev).unwrap();
            let v = randn(&[tk, hk, d], dtype, seed + 2, &dev).unwrap();
            let g = randn(&[tq, h, d], dtype, seed + 3, &dev).unwrap();
            let cq = Tensor::new(&cu_q, &dev).unwrap();
            let ck = Tensor::new(&cu_k, &dev).unwrap();
            let fast = autograd(&q, &k, &v, &g, |q, k, v| {
                opts.forward_varlen(q, k, v, &cq, &ck, 159, 139)
            })
            .unwrap();
            let naive = autograd(&q, &k, &v, &g, |q, k, v| {
                common::naive_varlen(q, k, v, &cu_q, &cu_k, opts)
            })
            .unwrap();
            let r = reference_grads_varlen(&q, &k, &v, &g, &cu_q, &cu_k, opts).unwrap();
            check_grads(
                &format!("varlen {dtype:?} {n}"),
                &fast,
                &naive,
                &r,
                [&q, &k, &v],
            );
            // Sequence 2 has queries but no keys: zero dq rows.
            let dq = values(&fast.0).unwrap();
            assert!(dq[61 * h * d..103 * h * d].iter().all(|&x| x == 0.0));
        }
    }
}

/// The public functions carry gradients to q, k and v, equal to those of the options-struct
/// call they wrap.
#[test]
fn public_functions() {
    let dev = Device::Cpu;
    let c = case(2, 70, 90, 4, 2, 32, DType::F32);
    let (q, k, v, g) = inputs(c, 60).unwrap();
    let s = scale(32);
    let slopes = Tensor::new(&[0.2f32, 0.1, 0.05, 0.3], &dev).unwrap();
    let via_fn = autograd(&q, &k, &v, &g, |q, k, v| {
        candle_flash::flash_attn(q, k, v, s, true)
    })
    .unwrap();
    let opts = FlashAttn::new(s).causal();
    let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &opts)).unwrap();
    check_grads("flash_attn", &via_fn, &naive, &r, [&q, &k, &v]);
    let via_windowed = autograd(&q, &k, &v, &g, |q, k, v| {
        candle_flash::flash_attn_alibi_windowed_softcap(
            q,
            k,
            v,
            Some(&slopes),
            s,
            Some(9),
            Some(2),
            6.0,
        )
    })
    .unwrap();
    let opts = FlashAttn::new(s)
        .window(Some(9), Some(2))
        .softcap(6.0)
        .alibi(&slopes);
    let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &opts)).unwrap();
    check_grads(
        "flash_attn_alibi_windowed_softcap",
        &via_windowed,
        &naive,
        &r,
        [&q, &k, &v],
    );
    // Varlen: two sequences of the batch packed.
    let flat = |t: &Tensor| t.flatten_to(1).unwrap();
    let (q3, k3, v3, g3) = (flat(&q), flat(&k), flat(&v), flat(&g));
    let cq = Tensor::new(&[0u32, 70, 140], &dev).unwrap();
    let ck = Tensor::new(&[0u32, 90, 180], &dev).unwrap();
    let via_varlen = autograd(&q3, &k3, &v3, &g3, |q, k, v| {
        candle_flash::flash_attn_varlen(q, k, v, &cq, &ck, 70, 90, s, true)
    })
    .unwrap();
    let dense = autograd(&q, &k, &v, &g, |q, k, v| {
        candle_flash::flash_attn(q, k, v, s, true)
    })
    .unwrap();
    for (a, b, name) in [
        (&via_varlen.0, &dense.0, "dq"),
        (&via_varlen.1, &dense.1, "dk"),
        (&via_varlen.2, &dense.2, "dv"),
    ] {
        assert_bitwise_eq(&format!("varlen vs dense {name}"), a, &flat(b));
    }
}

/// Transposed storage, a NaN-padded buffer with a start offset, and k/v with different
/// layouts: the gradients are bitwise those of the contiguous call (and flow back through the
/// views to the buffers, never reading the NaN padding).
#[test]
fn non_contiguous_inputs_are_bitwise_equal() {
    for dtype in DTYPES {
        let c = case(2, 77, 91, 6, 2, 40, dtype);
        let (q, k, v, g) = inputs(c, 70).unwrap();
        let opts = FlashAttn::new(scale(40)).causal().softcap(4.0);
        let want = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        // q through transposed storage, k inside a NaN buffer, v transposed as well.
        let dims: Vec<usize> = k.dims().iter().map(|&n| n + 3).collect();
        let ranges: Vec<_> = k.dims().iter().map(|&n| 1..1 + n).collect();
        let kbuf = Tensor::full(f32::NAN, dims.as_slice(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .slice_assign(&ranges, &k)
            .unwrap();
        let (kvar, qvar, vvar) = (
            Var::from_tensor(&kbuf).unwrap(),
            Var::from_tensor(&q).unwrap(),
            Var::from_tensor(&v).unwrap(),
        );
        let kview = (0..4).fold(kvar.as_tensor().clone(), |t, axis| {
            t.narrow(axis, 1, k.dim(axis).unwrap()).unwrap()
        });
        let qview = transposed_view(qvar.as_tensor()).unwrap();
        let vview = transposed_view(vvar.as_tensor()).unwrap();
        assert!(!qview.is_contiguous() && !kview.is_contiguous() && !vview.is_contiguous());
        let out = opts.forward(&qview, &kview, &vview).unwrap();
        let loss = (out.to_dtype(DType::F32).unwrap() * g.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let dq = grads.get(qvar.as_tensor()).expect("dq");
        let dkbuf = grads.get(kvar.as_tensor()).expect("dk");
        let dv = grads.get(vvar.as_tensor()).expect("dv");
        let dk = (0..4).fold(dkbuf.clone(), |t, axis| {
            t.narrow(axis, 1, k.dim(axis).unwrap()).unwrap()
        });
        assert_bitwise_eq(&format!("{dtype:?} dq"), dq, &want.0);
        assert_bitwise_eq(&format!("{dtype:?} dk"), &dk, &want.1);
        assert_bitwise_eq(&format!("{dtype:?} dv"), dv, &want.2);
        // The padding of the buffer gets exactly 0.
        let total: f64 = values(dkbuf).unwrap().iter().map(|x| x.abs()).sum();
        let inner: f64 = values(&dk).unwrap().iter().map(|x| x.abs()).sum();
        assert_eq!(total, inner, "{dtype:?}: gradient leaked into the padding");
    }
}

/// NaN and infinity in the K and V of keys that some rows do not see reach only the gradients
/// the reference gives them: a masked key has dS = 0, and `dS · K` must not turn that into
/// 0 · NaN = NaN in the dq of rows that do not see it.
#[test]
fn non_finite_keys_reach_only_the_gradients_that_see_them() {
    let dev = Device::Cpu;
    let (sq, sk, h, d) = (150, 150, 2, 40);
    let q = randn(&[1, sq, h, d], DType::F32, 61, &dev).unwrap();
    let g = randn(&[1, sq, h, d], DType::F32, 62, &dev).unwrap();
    let plant = |t: Tensor, at: &[(usize, f32)]| {
        let mut x = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for &(key, val) in at {
            x[key * d..(key + 1) * d].fill(val);
        }
        Tensor::from_vec(x, t.dims(), &dev).unwrap()
    };
    let k = plant(
        randn(&[1, sk, 1, d], DType::F32, 63, &dev).unwrap(),
        &[(100, f32::NAN), (37, f32::INFINITY)],
    );
    let v = plant(
        randn(&[1, sk, 1, d], DType::F32, 64, &dev).unwrap(),
        &[(64, f32::NAN)],
    );
    for opts in [
        FlashAttn::new(0.2).causal(),
        FlashAttn::new(0.2).window(Some(20), Some(5)),
    ] {
        let (out, lse) = opts.forward_with_lse(&q, &k, &v).unwrap();
        let (dq, dk, dv) = opts.backward(&q, &k, &v, &out, &g, &lse).unwrap();
        let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
        assert!(
            r.dq.iter().any(|x| x.is_finite()) && r.dq.iter().any(|x| !x.is_finite()),
            "{opts:?}: the planted keys should poison some dq rows and spare others"
        );
        for (name, fast, want) in [("dq", &dq, &r.dq), ("dk", &dk, &r.dk), ("dv", &dv, &r.dv)] {
            let err = max_abs_err_slice(&values(fast).unwrap(), want).unwrap_or_else(|| {
                panic!("{opts:?} {name}: non-finite where the reference is not, or back")
            });
            assert!(err <= 1e-4, "{opts:?} {name}: max abs err {err:.3e}");
        }
    }
}

/// Two runs give the same bits, and so do 1, 2 and 3 threads (which switch between the fused
/// and the split dQ schedule).
#[test]
fn deterministic_across_runs_and_thread_counts() {
    let c = case(1, 200, 333, 6, 2, 64, DType::F32);
    let (q, k, v, g) = inputs(c, 80).unwrap();
    let opts = FlashAttn::new(0.125).causal().softcap(5.0);
    let run = || autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
    let first = run();
    let again = run();
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let other = pool.install(run);
        for (a, b, name) in [
            (&first.0, &other.0, "dq"),
            (&first.1, &other.1, "dk"),
            (&first.2, &other.2, "dv"),
        ] {
            assert_bitwise_eq(&format!("{threads} threads {name}"), a, b);
        }
    }
    assert_bitwise_eq("rerun dq", &first.0, &again.0);
    assert_bitwise_eq("rerun dk", &first.1, &again.1);
    assert_bitwise_eq("rerun dv", &first.2, &again.2);
}

/// Paged, KV-cache and prefix-range calls have no backward pass: `backward` is an error
/// naming the reason, not a silent zero.
#[test]
fn inference_only_calls_refuse_backward() {
    let dev = Device::Cpu;
    let q = Var::from_tensor(&randn(&[2, 2, 8], DType::F32, 90, &dev).unwrap()).unwrap();
    let kv = randn(&[6, 2, 1, 8], DType::F32, 91, &dev).unwrap();
    let table = Tensor::new(&[[4u32, 1, 0], [2, 5, 3]], &dev).unwrap();
    let cu_q = Tensor::new(&[0u32, 1, 2], &dev).unwrap();
    let cu_k = Tensor::new(&[0u32, 3, 8], &dev).unwrap();
    let out = FlashAttn::new(0.35)
        .paged(&table, 2)
        .forward_varlen(q.as_tensor(), &kv, &kv, &cu_q, &cu_k, 1, 5)
        .unwrap();
    let err = out.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("paged"), "{err}");

    let q = Var::from_tensor(&randn(&[1, 2, 2, 8], DType::F32, 92, &dev).unwrap()).unwrap();
    let cache = Tensor::zeros((1, 16, 1, 8), DType::F32, &dev).unwrap();
    let lens = Tensor::new(&[3u32], &dev).unwrap();
    let out = FlashAttn::new(0.35)
        .causal()
        .forward_kvcache(q.as_tensor(), &cache, &cache, &lens, None)
        .unwrap();
    let err = out.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("KV-cache"), "{err}");

    let q = Var::from_tensor(&randn(&[1, 6, 2, 8], DType::F32, 93, &dev).unwrap()).unwrap();
    let kv = randn(&[1, 6, 2, 8], DType::F32, 94, &dev).unwrap();
    let ranges = Tensor::new(&[[[0i32, 4]]], &dev).unwrap();
    let out = FlashAttn::new(0.35)
        .causal()
        .mm_prefix_ranges(&ranges)
        .forward(q.as_tensor(), &kv, &kv)
        .unwrap();
    let err = out.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("mm_prefix_ranges"), "{err}");
}

/// No keys at all (`sk = 0`): dq is exactly 0, dk and dv are empty.
#[test]
fn no_keys_gives_zero_dq() {
    let dev = Device::Cpu;
    let q = randn(&[1, 5, 2, 8], DType::F32, 100, &dev).unwrap();
    let kv = Tensor::zeros((1, 0, 2, 8), DType::F32, &dev).unwrap();
    let g = randn(&[1, 5, 2, 8], DType::F32, 101, &dev).unwrap();
    let (dq, dk, dv) = autograd(&q, &kv, &kv, &g, |q, k, v| {
        FlashAttn::new(0.3).forward(q, k, v)
    })
    .unwrap();
    assert!(values(&dq).unwrap().iter().all(|&x| x == 0.0));
    assert_eq!((dk.dims(), dv.dims()), (kv.dims(), kv.dims()));
}

/// No queries (`sq = 0`): the output is empty, yet q, k and v all get gradients (dk and dv are 0).
#[test]
fn no_queries_give_zero_dk_dv() {
    let dev = Device::Cpu;
    let q = Tensor::zeros((2, 0, 4, 8), DType::F32, &dev).unwrap();
    let k = randn(&[2, 5, 2, 8], DType::F32, 102, &dev).unwrap();
    let v = randn(&[2, 5, 2, 8], DType::F32, 103, &dev).unwrap();
    let g = Tensor::zeros((2, 0, 4, 8), DType::F32, &dev).unwrap();
    let (dq, dk, dv) = autograd(&q, &k, &v, &g, |q, k, v| {
        FlashAttn::new(0.3).causal().forward(q, k, v)
    })
    .unwrap();
    assert_eq!(dq.dims(), q.dims());
    assert_eq!((dk.dims(), dv.dims()), (k.dims(), v.dims()));
    assert!(values(&dk).unwrap().iter().all(|&x| x == 0.0));
    assert!(values(&dv).unwrap().iter().all(|&x| x == 0.0));
}

/// Scores around 1e4 with one winning key (common::planted_winner), in every dtype: P is
/// one-hot, so dq and dk are 0 up to rounding, dv of the winner is the sum of dO, and nothing
/// overflows.
#[test]
fn large_scores_with_one_winner() {
    let (q, k, v, winner) = common::planted_winner().unwrap();
    for dtype in DTYPES {
        let (q, k, v) = (
            q.to_dtype(dtype).unwrap(),
            k.to_dtype(dtype).unwrap(),
            v.to_dtype(dtype).unwrap(),
        );
        let g = randn(q.dims(), dtype, 110, &Device::Cpu).unwrap();
        let opts = FlashAttn::new(1.0);
        let fast = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
        let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
        let dv = values(&fast.2).unwrap();
        let d = q.dim(3).unwrap();
        for (j, row) in dv.chunks(d).enumerate() {
            let want = &r.dv[j * d..(j + 1) * d];
            for (a, b) in row.iter().zip(want) {
                let tol = if j == winner {
                    1e-2 * b.abs().max(1.0)
                } else {
                    0.0
                };
                assert!((a - b).abs() <= tol, "{dtype:?} dv[{j}]: {a} vs {b}");
            }
        }
        for t in [&fast.0, &fast.1] {
            let x = values(t).unwrap();
            assert!(x.iter().all(|x| x.abs() < 1e-3), "{dtype:?}: {x:?}");
        }
    }
}

/// `FlashAttn::backward` (no autograd) gives bitwise the gradients of `loss.backward()`, and
/// refuses saved results that do not fit the call.
#[test]
fn explicit_backward_matches_autograd() {
    common::grad::explicit_backward_matches_autograd(&Device::Cpu, &[DType::F32, DType::BF16]);
}
