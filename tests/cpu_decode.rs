//! The CPU decode kernel (a few query rows per KV head against a long cache) on what its split
//! plan and kernels are sensitive to, against the f64 reference of `tests/common` with the
//! low-precision rule of shared/docs/testing.md: `seq_q` 1 to 16, GQA groups of 1, 3, 4, 6 and
//! 8, lengths that are no multiple of anything, f32/f16/bf16, many split counts (the plan
//! follows the rayon thread count, so each count runs in its own pool), bitwise repeatability,
//! and paged caches (page sizes 1 to 256, shuffled tables, NaN in every row no sequence owns).
//! Every shape here goes to the decode kernel (`cpu::decode::is_decode`: at most
//! `4 · group` rows per KV head in groups of four; its unit tests pin the rule).

mod common;

use candle::{DType, Device, Tensor};
use candle_flash::FlashAttn;
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// A rayon pool of `n` threads: the decode plan splits the cache for this many.
fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .expect("a rayon pool")
}

/// Checks the lse of every row against the reference: `-inf` exactly where no key is seen.
fn check_lse(what: &str, lse: &Tensor, reference: &[f64]) {
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(lse.len(), reference.len(), "{what}: lse length");
    for (i, (&a, &r)) in lse.iter().zip(reference).enumerate() {
        let ok = if r == f64::NEG_INFINITY {
            a == f32::NEG_INFINITY
        } else {
            (a as f64 - r).abs() <= 1e-4 * r.abs().max(1.0) + 1e-3
        };
        assert!(ok, "{what}: lse[{i}] = {a}, reference {r}");
    }
}

/// Runs `opts` on dense inputs in a pool of `threads`, checks output and lse against the
/// reference, and returns the output.
fn check_dense(
    what: &str,
    threads: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> Tensor {
    let (out, lse) = pool(threads)
        .install(|| opts.forward_with_lse(q, k, v))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (want, want_lse) = reference(q, k, v, opts).unwrap();
    let naive = candle_flash::naive_attention(q, k, v, opts).unwrap();
    assert_close(what, &out, &naive, &want, true);
    check_lse(what, &lse, &want_lse);
    out
}

/// `seq_q` from 1 to 16 and GQA groups of 1, 3, 4, 6 and 8 (6/6, 6/2, 32/8, 6/1, 8/1 heads),
/// over lengths of 1, 2, 17, 239, 1000 and 2049 keys, causal (the queries are the last rows).
#[test]
fn seq_q_and_gqa_groups_match_reference() {
    let dev = Device::Cpu;
    // (heads, kv heads, seq_q values): every seq_q the decode kernel takes for the group.
    let configs: [(usize, usize, Vec<usize>); 5] = [
        (8, 1, (1..=16).collect()),
        (32, 8, vec![1, 2, 5, 16]),
        (6, 6, (1..=4).collect()),
        (6, 2, vec![1, 3, 7, 12]),
        (6, 1, vec![1, 2, 9, 12]),
    ];
    let lengths = [1, 2, 17, 239, 1000, 2049];
    let mut n = 0;
    for (h, hk, seq_qs) in &configs {
        for &sq in seq_qs {
            // Cycle the lengths, the dtypes, head dims and batches through the cases.
            let sk = lengths[n % lengths.len()];
            let dtype = DTYPES[n % 3];
            let d = [64, 40, 128][n / 3 % 3];
            let b = 1 + n % 2;
            n += 1;
            let seed = 1000 + n as u64;
            let q = randn(&[b, sq, *h, d], dtype, seed, &dev).unwrap();
            let k = randn(&[b, sk, *hk, d], dtype, seed + 1, &dev).unwrap();
            let v = randn(&[b, sk, *hk, d], dtype, seed + 2, &dev).unwrap();
            let what = format!("{h}/{hk} b {b} sq {sq} sk {sk} d {d} {dtype:?}");
            check_dense(&what, 2, &q, &k, &v, &FlashAttn::new(scale(d)).causal());
        }
    }
}

/// bf16 caches whose whole 16-key blocks take `q·k` on the AMX tiles where the CPU has them
/// (head dims that are multiples of 32 up to 192; 256 stays on the vector kernels): lengths
/// below, at and past one block, and ragged ones, GQA groups 1 to 16 with `seq_q` up to 3
/// (16 to 48 rows per KV head: query tiles shared by several KV heads, and split into chunks of
/// 16 rows), one and two threads. Each also runs on a head-major cache (the `(b, kv, kv heads,
/// d)` view of `(b, kv heads, kv, d)` storage, its rows one head-dim apart) and on a cache
/// narrowed out of a longer one: bitwise equal to the contiguous run.
#[test]
fn bf16_tile_blocks_match_reference() {
    let dev = Device::Cpu;
    let dtype = DType::BF16;
    // (heads, kv heads): groups 1, 2, 3, 4, 5, 7, 8, 16.
    let heads = [
        (1, 1),
        (2, 1),
        (3, 1),
        (32, 8),
        (10, 2),
        (7, 1),
        (8, 1),
        (16, 1),
    ];
    let lengths = [1, 15, 16, 17, 33, 1000, 1013];
    let dims = [128, 64, 32, 192, 96, 256];
    let mut n = 0;
    for (h, hk) in heads {
        for sq in [1, 2, 3] {
            let sk = lengths[n % lengths.len()];
            let d = dims[n % dims.len()];
            let b = 1 + n % 3;
            let threads = 1 + n % 2;
            n += 1;
            let seed = 5000 + n as u64;
            let q = randn(&[b, sq, h, d], dtype, seed, &dev).unwrap();
            let k = randn(&[b, sk, hk, d], dtype, seed + 1, &dev).unwrap();
            let v = randn(&[b, sk, hk, d], dtype, seed + 2, &dev).unwrap();
            let opts = FlashAttn::new(scale(d)).causal();
            let what = format!("{h}/{hk} b {b} sq {sq} sk {sk} d {d} threads {threads}");
            let out = check_dense(&what, threads, &q, &k, &v, &opts);
            let head_major = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap();
            let (kh, vh) = (
                head_major(&k).transpose(1, 2).unwrap(),
                head_major(&v).transpose(1, 2).unwrap(),
            );
            let got = pool(threads)
                .install(|| opts.forward(&q, &kh, &vh))
                .unwrap();
            assert_bitwise_eq(&format!("{what} head-major"), &out, &got);
            // The same rows at an offset inside a longer cache.
            let wide = |t: &Tensor| {
                let pad = randn(&[b, 5, hk, d], dtype, seed + 3, &dev).unwrap();
                Tensor::cat(&[&pad, t, &pad], 1)
                    .unwrap()
                    .narrow(1, 5, sk)
                    .unwrap()
            };
            let got = pool(threads)
                .install(|| opts.forward(&q, &wide(&k), &wide(&v)))
                .unwrap();
            assert_bitwise_eq(&format!("{what} narrowed"), &out, &got);
        }
    }
}

/// The same problem in pools of 1 to 16 threads (one to dozens of splits per sequence): every
/// result matches the reference, all agree with the single-split one far inside the
/// tolerance, and each repeats bit for bit.
#[test]
fn split_counts_agree_and_repeat_bitwise() {
    let dev = Device::Cpu;
    // Large enough that the plan splits it for every thread count (tasks of 256 KiB).
    let (b, sk, h, hk, d) = (3, 4097, 8, 2, 64);
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        for sq in [1, 3] {
            let seed = 2000 + 10 * n as u64 + sq as u64;
            let q = randn(&[b, sq, h, d], dtype, seed, &dev).unwrap();
            let k = randn(&[b, sk, hk, d], dtype, seed + 1, &dev).unwrap();
            let v = randn(&[b, sk, hk, d], dtype, seed + 2, &dev).unwrap();
            let opts = FlashAttn::new(scale(d)).causal();
            let what = format!("{dtype:?} sq {sq}");
            let one = check_dense(&format!("{what} 1 thread"), 1, &q, &k, &v, &opts);
            let one_v = values(&one).unwrap();
            // The rounding of the output dtype bounds how far the merge order can move it.
            let (rel, _, _) = tolerances(dtype);
            let bound = 4.0 * rel * scale_of(&one_v) + 1e-6;
            for threads in [2, 3, 4, 7, 16] {
                let what = format!("{what} {threads} threads");
                let out = check_dense(&what, threads, &q, &k, &v, &opts);
                let err = max_abs_err(&out, &one_v)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{what}: non-finite where one split is finite"));
                assert!(
                    err <= bound,
                    "{what}: {err:.3e} from one split (bound {bound:.3e})"
                );
                let p = pool(threads);
                for _ in 0..3 {
                    let again = p.install(|| opts.forward(&q, &k, &v)).unwrap();
                    assert_bitwise_eq(&format!("{what}, run again"), &out, &again);
                }
            }
        }
    }
}

fn cumulative(lens: &[usize]) -> Vec<u32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0u32, |at, &l| {
            *at += l as u32;
            Some(*at)
        }))
        .collect()
}

/// A seeded permutation of `0..n` (Fisher-Yates over a 64-bit LCG).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed.wrapping_mul(0xD134_2543_DE82_EF95).wrapping_add(1);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        v.swap(i, (state >> 33) as usize % (i + 1));
    }
    v
}

/// Packed keys `(total_k, hk, d)` of sequences of `lens` rows, scattered into a paged cache
/// `(blocks, page, hk, d)` over a shuffled block table with two blocks no table names; NaN in
/// every row no sequence owns. Table entries past a sequence's pages name a block outside the
/// cache (they must never be read). Returns the two caches and the table.
fn to_pages(k: &Tensor, v: &Tensor, lens: &[usize], page: usize, seed: u64) -> [Tensor; 3] {
    let (_, hk, d) = k.dims3().unwrap();
    let pages: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
    let blocks = pages.iter().sum::<usize>() + 2;
    let width = pages.iter().copied().max().unwrap_or(0).max(1) + 1;
    let order = permutation(blocks, seed);
    let mut table = vec![blocks as u32 + 5; lens.len() * width];
    let mut next = 0;
    for (b, &n) in pages.iter().enumerate() {
        for j in 0..n {
            table[b * width + j] = order[next] as u32;
            next += 1;
        }
    }
    let row = hk * d;
    let scatter = |t: &Tensor| {
        let src = values(t).unwrap();
        let mut cache = vec![f32::NAN; blocks * page * row];
        let mut at = 0;
        for (b, &len) in lens.iter().enumerate() {
            for j in 0..len {
                let dst = (table[b * width + j / page] as usize * page + j % page) * row;
                for x in 0..row {
                    cache[dst + x] = src[at * row + x] as f32;
                }
                at += 1;
            }
        }
        Tensor::from_vec(cache, (blocks, page, hk, d), &Device::Cpu)
            .unwrap()
            .to_dtype(t.dtype())
            .unwrap()
    };
    [
        scatter(k),
        scatter(v),
        Tensor::from_vec(table, (lens.len(), width), &Device::Cpu).unwrap(),
    ]
}

/// Paged caches with pages of 1, 7, 16, 32 and 256 rows, sequences of 0, 1 and thousands of
/// keys with 1 to 16 query rows each, split 2 and 5 ways: the packed reference on the same keys.
#[test]
fn paged_caches_match_reference() {
    let dev = Device::Cpu;
    let lens_k = [3001usize, 0, 1, 2333, 777, 16];
    let lens_q = [1usize, 1, 2, 16, 4, 3];
    let (h, hk, d) = (8, 1, 48);
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (tq, tk) = (lens_q.iter().sum(), lens_k.iter().sum());
    let (max_q, max_k) = (16, 3001);
    let seqlens_q = Tensor::new(cu_q.as_slice(), &dev).unwrap();
    let seqlens_k = Tensor::new(cu_k.as_slice(), &dev).unwrap();
    for (n, page) in [1usize, 7, 16, 32, 256].into_iter().enumerate() {
        let dtype = DTYPES[n % 3];
        let seed = 3000 + 10 * n as u64;
        let q = randn(&[tq, h, d], dtype, seed, &dev).unwrap();
        let k = randn(&[tk, hk, d], dtype, seed + 1, &dev).unwrap();
        let v = randn(&[tk, hk, d], dtype, seed + 2, &dev).unwrap();
        let [kc, vc, table] = to_pages(&k, &v, &lens_k, page, seed);
        let opts = FlashAttn::new(scale(d)).causal();
        let (want, want_lse) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
        let naive = naive_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
        for threads in [2, 5] {
            let what = format!("page {page} {dtype:?} {threads} threads");
            let (out, lse) = pool(threads)
                .install(|| {
                    opts.clone()
                        .paged(&table, page)
                        .forward_varlen_with_lse(&q, &kc, &vc, &seqlens_q, &seqlens_k, max_q, max_k)
                })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &out, &naive, &want, true);
            check_lse(&what, &lse, &want_lse);
        }
    }
}
