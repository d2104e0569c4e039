//! Decode unit tests: path selection, the split rule, every instruction set and split count
//! against the materialising path, and the threshold timing.

use candle::{Device, Tensor};

use super::*;
use crate::{naive_attention, FlashAttn};

fn problem(b: usize, sq: usize, sk: usize, h: usize, hk: usize, d: usize) -> Problem {
    let dev = Device::Cpu;
    let q = Tensor::zeros((b, sq, h, d), candle::DType::F32, &dev).unwrap();
    let k = Tensor::zeros((b, sk, hk, d), candle::DType::F32, &dev).unwrap();
    FlashAttn::new(1.0)
        .causal()
        .problem(&q, &k, &k, None)
        .unwrap()
}

#[test]
fn decode_is_chosen_for_few_rows_per_kv_head() {
    // (sq, heads, kv_heads) -> decode?
    let cases = [
        (1, 32, 8, true),
        (16, 32, 8, true),
        (17, 32, 8, false),
        (1, 8, 1, true),
        (16, 8, 1, true),
        (17, 8, 1, false),
        (1, 6, 6, true),
        (4, 6, 6, true),
        (5, 6, 6, false),
        (12, 6, 2, true),
        (13, 6, 2, false),
        (512, 32, 8, false),
        (4096, 8, 8, false),
    ];
    for (sq, h, hk, want) in cases {
        let p = problem(2, sq, 4096, h, hk, 64);
        assert_eq!(is_decode(&p), want, "sq {sq}, heads {h}/{hk}");
    }
}

#[test]
fn split_rule() {
    // One sequence on 2 threads: 8 splits of a long cache, none shorter than MIN_SPLIT_KEYS.
    assert_eq!(split_count(4096, 1, 2), 8);
    assert_eq!(split_count(1000, 1, 2), 3);
    assert_eq!(split_count(255, 1, 2), 1);
    assert_eq!(split_count(0, 1, 2), 1);
    // Enough sequences keep the threads busy unsplit.
    assert_eq!(split_count(16384, 8, 2), 1);
    assert_eq!(split_count(16384, 3, 2), 3);
    // Capped.
    assert_eq!(split_count(1 << 30, 1, 1024), MAX_SPLITS);
    // Bounds tile the range exactly.
    for n in 1..20 {
        let mut at = 5;
        for s in 0..n {
            let (lo, hi) = split_bounds(5, 1234, s, n);
            assert_eq!(lo, at);
            at = hi;
        }
        assert_eq!(at, 1234);
    }
}

/// Every instruction set and many split counts (the thread count the split rule plans for)
/// against the materialising path.
#[test]
fn every_isa_and_split_count_matches_naive() -> candle::Result<()> {
    let dev = Device::Cpu;
    let cases = [
        (1, 1, 1, 8, 2, 2, FlashAttn::new(0.3)),
        // Head dims that end in a partial vector of every width, and one below a vector.
        (1, 2, 700, 57, 4, 1, FlashAttn::new(0.15).causal()),
        (2, 1, 300, 13, 8, 2, FlashAttn::new(0.3)),
        (1, 1, 500, 1, 2, 2, FlashAttn::new(0.5)),
        (2, 1, 3000, 128, 32, 8, FlashAttn::new(0.09).causal()),
        (1, 3, 1500, 40, 6, 2, FlashAttn::new(0.2).causal()),
        (
            3,
            2,
            777,
            80,
            8,
            1,
            FlashAttn::new(0.1).window(Some(300), Some(0)),
        ),
        (
            1,
            4,
            1100,
            24,
            4,
            4,
            FlashAttn::new(0.2).causal().softcap(3.0),
        ),
        (
            2,
            1,
            2000,
            64,
            2,
            1,
            FlashAttn::new(0.1).alibi(&Tensor::new(&[0.25f32, 0.0625], &dev)?),
        ),
    ];
    for (b, sq, sk, d, h, hk, opts) in cases {
        let q = Tensor::randn(0f32, 1., (b, sq, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?;
        let want = naive_attention(&q, &k, &v, &opts)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let p = opts.problem(&q, &k, &v, None)?;
        assert!(is_decode(&p));
        let slopes = match &opts.alibi_slopes {
            Some(s) => Some(s.to_vec1::<f32>()?),
            None => None,
        };
        let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        let (qv, kv, vv) = (flat(&q)?, flat(&k)?, flat(&v)?);
        for isa in Isa::available() {
            for threads in [1, 2, 5, 16, 64] {
                let (got, _) = forward_with(isa, threads, &p, slopes.as_deref(), &qv, &kv, &vv);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, |a, e| if e > a || e.is_nan() { e } else { a });
                assert!(
                    err <= 1e-4,
                    "{isa:?} threads {threads} ({b}, {sq}, {sk}, {d}): max error {err}"
                );
            }
        }
    }
    Ok(())
}

/// Times decode against prefill over query rows per KV head, to place
/// `MAX_ROW_GROUPS_PER_HEAD`:
/// `cargo test --release --lib threshold_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn threshold_timing() {
    let dev = Device::Cpu;
    let (b, sk, d) = (1, 8192, 128);
    for (h, hk, rows) in [4, 8, 16, 32, 64, 128]
        .into_iter()
        .flat_map(|r| [(32, 8, r), (8, 8, r)])
    {
        let sq = rows / (h / hk);
        let q = Tensor::randn(0f32, 1., (b, sq, h, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), &dev).unwrap();
        let p = FlashAttn::new(0.09)
            .causal()
            .problem(&q, &k, &v, None)
            .unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (qv, kv, vv) = (flat(&q), flat(&k), flat(&v));
        let time = |f: &dyn Fn()| {
            f();
            let mut t: Vec<f64> = (0..5)
                .map(|_| {
                    let s = std::time::Instant::now();
                    f();
                    s.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t[2]
        };
        let dec = time(&|| {
            forward(&p, None, &qv, &kv, &vv);
        });
        let pre = time(&|| {
            super::super::prefill::forward(&p, None, &qv, &kv, &vv);
        });
        println!("rows/kv head {rows:3} (sq {sq:2}): decode {dec:7.2} ms, prefill {pre:7.2} ms");
    }
}
