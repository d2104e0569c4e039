//! Property test: random shapes and options against the f64 reference, on the CPU and (with the
//! `cuda` feature) the GPU. Failing cases are saved to `props.proptest-regressions` beside this
//! file and replayed first.

#[macro_use]
mod common;

use candle::{DType, Result};
use candle_flash::FlashAttn;
use common::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};

fn window() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![Just(None), (0usize..40).prop_map(Some)]
}

/// One random call: shape, GQA grouping, head dim (any from 1 to 69 too), dtype, window, softcap,
/// ALiBi, scale and data seed.
#[derive(Clone, Debug)]
struct Random {
    b: usize,
    sq: usize,
    sk: usize,
    heads: (usize, usize),
    d: usize,
    dtype: DType,
    left: Option<usize>,
    right: Option<usize>,
    softcap: f32,
    alibi: bool,
    scale: f32,
    seed: u64,
}

fn random() -> impl Strategy<Value = Random> {
    (
        (1usize..3, 1usize..150, 0usize..150),
        prop_oneof![
            Just((1usize, 1usize)),
            Just((4, 4)),
            Just((6, 2)),
            Just((6, 1)),
            Just((3, 3))
        ],
        prop_oneof![
            Just(8usize),
            Just(16),
            Just(24),
            Just(40),
            Just(64),
            Just(80),
            1usize..70
        ],
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        (window(), window()),
        (prop_oneof![Just(0f32), 0.5f32..30.0], any::<bool>()),
        (0.05f32..0.5, any::<u64>()),
    )
        .prop_map(
            |((b, sq, sk), heads, d, dtype, (left, right), (softcap, alibi), (scale, seed))| {
                Random {
                    b,
                    sq,
                    sk,
                    heads,
                    d,
                    dtype,
                    left,
                    right,
                    softcap,
                    alibi,
                    scale,
                    seed,
                }
            },
        )
}

/// 48 cases keep the suite quick; `PROPTEST_CASES=N` runs a longer soak.
fn random_shapes_and_options(t: &Target) -> Result<()> {
    let config = Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(48),
        // Where the default persistence keeps failing seeds: beside this file.
        source_file: Some(file!()),
        ..Config::default()
    };
    // A case proptest once shrank to (softcap 0.5 with ALiBi and a right-only window, d 22),
    // kept explicitly: saved seeds replay through the strategy, which has changed since.
    check(
        t,
        &Random {
            b: 1,
            sq: 59,
            sk: 26,
            heads: (1, 1),
            d: 22,
            dtype: DType::F32,
            left: None,
            right: Some(18),
            softcap: 0.5,
            alibi: true,
            scale: 0.305_156_68,
            seed: 3050435774375380195,
        },
    );
    let mut runner = TestRunner::new(config);
    let result = runner.run(&random(), |r| {
        check(t, &r);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    Ok(())
}
test_device!(random_shapes_and_options, Forward);

/// Runs one random case through the forward check, which panics on a mismatch (proptest catches
/// the panic and shrinks).
fn check(t: &Target, r: &Random) {
    let (h, hk) = r.heads;
    let c = Case::new(r.b, r.sq, r.sk, h, hk, r.d, r.dtype);
    let mut opts = FlashAttn::new(r.scale)
        .window(r.left, r.right)
        .softcap(r.softcap);
    if r.alibi {
        opts = opts.alibi(&head_slopes(h));
    }
    let (q, k, v) = c.inputs(t, r.seed).unwrap();
    check_forward(t, &format!("{r:?}"), &q, &k, &v, &opts).unwrap();
}

/// The strategy draws what it says (a proptest mapping slip would shrink every run's coverage).
#[test]
fn strategy_covers_its_ranges() {
    let mut runner = TestRunner::deterministic();
    let (mut empty_k, mut odd_d, mut alibi, mut capped) = (false, false, false, false);
    for _ in 0..500 {
        let r = random().new_tree(&mut runner).unwrap().current();
        empty_k |= r.sk == 0;
        odd_d |= !r.d.is_multiple_of(8);
        alibi |= r.alibi;
        capped |= r.softcap > 0.0;
        assert!(r.heads.0.is_multiple_of(r.heads.1) && r.sq >= 1 && r.d >= 1);
    }
    assert!(empty_k && odd_d && alibi && capped);
}
