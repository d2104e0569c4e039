//! The forward pass against the f64 golden reference (tests/common), over the shapes, options,
//! layouts and numerics that find attention bugs: every property runs on the CPU (`::cpu`) and,
//! with the `cuda` feature, on the GPU in each forward configuration (`::cuda`, see
//! tests/common/device.rs).
//!
//! ```text
//! cargo test --release --test forward
//! cargo test --release --features cuda --test forward -- ::cuda
//! ```

#[macro_use]
mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{naive_attention, FlashAttn, PlanOverride};
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Odd lengths both ways, causal or not: one row or key, lengths one off the 64-row and 64-key
/// tiles, more queries than keys and the reverse.
fn odd_lengths_both_ways(t: &Target) -> Result<()> {
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
            let c = Case::new(2, sq, sk, 4, 2, 64, DType::F32);
            let c = if causal { c.causal() } else { c };
            c.check(t, n as u64)?;
        }
    }
    Ok(())
}
test_device!(odd_lengths_both_ways, Forward);

/// Around 1024 both ways: many query and key tiles, a partial last tile.
fn long_sequences(t: &Target) -> Result<()> {
    for (sq, sk) in [(1023, 1024), (1025, 1025), (1024, 1023)] {
        for causal in [false, true] {
            let c = Case::new(1, sq, sk, 2, 1, 32, DType::F32);
            let c = if causal { c.causal() } else { c };
            c.check(t, 7)?;
        }
    }
    Ok(())
}
test_device!(long_sequences, Forward);

/// Every head dim class (powers of two and not, above 128) in every dtype; head dims that are
/// not multiples of 8 too.
fn head_dims_and_dtypes(t: &Target) -> Result<()> {
    for d in [8, 24, 40, 64, 80, 96, 128, 160, 256] {
        for dtype in DTYPES {
            let c = Case::new(1, 37, 71, 3, 3, d, dtype);
            c.check(t, d as u64)?;
            c.causal().check(t, d as u64 + 1)?;
        }
    }
    for d in [1, 3, 13, 100] {
        Case::new(2, 9, 11, 2, 1, d, DType::F32).check(t, 5)?;
    }
    Ok(())
}
test_device!(head_dims_and_dtypes, Forward);

/// Six query heads over 6, 3, 2 and 1 K/V heads (MQA alone cannot catch a wrong GQA mapping).
fn gqa_and_mqa(t: &Target) -> Result<()> {
    for hk in [6, 3, 2, 1] {
        for dtype in DTYPES {
            Case::new(3, 29, 45, 6, hk, 40, dtype)
                .causal()
                .check(t, hk as u64)?;
        }
    }
    Ok(())
}
test_device!(gqa_and_mqa, Forward);

/// The cases of [`parity_matrix`]: length pairs around the tile sizes of every kernel (32 to 176
/// keys, 64 to 192 rows) crossed with head dims, along the diagonal of (pair, head dim) so each
/// pair meets every head dim and heads (6 over 6, 2, 1), batches (1, 4, 9), masks and modifiers
/// cycle through all their values. The CUDA kernels are instantiated per head-dim class (on
/// Hopper per head dim), so a GPU walks every head dim and the long pairs; the CPU kernel runs
/// one code path for every head dim (`head_dims_and_dtypes` walks them, `long_sequences` the
/// long pairs) and takes every fourth (24, 96, 160), each pair in one dtype (`Target::sweep`),
/// which keeps its f64 references to a second or two.
fn matrix(t: &Target) -> Vec<Case> {
    let pairs: &[(usize, usize)] = if t.small() {
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
    let dims: &[usize] = if t.small() {
        &[40, 64, 128]
    } else {
        &[24, 40, 64, 80, 96, 128, 256, 33, 160, 192, 224, 8]
    };
    let heads = [(6, 6), (6, 2), (6, 1)];
    let mut cases = Vec::new();
    for (i, &(sq, sk)) in pairs.iter().enumerate() {
        for (j, &d) in dims.iter().enumerate() {
            let n = i * dims.len() + j;
            let keep = match t.is_cuda() {
                // Long pairs: a third of the head dims keep the f64 reference quick.
                true => sq < 1000 || j % 3 == 0,
                false => sq < 1000 && j % 4 == 0,
            };
            if !keep {
                continue;
            }
            for &dtype in t.sweep(&[DType::BF16, DType::F16, DType::F32], i) {
                let (h, hk) = heads[n % 3];
                let mods = (n / 3) % 4;
                let b = if sq * sk > 100_000 {
                    1
                } else {
                    [1, 4, 9][(n / 2) % 3]
                };
                let c = Case::new(b, sq, sk, h, hk, d, dtype);
                let c = match (n + dtype.size_in_bytes()) % 5 {
                    0 => c,
                    1 | 4 => c.causal(),
                    2 => c.window(Some(37), Some(5)),
                    _ => c.window(Some(64), None),
                };
                let c = if mods & 1 == 1 { c.softcap(2.5) } else { c };
                cases.push(if mods & 2 == 2 { c.alibi() } else { c });
            }
        }
    }
    cases
}

/// The matrix of shapes, head dims, heads, masks and modifiers of [`matrix`].
fn parity_matrix(t: &Target) -> Result<()> {
    let cases = matrix(t);
    for (i, c) in cases.iter().enumerate() {
        c.check(t, 1000 + i as u64)?;
    }
    eprintln!("{} parity cases passed", cases.len());
    Ok(())
}
test_device!(parity_matrix, Forward);

/// Sliding windows of every kind: zero-width, one-sided, wider than the sequences, near
/// `usize::MAX` (no overflow in the bounds).
fn windows(t: &Target) -> Result<()> {
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
            Case::new(2, sq, sk, 4, 2, 24, DType::F32)
                .window(l, r)
                .check(t, n as u64)?;
        }
    }
    Ok(())
}
test_device!(windows, Forward);

/// ALiBi (per head and per sequence) and softcap, alone and with each other and a window;
/// softcap 0 means off, as upstream.
fn alibi_and_softcap(t: &Target) -> Result<()> {
    let slopes_h = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu)?;
    let slopes_bh = batch_slopes(2, 4, 3, 1.0);
    for dtype in DTYPES {
        let c = Case::new(2, 45, 77, 4, 2, 40, dtype);
        let s = scale(40);
        for (n, opts) in [
            FlashAttn::new(s).alibi(&slopes_h),
            FlashAttn::new(s).alibi(&slopes_bh).causal(),
            FlashAttn::new(s).softcap(2.0),
            FlashAttn::new(1.0).softcap(5.0).causal(),
            FlashAttn::new(s)
                .softcap(3.0)
                .alibi(&slopes_h)
                .window(Some(11), Some(4)),
            FlashAttn::new(s).softcap(0.0),
        ]
        .into_iter()
        .enumerate()
        {
            c.clone().with(opts).check(t, n as u64 + 1)?;
        }
    }
    Ok(())
}
test_device!(alibi_and_softcap, Forward);

/// Causal with more queries than keys: the leading rows see no key, so their output is exactly 0
/// (also under ALiBi) and their lse `-inf`; a window entirely outside the keys masks rows too.
fn causal_with_more_queries_than_keys_gives_zero_rows(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        for c in [
            Case::new(2, 50, 20, 4, 4, 32, dtype).causal(),
            Case::new(2, 150, 40, 6, 2, 64, dtype).causal().alibi(),
        ] {
            let out = c.check(t, 11)?;
            let lead = values(&out.narrow(1, 0, c.sq - c.sk)?)?;
            assert!(
                lead.iter().all(|&x| x == 0.0),
                "{c:?}: rows that see no key must be exactly 0"
            );
        }
    }
    let c = Case::new(1, 10, 3, 2, 2, 8, DType::BF16)
        .with(FlashAttn::new(1.0).window(Some(0), Some(0)));
    let out = c.check(t, 12)?;
    assert!(values(&out.i((.., 0..7))?)?.iter().all(|&x| x == 0.0));
    Ok(())
}
test_device!(causal_with_more_queries_than_keys_gives_zero_rows, Forward);

/// Every non-contiguous layout (transposed storage, views in NaN guard bands at an offset, k and
/// v laid out differently, a strided head dim, broadcast k and v) gives bitwise the output of
/// the contiguous call, which itself matches the reference.
fn non_contiguous_layouts_are_bitwise_equal(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        for c in [
            Case::new(2, 37, 53, 6, 2, 40, dtype),
            Case::new(2, 37, 53, 6, 2, 40, dtype).causal(),
            Case::new(2, 77, 150, 6, 2, 64, dtype).causal(),
            Case::new(2, 77, 150, 6, 2, 128, dtype).window(Some(50), Some(0)),
        ] {
            let base = c.check(t, 21)?;
            let (q, k, v) = c.inputs(t, 21)?;
            let op = t.op(&c.opts);
            for layout in Layout::VIEWS {
                let (q2, k2, v2) = layout.apply(&q, &k, &v)?;
                assert!(!(q2.is_contiguous() && k2.is_contiguous() && v2.is_contiguous()));
                let want = match layout {
                    // Other values: against the same values stored contiguously.
                    Layout::BroadcastKv => op.forward(&q2, &k2.contiguous()?, &v2.contiguous()?)?,
                    _ => base.clone(),
                };
                let got = op.forward(&q2, &k2, &v2)?;
                assert_bitwise_eq(
                    &format!("{c:?}: {layout:?} against contiguous"),
                    &got,
                    &want,
                );
            }
        }
    }
    Ok(())
}
test_device!(non_contiguous_layouts_are_bitwise_equal, Forward);

/// Packed varlen batches against the reference: sequences without queries, without keys, of one
/// query, longer than a tile either way; every mask and modifier, per-sequence ALiBi slopes.
fn varlen_matches_reference(t: &Target) -> Result<()> {
    let short = Ragged::new(&[(5, 7), (0, 3), (17, 17), (1, 40), (64, 65)]);
    let slopes = Tensor::new(&[0.3f32, 0.1, 0.05, 0.01], &Device::Cpu)?;
    let slopes_bh = batch_slopes(5, 4, 44, 1.0);
    let ragged = Ragged::standard(t);
    let slopes6 = head_slopes(6);
    for dtype in DTYPES {
        // Four heads over two, d 24: every option.
        for opts in [
            FlashAttn::new(0.2),
            FlashAttn::new(0.2).causal(),
            FlashAttn::new(0.2).causal().alibi(&slopes_bh),
            FlashAttn::new(0.2)
                .window(Some(4), Some(2))
                .alibi(&slopes)
                .softcap(4.0),
        ] {
            let q = randn(&[short.total_q, 4, 24], dtype, 41, &t.dev)?;
            let k = randn(&[short.total_k, 2, 24], dtype, 42, &t.dev)?;
            let v = randn(&[short.total_k, 2, 24], dtype, 43, &t.dev)?;
            check_varlen(
                t,
                &format!("varlen {dtype:?} {opts:?}"),
                &short,
                &q,
                &k,
                &v,
                &opts,
            )?;
        }
        // Six heads over two on the ragged batch, the head dims of the tensor-core kernels.
        for (d, opts) in [
            (64, FlashAttn::new(scale(64)).causal()),
            (96, FlashAttn::new(scale(96)).alibi(&slopes6)),
            (40, FlashAttn::new(scale(40)).window(Some(20), Some(3))),
        ] {
            let q = randn(&[ragged.total_q, 6, d], dtype, 5, &t.dev)?;
            let k = randn(&[ragged.total_k, 2, d], dtype, 6, &t.dev)?;
            let v = randn(&[ragged.total_k, 2, d], dtype, 7, &t.dev)?;
            let what = format!("ragged varlen {dtype:?} d {d} {opts:?}");
            check_varlen(t, &what, &ragged, &q, &k, &v, &opts)?;
        }
    }
    Ok(())
}
test_device!(varlen_matches_reference, Forward);

/// The public functions give bitwise the result of the options-struct call they wrap (dense and
/// varlen). They take no kernel configuration, so neither does the call they are compared with.
fn public_functions_match_the_op(t: &Target) -> Result<()> {
    let c = Case::new(2, 33, 47, 4, 2, 32, DType::BF16);
    let (q, k, v) = c.inputs(t, 51)?;
    let slopes = t.put(&Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu)?)?;
    let same = |a: Tensor, b: Tensor| assert_bitwise_eq("public function against the op", &a, &b);
    let s = 0.17;
    same(
        candle_flash::flash_attn(&q, &k, &v, s, true)?,
        FlashAttn::new(s).causal().forward(&q, &k, &v)?,
    );
    same(
        candle_flash::flash_attn_windowed(&q, &k, &v, s, Some(3), Some(2))?,
        FlashAttn::new(s)
            .window(Some(3), Some(2))
            .forward(&q, &k, &v)?,
    );
    same(
        candle_flash::flash_attn_alibi(&q, &k, &v, &slopes, s, false)?,
        FlashAttn::new(s).alibi(&slopes).forward(&q, &k, &v)?,
    );
    same(
        candle_flash::flash_attn_alibi_windowed(&q, &k, &v, &slopes, s, Some(8), None)?,
        FlashAttn::new(s)
            .alibi(&slopes)
            .window(Some(8), None)
            .forward(&q, &k, &v)?,
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
        )?,
        FlashAttn::new(s)
            .alibi(&slopes)
            .causal()
            .softcap(2.5)
            .forward(&q, &k, &v)?,
    );
    // Varlen, with an empty sequence.
    let r = Ragged::new(&[(5, 7), (0, 3), (17, 17), (1, 40), (64, 65)]);
    let (cq, ck) = r.tensors(t)?;
    let q = randn(&[r.total_q, 4, 24], DType::F16, 41, &t.dev)?;
    let k = randn(&[r.total_k, 2, 24], DType::F16, 42, &t.dev)?;
    let v = randn(&[r.total_k, 2, 24], DType::F16, 43, &t.dev)?;
    for causal in [false, true] {
        same(
            candle_flash::flash_attn_varlen(&q, &k, &v, &cq, &ck, 64, 65, 0.2, causal)?,
            FlashAttn::new(0.2)
                .window(None, causal.then_some(0))
                .forward_varlen(&q, &k, &v, &cq, &ck, 64, 65)?,
        );
    }
    Ok(())
}
test_device!(public_functions_match_the_op, Once);

/// Planted numerics: scores around 1e4 with one winner (the output is exactly that key's value
/// row), all scores equal and large (the mean of V, no 0/0), q = k = v large (scores far beyond
/// exp's range: no NaN or Inf).
fn planted_numerics(t: &Target) -> Result<()> {
    let cpu = &Device::Cpu;
    let (wq, wk, wv, winner) = planted_winner()?;
    for dtype in DTYPES {
        let put = |x: &Tensor| t.put(&x.to_dtype(dtype)?);
        let (q, k, v) = (put(&wq)?, put(&wk)?, put(&wv)?);
        let out = t.op(&FlashAttn::new(1.0)).forward(&q, &k, &v)?;
        let want = v.i((0, winner, 0))?;
        for i in 0..q.dim(1)? {
            assert_bitwise_eq(
                &format!("{dtype:?}: winner row {i}"),
                &out.i((0, i, 0))?,
                &want,
            );
        }
        for sk in [100, 300] {
            let q = t.put(&Tensor::full(30f32, (1, 3, 1, 8), cpu)?.to_dtype(dtype)?)?;
            let k = t.put(&Tensor::full(30f32, (1, sk, 1, 8), cpu)?.to_dtype(dtype)?)?;
            let v = randn(&[1, sk, 1, 8], dtype, 62, &t.dev)?;
            let what = format!("equal large scores {dtype:?} sk {sk}");
            check_forward(t, &what, &q, &k, &v, &FlashAttn::new(1.0))?;
        }
    }
    // (dtype, magnitude, shape)
    let big = [
        (DType::F32, 30.0, [1, 64, 2, 64]),
        (DType::F16, 30.0, [1, 64, 2, 64]),
        (DType::BF16, 30.0, [1, 64, 2, 64]),
        (DType::BF16, 200.0, [1, 40, 2, 64]),
    ];
    for (dtype, mag, shape) in big {
        let x = t.put(&(randn(&shape, DType::F32, 63, cpu)? * mag)?.to_dtype(dtype)?)?;
        for opts in [FlashAttn::new(1.0), FlashAttn::new(1.0).causal()] {
            let o = values(&t.op(&opts).forward(&x, &x, &x)?)?;
            assert!(
                o.iter().all(|x| x.is_finite()),
                "{dtype:?} x{mag} {opts:?}: large q = k = v gave non-finite output"
            );
        }
    }
    Ok(())
}
test_device!(planted_numerics, Forward);

/// NaN in one element of one query row makes exactly that row (of that head) NaN.
fn nan_in_one_query_row_poisons_only_that_row(t: &Target) -> Result<()> {
    let c = Case::new(1, 20, 30, 2, 1, 16, DType::F32);
    let (q, k, v) = c.inputs(t, 71)?;
    let mut qd = values(&q)?;
    let (row, head) = (7, 1);
    qd[(row * 2 + head) * 16 + 3] = f64::NAN;
    let q = t.put(&Tensor::from_vec(qd, (1, 20, 2, 16), &Device::Cpu)?.to_dtype(DType::F32)?)?;
    let vals = values(&t.op(&FlashAttn::new(0.25)).forward(&q, &k, &v)?)?;
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
    Ok(())
}
test_device!(nan_in_one_query_row_poisons_only_that_row, Forward);

/// NaN and infinity in the K and V of keys that some rows do not see (in tiles the mask cuts
/// through, where those keys' probabilities are 0 and 0 · NaN = NaN) reach exactly the rows that
/// see them, as in the reference, which leaves unseen keys out.
fn non_finite_keys_reach_only_the_rows_that_see_them(t: &Target) -> Result<()> {
    for (dtype, opts) in [
        (DType::F32, FlashAttn::new(0.2).causal()),
        (DType::BF16, FlashAttn::new(0.2).causal()),
        (DType::F32, FlashAttn::new(0.2).window(Some(20), Some(5))),
    ] {
        let c = Case::new(1, 150, 150, 2, 1, 40, dtype);
        let (q, k, v) = c.inputs(t, 81)?;
        // (key, value): keys in the middle of tiles and at a tile's first key.
        let plant = |x: &Tensor, at: &[(usize, f32)]| -> Result<Tensor> {
            let mut x = values(x)?;
            for &(key, val) in at {
                x[key * 40..(key + 1) * 40].fill(val as f64);
            }
            t.put(&Tensor::from_vec(x, (1, 150, 1, 40), &Device::Cpu)?.to_dtype(dtype)?)
        };
        let k = plant(&k, &[(64, f32::NAN), (90, f32::INFINITY)])?;
        let v = plant(
            &v,
            &[(100, f32::NAN), (37, f32::NEG_INFINITY), (128, f32::NAN)],
        )?;
        let what = format!("{dtype:?} {opts:?}");
        let out = t.op(&opts).forward(&q, &k, &v)?;
        let (want, _) = reference(&q, &k, &v, &opts)?;
        let finite_rows = want.chunks(40).filter(|r| r[0].is_finite()).count();
        assert!(
            finite_rows > 20 && finite_rows < 300,
            "{what}: the planted keys should poison some rows and spare others ({finite_rows})"
        );
        let got = values(&out)?;
        let err = max_abs_err_slice(&got, &want).unwrap_or_else(|| {
            panic!(
                "{what}: non-finite where the reference is not, or back ({}; rows of 40 values, \
                 heads interleaved)",
                first_non_finite_disagreement(&got, &want)
            )
        });
        let cap = tolerances(dtype).2;
        assert!(err <= cap, "{what}: max abs err {err:.3e} > {cap:.1e}");
    }
    Ok(())
}
test_cpu!(non_finite_keys_reach_only_the_rows_that_see_them);

/// Operands with no element: batch 0 and seq_q 0 give empty outputs and lse (without allocating
/// the other dimensions: 2^37 elements would not fit); seq_k 0 gives zeros and lse `-inf`, as
/// does the naive path.
fn empty_inputs(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        let kv = randn(&[2, 9, 2, 64], dtype, 8, &t.dev)?;
        for (q, causal) in [
            (empty(&[0, 4, 2, 64], dtype, &t.dev)?, true),
            (empty(&[2, 0, 4, 64], dtype, &t.dev)?, false),
        ] {
            let kv = kv.narrow(0, 0, q.dim(0)?)?;
            let opts = FlashAttn::new(0.125).window(None, causal.then_some(0));
            let (out, lse) = t.op(&opts).forward_with_lse(&q, &kv, &kv)?;
            assert_eq!(out.dims(), q.dims(), "{dtype:?}");
            assert_eq!(lse.dims(), &[q.dim(0)?, q.dim(2)?, q.dim(1)?], "{dtype:?}");
        }
        let q = randn(&[2, 3, 2, 8], dtype, 81, &t.dev)?;
        let kv = empty(&[2, 0, 1, 8], dtype, &t.dev)?;
        let opts = t.op(&FlashAttn::new(1.0));
        let (out, lse) = opts.forward_with_lse(&q, &kv, &kv)?;
        assert_eq!(out.dims(), &[2, 3, 2, 8]);
        assert!(values(&out)?.iter().all(|&x| x == 0.0), "{dtype:?}: out");
        assert!(values(&lse)?.iter().all(|&x| x == f64::NEG_INFINITY));
        let naive = naive_attention(&q, &kv, &kv, &opts)?;
        assert_eq!(naive.dims(), &[2, 3, 2, 8]);
    }
    let big = empty(&[0, 1 << 20, 256, 512], DType::F32, &t.dev)?;
    let (out, lse) = t
        .op(&FlashAttn::new(1.0))
        .forward_with_lse(&big, &big, &big)?;
    assert_eq!(out.dims(), &[0, 1 << 20, 256, 512]);
    assert_eq!(lse.dims(), &[0, 256, 1 << 20]);
    Ok(())
}
test_device!(empty_inputs, Forward);

/// Repeated calls give the same bits, output and lse. On a GPU a long call (many blocks, the
/// persistent scheduler's order) run 100 times; the CPU's work split depends on the shape and the
/// thread count only (`same_bits_on_any_thread_count`), and a shorter call run 10 times keeps its
/// share of the suite's time.
fn repeated_runs_are_bitwise_identical(t: &Target) -> Result<()> {
    let (runs, sq, sk) = match (t.is_cuda(), t.small()) {
        (true, false) => (100, 1000, 1000),
        (true, true) => (3, 300, 333),
        (false, _) => (10, 300, 333),
    };
    for dtype in [DType::BF16, DType::F32] {
        let c = Case::new(2, sq, sk, 6, 2, 128, dtype).causal();
        let (q, k, v) = c.inputs(t, 9)?;
        let op = t.op(&c.opts);
        let (o0, l0) = op.forward_with_lse(&q, &k, &v)?;
        let (b0, lb0) = (bits(&o0)?, bits(&l0)?);
        for run in 1..runs {
            let (o, l) = op.forward_with_lse(&q, &k, &v)?;
            assert!(
                bits(&o)? == b0 && bits(&l)? == lb0,
                "{c:?}: run {run} differs from run 0"
            );
        }
    }
    Ok(())
}
test_device!(repeated_runs_are_bitwise_identical, Forward);

/// The CPU's output bits do not depend on the thread count, which sets how many query tiles share
/// a work item, also under windows (the first key a work item sees moves with its size) and with
/// varlen sequences of every length class. (CPU only: rayon's thread count.)
#[test]
fn same_bits_on_any_thread_count() {
    let dev = Device::Cpu;
    let r = Ragged::new(&[(3, 200), (130, 129), (0, 7), (64, 65), (300, 310)]);
    let q = randn(&[r.total_q, 6, 24], DType::F32, 1, &dev).unwrap();
    let k = randn(&[r.total_k, 2, 24], DType::F32, 2, &dev).unwrap();
    let v = randn(&[r.total_k, 2, 24], DType::F32, 3, &dev).unwrap();
    let (cq, ck) = r.tensors(&Target::cpu()).unwrap();
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

/// The kernel options are CUDA choices: on the CPU `portable`, every plan override and
/// `deterministic` leave the forward output, its lse and the gradients bitwise as they are.
/// (CPU only: on a GPU they pick other kernels, which agree within rounding, and the matrix
/// of tests/common/device.rs checks each against the reference.)
#[test]
fn kernel_options_change_nothing_on_the_cpu() {
    let t = Target::cpu();
    let c = Case::new(2, 70, 90, 6, 2, 64, DType::BF16)
        .causal()
        .softcap(5.0);
    let (q, k, v, g) = c.grad_inputs(&t, 3).unwrap();
    let run = |opts: &FlashAttn| {
        let (out, lse) = opts.forward_with_lse(&q, &k, &v).unwrap();
        let grads = opts.backward(&q, &k, &v, &out, &g, &lse).unwrap();
        [out, lse, grads.0, grads.1, grads.2]
    };
    let want = run(&c.opts);
    let overrides = [
        PlanOverride {
            sm90_variant: Some("wg2p".into()),
            persistent_blocks: Some(3),
            ..PlanOverride::default()
        },
        PlanOverride {
            thread_stores: true,
            decode_splits: Some(1),
            bwd_sm90_variants: vec!["nopp".into(), "pp".into()],
            ..PlanOverride::default()
        },
    ];
    let mut options = vec![
        c.opts.clone().portable(true),
        c.opts.clone().deterministic(false),
        c.opts.clone().deterministic(true),
    ];
    options.extend(
        overrides
            .into_iter()
            .map(|o| c.opts.clone().plan_override(o)),
    );
    for opts in &options {
        let got = run(opts);
        for (name, a, b) in ["out", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(&got)
            .zip(&want)
            .map(|((n, a), b)| (n, a, b))
        {
            assert_bitwise_eq(&format!("{opts:?}: {name}"), a, b);
        }
    }
}

/// Variant names that no kernel has are errors naming them, forward and backward, on every GPU
/// (names that exist but do not apply to a call leave its plan as it is).
#[cfg(feature = "cuda")]
fn unknown_variant_names_are_errors(t: &Target) -> Result<()> {
    let c = Case::new(1, 130, 130, 4, 2, 64, DType::BF16).causal();
    let (q, k, v, g) = c.grad_inputs(t, 5)?;
    let fwd = c.opts.clone().plan_override(PlanOverride {
        sm90_variant: Some("no-such-variant".into()),
        ..PlanOverride::default()
    });
    let e = fwd
        .forward(&q, &k, &v)
        .expect_err("unknown forward variant");
    assert!(e.to_string().contains("no-such-variant"), "{e}");
    let bwd = c.opts.clone().plan_override(PlanOverride {
        bwd_sm90_variants: vec!["no-such-variant".into()],
        ..PlanOverride::default()
    });
    let (out, lse) = bwd.forward_with_lse(&q, &k, &v)?;
    let e = bwd
        .backward(&q, &k, &v, &out, &g, &lse)
        .expect_err("unknown backward variant");
    assert!(e.to_string().contains("no-such-variant"), "{e}");
    Ok(())
}
test_cuda!(unknown_variant_names_are_errors, Once);

/// Every (row, key) visibility for many windows against `semantics::Window::key_range`, through
/// the mask probe (q = 0, one-hot V: output = 1/count on visible keys, exactly 0 elsewhere).
/// d = 128 so the 64 keys span two 32-key tiles of the CUDA mma kernels; sq up to 130 spans two
/// 128-row query tiles (and three 64-row CPU tiles).
fn mask_visibility_matches_semantics(t: &Target) -> Result<()> {
    let shapes: &[(usize, usize)] = if t.small() {
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
    for dtype in DTYPES {
        for &(sq, sk) in shapes {
            for left in PROBE_WINDOWS {
                for right in PROBE_WINDOWS {
                    let p = mask_probe(sq, sk, 2, 1, 128, left, right, dtype)?;
                    let (q, k, v) = (t.put(&p.q)?, t.put(&p.k)?, t.put(&p.v)?);
                    t.poison(&out_and_lse_bytes(dtype, sq, 2, 128))?;
                    let (out, lse) = t.op(&p.opts).forward_with_lse(&q, &k, &v)?;
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
    assert_eq!(n, 3 * shapes.len() * 49);
    Ok(())
}
test_device!(mask_visibility_matches_semantics, Forward);

/// Small ragged shapes (odd lengths, head dims 40 to 128 and 33, every mask, softcap, ALiBi, k and
/// v read through views in every other case): the subset compute-sanitizer runs, with
/// `CANDLE_FLASH_TEST_SMALL=1` keeping the yardstick on the host so that only the flash
/// kernels run on the device.
fn sanitizer_small_ragged_shapes(t: &Target) -> Result<()> {
    let mut n = 0;
    for (i, &(sq, sk)) in [(1, 239), (113, 203), (203, 113), (65, 1)]
        .iter()
        .enumerate()
    {
        for (j, &d) in [40, 64, 128, 33].iter().enumerate() {
            for &dtype in t.sweep(&[DType::BF16, DType::F16, DType::F32], i + j) {
                let c = Case::new(2, sq, sk, 6, 2, d, dtype);
                let c = match (i + j) % 3 {
                    0 => c,
                    1 => c.causal(),
                    _ => c.window(Some(19), Some(2)),
                };
                let c = if j == 1 { c.softcap(3.0) } else { c };
                let c = if i == 1 { c.alibi() } else { c };
                let c = if n % 2 == 0 {
                    c.layout(Layout::Mixed)
                } else {
                    c
                };
                c.check(t, 77 + n)?;
                n += 1;
            }
        }
    }
    Ok(())
}
test_device!(sanitizer_small_ragged_shapes, Forward);

/// Heads wider than 256 (up to 512): the tensor-core kernels split V/O by columns, f32 takes the
/// row-wise kernel where its tiles do not fit.
fn wide_heads_320_and_512(t: &Target) -> Result<()> {
    let mut n = 0;
    for (i, (d, sq, sk)) in [(320, 77, 130), (512, 130, 77), (296, 1, 300), (512, 65, 65)]
        .into_iter()
        .enumerate()
    {
        for &dtype in t.sweep(&DTYPES, i) {
            let c = Case::new(2, sq, sk, 4, 2, d, dtype);
            let c = match i {
                0 | 2 => c.causal(),
                1 => c,
                _ => c.window(Some(20), Some(3)),
            };
            let c = if n % 3 == 2 { c.softcap(5.0) } else { c };
            let c = if n % 4 == 1 { c.alibi() } else { c };
            c.check(t, 700 + n)?;
            n += 1;
        }
    }
    Ok(())
}
test_device!(wide_heads_320_and_512, Forward);

/// Heads of 129..=256 in f16 and bf16 (on Hopper the sm_90a d 256 instance: 128-row tiles,
/// 80-key tiles, O staged in Q's buffer): several query tiles, key counts off the 80-key grid,
/// every mask, GQA, softcap and ALiBi.
fn heads_129_to_256_multi_tile(t: &Target) -> Result<()> {
    let mut n = 0;
    for (i, (d, sq, sk, mask)) in [
        (256, 300, 517, 0),
        (256, 517, 300, 1),
        (136, 257, 401, 2),
        (200, 129, 161, 3),
        (248, 384, 384, 1),
        (256, 80, 81, 0),
    ]
    .into_iter()
    .enumerate()
    {
        for &dtype in t.sweep(&[DType::BF16, DType::F16], i) {
            let c = Case::new(2, sq, sk, 4, if n % 2 == 0 { 2 } else { 4 }, d, dtype);
            let c = match mask {
                0 => c,
                1 => c.causal(),
                2 => c.window(Some(100), Some(20)),
                _ => c.window(Some(90), None),
            };
            let c = if n % 3 == 1 { c.softcap(5.0) } else { c };
            let c = if n % 4 == 2 { c.alibi() } else { c };
            c.check(t, 900 + n)?;
            n += 1;
        }
    }
    Ok(())
}
test_device!(heads_129_to_256_multi_tile, Forward);

/// Scores that grow along the keys (key j scaled by up to `top`, geometrically): later key tiles
/// pass the rows' running max, with `top` 60 by more than exp2's range (scores up to ~200). The
/// online softmax must rescale; the sm_90a kernels that rescale lazily take a tile's exps
/// against the current max first and must redo, exactly, the tiles where that guess fails;
/// `top` 4 leaves tiles near the rescaling margin.
fn growing_scores_move_the_max(t: &Target) -> Result<()> {
    let mut n = 0;
    for (i, (d, sq, sk, mask, top)) in [
        (128, 300, 700, 0, 60.0f32),
        (128, 257, 900, 1, 60.0),
        (128, 300, 1100, 0, 4.0),
        (128, 200, 600, 2, 60.0),
        (64, 200, 700, 0, 60.0),
        (256, 130, 500, 1, 60.0),
    ]
    .into_iter()
    .enumerate()
    {
        for &dtype in t.sweep(&[DType::BF16, DType::F16], i) {
            let c = Case::new(1, sq, sk, 2, 2, d, dtype);
            let c = match mask {
                0 => c,
                1 => c.causal(),
                _ => c.window(Some(300), Some(0)),
            };
            let (q, k, v) = c.inputs(t, 1000 + n)?;
            let growth: Vec<f32> = (0..sk)
                .map(|j| top.powf(j as f32 / (sk - 1) as f32))
                .collect();
            let growth = t.put(&Tensor::from_vec(growth, (1, sk, 1, 1), &Device::Cpu)?)?;
            let k = k
                .to_dtype(DType::F32)?
                .broadcast_mul(&growth)?
                .to_dtype(dtype)?;
            check_forward(
                t,
                &format!("growing scores, top {top}: {c:?}"),
                &q,
                &k,
                &v,
                &c.opts,
            )?;
            n += 1;
        }
    }
    Ok(())
}
test_device!(growing_scores_move_the_max, Forward);

/// Persistent Hopper blocks (d 64 and 128, causal or unmasked) run several query tiles each,
/// with the next tile's Q loaded into a second buffer during this one. These shapes give each
/// block about two tiles (b 4, 8 heads, 9 query tiles each; in the sm90-persistent
/// configuration three blocks take them all) and, under a bottom-right causal mask with far fewer
/// keys than queries, tiles without any key before tiles with keys; a window skips the first key
/// tiles of later query tiles. On the CPU (work items of up to four 64-row tiles) and under
/// compute-sanitizer, 300 rows of two batches of four heads meet the same pattern.
fn persistent_tiles_with_and_without_keys(t: &Target) -> Result<()> {
    let mut n = 0;
    // Causal with 50 keys: 8 of 9 query tiles without a key (1,100 rows), or 1 of 3 (300 rows).
    let (b, h, long) = match t.is_cuda() && !t.small() {
        true => (4, 8, 1100),
        false => (2, 4, 300),
    };
    for dtype in [DType::BF16, DType::F16] {
        for (d, sq, sk, mask) in [
            (128, long, 50, 1),
            (64, long, 50, 1),
            (128, long, 300, 0),
            (128, long * 2 / 3, long, 2),
        ] {
            let c = Case::new(b, sq, sk, h, 2, d, dtype);
            let c = match mask {
                0 => c,
                1 => c.causal(),
                _ => c.window(Some(long / 7), Some(0)),
            };
            c.check(t, 2000 + n)?;
            n += 1;
        }
    }
    Ok(())
}
test_device!(persistent_tiles_with_and_without_keys, Forward);

/// The GPU path and the CPU path each within the rule of the reference, and within the sum of
/// both tolerances of each other (NaN-propagating), lse within 1e-3.
#[cfg(feature = "cuda")]
fn gpu_agrees_with_cpu_path(t: &Target) -> Result<()> {
    let cpu = Target::cpu();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for c in [
            Case::new(2, 200, 333, 6, 2, 128, dtype).causal(),
            Case::new(3, 97, 97, 6, 6, 80, dtype)
                .window(Some(16), Some(16))
                .softcap(5.0)
                .alibi(),
        ] {
            let (q, k, v) = c.inputs(&cpu, 42)?;
            let what = format!("{c:?}");
            let (ref_out, _) = reference(&q, &k, &v, &c.opts)?;
            let (cpu_out, cpu_lse) = cpu.op(&c.opts).forward_with_lse(&q, &k, &v)?;
            let (qg, kg, vg) = (t.put(&q)?, t.put(&k)?, t.put(&v)?);
            let (gpu_out, gpu_lse) = t.op(&c.opts).forward_with_lse(&qg, &kg, &vg)?;
            let cpu_naive = naive_attention(&q, &k, &v, &cpu.op(&c.opts))?;
            let gpu_naive = naive_attention(&qg, &kg, &vg, &t.op(&c.opts))?;
            assert_close(&format!("CPU {what}"), &cpu_out, &cpu_naive, &ref_out, true);
            assert_close(&format!("GPU {what}"), &gpu_out, &gpu_naive, &ref_out, true);
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
test_cuda!(gpu_agrees_with_cpu_path, Forward);

/// The guard that makes unwritten output visible: after `Target::poison`, the next allocations of
/// those byte counts (made the way the op makes its output and lse) hold 0xFF bytes. If this
/// fails, the pool does not hand the poisoned blocks back and the NaN guard of every other GPU
/// test is void on this machine.
#[cfg(feature = "cuda")]
fn poison_reaches_the_next_allocation(t: &Target) -> Result<()> {
    let Device::Cuda(cuda) = &t.dev else {
        unreachable!("a CUDA target")
    };
    for (dtype, rows, h, d) in [
        (DType::BF16, 203, 6, 40),
        (DType::F16, 1, 6, 128),
        (DType::F32, 2 * 113, 6, 64),
    ] {
        let sizes = out_and_lse_bytes(dtype, rows, h, d);
        t.poison(&sizes)?;
        for n in sizes {
            // SAFETY: u8 has no invalid bit patterns; the bytes are only copied to the host.
            let slice = unsafe { cuda.alloc::<u8>(n)? };
            let host = cuda.clone_dtoh(&slice)?;
            let clean = host.iter().filter(|&&x| x != 0xFF).count();
            assert_eq!(
                clean, 0,
                "{dtype:?}: a fresh {n}-byte allocation after poisoning has {clean} bytes that are not 0xFF"
            );
        }
    }
    Ok(())
}
test_cuda!(poison_reaches_the_next_allocation, Once);
