//! Paged KV caches, `mm_prefix_ranges` and the one-call-per-step KV cache API against the f64
//! golden reference, on the CPU and (with the `cuda` feature) the GPU, where the decode and
//! row-wise kernels read them (so the decode configurations of tests/common/device.rs apply).
//! Every cache is filled with NaN outside the rows the sequences own: rows past each
//! sequence's length, and whole blocks the table does not name (a kernel that loads them and
//! masks the score still gets 0 · NaN = NaN from V). Inputs are built and scattered on the host,
//! then moved to the device.

#[macro_use]
mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::FlashAttn;
use common::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

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

/// A paged cache on the target whose blocks lie `gap` rows further apart than their `page` rows
/// (NaN between them): a view with a block stride that is not `page` row strides.
fn spread(t: &Target, cache: &Tensor, gap: usize) -> Result<Tensor> {
    let cache = t.put(cache)?;
    if gap == 0 {
        return Ok(cache);
    }
    let (n, page, hk, d) = cache.dims4()?;
    let nan = Tensor::full(f32::NAN, (n, gap, hk, d), cache.device())?.to_dtype(cache.dtype())?;
    Tensor::cat(&[&cache, &nan], 1)?.narrow(1, 0, page)
}

/// Runs one paged varlen call (the cache of `r`'s keys in pages of `page` rows, 3 spare blocks,
/// k's and v's blocks `gaps` rows further apart than a page) and checks it against the
/// reference, with the naive path in the same dtype on the packed keys as the precision
/// yardstick.
#[allow(clippy::too_many_arguments)]
fn check_paged(
    t: &Target,
    what: &str,
    r: &Ragged,
    (h, hk, d): (usize, usize, usize),
    page: usize,
    gaps: (usize, usize),
    dtype: DType,
    opts: &FlashAttn,
    seed: u64,
) -> Result<()> {
    let cpu = Device::Cpu;
    let q = randn(&[r.total_q, h, d], dtype, seed, &cpu)?;
    let k = randn(&[r.total_k, hk, d], dtype, seed + 1, &cpu)?;
    let v = randn(&[r.total_k, hk, d], dtype, seed + 2, &cpu)?;
    let lens_k: Vec<usize> = r.lens.iter().map(|l| l.1).collect();
    let pk = paged_kv(&k, &v, &lens_k, page, 3, seed);
    let table = table_tensor(&pk.table, DType::U32);
    let (cq, ck) = r.tensors(t)?;
    let (q, k, v) = (t.put(&q)?, t.put(&k)?, t.put(&v)?);
    t.poison(&out_and_lse_bytes(dtype, r.total_q, h, d))?;
    let got = t
        .op(&opts.clone().paged(&table, page))
        .forward_varlen(
            &q,
            &spread(t, &pk.k, gaps.0)?,
            &spread(t, &pk.v, gaps.1)?,
            &cq,
            &ck,
            r.max_q,
            r.max_k,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (want, _) = reference_varlen(&q, &k, &v, &r.cu_q, &r.cu_k, opts)?;
    let naive = naive_varlen(&q, &k, &v, &r.cu_q, &r.cu_k, &t.op(opts))?;
    assert_close(what, &got, &naive, &want, true);
    Ok(())
}

/// Pages of 1, 7, 16, 32 and 256 rows over shuffled blocks, decode with sequences of length 0
/// and 1, a few query rows per sequence (the decode kernels) and a longer prefill chunk (the
/// prefill kernels); heads, head dims, options and gaps between the blocks rotate.
fn paged_matches_reference(t: &Target) -> Result<()> {
    let shapes = [
        Ragged::new(&[(1, 0), (1, 1), (1, 300), (1, 45)]),
        Ragged::new(&[(0, 5), (4, 1), (3, 129), (2, 270)]),
        Ragged::new(&[(70, 70), (1, 0), (100, 333)]),
    ];
    let heads = [(32, 8), (6, 2), (4, 1)];
    let mut seed = 100;
    for (pi, page) in [1usize, 7, 16, 32, 256].into_iter().enumerate() {
        for (di, dtype) in DTYPES.into_iter().enumerate() {
            for (si, r) in shapes.iter().enumerate() {
                let (h, hk) = heads[(pi + di + si) % heads.len()];
                let d = [64, 40, 128][(pi + si) % 3];
                let s = scale(d);
                let opts = [
                    FlashAttn::new(s).causal(),
                    FlashAttn::new(s),
                    FlashAttn::new(s).window(Some(20), Some(3)),
                    FlashAttn::new(s).causal().alibi(&head_slopes(h)),
                    FlashAttn::new(s).causal().softcap(2.0),
                ];
                let opts = &opts[(pi + 2 * di + si) % opts.len()];
                let gaps = [(0, 0), (0, 0), (2, 2), (0, 5)][(pi + di + si) % 4];
                seed += 10;
                let what = format!(
                    "page {page} gaps {gaps:?} {dtype:?} lens {:?} heads {h}/{hk} d {d} window ({:?}, {:?}) \
                     softcap {:?} alibi {}",
                    r.lens,
                    opts.window_size_left,
                    opts.window_size_right,
                    opts.softcap,
                    opts.alibi_slopes.is_some()
                );
                check_paged(t, &what, r, (h, hk, d), page, gaps, dtype, opts, seed)?;
            }
        }
    }
    Ok(())
}
test_device!(paged_matches_reference, Decode);

/// Every option on one paged shape, so none depends on the rotation above.
fn paged_every_option(t: &Target) -> Result<()> {
    let r = Ragged::new(&[(1, 90), (3, 17), (40, 60)]);
    let s = scale(32);
    let slopes = Tensor::new(&[[0.5f32, 0.25, 0.125, 0.1, 0.05, 0.01]; 3], &Device::Cpu)?;
    let sinks = Tensor::new(
        &[0.5f32, -2.0, 3.0, f32::NEG_INFINITY, 8.0, 0.0],
        &Device::Cpu,
    )?;
    // A key bias (`-inf` at some keys) and a full one, over (max_seqlen_q, max_seqlen_k).
    let mut kb = values(&randn(&[3, 1, 1, r.max_k], DType::F32, 31, &Device::Cpu)?)?;
    kb.iter_mut()
        .skip(2)
        .step_by(7)
        .for_each(|x| *x = f64::NEG_INFINITY);
    let key_bias = Tensor::new(kb, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((3, 1, 1, r.max_k))?;
    let full_bias = randn(&[3, 6, r.max_q, r.max_k], DType::F32, 32, &Device::Cpu)?;
    let blocks = randn(
        &[3, 6, r.max_q.div_ceil(4), r.max_k.div_ceil(8)],
        DType::F32,
        33,
        &Device::Cpu,
    )?
    .ge(0.0)?
    .to_dtype(DType::U8)?;
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
        FlashAttn::new(s).causal().sinks(&sinks),
        FlashAttn::new(s).window(Some(4), Some(0)).sinks(&sinks),
        FlashAttn::new(s).causal().bias(&key_bias),
        FlashAttn::new(s).window(Some(9), Some(1)).bias(&full_bias),
        FlashAttn::new(s).block_mask(&blocks, 4, 8),
        FlashAttn::new(s)
            .causal()
            .bias(&key_bias)
            .block_mask(&blocks, 4, 8),
    ];
    for (n, opts) in all.iter().enumerate() {
        for page in [7, 16] {
            let what = format!("option set {n}, page {page}");
            check_paged(
                t,
                &what,
                &r,
                (6, 2, 32),
                page,
                if page == 7 { (3, 0) } else { (0, 0) },
                DType::F32,
                opts,
                900 + n as u64,
            )?;
        }
    }
    Ok(())
}
test_device!(paged_every_option, Decode);

/// i32 and i64 block tables (as upstream users pass them) give bitwise the u32 result.
fn block_table_dtypes_agree(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let lens = [9usize, 30];
    let q = randn(&[2, 4, 16], DType::F32, 1, &t.dev)?;
    let k = randn(&[39, 2, 16], DType::F32, 2, &cpu)?;
    let v = randn(&[39, 2, 16], DType::F32, 3, &cpu)?;
    let pk = paged_kv(&k, &v, &lens, 4, 2, 7);
    let (kc, vc) = (t.put(&pk.k)?, t.put(&pk.v)?);
    let sq = Tensor::new(&[0u32, 1, 2], &t.dev)?;
    let sk = Tensor::new(cumulative(&lens).as_slice(), &t.dev)?;
    let run = |dtype| {
        t.op(&FlashAttn::new(0.25)
            .causal()
            .paged(&table_tensor(&pk.table, dtype), 4))
            .forward_varlen(&q, &kc, &vc, &sq, &sk, 1, 30)
    };
    let want = run(DType::U32)?;
    assert_bitwise_eq("i32 table", &run(DType::I32)?, &want);
    assert_bitwise_eq("i64 table", &run(DType::I64)?, &want);
    Ok(())
}
test_device!(block_table_dtypes_agree, Decode);

/// Multimodal prefix ranges, paged and packed, against the spec's reference: an empty range as
/// padding, a range with start > end, ranges beyond the sequence; many query rows (the prefill
/// kernel), then a few (the decode kernel).
fn mm_prefix_ranges_match_reference(t: &Target) -> Result<()> {
    let (h, hk, d) = (4, 2, 24);
    let ranges: [[[i64; 2]; 3]; 4] = [
        [[0, 40], [50, 150], [170, 165]],
        [[3, 9], [20, 30], [-1, -1]],
        [[10, 200], [0, 0], [0, 0]],
        [[0, 0], [0, 0], [0, 0]],
    ];
    let lens_k = [200usize, 32, 150, 7];
    for lens_q in [[200usize, 4, 1, 7], [1, 4, 2, 3]] {
        let lens: Vec<(usize, usize)> = lens_q.iter().copied().zip(lens_k).collect();
        check_prefix(t, &Ragged::new(&lens), &ranges, h, hk, d)?;
    }
    Ok(())
}
test_device!(mm_prefix_ranges_match_reference, Decode);

fn check_prefix(
    t: &Target,
    r: &Ragged,
    ranges: &[[[i64; 2]; 3]],
    h: usize,
    hk: usize,
    d: usize,
) -> Result<()> {
    let cpu = Device::Cpu;
    let s = scale(d);
    let q = randn(&[r.total_q, h, d], DType::F32, 11, &cpu)?;
    let k = randn(&[r.total_k, hk, d], DType::F32, 12, &cpu)?;
    let v = randn(&[r.total_k, hk, d], DType::F32, 13, &cpu)?;
    let flat: Vec<i32> = ranges
        .iter()
        .flatten()
        .flatten()
        .map(|&x| x as i32)
        .collect();
    let rt = Tensor::from_vec(flat, (r.lens.len(), 3, 2), &cpu)?;
    let (cq, ck) = r.tensors(t)?;
    let lens_k: Vec<usize> = r.lens.iter().map(|l| l.1).collect();
    let pk = paged_kv(&k, &v, &lens_k, 16, 2, 5);
    let table = table_tensor(&pk.table, DType::U32);
    let (qd, kd, vd) = (t.put(&q)?, t.put(&k)?, t.put(&v)?);
    for opts in [
        FlashAttn::new(s).causal(),
        FlashAttn::new(s).window(Some(4), Some(0)),
        FlashAttn::new(s).window(Some(0), Some(0)),
    ] {
        let mut want = vec![0f64; r.total_q * h * d];
        for (b, seq) in sequences(&q, &k, &v, &r.cu_q, &r.cu_k, &opts)?
            .iter()
            .enumerate()
        {
            let (o, _) = reference_prefix(&seq.q, &seq.k, &seq.v, &opts, &ranges[b])?;
            want[seq.q0 * h * d..seq.q1 * h * d].copy_from_slice(&o);
        }
        let with = opts.clone().mm_prefix_ranges(&rt);
        let packed = t
            .op(&with)
            .forward_varlen(&qd, &kd, &vd, &cq, &ck, r.max_q, r.max_k)?;
        let paged = t.op(&with.clone().paged(&table, 16)).forward_varlen(
            &qd,
            &t.put(&pk.k)?,
            &t.put(&pk.v)?,
            &cq,
            &ck,
            r.max_q,
            r.max_k,
        )?;
        let what = format!(
            "window {:?}/{:?}",
            opts.window_size_left, opts.window_size_right
        );
        for (kind, got) in [("packed", &packed), ("paged", &paged)] {
            let err = max_abs_err(got, &want)?;
            assert!(
                err.is_some_and(|e| e < 1e-5),
                "mm_prefix {kind} {what}: max error {err:?}"
            );
        }
        // The prefix ranges matter: without them the outputs differ.
        let plain = t
            .op(&opts)
            .forward_varlen(&qd, &kd, &vd, &cq, &ck, r.max_q, r.max_k)?;
        assert!(max_abs_err(&plain, &want)?.is_none_or(|e| e > 1e-2));
    }
    Ok(())
}

/// A KV cache, contiguous `(batch, cap, hk, d)` or paged over shuffled blocks (5 spare), whose
/// first `prompt[b]` rows of sequence `b` hold `k[b]`/`v[b]`, and NaN everywhere else; on the
/// host.
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
        let src = values(t).unwrap();
        let sk = t.dim(1).unwrap();
        let mut cache = vec![f64::NAN; num_blocks * page * row];
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
/// `forward_kvcache` appending 9, 9 (chunked prefill) and 1, 2, 3, 4, 1 (decode) positions,
/// every other run with attention sinks, the others with a key bias over the cache's capacity
/// (`-inf` at some keys of the longest sequence). The rows computed step by step equal each
/// sequence's full causal attention over all its keys (the reference), the last step equals
/// attention over the already appended cache bitwise, and the cache holds NaN everywhere no
/// sequence wrote.
fn kvcache_chunked_prefill_and_decode_match_full_attention(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let (h, hk, d) = (6, 2, 40);
    let prompt = [0usize, 1, 23];
    let steps = [9usize, 9, 1, 2, 3, 4, 1];
    let total: usize = steps.iter().sum();
    let batch = prompt.len();
    let cap = 23 + total + 3;
    let sinks = Tensor::new(&[1.0f32, -0.5, 4.0, 0.0, -2.0, 2.0], &cpu)?;
    for (di, dtype) in DTYPES.into_iter().enumerate() {
        for (pi, paged) in [None, Some(1), Some(7), Some(16), Some(32)]
            .into_iter()
            .enumerate()
        {
            let q = randn(&[batch, total, h, d], dtype, 21, &cpu)?;
            let k = randn(&[batch, cap, hk, d], dtype, 22, &cpu)?;
            let v = randn(&[batch, cap, hk, d], dtype, 23, &cpu)?;
            let cache = new_cache(paged, cap, &k, &v, &prompt);
            let (kc, vc) = (t.put(&cache.k)?, t.put(&cache.v)?);
            // Every other run with attention sinks, the others with a key bias.
            let capacity = paged.map_or(cap, |page| cap.div_ceil(page) * page);
            let mut kb = values(&randn(&[batch, 1, 1, capacity], DType::F32, 24, &cpu)?)?;
            kb[2 * capacity..]
                .iter_mut()
                .step_by(5)
                .for_each(|x| *x = f64::NEG_INFINITY);
            let key_bias = Tensor::new(kb, &cpu)?
                .to_dtype(DType::F32)?
                .reshape((batch, 1, 1, capacity))?;
            // A block mask over the keys (the same for every row), key block 0 open.
            let nk = capacity.div_ceil(8);
            let open: Vec<u8> = (0..batch * nk).map(|x| u8::from(x % nk % 3 != 1)).collect();
            let key_blocks = Tensor::from_vec(open, (batch, 1, 1, nk), &cpu)?;
            let opts = FlashAttn::new(scale(d)).causal();
            let opts = if (di + pi) % 2 == 1 {
                opts.sinks(&sinks)
            } else if pi % 2 == 0 {
                opts.bias(&key_bias)
            } else {
                opts.bias(&key_bias).block_mask(&key_blocks, 1, 8)
            };
            let op = t.op(&match &cache.table {
                Some(table) => opts.clone().paged(table, cache.page),
                None => opts.clone(),
            });
            let what = format!(
                "kvcache {dtype:?} paged {paged:?} sinks {} bias {} blocks {}",
                opts.sinks.is_some(),
                opts.bias.is_some(),
                opts.block_mask.is_some()
            );
            let mut lens = prompt.to_vec();
            let mut outs = Vec::new();
            let mut done = 0;
            for &n in &steps {
                let part = |x: &Tensor| -> Result<Tensor> {
                    let rows = (0..batch)
                        .map(|b| x.narrow(0, b, 1)?.narrow(1, lens[b], n))
                        .collect::<Result<Vec<_>>>()?;
                    t.put(&Tensor::cat(&rows, 0)?)
                };
                let (kn, vn) = (part(&k)?, part(&v)?);
                let qn = t.put(&q.narrow(1, done, n)?)?;
                let seqlens: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
                let seqlens = Tensor::new(seqlens.as_slice(), &t.dev)?;
                let out = op.forward_kvcache(&qn, &kc, &vc, &seqlens, Some((&kn, &vn)))?;
                lens.iter_mut().for_each(|l| *l += n);
                done += n;
                // Append-then-attend equals attending over the appended cache.
                let after: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
                let after = Tensor::new(after.as_slice(), &t.dev)?;
                let again = op.forward_kvcache(&qn, &kc, &vc, &after, None)?;
                assert_bitwise_eq(&format!("{what}: append vs appended"), &out, &again);
                outs.push(out);
            }
            let got = Tensor::cat(&outs, 1)?;
            // Reference per sequence: its queries are the last `total` of its lens[b] positions.
            let mut want = Vec::new();
            let mut naive = Vec::new();
            for (b, &len) in lens.iter().enumerate() {
                let qb = t.put(&q.narrow(0, b, 1)?)?;
                let kb = t.put(&k.narrow(0, b, 1)?.narrow(1, 0, len)?)?;
                let vb = t.put(&v.narrow(0, b, 1)?.narrow(1, 0, len)?)?;
                // Key j of the sequence reads the bias at cache position j.
                let mut one = opts.clone();
                one.bias = match &opts.bias {
                    Some(bias) => Some(bias.narrow(0, b, 1)?.narrow(3, 0, len)?),
                    None => None,
                };
                if let Some(m) = &mut one.block_mask {
                    m.mask = m.mask.narrow(0, b, 1)?.narrow(3, 0, len.div_ceil(8))?;
                }
                want.extend(reference(&qb, &kb, &vb, &one)?.0);
                naive.push(candle_flash::naive_attention(&qb, &kb, &vb, &t.op(&one))?);
            }
            let naive = Tensor::cat(&naive, 0)?;
            assert_close(&what, &got, &naive, &want, true);
            // Exactly the appended rows were written: everything else is still NaN.
            for (name, c) in [("k", &kc), ("v", &vc)] {
                let written = values(c)?.iter().filter(|x| !x.is_nan()).count();
                assert_eq!(
                    written,
                    lens.iter().sum::<usize>() * hk * d,
                    "{what}: {name} cache"
                );
            }
        }
    }
    Ok(())
}
test_device!(
    kvcache_chunked_prefill_and_decode_match_full_attention,
    Decode
);

/// Bad paged and KV cache inputs are errors that name the argument; the caches are untouched.
fn bad_inputs_name_the_argument(t: &Target) -> Result<()> {
    let dev = &t.dev;
    let lens = [5usize, 12];
    let q = randn(&[2, 4, 8], DType::F32, 1, dev)?;
    let k = randn(&[17, 2, 8], DType::F32, 2, &Device::Cpu)?;
    let pk = paged_kv(&k, &k, &lens, 4, 1, 9);
    let (kc, vc) = (t.put(&pk.k)?, t.put(&pk.v)?);
    let sq = Tensor::new(&[0u32, 1, 2], dev)?;
    let sk = Tensor::new(cumulative(&lens).as_slice(), dev)?;
    let good = table_tensor(&pk.table, DType::U32);
    let call = |table: &Tensor, page: usize, sk: &Tensor| {
        t.op(&FlashAttn::new(0.3).paged(table, page))
            .forward_varlen(&q, &kc, &vc, &sq, sk, 1, 16)
    };
    assert!(call(&good, 4, &sk).is_ok());
    let expect = |what: &str, r: Result<Tensor>, needle: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains(needle), "{what}: {e:?} does not name {needle}");
    };
    expect(
        "f32 table",
        call(&good.to_dtype(DType::F32)?, 4, &sk),
        "block_table",
    );
    expect(
        "rank-1 table",
        call(&good.flatten_all()?, 4, &sk),
        "block_table",
    );
    expect(
        "one table row",
        call(&good.narrow(0, 0, 1)?, 4, &sk),
        "block_table",
    );
    // Values: errors on the CPU. On CUDA the library reads neither the table nor the lengths
    // back (documented: the kernels zero-fill blocks outside the cache and clamp lengths to the
    // table's capacity), so there the calls succeed, and compute-sanitizer's memcheck runs of
    // this test check that they stay in bounds.
    let value = |what: &str, r: Result<Tensor>, needle: &str| match t.is_cuda() {
        true => assert!(r.is_ok(), "{what}: {r:?}"),
        false => expect(what, r, needle),
    };
    let mut rows = pk.table.clone();
    rows[1][2] = pk.num_blocks as u32;
    value(
        "block out of range",
        call(&table_tensor(&rows, DType::U32), 4, &sk),
        "block_table[1][2]",
    );
    let neg = Tensor::new(&[[0i32, 1, 2, 3], [4, -1, 5, 6]], &Device::Cpu)?;
    value("negative block", call(&neg, 4, &sk), "block_table[1][1]");
    let long = Tensor::new(&[0u32, 5, 5 + 17], dev)?;
    value(
        "seqlens beyond capacity",
        call(&good, 4, &long),
        "seqlens_k",
    );
    expect("page size mismatch", call(&good, 8, &sk), "page_block_size");
    expect("page size 0", call(&good, 0, &sk), "page_block_size");
    let dense = t
        .op(&FlashAttn::new(0.3).paged(&good, 4))
        .forward(&q.unsqueeze(0)?, &kc, &vc);
    expect("dense forward with a table", dense, "forward_varlen");
    let bad_ranges = Tensor::new(&[[0i32, 4]], &Device::Cpu)?;
    expect(
        "prefix ranges of rank 2",
        t.op(&FlashAttn::new(0.3)
            .mm_prefix_ranges(&bad_ranges)
            .paged(&good, 4))
            .forward_varlen(&q, &kc, &vc, &sq, &sk, 1, 16),
        "mm_prefix_ranges",
    );

    // The KV cache API.
    let (kc, vc) = (
        Tensor::zeros((2, 8, 2, 8), DType::F32, dev)?,
        Tensor::zeros((2, 8, 2, 8), DType::F32, dev)?,
    );
    let q4 = Tensor::zeros((2, 1, 4, 8), DType::F32, dev)?;
    let kn = Tensor::ones((2, 1, 2, 8), DType::F32, dev)?;
    let lens = Tensor::new(&[3u32, 7], dev)?;
    let op = t.op(&FlashAttn::new(0.3));
    let kv = |lens: &Tensor, kn: &Tensor| op.forward_kvcache(&q4, &kc, &vc, lens, Some((kn, kn)));
    expect(
        "f32 lengths",
        kv(&lens.to_dtype(DType::F32)?, &kn),
        "cache_seqlens",
    );
    expect(
        "three lengths",
        kv(&Tensor::new(&[1u32, 2, 3], dev)?, &kn),
        "cache_seqlens",
    );
    // Lengths past the cache: errors on the CPU (before anything is written); on CUDA
    // (documented) the kernels skip appends past the capacity, tried below.
    let full = Tensor::new(&[3u32, 8], dev)?;
    let negative = Tensor::new(&[3i64, -1], dev)?;
    if !t.is_cuda() {
        expect("full cache", kv(&full, &kn), "cache_seqlens[1]");
        expect("negative length", kv(&negative, &kn), "cache_seqlens[1]");
    }
    expect(
        "k_new kv heads",
        kv(&lens, &Tensor::ones((2, 1, 1, 8), DType::F32, dev)?),
        "k_new",
    );
    expect("k_new dtype", kv(&lens, &kn.to_dtype(DType::F16)?), "k_new");
    // Caches that cannot take the append in place, and new keys aliasing a cache; each is
    // refused before the keys are written (candle's in-place op would only refuse the second).
    let broadcast = Tensor::zeros((1, 8, 2, 8), DType::F32, dev)?.broadcast_as((2, 8, 2, 8))?;
    let with = |vc: &Tensor, kn: &Tensor, vn: &Tensor| {
        op.forward_kvcache(&q4, &kc, vc, &lens, Some((kn, vn)))
    };
    expect("broadcast v_cache", with(&broadcast, &kn, &kn), "v_cache");
    expect(
        "v_cache = k_cache",
        with(&kc, &kn, &kn),
        "k_cache and v_cache",
    );
    let alias = vc.narrow(1, 0, 1)?;
    expect("v_new inside v_cache", with(&vc, &kn, &alias), "v_new");
    // None of the refused calls wrote to the caches.
    assert!(values(&kc)?.iter().all(|&x| x == 0.0));
    if t.is_cuda() {
        // Sequence 0 appends at row 3 (as the call below), sequence 1 nowhere.
        assert!(kv(&full, &kn).is_ok() && kv(&negative, &kn).is_ok());
    }
    assert!(kv(&lens, &kn).is_ok());
    assert_eq!(
        values(&kc)?.iter().filter(|&&x| x == 1.0).count(),
        2 * 2 * 8
    );
    Ok(())
}
test_device!(bad_inputs_name_the_argument, Once);
