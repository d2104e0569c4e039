//! Attention variants against the f64 reference: learnable sinks (one more logit per head that
//! carries no value) in every path (dense, varlen, decode, paged and KV-cache calls, which share
//! the `sinks` of tests/paged.rs), their gradients through autograd and
//! `FlashAttn::backward_all`, and their bad inputs; the additive bias and the block-sparse mask
//! (dense and packed calls here, paged and KV-cache calls in tests/paged.rs; CPU and CUDA
//! forward, CPU gradients, the bias's own included), and their bad inputs.
//!
//! ```text
//! cargo test --release --test variants
//! cargo test --release --features cuda --test variants -- ::cuda
//! ```

#[macro_use]
mod common;

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::{naive_attention, FlashAttn};
use common::grad::{
    autograd, check_grad, check_grads, dbias_of, dbias_varlen, grad_bytes, reference_grads,
    reference_grads_varlen,
};
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Sinks for `h` heads, f32 on the CPU: small and large, positive and negative, one `-inf` (no
/// sink) and one that outweighs every score (10: its row's output shrinks towards 0).
fn sinks(h: usize) -> Tensor {
    let pool = [0.5f32, -1.0, 2.0, f32::NEG_INFINITY, 10.0, 0.0, -3.0, 1.25];
    let s: Vec<f32> = (0..h).map(|i| pool[i % pool.len()]).collect();
    Tensor::from_vec(s, h, &Device::Cpu).unwrap()
}

/// Odd lengths both ways with causal masks, windows (rows that see no key: output 0, lse the
/// sink), softcap and ALiBi, GQA 6/3/2/1, every dtype and the non-contiguous layouts.
fn sinks_dense(t: &Target) -> Result<()> {
    let pairs = [(1, 1), (17, 33), (113, 65), (65, 113), (1, 239)];
    let hks = [6, 3, 2, 1];
    for (n, &(sq, sk)) in pairs.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, n) {
            let hk = hks[n % hks.len()];
            let d = [64, 40, 128][n % 3];
            let base = Case::new(2, sq, sk, 6, hk, d, dtype);
            let s = sinks(6);
            let cases = [
                base.clone().with(FlashAttn::new(scale(d)).sinks(&s)),
                base.clone()
                    .causal()
                    .with(FlashAttn::new(scale(d)).causal().sinks(&s)),
                base.clone().with(
                    FlashAttn::new(scale(d))
                        .window(Some(5), Some(0))
                        .softcap(3.0)
                        .sinks(&s),
                ),
                base.clone().with(
                    FlashAttn::new(scale(d))
                        .causal()
                        .alibi(&head_slopes(6))
                        .sinks(&s),
                ),
            ];
            for (i, c) in cases.iter().enumerate() {
                let layout = [Layout::Contiguous, Layout::Transposed, Layout::NanBuffers][i % 3];
                c.clone()
                    .layout(layout)
                    .check(t, 10 * n as u64 + i as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(sinks_dense, Forward);

/// Decode shapes `(seq_q, seq_k, heads, kv_heads)`: one and several query rows, GQA groups of
/// 8, 4 and 1, a cache long enough to split and one of 5 keys.
const DECODE_SHAPES: [(usize, usize, usize, usize); 4] = [
    (1, 1000, 8, 1),
    (4, 777, 8, 2),
    (2, 300, 4, 4),
    (1, 5, 8, 8),
];

/// One to four query rows against long caches (the decode kernels on a GPU, with one split and
/// with the most, where the sink joins in the combine pass), GQA groups 1 to 8.
fn sinks_decode(t: &Target) -> Result<()> {
    for (n, &(sq, sk, h, hk)) in DECODE_SHAPES.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, n) {
            let d = [128, 64][n % 2];
            let opts = FlashAttn::new(scale(d)).causal().sinks(&sinks(h));
            Case::new(3, sq, sk, h, hk, d, dtype)
                .with(opts)
                .check(t, 50 + n as u64)?;
        }
    }
    Ok(())
}
test_device!(sinks_decode, Decode);

/// A ragged packed batch (empty sequences, sequences without keys, odd lengths).
fn sinks_varlen(t: &Target) -> Result<()> {
    let r = Ragged::standard(t);
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let (h, hk, d) = (6, 2, [64, 40, 128][n]);
        let q = randn(&[r.total_q, h, d], dtype, 70 + n as u64, &t.dev)?;
        let k = randn(&[r.total_k, hk, d], dtype, 71 + n as u64, &t.dev)?;
        let v = randn(&[r.total_k, hk, d], dtype, 72 + n as u64, &t.dev)?;
        for opts in [
            FlashAttn::new(scale(d)).sinks(&sinks(h)),
            FlashAttn::new(scale(d)).causal().sinks(&sinks(h)),
        ] {
            let what = format!("varlen {dtype:?} causal {:?}", opts.window_size_right);
            check_varlen(t, &what, &r, &q, &k, &v, &opts)?;
        }
    }
    Ok(())
}
test_device!(sinks_varlen, Forward);

/// `dsinks` against the reference with the rule of the other gradients: within twice the naive
/// path's error (same dtype, same device) plus the floors.
fn check_dsinks(what: &str, fast: &Tensor, naive: &Tensor, reference: &[f64], dtype: DType) {
    assert_eq!(fast.dims(), &[reference.len()], "{what}: dsinks shape");
    assert_eq!(fast.dtype(), DType::F32, "{what}: dsinks dtype");
    let actual = values(fast).unwrap();
    let scale = scale_of(reference);
    let err = max_abs_err_slice(&actual, reference).unwrap_or_else(|| {
        panic!(
            "{what}: non-finite dsinks where the reference is finite ({})",
            first_non_finite_disagreement(&actual, reference)
        )
    });
    let naive_err = max_abs_err_slice(&values(naive).unwrap(), reference).expect("finite naive");
    let (floor, rel_backstop, _) = tolerances(dtype);
    let allowed = 2.0 * naive_err + (floor + SCALE_FLOOR) * scale + rel_backstop * scale * 0.1;
    assert!(
        err <= allowed,
        "{what}: dsinks max abs err {err:.3e} > allowed {allowed:.3e} (naive {naive_err:.3e})"
    );
}

/// Gradients of q, k, v and the sinks by autograd (sinks a `Var`) and by
/// `FlashAttn::backward_all`, against the f64 reference, with the naive path's autograd as the
/// yardstick: causal and windowed (rows without keys), GQA, every dtype.
fn sinks_gradients(t: &Target) -> Result<()> {
    let shapes = [(37, 53, 6, 3, 64), (53, 37, 6, 2, 40), (1, 90, 4, 1, 128)];
    for (n, &(sq, sk, h, hk, d)) in shapes.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, n) {
            for (m, base) in [
                FlashAttn::new(scale(d)).causal(),
                FlashAttn::new(scale(d)).window(Some(3), Some(1)),
            ]
            .into_iter()
            .enumerate()
            {
                let seed = 200 + 10 * n as u64 + m as u64;
                let c = Case::new(2, sq, sk, h, hk, d, dtype);
                let (q, k, v, g) = c.grad_inputs(t, seed)?;
                let host_sinks = sinks(h);
                let opts = base.clone().sinks(&host_sinks);
                let what = format!("{:?}", c.clone().with(opts.clone()));
                let sv = Var::from_tensor(&t.put(&host_sinks)?)?;
                let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor, &FlashAttn) -> Result<Tensor>| {
                    let (qv, kv, vv) = (
                        Var::from_tensor(&q)?,
                        Var::from_tensor(&k)?,
                        Var::from_tensor(&v)?,
                    );
                    let op = t.op(&base).sinks(sv.as_tensor());
                    let out = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &op)?;
                    let loss = (out.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?;
                    let grads = loss.backward()?;
                    let get = |x: &Tensor, name: &str| {
                        grads.get(x).cloned().ok_or_else(|| {
                            candle::Error::Msg(format!("{what}: no gradient reached {name}"))
                        })
                    };
                    Ok::<_, candle::Error>((
                        (
                            get(qv.as_tensor(), "q")?,
                            get(kv.as_tensor(), "k")?,
                            get(vv.as_tensor(), "v")?,
                        ),
                        get(sv.as_tensor(), "sinks")?,
                    ))
                };
                t.poison(&grad_bytes(dtype, 2 * sq, h, 2 * sk, hk, d))?;
                let (fast, fast_ds) = run(&|q, k, v, op| op.forward(q, k, v))?;
                let (naive, naive_ds) = run(&|q, k, v, op| naive_attention(q, k, v, op))?;
                let r = reference_grads(&q, &k, &v, &g, &opts)?;
                check_grads(&what, &fast, &naive, &r, [&q, &k, &v]);
                check_dsinks(
                    &format!("{what} autograd"),
                    &fast_ds,
                    &naive_ds,
                    &r.dsinks,
                    dtype,
                );
                // The explicit backward from the saved output and lse.
                let op = t.op(&opts);
                let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
                let all = op.backward_all(&q, &k, &v, &out, &g, &lse)?;
                let ds = all.dsinks.expect("dsinks with sinks");
                check_dsinks(
                    &format!("{what} backward_all"),
                    &ds,
                    &naive_ds,
                    &r.dsinks,
                    dtype,
                );
                let explicit = (all.dq, all.dk, all.dv);
                check_grads(
                    &format!("{what} backward_all"),
                    &explicit,
                    &naive,
                    &r,
                    [&q, &k, &v],
                );
            }
        }
    }
    Ok(())
}
test_device!(sinks_gradients, Backward);

/// Varlen gradients with sinks through autograd, and `backward_varlen_all`'s dsinks equal to the
/// sum of each sequence's dense dsinks.
fn sinks_varlen_gradients(t: &Target) -> Result<()> {
    let r = Ragged::new(&[(13, 20), (0, 4), (9, 0), (30, 25)]);
    let (h, hk, d) = (4, 2, 32);
    let q = randn(&[r.total_q, h, d], DType::F32, 300, &t.dev)?;
    let k = randn(&[r.total_k, hk, d], DType::F32, 301, &t.dev)?;
    let v = randn(&[r.total_k, hk, d], DType::F32, 302, &t.dev)?;
    let g = randn(&[r.total_q, h, d], DType::F32, 303, &t.dev)?;
    let opts = FlashAttn::new(scale(d)).causal().sinks(&sinks(h));
    let op = t.op(&opts);
    let (cq, ck) = r.tensors(t)?;
    let fast = autograd(&q, &k, &v, &g, |q, k, v| {
        op.forward_varlen(q, k, v, &cq, &ck, r.max_q, r.max_k)
    })?;
    let naive = autograd(&q, &k, &v, &g, |q, k, v| {
        naive_varlen(q, k, v, &r.cu_q, &r.cu_k, &op)
    })?;
    let reference = reference_grads_varlen(&q, &k, &v, &g, &r.cu_q, &r.cu_k, &opts)?;
    check_grads("varlen sinks", &fast, &naive, &reference, [&q, &k, &v]);
    let (out, lse) = op.forward_varlen_with_lse(&q, &k, &v, &cq, &ck, r.max_q, r.max_k)?;
    let all = op.backward_varlen_all(&q, &k, &v, &out, &g, &lse, &cq, &ck, r.max_q, r.max_k)?;
    let ds = values(&all.dsinks.expect("dsinks"))?;
    let err = max_abs_err_slice(&ds, &reference.dsinks).expect("finite");
    assert!(
        err <= 1e-4 * scale_of(&reference.dsinks).max(1.0),
        "varlen dsinks {ds:?} vs {:?}",
        reference.dsinks
    );
    Ok(())
}
test_device!(sinks_varlen_gradients, Once);

/// A `-inf` sink is no sink: bitwise the plain op's output and lse.
fn minus_infinity_sinks_change_nothing(t: &Target) -> Result<()> {
    let c = Case::new(2, 33, 47, 4, 2, 64, DType::BF16).causal();
    let (q, k, v) = c.inputs(t, 400)?;
    let none = Tensor::full(f32::NEG_INFINITY, 4, &Device::Cpu)?;
    let (a, la) = t.op(&c.opts).forward_with_lse(&q, &k, &v)?;
    let (b, lb) = t
        .op(&c.opts.clone().sinks(&none))
        .forward_with_lse(&q, &k, &v)?;
    assert_bitwise_eq("-inf sinks: out", &a, &b);
    assert_bitwise_eq("-inf sinks: lse", &la, &lb);
    Ok(())
}
test_device!(minus_infinity_sinks_change_nothing, Once);

/// Sinks of the wrong length, dtype or device are refused, naming `sinks`.
fn bad_sinks_name_the_argument(t: &Target) -> Result<()> {
    let q = randn(&[1, 5, 4, 8], DType::F32, 1, &t.dev)?;
    let kv = randn(&[1, 5, 2, 8], DType::F32, 2, &t.dev)?;
    let mut bad = vec![
        Tensor::zeros(3, DType::F32, &Device::Cpu)?,
        Tensor::zeros((1, 4), DType::F32, &Device::Cpu)?,
        Tensor::zeros(4, DType::F16, &Device::Cpu)?,
    ];
    if t.is_cuda() {
        // On the host while q is on the GPU.
        bad.push(Tensor::zeros(4, DType::F32, &Device::Cpu)?);
    }
    for (n, s) in bad.iter().enumerate() {
        // The first three go to the target's device with the options, the last stays behind.
        let op = if n < 3 {
            t.op(&FlashAttn::new(0.3).sinks(s))
        } else {
            t.op(&FlashAttn::new(0.3)).sinks(s)
        };
        let err = op.forward(&q, &kv, &kv).expect_err("bad sinks accepted");
        assert!(
            err.to_string().contains("sinks"),
            "sinks {:?} {:?}: {err}",
            s.dims(),
            s.dtype()
        );
    }
    Ok(())
}
test_device!(bad_sinks_name_the_argument, Once);

/// Small shapes for compute-sanitizer: the prefill kernels (every forward configuration) with
/// sinks, windows that leave rows without keys, and a ragged batch.
fn sanitizer_sinks_forward(t: &Target) -> Result<()> {
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let d = [40, 64, 128][n];
        let opts = FlashAttn::new(scale(d))
            .window(Some(3), Some(0))
            .sinks(&sinks(4));
        Case::new(2, 70, 33, 4, 2, d, dtype)
            .with(opts)
            .check(t, 500 + n as u64)?;
    }
    let r = Ragged::new(&[(5, 9), (0, 3), (40, 0), (17, 80)]);
    let q = randn(&[r.total_q, 4, 64], DType::BF16, 510, &t.dev)?;
    let k = randn(&[r.total_k, 1, 64], DType::BF16, 511, &t.dev)?;
    let opts = FlashAttn::new(scale(64)).causal().sinks(&sinks(4));
    check_varlen(t, "sanitizer varlen sinks", &r, &q, &k, &k, &opts)?;
    Ok(())
}
test_device!(sanitizer_sinks_forward, Forward);

/// Small shapes for compute-sanitizer: the decode kernels with one split and with the most (the
/// sink then joins in the combine pass), GQA groups of 1 and 8.
fn sanitizer_sinks_decode(t: &Target) -> Result<()> {
    for (n, &(sq, h, hk)) in [(1, 8, 1), (3, 4, 4)].iter().enumerate() {
        let opts = FlashAttn::new(scale(64)).causal().sinks(&sinks(h));
        Case::new(2, sq, 300, h, hk, 64, DType::BF16)
            .with(opts)
            .check(t, 520 + n as u64)?;
    }
    Ok(())
}
test_device!(sanitizer_sinks_decode, Decode);

/// A bias for `(b, h, sq, sk)` of the given shape (broadcast dimensions 1), N(0, 1) f32 on the
/// CPU, with `-inf` on every third key of the last batch where the key dimension is whole (a
/// key-padding mask when the other dimensions are 1).
fn bias_of(shape: &[usize], seed: u64) -> Result<Tensor> {
    let t = randn(shape, DType::F32, seed, &Device::Cpu)?;
    let dims = t.dims().to_vec();
    let (nb, sk) = (dims[0], dims[dims.len() - 1]);
    if sk == 1 {
        return Ok(t);
    }
    let mut v = t.flatten_all()?.to_vec1::<f32>()?;
    let per_batch = v.len() / nb;
    for (x, val) in v[(nb - 1) * per_batch..].iter_mut().enumerate() {
        if (x % sk) % 3 == 2 {
            *val = f32::NEG_INFINITY;
        }
    }
    Tensor::from_vec(v, dims, &Device::Cpu)
}

/// The additive bias: full, key-padding `(b, 1, 1, sk)` with `-inf` keys, per head without the
/// batch dimension, a stride-0 view, a transposed view of keys by rows, a view that starts past
/// its storage's first element, and one in q's dtype; with causal masks, windows, softcap,
/// ALiBi and sinks, odd lengths both ways and a decode-shaped call, GQA 6/3/2/1, every dtype and
/// layout.
fn bias_dense(t: &Target) -> Result<()> {
    let pairs = [(1, 1), (17, 33), (113, 65), (65, 113), (1, 239)];
    let hks = [6, 3, 2, 1];
    for (n, &(sq, sk)) in pairs.iter().enumerate() {
        for &dtype in &DTYPES {
            let hk = hks[n % hks.len()];
            let d = [64, 40, 128][n % 3];
            let base = Case::new(2, sq, sk, 6, hk, d, dtype);
            let seed = 100 * n as u64;
            let full = bias_of(&[2, 6, sq, sk], seed)?;
            let padding = bias_of(&[2, 1, 1, sk], seed + 1)?;
            let per_head = bias_of(&[6, sq, sk], seed + 2)?;
            let view = bias_of(&[1, 1, sq, sk], seed + 3)?.broadcast_as((2, 6, sq, sk))?;
            let typed = randn(&[2, 6, 1, sk], dtype, seed + 4, &Device::Cpu)?;
            let transposed = bias_of(&[2, 6, sk, sq], seed + 5)?.transpose(2, 3)?;
            let offset = bias_of(&[3, 6, sq, sk], seed + 6)?.narrow(0, 1, 2)?;
            let opts = |b: &Tensor| FlashAttn::new(scale(d)).bias(b);
            let cases = [
                base.clone().with(opts(&full)),
                base.clone().causal().with(opts(&padding).causal()),
                base.clone()
                    .with(opts(&per_head).window(Some(5), Some(0)).softcap(3.0)),
                base.clone()
                    .causal()
                    .with(opts(&view).causal().alibi(&head_slopes(6))),
                base.clone().with(opts(&typed).sinks(&sinks(6))),
                base.clone().causal().with(opts(&transposed).causal()),
                base.clone().with(opts(&offset).window(Some(9), Some(3))),
            ];
            for (i, c) in cases.iter().enumerate() {
                let layout = [Layout::Contiguous, Layout::Transposed, Layout::NanBuffers][i % 3];
                c.clone().layout(layout).check(t, seed + i as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(bias_dense, Forward);

/// Full biases in q's dtype, whose blocks cut the kernels' tiles and the CPU's 8 × 8 vector
/// blocks: lengths that are no multiple of 8 (rows and keys left to the scalar path), a bias
/// narrowed inside a wider one (a row stride that is no multiple of 8, an unaligned first
/// element), one broadcast over heads, one with strided keys; `-inf` on every third key of
/// the last batch; causal, a window and softcap.
fn full_bias_tiles(t: &Target) -> Result<()> {
    let pairs = [(130, 203), (64, 64), (71, 9), (24, 300)];
    for (n, &(sq, sk)) in pairs.iter().enumerate() {
        for &dtype in &DTYPES {
            let d = [64, 40, 128, 80][n];
            let seed = 1000 + 100 * n as u64;
            let typed = |b: Tensor| b.to_dtype(dtype);
            let full = typed(bias_of(&[2, 6, sq, sk], seed)?)?;
            let wide = typed(bias_of(&[2, 6, sq, sk + 7], seed + 1)?)?.narrow(3, 3, sk)?;
            let heads = typed(bias_of(&[2, 1, sq, sk], seed + 2)?)?;
            let strided = typed(bias_of(&[2, 6, sk, sq], seed + 3)?)?.transpose(2, 3)?;
            let base = Case::new(2, sq, sk, 6, 2, d, dtype);
            let o = |b: &Tensor| FlashAttn::new(scale(d)).bias(b);
            let cases = [
                base.clone().with(o(&full)),
                base.clone().causal().with(o(&wide).causal()),
                base.clone().with(o(&heads).softcap(3.0)),
                base.clone().with(o(&strided).window(Some(20), Some(7))),
            ];
            for (i, c) in cases.iter().enumerate() {
                c.check(t, seed + 10 + i as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(full_bias_tiles, Forward);

/// Key biases (no row dimension) whose values fill whole key tiles with `-inf`, which the tiled
/// kernels skip, and with 0, on which they add nothing, and cut other tiles, as padding does:
/// per batch, keys padded at the end, padded at the start before real values and zeros, and a
/// sequence padded entirely (its rows output 0, lse `-inf` or the sink); per head, a run of
/// `-inf` at a different place; in q's dtype; with causal masks, sinks and a block mask; every
/// dtype, head dims whose tiles are 64 to 176 keys wide.
fn key_bias_tiles(t: &Target) -> Result<()> {
    let (sq, sk, h): (usize, usize, usize) = (150, 700, 6);
    let ninf = f32::NEG_INFINITY;
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let (d, hk) = ([64, 128, 256][n], [2, 6, 3][n]);
        let seed = 900 + 10 * n as u64;
        let r = randn(&[3, 1, 1, sk], DType::F32, seed, &Device::Cpu)?;
        let r = r.flatten_all()?.to_vec1::<f32>()?;
        let padding: Vec<f32> = (0..3 * sk)
            .map(|x| match (x / sk, x % sk) {
                (0, j) if j < 300 => 0.0,
                (1, j) if (200..500).contains(&j) => r[x],
                (1, j) if j >= 500 => 0.0,
                _ => ninf,
            })
            .collect();
        let padding = Tensor::from_vec(padding, (3, 1, 1, sk), &Device::Cpu)?;
        let per_head: Vec<f32> = (0..h * sk)
            .map(|x| {
                let (hh, j) = (x / sk, x % sk);
                match hh > 0 && (100 * hh..100 * hh + 250).contains(&j) {
                    true => ninf,
                    false => 0.0,
                }
            })
            .collect();
        let per_head = Tensor::from_vec(per_head, (1, h, 1, sk), &Device::Cpu)?;
        let typed = padding.to_dtype(dtype)?;
        let blocks = blocks_of(&[1, 1, sq.div_ceil(64), sk.div_ceil(128)], seed + 1)?;
        let base = Case::new(3, sq, sk, h, hk, d, dtype);
        let o = |b: &Tensor| FlashAttn::new(scale(d)).bias(b);
        let cases = [
            base.clone().with(o(&padding)),
            base.clone()
                .causal()
                .with(o(&padding).causal().sinks(&sinks(h))),
            base.clone().with(o(&per_head).block_mask(&blocks, 64, 128)),
            base.clone().causal().with(o(&typed).causal()),
            base.clone().with(o(&per_head).softcap(4.0)),
        ];
        for (i, c) in cases.iter().enumerate() {
            let layout = [Layout::Contiguous, Layout::Transposed][i % 2];
            c.clone().layout(layout).check(t, seed + 2 + i as u64)?;
        }
    }
    Ok(())
}
test_device!(key_bias_tiles, Forward);

/// The bias on decode-shaped calls (few query rows per K/V head, split over the keys): a
/// key-padding bias with `-inf` keys, a full one in q's dtype and a per-head one, with causal
/// masks and sinks; and key vectors (which the GPU kernels stage per tile) in q's dtype, with
/// every other key of a wider vector (key stride 2) and one for every sequence.
fn bias_decode(t: &Target) -> Result<()> {
    for (n, &(sq, sk, h, hk)) in DECODE_SHAPES.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, n) {
            let d = [128, 64][n % 2];
            let seed = 700 + 10 * n as u64;
            let padding = bias_of(&[3, 1, 1, sk], seed)?;
            let full = randn(&[3, h, sq, sk], dtype, seed + 1, &Device::Cpu)?;
            let per_head = bias_of(&[h, 1, sk], seed + 2)?;
            let typed = bias_of(&[3, 1, 1, sk], seed + 3)?.to_dtype(dtype)?;
            let strided = bias_of(&[3, 1, 1, 2 * sk], seed + 4)?
                .reshape((3, 1, 1, sk, 2))?
                .narrow(4, 1, 1)?
                .squeeze(4)?;
            let shared = bias_of(&[1, 1, 1, sk], seed + 6)?;
            let cases = [padding, full, per_head, typed, strided, shared];
            for (i, bias) in cases.iter().enumerate() {
                let opts = FlashAttn::new(scale(d)).causal().bias(bias);
                let opts = if i == 2 { opts.sinks(&sinks(h)) } else { opts };
                Case::new(3, sq, sk, h, hk, d, dtype)
                    .causal()
                    .with(opts)
                    .check(t, seed + 5 + i as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(bias_decode, Decode);

/// Small shapes for compute-sanitizer: the decode kernels with a key vector they stage per tile
/// (f32 with `-inf` keys, and in q's dtype), with one split and with the most, GQA groups of 8
/// and 1.
fn sanitizer_bias_decode(t: &Target) -> Result<()> {
    for (n, &(sq, h, hk)) in [(1, 8, 1), (3, 4, 4)].iter().enumerate() {
        let seed = 560 + 10 * n as u64;
        let padding = bias_of(&[2, 1, 1, 300], seed)?;
        let typed = bias_of(&[2, 1, 1, 300], seed + 1)?.to_dtype(DType::BF16)?;
        for (i, bias) in [padding, typed].iter().enumerate() {
            let opts = FlashAttn::new(scale(64)).causal().bias(bias);
            Case::new(2, sq, 300, h, hk, 64, DType::BF16)
                .with(opts)
                .check(t, seed + 2 + i as u64)?;
        }
    }
    Ok(())
}
test_device!(sanitizer_bias_decode, Decode);

/// The bias and block masks on packed calls (the ragged batch of the varlen tests: sequences
/// without queries or keys, odd lengths): a full bias with `-inf` keys, key padding, per head
/// with sinks, in q's dtype, a block mask per sequence and head alone and with a bias, under
/// causal masks and windows; and a bias and block mask sized by bounds above the longest
/// sequences, which index them from 0 all the same.
fn bias_varlen(t: &Target) -> Result<()> {
    let r = Ragged::standard(t);
    let nb = r.lens.len();
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let (h, hk, d) = (6, [2, 3, 6][n], [64, 40, 128][n]);
        let seed = 800 + 10 * n as u64;
        let q = randn(&[r.total_q, h, d], dtype, seed, &t.dev)?;
        let k = randn(&[r.total_k, hk, d], dtype, seed + 1, &t.dev)?;
        let v = randn(&[r.total_k, hk, d], dtype, seed + 2, &t.dev)?;
        let (mq, mk) = (r.max_q, r.max_k);
        let full = bias_of(&[nb, h, mq, mk], seed + 3)?;
        let padding = bias_of(&[nb, 1, 1, mk], seed + 4)?;
        let per_head = bias_of(&[h, 1, mk], seed + 5)?;
        let typed = randn(&[nb, h, mq, mk], dtype, seed + 6, &Device::Cpu)?;
        let blocks = blocks_of(&[nb, h, mq.div_ceil(16), mk.div_ceil(8)], seed + 8)?;
        let shared = blocks_of(&[1, 1, mq.div_ceil(64), mk.div_ceil(128)], seed + 9)?;
        let o = |b: &Tensor| FlashAttn::new(scale(d)).bias(b);
        let cases = [
            o(&full),
            o(&padding).causal(),
            o(&per_head).window(Some(5), Some(0)).sinks(&sinks(h)),
            o(&typed).causal(),
            FlashAttn::new(scale(d)).block_mask(&blocks, 16, 8),
            o(&padding).causal().block_mask(&shared, 64, 128),
        ];
        for (i, opts) in cases.iter().enumerate() {
            let what = format!("varlen bias {dtype:?} case {i}");
            check_varlen(t, &what, &r, &q, &k, &v, opts)?;
        }
        let mut wide = Ragged::new(&r.lens);
        (wide.max_q, wide.max_k) = (mq + 2, mk + 5);
        let bias = bias_of(&[nb, h, mq + 2, mk + 5], seed + 7)?;
        let blocks = blocks_of(&[nb, 1, (mq + 2).div_ceil(32), (mk + 5).div_ceil(32)], seed)?;
        let what = format!("varlen bias {dtype:?} wider bounds");
        let opts = o(&bias).causal().block_mask(&blocks, 32, 32);
        check_varlen(t, &what, &wide, &q, &k, &v, &opts)?;
    }
    Ok(())
}
test_device!(bias_varlen, Forward);

/// Packed calls' gradients with a bias (full, key padding, per head): q, k and v through
/// autograd, and the bias's own through autograd and `backward_varlen_all`, against each
/// sequence's f64 reference.
fn bias_varlen_gradients(t: &Target) -> Result<()> {
    let r = Ragged::new(&[(13, 20), (0, 4), (9, 0), (30, 25)]);
    let (h, hk, d, nb) = (4, 2, 32, 4);
    let q = randn(&[r.total_q, h, d], DType::F32, 320, &t.dev)?;
    let k = randn(&[r.total_k, hk, d], DType::F32, 321, &t.dev)?;
    let v = randn(&[r.total_k, hk, d], DType::F32, 322, &t.dev)?;
    let g = randn(&[r.total_q, h, d], DType::F32, 323, &t.dev)?;
    let (cq, ck) = r.tensors(t)?;
    let biases = [
        bias_of(&[nb, h, r.max_q, r.max_k], 324)?,
        bias_of(&[nb, 1, 1, r.max_k], 325)?,
        bias_of(&[h, 1, r.max_k], 326)?,
    ];
    let blocks = blocks_of(&[nb, h, r.max_q.div_ceil(8), r.max_k.div_ceil(8)], 327)?;
    for (i, bias) in biases.iter().enumerate() {
        let what = format!("varlen bias gradients case {i}");
        let opts = FlashAttn::new(scale(d)).causal().bias(bias);
        // The last case under a block mask too.
        let opts = match i {
            2 => opts.block_mask(&blocks, 8, 8),
            _ => opts,
        };
        let op = t.op(&opts);
        let (out, lse) = op.forward_varlen_with_lse(&q, &k, &v, &cq, &ck, r.max_q, r.max_k)?;
        let all = op.backward_varlen_all(&q, &k, &v, &out, &g, &lse, &cq, &ck, r.max_q, r.max_k);
        let fast = autograd(&q, &k, &v, &g, |q, k, v| {
            op.forward_varlen(q, k, v, &cq, &ck, r.max_q, r.max_k)
        })?;
        let naive = autograd(&q, &k, &v, &g, |q, k, v| {
            naive_varlen(q, k, v, &r.cu_q, &r.cu_k, &op)
        })?;
        let reference = reference_grads_varlen(&q, &k, &v, &g, &r.cu_q, &r.cu_k, &opts)?;
        check_grads(&what, &fast, &naive, &reference, [&q, &k, &v]);
        let r_bias = dbias_varlen(&q, &k, &v, &g, &r.cu_q, &r.cu_k, &opts, bias.dims())?;
        let tracked = |f: &dyn Fn(&FlashAttn) -> Result<Tensor>| -> Result<Tensor> {
            let var = Var::from_tensor(&t.put(bias)?)?;
            let mut o = op.clone();
            o.bias = Some(var.as_tensor().clone());
            let loss = (f(&o)? * &g)?.sum_all()?;
            let grads = loss.backward()?;
            let db = grads.get(var.as_tensor()).cloned();
            db.ok_or_else(|| candle::Error::Msg("no gradient reached the bias".into()))
        };
        let fast_bias = tracked(&|o| o.forward_varlen(&q, &k, &v, &cq, &ck, r.max_q, r.max_k))?;
        let naive_bias = tracked(&|o| naive_varlen(&q, &k, &v, &r.cu_q, &r.cu_k, o))?;
        let from_all = all?
            .dbias
            .expect("backward_varlen_all returns dbias with a bias");
        for (how, db) in [("autograd", &fast_bias), ("backward_varlen_all", &from_all)] {
            check_grad(
                &format!("{what} dbias ({how})"),
                db,
                &naive_bias,
                &r_bias,
                bias,
            );
        }
    }
    Ok(())
}
test_device!(bias_varlen_gradients, Once);

/// A random u8 block mask of `(b, h, nq, nk)` blocks, about half of them 0, seeded.
fn blocks_of(shape: &[usize], seed: u64) -> Result<Tensor> {
    randn(shape, DType::F32, seed, &Device::Cpu)?
        .ge(0.0)?
        .to_dtype(DType::U8)
}

/// The block mask: block sizes that divide the lengths and ones that do not, one mask for all
/// heads and batches, combined with causal masks, windows and a bias, prefill and decode shapes;
/// rows whose every block is hidden output 0 with lse `-inf`.
fn block_mask_dense(t: &Target) -> Result<()> {
    // Block sizes below, equal to and above the kernels' tiles, dividing them or not.
    let shapes: [(usize, usize, usize, usize); 7] = [
        (17, 33, 3, 5),
        (113, 65, 16, 16),
        (130, 200, 64, 64),
        (65, 113, 1, 7),
        (1, 239, 1, 7),
        (5, 300, 2, 32),
        (333, 601, 128, 192),
    ];
    for (n, &(sq, sk, bq, bk)) in shapes.iter().enumerate() {
        let (nq, nk) = (sq.div_ceil(bq), sk.div_ceil(bk));
        for &dtype in &DTYPES {
            let d = [64, 40, 128][n % 3];
            let base = Case::new(2, sq, sk, 6, [2, 3, 6, 1, 2, 3, 6][n], d, dtype);
            let seed = 200 * n as u64;
            let every = blocks_of(&[2, 6, nq, nk], seed)?;
            let shared = blocks_of(&[nq, nk], seed + 1)?;
            // Query block 0 sees nothing at all.
            let mut v = blocks_of(&[1, 6, nq, nk], seed + 2)?
                .flatten_all()?
                .to_vec1::<u8>()?;
            for h in 0..6 {
                v[h * nq * nk..][..nk].fill(0);
            }
            let blind = Tensor::from_vec(v, (1, 6, nq, nk), &Device::Cpu)?;
            let m = |x: &Tensor| FlashAttn::new(scale(d)).block_mask(x, bq, bk);
            let cases = [
                base.clone().with(m(&every)),
                base.clone().causal().with(m(&shared).causal()),
                base.clone().with(m(&blind).window(Some(9), Some(4))),
                base.clone()
                    .with(m(&every).bias(&bias_of(&[2, 1, 1, sk], seed + 3)?)),
            ];
            for (i, c) in cases.iter().enumerate() {
                let layout = [Layout::Contiguous, Layout::Transposed, Layout::NanBuffers][i % 3];
                c.clone().layout(layout).check(t, seed + i as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(block_mask_dense, Forward);

/// For compute-sanitizer: a full bias in q's dtype and a block mask whose blocks cut the
/// kernels' tiles, with ragged lengths (tile tails past the sequences), every dtype; and a
/// key-padding bias with block sizes that are multiples of the tiles.
fn sanitizer_bias_blocks(t: &Target) -> Result<()> {
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let d = [40, 64, 128][n];
        let (sq, sk) = (70, 133);
        let bias = randn(&[2, 4, sq, sk], dtype, 520 + n as u64, &Device::Cpu)?;
        let blocks = blocks_of(&[2, 1, sq.div_ceil(48), sk.div_ceil(40)], 530 + n as u64)?;
        let opts = FlashAttn::new(scale(d))
            .causal()
            .bias(&bias)
            .block_mask(&blocks, 48, 40);
        Case::new(2, sq, sk, 4, 2, d, dtype)
            .causal()
            .with(opts)
            .check(t, 540 + n as u64)?;
        let pad = bias_of(&[2, 1, 1, sk], 550 + n as u64)?;
        let blocks = blocks_of(&[1, 4, sq.div_ceil(64), sk.div_ceil(128)], 560 + n as u64)?;
        let opts = FlashAttn::new(scale(d))
            .bias(&pad)
            .block_mask(&blocks, 64, 128);
        Case::new(2, sq, sk, 4, 2, d, dtype)
            .with(opts)
            .check(t, 570 + n as u64)?;
    }
    Ok(())
}
test_device!(sanitizer_bias_blocks, Forward);

/// Gradients of q, k, v and the bias through a bias and a block mask: a key-padding bias under a
/// causal mask, a full bias with a window and softcap, a block mask with a bias, a per-head bias
/// without batch and row dimensions, one in q's dtype shared by the batch, on the CPU against autograd of the naive path and the f64
/// reference; the bias's gradient both through autograd (a tracked bias) and `backward_all`.
fn bias_and_block_mask_gradients(t: &Target) -> Result<()> {
    let shapes = [(37, 53, 6, 3, 64), (53, 37, 6, 2, 40), (1, 90, 4, 1, 128)];
    for (n, &(sq, sk, h, hk, d)) in shapes.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, n) {
            let seed = 300 + 10 * n as u64;
            let c = Case::new(2, sq, sk, h, hk, d, dtype);
            let (q, k, v, g) = c.grad_inputs(t, seed)?;
            let pad = bias_of(&[2, 1, 1, sk], seed)?;
            let full = bias_of(&[2, h, sq, sk], seed + 1)?;
            let per_head = bias_of(&[h, 1, sk], seed + 3)?;
            // In q's dtype: its gradient comes back in that dtype.
            let typed = randn(&[1, h, sq, sk], dtype, seed + 4, &Device::Cpu)?;
            // Key block 0 stays open, so that every row sees a key.
            let (nq, nk) = (sq.div_ceil(16), sk.div_ceil(8));
            let mut m = blocks_of(&[1, h, nq, nk], seed + 2)?
                .flatten_all()?
                .to_vec1::<u8>()?;
            m.iter_mut().step_by(nk).for_each(|x| *x = 1);
            let blocks = Tensor::from_vec(m, (1, h, nq, nk), &Device::Cpu)?;
            let cases = [
                FlashAttn::new(scale(d)).causal().bias(&pad),
                FlashAttn::new(scale(d))
                    .window(Some(7), Some(2))
                    .softcap(3.0)
                    .bias(&full),
                FlashAttn::new(scale(d))
                    .block_mask(&blocks, 16, 8)
                    .bias(&pad),
                FlashAttn::new(scale(d)).causal().bias(&per_head),
                FlashAttn::new(scale(d)).window(Some(11), None).bias(&typed),
            ];
            for opts in cases {
                let what = format!("{:?}", c.clone().with(opts.clone()));
                let op = t.op(&opts);
                let fast = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
                let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &op))?;
                let r = reference_grads(&q, &k, &v, &g, &opts)?;
                check_grads(&what, &fast, &naive, &r, [&q, &k, &v]);
                // The bias's own gradient.
                let bias = opts.bias.clone().expect("every case has a bias");
                let r_bias = dbias_of(&r, (2, h, sq, sk), bias.dims());
                let tracked = |f: &dyn Fn(&FlashAttn) -> Result<Tensor>| -> Result<Tensor> {
                    let var = Var::from_tensor(&t.put(&bias)?)?;
                    let mut o = op.clone();
                    o.bias = Some(var.as_tensor().clone());
                    let out = f(&o)?;
                    let loss = (out.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?;
                    let grads = loss.backward()?;
                    let db = grads.get(var.as_tensor()).cloned();
                    db.ok_or_else(|| candle::Error::Msg("no gradient reached the bias".into()))
                };
                let fast_bias = tracked(&|o| o.forward(&q, &k, &v))?;
                let naive_bias = tracked(&|o| naive_attention(&q, &k, &v, o))?;
                let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
                let all = op.backward_all(&q, &k, &v, &out, &g, &lse)?;
                let from_all = all.dbias.expect("backward_all returns dbias with a bias");
                for (how, db) in [("autograd", &fast_bias), ("backward_all", &from_all)] {
                    let what = format!("{what} dbias ({how})");
                    check_grad(&what, db, &naive_bias, &r_bias, &bias);
                }
            }
        }
    }
    Ok(())
}
test_device!(bias_and_block_mask_gradients, Backward);

/// A call without scores (no query row) gives the bias a zero gradient of its own shape.
#[test]
fn bias_gradient_without_scores_is_zero() -> Result<()> {
    let dev = Device::Cpu;
    let bias = Tensor::ones((1, 2, 1, 5), DType::F32, &dev)?;
    let opts = FlashAttn::new(0.5).bias(&bias);
    let q = Tensor::zeros((1, 0, 2, 8), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 5, 2, 8), DType::F32, &dev)?;
    let (out, lse) = opts.forward_with_lse(&q, &k, &k)?;
    let g = opts.backward_all(&q, &k, &k, &out, &out, &lse)?;
    let db = g.dbias.expect("a bias gets a gradient");
    assert_eq!(db.dims(), bias.dims());
    assert_eq!(db.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

/// Bad biases and block masks are errors naming them; what runs nowhere yet says so.
#[test]
fn bias_and_block_mask_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((2, 5, 4, 8), DType::F32, &dev)?;
    let k = Tensor::zeros((2, 7, 2, 8), DType::F32, &dev)?;
    let err = |opts: FlashAttn, name: &str| {
        let e = opts.forward(&q, &k, &k).expect_err(name).to_string();
        assert!(e.contains(name), "error for {name} does not name it: {e}");
    };
    let base = FlashAttn::new(0.3);
    err(
        base.clone()
            .bias(&Tensor::zeros((2, 4, 5, 6), DType::F32, &dev)?),
        "bias",
    );
    err(
        base.clone()
            .bias(&Tensor::zeros((3, 1, 1, 7), DType::F32, &dev)?),
        "bias",
    );
    err(
        base.clone()
            .bias(&Tensor::zeros((1, 2, 4, 5, 7), DType::F32, &dev)?),
        "bias",
    );
    err(
        base.clone().bias(&Tensor::zeros((7,), DType::F16, &dev)?),
        "bias",
    );
    let blocks = Tensor::ones((1, 1, 2, 2), DType::U8, &dev)?;
    err(base.clone().block_mask(&blocks, 0, 4), "block_mask");
    err(base.clone().block_mask(&blocks, 4, 2), "block_mask");
    err(
        base.clone().block_mask(&blocks.to_dtype(DType::F32)?, 4, 4),
        "block_mask",
    );
    // Packed calls: the bias and the block mask span max_seqlen_q and max_seqlen_k.
    let cu = Tensor::new(&[0u32, 5], &dev)?;
    let cuk = Tensor::new(&[0u32, 7], &dev)?;
    let varlen = |o: FlashAttn, max_k: usize| {
        o.forward_varlen(&q.get(0)?, &k.get(0)?, &k.get(0)?, &cu, &cuk, 5, max_k)
    };
    let keys = |n: usize| Tensor::zeros((n,), DType::F32, &dev);
    varlen(base.clone().bias(&keys(7)?), 7)?;
    varlen(base.clone().bias(&keys(9)?), 9)?;
    for (o, max_k, name) in [
        (base.clone().bias(&keys(7)?), 9, "bias"),
        (base.clone().bias(&keys(6)?), 7, "bias"),
        (base.clone().block_mask(&blocks, 4, 2), 7, "block_mask"),
    ] {
        let e = varlen(o, max_k).expect_err(name).to_string();
        assert!(e.contains(name), "{e}");
    }
    // Not with prefix ranges; a tracked bias gets no gradient through a KV-cache call.
    let ranges = Tensor::new(&[[[0i32, 2]], [[0, 2]]], &dev)?;
    let e = base
        .clone()
        .bias(&keys(7)?)
        .mm_prefix_ranges(&ranges)
        .forward(&q, &k, &k)
        .expect_err("bias with prefix ranges")
        .to_string();
    assert!(e.contains("bias") && e.contains("mm_prefix_ranges"), "{e}");
    let var = Var::from_tensor(&Tensor::zeros((2, 1, 1, 7), DType::F32, &dev)?)?;
    let lens = Tensor::new(&[3u32, 4], &dev)?;
    let e = base
        .clone()
        .bias(var.as_tensor())
        .forward_kvcache(&q.narrow(1, 0, 1)?, &k, &k, &lens, None)
        .expect_err("tracked bias in a KV-cache call")
        .to_string();
    assert!(e.contains("bias") && e.contains("KV-cache"), "{e}");
    Ok(())
}
