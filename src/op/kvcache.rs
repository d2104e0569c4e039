//! One call per decode step: append the new keys and values to a KV cache in place, then attend
//! over each sequence's cache (FlashAttention-2's `flash_attn_with_kvcache`).

use candle::{bail, DType, Result, Tensor};

use super::append::AppendKv;
use super::fp8::quantize_new;
use super::validate::read_paged;
use super::FlashAttn;
use crate::problem::{Paged, VarLen};

impl FlashAttn {
    /// Attention against a KV cache, appending to it first: the whole of one decode step (or of
    /// one chunk of a chunked prefill).
    ///
    /// * q: `(batch, seq_q, heads, head_dim)`.
    /// * `k_cache`, `v_cache`: contiguous-per-sequence `(batch, max_len, kv_heads, head_dim)`,
    ///   or paged `(num_blocks, page_block_size, kv_heads, head_dim)` when the op has a block
    ///   table ([`paged`](Self::paged)).
    /// * `cache_seqlens`: integer `(batch,)` (u32; i32/i64 accepted), each sequence's length
    ///   *before* this call.
    /// * `new_kv`: optional `(k_new, v_new)`, `(batch, seq_new, kv_heads, head_dim)`, written
    ///   into the caches in place at positions `cache_seqlens[b] ..` of each sequence.
    ///
    /// Sequence `b` then attends over its `cache_seqlens[b] + seq_new` keys with every option of
    /// the op (mask aligned bottom-right: the queries are the last `seq_q` positions).
    /// Sequences of different lengths need no padding; cache rows past a sequence's length are
    /// never read. Returns `(batch, seq_q, heads, head_dim)` in q's dtype. The caller advances
    /// `cache_seqlens` by `seq_new` for the next step.
    ///
    /// # Errors
    ///
    /// Every input is checked before the caches are written, and an error names the argument:
    /// `cache_seqlens` not an integer `(batch,)` tensor or negative; `k_new`/`v_new` of another
    /// shape, dtype or device than the cache rows, or sharing storage with a cache; a cache that
    /// cannot be written in place (a broadcast view), or the same tensor as both caches; a
    /// sequence whose new length exceeds the cache (`max_len`, or `max_blocks ·
    /// page_block_size` paged); a bad block table (as [`paged`](Self::paged)); and everything
    /// [`forward`](Self::forward) refuses.
    ///
    /// On CUDA nothing is read back to the host: the kernels take the key counts from
    /// `cache_seqlens` on the device, find each sequence's queries from its index (every
    /// sequence has `seq_q` rows, so no cumulative lengths are uploaded) and read a contiguous
    /// cache without a block table. The attention allocates only its output and, for split-KV
    /// decode, the split scratch. So there the values of `cache_seqlens` and of the block table
    /// are not checked (shapes, dtypes and devices are): the kernels clamp them, skipping
    /// appended rows past the cache and reading blocks outside it as zero keys, so a bad value
    /// never reads or writes out of bounds, but the rows it touches get unspecified values.
    ///
    /// # Example
    ///
    /// ```
    /// use candle::{DType, Device, Tensor};
    /// use candle_flash::FlashAttn;
    ///
    /// let dev = Device::Cpu;
    /// // Two sequences of 3 and 5 cached tokens in a cache of 16 positions.
    /// let k_cache = Tensor::zeros((2, 16, 2, 8), DType::F32, &dev)?;
    /// let v_cache = Tensor::zeros((2, 16, 2, 8), DType::F32, &dev)?;
    /// let mut lens = vec![3u32, 5];
    /// for _step in 0..4 {
    ///     let q = Tensor::randn(0f32, 1., (2, 1, 4, 8), &dev)?;
    ///     let k = Tensor::randn(0f32, 1., (2, 1, 2, 8), &dev)?;
    ///     let v = Tensor::randn(0f32, 1., (2, 1, 2, 8), &dev)?;
    ///     let seqlens = Tensor::new(lens.as_slice(), &dev)?;
    ///     let out = FlashAttn::new(0.35)
    ///         .causal()
    ///         .forward_kvcache(&q, &k_cache, &v_cache, &seqlens, Some((&k, &v)))?;
    ///     assert_eq!(out.dims(), &[2, 1, 4, 8]);
    ///     lens.iter_mut().for_each(|l| *l += 1);
    /// }
    /// // The cache is full at 16: appending past it is an error, not an overflow.
    /// let q = Tensor::zeros((2, 1, 4, 8), DType::F32, &dev)?;
    /// let kv = Tensor::zeros((2, 1, 2, 8), DType::F32, &dev)?;
    /// let full = Tensor::new(&[16u32, 9], &dev)?;
    /// let err = FlashAttn::new(0.35).forward_kvcache(&q, &k_cache, &v_cache, &full, Some((&kv, &kv)));
    /// assert!(err.unwrap_err().to_string().contains("cache_seqlens"));
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn forward_kvcache(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        cache_seqlens: &Tensor,
        new_kv: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor> {
        let (batch, seq_q, heads, head_dim) = match q.dims() {
            &[b, s, h, d] => (b, s, h, d),
            d => bail!("flash-attn: q must have rank 4 (batch, seq_q, heads, head_dim), got {d:?}"),
        };
        let cache_dims = match k_cache.dims() {
            &[a, b, c, d] => [a, b, c, d],
            d => bail!(
                "flash-attn: k_cache must have rank 4 (batch, max_len, kv_heads, head_dim) or \
                 (num_blocks, page_block_size, kv_heads, head_dim), got {d:?}"
            ),
        };
        if v_cache.dims() != k_cache.dims() {
            bail!(
                "flash-attn: k_cache has shape {:?} but v_cache has shape {:?}",
                k_cache.dims(),
                v_cache.dims()
            )
        }
        // On the GPU the lengths are never read back: the kernels take them from the device,
        // skip appends past the cache's capacity and clamp the key counts to it.
        let on_gpu = q.device().is_cuda();
        check_cache_seqlens(cache_seqlens, q, batch)?;
        let start = if on_gpu {
            vec![0; batch]
        } else {
            read_cache_seqlens(cache_seqlens)?
        };
        let seq_new = match new_kv {
            None => 0,
            Some((k_new, v_new)) => check_new(k_new, v_new, k_cache, batch, cache_dims)?,
        };
        // New rows for an FP8 cache are stored quantized with their sequence's descale.
        let quantized;
        let new_kv = match new_kv {
            Some((k_new, v_new)) if k_cache.dtype() == DType::F8E4M3 => {
                quantized = (
                    quantize_new("k_new", k_new, "k_descale", self.k_descale.as_ref())?,
                    quantize_new("v_new", v_new, "v_descale", self.v_descale.as_ref())?,
                );
                Some((&quantized.0, &quantized.1))
            }
            other => other,
        };
        let lens: Vec<usize> = start.iter().map(|&s| s + seq_new).collect();
        let paged = match &self.block_table {
            Some(table) => read_paged(table, self.page_block_size, k_cache, &lens)?,
            None => {
                let [cache_batch, max_len, ..] = cache_dims;
                if cache_batch != batch {
                    bail!(
                        "flash-attn: q has batch {batch} but k_cache has batch {cache_batch} (pass \
                         a block table for a paged cache)"
                    )
                }
                if let Some(b) = lens.iter().position(|&l| l > max_len) {
                    bail!(
                        "flash-attn: cache_seqlens[{b}] = {} plus {seq_new} new keys exceeds the \
                         cache's {max_len} positions",
                        start[b]
                    )
                }
                Paged {
                    page: max_len,
                    num_blocks: batch,
                    max_blocks: 1,
                    table: (0..batch as u32).collect(),
                    device_table: None,
                }
            }
        };
        if let Some(b) = lens.iter().position(|&l| l > u32::MAX as usize) {
            bail!("flash-attn: cache_seqlens[{b}] plus {seq_new} new keys overflows u32")
        }
        let mut cu_k = vec![0u32; batch + 1];
        for (b, &len) in lens.iter().enumerate() {
            cu_k[b + 1] = u32::try_from(cu_k[b] as usize + len).map_err(|_| {
                candle::Error::Msg("flash-attn: the total cache length overflows u32".into())
            })?;
        }
        // Uniform query lengths: on CUDA the kernels derive sequence b's rows from b (q_uniform),
        // so this host copy is never uploaded.
        let cu_q = (0..=batch)
            .map(|b| u32::try_from(b * seq_q))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| candle::Error::Msg("flash-attn: batch * seq_q overflows u32".into()))?;
        let capacity = paged.max_blocks * paged.page;
        let vl = VarLen {
            batch,
            max_seqlen_q: if batch == 0 { 0 } else { seq_q },
            max_seqlen_k: if on_gpu {
                capacity
            } else {
                lens.iter().copied().max().unwrap_or(0)
            },
            total_k: 0,
            cu_q,
            cu_k,
            device: None,
            extent: (seq_q, capacity),
        };
        let q3 = q.reshape((batch * seq_q, heads, head_dim))?;
        // Everything is validated before the caches are written.
        let mut problem = self.problem_with(&q3, k_cache, v_cache, Some(vl), Some(paged))?;
        let lens_dev = match cache_seqlens.dtype() {
            DType::U32 | DType::I32 => cache_seqlens.contiguous()?,
            _ => cache_seqlens.to_dtype(DType::U32)?.contiguous()?,
        };
        if on_gpu {
            problem.seqused_k = Some((lens_dev.clone(), seq_new));
        }
        if let Some((k_new, v_new)) = new_kv {
            check_append_targets(k_cache, v_cache, k_new, v_new)?;
            let paged = problem.paged.as_ref().expect("paged problem");
            let append = AppendKv {
                paged,
                start: &start,
                start_dev: on_gpu.then_some(&lens_dev),
            };
            k_cache.inplace_op2(k_new, &append)?;
            v_cache.inplace_op2(v_new, &append)?;
        }
        let (out, _) = self.run(problem, &q3, k_cache, v_cache)?;
        out.reshape((batch, seq_q, heads, head_dim))
    }
}

/// Checks the cache lengths' type, shape and device: an integer `(batch,)` tensor on q's device.
fn check_cache_seqlens(t: &Tensor, q: &Tensor, batch: usize) -> Result<()> {
    if !t.dtype().is_int() {
        bail!(
            "flash-attn: cache_seqlens must be an integer tensor (u32), got {:?}",
            t.dtype()
        )
    }
    if t.dims() != [batch] {
        bail!(
            "flash-attn: cache_seqlens must have shape ({batch},) (one length per sequence of q), \
             got {:?}",
            t.dims()
        )
    }
    if !t.device().same_device(q.device()) {
        bail!("flash-attn: cache_seqlens is on another device than q")
    }
    Ok(())
}

/// Refuses, before either cache is written, what candle's in-place op would only refuse on the
/// second append (after the keys were written): a cache with repeated elements (a zero stride,
/// e.g. a broadcast view), the same tensor as both caches (the values would overwrite the
/// keys), and new keys or values that share storage with a cache (they could be overwritten
/// before they are read).
fn check_append_targets(
    k_cache: &Tensor,
    v_cache: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
) -> Result<()> {
    for (name, cache) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if cache.layout().has_internal_overlap() {
            bail!(
                "flash-attn: {name} has repeated elements (a zero stride, e.g. a broadcast view) \
                 and cannot be appended to in place"
            )
        }
    }
    let (kc, vc) = (storage_addr(k_cache), storage_addr(v_cache));
    if kc == vc && k_cache.layout() == v_cache.layout() {
        bail!("flash-attn: k_cache and v_cache are the same tensor: the values would overwrite the keys")
    }
    for (name, new) in [("k_new", k_new), ("v_new", v_new)] {
        if [kc, vc].contains(&storage_addr(new)) {
            bail!("flash-attn: {name} shares storage with k_cache or v_cache, which it is appended to")
        }
    }
    Ok(())
}

/// The address of a tensor's storage: equal for tensors that share one allocation.
fn storage_addr(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}

/// Reads the (checked) cache lengths to the host, none negative.
fn read_cache_seqlens(t: &Tensor) -> Result<Vec<usize>> {
    t.to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .enumerate()
        .map(|(b, l)| {
            usize::try_from(l).map_err(|_| {
                candle::Error::Msg(format!("flash-attn: cache_seqlens[{b}] = {l} is negative"))
            })
        })
        .collect()
}

/// Checks `k_new`/`v_new` against the cache; returns `seq_new`.
fn check_new(
    k_new: &Tensor,
    v_new: &Tensor,
    k_cache: &Tensor,
    batch: usize,
    cache_dims: [usize; 4],
) -> Result<usize> {
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        match t.dims() {
            &[b, _, h, d] if b == batch && h == cache_dims[2] && d == cache_dims[3] => {}
            d => bail!(
                "flash-attn: {name} must have shape ({batch}, seq_new, {}, {}) (batch of q, kv \
                 heads and head dim of the cache), got {d:?}",
                cache_dims[2],
                cache_dims[3]
            ),
        }
        // An F8E4M3 cache also takes bf16/f16 rows, quantized on the way in.
        let fp8_ok =
            k_cache.dtype() == DType::F8E4M3 && matches!(t.dtype(), DType::BF16 | DType::F16);
        if t.dtype() != k_cache.dtype() && !fp8_ok {
            bail!(
                "flash-attn: {name} has dtype {:?} but the cache has {:?}",
                t.dtype(),
                k_cache.dtype()
            )
        }
        if !t.device().same_device(k_cache.device()) {
            bail!("flash-attn: {name} is on another device than the cache")
        }
    }
    if k_new.dim(1)? != v_new.dim(1)? {
        bail!(
            "flash-attn: k_new has {} new positions but v_new has {}",
            k_new.dim(1)?,
            v_new.dim(1)?
        )
    }
    k_new.dim(1)
}
