//! Decode shapes (a few query rows per sequence against a long KV cache) against the f64 golden
//! reference: the CPU path sends them to its split-KV decode kernel (see `src/cpu/decode.rs`,
//! whose unit tests check which shapes go there, every instruction set and many split counts).

mod common;

use candle::{DType, Device, IndexOp, Tensor};
use candle_flash::{naive_attention, FlashAttn};
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

#[allow(clippy::too_many_arguments)]
fn inputs(
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
    seed: u64,
) -> (Tensor, Tensor, Tensor) {
    let dev = Device::Cpu;
    (
        randn(&[b, sq, h, d], dtype, seed, &dev).unwrap(),
        randn(&[b, sk, hk, d], dtype, seed + 1, &dev).unwrap(),
        randn(&[b, sk, hk, d], dtype, seed + 2, &dev).unwrap(),
    )
}

/// Checks the lse of every row against the reference: `-inf` exactly where no key is seen.
fn check_lse(what: &str, lse: &[f32], ref_lse: &[f64], dtype: DType) {
    assert_eq!(lse.len(), ref_lse.len(), "{what}: lse length");
    for (i, (&a, &r)) in lse.iter().zip(ref_lse).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(
                a,
                f32::NEG_INFINITY,
                "{what}: lse[{i}] of a row that sees no key"
            );
        } else {
            let tol = 1e-4 * r.abs().max(1.0) + if dtype == DType::F32 { 1e-5 } else { 1e-3 };
            assert!(
                (a as f64 - r).abs() <= tol,
                "{what}: lse[{i}] = {a}, reference {r}"
            );
        }
    }
}

/// Runs flash (with lse) and naive on the inputs, checks both against the reference and returns
/// the flash output.
fn check(what: &str, q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttn) -> Tensor {
    let (out, lse) = opts.forward_with_lse(q, k, v).unwrap();
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    let naive = naive_attention(q, k, v, opts).unwrap();
    let (ref_out, ref_lse) = reference(q, k, v, opts).unwrap();
    assert_close(what, &out, &naive, &ref_out, true);
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    check_lse(what, &lse, &ref_lse, q.dtype());
    out
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn decode_shapes_and_gqa() {
    // (heads, kv_heads, head_dim): GQA 32/8, MQA 8/1, MHA 6/6 and 6/2 (MQA alone cannot catch a
    // wrong GQA mapping).
    let heads = [(32, 8, 128), (8, 1, 64), (6, 6, 40), (6, 2, 80)];
    let sks = [1usize, 2, 31, 255, 257, 600, 2049, 3001];
    let mut seed = 1;
    for &(h, hk, d) in &heads {
        for &sq in &[1usize, 2, 3, 4, 7, 16] {
            for &sk in &sks {
                // Keep the f64 reference affordable: long caches only for the common shapes.
                if sk > 600 && !(sq <= 4 || h == 6) {
                    continue;
                }
                for b in [1, 3] {
                    if b == 3 && sk > 600 && h == 32 {
                        continue;
                    }
                    seed += 3;
                    let (q, k, v) = inputs(b, sq, sk, h, hk, d, DType::F32, seed);
                    for opts in [FlashAttn::new(scale(d)).causal(), FlashAttn::new(scale(d))] {
                        check(
                            &format!("b {b} sq {sq} sk {sk} heads {h}/{hk} d {d} {opts:?}"),
                            &q,
                            &k,
                            &v,
                            &opts,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn head_dims_and_dtypes() {
    for d in [8, 40, 80, 96, 128, 256, 320, 512] {
        for dtype in DTYPES {
            let (q, k, v) = inputs(2, 1, 700, 8, 2, d, dtype, 100 + d as u64);
            let opts = FlashAttn::new(scale(d)).causal();
            check(&format!("d {d} {dtype:?}"), &q, &k, &v, &opts);
            let (q, k, v) = inputs(1, 3, 1100, 6, 2, d, dtype, 200 + d as u64);
            let opts = FlashAttn::new(scale(d)).window(Some(300), Some(0));
            check(&format!("d {d} {dtype:?} windowed"), &q, &k, &v, &opts);
        }
    }
    let (q, k, v) = inputs(1, 1, 8, 2, 1, 520, DType::F32, 7);
    assert!(FlashAttn::new(0.1).forward(&q, &k, &v).is_err());
}

#[test]
fn every_option() {
    let dev = Device::Cpu;
    let d = 64;
    let per_head = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625, 0.03, 0.0, 0.01, 0.2], &dev).unwrap();
    let per_batch = randn(&[2, 8], DType::F32, 5, &dev)
        .unwrap()
        .abs()
        .unwrap()
        .affine(0.05, 0.0)
        .unwrap();
    let s = scale(d);
    let options = [
        FlashAttn::new(s),
        FlashAttn::new(s).causal(),
        FlashAttn::new(s).window(Some(100), Some(0)),
        FlashAttn::new(s).window(Some(5), Some(3)),
        FlashAttn::new(s).window(None, Some(7)),
        FlashAttn::new(s).window(Some(0), Some(0)),
        FlashAttn::new(s).window(Some(700), None),
        FlashAttn::new(s).causal().alibi(&per_head),
        FlashAttn::new(s).causal().alibi(&per_batch),
        FlashAttn::new(s).softcap(2.0),
        FlashAttn::new(s)
            .window(Some(400), Some(2))
            .alibi(&per_batch)
            .softcap(5.0),
    ];
    for dtype in DTYPES {
        for (sq, sk) in [(1, 1500), (4, 1500), (2, 1), (4, 2), (3, 513)] {
            let (q, k, v) = inputs(2, sq, sk, 8, 2, d, dtype, 300 + (sq * sk) as u64);
            for opts in &options {
                check(
                    &format!("{dtype:?} sq {sq} sk {sk} {opts:?}"),
                    &q,
                    &k,
                    &v,
                    opts,
                );
            }
        }
    }
}

#[test]
fn causal_with_more_queries_than_keys_gives_exact_zero_rows() {
    let (q, k, v) = inputs(2, 4, 2, 8, 2, 32, DType::BF16, 11);
    let (out, lse) = FlashAttn::new(0.2)
        .causal()
        .forward_with_lse(&q, &k, &v)
        .unwrap();
    let out = f32s(&out);
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for b in 0..2 {
        for i in 0..2 {
            for h in 0..8 {
                let row = &out[((b * 4 + i) * 8 + h) * 32..][..32];
                assert!(row.iter().all(|&x| x.to_bits() == 0), "row {i} must be +0");
                assert_eq!(lse[(b * 8 + h) * 4 + i], f32::NEG_INFINITY);
            }
        }
    }
}

#[test]
fn non_contiguous_layouts_are_bitwise_equal() {
    for dtype in DTYPES {
        let (q, k, v) = inputs(2, 2, 1300, 8, 2, 80, dtype, 400);
        let opts = FlashAttn::new(scale(80)).causal().softcap(4.0);
        let want = bits(&opts.forward(&q, &k, &v).unwrap());
        // The usual cache layout (b, h, s, d) seen as (b, s, h, d); K and V laid out differently;
        // a strided head dim; views inside NaN guard bands with non-zero start offsets.
        let head_dim_strided = |t: &Tensor| -> Tensor {
            t.transpose(2, 3)
                .unwrap()
                .contiguous()
                .unwrap()
                .transpose(2, 3)
                .unwrap()
        };
        let layouts: [(&str, Tensor, Tensor, Tensor); 4] = [
            (
                "(b, h, s, d) cache",
                q.clone(),
                transposed_view(&k).unwrap(),
                transposed_view(&v).unwrap(),
            ),
            (
                "k and v differ",
                q.clone(),
                transposed_view(&k).unwrap(),
                view_in_nan_buffer(&v).unwrap(),
            ),
            (
                "strided head dim",
                transposed_view(&q).unwrap(),
                head_dim_strided(&k),
                head_dim_strided(&v),
            ),
            (
                "NaN guard bands",
                view_in_nan_buffer(&q).unwrap(),
                view_in_nan_buffer(&k).unwrap(),
                view_in_nan_buffer(&v).unwrap(),
            ),
        ];
        for (what, q2, k2, v2) in layouts {
            assert!(!k2.is_contiguous() || !q2.is_contiguous(), "{what}: a view");
            let got = bits(&opts.forward(&q2, &k2, &v2).unwrap());
            assert!(
                got == want,
                "{dtype:?} {what}: not bitwise equal to the contiguous run"
            );
        }
        // A narrowed cache (the valid prefix of a preallocated one): the reference agrees.
        let big = randn(&[2, 2000, 2, 80], dtype, 401, &Device::Cpu).unwrap();
        let (kn, vn) = (
            big.narrow(1, 3, 1300).unwrap(),
            big.narrow(1, 600, 1300).unwrap(),
        );
        check(&format!("{dtype:?} narrowed cache"), &q, &kn, &vn, &opts);
    }
}

fn cum(l: &[usize]) -> Vec<u32> {
    std::iter::once(0)
        .chain(l.iter().scan(0u32, |s, &x| {
            *s += x as u32;
            Some(*s)
        }))
        .collect()
}

#[test]
fn varlen_decode() {
    let dev = Device::Cpu;
    // Sequences of 0 and 1 keys, one with no query, one with more queries than keys.
    let lens_q = [1usize, 1, 2, 1, 0, 3, 1];
    let lens_k = [1000usize, 0, 1, 2500, 7, 600, 1];
    let (cu_q, cu_k) = (cum(&lens_q), cum(&lens_k));
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let (h, hk, d) = (8, 2, 48);
    let slopes_bh = randn(&[lens_q.len(), h], DType::F32, 44, &dev)
        .unwrap()
        .abs()
        .unwrap()
        .affine(0.02, 0.0)
        .unwrap();
    let sq_t = Tensor::new(cu_q.as_slice(), &dev).unwrap();
    let sk_t = Tensor::new(cu_k.as_slice(), &dev).unwrap();
    for dtype in DTYPES {
        let q = randn(&[tq, h, d], dtype, 41, &dev).unwrap();
        let k = randn(&[tk, hk, d], dtype, 42, &dev).unwrap();
        let v = randn(&[tk, hk, d], dtype, 43, &dev).unwrap();
        for opts in [
            FlashAttn::new(scale(d)),
            FlashAttn::new(scale(d)).causal(),
            FlashAttn::new(scale(d)).causal().alibi(&slopes_bh),
            FlashAttn::new(scale(d))
                .window(Some(200), Some(0))
                .softcap(3.0),
        ] {
            let what = format!("varlen {dtype:?} {opts:?}");
            let (out, lse) = opts
                .forward_varlen_with_lse(&q, &k, &v, &sq_t, &sk_t, 3, 2500)
                .unwrap();
            let (r, rl) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
            let naive = naive_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
            assert_close(&what, &out, &naive, &r, true);
            let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            check_lse(&what, &lse, &rl, dtype);
            // The sequence with no key: exact zeros.
            let row = f32s(&out.i(cu_q[1] as usize).unwrap());
            assert!(row.iter().all(|&x| x.to_bits() == 0), "{what}: no-key row");
        }
    }
}

#[test]
fn sequence_lengths_zero_and_one() {
    let dev = Device::Cpu;
    for dtype in DTYPES {
        // No key at all: zeros and lse -inf.
        let q = randn(&[2, 1, 8, 16], dtype, 61, &dev).unwrap();
        let kv = Tensor::zeros((2, 0, 2, 16), dtype, &dev).unwrap();
        let (out, lse) = FlashAttn::new(0.25)
            .causal()
            .forward_with_lse(&q, &kv, &kv)
            .unwrap();
        assert!(f32s(&out).iter().all(|&x| x.to_bits() == 0));
        let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
        // One key: the output is that V row.
        let (q, k, v) = inputs(2, 1, 1, 8, 2, 16, dtype, 62);
        let out = check(
            &format!("sk 1 {dtype:?}"),
            &q,
            &k,
            &v,
            &FlashAttn::new(0.25).causal(),
        );
        let want = v
            .repeat((1, 1, 1, 1))
            .unwrap()
            .unsqueeze(3)
            .unwrap()
            .broadcast_as((2, 1, 2, 4, 16))
            .unwrap()
            .reshape((2, 1, 8, 16))
            .unwrap();
        assert_eq!(
            bits(&out),
            bits(&want),
            "{dtype:?}: one key gives its V row"
        );
    }
    // No query: empty output.
    let (q, k, v) = inputs(2, 0, 50, 8, 2, 16, DType::F32, 63);
    let out = FlashAttn::new(0.25).forward(&q, &k, &v).unwrap();
    assert_eq!(out.dims(), &[2, 0, 8, 16]);
}

#[test]
fn nan_in_one_query_row_poisons_only_that_row() {
    let (h, hk, d, sq, sk) = (32, 8, 64, 2, 2000);
    let (q, k, v) = inputs(2, sq, sk, h, hk, d, DType::F32, 71);
    let mut qd = f32s(&q);
    let (bb, row, head) = (1, 1, 13);
    qd[((bb * sq + row) * h + head) * d + 5] = f32::NAN;
    let q = Tensor::from_vec(qd, (2, sq, h, d), &Device::Cpu).unwrap();
    let (out, lse) = FlashAttn::new(scale(d))
        .causal()
        .forward_with_lse(&q, &k, &v)
        .unwrap();
    let vals = f32s(&out);
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for b in 0..2 {
        for i in 0..sq {
            for hh in 0..h {
                let r = &vals[((b * sq + i) * h + hh) * d..][..d];
                let l = lse[(b * h + hh) * sq + i];
                if (b, i, hh) == (bb, row, head) {
                    assert!(r.iter().all(|x| x.is_nan()), "poisoned row must be NaN");
                    assert!(l.is_nan(), "poisoned row's lse must be NaN");
                } else {
                    assert!(
                        r.iter().all(|x| x.is_finite()) && l.is_finite(),
                        "batch {b} row {i} head {hh} must stay finite"
                    );
                }
            }
        }
    }
}

#[test]
fn nan_in_keys_outside_the_window_is_never_read() {
    // Keys left of the window are NaN in both K and V: a kernel that loads them and only masks
    // the score still gets 0 · NaN = NaN from V.
    let (b, sq, sk, h, hk, d) = (2, 2, 1500, 8, 2, 32);
    let (q, k, v) = inputs(b, sq, sk, h, hk, d, DType::F32, 81);
    let left = 300;
    let first_seen = sk - sq - left; // row 0's first visible key
    let poison = |t: &Tensor| -> Tensor {
        let mut x = f32s(t);
        for bi in 0..b {
            for j in 0..first_seen {
                let at = (bi * sk + j) * hk * d;
                x[at..at + hk * d].iter_mut().for_each(|x| *x = f32::NAN);
            }
        }
        Tensor::from_vec(x, (b, sk, hk, d), &Device::Cpu).unwrap()
    };
    let (kp, vp) = (poison(&k), poison(&v));
    let opts = FlashAttn::new(scale(d)).window(Some(left), Some(0));
    let (ref_out, _) = reference(&q, &k, &v, &opts).unwrap();
    let out = opts.forward(&q, &kp, &vp).unwrap();
    let naive = naive_attention(&q, &k, &v, &opts).unwrap();
    assert_close("NaN outside the window", &out, &naive, &ref_out, true);
}

#[test]
fn one_winning_key_in_one_split() {
    // Scores around 1e4 with a single winner far from the other splits' maxima: the combine must
    // weight the other splits by exactly 0 and return the winner's V row.
    let (sq, sk, h, hk, d) = (1, 4000, 4, 1, 16);
    let (q, k, v) = inputs(1, sq, sk, h, hk, d, DType::F32, 91);
    let mut kd = f32s(&k);
    let qd = f32s(&q);
    let winner = 2777;
    for x in 0..d {
        // Every query head is aligned with the winner; the others score around +-1e3.
        let s: f32 = (0..h).map(|hh| qd[hh * d + x]).sum();
        kd[winner * d + x] = 50.0 * s;
    }
    let k = Tensor::from_vec(kd, (1, sk, hk, d), &Device::Cpu).unwrap();
    let out = check("one winner", &q, &k, &v, &FlashAttn::new(10.0).causal());
    let vals = f32s(&out);
    let vrow = &f32s(&v)[winner * d..][..d];
    for hh in 0..h {
        let o = &vals[hh * d..][..d];
        for (a, b) in o.iter().zip(vrow) {
            assert!((a - b).abs() < 1e-5, "head {hh}: {a} vs winner's {b}");
        }
    }
}

#[test]
fn repeated_runs_are_bitwise_identical() {
    for dtype in [DType::F32, DType::BF16] {
        let (q, k, v) = inputs(1, 1, 4000, 32, 8, 128, dtype, 101);
        let opts = FlashAttn::new(scale(128)).causal();
        let (o0, l0) = opts.forward_with_lse(&q, &k, &v).unwrap();
        let (o0, l0) = (bits(&o0), bits(&l0));
        for run in 0..30 {
            let (o, l) = opts.forward_with_lse(&q, &k, &v).unwrap();
            assert!(
                bits(&o) == o0 && bits(&l) == l0,
                "{dtype:?}: run {run} differs"
            );
        }
    }
}
