//! Input validation: every bad argument becomes a `candle::Error` naming it, and a valid call
//! becomes a [`Problem`] that the backends consume.

use candle::{bail, DType, Result, Tensor};

use super::fp8::{self, Fp8};
use super::{FlashAttn, MAX_HEAD_DIM};
use crate::problem::{Kernels, OnDevice, Paged, Prefix, Problem, Strides, VarLen};
use crate::semantics::ScoreMod;

impl FlashAttn {
    /// Validates the inputs against each other and the options, and describes the call.
    pub(crate) fn problem(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: Option<VarLen>,
    ) -> Result<Problem> {
        self.problem_with(q, k, v, varlen, None)
    }

    /// [`problem`](Self::problem) for any K/V source: packed/dense, or paged (varlen only).
    pub(crate) fn problem_with(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: Option<VarLen>,
        paged: Option<Paged>,
    ) -> Result<Problem> {
        let fp8 = Fp8::of(q, k, v)?;
        self.problem_of(q, k, v, varlen, paged, fp8)
    }

    /// [`problem_with`](Self::problem_with) for the operands an FP8 call was rewritten into
    /// (`fp8::Lowered`, no descales left): q in its compute dtype, f32 included, with K and V
    /// converted or as stored.
    pub(crate) fn problem_lowered(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: Option<VarLen>,
        paged: Option<Paged>,
    ) -> Result<Problem> {
        self.problem_of(q, k, v, varlen, paged, Fp8::None)
    }

    fn problem_of(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: Option<VarLen>,
        paged: Option<Paged>,
        fp8: Fp8,
    ) -> Result<Problem> {
        if paged.is_none() && self.block_table.is_some() {
            bail!(
                "flash-attn: a block table (paged K/V) needs forward_varlen or forward_kvcache, \
                 not forward"
            )
        }
        let rank = if varlen.is_some() { 3 } else { 4 };
        let expect = if varlen.is_some() {
            "(total_tokens, heads, head_dim)"
        } else {
            "(batch, seq, heads, head_dim)"
        };
        let (rank_kv, expect_kv) = if paged.is_some() {
            (4, "(num_blocks, page_block_size, kv_heads, head_dim)")
        } else {
            (rank, expect)
        };
        for (name, t, rank, expect) in [
            ("q", q, rank, expect),
            ("k", k, rank_kv, expect_kv),
            ("v", v, rank_kv, expect_kv),
        ] {
            if t.rank() != rank {
                bail!(
                    "flash-attn: {name} must have rank {rank} {expect}, got shape {:?}",
                    t.dims()
                )
            }
        }
        for (name, t) in [("k", k), ("v", v)] {
            check_device(name, t, q)?;
        }
        let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
        let (batch, seq_q, heads, head_dim) = match varlen {
            None => (qd[0], qd[1], qd[2], qd[3]),
            Some(ref vl) => (vl.batch, vl.max_seqlen_q, qd[1], qd[2]),
        };
        let (kv_heads, seq_k) = (kd[rank_kv - 2], if varlen.is_some() { 0 } else { kd[1] });
        if kd != vd {
            bail!("flash-attn: k has shape {kd:?} but v has shape {vd:?}")
        }
        if varlen.is_none() && kd[0] != batch {
            bail!(
                "flash-attn: q has batch {batch} but k and v have batch {}",
                kd[0]
            )
        }
        if kd[rank_kv - 1] != head_dim {
            bail!(
                "flash-attn: q has head_dim {head_dim} but k and v have head_dim {}",
                kd[rank_kv - 1]
            )
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            bail!("flash-attn: head_dim {head_dim} is unsupported (must be 1..={MAX_HEAD_DIM})")
        }
        if kv_heads == 0 {
            bail!("flash-attn: k and v have 0 kv heads")
        }
        if heads % kv_heads != 0 {
            bail!("flash-attn: q has {heads} heads, not a multiple of the {kv_heads} kv heads of k and v")
        }
        if !self.softmax_scale.is_finite() {
            bail!(
                "flash-attn: softmax_scale must be finite, got {}",
                self.softmax_scale
            )
        }
        let softcap = match self.softcap {
            None => 0.0,
            Some(0.0) => 0.0,
            Some(c) if c > 0.0 && c.is_finite() => c,
            Some(c) => {
                bail!("flash-attn: softcap must be a finite positive number (or 0 = off), got {c}")
            }
        };
        fp8::check_descales(self, fp8, [q, k, v], batch, kv_heads)?;
        let alibi_batch_stride = match &self.alibi_slopes {
            None => 0,
            Some(s) => check_alibi(s, q, batch, heads)?,
        };
        let (q_s, k_s, v_s, total_q, max_seq_k) = match &varlen {
            None => (
                Strides::dense(q.layout()),
                Strides::dense(k.layout()),
                Strides::dense(v.layout()),
                batch * seq_q,
                seq_k,
            ),
            Some(vl) if paged.is_some() => (
                Strides::packed(q.layout()),
                Strides::dense(k.layout()),
                Strides::dense(v.layout()),
                qd[0],
                vl.max_seqlen_k,
            ),
            Some(vl) => (
                Strides::packed(q.layout()),
                Strides::packed(k.layout()),
                Strides::packed(v.layout()),
                qd[0],
                vl.max_seqlen_k,
            ),
        };
        if let Some(pg) = &paged {
            if kd[0] != pg.num_blocks || kd[1] != pg.page {
                bail!(
                    "flash-attn: page_block_size {} and the block table's {} blocks do not match \
                     the paged k/v shape {kd:?}",
                    pg.page,
                    pg.num_blocks
                )
            }
        }
        let prefix = match &self.mm_prefix_ranges {
            None => None,
            Some(t) => Some(read_prefix(t, q, batch)?),
        };
        if let Some(s) = &self.sinks {
            check_sinks(s, q, heads)?;
        }
        // A sequence's rows and keys index the bias and the block mask: dense calls span
        // (seq_q, seq_k), packed, paged and KV-cache calls the extents their caller gave.
        let (rows, keys) = varlen.as_ref().map_or((seq_q, seq_k), |vl| vl.extent);
        for (name, given) in [
            ("bias", self.bias.is_some()),
            ("block_mask", self.block_mask.is_some()),
        ] {
            if given && prefix.is_some() {
                bail!("flash-attn: {name} is not supported together with mm_prefix_ranges")
            }
        }
        if let Some(b) = &self.bias {
            let inputs = fp8.out_dtype(q.dtype());
            if b.dtype() != DType::F32 && b.dtype() != inputs {
                bail!(
                    "flash-attn: bias must be f32 or the inputs' dtype {inputs:?}, got {:?}",
                    b.dtype()
                )
            }
            check_device("bias", b, q)?;
            check_broadcast("bias", b.dims(), [batch, heads, rows, keys])?;
        }
        if let Some(m) = &self.block_mask {
            if m.block_q == 0 || m.block_k == 0 {
                bail!(
                    "flash-attn: block_mask block sizes must be positive, got block_q {} and block_k {}",
                    m.block_q,
                    m.block_k
                )
            }
            if m.mask.dtype() != DType::U8 {
                bail!(
                    "flash-attn: block_mask must be u8, got {:?}",
                    m.mask.dtype()
                )
            }
            check_device("block_mask", &m.mask, q)?;
            let blocks = [
                batch,
                heads,
                rows.div_ceil(m.block_q),
                keys.div_ceil(m.block_k),
            ];
            check_broadcast("block_mask", m.mask.dims(), blocks)?;
        }
        Ok(Problem {
            batch,
            heads,
            kv_heads,
            head_dim,
            max_seq_q: seq_q,
            max_seq_k,
            total_q,
            q: q_s,
            k: k_s,
            v: v_s,
            varlen,
            paged,
            prefix,
            window: self.mask(),
            score: ScoreMod {
                scale: self.softmax_scale,
                softcap,
            },
            seqused_k: None,
            has_alibi: self.alibi_slopes.is_some(),
            sinks: self.sinks.clone(),
            bias: self.bias.clone(),
            block_mask: self
                .block_mask
                .as_ref()
                .map(|m| (m.mask.clone(), m.block_q, m.block_k)),
            kv8_descales: None,
            alibi_batch_stride,
            kernels: Kernels {
                portable: self.portable,
                overrides: self.plan_override.clone().unwrap_or_default(),
            },
        })
    }
}

/// The saved forward results and the output gradient handed to [`FlashAttn::backward`]: `out`
/// and `grad_out` in the output's shape (`out` in q's dtype, `grad_out` in any float dtype),
/// `lse` f32 in the log-sum-exp's shape, all on q's device.
pub(super) fn check_saved(
    p: &Problem,
    q: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<()> {
    let (out_shape, lse_shape) = (p.out_shape(), p.lse_shape());
    for (name, t) in [("out", out), ("grad_out", grad_out)] {
        if t.dims() != out_shape.as_slice() {
            bail!(
                "flash-attn backward: {name} must have the output's shape {out_shape:?}, got {:?}",
                t.dims()
            )
        }
        check_device(name, t, q)?;
    }
    if out.dtype() != q.dtype() {
        bail!(
            "flash-attn backward: out must have q's dtype {:?}, got {:?}",
            q.dtype(),
            out.dtype()
        )
    }
    if !matches!(
        grad_out.dtype(),
        DType::F16 | DType::BF16 | DType::F32 | DType::F64
    ) {
        bail!(
            "flash-attn backward: grad_out must be a float tensor, got {:?}",
            grad_out.dtype()
        )
    }
    if lse.dims() != lse_shape.as_slice() || lse.dtype() != DType::F32 {
        bail!(
            "flash-attn backward: lse must be f32 of shape {lse_shape:?} (forward_with_lse), got \
             {:?} {:?}",
            lse.dtype(),
            lse.dims()
        )
    }
    check_device("lse", lse, q)
}

/// `t` (the argument `name`) must live on q's device.
fn check_device(name: &str, t: &Tensor, q: &Tensor) -> Result<()> {
    if !t.device().same_device(q.device()) {
        bail!(
            "flash-attn: {name} is on {:?} but q is on {:?}",
            t.device().location(),
            q.device().location()
        )
    }
    Ok(())
}

/// Checks ALiBi slopes and returns their batch stride (0 for per-head slopes).
fn check_alibi(s: &Tensor, q: &Tensor, batch: usize, heads: usize) -> Result<usize> {
    if s.dtype() != DType::F32 {
        bail!("flash-attn: alibi_slopes must be f32, got {:?}", s.dtype())
    }
    check_device("alibi_slopes", s, q)?;
    match s.dims() {
        [h] if *h == heads => Ok(0),
        [b, h] if *b == batch && *h == heads => Ok(heads),
        d => bail!(
            "flash-attn: alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {d:?}"
        ),
    }
}

/// Checks that `dims` (rank at most 4, leading dimensions left out) broadcast to `to`: each
/// dimension 1 or equal.
fn check_broadcast(name: &str, dims: &[usize], to: [usize; 4]) -> Result<()> {
    let fits = dims.len() <= 4
        && dims
            .iter()
            .rev()
            .zip(to.iter().rev())
            .all(|(&d, &t)| d == 1 || d == t);
    if !fits {
        bail!("flash-attn: {name} of shape {dims:?} does not broadcast to {to:?}")
    }
    Ok(())
}

/// Checks attention sinks: f32 `(heads,)` on q's device.
fn check_sinks(s: &Tensor, q: &Tensor, heads: usize) -> Result<()> {
    if s.dtype() != DType::F32 {
        bail!("flash-attn: sinks must be f32, got {:?}", s.dtype())
    }
    check_device("sinks", s, q)?;
    if s.dims() != [heads] {
        bail!(
            "flash-attn: sinks must have shape ({heads},) (one per query head), got {:?}",
            s.dims()
        )
    }
    Ok(())
}

/// Reads and checks cumulative sequence lengths of a varlen call.
pub(super) fn read_seqlens(
    q: &Tensor,
    k: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    paged: bool,
) -> Result<VarLen> {
    let read = |name: &str, t: &Tensor, total: Option<usize>, max: usize| -> Result<Vec<u32>> {
        if t.dtype() != DType::U32 {
            bail!("flash-attn: {name} must be u32, got {:?}", t.dtype())
        }
        if t.rank() != 1 || t.dims1()? == 0 {
            bail!(
                "flash-attn: {name} must have shape (batch + 1,), got {:?}",
                t.dims()
            )
        }
        check_device(name, t, q)?;
        if q.device().is_cuda() {
            // Never read to the host on the GPU: the kernels clamp whatever the lengths say.
            return Ok(Vec::new());
        }
        let cu = t.to_vec1::<u32>()?;
        if cu[0] != 0 {
            bail!("flash-attn: {name} must start at 0, got {}", cu[0])
        }
        for (b, w) in cu.windows(2).enumerate() {
            if w[1] < w[0] {
                bail!(
                    "flash-attn: {name} must be non-decreasing, got {} then {} at {b}",
                    w[0],
                    w[1]
                )
            }
            if (w[1] - w[0]) as usize > max {
                bail!(
                    "flash-attn: sequence {b} of {name} has length {} > max_seqlen {max}",
                    w[1] - w[0]
                )
            }
        }
        if let Some(total) = total {
            if *cu.last().unwrap_or(&0) as usize != total {
                bail!(
                    "flash-attn: {name} ends at {} but the packed tensor has {total} tokens",
                    cu.last().unwrap_or(&0)
                )
            }
        }
        Ok(cu)
    };
    let mut packed = vec![("q", q)];
    if !paged {
        packed.push(("k", k));
    }
    for (name, t) in packed {
        if t.rank() != 3 {
            bail!("flash-attn: varlen {name} must have rank 3 (total_tokens, heads, head_dim), got {:?}", t.dims())
        }
    }
    let cu_q = read("seqlens_q", seqlens_q, Some(q.dim(0)?), max_seqlen_q)?;
    // Paged keys: the offsets only give each sequence's logical length.
    let total_k = if paged { None } else { Some(k.dim(0)?) };
    let cu_k = read("seqlens_k", seqlens_k, total_k, max_seqlen_k)?;
    let (nq, nk) = (seqlens_q.dim(0)?, seqlens_k.dim(0)?);
    if nq != nk {
        bail!(
            "flash-attn: seqlens_q has {nq} entries but seqlens_k has {nk}: both must be batch + 1"
        )
    }
    if q.device().is_cuda() {
        // The grid is sized from the caller's bounds; nothing is read back.
        return Ok(VarLen {
            batch: nq - 1,
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            total_k: total_k.unwrap_or(0),
            device: Some(OnDevice {
                cu_q: seqlens_q.contiguous()?,
                cu_k: seqlens_k.contiguous()?,
            }),
            extent: (max_seqlen_q, max_seqlen_k),
        });
    }
    // The longest actual sequences, not the caller's bounds: kernels size their grids by them.
    let longest = |cu: &[u32]| {
        cu.windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    };
    Ok(VarLen {
        batch: nq - 1,
        max_seqlen_q: longest(&cu_q),
        max_seqlen_k: longest(&cu_k),
        total_k: *cu_k.last().unwrap_or(&0) as usize,
        cu_q,
        cu_k,
        device: None,
        extent: (max_seqlen_q, max_seqlen_k),
    })
}

/// Reads and checks a block table: integer (u32, i32, i64, …) `(batch, max_blocks)` on q's
/// device, naming `⌈len_b / page⌉` blocks `< num_blocks` for every sequence `b` of `lens`.
pub(super) fn read_paged(
    block_table: &Tensor,
    page_block_size: usize,
    k: &Tensor,
    lens: &[usize],
) -> Result<Paged> {
    if !block_table.dtype().is_int() {
        bail!(
            "flash-attn: block_table must be an integer tensor (u32, i32 or i64), got {:?}",
            block_table.dtype()
        )
    }
    check_device("block_table", block_table, k)?;
    let (batch, max_blocks) = match block_table.dims() {
        &[b, m] => (b, m),
        d => bail!("flash-attn: block_table must have shape (batch, max_blocks), got {d:?}"),
    };
    if batch != lens.len() {
        bail!(
            "flash-attn: block_table has {batch} rows but the call has {} sequences",
            lens.len()
        )
    }
    let (num_blocks, page) = match k.dims() {
        &[n, p, _, _] => (n, p),
        d => bail!(
            "flash-attn: paged k must be (num_blocks, page_block_size, kv_heads, head_dim), got {d:?}"
        ),
    };
    if page_block_size == 0 || page_block_size != page {
        bail!(
            "flash-attn: page_block_size {page_block_size} does not match the page size {page} of \
             k's shape {:?} (num_blocks, page_block_size, kv_heads, head_dim)",
            k.dims()
        )
    }
    if k.device().is_cuda() {
        // Left on the GPU as 4-byte indices; the kernels zero-fill any outside the cache.
        let table = match block_table.dtype() {
            DType::I32 | DType::U32 => block_table.contiguous()?,
            // Through u32 (candle casts i64 to u32 on the GPU, wrapping; the kernels read the
            // bits as i32, so negative indices stay negative and read as zero rows).
            _ => block_table.to_dtype(DType::U32)?.contiguous()?,
        };
        return Ok(Paged {
            page,
            num_blocks,
            max_blocks,
            table: Vec::new(),
            device_table: Some(table),
        });
    }
    let raw = block_table
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    let mut table = vec![0u32; batch * max_blocks];
    for (b, &len) in lens.iter().enumerate() {
        let used = len.div_ceil(page);
        if used > max_blocks {
            bail!(
                "flash-attn: sequence {b} has {len} keys (seqlens_k) but block_table holds {max_blocks} \
                 pages of {page} = {} keys per sequence",
                max_blocks * page
            )
        }
        for (t, &blk) in raw[b * max_blocks..][..used].iter().enumerate() {
            if blk < 0 || blk as u64 >= num_blocks as u64 {
                bail!(
                    "flash-attn: block_table[{b}][{t}] = {blk} is out of range: k and v have \
                     {num_blocks} blocks"
                )
            }
            table[b * max_blocks + t] = blk as u32;
        }
    }
    Ok(Paged {
        page,
        num_blocks,
        max_blocks,
        table,
        device_table: None,
    })
}

/// Reads and checks multimodal prefix ranges: i32 (or another integer type) of shape
/// `(batch, max_ranges, 2)` on q's device.
fn read_prefix(t: &Tensor, q: &Tensor, batch: usize) -> Result<Prefix> {
    if !t.dtype().is_int() {
        bail!(
            "flash-attn: mm_prefix_ranges must be an integer tensor (i32), got {:?}",
            t.dtype()
        )
    }
    check_device("mm_prefix_ranges", t, q)?;
    let max_ranges = match t.dims() {
        &[b, m, 2] if b == batch => m,
        d => bail!(
            "flash-attn: mm_prefix_ranges must have shape ({batch}, max_ranges, 2), got {d:?}"
        ),
    };
    if q.device().is_cuda() {
        let dev = match t.dtype() {
            DType::I32 => t.contiguous()?,
            DType::U32 => t.contiguous()?,
            // Through u32 (wrapping), read back as i32 by the kernels.
            _ => t.to_dtype(DType::U32)?.contiguous()?,
        };
        return Ok(Prefix {
            max_ranges,
            ranges: Vec::new(),
            device: Some(dev),
        });
    }
    let flat = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
    Ok(Prefix {
        max_ranges,
        ranges: flat.chunks_exact(2).map(|r| [r[0], r[1]]).collect(),
        device: None,
    })
}
