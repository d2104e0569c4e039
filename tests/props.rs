//! Property test: random shapes and options against the f64 reference.

mod common;

use candle::{DType, Device, Tensor};
use candle_flash::{naive_attention, FlashAttn};
use common::*;
use proptest::prelude::*;

fn window() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![Just(None), (0usize..40).prop_map(Some)]
}

proptest! {
    // 48 cases keep CI quick; PROPTEST_CASES=N runs a longer soak.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]
    #[test]
    fn random_shapes_and_options(
        b in 1usize..3,
        sq in 1usize..150,
        sk in 0usize..150,
        (h, hk) in prop_oneof![Just((1usize, 1usize)), Just((4, 4)), Just((6, 2)), Just((6, 1)), Just((3, 3))],
        d in prop_oneof![Just(8usize), Just(16), Just(24), Just(40), Just(64), Just(80), 1usize..70],
        dtype in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        left in window(),
        right in window(),
        softcap in prop_oneof![Just(0f32), 0.5f32..30.0],
        alibi in any::<bool>(),
        scale in 0.05f32..0.5,
        seed in any::<u64>(),
    ) {
        let dev = Device::Cpu;
        let q = randn(&[b, sq, h, d], dtype, seed, &dev).unwrap();
        let k = randn(&[b, sk, hk, d], dtype, seed ^ 1, &dev).unwrap();
        let v = randn(&[b, sk, hk, d], dtype, seed ^ 2, &dev).unwrap();
        let mut opts = FlashAttn::new(scale).window(left, right).softcap(softcap);
        if alibi {
            let slopes: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect();
            opts = opts.alibi(&Tensor::new(slopes.as_slice(), &dev).unwrap());
        }
        let out = opts.forward(&q, &k, &v).unwrap();
        prop_assert_eq!(out.dims(), q.dims());
        let naive = naive_attention(&q, &k, &v, &opts).unwrap();
        let (r, _) = reference(&q, &k, &v, &opts).unwrap();
        assert_close(&format!("{opts:?}"), &out, &naive, &r, true);
    }
}
