//! Paged KV caches, `mm_prefix_ranges` and the one-call-per-step KV cache API, on the CPU,
//! against the f64 golden reference of `tests/common` (shared/docs/testing.md, "Decode and paged
//! caches"). Every cache is filled with NaN outside the rows the sequences own: rows past each
//! sequence's length, and whole blocks the table does not name (a kernel that loads them and
//! masks the score still gets 0 · NaN = NaN from V).

mod common;

use candle::{DType, Device, Tensor};
use candle_flash::FlashAttn;
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The device the flash calls of these tests run on: the CPU, or the GPU when
/// `CANDLE_FLASH_TEST_DEVICE=cuda` (scripts/gpu-run.sh runs this binary that way). Inputs and the
/// f64 reference stay on the host either way.
fn test_device() -> Device {
    // One device for the whole binary: candle tells devices apart by instance, not ordinal.
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(
            || match std::env::var("CANDLE_FLASH_TEST_DEVICE").as_deref() {
                Ok("cuda") => {
                    Device::new_cuda(0).expect("CANDLE_FLASH_TEST_DEVICE=cuda: no CUDA device")
                }
                _ => Device::Cpu,
            },
        )
        .clone()
}

/// `t` on the test device.
fn td(t: &Tensor) -> Tensor {
    t.to_device(&test_device()).unwrap()
}

/// `opts` with its ALiBi slopes on the test device.
fn opts_td(opts: &FlashAttn) -> FlashAttn {
    let mut o = opts.clone();
    o.alibi_slopes = o.alibi_slopes.as_ref().map(td);
    o
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

fn cumulative(lens: &[usize]) -> Vec<u32> {
    let mut cu = vec![0u32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    cu
}

/// A seeded permutation of `0..n` (Fisher-Yates on xorshift).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        v.swap(i, (state % (i as u64 + 1)) as usize);
    }
    v
}

/// Packed keys `(total_k, hk, d)` scattered into a paged cache
/// `(num_blocks, page, hk, d)`: shuffled blocks, `spare` more blocks than needed, NaN in every
/// row no sequence owns, and table entries past a sequence's pages naming a NaN block.
struct PagedKv {
    k: Tensor,
    v: Tensor,
    table: Vec<Vec<u32>>,
    num_blocks: usize,
}

fn paged_kv(
    k: &Tensor,
    v: &Tensor,
    lens: &[usize],
    page: usize,
    spare: usize,
    seed: u64,
) -> PagedKv {
    let (_, hk, d) = k.dims3().unwrap();
    let dtype = k.dtype();
    let pages: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
    let num_blocks = pages.iter().sum::<usize>() + spare;
    let max_blocks = pages.iter().copied().max().unwrap_or(0) + 1;
    let order = shuffled(num_blocks, seed);
    // Blocks no sequence gets: the last `spare` of the permutation.
    let unnamed = order.get(num_blocks - spare).copied().unwrap_or(0) as u32;
    let mut next = 0;
    let table: Vec<Vec<u32>> = pages
        .iter()
        .map(|&n| {
            let mut row: Vec<u32> = order[next..next + n].iter().map(|&b| b as u32).collect();
            next += n;
            row.resize(max_blocks, unnamed);
            row
        })
        .collect();
    let row_len = hk * d;
    let scatter = |t: &Tensor| {
        let src = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let src = src.to_vec1::<f32>().unwrap();
        let mut cache = vec![f32::NAN; num_blocks * page * row_len];
        let mut at = 0;
        for (b, &len) in lens.iter().enumerate() {
            for j in 0..len {
                let dst = (table[b][j / page] as usize * page + j % page) * row_len;
                cache[dst..dst + row_len].copy_from_slice(&src[at * row_len..(at + 1) * row_len]);
                at += 1;
            }
        }
        Tensor::from_vec(cache, (num_blocks, page, hk, d), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    PagedKv {
        k: scatter(k),
        v: scatter(v),
        table,
        num_blocks,
    }
}

fn table_tensor(table: &[Vec<u32>], dtype: DType) -> Tensor {
    let (b, m) = (table.len(), table.first().map_or(0, |r| r.len()));
    let flat: Vec<u32> = table.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (b, m), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

struct Case {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    h: usize,
    hk: usize,
    d: usize,
}

/// Runs one paged varlen call and checks it against the reference (with the naive path in the
/// same dtype on the packed keys as the precision yardstick).
fn check_paged(what: &str, c: &Case, page: usize, dtype: DType, opts: &FlashAttn, seed: u64) {
    let dev = Device::Cpu;
    let (tq, tk) = (c.lens_q.iter().sum(), c.lens_k.iter().sum());
    let q = randn(&[tq, c.h, c.d], dtype, seed, &dev).unwrap();
    let k = randn(&[tk, c.hk, c.d], dtype, seed + 1, &dev).unwrap();
    let v = randn(&[tk, c.hk, c.d], dtype, seed + 2, &dev).unwrap();
    let (cu_q, cu_k) = (cumulative(&c.lens_q), cumulative(&c.lens_k));
    let pk = paged_kv(&k, &v, &c.lens_k, page, 3, seed);
    let table = table_tensor(&pk.table, DType::U32);
    let (sq, sk) = (
        Tensor::new(cu_q.as_slice(), &dev).unwrap(),
        Tensor::new(cu_k.as_slice(), &dev).unwrap(),
    );
    let (mq, mk) = (
        *c.lens_q.iter().max().unwrap(),
        *c.lens_k.iter().max().unwrap(),
    );
    let got = opts_td(opts)
        .paged(&td(&table), page)
        .forward_varlen(&td(&q), &td(&pk.k), &td(&pk.v), &td(&sq), &td(&sk), mq, mk)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (want, _) = reference_varlen(&q, &k, &v, &cu_q, &cu_k, opts).unwrap();
    let naive = naive_varlen(&q, &k, &v, &cu_q, &cu_k, opts).unwrap();
    assert_close(what, &got, &naive, &want, true);
}

#[test]
fn paged_matches_reference() {
    let dev = Device::Cpu;
    // (lens_q, lens_k): decode with sequences of length 0 and 1, a few query rows per sequence
    // (the decode kernel), and a longer prefill chunk (the prefill kernel).
    let shapes: [(&[usize], &[usize]); 3] = [
        (&[1, 1, 1, 1], &[0, 1, 300, 45]),
        (&[0, 4, 3, 2], &[5, 1, 129, 270]),
        (&[70, 1, 100], &[70, 0, 333]),
    ];
    let heads = [(32, 8), (6, 2), (4, 1)];
    let slopes = |h: usize| {
        let s: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 % 6 + 1)).collect();
        Tensor::new(s.as_slice(), &dev).unwrap()
    };
    let mut seed = 100;
    for (pi, page) in [1usize, 7, 16, 32, 256].into_iter().enumerate() {
        for (di, dtype) in DTYPES.into_iter().enumerate() {
            for (si, (lq, lk)) in shapes.iter().enumerate() {
                let (h, hk) = heads[(pi + di + si) % heads.len()];
                let d = [64, 40, 128][(pi + si) % 3];
                let s = scale(d);
                let opts = [
                    FlashAttn::new(s).causal(),
                    FlashAttn::new(s),
                    FlashAttn::new(s).window(Some(20), Some(3)),
                    FlashAttn::new(s).causal().alibi(&slopes(h)),
                    FlashAttn::new(s).causal().softcap(2.0),
                ];
                let opts = &opts[(pi + 2 * di + si) % opts.len()];
                let case = Case {
                    lens_q: lq.to_vec(),
                    lens_k: lk.to_vec(),
                    h,
                    hk,
                    d,
                };
                seed += 10;
                let what = format!(
                    "page {page} {dtype:?} lens_q {lq:?} lens_k {lk:?} heads {h}/{hk} d {d} \
                     window ({:?}, {:?}) softcap {:?} alibi {}",
                    opts.window_size_left,
                    opts.window_size_right,
                    opts.softcap,
                    opts.alibi_slopes.is_some()
                );
                check_paged(&what, &case, page, dtype, opts, seed);
            }
        }
    }
}

/// Every option on one paged shape, so none depends on the rotation above.
#[test]
fn paged_every_option() {
    let dev = Device::Cpu;
    let case = Case {
        lens_q: vec![1, 3, 40],
        lens_k: vec![90, 17, 60],
        h: 6,
        hk: 2,
        d: 32,
    };
    let s = scale(32);
    let slopes = Tensor::new(&[[0.5f32, 0.25, 0.125, 0.1, 0.05, 0.01]; 3], &dev).unwrap();
    let all = [
        FlashAttn::new(s),
        FlashAttn::new(s).causal(),
        FlashAttn::new(s).window(Some(7), Some(0)),
        FlashAttn::new(s).window(Some(0), Some(5)),
        FlashAttn::new(s).window(None, Some(2)).softcap(1.5),
        FlashAttn::new(s).causal().alibi(&slopes),
        FlashAttn::new(s)
            .window(Some(9), Some(1))
            .alibi(&slopes)
            .softcap(3.0),
    ];
    for (n, opts) in all.iter().enumerate() {
        for page in [7, 16] {
            let what = format!("option set {n}, page {page}");
            check_paged(&what, &case, page, DType::F32, opts, 900 + n as u64);
        }
    }
}

/// i32 and i64 block tables (as upstream users pass them) give bitwise the u32 result.
#[test]
fn block_table_dtypes_agree() {
    let dev = Device::Cpu;
    let lens = [9usize, 30];
    let q = randn(&[2, 4, 16], DType::F32, 1, &dev).unwrap();
    let k = randn(&[39, 2, 16], DType::F32, 2, &dev).unwrap();
    let v = randn(&[39, 2, 16], DType::F32, 3, &dev).unwrap();
    let pk = paged_kv(&k, &v, &lens, 4, 2, 7);
    let sq = Tensor::new(&[0u32, 1, 2], &dev).unwrap();
    let sk = Tensor::new(cumulative(&lens).as_slice(), &dev).unwrap();
    let run = |dtype| {
        FlashAttn::new(0.25)
            .causal()
            .paged(&table_tensor(&pk.table, dtype), 4)
            .forward_varlen(&q, &pk.k, &pk.v, &sq, &sk, 1, 30)
            .unwrap()
    };
    let want = run(DType::U32);
    assert_bitwise_eq("i32 table", &run(DType::I32), &want);
    assert_bitwise_eq("i64 table", &run(DType::I64), &want);
}

/// Multimodal prefix ranges, paged and packed, against the spec's reference.
#[test]
fn mm_prefix_ranges_match_reference() {
    let (h, hk, d) = (4, 2, 24);
    let s = scale(d);
    // Per sequence: ranges (an empty one is padding), prefix queries and keys.
    let ranges: [[[i64; 2]; 3]; 4] = [
        [[0, 40], [50, 150], [170, 165]],
        [[3, 9], [20, 30], [-1, -1]],
        [[10, 200], [0, 0], [0, 0]],
        [[0, 0], [0, 0], [0, 0]],
    ];
    let lens_k = [200usize, 32, 150, 7];
    // Many query rows (the prefill kernel), then a few (the decode kernel).
    for lens_q in [[200usize, 4, 1, 7], [1, 4, 2, 3]] {
        check_prefix(&lens_q, &lens_k, &ranges, h, hk, d, s);
    }
}

#[allow(clippy::too_many_arguments)]
fn check_prefix(
    lens_q: &[usize],
    lens_k: &[usize],
    ranges: &[[[i64; 2]; 3]],
    h: usize,
    hk: usize,
    d: usize,
    s: f32,
) {
    let dev = Device::Cpu;
    let (cu_q, cu_k) = (cumulative(lens_q), cumulative(lens_k));
    let (tq, tk) = (cu_q[4] as usize, cu_k[4] as usize);
    let (mq, mk) = (*lens_q.iter().max().unwrap(), 200);
    let q = randn(&[tq, h, d], DType::F32, 11, &dev).unwrap();
    let k = randn(&[tk, hk, d], DType::F32, 12, &dev).unwrap();
    let v = randn(&[tk, hk, d], DType::F32, 13, &dev).unwrap();
    let flat: Vec<i32> = ranges
        .iter()
        .flatten()
        .flatten()
        .map(|&x| x as i32)
        .collect();
    let rt = Tensor::from_vec(flat, (4, 3, 2), &dev).unwrap();
    let (sq, sk) = (
        Tensor::new(cu_q.as_slice(), &dev).unwrap(),
        Tensor::new(cu_k.as_slice(), &dev).unwrap(),
    );
    for opts in [
        FlashAttn::new(s).causal(),
        FlashAttn::new(s).window(Some(4), Some(0)),
        FlashAttn::new(s).window(Some(0), Some(0)),
    ] {
        let mut want = vec![0f64; tq * h * d];
        for (b, seq) in sequences(&q, &k, &v, &cu_q, &cu_k, &opts)
            .unwrap()
            .iter()
            .enumerate()
        {
            let (o, _) = reference_prefix(&seq.q, &seq.k, &seq.v, &opts, &ranges[b]).unwrap();
            want[seq.q0 * h * d..seq.q1 * h * d].copy_from_slice(&o);
        }
        let with = opts_td(&opts).mm_prefix_ranges(&td(&rt));
        let (qd, sqd, skd) = (td(&q), td(&sq), td(&sk));
        let packed = with
            .forward_varlen(&qd, &td(&k), &td(&v), &sqd, &skd, mq, mk)
            .unwrap();
        let pk = paged_kv(&k, &v, lens_k, 16, 2, 5);
        let table = table_tensor(&pk.table, DType::U32);
        let paged = with
            .clone()
            .paged(&td(&table), 16)
            .forward_varlen(&qd, &td(&pk.k), &td(&pk.v), &sqd, &skd, mq, mk)
            .unwrap();
        let what = format!(
            "window {:?}/{:?}",
            opts.window_size_left, opts.window_size_right
        );
        for (kind, got) in [("packed", &packed), ("paged", &paged)] {
            let err = max_abs_err(got, &want).unwrap();
            assert!(
                err.is_some_and(|e| e < 1e-5),
                "mm_prefix {kind} {what}: max error {err:?}"
            );
        }
        // The prefix ranges matter: without them the outputs differ.
        let plain = opts.forward_varlen(&q, &k, &v, &sq, &sk, mq, mk).unwrap();
        assert!(max_abs_err(&plain, &want).unwrap().is_none_or(|e| e > 1e-2));
    }
}

/// A KV cache, contiguous `(batch, cap, hk, d)` or paged over shuffled blocks (5 spare), whose
/// first `prompt[b]` rows of sequence `b` hold `k[b]`/`v[b]`, and NaN everywhere else.
struct Cache {
    k: Tensor,
    v: Tensor,
    table: Option<Tensor>,
    page: usize,
}

fn new_cache(paged: Option<usize>, cap: usize, k: &Tensor, v: &Tensor, prompt: &[usize]) -> Cache {
    let (batch, _, hk, d) = k.dims4().unwrap();
    let (page, table, num_blocks) = match paged {
        None => (cap, (0..batch as u32).map(|b| vec![b]).collect(), batch),
        Some(page) => {
            let per = cap.div_ceil(page);
            let num_blocks = batch * per + 5;
            let order = shuffled(num_blocks, 3);
            let table: Vec<Vec<u32>> = (0..batch)
                .map(|b| {
                    order[b * per..(b + 1) * per]
                        .iter()
                        .map(|&x| x as u32)
                        .collect()
                })
                .collect();
            (page, table, num_blocks)
        }
    };
    let row = hk * d;
    let fill = |t: &Tensor| {
        let src = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let src = src.to_vec1::<f32>().unwrap();
        let sk = t.dim(1).unwrap();
        let mut cache = vec![f32::NAN; num_blocks * page * row];
        for (b, &n) in prompt.iter().enumerate() {
            for j in 0..n {
                let dst = (table[b][j / page] as usize * page + j % page) * row;
                let at = (b * sk + j) * row;
                cache[dst..dst + row].copy_from_slice(&src[at..at + row]);
            }
        }
        Tensor::from_vec(cache, (num_blocks, page, hk, d), &Device::Cpu)
            .unwrap()
            .to_dtype(t.dtype())
            .unwrap()
    };
    Cache {
        k: fill(k),
        v: fill(v),
        table: paged.map(|_| table_tensor(&table, DType::I64)),
        page,
    }
}

/// Sequences of different prompt lengths (0, 1, 23) in a cache; then steps through
/// `forward_kvcache` appending 9, 9 (chunked prefill) and 1, 2, 3, 4, 1 (decode) positions.
/// The rows computed step by step equal each sequence's full causal attention over all its
/// keys (the reference), the last step equals attention over the already appended cache
/// bitwise, and the cache holds NaN everywhere no sequence wrote.
#[test]
fn kvcache_chunked_prefill_and_decode_match_full_attention() {
    let dev = Device::Cpu;
    let (h, hk, d) = (6, 2, 40);
    let prompt = [0usize, 1, 23];
    let steps = [9usize, 9, 1, 2, 3, 4, 1];
    let t: usize = steps.iter().sum();
    let batch = prompt.len();
    let cap = 23 + t + 3;
    for dtype in DTYPES {
        for paged in [None, Some(1), Some(7), Some(16), Some(32)] {
            let q = randn(&[batch, t, h, d], dtype, 21, &dev).unwrap();
            let k = randn(&[batch, cap, hk, d], dtype, 22, &dev).unwrap();
            let v = randn(&[batch, cap, hk, d], dtype, 23, &dev).unwrap();
            let cache = new_cache(paged, cap, &k, &v, &prompt);
            let cache = Cache {
                k: td(&cache.k),
                v: td(&cache.v),
                table: cache.table.as_ref().map(td),
                page: cache.page,
            };
            let opts = FlashAttn::new(scale(d)).causal();
            let op = match &cache.table {
                Some(table) => opts.clone().paged(table, cache.page),
                None => opts.clone(),
            };
            let what = format!("kvcache {dtype:?} paged {paged:?}");
            let mut lens = prompt.to_vec();
            let mut outs = Vec::new();
            let mut done = 0;
            for &n in &steps {
                let part = |t: &Tensor| {
                    let rows: Vec<Tensor> = (0..batch)
                        .map(|b| t.narrow(0, b, 1).unwrap().narrow(1, lens[b], n).unwrap())
                        .collect();
                    Tensor::cat(&rows, 0).unwrap()
                };
                let (kn, vn) = (td(&part(&k)), td(&part(&v)));
                let qn = td(&q.narrow(1, done, n).unwrap());
                let seqlens: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
                let seqlens = td(&Tensor::new(seqlens.as_slice(), &dev).unwrap());
                let out = op
                    .forward_kvcache(&qn, &cache.k, &cache.v, &seqlens, Some((&kn, &vn)))
                    .unwrap();
                lens.iter_mut().for_each(|l| *l += n);
                done += n;
                // Append-then-attend equals attending over the appended cache.
                let after: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
                let after = td(&Tensor::new(after.as_slice(), &dev).unwrap());
                let again = op
                    .forward_kvcache(&qn, &cache.k, &cache.v, &after, None)
                    .unwrap();
                assert_bitwise_eq(&format!("{what}: append vs appended"), &out, &again);
                outs.push(out);
            }
            let got = Tensor::cat(&outs, 1).unwrap();
            // Reference per sequence: its t queries are the last t of its lens[b] positions.
            let mut want = Vec::new();
            let mut naive = Vec::new();
            for (b, &len) in lens.iter().enumerate() {
                let qb = q.narrow(0, b, 1).unwrap();
                let kb = k.narrow(0, b, 1).unwrap().narrow(1, 0, len).unwrap();
                let vb = v.narrow(0, b, 1).unwrap().narrow(1, 0, len).unwrap();
                want.extend(reference(&qb, &kb, &vb, &opts).unwrap().0);
                naive.push(candle_flash::naive_attention(&qb, &kb, &vb, &opts).unwrap());
            }
            let naive = Tensor::cat(&naive, 0).unwrap();
            assert_close(&what, &got, &naive, &want, true);
            // Exactly the appended rows were written: everything else is still NaN.
            for (name, c) in [("k", &cache.k), ("v", &cache.v)] {
                let finite = values(c).unwrap().iter().filter(|x| !x.is_nan()).count();
                assert_eq!(
                    finite,
                    lens.iter().sum::<usize>() * hk * d,
                    "{what}: {name} cache"
                );
            }
        }
    }
}

/// Bad paged and KV cache inputs are errors that name the argument; the caches are untouched.
#[test]
fn bad_inputs_name_the_argument() {
    let dev = Device::Cpu;
    let lens = [5usize, 12];
    let q = randn(&[2, 4, 8], DType::F32, 1, &dev).unwrap();
    let k = randn(&[17, 2, 8], DType::F32, 2, &dev).unwrap();
    let pk = paged_kv(&k, &k, &lens, 4, 1, 9);
    let sq = Tensor::new(&[0u32, 1, 2], &dev).unwrap();
    let sk = Tensor::new(cumulative(&lens).as_slice(), &dev).unwrap();
    let good = table_tensor(&pk.table, DType::U32);
    let call = |table: &Tensor, page: usize, sk: &Tensor| {
        FlashAttn::new(0.3)
            .paged(table, page)
            .forward_varlen(&q, &pk.k, &pk.v, &sq, sk, 1, 16)
    };
    assert!(call(&good, 4, &sk).is_ok());
    let expect = |what: &str, r: candle::Result<Tensor>, needle: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains(needle), "{what}: {e:?} does not name {needle}");
    };
    expect(
        "f32 table",
        call(&good.to_dtype(DType::F32).unwrap(), 4, &sk),
        "block_table",
    );
    expect(
        "rank-1 table",
        call(&good.flatten_all().unwrap(), 4, &sk),
        "block_table",
    );
    expect(
        "one table row",
        call(&good.narrow(0, 0, 1).unwrap(), 4, &sk),
        "block_table",
    );
    let mut rows = pk.table.clone();
    rows[1][2] = pk.num_blocks as u32;
    expect(
        "block out of range",
        call(&table_tensor(&rows, DType::U32), 4, &sk),
        "block_table[1][2]",
    );
    let neg = Tensor::new(&[[0i32, 1, 2, 3], [4, -1, 5, 6]], &dev).unwrap();
    expect("negative block", call(&neg, 4, &sk), "block_table[1][1]");
    let long = Tensor::new(&[0u32, 5, 5 + 17], &dev).unwrap();
    expect(
        "seqlens beyond capacity",
        call(&good, 4, &long),
        "seqlens_k",
    );
    expect("page size mismatch", call(&good, 8, &sk), "page_block_size");
    expect("page size 0", call(&good, 0, &sk), "page_block_size");
    let dense = FlashAttn::new(0.3)
        .paged(&good, 4)
        .forward(&q.unsqueeze(0).unwrap(), &pk.k, &pk.v);
    expect("dense forward with a table", dense, "forward_varlen");
    let bad_ranges = Tensor::new(&[[0i32, 4]], &dev).unwrap();
    expect(
        "prefix ranges of rank 2",
        FlashAttn::new(0.3)
            .mm_prefix_ranges(&bad_ranges)
            .paged(&good, 4)
            .forward_varlen(&q, &pk.k, &pk.v, &sq, &sk, 1, 16),
        "mm_prefix_ranges",
    );

    // The KV cache API.
    let (kc, vc) = (
        Tensor::zeros((2, 8, 2, 8), DType::F32, &dev).unwrap(),
        Tensor::zeros((2, 8, 2, 8), DType::F32, &dev).unwrap(),
    );
    let q4 = Tensor::zeros((2, 1, 4, 8), DType::F32, &dev).unwrap();
    let kn = Tensor::ones((2, 1, 2, 8), DType::F32, &dev).unwrap();
    let lens = Tensor::new(&[3u32, 7], &dev).unwrap();
    let op = FlashAttn::new(0.3);
    let kv = |lens: &Tensor, kn: &Tensor| op.forward_kvcache(&q4, &kc, &vc, lens, Some((kn, kn)));
    expect(
        "f32 lengths",
        kv(&lens.to_dtype(DType::F32).unwrap(), &kn),
        "cache_seqlens",
    );
    expect(
        "three lengths",
        kv(&Tensor::new(&[1u32, 2, 3], &dev).unwrap(), &kn),
        "cache_seqlens",
    );
    expect(
        "full cache",
        kv(&Tensor::new(&[3u32, 8], &dev).unwrap(), &kn),
        "cache_seqlens[1]",
    );
    expect(
        "negative length",
        kv(&Tensor::new(&[3i64, -1], &dev).unwrap(), &kn),
        "cache_seqlens[1]",
    );
    expect(
        "k_new kv heads",
        kv(
            &lens,
            &Tensor::ones((2, 1, 1, 8), DType::F32, &dev).unwrap(),
        ),
        "k_new",
    );
    expect(
        "k_new dtype",
        kv(&lens, &kn.to_dtype(DType::F16).unwrap()),
        "k_new",
    );
    // Caches that cannot take the append in place, and new keys aliasing a cache; each is
    // refused before the keys are written (candle's in-place op would only refuse the second).
    let broadcast = Tensor::zeros((1, 8, 2, 8), DType::F32, &dev)
        .unwrap()
        .broadcast_as((2, 8, 2, 8))
        .unwrap();
    let with = |vc: &Tensor, kn: &Tensor, vn: &Tensor| {
        op.forward_kvcache(&q4, &kc, vc, &lens, Some((kn, vn)))
    };
    expect("broadcast v_cache", with(&broadcast, &kn, &kn), "v_cache");
    expect(
        "v_cache = k_cache",
        with(&kc, &kn, &kn),
        "k_cache and v_cache",
    );
    let alias = vc.narrow(1, 0, 1).unwrap();
    expect("v_new inside v_cache", with(&vc, &kn, &alias), "v_new");
    // None of the refused calls wrote to the caches.
    assert!(values(&kc).unwrap().iter().all(|&x| x == 0.0));
    assert!(kv(&lens, &kn).is_ok());
    assert_eq!(
        values(&kc).unwrap().iter().filter(|&&x| x == 1.0).count(),
        2 * 2 * 8
    );
}
