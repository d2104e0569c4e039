//! CPU parity against the f64 golden reference (see tests/common), over the shapes, options,
//! layouts and numerics that find attention bugs.

mod common;

use candle::{DType, Device, IndexOp, Tensor};
use candle_flash::{naive_attention, FlashAttn};
use common::*;

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

fn inputs(c: Case, seed: u64) -> (Tensor, Tensor, Tensor) {
    let dev = Device::Cpu;
    let q = randn(&[c.b, c.sq, c.h, c.d], c.dtype, seed, &dev).unwrap();
    let k = randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 1, &dev).unwrap();
    let v = randn(&[c.b, c.sk, c.hk, c.d], c.dtype, seed + 2, &dev).unwrap();
    (q, k, v)
}

/// Runs flash and naive on the inputs and checks both output and lse against the reference.
fn check_inputs(what: &str, q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttn) {
    let (out, lse) = opts.forward_with_lse(q, k, v).unwrap();
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    let naive = naive_attention(q, k, v, opts).unwrap();
    let (ref_out, ref_lse) = reference(q, k, v, opts).unwrap();
    assert_close(what, &out, &naive, &ref_out, true);
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (i, (&a, &r)) in lse.iter().zip(&ref_lse).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(
                a,
                f32::NEG_INFINITY,
                "{what}: lse[{i}] of a fully masked row"
            );
        } else {
            let tol = 1e-4 * r.abs().max(1.0) + if q.dtype() == DType::F32 { 1e-5 } else { 1e-3 };
            assert!(
                (a as f64 - r).abs() <= tol,
                "{what}: lse[{i}] = {a}, reference {r}"
            );
        }
    }
}

fn check(c: Case, opts: &FlashAttn, seed: u64) {
    let (q, k, v) = inputs(c, seed);
    check_inputs(&format!("{c:?} {opts:?}"), &q, &k, &v, opts);
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

#[test]
fn odd_lengths_both_ways() {
    let pairs = [
        (1, 1),
        (1, 239),
        (239, 1),
        (17, 17),
        (113, 203),
        (203, 113),
        (65, 63),
        (64, 64),
        (63, 129),
    ];
    for (n, &(sq, sk)) in pairs.iter().enumerate() {
        for causal in [false, true] {
            let c = case(2, sq, sk, 4, 2, 64, DType::F32);
            let opts = FlashAttn::new(scale(64)).window(None, causal.then_some(0));
            check(c, &opts, n as u64);
        }
    }
}

#[test]
fn long_sequences() {
    for (sq, sk) in [(1023, 1024), (1025, 1025), (1024, 1023)] {
        for causal in [false, true] {
            let c = case(1, sq, sk, 2, 1, 32, DType::F32);
            check(
                c,
                &FlashAttn::new(scale(32)).window(None, causal.then_some(0)),
                7,
            );
        }
    }
}

#[test]
fn head_dims_and_dtypes() {
    for d in [8, 24, 40, 64, 80, 96, 128, 160, 256] {
        for dtype in DTYPES {
            let c = case(1, 37, 71, 3, 3, d, dtype);
            check(c, &FlashAttn::new(scale(d)), d as u64);
            check(c, &FlashAttn::new(scale(d)).causal(), d as u64 + 1);
        }
    }
    // Head dims that are not multiples of 8 work too.
    for d in [1, 3, 13, 100] {
        check(
            case(2, 9, 11, 2, 1, d, DType::F32),
            &FlashAttn::new(scale(d)),
            5,
        );
    }
}

#[test]
fn gqa_and_mqa() {
    for hk in [6, 3, 2, 1] {
        for dtype in DTYPES {
            let c = case(3, 29, 45, 6, hk, 40, dtype);
            check(c, &FlashAttn::new(scale(40)).causal(), hk as u64);
        }
    }
}

#[test]
fn decode_single_query() {
    for sk in [1, 2, 63, 64, 65, 239, 1000] {
        for dtype in DTYPES {
            let c = case(4, 1, sk, 6, 2, 64, dtype);
            check(c, &FlashAttn::new(scale(64)).causal(), sk as u64);
            check(
                c,
                &FlashAttn::new(scale(64)).window(Some(16), Some(0)),
                sk as u64,
            );
        }
    }
}

#[test]
fn windows() {
    let windows = [
        (Some(0), Some(0)),
        (Some(5), Some(3)),
        (None, Some(7)),
        (Some(9), None),
        (Some(0), None),
        (Some(100), Some(100)),
        (Some(usize::MAX), Some(usize::MAX)),
        (Some(usize::MAX), Some(0)),
        (Some(1 << 62), Some(usize::MAX - 1)),
        (Some(1), Some(0)),
    ];
    for (n, &(l, r)) in windows.iter().enumerate() {
        for (sq, sk) in [(70, 70), (33, 130), (130, 33)] {
            let c = case(2, sq, sk, 4, 2, 24, DType::F32);
            check(c, &FlashAttn::new(scale(24)).window(l, r), n as u64);
        }
    }
}

#[test]
fn alibi_and_softcap() {
    let dev = Device::Cpu;
    let slopes_h = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &dev).unwrap();
    let slopes_bh = randn(&[2, 4], DType::F32, 3, &dev).unwrap().abs().unwrap();
    for dtype in DTYPES {
        let c = case(2, 45, 77, 4, 2, 40, dtype);
        let s = scale(40);
        check(c, &FlashAttn::new(s).alibi(&slopes_h), 1);
        check(c, &FlashAttn::new(s).alibi(&slopes_bh).causal(), 2);
        check(c, &FlashAttn::new(s).softcap(2.0), 3);
        check(c, &FlashAttn::new(1.0).softcap(5.0).causal(), 4);
        check(
            c,
            &FlashAttn::new(s)
                .softcap(3.0)
                .alibi(&slopes_h)
                .window(Some(11), Some(4)),
            5,
        );
        // softcap = 0 means off, as upstream.
        check(c, &FlashAttn::new(s).softcap(0.0), 6);
    }
}

#[test]
fn causal_with_more_queries_than_keys_gives_zero_rows() {
    let c = case(2, 50, 20, 4, 4, 32, DType::F32);
    let (q, k, v) = inputs(c, 11);
    let (out, lse) = FlashAttn::new(scale(32))
        .causal()
        .forward_with_lse(&q, &k, &v)
        .unwrap();
    // Rows 0..30 see no key: exactly 0 and lse -inf.
    let head = out
        .i((.., 0..30))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(
        head.iter().all(|&x| x == 0.0),
        "leading rows must be exactly 0"
    );
    let lse = lse
        .i((.., .., 0..30))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    check_inputs(
        "sq > sk causal",
        &q,
        &k,
        &v,
        &FlashAttn::new(scale(32)).causal(),
    );
    // A window entirely outside the keys: every row masked.
    let opts = FlashAttn::new(1.0).window(Some(0), Some(0));
    let c = case(1, 10, 3, 2, 2, 8, DType::BF16);
    let (q, k, v) = inputs(c, 12);
    let out = opts.forward(&q, &k, &v).unwrap();
    let vals = out
        .i((.., 0..7))
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap();
    assert!(vals.to_vec1::<f32>().unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn non_contiguous_layouts_are_bitwise_equal() {
    for dtype in DTYPES {
        let c = case(2, 37, 53, 6, 2, 40, dtype);
        let (q, k, v) = inputs(c, 21);
        for opts in [FlashAttn::new(0.2), FlashAttn::new(0.2).causal()] {
            let base = opts.forward(&q, &k, &v).unwrap();
            let variants = [
                (
                    transposed_view(&q).unwrap(),
                    k.clone(),
                    transposed_view(&v).unwrap(),
                ),
                (
                    view_in_nan_buffer(&q).unwrap(),
                    view_in_nan_buffer(&k).unwrap(),
                    v.clone(),
                ),
                (
                    q.clone(),
                    transposed_view(&k).unwrap(),
                    view_in_nan_buffer(&v).unwrap(),
                ),
            ];
            for (n, (qv, kv, vv)) in variants.iter().enumerate() {
                assert!(!qv.is_contiguous() || !kv.is_contiguous() || !vv.is_contiguous());
                let out = opts.forward(qv, kv, vv).unwrap();
                assert_bitwise_eq(
                    &format!("{dtype:?} {opts:?} variant {n} against contiguous"),
                    &out,
                    &base,
                );
            }
        }
    }
}

#[test]
fn strided_head_dim() {
    // Last-dim stride != 1: a (b, s, h, d) view of (b, s, d, h) storage.
    let c = case(1, 19, 23, 4, 2, 16, DType::F32);
    let (q, k, v) = inputs(c, 31);
    let qs = q
        .transpose(2, 3)
        .unwrap()
        .contiguous()
        .unwrap()
        .transpose(2, 3)
        .unwrap();
    assert_ne!(qs.stride()[3], 1);
    check_inputs("dim stride", &qs, &k, &v, &FlashAttn::new(0.25).causal());
}

#[test]
fn varlen_matches_reference() {
    let dev = Device::Cpu;
    let lens_q = [5usize, 0, 17, 1, 64];
    let lens_k = [7usize, 3, 17, 40, 65];
    let cum = |l: &[usize]| -> Vec<u32> {
        std::iter::once(0)
            .chain(l.iter().scan(0u32, |s, &x| {
                *s += x as u32;
                Some(*s)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (cum(&lens_q), cum(&lens_k));
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let slopes = Tensor::new(&[0.3f32, 0.1, 0.05, 0.01], &dev).unwrap();
    // Per-sequence slopes: (batch, heads).
    let slopes_bh = randn(&[lens_q.len(), 4], DType::F32, 44, &dev)
        .unwrap()
        .abs()
        .unwrap();
    for dtype in DTYPES {
        let q = randn(&[tq, 4, 24], dtype, 41, &dev).unwrap();
        let k = randn(&[tk, 2, 24], dtype, 42, &dev).unwrap();
        let v = randn(&[tk, 2, 24], dtype, 43, &dev).unwrap();
        let sq_t = Tensor::new(cu_q.as_slice(), &dev).unwrap();
        let sk_t = Tensor::new(cu_k.as_slice(), &dev).unwrap();
        for opts in [
            FlashAttn::new(0.2),
            FlashAttn::new(0.2).causal(),
            FlashAttn::new(0.2).causal().alibi(&slopes_bh),
            FlashAttn::new(0.2)
                .window(Some(4), Some(2))
                .alibi(&slopes)
                .softcap(4.0),
        ] {
            let (out, lse) = opts
                .forward_varlen_with_lse(&q, &k, &v, &sq_t, &sk_t, 64, 65)
                .unwrap();
            assert_eq!(out.dims(), q.dims());
            assert_eq!(lse.dims(), &[4, tq]);
            let (r, rl) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
            // Naive per-sequence error bounds the low-precision tolerance.
            let naive = naive_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
            assert_close(
                &format!("varlen {dtype:?} {opts:?}"),
                &out,
                &naive,
                &r,
                true,
            );
            let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (&a, &b) in lse.iter().zip(&rl) {
                assert!(
                    a as f64 == b || (a as f64 - b).abs() < 2e-3 * b.abs().max(1.0),
                    "varlen lse {a} vs {b}"
                );
            }
            // The public varlen functions agree with the op.
            if opts.alibi_slopes.is_none() && opts.window_size_left.is_none() {
                let f = candle_flash::flash_attn_varlen(
                    &q,
                    &k,
                    &v,
                    &sq_t,
                    &sk_t,
                    64,
                    65,
                    0.2,
                    opts.window_size_right == Some(0),
                )
                .unwrap();
                assert_bitwise_eq("flash_attn_varlen against the op", &f, &out);
            }
        }
    }
}

#[test]
fn public_functions_match_the_op() {
    let c = case(2, 33, 47, 4, 2, 32, DType::BF16);
    let (q, k, v) = inputs(c, 51);
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu).unwrap();
    let same = |a: Tensor, b: Tensor| assert_bitwise_eq("public function against the op", &a, &b);
    let s = 0.17;
    same(
        candle_flash::flash_attn(&q, &k, &v, s, true).unwrap(),
        FlashAttn::new(s).causal().forward(&q, &k, &v).unwrap(),
    );
    same(
        candle_flash::flash_attn_windowed(&q, &k, &v, s, Some(3), Some(2)).unwrap(),
        FlashAttn::new(s)
            .window(Some(3), Some(2))
            .forward(&q, &k, &v)
            .unwrap(),
    );
    same(
        candle_flash::flash_attn_alibi(&q, &k, &v, &slopes, s, false).unwrap(),
        FlashAttn::new(s)
            .alibi(&slopes)
            .forward(&q, &k, &v)
            .unwrap(),
    );
    same(
        candle_flash::flash_attn_alibi_windowed(&q, &k, &v, &slopes, s, Some(8), None).unwrap(),
        FlashAttn::new(s)
            .alibi(&slopes)
            .window(Some(8), None)
            .forward(&q, &k, &v)
            .unwrap(),
    );
    same(
        candle_flash::flash_attn_alibi_windowed_softcap(
            &q,
            &k,
            &v,
            Some(&slopes),
            s,
            None,
            Some(0),
            2.5,
        )
        .unwrap(),
        FlashAttn::new(s)
            .alibi(&slopes)
            .causal()
            .softcap(2.5)
            .forward(&q, &k, &v)
            .unwrap(),
    );
}

#[test]
fn planted_numerics() {
    let dev = Device::Cpu;
    // One winning key with scores around 1e4: the output is that key's value row, exactly.
    let (q, k, v, winner) = planted_winner().unwrap();
    for dtype in DTYPES {
        let (q, k, v) = (
            q.to_dtype(dtype).unwrap(),
            k.to_dtype(dtype).unwrap(),
            v.to_dtype(dtype).unwrap(),
        );
        let out = FlashAttn::new(1.0).forward(&q, &k, &v).unwrap();
        let want = v.i((0, winner, 0)).unwrap();
        for i in 0..q.dim(1).unwrap() {
            let row = out.i((0, i, 0)).unwrap();
            assert_bitwise_eq(&format!("{dtype:?}: winner row {i}"), &row, &want);
        }
    }
    // All scores equal and large: the output is the mean of V, no 0/0.
    for dtype in DTYPES {
        let q = Tensor::full(30f32, (1, 3, 1, 8), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let k = Tensor::full(30f32, (1, 100, 1, 8), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let v = randn(&[1, 100, 1, 8], dtype, 62, &dev).unwrap();
        check_inputs(
            &format!("equal large scores {dtype:?}"),
            &q,
            &k,
            &v,
            &FlashAttn::new(1.0),
        );
    }
    // q = k = v large in bf16: no NaN or Inf.
    let x = randn(&[1, 40, 2, 64], DType::F32, 63, &dev)
        .unwrap()
        .affine(200.0, 0.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    for opts in [FlashAttn::new(1.0), FlashAttn::new(1.0).causal()] {
        let out = opts
            .forward(&x, &x, &x)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let vals = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            vals.iter().all(|v| v.is_finite()),
            "large bf16 q = k = v gave non-finite output"
        );
    }
}

#[test]
fn nan_in_one_query_row_poisons_only_that_row() {
    let c = case(1, 20, 30, 2, 1, 16, DType::F32);
    let (q, k, v) = inputs(c, 71);
    let mut qd = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (row, head) = (7, 1);
    qd[(row * 2 + head) * 16 + 3] = f32::NAN;
    let q = Tensor::from_vec(qd, (1, 20, 2, 16), &Device::Cpu).unwrap();
    let out = FlashAttn::new(0.25).forward(&q, &k, &v).unwrap();
    let vals = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for i in 0..20 {
        for h in 0..2 {
            let r = &vals[(i * 2 + h) * 16..][..16];
            if (i, h) == (row, head) {
                assert!(r.iter().all(|x| x.is_nan()), "poisoned row must be NaN");
            } else {
                assert!(
                    r.iter().all(|x| x.is_finite()),
                    "row {i} head {h} must stay finite"
                );
            }
        }
    }
}

/// NaN and infinity in the K and V of keys that some rows do not see (in tiles the mask cuts
/// through, where those keys' probabilities are 0 and 0 · NaN = NaN) reach exactly the rows that
/// see them, as in the reference, which leaves unseen keys out.
#[test]
fn non_finite_keys_reach_only_the_rows_that_see_them() {
    let dev = Device::Cpu;
    for (dtype, opts) in [
        (DType::F32, FlashAttn::new(0.2).causal()),
        (DType::BF16, FlashAttn::new(0.2).causal()),
        (DType::F32, FlashAttn::new(0.2).window(Some(20), Some(5))),
    ] {
        let c = case(1, 150, 150, 2, 1, 40, dtype);
        let (q, k, v) = inputs(c, 81);
        // (key, tensor, value): keys in the middle of tiles and at a tile's first key.
        let plant = |t: &Tensor, at: &[(usize, f32)]| {
            let mut x = values(t).unwrap();
            for &(key, val) in at {
                x[key * 40..(key + 1) * 40].fill(val as f64);
            }
            Tensor::from_vec(x, t.dims(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let k = plant(&k, &[(64, f32::NAN), (90, f32::INFINITY)]);
        let v = plant(
            &v,
            &[(100, f32::NAN), (37, f32::NEG_INFINITY), (128, f32::NAN)],
        );
        let what = format!("{dtype:?} {opts:?}");
        let out = opts.forward(&q, &k, &v).unwrap();
        let (want, _) = reference(&q, &k, &v, &opts).unwrap();
        let finite_rows = want.chunks(40).filter(|r| r[0].is_finite()).count();
        assert!(
            finite_rows > 20 && finite_rows < 300,
            "{what}: the planted keys should poison some rows and spare others ({finite_rows})"
        );
        let err = max_abs_err(&out, &want)
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: non-finite where the reference is not, or back"));
        let cap = tolerances(dtype).2;
        assert!(err <= cap, "{what}: max abs err {err:.3e} > {cap:.1e}");
    }
}

#[test]
fn empty_inputs() {
    let dev = Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
    // batch 0 and seq_q 0: empty outputs.
    let out = candle_flash::flash_attn(
        &z(&[0, 4, 2, 8]),
        &z(&[0, 4, 2, 8]),
        &z(&[0, 4, 2, 8]),
        1.0,
        true,
    )
    .unwrap();
    assert_eq!(out.dims(), &[0, 4, 2, 8]);
    let out = candle_flash::flash_attn(
        &z(&[2, 0, 2, 8]),
        &z(&[2, 4, 2, 8]),
        &z(&[2, 4, 2, 8]),
        1.0,
        false,
    )
    .unwrap();
    assert_eq!(out.dims(), &[2, 0, 2, 8]);
    // Batch 0 with large other dimensions: the empty output must not allocate them (2^37
    // elements would not fit).
    let big = z(&[0, 1 << 20, 256, 512]);
    let (out, lse) = FlashAttn::new(1.0)
        .forward_with_lse(&big, &big, &big)
        .unwrap();
    assert_eq!(out.dims(), &[0, 1 << 20, 256, 512]);
    assert_eq!(lse.dims(), &[0, 256, 1 << 20]);
    // seq_k 0: zeros, lse -inf.
    let q = randn(&[2, 3, 2, 8], DType::BF16, 81, &dev).unwrap();
    let kv = Tensor::zeros((2, 0, 1, 8), DType::BF16, &dev).unwrap();
    let (out, lse) = FlashAttn::new(1.0).forward_with_lse(&q, &kv, &kv).unwrap();
    assert_eq!(out.dims(), &[2, 3, 2, 8]);
    let vals = out
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(vals.iter().all(|&x| x == 0.0));
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    let naive = naive_attention(&q, &kv, &kv, &FlashAttn::new(1.0)).unwrap();
    assert_eq!(naive.dims(), &[2, 3, 2, 8]);
}

#[test]
fn repeated_runs_are_bitwise_identical() {
    let c = case(2, 130, 150, 4, 2, 64, DType::BF16);
    let (q, k, v) = inputs(c, 91);
    let opts = FlashAttn::new(0.125).causal();
    let first = opts
        .forward(&q, &k, &v)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for _ in 0..10 {
        let again = opts
            .forward(&q, &k, &v)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(first
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// The output bits do not depend on the thread count, which sets how many query tiles share a
/// work item, also under windows (the first key a work item sees moves with its size) and with
/// varlen sequences of every length class.
#[test]
fn same_bits_on_any_thread_count() {
    let dev = Device::Cpu;
    let (lens_q, lens_k) = ([3u32, 130, 0, 64, 300], [200u32, 129, 7, 65, 310]);
    let cum = |l: &[u32]| -> Vec<u32> {
        std::iter::once(0)
            .chain(l.iter().scan(0, |a, &x| {
                *a += x;
                Some(*a)
            }))
            .collect()
    };
    let (cq, ck) = (cum(&lens_q), cum(&lens_k));
    let q = randn(&[cq[5] as usize, 6, 24], DType::F32, 1, &dev).unwrap();
    let k = randn(&[ck[5] as usize, 2, 24], DType::F32, 2, &dev).unwrap();
    let v = randn(&[ck[5] as usize, 2, 24], DType::F32, 3, &dev).unwrap();
    let (cq, ck) = (
        Tensor::new(cq.as_slice(), &dev).unwrap(),
        Tensor::new(ck.as_slice(), &dev).unwrap(),
    );
    for opts in [
        FlashAttn::new(0.2).window(Some(40), Some(3)),
        FlashAttn::new(0.2).window(Some(100), None),
        FlashAttn::new(0.2).causal(),
    ] {
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| opts.forward_varlen(&q, &k, &v, &cq, &ck, 300, 310).unwrap())
        };
        let one = run(1);
        for threads in [2, 3, 8] {
            assert_bitwise_eq(&format!("{opts:?}, {threads} threads"), &one, &run(threads));
        }
    }
}

/// Every (row, key) visibility for many windows against `semantics::Window::key_range`, through the
/// mask probe of tests/common (q = 0, one-hot V: output = 1/count on visible keys, exactly 0
/// elsewhere).
#[test]
fn mask_visibility_matches_semantics() {
    let shapes = [
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
    ];
    let mut n = 0;
    for dtype in DTYPES {
        for &(sq, sk) in &shapes {
            for left in PROBE_WINDOWS {
                for right in PROBE_WINDOWS {
                    let p = mask_probe(sq, sk, 2, 1, 64, left, right, dtype).unwrap();
                    let (out, lse) = p.opts.forward_with_lse(&p.q, &p.k, &p.v).unwrap();
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
    assert_eq!(n, 3 * 10 * 49);
}
