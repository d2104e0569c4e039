//! The backward pass: gradients of q, k and v through `FlashAttn` against the f64 analytic
//! reference (`common::grad`, itself checked against central differences), with candle autograd
//! through `naive_attention` in the same dtype on the same device as the precision yardstick;
//! bitwise determinism; layouts. Every property runs on the CPU and, with the `cuda` feature, on
//! the GPU in each backward configuration (the portable kernels and the named sm_90a instances
//! on Hopper; tests/common/device.rs).
//!
//! ```text
//! cargo test --release --test backward
//! ```

#[macro_use]
mod common;

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::{naive_attention, FlashAttn};

use common::device::{bwd_variant_pick, bwd_variant_sets};
use common::grad::{
    autograd, check_grads, grad_bytes, reference_grads, reference_grads_varlen, Grads, RefGrads,
};
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// `Σ reference(q, k, v) ∘ g` in f64.
fn ref_loss(q: &Tensor, k: &Tensor, v: &Tensor, g: &[f64], opts: &FlashAttn) -> Result<f64> {
    let (out, _) = reference(q, k, v, opts)?;
    Ok(out.iter().zip(g).map(|(a, b)| a * b).sum())
}

/// The analytic reference agrees with central differences of the f64 forward reference, with
/// every option on (causal window, softcap, ALiBi, GQA, a row that sees no key). (The reference
/// only: host f64, no device.)
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
        let gv = values(&g)?;
        let RefGrads { dq, dk, dv, .. } = reference_grads(&q, &k, &v, &g, &opts)?;
        let eps = 1e-6;
        let numeric = |t: &Tensor, which: usize| -> Result<Vec<f64>> {
            let base = values(t)?;
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
            let err = max_abs_err_slice(analytic, &num).expect("finite");
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

/// The `bwd-...` configurations of the GPU matrix make the planner pick every named sm_90a
/// backward instance of `BWD_SM90` (dK/dV and dQ, each head dim, with and without score
/// modifiers) at least once. (The table and the planner's rule only: no device.)
#[test]
fn bwd_variant_configs_cover_every_hopper_instance() {
    use common::bwd_instances::BWD_SM90;
    let sets = bwd_variant_sets();
    for i in BWD_SM90.iter().filter(|i| !i.variant.is_empty()) {
        let reached = sets.iter().any(|names| {
            [false, true].iter().any(|&mods| {
                (i.mods || !mods) && bwd_variant_pick(i.dkdv(), i.d, mods, names) == Some(*i)
            })
        });
        assert!(
            reached,
            "{}: no backward configuration of the test matrix ({sets:?}) reaches it",
            i.name
        );
    }
}

/// (head dim, dtype) pairs that reach every CUDA backward kernel family: the exact kernels (f32,
/// d 40) and the tensor-core ones (d 64 and 128, f16 and bf16; on Hopper the sm_90a instances).
const FAMILIES: [(usize, DType); 5] = [
    (40, DType::F32),
    (64, DType::BF16),
    (64, DType::F16),
    (128, DType::BF16),
    (128, DType::F16),
];

/// The families case `n` of a sweep runs: every one on a GPU; on the CPU, whose one kernel serves
/// every head dim, one of the first three (each dtype once, at head dims whose f64 references
/// and half-precision autograd yardstick stay cheap).
fn families(t: &Target, n: usize) -> &'static [(usize, DType)] {
    match t.is_cuda() {
        true => &FAMILIES,
        false => &FAMILIES[n % 3..n % 3 + 1],
    }
}

/// Flash gradients (through `FlashAttn::forward`, outputs poisoned first) against the reference,
/// with naive autograd on the same device as the yardstick. Returns the flash gradients.
fn check(t: &Target, c: &Case, seed: u64) -> Result<Grads> {
    let (q, k, v, g) = c.grad_inputs(t, seed)?;
    check_inputs(t, &format!("{c:?}"), &q, &k, &v, &g, &c.opts)
}

/// [`check`] on given inputs, on the target's device.
fn check_inputs(
    t: &Target,
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    opts: &FlashAttn,
) -> Result<Grads> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let op = t.op(opts);
    t.poison(&grad_bytes(q.dtype(), b * sq, h, b * sk, hk, d))?;
    let fast = autograd(q, k, v, g, |q, k, v| op.forward(q, k, v))?;
    let naive = autograd(q, k, v, g, |q, k, v| naive_attention(q, k, v, &op))?;
    let r = reference_grads(q, k, v, g, opts)?;
    check_grads(what, &fast, &naive, &r, [q, k, v]);
    Ok(fast)
}

/// Odd lengths both ways, causal or not: on the tensor-core head dims (64, 128) in f16 and bf16,
/// and on the exact kernels (f32, d 40).
fn odd_lengths_both_ways(t: &Target) -> Result<()> {
    let pairs: &[(usize, usize)] = if t.small() {
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
    for (i, &(sq, sk)) in pairs.iter().enumerate() {
        for causal in [false, true] {
            for &(d, dtype) in families(t, 2 * i + causal as usize) {
                let c = Case::new(2, sq, sk, 4, 2, d, dtype);
                let c = if causal { c.causal() } else { c };
                check(t, &c, sq as u64)?;
            }
        }
    }
    Ok(())
}
test_device!(odd_lengths_both_ways, Backward);

/// GQA with 6 query heads over 6, 3, 2 and 1 K/V heads (dk, dv summed over each group), at
/// head dims of every kernel family.
fn gqa_6_3_2_1_and_head_dims(t: &Target) -> Result<()> {
    for (hk, d) in [(6, 24), (3, 64), (2, 80), (1, 200), (6, 1), (2, 512)] {
        check(
            t,
            &Case::new(1, 97, 150, 6, hk, d, DType::F32).causal(),
            hk as u64,
        )?;
    }
    // The tensor-core kernels on a GPU (the CPU's half-precision GQA is in `half_precision`).
    if t.is_cuda() {
        for hk in [6, 3, 2, 1] {
            for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (80, DType::BF16)] {
                check(
                    t,
                    &Case::new(1, 97, 150, 6, hk, d, dtype).causal(),
                    hk as u64,
                )?;
            }
        }
    }
    Ok(())
}
test_device!(gqa_6_3_2_1_and_head_dims, Backward);

/// Head dims off the tensor-core path (and f32 everywhere): the exact kernels, up to 512.
fn other_head_dims(t: &Target) -> Result<()> {
    let dims: &[usize] = if t.small() {
        &[24, 96]
    } else {
        &[1, 8, 24, 40, 80, 96, 128, 200, 256, 320, 512]
    };
    for (i, &d) in dims.iter().enumerate() {
        for &dtype in t.sweep(&DTYPES, i) {
            check(t, &Case::new(1, 70, 90, 4, 2, d, dtype).causal(), d as u64)?;
        }
    }
    Ok(())
}
test_device!(other_head_dims, Backward);

/// Sliding windows, ALiBi (per head and per sequence) and softcap, alone and together.
fn windows_alibi_softcap(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let per_head = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &cpu)?;
    let per_batch = Tensor::new(&[[0.3f32, 0.1, 0.05, 0.0], [0.2, 0.4, 0.0, 0.01]], &cpu)?;
    let options = |d: usize| {
        let s = scale(d);
        [
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
        ]
    };
    for n in 0..10 {
        for &(d, dtype) in families(t, n) {
            // 101 keys for the exact kernels (fewer keys than rows), 201 for the tensor cores
            // (a partial third key tile).
            let sk = if dtype == DType::F32 { 101 } else { 201 };
            let opts = options(d)[n].clone();
            check(
                t,
                &Case::new(2, 130, sk, 4, 2, d, dtype).with(opts),
                10 + n as u64,
            )?;
        }
    }
    Ok(())
}
test_device!(windows_alibi_softcap, Backward);

/// f16 and bf16 with GQA down to MQA, a window with softcap and ALiBi together.
fn half_precision(t: &Target) -> Result<()> {
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625, 0.03, 0.01], &Device::Cpu)?;
    for dtype in [DType::F16, DType::BF16] {
        for c in [
            Case::new(1, 113, 203, 6, 2, 40, dtype).causal(),
            Case::new(2, 90, 70, 6, 3, 64, dtype),
            Case::new(1, 100, 140, 6, 1, 96, dtype).with(
                FlashAttn::new(scale(96))
                    .window(Some(40), Some(3))
                    .softcap(4.0)
                    .alibi(&slopes),
            ),
        ] {
            check(t, &c, 20)?;
        }
    }
    Ok(())
}
test_device!(half_precision, Backward);

/// Many key and query tiles (sums over dozens of tiles in dq and dk/dv).
fn long_sequence(t: &Target) -> Result<()> {
    check(
        t,
        &Case::new(1, 1500, 1700, 2, 1, 64, DType::F32).causal(),
        35,
    )?;
    check(t, &Case::new(1, 1100, 900, 2, 2, 64, DType::BF16), 36)?;
    Ok(())
}
test_device!(long_sequence, Backward);

/// Decode-shaped calls: a few queries against many keys, GQA.
fn decode_shaped(t: &Target) -> Result<()> {
    let families = [(64, DType::F32), (128, DType::BF16), (64, DType::F16)];
    for (i, (b, sq, sk, h, hk)) in [(3, 1, 300, 8, 2), (1, 4, 517, 8, 1), (2, 16, 700, 6, 6)]
        .into_iter()
        .enumerate()
    {
        for &(d, dtype) in t.sweep(&families, i) {
            check(t, &Case::new(b, sq, sk, h, hk, d, dtype).causal(), 30)?;
        }
    }
    Ok(())
}
test_device!(decode_shaped, Backward);

/// Causal with more queries than keys: the leading rows see no key; their dq is exactly 0, and
/// nothing anywhere is NaN. A window that leaves rows and keys out entirely too.
fn fully_masked_rows_give_zero_gradients(t: &Target) -> Result<()> {
    let all = [
        (32, DType::F32),
        (32, DType::F16),
        (32, DType::BF16),
        (64, DType::BF16),
        (128, DType::F16),
    ];
    // The tensor-core head dims select kernels on a GPU only.
    let n = if t.is_cuda() { all.len() } else { 3 };
    for &(d, dtype) in &all[..n] {
        let (sq, sk, h) = (150, 40, 4);
        let g = check(t, &Case::new(1, sq, sk, h, 2, d, dtype).causal(), 40)?;
        let dq = values(&g.0)?;
        let masked = sq - sk;
        assert!(
            dq[..masked * h * d].iter().all(|&x| x == 0.0),
            "{dtype:?} d {d}: masked rows"
        );
        assert!(dq[masked * h * d..].iter().any(|&x| x != 0.0));
        for x in [&g.0, &g.1, &g.2] {
            assert!(
                values(x)?.iter().all(|x| x.is_finite()),
                "{dtype:?} d {d}: NaN"
            );
        }
        let c = Case::new(1, 60, 200, 2, 1, d, dtype)
            .with(FlashAttn::new(0.25).window(Some(0), Some(0)));
        check(t, &c, 41)?;
    }
    Ok(())
}
test_device!(fully_masked_rows_give_zero_gradients, Backward);

/// One varlen backward check: packed q, k, v and the output gradient of `r` on the target, the
/// pool poisoned, flash gradients against the reference with naive autograd per sequence as the
/// yardstick. Returns the flash gradients.
#[allow(clippy::too_many_arguments)]
fn check_varlen_grads(
    t: &Target,
    what: &str,
    r: &Ragged,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
    opts: &FlashAttn,
    seed: u64,
) -> Result<Grads> {
    let q = randn(&[r.total_q, h, d], dtype, seed, &t.dev)?;
    let k = randn(&[r.total_k, hk, d], dtype, seed + 1, &t.dev)?;
    let v = randn(&[r.total_k, hk, d], dtype, seed + 2, &t.dev)?;
    let g = randn(&[r.total_q, h, d], dtype, seed + 3, &t.dev)?;
    let (cq, ck) = r.tensors(t)?;
    let op = t.op(opts);
    t.poison(&grad_bytes(dtype, r.total_q, h, r.total_k, hk, d))?;
    let fast = autograd(&q, &k, &v, &g, |q, k, v| {
        op.forward_varlen(q, k, v, &cq, &ck, r.max_q, r.max_k)
    })?;
    let naive = autograd(&q, &k, &v, &g, |q, k, v| {
        naive_varlen(q, k, v, &r.cu_q, &r.cu_k, &op)
    })?;
    let reference = reference_grads_varlen(&q, &k, &v, &g, &r.cu_q, &r.cu_k, opts)?;
    check_grads(what, &fast, &naive, &reference, [&q, &k, &v]);
    Ok(fast)
}

/// Varlen calls with the lengths on the device: an empty query sequence, a sequence with no keys
/// (zero dq rows), odd lengths, more queries than keys; every option with per-sequence ALiBi
/// slopes; the ragged batch of the forward tests on the tensor-core head dims.
fn varlen(t: &Target) -> Result<()> {
    let r = Ragged::new(&[(37, 50), (0, 11), (103, 0), (1, 139), (159, 133)]);
    let (h, hk, d) = (4, 2, 40);
    let slopes = Tensor::new(
        &[
            [0.1f32, 0.2, 0.3, 0.4],
            [0.0, 0.1, 0.0, 0.1],
            [0.5, 0.5, 0.5, 0.5],
            [0.01, 0.02, 0.03, 0.04],
            [0.2, 0.0, 0.2, 0.0],
        ],
        &Device::Cpu,
    )?;
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
            let what = format!("varlen {dtype:?} {n}");
            let fast = check_varlen_grads(t, &what, &r, h, hk, d, dtype, opts, 50 + n as u64)?;
            // Sequence 2 has queries but no keys: zero dq rows.
            let dq = values(&fast.0)?;
            let (q0, q1) = (r.cu_q[2] as usize, r.cu_q[3] as usize);
            assert!(dq[q0 * h * d..q1 * h * d].iter().all(|&x| x == 0.0));
        }
    }
    let ragged = Ragged::standard(t);
    let slopes6 = Tensor::new(&[0.5f32, 0.25, 0.125, 0.1, 0.05, 0.3], &Device::Cpu)?;
    // On a GPU every tensor-core head dim and the exact kernels; on the CPU (whose varlen path the
    // batch above covers in every dtype) the first, with each option.
    let ragged_families: &[(usize, DType)] = match t.is_cuda() {
        true => &[
            (64, DType::BF16),
            (128, DType::F16),
            (96, DType::BF16),
            (40, DType::F32),
        ],
        false => &[(64, DType::BF16)],
    };
    for i in 0..3 {
        for &(d, dtype) in ragged_families {
            let opts = [
                FlashAttn::new(scale(d)).causal(),
                FlashAttn::new(scale(d)).alibi(&slopes6).softcap(4.0),
                FlashAttn::new(scale(d)).window(Some(20), Some(3)),
            ];
            let what = format!("ragged varlen {dtype:?} d {d} {:?}", opts[i]);
            check_varlen_grads(t, &what, &ragged, 6, 2, d, dtype, &opts[i], 5)?;
        }
    }
    Ok(())
}
test_device!(varlen, Backward);

/// The public functions carry gradients to q, k and v, equal to those of the options-struct
/// call they wrap (they take no kernel configuration, so the checks run in the default one).
fn public_functions(t: &Target) -> Result<()> {
    let c = Case::new(2, 70, 90, 4, 2, 32, DType::F32);
    let (q, k, v, g) = c.grad_inputs(t, 60)?;
    let s = scale(32);
    let slopes = t.put(&Tensor::new(&[0.2f32, 0.1, 0.05, 0.3], &Device::Cpu)?)?;
    let via_fn = autograd(&q, &k, &v, &g, |q, k, v| {
        candle_flash::flash_attn(q, k, v, s, true)
    })?;
    let opts = FlashAttn::new(s).causal();
    let r = reference_grads(&q, &k, &v, &g, &opts)?;
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &opts))?;
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
    })?;
    let opts = FlashAttn::new(s)
        .window(Some(9), Some(2))
        .softcap(6.0)
        .alibi(&slopes);
    let r = reference_grads(&q, &k, &v, &g, &opts)?;
    let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &opts))?;
    check_grads(
        "flash_attn_alibi_windowed_softcap",
        &via_windowed,
        &naive,
        &r,
        [&q, &k, &v],
    );
    // Varlen: the two sequences of the batch packed give the dense call's gradients.
    let flat = |x: &Tensor| x.flatten_to(1);
    let (q3, k3, v3, g3) = (flat(&q)?, flat(&k)?, flat(&v)?, flat(&g)?);
    let cq = Tensor::new(&[0u32, 70, 140], &t.dev)?;
    let ck = Tensor::new(&[0u32, 90, 180], &t.dev)?;
    let via_varlen = autograd(&q3, &k3, &v3, &g3, |q, k, v| {
        candle_flash::flash_attn_varlen(q, k, v, &cq, &ck, 70, 90, s, true)
    })?;
    let dense = autograd(&q, &k, &v, &g, |q, k, v| {
        candle_flash::flash_attn(q, k, v, s, true)
    })?;
    for (a, b, name) in [
        (&via_varlen.0, &dense.0, "dq"),
        (&via_varlen.1, &dense.1, "dk"),
        (&via_varlen.2, &dense.2, "dv"),
    ] {
        assert_bitwise_eq(&format!("varlen vs dense {name}"), a, &flat(b)?);
    }
    Ok(())
}
test_device!(public_functions, Once);

/// Non-contiguous q, k, v: gradients flow back through the views to their buffers.
/// * q, k and v through transposed storage: bitwise the gradients of the contiguous call (on a
///   GPU too: the same kernels read the strides).
/// * k inside a NaN-padded buffer: the padding gets exactly 0 (the NaN is never read); bitwise
///   the contiguous gradients on the CPU, on a GPU within the rule of the reference, since its
///   rows are not 16-byte aligned there and the exact kernels run instead of the tensor cores.
/// * k at an odd element offset (likewise misaligned) matches the reference.
fn non_contiguous_inputs_are_bitwise_equal(t: &Target) -> Result<()> {
    let all = [
        (40, DType::F32),
        (40, DType::F16),
        (40, DType::BF16),
        (64, DType::BF16),
        (128, DType::F16),
    ];
    // The tensor-core head dims select kernels on a GPU only.
    let n = if t.is_cuda() { all.len() } else { 3 };
    for &(d, dtype) in &all[..n] {
        let c = Case::new(2, 77, 91, 6, 2, d, dtype).causal().softcap(4.0);
        let what = format!("{c:?}");
        let (q, k, v, g) = c.grad_inputs(t, 70)?;
        let op = t.op(&c.opts);
        let want = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
        // Gradients of the loss through a call on views of three Vars.
        let loss_grads = |views: [Tensor; 3]| -> Result<candle::backprop::GradStore> {
            assert!(views.iter().all(|v| !v.is_contiguous()));
            let out = op.forward(&views[0], &views[1], &views[2])?;
            (out.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?
                .sum_all()?
                .backward()
        };

        // Transposed storage, all three.
        let (qvar, kvar, vvar) = (
            Var::from_tensor(&q)?,
            Var::from_tensor(&k)?,
            Var::from_tensor(&v)?,
        );
        let views = [
            transposed_view(qvar.as_tensor())?,
            transposed_view(kvar.as_tensor())?,
            transposed_view(vvar.as_tensor())?,
        ];
        let grads = loss_grads(views)?;
        for (name, x, w) in [
            ("dq", &qvar, &want.0),
            ("dk", &kvar, &want.1),
            ("dv", &vvar, &want.2),
        ] {
            let dx = grads.get(x.as_tensor()).expect(name);
            assert_bitwise_eq(&format!("{what} transposed {name}"), dx, w);
        }

        // k inside a NaN-padded buffer (q and v transposed as well).
        let dims: Vec<usize> = k.dims().iter().map(|&n| n + 3).collect();
        let ranges: Vec<_> = k.dims().iter().map(|&n| 1..1 + n).collect();
        let kbuf = Tensor::full(f32::NAN, dims.as_slice(), &t.dev)?
            .to_dtype(dtype)?
            .slice_assign(&ranges, &k)?;
        let (qvar, kvar, vvar) = (
            Var::from_tensor(&q)?,
            Var::from_tensor(&kbuf)?,
            Var::from_tensor(&v)?,
        );
        let inner =
            |x: &Tensor| (0..4).try_fold(x.clone(), |x, axis| x.narrow(axis, 1, k.dim(axis)?));
        let views = [
            transposed_view(qvar.as_tensor())?,
            inner(kvar.as_tensor())?,
            transposed_view(vvar.as_tensor())?,
        ];
        let grads = loss_grads(views)?;
        let dq = grads.get(qvar.as_tensor()).expect("dq").clone();
        let dkbuf = grads.get(kvar.as_tensor()).expect("dk");
        let dv = grads.get(vvar.as_tensor()).expect("dv").clone();
        let dk = inner(dkbuf)?;
        let total: f64 = values(dkbuf)?.iter().map(|x| x.abs()).sum();
        let interior: f64 = values(&dk)?.iter().map(|x| x.abs()).sum();
        assert_eq!(total, interior, "{what}: gradient leaked into the padding");
        let got = (dq, dk, dv);
        if t.is_cuda() {
            let naive = autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &op))?;
            let r = reference_grads(&q, &k, &v, &g, &c.opts)?;
            check_grads(
                &format!("{what} k in a NaN buffer"),
                &got,
                &naive,
                &r,
                [&q, &k, &v],
            );
        } else {
            assert_bitwise_eq(&format!("{what} k in a NaN buffer dq"), &got.0, &want.0);
            assert_bitwise_eq(&format!("{what} k in a NaN buffer dk"), &got.1, &want.1);
            assert_bitwise_eq(&format!("{what} k in a NaN buffer dv"), &got.2, &want.2);
        }

        // k at element offset 1 of a larger buffer.
        let n = c.b * c.sk * c.hk * d;
        let ko = randn(&[n + 1], dtype, 51, &t.dev)?
            .narrow(0, 1, n)?
            .reshape((c.b, c.sk, c.hk, d))?;
        check_inputs(t, &format!("offset k {what}"), &q, &ko, &v, &g, &c.opts)?;
    }
    Ok(())
}
test_device!(non_contiguous_inputs_are_bitwise_equal, Backward);

/// NaN and infinity in the K and V of keys that some rows do not see reach only the gradients
/// the reference gives them: a masked key has dS = 0, and `dS · K` must not turn that into
/// 0 · NaN = NaN in the dq of rows that do not see it.
fn non_finite_keys_reach_only_the_gradients_that_see_them(t: &Target) -> Result<()> {
    let (sq, sk, h, d) = (150, 150, 2, 40);
    let q = randn(&[1, sq, h, d], DType::F32, 61, &t.dev)?;
    let g = randn(&[1, sq, h, d], DType::F32, 62, &t.dev)?;
    let plant = |x: Tensor, at: &[(usize, f64)]| -> Result<Tensor> {
        let mut x = values(&x)?;
        for &(key, val) in at {
            x[key * d..(key + 1) * d].fill(val);
        }
        t.put(&Tensor::from_vec(x, (1, sk, 1, d), &Device::Cpu)?.to_dtype(DType::F32)?)
    };
    let k = plant(
        randn(&[1, sk, 1, d], DType::F32, 63, &t.dev)?,
        &[(100, f64::NAN), (37, f64::INFINITY)],
    )?;
    let v = plant(
        randn(&[1, sk, 1, d], DType::F32, 64, &t.dev)?,
        &[(64, f64::NAN)],
    )?;
    for opts in [
        FlashAttn::new(0.2).causal(),
        FlashAttn::new(0.2).window(Some(20), Some(5)),
    ] {
        let op = t.op(&opts);
        let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
        let (dq, dk, dv) = op.backward(&q, &k, &v, &out, &g, &lse)?;
        let r = reference_grads(&q, &k, &v, &g, &opts)?;
        assert!(
            r.dq.iter().any(|x| x.is_finite()) && r.dq.iter().any(|x| !x.is_finite()),
            "{opts:?}: the planted keys should poison some dq rows and spare others"
        );
        for (name, fast, want) in [("dq", &dq, &r.dq), ("dk", &dk, &r.dk), ("dv", &dv, &r.dv)] {
            let got = values(fast)?;
            let err = max_abs_err_slice(&got, want).unwrap_or_else(|| {
                panic!(
                    "{opts:?} {name}: non-finite where the reference is not, or back ({})",
                    first_non_finite_disagreement(&got, want)
                )
            });
            assert!(err <= 1e-4, "{opts:?} {name}: max abs err {err:.3e}");
        }
    }
    Ok(())
}
test_cpu!(non_finite_keys_reach_only_the_gradients_that_see_them);

/// Repeated backward passes give the same bits, with `deterministic(false)` and `(true)` as
/// without. On a GPU, 20 runs each of long calls on the
/// tensor-core kernels (causal and not, GQA, a window over several key tiles) and on the exact
/// ones; the CPU's schedule depends on the shape and the thread count only
/// (`same_bits_on_any_thread_count`), so two runs of one call there.
fn deterministic_across_runs(t: &Target) -> Result<()> {
    let (runs, cases) = if t.is_cuda() {
        (
            if t.small() { 2 } else { 20 },
            vec![
                Case::new(2, 1000, 1100, 8, 2, 128, DType::BF16).causal(),
                Case::new(1, 700, 513, 6, 3, 64, DType::F16),
                Case::new(1, 900, 1000, 4, 2, 64, DType::BF16).window(Some(300), Some(40)),
                Case::new(1, 200, 300, 4, 1, 96, DType::BF16).causal(),
                Case::new(1, 100, 150, 4, 2, 40, DType::F32),
            ],
        )
    } else {
        (
            2,
            vec![Case::new(1, 200, 333, 6, 2, 64, DType::F32)
                .causal()
                .softcap(5.0)],
        )
    };
    for c in cases {
        let (q, k, v, g) = c.grad_inputs(t, 60)?;
        let op = t.op(&c.opts);
        let first = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
        // FlashAttention's `deterministic` argument changes nothing: every backward is.
        let flags = [false, true].map(|on| op.clone().deterministic(on));
        for run in 1..runs.max(3) {
            let op = if run < 3 { &flags[run - 1] } else { &op };
            let again = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
            let what = format!("{c:?} run {run}");
            assert_bitwise_eq(&format!("{what} dq"), &first.0, &again.0);
            assert_bitwise_eq(&format!("{what} dk"), &first.1, &again.1);
            assert_bitwise_eq(&format!("{what} dv"), &first.2, &again.2);
        }
    }
    Ok(())
}
test_device!(deterministic_across_runs, Backward);

/// 1, 2 and 3 CPU threads (which switch between the fused and the split dQ schedule) give the
/// same bits. (CPU only: rayon's thread count.)
#[test]
fn same_bits_on_any_thread_count() {
    let t = Target::cpu();
    let c = Case::new(1, 200, 333, 6, 2, 64, DType::F32)
        .causal()
        .softcap(5.0);
    let (q, k, v, g) = c.grad_inputs(&t, 80).unwrap();
    let run = || autograd(&q, &k, &v, &g, |q, k, v| c.opts.forward(q, k, v)).unwrap();
    let first = run();
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
}

/// Paged, KV-cache and prefix-range calls have no backward pass: `backward` is an error
/// naming the reason, not a silent zero.
fn inference_only_calls_refuse_backward(t: &Target) -> Result<()> {
    let dev = &t.dev;
    let q = Var::from_tensor(&randn(&[2, 2, 8], DType::F32, 90, dev)?)?;
    let kv = randn(&[6, 2, 1, 8], DType::F32, 91, dev)?;
    let table = Tensor::new(&[[4u32, 1, 0], [2, 5, 3]], dev)?;
    let cu_q = Tensor::new(&[0u32, 1, 2], dev)?;
    let cu_k = Tensor::new(&[0u32, 3, 8], dev)?;
    let out = t
        .op(&FlashAttn::new(0.35).paged(&table, 2))
        .forward_varlen(q.as_tensor(), &kv, &kv, &cu_q, &cu_k, 1, 5)?;
    let err = out.sum_all()?.backward().unwrap_err().to_string();
    assert!(err.contains("paged"), "{err}");

    let q = Var::from_tensor(&randn(&[1, 2, 2, 8], DType::F32, 92, dev)?)?;
    let cache = Tensor::zeros((1, 16, 1, 8), DType::F32, dev)?;
    let lens = Tensor::new(&[3u32], dev)?;
    let out = t.op(&FlashAttn::new(0.35).causal()).forward_kvcache(
        q.as_tensor(),
        &cache,
        &cache,
        &lens,
        None,
    )?;
    let err = out.sum_all()?.backward().unwrap_err().to_string();
    assert!(err.contains("KV-cache"), "{err}");

    let q = Var::from_tensor(&randn(&[1, 6, 2, 8], DType::F32, 93, dev)?)?;
    let kv = randn(&[1, 6, 2, 8], DType::F32, 94, dev)?;
    let ranges = Tensor::new(&[[[0i32, 4]]], dev)?;
    let out = t
        .op(&FlashAttn::new(0.35).causal().mm_prefix_ranges(&ranges))
        .forward(q.as_tensor(), &kv, &kv)?;
    let err = out.sum_all()?.backward().unwrap_err().to_string();
    assert!(err.contains("mm_prefix_ranges"), "{err}");
    Ok(())
}
test_device!(inference_only_calls_refuse_backward, Once);

/// No keys at all (`sk = 0`): dq is exactly 0. The empty k and v get empty gradients on the CPU
/// and no gradient entry on CUDA, where candle would seed one with a zero-byte allocation, which
/// the driver refuses (the library documents this).
fn no_keys_gives_zero_dq(t: &Target) -> Result<()> {
    for dtype in DTYPES {
        let q = Var::from_tensor(&randn(&[2, 3, 4, 64], dtype, 100, &t.dev)?)?;
        let k = Var::from_tensor(&empty(&[2, 0, 2, 64], dtype, &t.dev)?)?;
        let v = Var::from_tensor(&empty(&[2, 0, 2, 64], dtype, &t.dev)?)?;
        let (out, lse) = t.op(&FlashAttn::new(0.125)).forward_with_lse(&q, &k, &v)?;
        assert_eq!(out.dims(), q.dims());
        assert!(values(&out)?.iter().all(|&x| x == 0.0), "{dtype:?}: out");
        assert!(
            values(&lse)?.iter().all(|&x| x == f64::NEG_INFINITY),
            "{dtype:?}: lse"
        );
        let g = randn(q.dims(), dtype, 101, &t.dev)?;
        let grads = (out * g)?.sum_all()?.backward()?;
        let dq = grads.get(&q).expect("q gets a gradient");
        assert_eq!(dq.dims(), q.dims());
        assert!(values(dq)?.iter().all(|&x| x == 0.0), "{dtype:?}: dq");
        for (name, x) in [("k", &k), ("v", &v)] {
            match grads.get(x) {
                Some(dx) => {
                    assert!(!t.is_cuda(), "{dtype:?}: d{name} on CUDA");
                    assert_eq!(dx.dims(), x.dims(), "{dtype:?}: d{name}");
                }
                None => assert!(t.is_cuda(), "{dtype:?}: no d{name} on the CPU"),
            }
        }
    }
    Ok(())
}
test_device!(no_keys_gives_zero_dq, Backward);

/// No queries (`sq = 0`): the output is empty, yet k and v get gradients, exactly 0; the empty q
/// gets an empty gradient on the CPU and none on CUDA (as for `no_keys_gives_zero_dq`).
fn no_queries_give_zero_dk_dv(t: &Target) -> Result<()> {
    let q = Var::from_tensor(&empty(&[2, 0, 4, 8], DType::F32, &t.dev)?)?;
    let k = Var::from_tensor(&randn(&[2, 5, 2, 8], DType::F32, 102, &t.dev)?)?;
    let v = Var::from_tensor(&randn(&[2, 5, 2, 8], DType::F32, 103, &t.dev)?)?;
    let out = t.op(&FlashAttn::new(0.3).causal()).forward(&q, &k, &v)?;
    assert_eq!(out.dims(), q.dims());
    let grads = out.sum_all()?.backward()?;
    match grads.get(&q) {
        Some(dq) => {
            assert!(!t.is_cuda(), "dq on CUDA");
            assert_eq!(dq.dims(), q.dims());
        }
        None => assert!(t.is_cuda(), "no dq on the CPU"),
    }
    for (name, x) in [("dk", &k), ("dv", &v)] {
        let dx = grads
            .get(x)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(dx.dims(), x.dims(), "{name}");
        assert!(values(dx)?.iter().all(|&x| x == 0.0), "{name}");
    }
    Ok(())
}
test_device!(no_queries_give_zero_dk_dv, Backward);

/// Scores around 1e4 with one winning key (`planted_winner`), in every dtype: P is one-hot, so dq
/// and dk are 0 up to rounding, dv of the winner is the sum of dO, and nothing overflows.
fn large_scores_with_one_winner(t: &Target) -> Result<()> {
    let (q, k, v, winner) = planted_winner()?;
    for dtype in DTYPES {
        let put = |x: &Tensor| t.put(&x.to_dtype(dtype)?);
        let (q, k, v) = (put(&q)?, put(&k)?, put(&v)?);
        let g = randn(q.dims(), dtype, 110, &t.dev)?;
        let opts = FlashAttn::new(1.0);
        let op = t.op(&opts);
        let fast = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
        let r = reference_grads(&q, &k, &v, &g, &opts)?;
        let dv = values(&fast.2)?;
        let d = q.dim(3)?;
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
        for x in [&fast.0, &fast.1] {
            let x = values(x)?;
            assert!(x.iter().all(|x| x.abs() < 1e-3), "{dtype:?}: {x:?}");
        }
    }
    Ok(())
}
test_device!(large_scores_with_one_winner, Backward);

/// Large equal scores in bf16 (q = k = v large, causal): no NaN or Inf in any gradient.
fn large_scores_stay_finite(t: &Target) -> Result<()> {
    for d in [64, 128] {
        let x = (randn(&[1, 64, 2, d], DType::F32, 70, &t.dev)? * 30.0)?.to_dtype(DType::BF16)?;
        let g = randn(&[1, 64, 2, d], DType::BF16, 71, &t.dev)?;
        let op = t.op(&FlashAttn::new(scale(d)).causal());
        let (dq, dk, dv) = autograd(&x, &x, &x, &g, |q, k, v| op.forward(q, k, v))?;
        for (n, x) in [("dq", dq), ("dk", dk), ("dv", dv)] {
            assert!(
                values(&x)?.iter().all(|x| x.is_finite()),
                "d {d} {n}: non-finite"
            );
        }
    }
    Ok(())
}
test_device!(large_scores_stay_finite, Backward);

/// `FlashAttn::backward` and `backward_varlen` give bitwise the gradients that `loss.backward()`
/// gives through the op (dense with GQA, a causal window, softcap and ALiBi, q transposed in
/// storage; varlen with an empty sequence), in f32 and bf16; and refuse saved results that do
/// not belong to the call, naming the argument.
fn explicit_backward_matches_autograd(t: &Target) -> Result<()> {
    let slopes = Tensor::new(&[0.3f32, 0.1, 0.5, 0.05, 0.2, 0.0], &Device::Cpu)?;
    let cases = [
        FlashAttn::new(0.125),
        FlashAttn::new(0.125)
            .window(Some(30), Some(0))
            .softcap(4.0)
            .alibi(&slopes),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (n, opts) in cases.iter().enumerate() {
            let what = format!("{dtype:?} case {n}");
            let c = Case::new(2, 77, 91, 6, 2, 64, dtype).with(opts.clone());
            let (q, k, v, g) = c.grad_inputs(t, 10 + n as u64)?;
            let q = transposed_view(&q)?;
            let op = t.op(opts);
            let want = autograd(&q, &k, &v, &g, |q, k, v| op.forward(q, k, v))?;
            let (out, lse) = op.forward_with_lse(&q, &k, &v)?;
            let got = op.backward(&q, &k, &v, &out, &g, &lse)?;
            assert_bitwise_eq(&format!("{what} dq"), &got.0, &want.0);
            assert_bitwise_eq(&format!("{what} dk"), &got.1, &want.1);
            assert_bitwise_eq(&format!("{what} dv"), &got.2, &want.2);

            // Saved results of another call, or of the wrong kind: errors naming them.
            let expect_err = |r: Result<(Tensor, Tensor, Tensor)>, name: &str| {
                let e = r.expect_err(name).to_string();
                assert!(e.contains(name), "{what}: {e:?} does not name {name}");
            };
            let short = out.narrow(1, 0, c.sq - 1)?;
            expect_err(op.backward(&q, &k, &v, &short, &g, &lse), "out");
            expect_err(op.backward(&q, &k, &v, &out, &short, &lse), "grad_out");
            let lse16 = lse.to_dtype(DType::F16)?;
            expect_err(op.backward(&q, &k, &v, &out, &g, &lse16), "lse");
            let lse_t = lse.narrow(2, 1, c.sq - 1)?;
            expect_err(op.backward(&q, &k, &v, &out, &g, &lse_t), "lse");
            let other = if dtype == DType::F32 {
                DType::BF16
            } else {
                DType::F32
            };
            let out_x = out.to_dtype(other)?;
            expect_err(op.backward(&q, &k, &v, &out_x, &g, &lse), "out");
            let g_int = g.to_dtype(DType::U32)?;
            expect_err(op.backward(&q, &k, &v, &out, &g_int, &lse), "grad_out");
        }
        // Varlen: three sequences, the middle one without queries.
        let r = Ragged::new(&[(37, 50), (0, 11), (83, 79)]);
        let (h, hk, d) = (4, 2, 64);
        let op = t.op(&FlashAttn::new(0.125).causal());
        let q = randn(&[r.total_q, h, d], dtype, 50, &t.dev)?;
        let k = randn(&[r.total_k, hk, d], dtype, 51, &t.dev)?;
        let v = randn(&[r.total_k, hk, d], dtype, 52, &t.dev)?;
        let g = randn(&[r.total_q, h, d], dtype, 53, &t.dev)?;
        let (cq, ck) = r.tensors(t)?;
        let want = autograd(&q, &k, &v, &g, |q, k, v| {
            op.forward_varlen(q, k, v, &cq, &ck, 83, 79)
        })?;
        let (out, lse) = op.forward_varlen_with_lse(&q, &k, &v, &cq, &ck, 83, 79)?;
        let got = op.backward_varlen(&q, &k, &v, &out, &g, &lse, &cq, &ck, 83, 79)?;
        assert_bitwise_eq(&format!("{dtype:?} varlen dq"), &got.0, &want.0);
        assert_bitwise_eq(&format!("{dtype:?} varlen dk"), &got.1, &want.1);
        assert_bitwise_eq(&format!("{dtype:?} varlen dv"), &got.2, &want.2);
    }
    Ok(())
}
test_device!(explicit_backward_matches_autograd, Backward);

/// Packed sequences stay independent: NaN in every element of one sequence (q, k, v and the
/// output gradient) leaves its neighbours' outputs and gradients bitwise unchanged. The Hopper
/// kernels load whole tiles with the tensor copy engine, across sequence ends; the next
/// sequence's rows must not reach this one's products (0 · NaN is NaN). Lengths put a partial
/// tile at every tile size the kernels use; the poisoned sequence sits between two others.
fn nan_in_one_sequence_stays_there(t: &Target) -> Result<()> {
    let r = Ragged::new(&[(100, 100), (77, 77), (203, 203)]);
    let total = r.total_q;
    let (p0, p1) = (r.cu_q[1] as usize, r.cu_q[2] as usize);
    let (cu, _) = r.tensors(t)?;
    let all = [
        (40, DType::F32),
        (64, DType::BF16),
        (128, DType::F16),
        (128, DType::BF16),
    ];
    for causal in [false, true] {
        for &(d, dtype) in t.sweep(&all, causal as usize) {
            let opts = FlashAttn::new(scale(d)).window(None, causal.then_some(0));
            let op = t.op(&opts);
            let (h, hk) = (4, 2);
            let clean = [
                randn(&[total, h, d], dtype, 21, &t.dev)?,
                randn(&[total, hk, d], dtype, 22, &t.dev)?,
                randn(&[total, hk, d], dtype, 23, &t.dev)?,
                randn(&[total, h, d], dtype, 24, &t.dev)?,
            ];
            // Rows p0..p1 (sequence 1) replaced by NaN.
            let poison = |x: &Tensor| -> Result<Tensor> {
                let (_, heads, d) = x.dims3()?;
                let nan = Tensor::full(f32::NAN, (p1 - p0, heads, d), &t.dev)?.to_dtype(dtype)?;
                Tensor::cat(
                    &[&x.narrow(0, 0, p0)?, &nan, &x.narrow(0, p1, total - p1)?],
                    0,
                )
            };
            let dirty = clean.iter().map(poison).collect::<Result<Vec<_>>>()?;
            let run = |x: &[Tensor]| -> Result<[Tensor; 4]> {
                let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    op.forward_varlen(q, k, v, &cu, &cu, r.max_q, r.max_k)
                };
                let out = f(&x[0], &x[1], &x[2])?;
                let (dq, dk, dv) = autograd(&x[0], &x[1], &x[2], &x[3], f)?;
                Ok([out, dq, dk, dv])
            };
            let (a, b) = (run(&clean)?, run(&dirty)?);
            for (name, x, y) in [
                ("out", &a[0], &b[0]),
                ("dq", &a[1], &b[1]),
                ("dk", &a[2], &b[2]),
                ("dv", &a[3], &b[3]),
            ] {
                for (seq, (lo, hi)) in [(0, (0, p0)), (2, (p1, total))] {
                    assert_bitwise_eq(
                        &format!("{dtype:?} d {d} {opts:?}: {name} of sequence {seq}"),
                        &x.narrow(0, lo, hi - lo)?,
                        &y.narrow(0, lo, hi - lo)?,
                    );
                }
            }
        }
    }
    Ok(())
}
test_device!(nan_in_one_sequence_stays_there, Backward);

/// A handful of small ragged calls covering every backward kernel family (tensor-core d 64 / 128,
/// plain and with score modifiers, on Hopper the sm_90a kernels in every configuration; the exact
/// kernels), the subset compute-sanitizer runs. The third shape has several query steps and key
/// tiles per block over a GQA group: every stage of the pipelines' rings is refilled more than
/// once.
fn sanitizer_shapes(t: &Target) -> Result<()> {
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu)?;
    let families = [(64, DType::BF16), (128, DType::F16), (40, DType::F32)];
    for n in 0..3 {
        for &(d, dtype) in t.sweep(&families, n) {
            let c = match n {
                0 => Case::new(1, 37, 70, 4, 2, d, dtype).causal(),
                1 => Case::new(1, 70, 33, 4, 1, d, dtype).with(
                    FlashAttn::new(scale(d))
                        .window(Some(9), Some(2))
                        .softcap(3.0)
                        .alibi(&slopes),
                ),
                _ => Case::new(1, 300, 333, 4, 2, d, dtype),
            };
            check(t, &c, 95)?;
        }
    }
    Ok(())
}
test_device!(sanitizer_shapes, Backward);
