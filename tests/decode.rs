//! Decode shapes (a few query rows per sequence against a long KV cache) against the f64 golden
//! reference. Both backends send them to a split-KV decode kernel (CPU: `src/cpu/decode`, whose
//! unit tests check which shapes go there, every instruction set and many split counts; CUDA:
//! the partial pass and its combine). On the GPU every property also runs with the split count
//! forced to one and to one key tile per split (tests/common/device.rs).

#[macro_use]
mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::FlashAttn;
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// q, k, v of a dense case on the target, seeded.
#[allow(clippy::too_many_arguments)]
fn inputs(
    t: &Target,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
    seed: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    Case::new(b, sq, sk, h, hk, d, dtype).inputs(t, seed)
}

/// One to sixteen queries against caches from 1 to 3001 keys, batch 1 (many splits) and 3, GQA
/// 32/8, MQA 8/1, MHA 6/6 and 6/2 (MQA alone cannot catch a wrong GQA mapping), causal or not.
fn decode_shapes_and_gqa(t: &Target) -> Result<()> {
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
                    let (q, k, v) = inputs(t, b, sq, sk, h, hk, d, DType::F32, seed)?;
                    for opts in [FlashAttn::new(scale(d)).causal(), FlashAttn::new(scale(d))] {
                        let what = format!("b {b} sq {sq} sk {sk} heads {h}/{hk} d {d} {opts:?}");
                        check_forward(t, &what, &q, &k, &v, &opts)?;
                    }
                }
            }
        }
    }
    Ok(())
}
test_device!(decode_shapes_and_gqa, Decode);

/// One query, batch 4, against caches around the tile sizes and one long one: GQA 6/2 at d 64
/// (causal and a 16-key window), and 6/2, 6/1, 8/8 at d 128 against 777 keys.
fn single_query_gqa(t: &Target) -> Result<()> {
    for sk in [1, 2, 63, 64, 65, 239, 1000] {
        for dtype in DTYPES {
            let c = Case::new(4, 1, sk, 6, 2, 64, dtype);
            c.clone().causal().check(t, sk as u64)?;
            c.window(Some(16), Some(0)).check(t, sk as u64)?;
        }
    }
    for (i, (h, hk)) in [(6, 2), (6, 1), (8, 8)].into_iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, i) {
            Case::new(4, 1, 777, h, hk, 128, dtype)
                .causal()
                .check(t, 7)?;
        }
    }
    Ok(())
}
test_device!(single_query_gqa, Decode);

/// Head dims from 8 to 512 in every dtype, causal and with a window; 520 is refused.
fn head_dims_and_dtypes(t: &Target) -> Result<()> {
    for d in [8, 40, 80, 96, 128, 256, 320, 512] {
        for dtype in DTYPES {
            let (q, k, v) = inputs(t, 2, 1, 700, 8, 2, d, dtype, 100 + d as u64)?;
            let opts = FlashAttn::new(scale(d)).causal();
            check_forward(t, &format!("d {d} {dtype:?}"), &q, &k, &v, &opts)?;
            let (q, k, v) = inputs(t, 1, 3, 1100, 6, 2, d, dtype, 200 + d as u64)?;
            let opts = FlashAttn::new(scale(d)).window(Some(300), Some(0));
            check_forward(t, &format!("d {d} {dtype:?} windowed"), &q, &k, &v, &opts)?;
        }
    }
    let (q, k, v) = inputs(t, 1, 1, 8, 2, 1, 520, DType::F32, 7)?;
    assert!(t.op(&FlashAttn::new(0.1)).forward(&q, &k, &v).is_err());
    Ok(())
}
test_device!(head_dims_and_dtypes, Decode);

/// Every option on decode shapes: windows of every kind, ALiBi per head and per sequence,
/// softcap, and all of them together.
fn every_option(t: &Target) -> Result<()> {
    let d = 64;
    let per_head = Tensor::new(
        &[0.5f32, 0.25, 0.125, 0.0625, 0.03, 0.0, 0.01, 0.2],
        &Device::Cpu,
    )?;
    let per_batch = batch_slopes(2, 8, 5, 0.05);
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
            let (q, k, v) = inputs(t, 2, sq, sk, 8, 2, d, dtype, 300 + (sq * sk) as u64)?;
            for opts in &options {
                let what = format!("{dtype:?} sq {sq} sk {sk} {opts:?}");
                check_forward(t, &what, &q, &k, &v, opts)?;
            }
        }
    }
    Ok(())
}
test_device!(every_option, Decode);

/// Split-KV shapes of the CUDA decode kernel: one to sixteen queries per K/V head against caches
/// from 1 to 5000 keys, batch 1 (many splits) and 3, GQA 32/8, 8/1, 6/6, 6/2, head dims 40 to
/// 256, every mask, softcap and ALiBi, in f16 and bf16. The CPU (whose decode kernel
/// `decode_shapes_and_gqa` sweeps) takes one dtype per case and every third case.
fn split_kv_against_reference(t: &Target) -> Result<()> {
    let mut n = 0;
    for &(b, sq, sk) in &[
        (1, 1, 5000),
        (3, 1, 777),
        (1, 2, 1),
        (3, 4, 63),
        (1, 16, 1500),
        (2, 3, 2049),
    ] {
        for (i, &(h, hk)) in [(32, 8), (8, 1), (6, 6), (6, 2)].iter().enumerate() {
            if sq * h / hk > 64 {
                continue;
            }
            for &dtype in t.sweep(&[DType::BF16, DType::F16], sk + i) {
                if !t.is_cuda() && n % 3 != 0 {
                    n += 1;
                    continue;
                }
                let d = [128, 64, 40, 256][n % 4];
                let c = Case::new(b, sq, sk, h, hk, d, dtype);
                let c = match n % 4 {
                    0 => c.causal(),
                    1 => c,
                    2 => c.window(Some(300), Some(0)),
                    _ => c.window(Some(77), None),
                };
                let c = if n % 3 == 1 { c.softcap(4.0) } else { c };
                let c = if n % 5 == 2 { c.alibi() } else { c };
                c.check(t, 500 + n as u64)?;
                n += 1;
            }
        }
    }
    Ok(())
}
test_device!(split_kv_against_reference, Decode);

/// Many (query row, head) pairs: 8 to 64 sequences of 4 query rows, 32/8 heads. Under the
/// forced-split configuration the GPU's combine kernel merges them with two warps a pair and
/// one, as they outgrow one wave of its blocks (1024, 3072 and 8192 pairs against about 500 to
/// 800 resident blocks, 4 to 6 an SM, on H100-class GPUs); the other decode tests' few pairs
/// take four warps each.
fn combine_over_many_rows_and_heads(t: &Target) -> Result<()> {
    for (n, &(b, sk, dtype)) in [
        (8, 300, DType::BF16),
        (24, 257, DType::F16),
        (64, 130, DType::BF16),
    ]
    .iter()
    .enumerate()
    {
        let c = Case::new(b, 4, sk, 32, 8, 128, dtype);
        let c = if n == 1 { c.causal() } else { c };
        c.check(t, 1200 + n as u64)?;
    }
    Ok(())
}
test_device!(combine_over_many_rows_and_heads, Decode);

/// Small split-KV decode shapes for compute-sanitizer: many splits, ragged tails, GQA.
fn sanitizer_decode_split_kv(t: &Target) -> Result<()> {
    for (n, &(dtype, sq, sk, d)) in [
        (DType::BF16, 1, 1500, 128),
        (DType::F16, 3, 333, 40),
        (DType::BF16, 2, 1, 64),
    ]
    .iter()
    .enumerate()
    {
        let c = Case::new(2, sq, sk, 8, 2, d, dtype);
        let c = match n {
            0 => c.causal(),
            1 => c.window(Some(50), Some(0)).softcap(3.0),
            _ => c.alibi(),
        };
        c.check(t, 900 + n as u64)?;
    }
    Ok(())
}
test_device!(sanitizer_decode_split_kv, Decode);

/// Every decode instance, forced by name, against the reference: at its own head dim and a
/// narrower one padded up to it, one packed row tile and 128 packed rows (one block of the
/// widest instance, several row blocks of the others), odd cache lengths across tile and split
/// edges, a one-key cache, both 16-bit dtypes. Instances a GPU's shared memory cannot hold, and
/// the warpgroup-MMA ones off sm_90a, are refused with an error, and skipped here.
#[cfg(feature = "cuda")]
fn sanitizer_every_decode_instance(t: &Target) -> Result<()> {
    use common::device::Config;
    use common::instances::DECODE_INSTANCES;
    let sk_long = if t.small() { 333 } else { 1777 };
    for (n, i) in DECODE_INSTANCES.iter().enumerate() {
        let name = i.name();
        let it = Target {
            dev: t.dev.clone(),
            config: Config::DecodeInstance(name.clone()),
        };
        for (m, &(sq, sk, h, hk, d)) in [
            (1, sk_long, 8, 2, i.d),
            (16, 301, 8, 1, i.d - 24),
            (2, 1, 4, 4, i.d),
        ]
        .iter()
        .enumerate()
        {
            let dtype = [DType::BF16, DType::F16][(n + m) % 2];
            let c = Case::new(2, sq, sk, h, hk, d, dtype).causal();
            match c.check(&it, 1000 + (10 * n + m) as u64) {
                Err(e)
                    if e.to_string().contains("more shared memory")
                        || (i.wg && e.to_string().contains("sm_90a")) =>
                {
                    break
                }
                r => {
                    r.map_err(|e| candle::Error::Msg(format!("instance {name}: {e}")))?;
                }
            }
        }
    }
    Ok(())
}
test_cuda!(sanitizer_every_decode_instance, Once);

/// Causal with more queries than keys: the leading rows are exactly +0 with lse `-inf`.
fn causal_with_more_queries_than_keys_gives_exact_zero_rows(t: &Target) -> Result<()> {
    let (q, k, v) = inputs(t, 2, 4, 2, 8, 2, 32, DType::BF16, 11)?;
    let (out, lse) = t
        .op(&FlashAttn::new(0.2).causal())
        .forward_with_lse(&q, &k, &v)?;
    let out = bits(&out)?;
    let lse = values(&lse)?;
    for b in 0..2 {
        for i in 0..2 {
            for h in 0..8 {
                let row = &out[((b * 4 + i) * 8 + h) * 32..][..32];
                assert!(row.iter().all(|&x| x == 0), "row {i} must be +0");
                assert_eq!(lse[(b * 8 + h) * 4 + i], f64::NEG_INFINITY);
            }
        }
    }
    Ok(())
}
test_device!(
    causal_with_more_queries_than_keys_gives_exact_zero_rows,
    Decode
);

/// The usual cache layout `(b, h, s, d)` seen as `(b, s, h, d)`, K and V laid out differently, a
/// strided head dim, views inside NaN guard bands with non-zero start offsets: bitwise the
/// contiguous result. A narrowed cache (the valid prefix of a preallocated one) matches the
/// reference.
fn non_contiguous_layouts_are_bitwise_equal(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        let (q, k, v) = inputs(t, 2, 2, 1300, 8, 2, 80, dtype, 400)?;
        let opts = FlashAttn::new(scale(80)).causal().softcap(4.0);
        let op = t.op(&opts);
        let want = op.forward(&q, &k, &v)?;
        let layouts: [(&str, Tensor, Tensor, Tensor); 4] = [
            (
                "(b, h, s, d) cache",
                q.clone(),
                transposed_view(&k)?,
                transposed_view(&v)?,
            ),
            (
                "k and v differ",
                q.clone(),
                transposed_view(&k)?,
                view_in_nan_buffer(&v)?,
            ),
            (
                "strided head dim",
                transposed_view(&q)?,
                head_dim_strided(&k)?,
                head_dim_strided(&v)?,
            ),
            (
                "NaN guard bands",
                view_in_nan_buffer(&q)?,
                view_in_nan_buffer(&k)?,
                view_in_nan_buffer(&v)?,
            ),
        ];
        for (what, q2, k2, v2) in layouts {
            assert!(!k2.is_contiguous() || !q2.is_contiguous(), "{what}: a view");
            let got = op.forward(&q2, &k2, &v2)?;
            assert_bitwise_eq(&format!("{dtype:?} {what}"), &got, &want);
        }
        let big = randn(&[2, 2000, 2, 80], dtype, 401, &t.dev)?;
        let (kn, vn) = (big.narrow(1, 3, 1300)?, big.narrow(1, 600, 1300)?);
        check_forward(t, &format!("{dtype:?} narrowed cache"), &q, &kn, &vn, &opts)?;
    }
    Ok(())
}
test_device!(non_contiguous_layouts_are_bitwise_equal, Decode);

/// Packed decode batches: sequences of 0 and 1 keys, one with no query, one with more queries
/// than keys; the sequence without keys gives exact zeros.
fn varlen_decode(t: &Target) -> Result<()> {
    let r = Ragged::new(&[
        (1, 1000),
        (1, 0),
        (2, 1),
        (1, 2500),
        (0, 7),
        (3, 600),
        (1, 1),
    ]);
    let (h, hk, d) = (8, 2, 48);
    let slopes_bh = batch_slopes(7, h, 44, 0.02);
    for dtype in DTYPES {
        let q = randn(&[r.total_q, h, d], dtype, 41, &t.dev)?;
        let k = randn(&[r.total_k, hk, d], dtype, 42, &t.dev)?;
        let v = randn(&[r.total_k, hk, d], dtype, 43, &t.dev)?;
        for opts in [
            FlashAttn::new(scale(d)),
            FlashAttn::new(scale(d)).causal(),
            FlashAttn::new(scale(d)).causal().alibi(&slopes_bh),
            FlashAttn::new(scale(d))
                .window(Some(200), Some(0))
                .softcap(3.0),
        ] {
            let what = format!("varlen {dtype:?} {opts:?}");
            let out = check_varlen(t, &what, &r, &q, &k, &v, &opts)?;
            let row = bits(&out.i(r.cu_q[1] as usize)?)?;
            assert!(row.iter().all(|&x| x == 0), "{what}: no-key row");
        }
    }
    Ok(())
}
test_device!(varlen_decode, Decode);

/// No key at all: zeros and lse `-inf`; one key: the output is that V row, bitwise; no query:
/// an empty output.
fn sequence_lengths_zero_and_one(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        let q = randn(&[2, 1, 8, 16], dtype, 61, &t.dev)?;
        let kv = empty(&[2, 0, 2, 16], dtype, &t.dev)?;
        let (out, lse) = t
            .op(&FlashAttn::new(0.25).causal())
            .forward_with_lse(&q, &kv, &kv)?;
        assert!(bits(&out)?.iter().all(|&x| x == 0));
        assert!(values(&lse)?.iter().all(|&x| x == f64::NEG_INFINITY));
        let (q, k, v) = inputs(t, 2, 1, 1, 8, 2, 16, dtype, 62)?;
        let out = check_forward(
            t,
            &format!("sk 1 {dtype:?}"),
            &q,
            &k,
            &v,
            &FlashAttn::new(0.25).causal(),
        )?;
        // Each K/V head's one row, repeated over its four query heads.
        let want = v
            .unsqueeze(3)?
            .broadcast_as((2, 1, 2, 4, 16))?
            .reshape((2, 1, 8, 16))?;
        assert_bitwise_eq(&format!("{dtype:?}: one key gives its V row"), &out, &want);
    }
    let (q, k, v) = inputs(t, 2, 0, 50, 8, 2, 16, DType::F32, 63)?;
    let out = t.op(&FlashAttn::new(0.25)).forward(&q, &k, &v)?;
    assert_eq!(out.dims(), &[2, 0, 8, 16]);
    Ok(())
}
test_device!(sequence_lengths_zero_and_one, Decode);

/// NaN in one query row of one head makes exactly that row and its lse NaN, across splits.
fn nan_in_one_query_row_poisons_only_that_row(t: &Target) -> Result<()> {
    let (h, hk, d, sq, sk) = (32, 8, 64, 2, 2000);
    let (q, k, v) = inputs(t, 2, sq, sk, h, hk, d, DType::F32, 71)?;
    let mut qd = values(&q)?;
    let (bb, row, head) = (1, 1, 13);
    qd[((bb * sq + row) * h + head) * d + 5] = f64::NAN;
    let q = t.put(&Tensor::from_vec(qd, (2, sq, h, d), &Device::Cpu)?.to_dtype(DType::F32)?)?;
    let (out, lse) = t
        .op(&FlashAttn::new(scale(d)).causal())
        .forward_with_lse(&q, &k, &v)?;
    let (vals, lse) = (values(&out)?, values(&lse)?);
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
    Ok(())
}
test_device!(nan_in_one_query_row_poisons_only_that_row, Decode);

/// Keys left of the window are NaN in both K and V: a kernel that loads them and only masks the
/// score still gets 0 · NaN = NaN from V.
fn nan_in_keys_outside_the_window_is_never_read(t: &Target) -> Result<()> {
    let (b, sq, sk, h, hk, d) = (2, 2, 1500, 8, 2, 32);
    let (q, k, v) = inputs(t, b, sq, sk, h, hk, d, DType::F32, 81)?;
    let left = 300;
    let first_seen = sk - sq - left; // row 0's first visible key
    let poison = |x: &Tensor| -> Result<Tensor> {
        let mut x = values(x)?;
        for bi in 0..b {
            let at = bi * sk * hk * d;
            x[at..at + first_seen * hk * d].fill(f64::NAN);
        }
        t.put(&Tensor::from_vec(x, (b, sk, hk, d), &Device::Cpu)?.to_dtype(DType::F32)?)
    };
    let (kp, vp) = (poison(&k)?, poison(&v)?);
    let opts = FlashAttn::new(scale(d)).window(Some(left), Some(0));
    let (ref_out, _) = reference(&q, &k, &v, &opts)?;
    let out = t.op(&opts).forward(&q, &kp, &vp)?;
    let naive = candle_flash::naive_attention(&q, &k, &v, &t.op(&opts))?;
    assert_close("NaN outside the window", &out, &naive, &ref_out, true);
    Ok(())
}
test_cpu!(nan_in_keys_outside_the_window_is_never_read);

/// Scores around 1e4 with a single winner far from the other splits' maxima: the combine must
/// weight the other splits by exactly 0 and return the winner's V row.
fn one_winning_key_in_one_split(t: &Target) -> Result<()> {
    let (sq, sk, h, hk, d) = (1, 4000, 4, 1, 16);
    let (q, k, v) = inputs(t, 1, sq, sk, h, hk, d, DType::F32, 91)?;
    let mut kd = values(&k)?;
    let qd = values(&q)?;
    let winner = 2777;
    for x in 0..d {
        // Every query head is aligned with the winner; the others score around +-1e3.
        let s: f64 = (0..h).map(|hh| qd[hh * d + x]).sum();
        kd[winner * d + x] = 50.0 * s;
    }
    let k = t.put(&Tensor::from_vec(kd, (1, sk, hk, d), &Device::Cpu)?.to_dtype(DType::F32)?)?;
    let out = check_forward(t, "one winner", &q, &k, &v, &FlashAttn::new(10.0).causal())?;
    let vals = values(&out)?;
    let vrow = &values(&v)?[winner * d..][..d];
    for hh in 0..h {
        let o = &vals[hh * d..][..d];
        for (a, b) in o.iter().zip(vrow) {
            assert!((a - b).abs() < 1e-5, "head {hh}: {a} vs winner's {b}");
        }
    }
    Ok(())
}
test_device!(one_winning_key_in_one_split, Decode);

/// A split-KV call gives the same bits every time (fixed splits, fixed merge order): output and
/// lse, 50 runs on a GPU (3 under compute-sanitizer), 30 on the CPU. 20,000 keys on a GPU too
/// (many splits per wave of blocks); the CPU's split count follows its thread count, which 4,000
/// keys already exceed.
fn repeated_runs_are_bitwise_identical(t: &Target) -> Result<()> {
    let runs = match (t.is_cuda(), t.small()) {
        (true, false) => 50,
        (true, true) => 3,
        (false, _) => 30,
    };
    let cases: &[(DType, usize)] = match t.is_cuda() {
        true => &[
            (DType::F32, 4000),
            (DType::BF16, 4000),
            (DType::BF16, 20000),
        ],
        false => &[(DType::F32, 4000), (DType::BF16, 4000)],
    };
    for &(dtype, sk) in cases {
        let (q, k, v) = inputs(t, 1, 1, sk, 32, 8, 128, dtype, 101)?;
        let op = t.op(&FlashAttn::new(scale(128)).causal());
        let (o0, l0) = op.forward_with_lse(&q, &k, &v)?;
        let (o0, l0) = (bits(&o0)?, bits(&l0)?);
        for run in 1..runs {
            let (o, l) = op.forward_with_lse(&q, &k, &v)?;
            assert!(
                bits(&o)? == o0 && bits(&l)? == l0,
                "{dtype:?} sk {sk}: run {run} differs"
            );
        }
    }
    Ok(())
}
test_device!(repeated_runs_are_bitwise_identical, Decode);
