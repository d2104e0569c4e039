//! The CPU paths one by one ([`CpuMatmul`], forced through `PlanOverride::cpu_matmul`): every
//! option of the CPU backend (causal and sliding windows, GQA 6/2/1, ALiBi, softcap, varlen,
//! the lse, odd lengths, head dims 40 to 256, non-contiguous and guard-banded inputs), forward
//! and backward, on each path this machine can run, against the f64 reference with the rule of
//! shared/docs/testing.md; then the paths against each other, and each path bitwise the same on
//! 1, 2 and 3 threads.
//!
//! bf16 inputs run every path (AMX, AVX512-BF16, and the f32 products: best, AVX2, portable);
//! f16 and f32 inputs the f32 ones (the bf16 engines do not apply to them). A path this machine
//! lacks is named on stderr, past the harness's capture, and is not tested here: a run on a
//! machine without AMX has not tested AMX.

mod common;

use std::io::Write;

use candle::{DType, Device, Tensor};
use candle_flash::{naive_attention, CpuMatmul, FlashAttn, PlanOverride};
use common::grad::{
    autograd, check_grads, reference_grads, reference_grads_varlen, Grads, RefGrads,
};
use common::{
    assert_bitwise_eq, assert_close, max_abs_err, naive_err, naive_varlen, randn, reference,
    reference_varlen, scale_of, tolerance, transposed_view, values, view_in_nan_buffer,
};

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// Every path, in the order the CPU prefers them.
const ALL: [CpuMatmul; 5] = [
    CpuMatmul::Amx,
    CpuMatmul::Avx512Bf16,
    CpuMatmul::F32,
    CpuMatmul::F32Avx2,
    CpuMatmul::F32Portable,
];

/// The paths to test for inputs of `dtype` on this machine; the ones it lacks are written to
/// stderr (not captured by the test harness, so every run shows them).
fn paths(dtype: DType) -> Vec<CpuMatmul> {
    let have = CpuMatmul::available();
    let wanted: Vec<CpuMatmul> = match dtype {
        DType::BF16 => ALL.to_vec(),
        _ => vec![CpuMatmul::F32, CpuMatmul::F32Avx2, CpuMatmul::F32Portable],
    };
    let missing: Vec<&CpuMatmul> = wanted.iter().filter(|m| !have.contains(m)).collect();
    if !missing.is_empty() {
        let _ =
            writeln!(
            std::io::stderr(),
            "cpu_matrix: NOT TESTED on this machine ({dtype:?} inputs): {missing:?}: the CPU (or \
             the OS) cannot run them; tested: {:?}",
            wanted.iter().filter(|m| have.contains(m)).collect::<Vec<_>>()
        );
    }
    wanted.into_iter().filter(|m| have.contains(m)).collect()
}

/// `opts` with the tile products forced onto `m`.
fn on(opts: &FlashAttn, m: CpuMatmul) -> FlashAttn {
    opts.clone().plan_override(PlanOverride {
        cpu_matmul: Some(m),
        ..PlanOverride::default()
    })
}

/// How q, k and v are laid out in storage (the values are the same).
#[derive(Clone, Copy, Debug)]
enum Layout {
    Contiguous,
    /// q stored `(b, h, s, d)` and seen as `(b, s, h, d)`.
    QTransposed,
    /// k and v as views inside NaN-filled buffers (guard bands, non-zero offsets).
    KvInNanBuffer,
    /// q and k transposed, v inside a NaN buffer.
    AllStrided,
}

/// One dense call.
struct Case {
    name: &'static str,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    opts: FlashAttn,
    layout: Layout,
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// The dense cases: every option at least once, odd lengths, head dims 40, 64, 80, 128, 256,
/// GQA 6/6, 6/2 and 6/1.
fn cases() -> Vec<Case> {
    let dev = Device::Cpu;
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625, 0.03, 0.0], &dev).unwrap();
    let case = |name, b, sq, sk, h, hk, d, opts, layout| Case {
        name,
        b,
        sq,
        sk,
        h,
        hk,
        d,
        opts,
        layout,
    };
    vec![
        case(
            "causal, GQA 6/2",
            2,
            113,
            203,
            6,
            2,
            64,
            FlashAttn::new(scale(64)).causal(),
            Layout::Contiguous,
        ),
        case(
            "sliding window, MQA 6/1, q transposed",
            1,
            203,
            113,
            6,
            1,
            40,
            FlashAttn::new(scale(40)).window(Some(50), Some(7)),
            Layout::QTransposed,
        ),
        case(
            "causal + softcap, MHA 6/6, k/v in NaN buffers",
            1,
            37,
            203,
            6,
            6,
            80,
            FlashAttn::new(scale(80)).causal().softcap(4.0),
            Layout::KvInNanBuffer,
        ),
        case(
            "ALiBi, GQA 6/2, all strided",
            1,
            113,
            113,
            6,
            2,
            128,
            FlashAttn::new(scale(128)).alibi(&slopes),
            Layout::AllStrided,
        ),
        case(
            "one key, d 256",
            1,
            37,
            1,
            2,
            1,
            256,
            FlashAttn::new(scale(256)),
            Layout::Contiguous,
        ),
        case(
            "causal with sq > sk: leading rows see no key",
            1,
            203,
            37,
            6,
            2,
            64,
            FlashAttn::new(scale(64)).causal(),
            Layout::Contiguous,
        ),
        case(
            "tile edges (64 rows, 65 keys), window right 3",
            1,
            64,
            65,
            4,
            2,
            64,
            FlashAttn::new(scale(64)).window(None, Some(3)),
            Layout::Contiguous,
        ),
        case(
            "one query (the decode kernels; the override applies to prefill and backward)",
            1,
            1,
            203,
            2,
            2,
            64,
            FlashAttn::new(scale(64)).causal(),
            Layout::Contiguous,
        ),
    ]
}

/// q, k, v and the output gradient of a case in `dtype`, laid out as the case says.
fn inputs(c: &Case, dtype: DType, seed: u64) -> (Tensor, Tensor, Tensor, Tensor) {
    let dev = Device::Cpu;
    let q = randn(&[c.b, c.sq, c.h, c.d], dtype, seed, &dev).unwrap();
    let k = randn(&[c.b, c.sk, c.hk, c.d], dtype, seed + 1, &dev).unwrap();
    let v = randn(&[c.b, c.sk, c.hk, c.d], dtype, seed + 2, &dev).unwrap();
    let g = randn(&[c.b, c.sq, c.h, c.d], dtype, seed + 3, &dev).unwrap();
    let (t, nan) = (
        |x: &Tensor| transposed_view(x).unwrap(),
        |x: &Tensor| view_in_nan_buffer(x).unwrap(),
    );
    let (q, k, v) = match c.layout {
        Layout::Contiguous => (q, k, v),
        Layout::QTransposed => (t(&q), k, v),
        Layout::KvInNanBuffer => (q, nan(&k), nan(&v)),
        Layout::AllStrided => (t(&q), t(&k), nan(&v)),
    };
    (q, k, v, g)
}

/// The lse against the reference: `-inf` exactly where a row sees no key, else within
/// `1e-4 · max(1, |ref|)` plus 1e-5 (f32) or 1e-3 (f16/bf16, whose inputs are rounded).
fn check_lse(what: &str, lse: &Tensor, reference: &[f64], dtype: DType) {
    let got = values(lse).unwrap();
    assert_eq!(got.len(), reference.len(), "{what}: lse length");
    for (i, (&a, &r)) in got.iter().zip(reference).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(a, r, "{what}: lse[{i}] of a row that sees no key");
        } else {
            let tol = 1e-4 * r.abs().max(1.0) + if dtype == DType::F32 { 1e-5 } else { 1e-3 };
            assert!(
                (a - r).abs() <= tol,
                "{what}: lse[{i}] = {a}, reference {r}"
            );
        }
    }
}

/// Two paths' outputs within the rule's bound of each other (that of one path against the
/// reference: `2 · naive_err` plus the floors at the largest reference element).
fn check_agree(what: &str, a: &Tensor, b: &Tensor, naive_err: f64, scale: f64) {
    let bound = tolerance(a.dtype(), naive_err, scale);
    let err = max_abs_err(a, &values(b).unwrap())
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: non-finite where the other path is finite"));
    assert!(
        err <= bound,
        "{what}: paths differ by {err:.3e} > {bound:.3e}"
    );
}

/// Gradients of two paths within the rule's bound of each other (per gradient, the naive
/// error of that gradient; the scale over all three, as in `check_grads`).
fn check_grads_agree(what: &str, a: &Grads, b: &Grads, naive: &Grads, r: &RefGrads) {
    let scale = [&r.dq, &r.dk, &r.dv]
        .iter()
        .map(|x| scale_of(x))
        .fold(0f64, f64::max);
    for (name, x, y, n, r) in [
        ("dq", &a.0, &b.0, &naive.0, &r.dq),
        ("dk", &a.1, &b.1, &naive.1, &r.dk),
        ("dv", &a.2, &b.2, &naive.2, &r.dv),
    ] {
        // Naive autograd is NaN in rows that see no key; its error over the finite elements.
        let ne = values(n)
            .unwrap()
            .iter()
            .zip(r.iter())
            .filter(|(n, _)| n.is_finite())
            .fold(0f64, |m, (n, r)| m.max((n - r).abs()));
        check_agree(&format!("{what} {name}"), x, y, ne, scale);
    }
}

/// Forward: output and lse of every path against the reference, and against the first path.
#[test]
fn forward_every_option_every_path() {
    for dtype in DTYPES {
        let paths = paths(dtype);
        for (n, c) in cases().iter().enumerate() {
            let (q, k, v, _) = inputs(c, dtype, 100 + 10 * n as u64);
            let (ref_out, ref_lse) = reference(&q, &k, &v, &c.opts).unwrap();
            let naive = naive_attention(&q, &k, &v, &c.opts).unwrap();
            let ne = naive_err(c.name, &naive, &ref_out);
            let scale = scale_of(&ref_out);
            let mut first: Option<(CpuMatmul, Tensor)> = None;
            for &m in &paths {
                let what = format!("forward {dtype:?} {m:?}: {}", c.name);
                let (out, lse) = on(&c.opts, m).forward_with_lse(&q, &k, &v).unwrap();
                assert_close(&what, &out, &naive, &ref_out, true);
                check_lse(&what, &lse, &ref_lse, dtype);
                match &first {
                    None => first = Some((m, out)),
                    Some((m0, o0)) => {
                        check_agree(&format!("{what} vs {m0:?}"), &out, o0, ne, scale)
                    }
                }
            }
        }
    }
}

/// Backward: the gradients of every path (through candle autograd) against the f64 analytic
/// gradients, with naive autograd as the yardstick, and against the first path.
#[test]
fn backward_every_option_every_path() {
    for dtype in DTYPES {
        let paths = paths(dtype);
        for (n, c) in cases().iter().enumerate() {
            let (q, k, v, g) = inputs(c, dtype, 200 + 10 * n as u64);
            let r = reference_grads(&q, &k, &v, &g, &c.opts).unwrap();
            let naive =
                autograd(&q, &k, &v, &g, |q, k, v| naive_attention(q, k, v, &c.opts)).unwrap();
            let mut first: Option<(CpuMatmul, Grads)> = None;
            for &m in &paths {
                let what = format!("backward {dtype:?} {m:?}: {}", c.name);
                let opts = on(&c.opts, m);
                let fast = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
                check_grads(&what, &fast, &naive, &r, [&q, &k, &v]);
                match &first {
                    None => first = Some((m, fast)),
                    Some((m0, f0)) => {
                        check_grads_agree(&format!("{what} vs {m0:?}"), &fast, f0, &naive, &r)
                    }
                }
            }
        }
    }
}

/// Varlen (a sequence of one query, one with no queries, one longer than a tile) with GQA,
/// causal, softcap and per-sequence ALiBi: output, lse and gradients of every path.
#[test]
fn varlen_every_path() {
    let dev = Device::Cpu;
    let cu_q = [0u32, 37, 38, 151, 151];
    let cu_k = [0u32, 50, 51, 254, 259];
    let (h, hk, d) = (6, 2, 64);
    let (tq, tk) = (cu_q[4] as usize, cu_k[4] as usize);
    let slopes = Tensor::new(
        &[
            [0.1f32, 0.2, 0.3, 0.4, 0.5, 0.6],
            [0.0; 6],
            [0.05, 0.0, 0.05, 0.0, 0.05, 0.0],
            [0.3; 6],
        ],
        &dev,
    )
    .unwrap();
    let opts = FlashAttn::new(scale(d))
        .causal()
        .softcap(6.0)
        .alibi(&slopes);
    let (cq, ck) = (
        Tensor::new(&cu_q, &dev).unwrap(),
        Tensor::new(&cu_k, &dev).unwrap(),
    );
    for dtype in DTYPES {
        let q = randn(&[tq, h, d], dtype, 300, &dev).unwrap();
        let k = randn(&[tk, hk, d], dtype, 301, &dev).unwrap();
        let v = randn(&[tk, hk, d], dtype, 302, &dev).unwrap();
        let g = randn(&[tq, h, d], dtype, 303, &dev).unwrap();
        let (ref_out, ref_lse) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
        let naive = naive_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
        let r = reference_grads_varlen(&q, &k, &v, &g, &cu_q, &cu_k, &opts).unwrap();
        let naive_g = autograd(&q, &k, &v, &g, |q, k, v| {
            naive_varlen(q, k, v, &cu_q, &cu_k, &opts)
        })
        .unwrap();
        let ne = naive_err("varlen", &naive, &ref_out);
        let scale = scale_of(&ref_out);
        let mut first: Option<(CpuMatmul, Tensor, Grads)> = None;
        for m in paths(dtype) {
            let what = format!("varlen {dtype:?} {m:?}");
            let o = on(&opts, m);
            let (out, lse) = o
                .forward_varlen_with_lse(&q, &k, &v, &cq, &ck, 113, 203)
                .unwrap();
            assert_close(&what, &out, &naive, &ref_out, true);
            check_lse(&what, &lse, &ref_lse, dtype);
            let fast = autograd(&q, &k, &v, &g, |q, k, v| {
                o.forward_varlen(q, k, v, &cq, &ck, 113, 203)
            })
            .unwrap();
            check_grads(&what, &fast, &naive_g, &r, [&q, &k, &v]);
            match &first {
                None => first = Some((m, out, fast)),
                Some((m0, o0, g0)) => {
                    check_agree(&format!("{what} vs {m0:?}"), &out, o0, ne, scale);
                    check_grads_agree(&format!("{what} vs {m0:?}"), &fast, g0, &naive_g, &r);
                }
            }
        }
    }
}

/// Each path gives the same bits on 1, 2 and 3 threads (item sizes, and in the backward pass
/// the dQ schedule, change with the thread count), forward and backward.
#[test]
fn every_path_is_bitwise_deterministic_across_thread_counts() {
    let dev = Device::Cpu;
    let (b, sq, sk, h, hk, d) = (1, 203, 333, 6, 2, 80);
    let opts = FlashAttn::new(scale(d)).causal().softcap(5.0);
    for dtype in [DType::BF16, DType::F32] {
        let q = randn(&[b, sq, h, d], dtype, 400, &dev).unwrap();
        let k = randn(&[b, sk, hk, d], dtype, 401, &dev).unwrap();
        let v = randn(&[b, sk, hk, d], dtype, 402, &dev).unwrap();
        let g = randn(&[b, sq, h, d], dtype, 403, &dev).unwrap();
        for m in paths(dtype) {
            let o = on(&opts, m);
            let run = || {
                let out = o.forward(&q, &k, &v).unwrap();
                let grads = autograd(&q, &k, &v, &g, |q, k, v| o.forward(q, k, v)).unwrap();
                (out, grads)
            };
            let mut runs = Vec::new();
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                runs.push((threads, pool.install(run)));
            }
            let (_, (out1, g1)) = &runs[0];
            for (threads, (out, g)) in &runs[1..] {
                let what = format!("{dtype:?} {m:?}, {threads} threads vs 1");
                assert_bitwise_eq(&format!("{what}: out"), out, out1);
                assert_bitwise_eq(&format!("{what}: dq"), &g.0, &g1.0);
                assert_bitwise_eq(&format!("{what}: dk"), &g.1, &g1.1);
                assert_bitwise_eq(&format!("{what}: dv"), &g.2, &g1.2);
            }
        }
    }
}

/// Forcing a path this machine cannot run is an error naming it, forward and backward, for
/// every dtype: never a crash (SIGILL) and never a silent fallback.
#[test]
fn forcing_a_missing_path_is_an_error() {
    let dev = Device::Cpu;
    let have = CpuMatmul::available();
    let missing: Vec<CpuMatmul> = ALL.into_iter().filter(|m| !have.contains(m)).collect();
    if missing.is_empty() {
        let _ = writeln!(
            std::io::stderr(),
            "cpu_matrix: this machine runs every path; the error for a missing one is not exercised"
        );
    }
    for m in missing {
        for dtype in DTYPES {
            let q = randn(&[1, 70, 2, 64], dtype, 500, &dev).unwrap();
            let opts = on(&FlashAttn::new(0.125), m);
            let err = opts.forward(&q, &q, &q).unwrap_err().to_string();
            assert!(
                err.contains("cpu_matmul") && err.contains(&format!("{m:?}")),
                "{dtype:?} {m:?}: {err}"
            );
            let var = candle::Var::from_tensor(&q).unwrap();
            assert!(opts.forward(var.as_tensor(), &q, &q).is_err());
        }
    }
    // The available ones run.
    for m in have {
        let q = randn(&[1, 70, 2, 64], DType::BF16, 501, &dev).unwrap();
        assert!(
            on(&FlashAttn::new(0.125), m).forward(&q, &q, &q).is_ok(),
            "{m:?}"
        );
    }
}

/// A NaN in one key and an infinity in the next one's value reach only the rows that see
/// those keys, forward and backward (dQ), on every path: a masked key has `P = 0` and `dS = 0`,
/// but `0 · NaN = NaN`, so the products must leave such terms out.
#[test]
fn non_finite_keys_reach_only_the_rows_that_see_them() {
    let dev = Device::Cpu;
    let (sq, sk, h, hk, d) = (130, 130, 2, 1, 64);
    let opts = FlashAttn::new(scale(d)).causal();
    for dtype in [DType::BF16, DType::F32] {
        let q = randn(&[1, sq, h, d], dtype, 600, &dev).unwrap();
        let g = randn(&[1, sq, h, d], dtype, 603, &dev).unwrap();
        let poison = |t: Tensor, row: usize, x: f32| {
            let bad = Tensor::full(x, (1, 1, hk, d), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            t.slice_assign(&[0..1, row..row + 1, 0..hk, 0..d], &bad)
                .unwrap()
        };
        let k0 = randn(&[1, sk, hk, d], dtype, 601, &dev).unwrap();
        let v0 = randn(&[1, sk, hk, d], dtype, 602, &dev).unwrap();
        let k = poison(k0.clone(), 100, f32::NAN);
        let v = poison(v0.clone(), 101, f32::INFINITY);
        // Rows 0 .. 100 see neither key (causal, sq = sk): compare them alone.
        let clean = 100 * h * d;
        let (ref_out, _) = reference(&q, &k, &v, &opts).unwrap();
        let r = reference_grads(&q, &k, &v, &g, &opts).unwrap();
        // The yardstick on the clean inputs: the same for those rows (the naive path's matrix
        // products carry 0 · NaN into every row).
        let naive = naive_attention(&q, &k0, &v0, &opts).unwrap();
        let ne = max_abs_err_slice_prefix(&naive, &ref_out, clean);
        let scale = scale_of(&ref_out[..clean]);
        for m in paths(dtype) {
            let what = format!("non-finite keys {dtype:?} {m:?}");
            let o = on(&opts, m);
            let out = values(&o.forward(&q, &k, &v).unwrap()).unwrap();
            let err = common::max_abs_err_slice(&out[..clean], &ref_out[..clean])
                .unwrap_or_else(|| panic!("{what}: a row that sees no bad key is not finite"));
            let bound = tolerance(dtype, ne, scale);
            assert!(err <= bound, "{what}: out err {err:.3e} > {bound:.3e}");
            assert!(
                out[100 * h * d..].iter().any(|x| !x.is_finite()),
                "{what}: NaN vanished"
            );
            let grads = autograd(&q, &k, &v, &g, |q, k, v| o.forward(q, k, v)).unwrap();
            let dq = values(&grads.0).unwrap();
            let dq_scale = scale_of(&r.dq[..clean]);
            let err =
                common::max_abs_err_slice(&dq[..clean], &r.dq[..clean]).unwrap_or_else(|| {
                    panic!("{what}: dq of a row that sees no bad key is not finite")
                });
            // bf16 rounding of dS and the inputs, at the scale of dq's clean rows.
            let bound = if dtype == DType::F32 { 1e-4 } else { 2e-2 } * dq_scale.max(1.0);
            assert!(err <= bound, "{what}: dq err {err:.3e} > {bound:.3e}");
        }
    }
}

/// `max |a - reference|` over the first `n` elements (finite there by construction).
fn max_abs_err_slice_prefix(a: &Tensor, reference: &[f64], n: usize) -> f64 {
    let a = values(a).unwrap();
    common::max_abs_err_slice(&a[..n], &reference[..n]).expect("non-finite naive output")
}
