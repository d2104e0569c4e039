//! Decode unit tests: path selection, the split rule, every instruction set and split count
//! against the materialising path, and the threshold timing.

use candle::{DType, Device, Tensor};

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
        (16, 64, 1, true),
        (1, 6, 6, true),
        (16, 6, 6, true),
        (32, 6, 6, true),
        (33, 6, 6, false),
        (16, 6, 2, true),
        (17, 6, 2, false),
        (512, 32, 8, false),
        (4096, 8, 8, false),
    ];
    for (sq, h, hk, want) in cases {
        let p = problem(2, sq, 4096, h, hk, 64);
        assert_eq!(is_decode(&p), want, "sq {sq}, heads {h}/{hk}");
    }
}

#[test]
fn task_count_rule() {
    let mb = 1 << 20;
    // Small caches: one task per MIN_TASK_BYTES, fewer threads then.
    assert_eq!(plan::task_count(0, 2, plan::MIN_TASK_BYTES), 1);
    assert_eq!(
        plan::task_count(plan::MIN_TASK_BYTES - 1, 2, plan::MIN_TASK_BYTES),
        1
    );
    assert_eq!(
        plan::task_count(plan::MIN_TASK_BYTES, 2, plan::MIN_TASK_BYTES),
        1
    );
    assert_eq!(
        plan::task_count(3 * plan::MIN_TASK_BYTES, 4, plan::MIN_TASK_BYTES),
        3
    );
    // Otherwise a multiple of the thread count, up to TASKS_PER_THREAD each.
    assert_eq!(
        plan::task_count(3 * plan::MIN_TASK_BYTES, 2, plan::MIN_TASK_BYTES),
        2
    );
    assert_eq!(
        plan::task_count(5 * plan::MIN_TASK_BYTES, 2, plan::MIN_TASK_BYTES),
        4
    );
    assert_eq!(
        plan::task_count(1024 * mb, 2, plan::MIN_TASK_BYTES),
        2 * plan::TASKS_PER_THREAD
    );
    assert_eq!(
        plan::task_count(1024 * mb, 7, plan::MIN_TASK_BYTES),
        7 * plan::TASKS_PER_THREAD
    );
    assert_eq!(plan::task_count(usize::MAX, 1, plan::MIN_TASK_BYTES), 1);
}

/// The plan's items tile every sequence's key range exactly, in split order, and every task
/// streams about the same number of keys.
#[test]
fn plan_tiles_the_keys_and_balances_tasks() {
    // (key range of every sequence, threads, bytes per key)
    type Case<'a> = (&'a [(usize, usize)], usize, usize);
    let cases: [Case; 6] = [
        (&[(0, 4096)], 2, 8 << 10),
        (&[(0, 1000), (0, 1000), (0, 1000)], 2, 8 << 10),
        (&[(0, 65536); 8], 2, 512),
        (
            &[(0, 0), (3, 700), (0, 1), (0, 0), (17, 40000), (0, 5)],
            3,
            4 << 10,
        ),
        (&[(0, 7); 5], 16, 1 << 20),
        (&[(100, 100)], 2, 1 << 10),
    ];
    for (keys, threads, key_bytes) in cases {
        let plan = plan::Plan::from_keys(
            keys.to_vec(),
            4,
            |_| 2,
            threads,
            key_bytes,
            plan::MIN_TASK_BYTES,
        );
        let what = format!("{keys:?} on {threads} threads");
        for (b, sp) in plan.seqs.iter().enumerate() {
            let items: Vec<_> = plan.items.iter().filter(|it| it.b == b).collect();
            assert_eq!(items.len(), sp.splits, "{what}: splits of {b}");
            let mut at = keys[b].0;
            for (s, it) in items.iter().enumerate() {
                assert_eq!((it.split, it.lo), (s, at), "{what}: item {it:?}");
                assert!(it.hi > it.lo, "{what}: empty item {it:?}");
                at = it.hi;
            }
            if sp.splits > 0 {
                assert_eq!(at, keys[b].1, "{what}: sequence {b} not covered");
            } else {
                assert_eq!(
                    keys[b].0, keys[b].1,
                    "{what}: sequence {b} has keys, no item"
                );
            }
        }
        // Tasks cover the items in order; their key counts differ by at most a block per
        // sequence boundary they cross (the cuts move to block boundaries).
        let mut next = 0;
        let loads: Vec<usize> = plan
            .tasks
            .iter()
            .map(|r| {
                assert_eq!(r.start, next, "{what}: tasks in order");
                next = r.end;
                plan.items[r.clone()].iter().map(|it| it.hi - it.lo).sum()
            })
            .collect();
        assert_eq!(next, plan.items.len(), "{what}: every item in a task");
        let total: usize = keys.iter().map(|k| k.1 - k.0).sum();
        let bytes = total * key_bytes;
        // Cuts that meet once moved to block boundaries leave fewer tasks, never more.
        assert!(
            plan.tasks.len() <= plan::task_count(bytes, threads, plan::MIN_TASK_BYTES),
            "{what}: task count"
        );
        assert_eq!(
            plan.tasks.is_empty(),
            total == 0,
            "{what}: no task without keys"
        );
        if let (Some(&lo), Some(&hi)) = (loads.iter().min(), loads.iter().max()) {
            assert!(hi - lo <= 2 * BK + 1, "{what}: task loads {loads:?}");
        }
    }
}

/// The task runner runs every task exactly once, whatever the task and helper counts (helpers
/// that arrive after the last claim included), and a panic in a task reaches the caller after
/// every other claimed task has finished.
#[test]
fn run_runs_every_task_once_and_resumes_panics() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for (n, helpers) in [(1, 0), (1, 3), (2, 1), (7, 1), (64, 2), (100, 63), (5, 0)] {
        let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        run::run(n, helpers, &|i| {
            counts[i].fetch_add(1, Ordering::SeqCst);
        });
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                c.load(Ordering::SeqCst),
                1,
                "{n} tasks, {helpers} helpers: task {i}"
            );
        }
    }
    for bad in [0, 5, 19] {
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run::run(20, 2, &|i| {
                assert!(i != bad, "task {i} fails");
                done.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err(), "task {bad}: the panic reaches the caller");
        assert!(
            done.load(Ordering::SeqCst) < 20,
            "task {bad}: it did not run"
        );
    }
}

/// One case of [`every_isa_dtype_and_split_count_matches_naive`]: batch, seq_q, keys, head
/// dim, heads, KV heads, options.
type IsaCase = (usize, usize, usize, usize, usize, usize, FlashAttn);

/// Every instruction set, with and without the bf16 dot products, f32/f16/bf16, many split
/// counts (the thread count the plan is made for, with tasks as small as one key), against the
/// materialising path in f32 on the same (rounded) inputs; the same plan run twice is bitwise
/// equal, and every split count agrees with one split far inside the tolerance.
#[test]
fn every_isa_dtype_and_split_count_matches_naive() -> candle::Result<()> {
    let dev = Device::Cpu;
    let cases: Vec<IsaCase> = vec![
        (1, 1, 1, 8, 2, 2, FlashAttn::new(0.3)),
        // Head dims that end in a partial vector of every width, and one below a vector.
        (1, 2, 700, 57, 4, 1, FlashAttn::new(0.15).causal()),
        (2, 1, 300, 13, 8, 2, FlashAttn::new(0.3)),
        (1, 1, 500, 1, 2, 2, FlashAttn::new(0.5)),
        (2, 1, 3000, 128, 32, 8, FlashAttn::new(0.09).causal()),
        // GQA groups of 1, 3 and 6 (6/6, 6/2, 6/1), seq_q up to 16.
        (1, 3, 1500, 40, 6, 2, FlashAttn::new(0.2).causal()),
        (2, 4, 233, 64, 6, 6, FlashAttn::new(0.2).causal()),
        (1, 12, 1001, 96, 6, 1, FlashAttn::new(0.1).causal()),
        (1, 16, 517, 128, 8, 1, FlashAttn::new(0.09).causal()),
        (2, 16, 77, 32, 32, 8, FlashAttn::new(0.2).causal()),
        (1, 5, 3, 48, 8, 1, FlashAttn::new(0.2).causal()),
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
        let what = format!("({b}, {sq}, {sk}, {d}, {h}/{hk})");
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let rounded = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
            let q = rounded(Tensor::randn(0f32, 1., (b, sq, h, d), &dev)?)?;
            let k = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
            let v = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
            let want = naive_attention(&q, &k, &v, &opts)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let p = opts.problem(&q, &k, &v, None)?;
            assert!(is_decode(&p), "{what}: a decode shape");
            let slopes = match &opts.alibi_slopes {
                Some(s) => Some(s.to_vec1::<f32>()?),
                None => None,
            };
            let (qt, kt, vt) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
            let what = format!("{what} {dtype:?}");
            match dtype {
                DType::F32 => {
                    check_isas::<f32>(&what, &p, slopes.as_deref(), &qt, &kt, &vt, &want, 1e-4)
                }
                DType::F16 => check_isas::<half::f16>(
                    &what,
                    &p,
                    slopes.as_deref(),
                    &qt,
                    &kt,
                    &vt,
                    &want,
                    4e-3,
                ),
                _ => check_isas::<half::bf16>(
                    &what,
                    &p,
                    slopes.as_deref(),
                    &qt,
                    &kt,
                    &vt,
                    &want,
                    2.5e-2,
                ),
            }?;
        }
    }
    Ok(())
}

/// [`every_isa_dtype_and_split_count_matches_naive`] for one dtype: `want` is the f32 naive
/// output on the same values, `tol` the largest error allowed.
#[allow(clippy::too_many_arguments)]
fn check_isas<T: Elem + candle::WithDType>(
    what: &str,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    want: &[f32],
    tol: f32,
) -> candle::Result<()> {
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<T>();
    let (qv, kv, vv) = (flat(q)?, flat(k)?, flat(v)?);
    // NaN-propagating largest difference.
    let max_err = |a: &[T], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(g, w)| (g.to_f32() - w).abs())
            .fold(0f32, |m, e| if e > m || e.is_nan() { e } else { m })
    };
    let none = Extras::default();
    // bf16 `q·k` on the vector units, the AMX tiles and their software model (which the
    // calls that the tiles do not take run as the first).
    let uses = [
        (true, TileUse::Off),
        (false, TileUse::Off),
        (true, TileUse::Amx),
        (true, TileUse::Model),
    ];
    for isa in Isa::available() {
        for (dot, tiles) in uses {
            let (one, lse_one) =
                forward_with(isa, dot, tiles, 1, 1, p, slopes, &qv, [&kv, &vv], &none);
            for threads in [1, 2, 3, 5, 16, 64] {
                let run = || {
                    forward_with(
                        isa,
                        dot,
                        tiles,
                        threads,
                        1,
                        p,
                        slopes,
                        &qv,
                        [&kv, &vv],
                        &none,
                    )
                };
                let (got, lse) = run();
                let err = max_err(&got, want);
                assert!(
                    err <= tol,
                    "{what} {isa:?} dot {dot} {tiles:?} threads {threads}: max error {err}"
                );
                // The same plan twice: the same bits.
                let (again, lse_again) = run();
                let bits = |x: &[T]| x.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&got) == bits(&again)
                        && lse
                            .iter()
                            .zip(&lse_again)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what} {isa:?} dot {dot} {tiles:?} threads {threads}: not bitwise stable"
                );
                // Other splits: the same up to the rounding of the merge, which can move an
                // output across one rounding step of the dtype.
                let one_f: Vec<f32> = one.iter().map(|x| x.to_f32()).collect();
                let split_err = max_err(&got, &one_f);
                let top = one_f.iter().fold(1f32, |m, x| m.max(x.abs()));
                // The dtype's rounding step at 1: the smallest 2^-k it tells from 0.
                let step = (1..=23)
                    .map(|k| (-(k as f32)).exp2())
                    .take_while(|&e| T::from_f32(1.0 + e).to_f32() != 1.0)
                    .last()
                    .unwrap_or(1.0);
                assert!(
                    split_err <= tol / 4.0 + 2.0 * step * top,
                    "{what} {isa:?} dot {dot} {tiles:?} threads {threads}: {split_err} from one split"
                );
                for (a, b) in lse.iter().zip(&lse_one) {
                    assert!(
                        (a - b).abs() <= 1e-4 * b.abs().max(1.0) || a == b,
                        "{what} {isa:?} dot {dot} {tiles:?} threads {threads}: lse {a} vs {b}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// A NaN in one key's K (or V) row reaches exactly the output rows that see that key, on every
/// instruction set, dtype and split count: those rows are NaN in every element, the others
/// match the materialising path on the same inputs with that row zeroed (they never see it).
/// Odd head dim and key count, groups of 8 (a whole AVX2 register block of rows) and 3, and a
/// bf16 NaN key at the end of a whole block that every row of its sequence sees (`P V` on the
/// tiles: the NaN reaches every element of those rows, and no other sequence's).
#[test]
fn nan_in_a_key_reaches_exactly_the_rows_that_see_it() -> candle::Result<()> {
    let dev = Device::Cpu;
    // (batch, seq_q, keys, head dim, heads, KV heads)
    for (b, sq, sk, d, h, hk) in [
        (2, 2, 1001, 57, 8, 1),
        (1, 3, 517, 128, 6, 2),
        (2, 1, 512, 128, 8, 1),
    ] {
        // The last key of sequence 0: under the bottom-right causal mask only its last query
        // row sees it.
        let (nan_b, nan_key) = (0, sk - 1);
        for nan_in_v in [false, true] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let what = format!("({b}, {sq}, {sk}, {d}, {h}/{hk}) {dtype:?} v {nan_in_v}");
                let rounded = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
                let q = rounded(Tensor::randn(0f32, 1., (b, sq, h, d), &dev)?)?;
                let k = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
                let v = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
                let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
                let row = (nan_b * sk + nan_key) * hk * d;
                let with = |t: &Tensor, x: f32| -> candle::Result<Tensor> {
                    let mut e = flat(t)?;
                    e[row..row + hk * d].fill(x);
                    Tensor::from_vec(e, t.shape(), &dev)
                };
                let (kz, vz) = if nan_in_v {
                    (k.clone(), with(&v, 0.0)?)
                } else {
                    (with(&k, 0.0)?, v.clone())
                };
                let (kn, vn) = if nan_in_v {
                    (k.clone(), with(&v, f32::NAN)?)
                } else {
                    (with(&k, f32::NAN)?, v.clone())
                };
                let opts = FlashAttn::new(0.1).causal();
                let want = flat(&naive_attention(&q, &kz, &vz, &opts)?)?;
                let p = opts.problem(&q, &kn, &vn, None)?;
                let to = |t: &Tensor| -> candle::Result<Tensor> { t.to_dtype(dtype) };
                let (qt, kt, vt) = (to(&q)?, to(&kn)?, to(&vn)?);
                let sees = |bi: usize, i: usize| bi == nan_b && i == sq - 1;
                match dtype {
                    DType::F32 => check_nan::<f32>(&what, &p, &qt, &kt, &vt, &want, sees, 1e-4),
                    DType::F16 => {
                        check_nan::<half::f16>(&what, &p, &qt, &kt, &vt, &want, sees, 4e-3)
                    }
                    _ => check_nan::<half::bf16>(&what, &p, &qt, &kt, &vt, &want, sees, 2.5e-2),
                }?;
            }
        }
    }
    Ok(())
}

/// [`nan_in_a_key_reaches_exactly_the_rows_that_see_it`] for one dtype: `sees(b, i)` tells the
/// query rows that see the NaN key, `want` the reference of the others.
#[allow(clippy::too_many_arguments)]
fn check_nan<T: Elem + candle::WithDType>(
    what: &str,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    want: &[f32],
    sees: impl Fn(usize, usize) -> bool,
    tol: f32,
) -> candle::Result<()> {
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<T>();
    let (qv, kv, vv) = (flat(q)?, flat(k)?, flat(v)?);
    let row = p.heads * p.head_dim;
    every_setting(p, &qv, [&kv, &vv], &[1, 2, 7], |setting, got| {
        for (r, (g, w)) in got
            .chunks_exact(row)
            .zip(want.chunks_exact(row))
            .enumerate()
        {
            let (b, i) = (r / p.max_seq_q, r % p.max_seq_q);
            let at = format!("{what} {setting} row ({b}, {i})");
            if sees(b, i) {
                assert!(g.iter().all(|x| x.to_f32().is_nan()), "{at}: not all NaN");
            } else {
                // NaN-propagating largest difference.
                let err = g
                    .iter()
                    .zip(w)
                    .map(|(g, w)| (g.to_f32() - w).abs())
                    .fold(0f32, |m, e| if e > m || e.is_nan() { e } else { m });
                assert!(err <= tol, "{at}: max error {err}");
            }
        }
    });
    Ok(())
}

/// `forward_with` on every instruction set and tile setting (the tile unit, its software
/// model, none) at each thread count of `threads`, with the bf16 products where the cache has
/// them: `check(setting, output)` for each.
fn every_setting<T: Elem, KV: Elem>(
    p: &Problem,
    q: &[T],
    kv: [&[KV]; 2],
    threads: &[usize],
    mut check: impl FnMut(&str, &[T]),
) {
    for isa in Isa::available() {
        for tiles in [TileUse::Off, TileUse::Amx, TileUse::Model] {
            for &threads in threads {
                let (got, _) = forward_with(
                    isa,
                    true,
                    tiles,
                    threads,
                    1,
                    p,
                    None,
                    q,
                    kv,
                    &Extras::default(),
                );
                check(&format!("{isa:?} {tiles:?} threads {threads}"), &got);
            }
        }
    }
}

/// An infinite or NaN element of one V row reaches only its own column: the rows that see the
/// key get a non-finite value there and match the reference everywhere else, on every
/// instruction set and tile setting, one and two threads. The key sits inside a whole block
/// that every row sees, and the column is even and odd, so that `P V` on the tiles (which
/// multiplies the other half of each V pair by zero) is where it must not spread.
#[test]
fn a_non_finite_v_element_reaches_only_its_column() -> candle::Result<()> {
    use half::bf16;
    let dev = Device::Cpu;
    let (b, sq, sk, d, h, hk) = (2, 1, 512, 128, 8, 1);
    let key = 100;
    let rounded = |t: Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let q = rounded(Tensor::randn(0f32, 1., (b, sq, h, d), &dev)?)?;
    let k = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
    let v = rounded(Tensor::randn(0f32, 1., (b, sk, hk, d), &dev)?)?;
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    let opts = FlashAttn::new(0.1);
    for col in [6, 7] {
        for bad in [f32::INFINITY, f32::NAN] {
            // Sequence 0's key, KV head 0, element `col`.
            let at = key * hk * d + col;
            let mut vz = flat(&v)?;
            vz[at] = 0.0;
            let want = flat(&naive_attention(
                &q,
                &k,
                &Tensor::from_vec(vz, v.shape(), &dev)?,
                &opts,
            )?)?;
            let mut vn = flat(&v)?;
            vn[at] = bad;
            let vt = Tensor::from_vec(vn, v.shape(), &dev)?;
            let p = opts.problem(&q, &k, &vt, None)?;
            let as_bf16 = |t: &Tensor| t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>();
            let (qv, kv, vv) = (as_bf16(&q)?, as_bf16(&k)?, as_bf16(&vt)?);
            every_setting(&p, &qv, [&kv, &vv], &[1, 2], |setting, got| {
                for (r, (g, w)) in got.chunks_exact(d).zip(want.chunks_exact(d)).enumerate() {
                    // Rows (b, i, head): sequence 0's see the key.
                    let seq0 = r < sq * h;
                    let what = format!("{bad} at {col}: {setting} row {r}");
                    for (x, (g, w)) in g.iter().zip(w).enumerate() {
                        let g = g.to_f32();
                        if seq0 && x == col {
                            assert!(!g.is_finite(), "{what}: element {x} is {g}");
                        } else {
                            assert!(
                                (g - w).abs() <= 2.5e-2,
                                "{what}: element {x} is {g}, want {w}"
                            );
                        }
                    }
                }
            });
        }
    }
    Ok(())
}

/// Times decode against prefill over query rows per KV head, to place `MAX_DECODE_SEQ_Q` and
/// `MAX_DECODE_ROWS_PER_KV_HEAD`:
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
            forward(&p, None, &qv, &kv, &vv, &Extras::default());
        });
        let pre = time(&|| {
            super::super::prefill::forward(&p, None, &qv, &kv, &vv);
        });
        println!("rows/kv head {rows:3} (sq {sq:2}): decode {dec:7.2} ms, prefill {pre:7.2} ms");
    }
}

/// Kernel throughput against the read bandwidth, robust to a loaded machine: the fastest of
/// many calls (a call that ran unpreempted), hot (one input set) and cold (rotating over
/// 256 MiB), beside the fastest multi-threaded read of a 256 MiB buffer:
/// `cargo test --release --lib kernel_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn kernel_throughput() {
    use half::bf16;
    use rayon::prelude::*;
    fn best(calls: usize, mut f: impl FnMut(usize)) -> f64 {
        (0..calls)
            .map(|c| {
                let t = std::time::Instant::now();
                f(c);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }
    let buf: Vec<f32> = (0..64 << 20).map(|i| (i % 7) as f32).collect();
    let read = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let t = pool.install(|| {
            best(20, |_| {
                let s: f32 = buf
                    .par_chunks(buf.len() / threads)
                    .map(|c| {
                        let mut acc = [0f32; 64];
                        for x in c.chunks_exact(64) {
                            for (a, &x) in acc.iter_mut().zip(x) {
                                *a += x;
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                    .sum();
                std::hint::black_box(s);
            })
        });
        (buf.len() * 4) as f64 / t / 1e9
    };
    fn run<T: Elem>(what: &str, h: usize, hk: usize, b: usize, sk: usize, threads: usize, rd: f64) {
        let d = 128;
        let p = problem(b, 1, sk, h, hk, d);
        let q: Vec<T> = (0..b * h * d)
            .map(|i| T::from_f32(((i % 7) as f32 - 3.0) * 0.1))
            .collect();
        let kv_len = b * sk * hk * d;
        let bytes = 2 * kv_len * std::mem::size_of::<T>();
        let sets = (256usize << 20).div_ceil(bytes).max(2);
        let mk = |s: usize| -> Vec<T> {
            (0..kv_len)
                .map(|i| T::from_f32((((i * 7 + s) % 13) as f32 - 6.0) * 0.05))
                .collect()
        };
        let ks: Vec<Vec<T>> = (0..sets).map(mk).collect();
        let vs: Vec<Vec<T>> = (0..sets).map(|s| mk(s + 1)).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for (label, n) in [("hot", 1), ("cold", sets)] {
                let calls = ((1usize << 30) / bytes).clamp(20, 3000);
                let t = best(calls, |c| {
                    let s = c % n;
                    std::hint::black_box(forward_with(
                        Isa::detect(),
                        true,
                        TileUse::Amx,
                        threads,
                        plan::MIN_TASK_BYTES,
                        &p,
                        None,
                        &q,
                        [&ks[s], &vs[s]],
                        &Extras::default(),
                    ));
                });
                let gbps = bytes as f64 / t / 1e9;
                println!(
                    "{what} {h}/{hk} b {b} kv {sk} threads {threads} {label}: {:.1} us, {gbps:.1} GB/s, {:.0}% of read {rd:.1}",
                    t * 1e6,
                    100.0 * gbps / rd
                );
            }
        });
    }
    // Single-threaded with K and V inside L2 (512 KiB): the kernels' compute speed.
    let rd = read(1);
    for (h, hk, f32_keys) in [(32, 8, 64), (8, 1, 512)] {
        run::<f32>("f32", h, hk, 1, f32_keys, 1, rd);
        run::<bf16>("bf16", h, hk, 1, 2 * f32_keys, 1, rd);
    }
    for threads in [1, 2] {
        let rd = read(threads);
        for (h, hk) in [(32, 8), (8, 1)] {
            run::<f32>("f32", h, hk, 1, 4096, threads, rd);
            run::<bf16>("bf16", h, hk, 1, 4096, threads, rd);
        }
    }
}

/// Every e4m3 code read in place by every instruction set's kernels converts exactly (NaN to
/// NaN; zeros of either sign): with one key, the output is that key's V row. Head dims 256 (whole vectors) and 253
/// (a partial vector of every width).
#[test]
fn fp8_rows_convert_exactly_on_every_isa() {
    for d in [256usize, 253] {
        let p = problem(1, 1, 1, 1, 1, d);
        let v: Vec<float8::F8E4M3> = (0..d).map(|i| float8::F8E4M3::from_bits(i as u8)).collect();
        let k = vec![float8::F8E4M3::from_f32(0.5); d];
        let q = vec![0.25f32; d];
        for isa in Isa::available() {
            let (got, _) = forward_with(
                isa,
                false,
                TileUse::Off,
                1,
                1,
                &p,
                None,
                &q,
                [&k, &v],
                &Extras::default(),
            );
            for (x, (g, w)) in got.iter().zip(&v).enumerate() {
                let w = w.to_f32();
                // (Equal as values: the sum O = 0 + 1 · v turns -0 into +0.)
                assert!(
                    *g == w || (g.is_nan() && w.is_nan()),
                    "d {d} {isa:?}: e4m3 {x:#04x} read as {g}, is {w}"
                );
            }
        }
    }
}

/// Decode over an FP8 cache, K and V read as stored, on every instruction set and split count,
/// against attention in f64 over the dequantized values (odd lengths and head dims, GQA,
/// causal with more keys than queries, subnormal and largest codes); reruns are bitwise equal.
#[test]
fn fp8_caches_match_f64_on_every_isa() {
    for (b, sq, sk, d, h, hk) in [
        (2, 1, 77, 40, 6, 2),
        (1, 3, 301, 13, 4, 4),
        (3, 2, 130, 128, 8, 1),
    ] {
        let p = problem(b, sq, sk, h, hk, d);
        // Codes over the whole finite range (NaN codes, 0x7f and 0xff, skipped), their order
        // differing between K and V and over the rows.
        let code = |i: usize, salt: usize| {
            let c = ((i * 37 + salt * 11) % 254) as u8;
            float8::F8E4M3::from_bits(if c >= 0x7f { c + 1 } else { c })
        };
        let n = b * sk * hk * d;
        let k: Vec<float8::F8E4M3> = (0..n).map(|i| code(i, 1)).collect();
        let v: Vec<float8::F8E4M3> = (0..n).map(|i| code(i, 5)).collect();
        // Queries small enough that the scores (up to 448² per term) stay in exp2's range.
        let q: Vec<f32> = (0..b * sq * h * d)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 2e-5)
            .collect();
        let scale = p.score.scale as f64;
        // out[b, i, h, :], causal from the bottom right: row i sees keys j <= i + sk - sq.
        let mut want = vec![0f64; b * sq * h * d];
        for bb in 0..b {
            for i in 0..sq {
                for hh in 0..h {
                    let kh = hh / (h / hk);
                    let qr = &q[((bb * sq + i) * h + hh) * d..][..d];
                    let row = |t: &[float8::F8E4M3], j: usize| {
                        t[((bb * sk + j) * hk + kh) * d..][..d]
                            .iter()
                            .map(|x| x.to_f32() as f64)
                            .collect::<Vec<f64>>()
                    };
                    let seen = i + sk - sq + 1;
                    let s: Vec<f64> = (0..seen)
                        .map(|j| {
                            let kr = row(&k, j);
                            scale * qr.iter().zip(&kr).map(|(a, c)| *a as f64 * c).sum::<f64>()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    let o = &mut want[((bb * sq + i) * h + hh) * d..][..d];
                    for (j, sj) in s.iter().enumerate() {
                        let w = (sj - m).exp() / l;
                        for (o, x) in o.iter_mut().zip(row(&v, j)) {
                            *o += w * x;
                        }
                    }
                }
            }
        }
        let top = want.iter().fold(1f64, |m, x| m.max(x.abs()));
        for isa in Isa::available() {
            for threads in [1, 3] {
                let run = || {
                    forward_with(
                        isa,
                        false,
                        TileUse::Off,
                        threads,
                        1,
                        &p,
                        None,
                        &q,
                        [&k, &v],
                        &Extras::default(),
                    )
                };
                let (got, _) = run();
                // NaN-propagating largest difference, relative to the largest output.
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| ((*g as f64 - w) / top).abs())
                    .fold(0f64, |m, e| if e > m || e.is_nan() { e } else { m });
                assert!(
                    err <= 1e-5,
                    "({b}, {sq}, {sk}, {d}, {h}/{hk}) {isa:?} threads {threads}: error {err}"
                );
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&run().0),
                    "{isa:?} threads {threads}: reruns"
                );
            }
        }
    }
}
