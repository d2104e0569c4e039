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
//! Differences from upstream. Accepted here and refused there:
//! - any head dim from 1 to 512 (upstream: multiples of 8), and CPU tensors as well as CUDA ones;
//! - `flash_attn_varlen_paged_windowed` accepts any `page_block_size` (upstream: multiples of
//!   32) and reads the pages inside the kernel on both backends, `mm_prefix_ranges` included.
//!
//! Refused here (an error naming the argument) and passed through there: a negative, NaN or
//! infinite softcap (upstream: a softcap that is not positive is off), and a softmax scale that
//! is not finite.
//!
//! Windows differ only for the first `seq_q - seq_k - 1` query rows of a call with more
//! queries than keys (`diag(i) < -1`): upstream treats a right window of at least `seq_k` as
//! unbounded, and bounds the right side at `seq_k` when only the left one is given; here
//! `Some(w)` is always `w` and `None` always unbounded, as candle-flash's README defines.
//!
//! Not provided: the `FlashAttn` struct that upstream exposes as a `CustomOp3` (models call the
//! functions, not the struct; candle-flash's own `FlashAttn` builder has the same fields and a
//! `forward` method instead).

pub use candle_flash::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed, flash_attn_alibi_windowed_softcap,
    flash_attn_varlen, flash_attn_varlen_alibi, flash_attn_varlen_alibi_windowed,
    flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_paged_windowed,
    flash_attn_varlen_windowed, flash_attn_windowed,
};
#[cfg(test)]
mod tests {
    use super::*;
    use candle::{DType, Device, IndexOp, Result, Tensor};

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
