//! FP8 (e4m3) operands: a stored value `x` means `x · descale`, with one f32 descale per
//! (sequence, K/V head), as FlashAttention-3 takes them.
//!
//! The descales never touch the big operands. With `c = q_descale · k_descale` and
//! `d = v_descale` of a row's sequence and K/V head,
//! `softmax(scale · (c q)·k) (d v) = d · softmax(scale · (c q)·k) v`: `c` multiplies the (few)
//! query rows, `d` the output, and K and V are attended as stored. Decode calls read e4m3 K and
//! V directly, one byte per element: the CUDA decode kernels (see
//! `kernels/decode/partial.cuh`), and the CPU's decode kernel, which converts each block of keys
//! to f32 (`cpu::forward_kv8`). Elsewhere K and V are converted first, exactly (an e4m3 value is
//! exact in f32, f16 and bf16): to f32 on the CPU, to the output's dtype on the GPU. The result
//! is the one of the dequantized inputs up to that path's rounding: `c q` rounded once to the
//! compute dtype (f32 on the CPU), and the output rounded once more after `d` on the GPU.

use candle::{bail, DType, Result, Tensor};

use super::FlashAttn;
use crate::problem::{Problem, VarLen};

/// Which operands of a call are F8E4M3: none, K and V (an FP8 KV cache), or all three.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fp8 {
    None,
    Kv,
    All,
}

impl Fp8 {
    /// Checks the dtype combination of q, k and v: the same f32/f16/bf16 dtype, F8E4M3 k and v
    /// with q in bf16 or f16, or F8E4M3 everywhere.
    pub fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let f8 = |t: &Tensor| t.dtype() == DType::F8E4M3;
        let (qd, kd, vd) = (q.dtype(), k.dtype(), v.dtype());
        match (f8(q), f8(k), f8(v)) {
            (false, false, false) => {
                if !matches!(qd, DType::F32 | DType::F16 | DType::BF16) {
                    bail!(
                        "flash-attn: q has dtype {qd:?}, only f32, f16, bf16 and F8E4M3 are \
                         supported"
                    )
                }
                for (name, d) in [("k", kd), ("v", vd)] {
                    if d != qd {
                        bail!("flash-attn: {name} has dtype {d:?} but q has {qd:?}")
                    }
                }
                Ok(Self::None)
            }
            (true, true, true) => Ok(Self::All),
            (false, true, true) if matches!(qd, DType::F16 | DType::BF16) => Ok(Self::Kv),
            (false, true, true) => bail!(
                "flash-attn: F8E4M3 k and v (an FP8 KV cache) need q in bf16 or f16 (or \
                 F8E4M3), got {qd:?}"
            ),
            (true, _, _) => bail!(
                "flash-attn: q is F8E4M3, so k and v must be F8E4M3 too, got k {kd:?} and v \
                 {vd:?}"
            ),
            (false, _, _) => bail!(
                "flash-attn: k is {kd:?} but v is {vd:?}: an FP8 KV cache holds both in F8E4M3"
            ),
        }
    }

    /// The dtype of the output (and of a bias in "the inputs' dtype"): bf16 for F8E4M3 q.
    pub fn out_dtype(self, q: DType) -> DType {
        match self {
            Self::All => DType::BF16,
            _ => q,
        }
    }
}

impl FlashAttn {
    /// The descale of an F8E4M3 `q`: f32 `(batch, kv_heads)` on q's device (for varlen and
    /// paged calls `batch` is the number of sequences); the stored query `x` of sequence `b`
    /// and K/V head `g` (query heads `g · group ..`) means `x · q_descale[b][g]`. Absent: 1.
    ///
    /// FP8 calls take `q`, `k` and `v` all in `DType::F8E4M3` (FP8 prefill; the output is
    /// bf16), or `k` and `v` only with `q` in bf16 or f16 (an FP8 KV cache; the output is in
    /// q's dtype). They compute `softmax(scale · (q·qd)(k·kd)ᵀ)(v·vd)` with every other option,
    /// and return the f32 log-sum-exp of those scores. They are inference only: a tracked input
    /// and the backward functions are refused.
    ///
    /// # Errors
    ///
    /// The forward call fails, naming the argument, for a descale that is not f32 of shape
    /// `(batch, kv_heads)` on q's device, a `q_descale` when q is not F8E4M3 (a `k_descale` or
    /// `v_descale` when k and v are not), F8E4M3 q with k or v in another dtype, F8E4M3 k and v
    /// with f32 q, and tracked inputs.
    ///
    /// ```
    /// use candle::{DType, Device, Tensor};
    /// use candle_flash::FlashAttn;
    /// let dev = Device::Cpu;
    /// let q = Tensor::randn(0f32, 1., (1, 3, 4, 16), &dev)?.to_dtype(DType::BF16)?;
    /// // A K/V cache quantized with one scale per (sequence, K/V head).
    /// let k = (Tensor::randn(0f32, 1., (1, 9, 2, 16), &dev)? * 64.)?.to_dtype(DType::F8E4M3)?;
    /// let v = (Tensor::randn(0f32, 1., (1, 9, 2, 16), &dev)? * 64.)?.to_dtype(DType::F8E4M3)?;
    /// let descale = Tensor::new(&[[1f32 / 64., 1. / 64.]], &dev)?;
    /// let out = FlashAttn::new(0.25)
    ///     .causal()
    ///     .k_descale(&descale)
    ///     .v_descale(&descale)
    ///     .forward(&q, &k, &v)?;
    /// assert_eq!((out.dims(), out.dtype()), (&[1, 3, 4, 16][..], DType::BF16));
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn q_descale(mut self, descale: &Tensor) -> Self {
        self.q_descale = Some(descale.clone());
        self
    }

    /// The descale of an F8E4M3 `k`, as [`q_descale`](Self::q_descale). With
    /// [`forward_kvcache`](Self::forward_kvcache) on F8E4M3 caches, new bf16/f16 keys are
    /// stored as `saturate(x / k_descale)` with their sequence's descale.
    pub fn k_descale(mut self, descale: &Tensor) -> Self {
        self.k_descale = Some(descale.clone());
        self
    }

    /// The descale of an F8E4M3 `v`, as [`k_descale`](Self::k_descale).
    pub fn v_descale(mut self, descale: &Tensor) -> Self {
        self.v_descale = Some(descale.clone());
        self
    }

    fn descales(&self) -> [(&'static str, Option<&Tensor>); 3] {
        [
            ("q_descale", self.q_descale.as_ref()),
            ("k_descale", self.k_descale.as_ref()),
            ("v_descale", self.v_descale.as_ref()),
        ]
    }
}

/// Checks the descales of a call whose operands are `kind`: each an f32 `(batch, kv_heads)`
/// tensor on q's device, given only for F8E4M3 operands; and refuses tracked inputs of an FP8
/// call (FP8 attention is inference only).
pub(crate) fn check_descales(
    op: &FlashAttn,
    kind: Fp8,
    [q, k, v]: [&Tensor; 3],
    batch: usize,
    kv_heads: usize,
) -> Result<()> {
    for (i, (name, d)) in op.descales().into_iter().enumerate() {
        let Some(d) = d else { continue };
        let fp8 = match i {
            0 => kind == Fp8::All,
            _ => kind != Fp8::None,
        };
        if !fp8 {
            let operand = ["q", "k", "v"][i];
            bail!(
                "flash-attn: {name} is given but {operand} is {:?}: descales apply to F8E4M3 \
                 operands only",
                [q, k, v][i].dtype()
            )
        }
        if d.dtype() != DType::F32 {
            bail!("flash-attn: {name} must be f32, got {:?}", d.dtype())
        }
        if d.dims() != [batch, kv_heads] {
            bail!(
                "flash-attn: {name} must have shape ({batch}, {kv_heads}) (sequences, kv heads), \
                 got {:?}",
                d.dims()
            )
        }
        if !d.device().same_device(q.device()) {
            bail!(
                "flash-attn: {name} is on {:?} but q is on {:?}",
                d.device().location(),
                q.device().location()
            )
        }
    }
    if kind != Fp8::None {
        let tracked = [("q", Some(q)), ("k", Some(k)), ("v", Some(v))]
            .into_iter()
            .chain(op.descales())
            .find(|(_, t)| t.is_some_and(|t| t.track_op()));
        if let Some((name, _)) = tracked {
            bail!(
                "flash-attn: FP8 (F8E4M3) attention is inference only, but {name} is tracked for \
                 gradients (detach it)"
            )
        }
    }
    Ok(())
}

/// New keys or values for an F8E4M3 cache: bf16/f16 rows quantized as `saturate(x / descale)`
/// with their sequence's descale (`(batch, kv_heads)`, absent: 1); F8E4M3 rows as they are.
/// `name` is `k_new` or `v_new`, for errors.
/// `new` is `(batch, seq_new, kv_heads, d)` (checked); `descale` is checked here, before it is
/// used.
pub(crate) fn quantize_new(
    name: &str,
    new: &Tensor,
    descale_name: &str,
    descale: Option<&Tensor>,
) -> Result<Tensor> {
    if let Some(d) = descale {
        let (batch, _, kv_heads, _) = new.dims4()?;
        if d.dtype() != DType::F32 || d.dims() != [batch, kv_heads] {
            bail!(
                "flash-attn: {descale_name} must be f32 of shape ({batch}, {kv_heads}) \
                 (sequences, kv heads), got {:?} {:?}",
                d.dtype(),
                d.dims()
            )
        }
        if !d.device().same_device(new.device()) {
            bail!("flash-attn: {descale_name} is on another device than {name}")
        }
    }
    match new.dtype() {
        DType::F8E4M3 => Ok(new.clone()),
        #[cfg(feature = "cuda")]
        DType::BF16 | DType::F16 if new.device().is_cuda() => {
            crate::cuda::fp8::to_e4m3(new, descale)
        }
        DType::BF16 | DType::F16 => {
            let x = new.to_dtype(DType::F32)?;
            let x = match descale {
                // (batch, kv_heads) against (batch, seq_new, kv_heads, d).
                Some(d) => x.broadcast_div(&d.unsqueeze(1)?.unsqueeze(3)?)?,
                None => x,
            };
            // The conversion saturates to ±448 (e4m3's largest finite value); NaN stays NaN.
            x.to_dtype(DType::F8E4M3)
        }
        d => bail!("flash-attn: {name} for an F8E4M3 cache must be bf16, f16 or F8E4M3, got {d:?}"),
    }
}

/// An FP8 call rewritten for the kernels: the options without descales, q scaled by
/// `q_descale · k_descale` in the compute dtype, K and V as stored where a kernel reads e4m3
/// (the CPU and CUDA decode kernels) or converted, and the factor `v_descale` that the output
/// takes afterwards. For the CUDA decode kernels with 16-bit queries, q is as given and the
/// descales go to the kernels instead (`kernel_descales`).
pub(crate) struct Lowered {
    pub op: FlashAttn,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// `v_descale` per output row and head, broadcastable to the output (f32).
    out_factor: Option<Tensor>,
    out_dtype: DType,
    /// The descales the CUDA decode kernels apply, `[q·k, v]` (see
    /// [`Problem::kv8_descales`]).
    pub kernel_descales: Option<[Option<Tensor>; 2]>,
}

impl Lowered {
    /// Rewrites the FP8 call `p` (validated) of `op` on q, k and v, or `None` when no operand
    /// is F8E4M3.
    pub fn of(
        op: &FlashAttn,
        p: &Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Option<Self>> {
        let kind = Fp8::of(q, k, v)?;
        if kind == Fp8::None {
            return Ok(None);
        }
        let out_dtype = kind.out_dtype(q.dtype());
        // The CPU kernels run f32 (the dequantized values exactly, no rounding of c q); the
        // GPU's in the output's dtype, into which e4m3 converts exactly.
        let compute = if q.device().is_cpu() {
            DType::F32
        } else {
            out_dtype
        };
        let qk = match (&op.q_descale, &op.k_descale) {
            (None, None) => None,
            (Some(a), None) | (None, Some(a)) => Some(a.clone()),
            (Some(a), Some(b)) => Some((a * b)?),
        };
        // Decode-shaped calls read K and V as stored: on the CPU, and on GPUs with e4m3
        // conversion.
        let native = match q.device() {
            #[cfg(feature = "cuda")]
            candle::Device::Cuda(dev) => crate::cuda::kv8_decode(p, compute, dev)?,
            candle::Device::Cpu => crate::cpu::kv8_decode(p),
            _ => false,
        };
        // All-FP8 calls that are not decode-shaped run the sm_90a FP8 forward on Hopper, which
        // reads all three as stored.
        #[cfg(feature = "cuda")]
        let native_all = match q.device() {
            candle::Device::Cuda(dev) if !native && kind == Fp8::All => {
                crate::cuda::fp8_forward(p, dev)?
            }
            _ => false,
        };
        #[cfg(not(feature = "cuda"))]
        let native_all = false;
        // There, 16-bit queries (or FP8 ones, native_all) go in as they are and the CUDA
        // kernels apply the descales (one (sequence, kv head) per block): no op is added to the
        // call.
        if (native && q.device().is_cuda() && q.dtype() != DType::F8E4M3) || native_all {
            let mut inner = op.clone();
            (inner.q_descale, inner.k_descale, inner.v_descale) = (None, None, None);
            return Ok(Some(Self {
                op: inner,
                q: q.clone(),
                k: k.clone(),
                v: v.clone(),
                out_factor: None,
                out_dtype,
                kernel_descales: Some([qk, op.v_descale.clone()]),
            }));
        }
        // Only a descale needs each query row's sequence (on the GPU, a varlen call's lengths
        // are read back for it).
        let rows = match qk.is_some() || op.v_descale.is_some() {
            true => Some(RowSeqs::of(p, q)?),
            false => None,
        };
        let q_low = match (&qk, &rows) {
            (Some(c), Some(rows)) => convert(q, DType::F32)?
                .broadcast_mul(&rows.expand(c, p)?)?
                .to_dtype(compute)?,
            _ => convert(q, compute)?,
        };
        let out_factor = match (&op.v_descale, &rows) {
            (Some(d), Some(rows)) => Some(rows.expand(d, p)?),
            _ => None,
        };
        let kv = |t: &Tensor| {
            if native {
                Ok(t.clone())
            } else {
                convert(t, compute)
            }
        };
        let mut inner = op.clone();
        inner.q_descale = None;
        inner.k_descale = None;
        inner.v_descale = None;
        // A bias in the inputs' dtype becomes one the compute dtype takes.
        if let Some(b) = &inner.bias {
            if b.dtype() == out_dtype && compute != out_dtype {
                inner.bias = Some(b.to_dtype(DType::F32)?);
            }
        }
        Ok(Some(Self {
            op: inner,
            q: q_low,
            k: kv(k)?,
            v: kv(v)?,
            out_factor,
            out_dtype,
            kernel_descales: None,
        }))
    }

    /// The output of the FP8 call from the rewritten call's output.
    pub fn finish(&self, out: Tensor) -> Result<Tensor> {
        match &self.out_factor {
            None => out.to_dtype(self.out_dtype),
            Some(f) => out
                .to_dtype(DType::F32)?
                .broadcast_mul(f)?
                .to_dtype(self.out_dtype),
        }
    }
}

/// Which sequence each query row of a call belongs to, for per-sequence descales.
enum RowSeqs {
    /// q is `(batch, seq_q, heads, d)`.
    Dense,
    /// q is `(total_q, heads, d)` with this many rows per sequence (every KV-cache call):
    /// sequence `b` holds rows `b * seq_q ..`.
    Uniform(usize),
    /// q is `(total_q, heads, d)`; row `r` belongs to sequence `index[r]` (u32 on q's device).
    Packed(Tensor),
}

impl RowSeqs {
    fn of(p: &Problem, q: &Tensor) -> Result<Self> {
        let Some(vl) = &p.varlen else {
            return Ok(Self::Dense);
        };
        // No index to upload: a copy from the host waits for the device's queue, which would
        // cost every decode step of a model its overlap of host and device.
        if vl.uniform_q() {
            return Ok(Self::Uniform(vl.max_seqlen_q));
        }
        let cu = cu_q(vl)?;
        let total = p.total_q;
        let mut index = vec![0u32; total];
        for b in 0..vl.batch {
            let (lo, hi) = (cu[b] as usize, cu[b + 1] as usize);
            // Lengths the CPU checked; on the GPU the kernels clamp them, and so does this.
            for x in &mut index[lo.min(total)..hi.min(total)] {
                *x = b as u32;
            }
        }
        Ok(Self::Packed(Tensor::new(index, q.device())?))
    }

    /// A `(batch, kv_heads)` per-sequence factor as one per query row and head, broadcastable
    /// to the output.
    fn expand(&self, f: &Tensor, p: &Problem) -> Result<Tensor> {
        let group = p.heads / p.kv_heads;
        let per_head = f
            .unsqueeze(2)?
            .broadcast_as((p.batch, p.kv_heads, group))?
            .reshape((p.batch, p.heads))?;
        match self {
            Self::Dense => per_head.reshape((p.batch, 1, p.heads, 1)),
            Self::Uniform(seq_q) => per_head
                .unsqueeze(1)?
                .broadcast_as((p.batch, *seq_q, p.heads))?
                .reshape((p.batch * seq_q, p.heads))?
                .unsqueeze(2),
            Self::Packed(index) => per_head.index_select(index, 0)?.unsqueeze(2),
        }
    }
}

/// `t` in dtype `to`; F8E4M3 tensors on the GPU through this crate's conversion kernel, which
/// candle 0.11 lacks there.
fn convert(t: &Tensor, to: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if t.dtype() == DType::F8E4M3 && t.device().is_cuda() {
        return crate::cuda::fp8::from_e4m3(t, to);
    }
    t.to_dtype(to)
}

/// The cumulative query lengths of a varlen call on the host (read back from the GPU there).
fn cu_q(vl: &VarLen) -> Result<Vec<u32>> {
    match &vl.device {
        Some(d) if vl.cu_q.is_empty() => d.cu_q.to_vec1::<u32>(),
        _ => Ok(vl.cu_q.clone()),
    }
}
