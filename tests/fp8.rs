//! FP8 (e4m3) operands against the f64 reference of the dequantized inputs (`stored ·
//! descale`): FP8 KV caches with bf16/f16 queries and all-FP8 calls; dense, varlen, paged and
//! KV-cache calls (new rows quantized on append); and the errors of bad FP8 calls.
//!
//! Tolerance: FlashAttention's rule of the suite, against the naive path run in the output's
//! dtype on the dequantized inputs rounded to that dtype. An e4m3 value converts exactly to
//! f32, f16 and bf16, so what the fast path adds to the dtype's own error is the rounding of
//! `q · q_descale · k_descale` to the compute dtype and one more rounding of the output after
//! `v_descale`: about one unit roundoff each, which the naive path's error (several units over
//! a softmax) covers.

#[macro_use]
mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{naive_attention, FlashAttn, PlanOverride};
use common::*;

/// Distinct descales per (sequence, K/V head), so that a swapped or missing one shows.
fn descales(batch: usize, hk: usize, salt: usize) -> Vec<f32> {
    (0..batch * hk)
        .map(|i| (1 + (i * 7 + salt * 3) % 5) as f32 / 64.0)
        .collect()
}

/// `x` (rows of `(heads, d)`, leading dims flattened; row `r` of sequence `seq[r]`) quantized
/// with `descale` (`batch × hk`): the stored F8E4M3 tensor (shaped like `x`) and its
/// dequantized values in f64.
fn quantize(x: &Tensor, seq: &[usize], hk: usize, descale: &[f32]) -> Result<(Tensor, Tensor)> {
    let dims = x.dims().to_vec();
    let (heads, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows = x.elem_count() / (heads * d);
    let group = heads / hk;
    let f: Vec<f32> = (0..rows * heads)
        .map(|i| descale[seq[i / heads] * hk + (i % heads) / group])
        .collect();
    let f = Tensor::from_vec(f, (rows, heads, 1), &Device::Cpu)?;
    let x = x.to_dtype(DType::F32)?.reshape((rows, heads, d))?;
    let stored = x.broadcast_div(&f)?.to_dtype(DType::F8E4M3)?;
    let deq = stored
        .to_dtype(DType::F32)?
        .to_dtype(DType::F64)?
        .broadcast_mul(&f.to_dtype(DType::F64)?)?;
    Ok((
        stored.reshape(dims.as_slice())?,
        deq.reshape(dims.as_slice())?,
    ))
}

fn table(batch: usize, hk: usize, v: &[f32], dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), (batch, hk), dev)
}

/// For each query row (of sequence `seq_q[r]`) and head, in the lse's layout (`(b, h, sq)` with
/// `rows_per_seq`, else `(h, total_q)`): `scale · max_j Σ_x |q_x k_jx|` over the keys of its
/// sequence, a bound on `|score|` (f64, dequantized inputs). Rounding `q · q_descale ·
/// k_descale` to a dtype of unit roundoff `u` moves every score by at most `u` times it, and the
/// log-sum-exp by as much.
fn score_bounds(
    q: &Tensor,
    k: &Tensor,
    seq_q: &[usize],
    cu_k: &[usize],
    scale: f64,
    rows_per_seq: Option<usize>,
) -> Result<Vec<f64>> {
    let (h, d) = (q.dim(q.rank() - 2)?, q.dim(q.rank() - 1)?);
    let hk = k.dim(k.rank() - 2)?;
    let (qv, kv) = (values(q)?, values(k)?);
    let rows = seq_q.len();
    let mut out = vec![0f64; rows * h];
    for (r, &b) in seq_q.iter().enumerate() {
        for hi in 0..h {
            let qr = &qv[(r * h + hi) * d..][..d];
            let g = hi / (h / hk);
            let m = (cu_k[b]..cu_k[b + 1])
                .map(|j| {
                    let kr = &kv[(j * hk + g) * d..][..d];
                    qr.iter().zip(kr).map(|(a, b)| (a * b).abs()).sum::<f64>()
                })
                .fold(0f64, f64::max);
            let at = match rows_per_seq {
                Some(sq) => (b * h + hi) * sq + r % sq,
                None => hi * rows + r,
            };
            out[at] = scale * m;
        }
    }
    Ok(out)
}

/// Checks an FP8 call's output and lse against the reference of the dequantized inputs: the
/// output by the suite's rule with the naive path in the output's dtype as the yardstick, the
/// lse within the suite's bound plus the unit roundoff of the compute dtype (the GPU's is the
/// output's) times each row's score bound ([`score_bounds`]).
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    out: &Tensor,
    lse: &Tensor,
    want: &[f64],
    want_lse: &[f64],
    bounds: &[f64],
    naive: &Tensor,
    out_dtype: DType,
) {
    assert_eq!(out.dtype(), out_dtype, "{what}: output dtype");
    assert_close(what, out, naive, want, true);
    let u = match (out.device().is_cuda(), out_dtype) {
        (false, _) => 0.0,
        (true, DType::F16) => REL_FLOOR_F16,
        (true, _) => REL_FLOOR_BF16,
    };
    let got = values(lse).unwrap();
    assert_eq!(got.len(), want_lse.len(), "{what}: lse length");
    for (i, ((&a, &r), &bound)) in got.iter().zip(want_lse).zip(bounds).enumerate() {
        let ok = if r.is_finite() {
            (a - r).abs() <= 1e-4 * r.abs().max(1.0) + 1e-3 + u * bound
        } else {
            a == r || (a.is_nan() && r.is_nan())
        };
        assert!(
            ok,
            "{what}: lse[{i}] = {a}, reference {r} (score bound {bound:.3e})"
        );
    }
}

/// Dense calls: decode and prefill shapes, GQA and MHA, odd head dims, causal, windows and
/// softcap, a key bias (`-inf` at some keys) and a per-head bias in the output's dtype; FP8 K/V
/// with bf16 and f16 queries, and FP8 everywhere (with and without descales).
fn dense(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let shapes = [
        (2, 1, 257, 8, 2, 128),
        (1, 113, 203, 6, 2, 80),
        (3, 4, 64, 4, 4, 64),
        (1, 16, 1000, 8, 1, 256),
    ];
    for (n, &(b, sq, sk, h, hk, d)) in shapes.iter().enumerate() {
        let opts = match n % 3 {
            0 => FlashAttn::new(scale(d)).causal(),
            1 => FlashAttn::new(scale(d))
                .window(Some(40), Some(0))
                .softcap(20.0),
            _ => FlashAttn::new(scale(d)),
        };
        let seed = 10 * n as u64;
        let (qx, kx, vx) = (
            randn(&[b, sq, h, d], DType::F32, seed, &cpu)?,
            randn(&[b, sk, hk, d], DType::F32, seed + 1, &cpu)?,
            randn(&[b, sk, hk, d], DType::F32, seed + 2, &cpu)?,
        );
        let (kd, vd) = (descales(b, hk, 1), descales(b, hk, 2));
        let rows_q: Vec<usize> = (0..b * sq).map(|r| r / sq).collect();
        let rows_k: Vec<usize> = (0..b * sk).map(|r| r / sk).collect();
        let (k8, kq) = quantize(&kx, &rows_k, hk, &kd)?;
        let (v8, vq) = quantize(&vx, &rows_k, hk, &vd)?;
        for (kind, qdt) in [
            ("kv", DType::BF16),
            ("kv", DType::F16),
            ("all", DType::BF16),
        ] {
            let (q_in, q_deq, qd) = if kind == "all" {
                let qd = descales(b, hk, 3);
                let (q8, qq) = quantize(&qx, &rows_q, hk, &qd)?;
                (q8, qq, Some(qd))
            } else {
                let q = qx.to_dtype(qdt)?;
                (q.clone(), q.to_dtype(DType::F64)?, None)
            };
            // A bias in the output's dtype: one value per key, or per head and key.
            let out_dt = if kind == "all" { DType::BF16 } else { qdt };
            let opts = match n {
                0 => {
                    let mut kb = values(&randn(&[b, 1, 1, sk], DType::F32, seed + 5, &cpu)?)?;
                    kb.iter_mut()
                        .skip(3)
                        .step_by(7)
                        .for_each(|x| *x = f64::NEG_INFINITY);
                    let kb = Tensor::new(kb, &cpu)?.reshape((b, 1, 1, sk))?;
                    opts.clone().bias(&kb.to_dtype(out_dt)?)
                }
                2 => opts
                    .clone()
                    .bias(&randn(&[h, 1, sk], out_dt, seed + 6, &cpu)?),
                _ => opts.clone(),
            };
            let (want, want_lse) = reference(&q_deq, &kq, &vq, &opts)?;
            let y = t.yardstick();
            let low = |x: &Tensor| y.put(&x.to_dtype(qdt)?);
            let naive = naive_attention(&low(&q_deq)?, &low(&kq)?, &low(&vq)?, &y.op(&opts))?;
            let mut op = opts
                .clone()
                .k_descale(&table(b, hk, &kd, &t.dev)?)
                .v_descale(&table(b, hk, &vd, &t.dev)?);
            if let Some(qd) = &qd {
                op = op.q_descale(&table(b, hk, qd, &t.dev)?);
            }
            let (q_in, k_in, v_in) = (t.put(&q_in)?, t.put(&k8)?, t.put(&v8)?);
            t.poison(&out_and_lse_bytes(qdt, b * sq, h, d))?;
            let (out, lse) = t.op(&op).forward_with_lse(&q_in, &k_in, &v_in)?;
            let what = format!("dense {kind} q {qdt:?} b {b} sq {sq} sk {sk} {h}/{hk} d {d}");
            let cu_k: Vec<usize> = (0..=b).map(|i| i * sk).collect();
            let bounds = score_bounds(&q_deq, &kq, &rows_q, &cu_k, scale(d) as f64, Some(sq))?;
            check(&what, &out, &lse, &want, &want_lse, &bounds, &naive, qdt);
            let (again, _) = t.op(&op).forward_with_lse(&q_in, &k_in, &v_in)?;
            assert_bitwise_eq(&format!("{what}: rerun"), &out, &again);
        }
        // No descales at all: the stored values are the values.
        let (q8, qq) = quantize(&qx, &rows_q, hk, &vec![1.0; b * hk])?;
        let (k8, kq) = quantize(&kx, &rows_k, hk, &vec![1.0; b * hk])?;
        let (want, want_lse) = reference(&qq, &kq, &kq, &opts)?;
        let y = t.yardstick();
        let low = |x: &Tensor| y.put(&x.to_dtype(DType::BF16)?);
        let naive = naive_attention(&low(&qq)?, &low(&kq)?, &low(&kq)?, &y.op(&opts))?;
        let k8 = t.put(&k8)?;
        let (out, lse) = t.op(&opts).forward_with_lse(&t.put(&q8)?, &k8, &k8)?;
        let what = format!("dense without descales b {b} sq {sq} sk {sk} {h}/{hk} d {d}");
        let cu_k: Vec<usize> = (0..=b).map(|i| i * sk).collect();
        let bounds = score_bounds(&qq, &kq, &rows_q, &cu_k, scale(d) as f64, Some(sq))?;
        check(
            &what,
            &out,
            &lse,
            &want,
            &want_lse,
            &bounds,
            &naive,
            DType::BF16,
        );
    }
    Ok(())
}
test_device!(dense, Decode);

/// A ragged varlen batch (an empty sequence, more queries than keys) with per-sequence
/// descales: FP8 K/V under bf16 queries, and FP8 everywhere.
fn varlen(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let lens = [(1usize, 17usize), (5, 300), (0, 4), (9, 3), (2, 64)];
    let (h, hk, d) = (6, 2, 64);
    let cu_q = cumulative(&lens.iter().map(|l| l.0).collect::<Vec<_>>());
    let cu_k = cumulative(&lens.iter().map(|l| l.1).collect::<Vec<_>>());
    let seq_of = |cu: &[u32]| -> Vec<usize> {
        (0..cu.len() - 1)
            .flat_map(|b| std::iter::repeat_n(b, (cu[b + 1] - cu[b]) as usize))
            .collect()
    };
    let (sq_of, sk_of) = (seq_of(&cu_q), seq_of(&cu_k));
    let (tq, tk, batch) = (sq_of.len(), sk_of.len(), lens.len());
    let (max_q, max_k) = (9, 300);
    let opts = FlashAttn::new(scale(d)).causal();
    let qx = randn(&[tq, h, d], DType::F32, 1, &cpu)?;
    let kx = randn(&[tk, hk, d], DType::F32, 2, &cpu)?;
    let vx = randn(&[tk, hk, d], DType::F32, 3, &cpu)?;
    let (qd, kd, vd) = (
        descales(batch, hk, 4),
        descales(batch, hk, 5),
        descales(batch, hk, 6),
    );
    let (k8, kq) = quantize(&kx, &sk_of, hk, &kd)?;
    let (v8, vq) = quantize(&vx, &sk_of, hk, &vd)?;
    let cq = t.put(&Tensor::new(cu_q.as_slice(), &cpu)?)?;
    let ck = t.put(&Tensor::new(cu_k.as_slice(), &cpu)?)?;
    for all in [false, true] {
        let (q_in, q_deq) = if all {
            quantize(&qx, &sq_of, hk, &qd)?
        } else {
            let q = qx.to_dtype(DType::BF16)?;
            (q.clone(), q.to_dtype(DType::F64)?)
        };
        let (want, want_lse) = reference_varlen(&q_deq, &kq, &vq, &cu_q, &cu_k, &opts)?;
        let y = t.yardstick();
        let low = |x: &Tensor| y.put(&x.to_dtype(DType::BF16)?);
        let naive = naive_varlen(
            &low(&q_deq)?,
            &low(&kq)?,
            &low(&vq)?,
            &cu_q,
            &cu_k,
            &y.op(&opts),
        )?;
        let mut op = opts
            .clone()
            .k_descale(&table(batch, hk, &kd, &t.dev)?)
            .v_descale(&table(batch, hk, &vd, &t.dev)?);
        if all {
            op = op.q_descale(&table(batch, hk, &qd, &t.dev)?);
        }
        t.poison(&out_and_lse_bytes(DType::BF16, tq, h, d))?;
        let (out, lse) = t.op(&op).forward_varlen_with_lse(
            &t.put(&q_in)?,
            &t.put(&k8)?,
            &t.put(&v8)?,
            &cq,
            &ck,
            max_q,
            max_k,
        )?;
        let what = format!("varlen all-fp8 {all}");
        let cu: Vec<usize> = cu_k.iter().map(|&c| c as usize).collect();
        let bounds = score_bounds(&q_deq, &kq, &sq_of, &cu, scale(d) as f64, None)?;
        check(
            &what,
            &out,
            &lse,
            &want,
            &want_lse,
            &bounds,
            &naive,
            DType::BF16,
        );
    }
    Ok(())
}
test_device!(varlen, Decode);

/// `forward_kvcache` on F8E4M3 caches, contiguous and paged (7- and 16-row pages, shuffled
/// blocks), at head dims 64, 80 and 128: bf16 rows appended are stored as `saturate(x / k_descale)` of their sequence (one
/// planted past e4m3's range saturates to 448), every cache row no sequence owns holds NaN, and
/// the output matches the reference over the dequantized cache after the append.
fn kvcache(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let (h, hk) = (8, 2);
    let lens = [3usize, 17, 0, 40];
    let (b, sq, seq_new, max_len) = (lens.len(), 2, 2, 48);
    let kd = descales(b, hk, 7);
    let vd = descales(b, hk, 8);
    // Head dims that the CUDA decode kernels read as stored (multiples of 16) and one they
    // convert first.
    for (page, d) in [(0usize, 64usize), (7, 80), (16, 128)] {
        // Logical cache contents of each sequence (its first `len` rows), quantized.
        let kx = randn(&[b, max_len, hk, d], DType::F32, page as u64, &cpu)?;
        let vx = randn(&[b, max_len, hk, d], DType::F32, page as u64 + 1, &cpu)?;
        let rows: Vec<usize> = (0..b * max_len).map(|r| r / max_len).collect();
        let (k8, _) = quantize(&kx, &rows, hk, &kd)?;
        let (v8, _) = quantize(&vx, &rows, hk, &vd)?;
        let mut knew = randn(&[b, seq_new, hk, d], DType::F32, 3, &cpu)?;
        // One value far past 448 · descale: stored as 448.
        knew = knew.slice_assign(
            &[0..1, 0..1, 0..1, 0..1],
            &Tensor::full(1e4f32, (1, 1, 1, 1), &cpu)?,
        )?;
        let (knew, vnew) = (
            knew.to_dtype(DType::BF16)?,
            randn(&[b, seq_new, hk, d], DType::BF16, 4, &cpu)?,
        );
        let q = randn(&[b, sq, h, d], DType::BF16, 5, &cpu)?;
        // The caches: NaN everywhere but the rows each sequence owns before the call.
        let nan = f32::NAN;
        let owned = |x: &Tensor| -> Result<Vec<Vec<f32>>> {
            let x = x.to_dtype(DType::F32)?;
            (0..b)
                .map(|s| x.get(s)?.flatten_all()?.to_vec1::<f32>())
                .collect()
        };
        let (kown, vown) = (owned(&k8)?, owned(&v8)?);
        let row = hk * d;
        let (cache_k, cache_v, tab, op) = if page == 0 {
            let fill = |own: &[Vec<f32>]| -> Result<Tensor> {
                let mut c = vec![nan; b * max_len * row];
                for (s, &len) in lens.iter().enumerate() {
                    let base = s * max_len * row;
                    c[base..base + len * row].copy_from_slice(&own[s][..len * row]);
                }
                Tensor::from_vec(c, (b, max_len, hk, d), &cpu)?.to_dtype(DType::F8E4M3)
            };
            (
                fill(&kown)?,
                fill(&vown)?,
                None,
                FlashAttn::new(scale(d)).causal(),
            )
        } else {
            let pages = (max_len).div_ceil(page);
            let nb = b * pages + 2;
            // Shuffled blocks: sequence s's page p is block (s * pages + p) * 5 % nb.
            let blocks: Vec<Vec<u32>> = (0..b)
                .map(|s| {
                    (0..pages)
                        .map(|p| (((s * pages + p) * 5) % nb) as u32)
                        .collect()
                })
                .collect();
            let fill = |own: &[Vec<f32>]| -> Result<Tensor> {
                let mut c = vec![nan; nb * page * row];
                for (s, &len) in lens.iter().enumerate() {
                    for j in 0..len {
                        let dst = (blocks[s][j / page] as usize * page + j % page) * row;
                        c[dst..dst + row].copy_from_slice(&own[s][j * row..(j + 1) * row]);
                    }
                }
                Tensor::from_vec(c, (nb, page, hk, d), &cpu)?.to_dtype(DType::F8E4M3)
            };
            let flat: Vec<u32> = blocks.iter().flatten().copied().collect();
            let tab = Tensor::from_vec(flat, (b, pages), &cpu)?;
            let op = FlashAttn::new(scale(d)).causal().paged(&tab, page);
            (fill(&kown)?, fill(&vown)?, Some(blocks), op)
        };
        let (kc, vc) = (t.put(&cache_k)?, t.put(&cache_v)?);
        let op = t
            .op(&op)
            .k_descale(&table(b, hk, &kd, &t.dev)?)
            .v_descale(&table(b, hk, &vd, &t.dev)?);
        let seqlens = t.put(&Tensor::new(
            lens.iter()
                .map(|&l| l as u32)
                .collect::<Vec<_>>()
                .as_slice(),
            &cpu,
        )?)?;
        t.poison(&out_and_lse_bytes(DType::BF16, b * sq, h, d))?;
        let out = op.forward_kvcache(
            &t.put(&q)?,
            &kc,
            &vc,
            &seqlens,
            Some((&t.put(&knew)?, &t.put(&vnew)?)),
        )?;
        // Each sequence's logical rows after the append, read back from the caches.
        let logical = |c: &Tensor, s: usize, n: usize| -> Result<Tensor> {
            let c = c.to_device(&cpu)?;
            let rows: Vec<Tensor> = (0..n)
                .map(|j| match &tab {
                    None => c.get(s)?.get(j),
                    Some(bl) => c.get(bl[s][j / page] as usize)?.get(j % page),
                })
                .collect::<Result<_>>()?;
            Tensor::stack(&rows, 0)
        };
        let what = format!("kvcache page {page} d {d}");
        let mut want = Vec::new();
        for (s, &len) in lens.iter().enumerate() {
            let n = len + seq_new;
            let (ks, vs) = (logical(&kc, s, n)?, logical(&vc, s, n)?);
            // The appended rows: saturate(x / descale) of this sequence, bit for bit.
            for (name, got, new, dsc) in [("k", &ks, &knew, &kd), ("v", &vs, &vnew, &vd)] {
                let f = Tensor::from_vec(dsc[s * hk..(s + 1) * hk].to_vec(), (1, hk, 1), &cpu)?;
                let expect = new
                    .get(s)?
                    .to_dtype(DType::F32)?
                    .broadcast_div(&f)?
                    .clamp(-448f32, 448f32)?
                    .to_dtype(DType::F8E4M3)?;
                let got = got.narrow(0, len, seq_new)?;
                let (g, e) = (values(&got)?, values(&expect)?);
                assert_eq!(g, e, "{what}: sequence {s}: appended {name} rows");
            }
            let deq = |x: &Tensor, dsc: &[f32]| -> Result<Tensor> {
                let f = Tensor::from_vec(dsc[s * hk..(s + 1) * hk].to_vec(), (1, hk, 1), &cpu)?;
                x.to_dtype(DType::F32)?
                    .to_dtype(DType::F64)?
                    .broadcast_mul(&f.to_dtype(DType::F64)?)?
                    .unsqueeze(0)
            };
            let (kq, vq) = (deq(&ks, &kd)?, deq(&vs, &vd)?);
            let qs = q.get(s)?.unsqueeze(0)?;
            let (o, _) = reference(&qs, &kq, &vq, &FlashAttn::new(scale(d)).causal())?;
            want.extend(o);
        }
        // The yardstick: the naive path over each sequence's dequantized rows in bf16.
        let naive: Vec<Tensor> = lens
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let n = len + seq_new;
                let deq = |c: &Tensor, dsc: &[f32]| -> Result<Tensor> {
                    let f = Tensor::from_vec(dsc[s * hk..(s + 1) * hk].to_vec(), (1, hk, 1), &cpu)?;
                    logical(c, s, n)?
                        .to_dtype(DType::F32)?
                        .broadcast_mul(&f)?
                        .to_dtype(DType::BF16)?
                        .unsqueeze(0)
                };
                naive_attention(
                    &q.get(s)?.unsqueeze(0)?,
                    &deq(&kc, &kd)?,
                    &deq(&vc, &vd)?,
                    &FlashAttn::new(scale(d)).causal(),
                )
            })
            .collect::<Result<_>>()?;
        let naive = Tensor::cat(&naive, 0)?;
        assert_eq!(out.dtype(), DType::BF16, "{what}: output dtype");
        assert_close(&what, &out, &naive, &want, true);
    }
    Ok(())
}
test_device!(kvcache, Decode);

/// The bound on an FP8 prefill's error at each output element, from the f64 reference's
/// probabilities (`(b, sq, h, d)` q and `(b, sk, hk, d)` k and v, dequantized; no mask or
/// bottom-right causal). The sm_90a FP8 forward rounds P = 2^(s - m) to e4m3 for P V (as
/// FlashAttention-3 does), with m a row's reference max, so the largest P is at least 1 and
/// l = sum P >= 1 / p_max (p the exact probabilities): a normal e4m3 P is off by at most 2^-4
/// of itself, a subnormal one (below 2^-6, which needs p < 2^-6 p_max) by at most 2^-10. Then
/// |dO| <= 2^-4 sum p |v| + 2^-10 p_max sum_{p < 2^-6 p_max} |v|, doubled as the suite doubles
/// its yardstick's error, plus the bf16 rounding of the output (2^-8 of it) and a floor.
/// Also each element's expected error if the roundings are independent and uniform (rms: a
/// relative one of at most 2^-4 has a standard deviation below 2^-4 / sqrt 3), which the
/// output's RMS error must stay near: the worst case alone would let a wrong layout of P or V
/// pass where attention is spread over many keys.
fn fp8_prefill_bounds(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let (qv, kv, vv) = (values(q)?, values(k)?, values(v)?);
    let sc = scale(d) as f64;
    let mut out = vec![0f64; b * sq * h * d];
    let mut rms = vec![0f64; b * sq * h * d];
    for bi in 0..b {
        for i in 0..sq {
            for hi in 0..h {
                let g = hi / (h / hk);
                let qr = &qv[((bi * sq + i) * h + hi) * d..][..d];
                let last = if causal {
                    (i + sk).checked_sub(sq)
                } else {
                    Some(sk - 1)
                };
                let Some(last) = last.map(|l| l.min(sk - 1)) else {
                    continue;
                };
                let row = |j: usize| &kv[((bi * sk + j) * hk + g) * d..][..d];
                let s: Vec<f64> = (0..=last)
                    .map(|j| sc * qr.iter().zip(row(j)).map(|(a, b)| a * b).sum::<f64>())
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / l).collect();
                let p_max = p.iter().copied().fold(0f64, f64::max);
                for c in 0..d {
                    let vat = |j: usize| vv[((bi * sk + j) * hk + g) * d + c].abs();
                    let normal: f64 = (0..=last).map(|j| p[j] * vat(j)).sum();
                    let small: f64 = (0..=last).filter(|&j| p[j] < p_max / 64.0).map(vat).sum();
                    let o = ((bi * sq + i) * h + hi) * d + c;
                    out[o] = 2.0 * (normal / 16.0 + small * p_max / 1024.0);
                    let var: f64 = (0..=last).map(|j| (p[j] * vat(j)).powi(2)).sum();
                    rms[o] = (var / 3.0).sqrt() / 16.0 + small * p_max / 1024.0;
                }
            }
        }
    }
    Ok((out, rms))
}

/// All-FP8 prefill calls (the sm_90a FP8 forward on Hopper; elsewhere, and on the CPU, the
/// dequantized path): odd lengths either side of the 128-row and 128-key tiles, more queries
/// than keys, GQA and MHA, causal and not, head dims 64 to 128, with descales; against the f64
/// reference of the dequantized inputs within [`fp8_prefill_bounds`] (the naive yardstick's
/// rule does not apply: the kernel rounds P to e4m3, the yardstick does not), NaN-propagating;
/// reruns bitwise equal.
fn prefill(t: &Target) -> Result<()> {
    let cpu = Device::Cpu;
    let shapes = [
        (2, 200, 333, 8, 2, 128, true),
        (1, 129, 127, 4, 4, 128, false),
        (1, 1000, 1000, 6, 3, 64, true),
        (2, 300, 257, 4, 1, 112, false),
        (1, 64, 1, 2, 1, 128, true),
    ];
    for (n, &(b, sq, sk, h, hk, d, causal)) in shapes.iter().enumerate() {
        let seed = 700 + 10 * n as u64;
        let (qx, kx, vx) = (
            randn(&[b, sq, h, d], DType::F32, seed, &cpu)?,
            randn(&[b, sk, hk, d], DType::F32, seed + 1, &cpu)?,
            randn(&[b, sk, hk, d], DType::F32, seed + 2, &cpu)?,
        );
        let (qd, kd, vd) = (descales(b, hk, 4), descales(b, hk, 5), descales(b, hk, 6));
        let rows_q: Vec<usize> = (0..b * sq).map(|r| r / sq).collect();
        let rows_k: Vec<usize> = (0..b * sk).map(|r| r / sk).collect();
        let (q8, qq) = quantize(&qx, &rows_q, hk, &qd)?;
        let (k8, kq) = quantize(&kx, &rows_k, hk, &kd)?;
        let (v8, vq) = quantize(&vx, &rows_k, hk, &vd)?;
        let opts = match causal {
            true => FlashAttn::new(scale(d)).causal(),
            false => FlashAttn::new(scale(d)),
        };
        let (want, want_lse) = reference(&qq, &kq, &vq, &opts)?;
        let (bounds, rms) = fp8_prefill_bounds(&qq, &kq, &vq, causal)?;
        // On a GPU, each sm_90a FP8 variant (one tile per block, persistent) runs every case
        // (elsewhere the override changes nothing).
        let variants: &[Option<&str>] = match t.dev.is_cuda() {
            true => &[Some("wg2"), Some("wg2p")],
            false => &[None],
        };
        let (q8, k8, v8) = (t.put(&q8)?, t.put(&k8)?, t.put(&v8)?);
        for &variant in variants {
            let mut op = opts
                .clone()
                .q_descale(&table(b, hk, &qd, &t.dev)?)
                .k_descale(&table(b, hk, &kd, &t.dev)?)
                .v_descale(&table(b, hk, &vd, &t.dev)?);
            if let Some(v) = variant {
                op = op.plan_override(PlanOverride {
                    sm90_variant: Some(v.into()),
                    ..Default::default()
                });
            }
            t.poison(&out_and_lse_bytes(DType::BF16, b * sq, h, d))?;
            let (out, lse) = t.op(&op).forward_with_lse(&q8, &k8, &v8)?;
            let what =
                format!("prefill b {b} sq {sq} sk {sk} {h}/{hk} d {d} causal {causal} {variant:?}");
            assert_eq!(out.dtype(), DType::BF16, "{what}: output dtype");
            let got = values(&out)?;
            for (i, ((&a, &r), &bound)) in got.iter().zip(&want).zip(&bounds).enumerate() {
                let tol = bound + r.abs() / 256.0 + 1e-3;
                assert!(
                    (r.is_finite() && (a - r).abs() <= tol) || (a.is_nan() && r.is_nan()),
                    "{what}: out[{i}] = {a}, reference {r}, bound {tol:.3e}"
                );
            }
            // The RMS error against the expected one (with the output's bf16 rounding, RMS 2^-9 of
            // it), within a factor of two.
            let mean = |x: &mut dyn Iterator<Item = f64>| {
                let (s, n) = x.fold((0f64, 0usize), |(s, n), e| (s + e, n + 1));
                s / n.max(1) as f64
            };
            let err = mean(&mut got.iter().zip(&want).map(|(a, r)| (a - r).powi(2))).sqrt();
            let expect = mean(
                &mut rms
                    .iter()
                    .zip(&want)
                    .map(|(e, r)| e * e + (r / 512.0).powi(2)),
            )
            .sqrt();
            assert!(
                err <= 2.0 * expect + 1e-5,
                "{what}: RMS error {err:.3e}, expected about {expect:.3e}"
            );
            // The lse takes unrounded P: the suite's bound plus the compute dtype's roundoff of
            // the scores.
            let cu_k: Vec<usize> = (0..=b).map(|i| i * sk).collect();
            let sb = score_bounds(&qq, &kq, &rows_q, &cu_k, scale(d) as f64, Some(sq))?;
            for (i, ((&a, &r), &bound)) in values(&lse)?.iter().zip(&want_lse).zip(&sb).enumerate()
            {
                let ok = match r.is_finite() {
                    true => {
                        (a - r).abs() <= 1e-4 * r.abs().max(1.0) + 1e-3 + REL_FLOOR_BF16 * bound
                    }
                    false => a == r,
                };
                assert!(ok, "{what}: lse[{i}] = {a}, reference {r}");
            }
            let (again, _) = t.op(&op).forward_with_lse(&q8, &k8, &v8)?;
            assert_bitwise_eq(&format!("{what}: rerun"), &out, &again);
        }
    }
    Ok(())
}
test_device!(prefill, Decode);

/// compute-sanitizer's subset of the FP8 calls: every test above (their shapes are small:
/// head dims 64 to 256, contiguous and paged caches, appends), run with
/// `CANDLE_FLASH_TEST_SMALL=1`, which keeps the naive yardsticks on the host.
#[cfg(feature = "cuda")]
fn sanitizer_fp8_calls(t: &Target) -> Result<()> {
    dense(t)?;
    varlen(t)?;
    prefill(t)?;
    kvcache(t)
}
test_cuda!(sanitizer_fp8_calls, Decode);

/// Bad FP8 calls are errors naming the argument.
#[test]
fn errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[2, 3, 4, 16], DType::BF16, 1, &dev)?;
    let k8 = randn(&[2, 5, 2, 16], DType::F8E4M3, 2, &dev)?;
    let kb = randn(&[2, 5, 2, 16], DType::BF16, 3, &dev)?;
    let good = Tensor::ones((2, 2), DType::F32, &dev)?;
    let op = FlashAttn::new(0.25);
    let fails = |r: Result<Tensor>, needle: &str| {
        let e = r.expect_err(needle).to_string();
        assert!(
            e.contains(needle),
            "expected an error naming {needle}, got: {e}"
        );
    };
    fails(
        op.forward(&q.to_dtype(DType::F8E4M3)?, &kb, &kb),
        "q is F8E4M3",
    );
    fails(op.forward(&q, &k8, &kb), "an FP8 KV cache holds both");
    fails(
        op.forward(&q.to_dtype(DType::F32)?, &k8, &k8),
        "need q in bf16 or f16",
    );
    fails(
        op.clone().q_descale(&good).forward(&q, &k8, &k8),
        "q_descale",
    );
    fails(
        op.clone().k_descale(&good).forward(&q, &kb, &kb),
        "k_descale",
    );
    let bad_shape = Tensor::ones((2, 4), DType::F32, &dev)?;
    fails(
        op.clone().v_descale(&bad_shape).forward(&q, &k8, &k8),
        "v_descale",
    );
    let bad_dtype = Tensor::ones((2, 2), DType::BF16, &dev)?;
    fails(
        op.clone().k_descale(&bad_dtype).forward(&q, &k8, &k8),
        "k_descale",
    );
    // Inference only: tracked inputs and the backward functions are refused.
    let tracked = candle::Var::from_tensor(&q)?;
    fails(op.forward(tracked.as_tensor(), &k8, &k8), "inference only");
    let (out, lse) = op.forward_with_lse(&q, &k8, &k8)?;
    let r = op.backward(&q, &k8, &k8, &out, &out, &lse).map(|g| g.0);
    fails(r, "inference only");
    // A KV-cache append with a descale of the wrong shape, before anything is written.
    let cache = Tensor::zeros((2, 8, 2, 16), DType::F8E4M3, &dev)?;
    let lens = Tensor::new(&[1u32, 2], &dev)?;
    let new = randn(&[2, 1, 2, 16], DType::BF16, 4, &dev)?;
    let r = op.clone().k_descale(&bad_shape).forward_kvcache(
        &q,
        &cache,
        &cache.clone().copy()?,
        &lens,
        Some((&new, &new)),
    );
    fails(r, "k_descale");
    assert!(
        values(&cache)?.iter().all(|&x| x == 0.0),
        "the cache was written"
    );
    Ok(())
}
