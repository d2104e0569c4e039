//! `merge_states` and ring attention over the in-process loopback ring, on the CPU (and, with
//! the `cuda` feature, the merge and the ring's ranks sharing one GPU): the merge
//! of two real partial attentions against the f64 golden attention over their union, its edge
//! rows against the formula in f64, and the ring's output, log-sum-exp and gradients with 1 to
//! 4 ranks against the single-device op and the f64 references; bad inputs error on every rank.

#[macro_use]
mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::ring::{self, Communicator, Loopback};
use candle_flash::{merge_states, naive_attention, FlashAttn};
use common::grad::{autograd, check_grads, reference_grads};
use common::*;

const CPU: Device = Device::Cpu;

/// Merge of attention over keys `0..split` with attention over keys `split..sk`, against the
/// f64 golden attention over all `sk` keys. `causal`: both parts are masked as the whole is
/// (bottom-right: with `sq > sk - split` the leading rows see none of the second part); with
/// `sq > sk` some rows see no key anywhere.
fn check_split(
    dev: &Device,
    dtype: DType,
    (b, sq, sk, h, hk, d): (usize, usize, usize, usize, usize, usize),
    split: usize,
    causal: bool,
    layout_views: bool,
) -> Result<()> {
    let what = format!(
        "merge {dtype:?} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} split {split} causal {causal} views \
         {layout_views}"
    );
    let seed = (sq * 1000 + sk * 10 + split) as u64;
    let q = randn(&[b, sq, h, d], dtype, seed, dev)?;
    let k = randn(&[b, sk, hk, d], dtype, seed + 1, dev)?;
    let v = randn(&[b, sk, hk, d], dtype, seed + 2, dev)?;
    let whole = if causal {
        FlashAttn::new(scale(d)).causal()
    } else {
        FlashAttn::new(scale(d))
    };
    // The prefix under the whole's mask: key j is visible to row i iff j <= i + sk - sq, which
    // is `sk - split` right of the prefix's own (bottom-right) diagonal.
    let first = match causal {
        true => FlashAttn::new(scale(d)).window(None, Some(sk - split)),
        false => FlashAttn::new(scale(d)),
    };
    let (o_a, l_a) =
        first.forward_with_lse(&q, &k.narrow(1, 0, split)?, &v.narrow(1, 0, split)?)?;
    let (o_b, l_b) = whole.forward_with_lse(
        &q,
        &k.narrow(1, split, sk - split)?,
        &v.narrow(1, split, sk - split)?,
    )?;
    let (o, lse) = if layout_views {
        // Non-contiguous operands: o as a (b, h, s, d) storage, lse as (b, s, h).
        let lse_view = |l: &Tensor| l.transpose(1, 2)?.contiguous()?.transpose(1, 2);
        merge_states(
            &transposed_view(&o_a)?,
            &lse_view(&l_a)?,
            &view_in_nan_buffer(&o_b)?,
            &lse_view(&l_b)?,
        )?
    } else {
        merge_states(&o_a, &l_a, &o_b, &l_b)?
    };
    assert!(
        o.is_contiguous() && lse.is_contiguous(),
        "{what}: outputs contiguous"
    );
    assert_eq!(o.dtype(), dtype);
    let (r_out, r_lse) = reference(&q, &k, &v, &whole)?;
    let naive = naive_attention(&q, &k, &v, &whole)?;
    assert_close(&what, &o, &naive, &r_out, true);
    check_lse(&what, &lse, &r_lse, dtype);
    Ok(())
}

fn merge_matches_reference(t: &Target) -> Result<()> {
    let dev = &t.dev;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Odd lengths and head dims, GQA 6/2 and MQA 4/1, a single key on one side.
        check_split(dev, dtype, (2, 7, 13, 6, 2, 24), 5, false, false)?;
        check_split(dev, dtype, (1, 9, 9, 4, 1, 40), 1, true, false)?;
        // Causal, more queries than suffix keys: leading rows see no suffix key (lse_b = -inf).
        check_split(dev, dtype, (3, 11, 17, 6, 6, 16), 7, true, true)?;
        // More queries than keys: the leading rows see no key at all (both -inf: o = 0).
        check_split(dev, dtype, (1, 19, 7, 2, 2, 8), 3, true, false)?;
    }
    Ok(())
}
test_device!(merge_matches_reference, Once);

/// Edge rows against the formula in f64: one side `-inf`, both `-inf`, NaN, far apart, equal.
fn merge_edge_rows(t: &Target) -> Result<()> {
    let dev = &t.dev;
    let inf = f32::INFINITY;
    let pairs = [
        (0.3f32, -inf),
        (-inf, 1.7),
        (-inf, -inf),
        (f32::NAN, 0.5),
        (2.0, f32::NAN),
        (80.0, -80.0),
        (-3.0, -3.0),
        (0.1, 0.2),
    ];
    let (n, h, d) = (pairs.len(), 1, 3);
    for dtype in [DType::F32, DType::BF16] {
        let o_a = randn(&[n, h, d], dtype, 7, dev)?;
        let o_b = randn(&[n, h, d], dtype, 8, dev)?;
        let la: Vec<f32> = pairs.iter().map(|p| p.0).collect();
        let lb: Vec<f32> = pairs.iter().map(|p| p.1).collect();
        // Varlen form: o (total_q, heads, d), lse (heads, total_q).
        let (l_a, l_b) = (
            Tensor::from_vec(la.clone(), (1, n), dev)?,
            Tensor::from_vec(lb.clone(), (1, n), dev)?,
        );
        let (o, lse) = merge_states(&o_a, &l_a, &o_b, &l_b)?;
        let (oa, ob, ov, lv) = (values(&o_a)?, values(&o_b)?, values(&o)?, values(&lse)?);
        for (i, (&x, &y)) in la.iter().zip(&lb).enumerate() {
            let (x, y) = (x as f64, y as f64);
            let m = x.max(y);
            let (want_l, wa, wb) = if x.is_nan() || y.is_nan() {
                (f64::NAN, f64::NAN, f64::NAN)
            } else if m == f64::NEG_INFINITY {
                (m, 0.0, 0.0)
            } else {
                let l = m + ((x - m).exp() + (y - m).exp()).ln();
                ((l), (x - l).exp(), (y - l).exp())
            };
            let got_l = lv[i];
            assert!(
                (got_l.is_nan() && want_l.is_nan())
                    || got_l == want_l
                    || (got_l - want_l).abs() < 1e-6,
                "lse of pair {i}: {got_l} vs {want_l}"
            );
            for x in 0..d {
                let j = i * d + x;
                let want = wa * oa[j] * f64::from(wa != 0.0) + wb * ob[j] * f64::from(wb != 0.0);
                let want = if wa.is_nan() { f64::NAN } else { want };
                let got = ov[j];
                let tol = if dtype == DType::F32 { 1e-6 } else { 8e-3 } * want.abs().max(1.0);
                assert!(
                    (got.is_nan() && want.is_nan()) || (got - want).abs() <= tol,
                    "{dtype:?} o of pair {i} elem {x}: {got} vs {want}"
                );
            }
        }
        // A side at -inf gives the other side exactly.
        let row = |t: &Tensor, i: usize| t.narrow(0, i, 1);
        assert_bitwise_eq("lse_b = -inf", &row(&o, 0)?, &row(&o_a, 0)?);
        assert_bitwise_eq("lse_a = -inf", &row(&o, 1)?, &row(&o_b, 1)?);
        assert!(
            values(&row(&o, 2)?)?.iter().all(|&x| x == 0.0),
            "both -inf: 0"
        );
    }
    Ok(())
}

test_device!(merge_edge_rows, Once);

#[test]
fn merge_bad_inputs() -> Result<()> {
    let o = Tensor::zeros((2, 5, 4, 8), DType::F32, &CPU)?;
    let l = Tensor::zeros((2, 4, 5), DType::F32, &CPU)?;
    let err = |r: Result<(Tensor, Tensor)>, name: &str| {
        let e = r.expect_err(name).to_string();
        assert!(e.contains(name), "error for {name} does not name it: {e}");
    };
    err(merge_states(&o, &l, &o.narrow(1, 0, 4)?, &l), "o_b");
    err(merge_states(&o, &l, &o.to_dtype(DType::F16)?, &l), "o_b");
    err(merge_states(&o, &l.narrow(2, 0, 4)?, &o, &l), "lse_a");
    err(merge_states(&o, &l, &o, &l.to_dtype(DType::BF16)?), "lse_b");
    err(merge_states(&o, &l, &o, &l.transpose(1, 2)?), "lse_b");
    err(merge_states(&o.to_dtype(DType::U32)?, &l, &o, &l), "o_a");
    err(merge_states(&o.flatten_all()?, &l, &o, &l), "o_a");
    // Empty rows: empty outputs, no error.
    let (e, el) = merge_states(
        &o.narrow(1, 0, 0)?,
        &l.narrow(2, 0, 0)?,
        &o.narrow(1, 0, 0)?,
        &l.narrow(2, 0, 0)?,
    )?;
    assert_eq!((e.dims(), el.dims()), (&[2, 0, 4, 8][..], &[2, 4, 0][..]));
    Ok(())
}

/// One rank's results.
type RankOut = (Tensor, Tensor, Tensor, Tensor, Tensor);

/// Runs ring forward then backward on `world` loopback ranks, each on its zigzag shard of q, k,
/// v and g; returns each rank's (out, lse, dq, dk, dv) or error, in rank order.
fn run_ring(world: usize, op: &FlashAttn, [q, k, v, g]: [&Tensor; 4]) -> Vec<Result<RankOut>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = Loopback::ring(world)
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || -> Result<RankOut> {
                    let r = comm.rank();
                    let shard = |t: &Tensor| ring::zigzag_shard(t, 1, r, world);
                    let (q, k, v, g) = (shard(q)?, shard(k)?, shard(v)?, shard(g)?);
                    let (out, lse) = ring::ring_attention_forward(&mut comm, op, &q, &k, &v)?;
                    let (dq, dk, dv) =
                        ring::ring_attention_backward(&mut comm, op, &q, &k, &v, &out, &g, &lse)?;
                    Ok((out, lse, dq, dk, dv))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

fn check_ring(
    dev: &Device,
    world: usize,
    dtype: DType,
    (b, s, h, hk, d): (usize, usize, usize, usize, usize),
    op: FlashAttn,
) -> Result<()> {
    let what = format!(
        "ring W{world} {dtype:?} b{b} s{s} h{h}/{hk} d{d} window {:?}/{:?} softcap {:?}",
        op.window_size_left, op.window_size_right, op.softcap
    );
    let seed = (world * 100 + s) as u64;
    let q = randn(&[b, s, h, d], dtype, seed, dev)?;
    let k = randn(&[b, s, hk, d], dtype, seed + 1, dev)?;
    let v = randn(&[b, s, hk, d], dtype, seed + 2, dev)?;
    let g = randn(&[b, s, h, d], dtype, seed + 3, dev)?;
    let ranks = run_ring(world, &op, [&q, &k, &v, &g])
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let gather = |f: fn(&RankOut) -> &Tensor, dim: usize| {
        ring::zigzag_unshard(&ranks.iter().map(|r| f(r).clone()).collect::<Vec<_>>(), dim)
    };
    let out = gather(|r| &r.0, 1)?;
    let lse = gather(|r| &r.1, 2)?;
    let grads = (
        gather(|r| &r.2, 1)?,
        gather(|r| &r.3, 1)?,
        gather(|r| &r.4, 1)?,
    );

    // Against the f64 golden attention and gradients, with the naive op as the yardstick.
    let (r_out, r_lse) = reference(&q, &k, &v, &op)?;
    let naive = naive_attention(&q, &k, &v, &op)?;
    assert_close(&format!("{what} out"), &out, &naive, &r_out, true);
    check_lse(&format!("{what} lse"), &lse, &r_lse, dtype);
    let r_grads = reference_grads(&q, &k, &v, &g, &op)?;
    let naive_grads = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &op))?;
    check_grads(&what, &grads, &naive_grads, &r_grads, [&q, &k, &v]);

    // Against the single-device op: the same numbers up to the merge's rounding.
    let (o1, l1) = op.forward_with_lse(&q, &k, &v)?;
    let (dq1, dk1, dv1) = op.backward(&q, &k, &v, &o1, &g, &l1)?;
    let rel = if dtype == DType::F32 { 2e-5 } else { 2e-2 };
    for (name, a, b) in [
        ("out", &out, &o1),
        ("lse", &lse, &l1),
        ("dq", &grads.0, &dq1),
        ("dk", &grads.1, &dk1),
        ("dv", &grads.2, &dv1),
    ] {
        let (x, y) = (values(a)?, values(b)?);
        let sc = scale_of(&y).max(1.0);
        let err = max_abs_err_slice(&x, &y).unwrap_or_else(|| panic!("{what} {name}: non-finite"));
        assert!(
            err <= rel * sc,
            "{what} {name}: ring vs single device {err:.3e} > {:.3e}",
            rel * sc
        );
    }
    Ok(())
}

#[test]
fn ring_matches_single_device_and_reference() -> Result<()> {
    for world in 1..=4 {
        // Chunks of 3 rows: odd lengths; GQA 6/2; head dim not a power of two.
        let s = 2 * world * 3;
        check_ring(
            &CPU,
            world,
            DType::F32,
            (2, s, 6, 2, 24),
            FlashAttn::new(scale(24)).causal(),
        )?;
        check_ring(
            &CPU,
            world,
            DType::F32,
            (2, s, 6, 2, 24),
            FlashAttn::new(scale(24)),
        )?;
    }
    // Longer chunks, MQA, softcap, low precision.
    check_ring(
        &CPU,
        3,
        DType::F32,
        (1, 6 * 11, 4, 1, 16),
        FlashAttn::new(0.4).causal().softcap(2.5),
    )?;
    check_ring(
        &CPU,
        2,
        DType::BF16,
        (1, 4 * 9, 4, 2, 32),
        FlashAttn::new(scale(32)).causal(),
    )?;
    check_ring(
        &CPU,
        4,
        DType::F16,
        (1, 8 * 5, 2, 2, 16),
        FlashAttn::new(scale(16)),
    )?;
    Ok(())
}

/// The ring on one GPU: loopback ranks as threads sharing GPU 0, against the single-GPU op and
/// the f64 references. Fails (never skips) when the feature is on and no GPU answers.
#[cfg(feature = "cuda")]
#[test]
fn ring_on_cuda_matches_single_device_and_reference() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    for world in [1, 2, 3] {
        let s = 2 * world * 37;
        for op in [
            FlashAttn::new(scale(64)).causal(),
            FlashAttn::new(scale(64)),
        ] {
            check_ring(&gpu, world, DType::BF16, (2, s, 8, 2, 64), op.clone())?;
            check_ring(&gpu, world, DType::F32, (1, s, 4, 4, 40), op)?;
        }
    }
    check_ring(
        &gpu,
        4,
        DType::F16,
        (1, 8 * 33, 6, 2, 128),
        FlashAttn::new(0.1).causal().softcap(5.0),
    )?;
    Ok(())
}

#[test]
fn zigzag_mapping_round_trips() -> Result<()> {
    for world in 1..=4 {
        let s = 2 * world * 3;
        for p in 0..s {
            let (r, row) = ring::zigzag_local(p, s, world)?;
            assert_eq!(ring::zigzag_global(r, row, s, world)?, p);
        }
        let x = Tensor::arange(0u32, s as u32, &CPU)?.reshape((1, s))?;
        let shards: Vec<Tensor> = (0..world)
            .map(|r| ring::zigzag_shard(&x, 1, r, world))
            .collect::<Result<_>>()?;
        for (r, sh) in shards.iter().enumerate() {
            for (row, p) in sh.flatten_all()?.to_vec1::<u32>()?.into_iter().enumerate() {
                assert_eq!(ring::zigzag_global(r, row, s, world)?, p as usize);
            }
        }
        assert_eq!(
            ring::zigzag_unshard(&shards, 1)?
                .flatten_all()?
                .to_vec1::<u32>()?,
            (0..s as u32).collect::<Vec<_>>()
        );
    }
    assert!(ring::zigzag_shard(&Tensor::zeros((1, 10), DType::F32, &CPU)?, 1, 0, 3).is_err());
    Ok(())
}

/// One rank's op and q from its rank and the shared q.
type RankCall<'a> = dyn Fn(usize, &Tensor) -> Result<(FlashAttn, Tensor)> + Sync + 'a;

/// Every rank returns an error (none hangs) when the ranks disagree or one fails alone.
#[test]
fn ring_bad_inputs_fail_every_rank() -> Result<()> {
    let world = 3;
    let (b, c, h, d) = (1, 2, 2, 8);
    let s = 2 * c;
    let t = |seed| randn(&[b, s, h, d], DType::F32, seed, &CPU);
    let (q, k, v) = (t(1)?, t(2)?, t(3)?);
    let op = FlashAttn::new(0.3).causal();
    // Each rank's call; `bad` changes rank 1's.
    let run = |bad: &RankCall<'_>| -> Vec<String> {
        let (q, k, v) = (&q, &k, &v);
        std::thread::scope(|sc| {
            let hs: Vec<_> = Loopback::ring(world)
                .into_iter()
                .map(|mut comm| {
                    sc.spawn(move || {
                        let (op_r, q_r) = bad(comm.rank(), q)?;
                        ring::ring_attention_forward(&mut comm, &op_r, &q_r, k, v).map(|_| ())
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .expect("a rank panicked")
                        .expect_err("a rank succeeded")
                        .to_string()
                })
                .collect()
        })
    };
    // Rank 1's q is longer (which it could attend alone without a mask): every rank sees the
    // disagreement and names the shapes.
    let errs = run(&|r, q| {
        let q = if r == 1 {
            Tensor::cat(&[q, q], 1)?
        } else {
            q.clone()
        };
        Ok((FlashAttn::new(0.3), q))
    });
    for (r, e) in errs.iter().enumerate() {
        assert!(e.contains("disagree") && e.contains("q ["), "rank {r}: {e}");
    }
    // Rank 1 alone uses a sliding window: it refuses, the others stop naming it.
    let errs = run(&|r, q| {
        let o = if r == 1 {
            op.clone().window(Some(2), Some(0))
        } else {
            op.clone()
        };
        Ok((o, q.clone()))
    });
    assert!(errs[1].contains("window"), "{}", errs[1]);
    for r in [0, 2] {
        assert!(
            errs[r].contains("rank 1 failed") && errs[r].contains("window"),
            "rank {r}: {}",
            errs[r]
        );
    }
    // A mismatched dtype on one rank.
    let errs = run(&|r, q| {
        Ok((
            op.clone(),
            if r == 2 {
                q.to_dtype(DType::F16)?
            } else {
                q.clone()
            },
        ))
    });
    assert!(
        errs.iter()
            .all(|e| e.contains("failed") || e.contains("disagree") || e.contains("dtype")),
        "{errs:?}"
    );
    Ok(())
}
