//! `candle-flash-attn` 0.11.1's public functions, served by `candle-flash`.
//!
//! Patch it in and every crate that calls `candle_flash_attn::flash_attn*` (candle-transformers'
//! llama, mistral, qwen3, gemma, phi3, … under their `flash-attn` feature) runs on candle-flash's
//! kernels, with no CUTLASS build:
//!
//! ```toml
//! [patch.crates-io]
//! candle-flash-attn = { path = "path/to/candle-flash/compat/candle-flash-attn" }
//! ```
//!
//! Differences from upstream, all in the direction of accepting more:
//! - any head dim from 1 to 256 (upstream: multiples of 8), and CPU tensors as well as CUDA ones;
//! - `flash_attn_varlen_paged_windowed` accepts any `page_block_size`. On the CPU it reads the
//!   pages in place (candle-flash's own paged kernel, `mm_prefix_ranges` included); on CUDA it
//!   still gathers the paged keys and values into packed tensors and runs the varlen kernel (a
//!   copy of the visible keys, O(total_k)), and refuses `mm_prefix_ranges` with an error.
//!
//! Not provided: the `FlashAttn` struct that upstream exposes as a `CustomOp3` (models call the
//! functions, not the struct; candle-flash's own `FlashAttn` builder has the same fields and a
//! `forward` method instead).

use candle::{bail, DType, Result, Tensor};

pub use candle_flash::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed, flash_attn_alibi_windowed_softcap,
    flash_attn_varlen, flash_attn_varlen_alibi, flash_attn_varlen_alibi_windowed,
    flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_windowed, flash_attn_windowed,
};

/// Varlen attention over a paged K/V cache.
///
/// q: `(total_q, heads, head_dim)`; k, v: `(num_blocks, page_block_size, kv_heads, head_dim)`;
/// `block_table`: integer `(batch, max_blocks)`, row `b` listing the physical blocks that hold
/// sequence `b`'s keys in order; `seqlens_q`/`seqlens_k`: cumulative u32 lengths of `batch + 1`
/// entries (the logical key lengths). Returns `(total_q, heads, head_dim)`.
///
/// On the CPU this is [`candle_flash::flash_attn_varlen_paged_windowed`]; CUDA tensors take the
/// gather path until candle-flash's CUDA kernels read pages.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if !q.device().is_cuda() {
        return candle_flash::flash_attn_varlen_paged_windowed(
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            block_table,
            mm_prefix_ranges,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
            page_block_size,
            softcap,
        );
    }
    if mm_prefix_ranges.is_some() {
        bail!("flash-attn (candle-flash shim): mm_prefix_ranges is not supported")
    }
    let (num_blocks, page, kv_heads, head_dim) = match k.dims() {
        &[n, p, h, d] => (n, p, h, d),
        d => bail!("flash-attn paged: k must be (num_blocks, page_block_size, kv_heads, head_dim), got {d:?}"),
    };
    if v.dims() != k.dims() {
        bail!(
            "flash-attn paged: k has shape {:?} but v has shape {:?}",
            k.dims(),
            v.dims()
        )
    }
    if page != page_block_size || page == 0 {
        bail!(
            "flash-attn paged: page_block_size {page_block_size} does not match k shape {:?}",
            k.dims()
        )
    }
    let index = paged_rows(block_table, seqlens_k, num_blocks, page)?;
    let index = Tensor::from_vec(index.clone(), index.len(), k.device())?;
    // Flattening the pages makes every key a row, so one index_select per tensor packs them in
    // varlen order; the kernel then never needs to know about pages.
    let rows = num_blocks * page;
    let k = k
        .reshape((rows, kv_heads, head_dim))?
        .index_select(&index, 0)?;
    let v = v
        .reshape((rows, kv_heads, head_dim))?
        .index_select(&index, 0)?;
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        &k,
        &v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        softcap.unwrap_or(0.0),
    )
}

/// The flattened page rows holding each sequence's keys, in packed varlen order.
fn paged_rows(
    block_table: &Tensor,
    seqlens_k: &Tensor,
    num_blocks: usize,
    page: usize,
) -> Result<Vec<u32>> {
    if !block_table.dtype().is_int() {
        bail!(
            "flash-attn paged: block_table must be an integer tensor, got {:?}",
            block_table.dtype()
        )
    }
    let table = block_table.to_dtype(DType::I64)?.to_vec2::<i64>()?;
    if seqlens_k.dtype() != DType::U32 {
        bail!(
            "flash-attn paged: seqlens_k must be u32, got {:?}",
            seqlens_k.dtype()
        )
    }
    let cu = seqlens_k.to_vec1::<u32>()?;
    if cu.len() != table.len() + 1 {
        bail!(
            "flash-attn paged: seqlens_k has {} entries but block_table has {} rows (expected rows + 1)",
            cu.len(),
            table.len()
        )
    }
    let rows_total = num_blocks * page;
    if rows_total > u32::MAX as usize {
        bail!("flash-attn paged: {rows_total} cached rows overflow the u32 gather index")
    }
    let mut index = Vec::with_capacity(*cu.last().unwrap_or(&0) as usize);
    for (b, (w, blocks)) in cu.windows(2).zip(&table).enumerate() {
        let len = w[1].checked_sub(w[0]).ok_or_else(|| {
            candle::Error::Msg(format!(
                "flash-attn paged: seqlens_k decreases at sequence {b}"
            ))
        })? as usize;
        for j in 0..len {
            let Some(&block) = blocks.get(j / page) else {
                bail!(
                    "flash-attn paged: sequence {b} has {len} keys but its block_table row holds {} pages of {page}",
                    blocks.len()
                )
            };
            if block < 0 || block as usize >= num_blocks {
                bail!("flash-attn paged: block_table[{b}] names block {block}, k has {num_blocks}")
            }
            index.push((block as usize * page + j % page) as u32);
        }
    }
    Ok(index)
}

// Pin every function to upstream 0.11.1's exact signature: a drift in candle-flash breaks this
// crate's build instead of the build of a user's model. The types are long by nature.
#[allow(clippy::type_complexity)]
mod signatures {
    use super::*;
    type T<'a> = &'a Tensor;
    const _: fn(T, T, T, f32, bool) -> Result<Tensor> = flash_attn;
    const _: fn(T, T, T, f32, Option<usize>, Option<usize>) -> Result<Tensor> = flash_attn_windowed;
    const _: fn(T, T, T, T, f32, bool) -> Result<Tensor> = flash_attn_alibi;
    const _: fn(T, T, T, T, f32, Option<usize>, Option<usize>) -> Result<Tensor> =
        flash_attn_alibi_windowed;
    const _: fn(T, T, T, Option<T>, f32, Option<usize>, Option<usize>, f32) -> Result<Tensor> =
        flash_attn_alibi_windowed_softcap;
    const _: fn(T, T, T, T, T, usize, usize, f32, bool) -> Result<Tensor> = flash_attn_varlen;
    const _: fn(T, T, T, T, T, usize, usize, f32, Option<usize>, Option<usize>) -> Result<Tensor> =
        flash_attn_varlen_windowed;
    const _: fn(
        T,
        T,
        T,
        T,
        T,
        T,
        Option<T>,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
        usize,
        Option<f32>,
    ) -> Result<Tensor> = flash_attn_varlen_paged_windowed;
    const _: fn(T, T, T, T, T, T, usize, usize, f32, bool) -> Result<Tensor> =
        flash_attn_varlen_alibi;
    const _: fn(
        T,
        T,
        T,
        T,
        T,
        T,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
    ) -> Result<Tensor> = flash_attn_varlen_alibi_windowed;
    const _: fn(
        T,
        T,
        T,
        Option<T>,
        T,
        T,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
        f32,
    ) -> Result<Tensor> = flash_attn_varlen_alibi_windowed_softcap;
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{Device, IndexOp};

    /// Bitwise equality of two f32 tensors. (Candle's `max` keeps a value only when `x < y`, so
    /// `(a - b).abs().max()` drops any NaN that is not the first element.)
    fn assert_bitwise_eq(a: &Tensor, b: &Tensor) {
        assert_eq!(a.dims(), b.dims(), "shapes differ");
        let bits = |t: &Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        let (x, y) = (bits(a), bits(b));
        if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
            panic!(
                "element {i} differs: {} vs {}",
                f32::from_bits(x[i]),
                f32::from_bits(y[i])
            );
        }
    }

    /// Paged keys scattered over shuffled blocks give the same output as the packed varlen call.
    #[test]
    fn paged_matches_packed() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hk, d, page) = (4, 2, 24, 4);
        let lens_q = [3u32, 1];
        let lens_k = [7u32, 9];
        let cu = |l: &[u32]| {
            let mut c = vec![0u32];
            l.iter().for_each(|x| c.push(c.last().unwrap() + x));
            c
        };
        let (cu_q, cu_k) = (cu(&lens_q), cu(&lens_k));
        let total_k = cu_k[2] as usize;
        let q = Tensor::randn(0f32, 1., (cu_q[2] as usize, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (total_k, hk, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (total_k, hk, d), &dev)?;
        // Sequence 0 lives in blocks 5, 1 (7 keys), sequence 1 in blocks 0, 4, 2 (9 keys).
        let table: [[u32; 3]; 2] = [[5, 1, 0], [0, 4, 2]];
        let num_blocks = 6;
        let mut kc = Tensor::zeros((num_blocks * page, hk, d), DType::F32, &dev)?;
        let mut vc = kc.clone();
        for b in 0..2 {
            for j in 0..lens_k[b] as usize {
                let dst = table[b][j / page] as usize * page + j % page;
                let src = cu_k[b] as usize + j;
                kc = kc.slice_assign(&[dst..dst + 1, 0..hk, 0..d], &k.i(src..src + 1)?)?;
                vc = vc.slice_assign(&[dst..dst + 1, 0..hk, 0..d], &v.i(src..src + 1)?)?;
            }
        }
        let kc = kc.reshape((num_blocks, page, hk, d))?;
        let vc = vc.reshape((num_blocks, page, hk, d))?;
        let sq = Tensor::new(cu_q.as_slice(), &dev)?;
        let sk = Tensor::new(cu_k.as_slice(), &dev)?;
        let bt = Tensor::new(&table, &dev)?;
        let scale = 1.0 / (d as f32).sqrt();
        let want = flash_attn_varlen(&q, &k, &v, &sq, &sk, 3, 9, scale, true)?;
        let got = flash_attn_varlen_paged_windowed(
            &q,
            &kc,
            &vc,
            &sq,
            &sk,
            &bt,
            None,
            3,
            9,
            scale,
            None,
            Some(0),
            page,
            None,
        )?;
        assert_bitwise_eq(&got, &want);
        Ok(())
    }

    #[test]
    fn paged_bad_inputs_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((2, 2, 8), DType::F32, &dev)?;
        let kc = Tensor::zeros((2, 4, 2, 8), DType::F32, &dev)?;
        let sq = Tensor::new(&[0u32, 2], &dev)?;
        let call = |sk: &[u32], bt: &Tensor, page: usize, mm: Option<&Tensor>| {
            let sk = Tensor::new(sk, &dev)?;
            flash_attn_varlen_paged_windowed(
                &q, &kc, &kc, &sq, &sk, bt, mm, 2, 8, 1.0, None, None, page, None,
            )
        };
        let bt = Tensor::new(&[[0u32, 1]], &dev)?;
        assert!(call(&[0, 9], &bt, 4, None).is_err(), "more keys than pages");
        assert!(call(&[0, 4], &bt, 8, None).is_err(), "page size mismatch");
        assert!(
            call(&[0, 4], &Tensor::new(&[[2u32, 0]], &dev)?, 4, None).is_err(),
            "block out of range"
        );
        assert!(
            call(&[0, 4], &bt, 4, Some(&bt)).is_err(),
            "mm_prefix_ranges of the wrong shape"
        );
        assert!(call(&[0, 8], &bt, 4, None).is_ok());
        Ok(())
    }
}
