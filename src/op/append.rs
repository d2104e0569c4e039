//! Appending new keys or values to a KV cache in place: the write half of
//! [`FlashAttn::forward_kvcache`](super::FlashAttn::forward_kvcache).

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, Layout, Result};

use crate::problem::{Paged, Strides};

/// Writes `new` `(batch, seq_new, kv_heads, head_dim)` into the cache
/// `(num_blocks, page, kv_heads, head_dim)` at positions `start[b] ..` of each sequence,
/// addressed through the (validated) block table. A contiguous cache is the paged one with one
/// block per sequence.
pub(super) struct AppendKv<'a> {
    pub paged: &'a Paged,
    /// Each sequence's length before the append (host copy; unused on the GPU).
    pub start: &'a [usize],
    /// The same lengths left on the GPU (u32 or i32 `(batch,)`), for the CUDA append.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub start_dev: Option<&'a candle::Tensor>,
}

impl AppendKv<'_> {
    fn copy<T: Copy>(&self, cache: &mut [T], cl: &Layout, new: &[T], nl: &Layout) -> Result<()> {
        let (dst, src) = (Strides::dense(cl), Strides::dense(nl));
        let &[batch, seq_new, kv_heads, d] = nl.dims() else {
            bail!(
                "flash-attn: k_new/v_new must have rank 4, got {:?}",
                nl.dims()
            )
        };
        let pg = self.paged;
        let last = |s: &Strides, b: usize, r: usize, h: usize| s.at(b, r, h) + (d - 1) * s.dim;
        if batch * seq_new * kv_heads * d == 0 {
            return Ok(());
        }
        // Bounds once: the largest address of either side is at its last index.
        if last(&src, batch - 1, seq_new - 1, kv_heads - 1) >= new.len()
            || last(&dst, pg.num_blocks - 1, pg.page - 1, kv_heads - 1) >= cache.len()
        {
            bail!("flash-attn: kv cache or new keys smaller than their layouts claim")
        }
        for (b, &start) in self.start.iter().enumerate() {
            let table = &pg.table[b * pg.max_blocks..(b + 1) * pg.max_blocks];
            for t in 0..seq_new {
                let j = start + t;
                let (blk, row) = (table[j / pg.page] as usize, j % pg.page);
                for h in 0..kv_heads {
                    let (o, i) = (dst.at(blk, row, h), src.at(b, t, h));
                    for x in 0..d {
                        cache[o + x * dst.dim] = new[i + x * src.dim];
                    }
                }
            }
        }
        Ok(())
    }
}

impl candle::InplaceOp2 for AppendKv<'_> {
    fn name(&self) -> &'static str {
        "flash-attn-append-kv"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        new: &CpuStorage,
        nl: &Layout,
    ) -> Result<()> {
        match (cache, new) {
            (CpuStorage::F32(c), CpuStorage::F32(n)) => self.copy(c, cl, n, nl),
            (CpuStorage::F16(c), CpuStorage::F16(n)) => self.copy(c, cl, n, nl),
            (CpuStorage::BF16(c), CpuStorage::BF16(n)) => self.copy(c, cl, n, nl),
            (CpuStorage::F8E4M3(c), CpuStorage::F8E4M3(n)) => self.copy(c, cl, n, nl),
            (c, n) => bail!(
                "flash-attn: the kv cache ({:?}) and the new keys/values ({:?}) must share one of \
                 f32/f16/bf16/F8E4M3",
                c.dtype(),
                n.dtype()
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle::CudaStorage,
        cl: &Layout,
        new: &candle::CudaStorage,
        nl: &Layout,
    ) -> Result<()> {
        let Some(start) = self.start_dev else {
            bail!("flash-attn: the CUDA KV-cache append needs the cache lengths on the GPU")
        };
        crate::cuda::append_kv(cache, cl, new, nl, self.paged, start)
    }
}
