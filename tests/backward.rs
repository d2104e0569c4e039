//! Backward pass on the CPU: gradients of q, k and v against the f64 analytic reference
//! (`common::grad`, itself checked against central differences) and against candle autograd
//! through `naive_attention`.
//!
//! ```text
//! cargo test --release --test backward
//! ```

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::FlashAttn;

use common::grad::{reference_grads, RefGrads};
use common::{randn, reference};

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
