//! The public op struct and its builder; validation lives in `validate`, the `CustomOp3` that
//! dispatches to a backend in `custom`.

mod append;
mod backward;
mod bias_grad;
mod custom;
mod fp8;
mod kvcache;
mod overrides;
mod sinks;
mod validate;

use candle::op::BackpropOp;
use candle::{bail, DType, Result, Tensor};

use crate::problem::Problem;
use crate::semantics::Window;
use custom::{EmptyAttnOp, FlashAttnOp};
pub use overrides::PlanOverride;
use validate::{read_paged, read_seqlens};

/// Largest supported head dimension (every size from 1 up to it works on every backend).
pub const MAX_HEAD_DIM: usize = 512;

/// Exact attention `softmax(q kᵀ · scale) v`, computed tile by tile with an online softmax.
///
/// The fields are the options of the call; the `flash_attn*` functions of this crate are thin
/// wrappers that fill them in. `forward_with_lse` also returns the log-sum-exp of each row.
///
/// ```
/// use candle::{Device, Tensor};
/// use candle_flash::FlashAttn;
/// let q = Tensor::randn(0f32, 1., (1, 5, 4, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 7, 2, 16), &Device::Cpu)?;
/// let (out, lse) = FlashAttn::new(0.25).causal().forward_with_lse(&q, &kv, &kv)?;
/// assert_eq!(out.dims(), &[1, 5, 4, 16]);
/// assert_eq!(lse.dims(), &[1, 4, 5]);
/// # Ok::<(), candle::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct FlashAttn {
    /// Multiplies `q·k` before the softmax (usually `1/sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// Keys visible left of the (bottom-right aligned) diagonal; `None` = all.
    pub window_size_left: Option<usize>,
    /// Keys visible right of the diagonal; `None` = all, `Some(0)` = causal.
    pub window_size_right: Option<usize>,
    /// `Some(c)` with `c > 0` applies `c * tanh(s / c)` to the scaled scores.
    pub softcap: Option<f32>,
    /// ALiBi slopes, f32 of shape `(heads,)` or `(batch, heads)`.
    pub alibi_slopes: Option<Tensor>,
    /// Attention sinks, f32 of shape `(heads,)` (see [`sinks`](Self::sinks)).
    pub sinks: Option<Tensor>,
    /// Additive score bias (see [`bias`](Self::bias)).
    pub bias: Option<Tensor>,
    /// Block-sparse mask (see [`block_mask`](Self::block_mask)).
    pub block_mask: Option<BlockMask>,
    /// Paged K/V: integer `(batch, max_blocks)` block table (see [`paged`](Self::paged)).
    pub block_table: Option<Tensor>,
    /// Rows per block of a paged K/V cache (with `block_table`).
    pub page_block_size: usize,
    /// Multimodal prefix ranges, integer `(batch, max_ranges, 2)` (see
    /// [`mm_prefix_ranges`](Self::mm_prefix_ranges)).
    pub mm_prefix_ranges: Option<Tensor>,
    /// Run the portable CUDA kernels (compute capability 8.0 code) even where the Hopper
    /// (sm_90a) kernels apply; see [`portable`](Self::portable).
    pub portable: bool,
    /// Choices forced on the planners (benchmarks, tests); `None` in normal use.
    pub plan_override: Option<PlanOverride>,
    /// Descales of F8E4M3 operands, f32 `(batch, kv_heads)` (see [`q_descale`](Self::q_descale)).
    pub q_descale: Option<Tensor>,
    pub k_descale: Option<Tensor>,
    pub v_descale: Option<Tensor>,
}

impl FlashAttn {
    /// Full (unmasked) attention with the given scale.
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            window_size_left: None,
            window_size_right: None,
            softcap: None,
            alibi_slopes: None,
            sinks: None,
            bias: None,
            block_mask: None,
            block_table: None,
            page_block_size: 0,
            mm_prefix_ranges: None,
            portable: false,
            plan_override: None,
            q_descale: None,
            k_descale: None,
            v_descale: None,
        }
    }

    /// Bottom-right aligned causal masking (`window(None, Some(0))`).
    pub fn causal(self) -> Self {
        self.window(None, Some(0))
    }

    /// Sliding window of `left` keys before and `right` keys after the diagonal.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_size_left = left;
        self.window_size_right = right;
        self
    }

    /// Softcapping of the scores with cap `c` (`c > 0`).
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }

    /// ALiBi with the given f32 slopes, `(heads,)` or `(batch, heads)`.
    pub fn alibi(mut self, slopes: &Tensor) -> Self {
        self.alibi_slopes = Some(slopes.clone());
        self
    }

    /// Learnable attention sinks (as in gpt-oss and StreamingLLM): f32 of shape `(heads,)`, on
    /// q's device. Each row's softmax of head `h` gets one more logit `sinks[h]` that carries no
    /// value, so a row may put weight on "nothing":
    /// `out_i = Σ_j exp(s_ij − L_i) v_j` with `L_i = log(exp(sinks[h]) + Σ_j exp(s_ij))`, and the
    /// returned lse is `L_i`. A row that sees no key outputs 0 (lse `sinks[h]`); a sink of `-inf`
    /// is no sink. Every path takes them: dense, varlen, decode, paged and KV-cache calls.
    ///
    /// Gradients: `loss.backward()` reaches `sinks` when it is a tracked tensor (a `Var`), and
    /// [`backward_all`](Self::backward_all) returns `dsinks`.
    ///
    /// # Errors
    ///
    /// The forward call fails, naming `sinks`, when the tensor is not f32, not of shape
    /// `(heads,)`, or on another device than q.
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// use candle_flash::FlashAttn;
    ///
    /// let q = Tensor::randn(0f32, 1., (1, 5, 2, 8), &Device::Cpu)?;
    /// let kv = Tensor::randn(0f32, 1., (1, 5, 2, 8), &Device::Cpu)?;
    /// let sinks = Tensor::new(&[0.5f32, -1.0], &Device::Cpu)?;
    /// let (out, lse) = FlashAttn::new(0.35).causal().sinks(&sinks).forward_with_lse(&q, &kv, &kv)?;
    /// // Every lse is above its sink: the sink is one of the terms of the sum.
    /// let lse = lse.to_vec3::<f32>()?;
    /// assert!(lse[0][0].iter().all(|&l| l > 0.5) && lse[0][1].iter().all(|&l| l > -1.0));
    /// assert_eq!(out.dims(), &[1, 5, 2, 8]);
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn sinks(mut self, sinks: &Tensor) -> Self {
        self.sinks = Some(sinks.clone());
        self
    }

    /// An additive score bias: a tensor broadcastable to `(batch, heads, seq_q, seq_k)` (size-1
    /// dimensions, leading ones left out, and stride-0 views are read without being expanded),
    /// f32 or q's dtype, on q's device. It is added after the scale, the softcap and ALiBi and
    /// before the mask: `s = softcap(scale · q·k) − ALiBi + bias`, then masked. A `-inf` entry
    /// masks its key; a `(batch, 1, 1, seq_k)` bias of 0 and `-inf` is a key-padding mask.
    ///
    /// Dense, packed (varlen), paged and KV-cache calls, on the CPU and CUDA. In a packed or
    /// paged call sequence `b`'s query rows and keys index the bias from 0: its last two
    /// dimensions span the call's `max_seqlen_q` and `max_seqlen_k` (or are 1); in a KV-cache
    /// call they span the new rows and the cache's capacity (`k_cache`'s second dimension, or
    /// `max_blocks · page_block_size` pages), key `j` being position `j` of the sequence's
    /// cache. Not with `mm_prefix_ranges`. Gradients of q, k and v on the CPU and CUDA (there by
    /// the portable backward kernels, also on Hopper). The bias's own gradient:
    /// `loss.backward()` reaches a tracked (`Var`) bias, and
    /// [`backward_all`](Self::backward_all) and
    /// [`backward_varlen_all`](Self::backward_varlen_all) return `dbias`; they rebuild the
    /// scores one sequence at a time (`(heads, seq_q, seq_k)` f32, the memory of naive
    /// attention for one sequence). Paged and KV-cache calls are inference only: a tracked bias
    /// is refused there with an error that says so. [`naive_attention`](crate::naive_attention)
    /// takes it on every device. A bias without a query-row dimension (key padding) is read
    /// once per key tile; a full bias is read per score and costs several times the plain call
    /// on the GPU.
    pub fn bias(mut self, bias: &Tensor) -> Self {
        self.bias = Some(bias.clone());
        self
    }

    /// A block-sparse mask: `mask` of dtype u8, broadcastable to
    /// `(batch, heads, ceil(seq_q / block_q), ceil(seq_k / block_k))`; where an entry is 0, the
    /// keys of that block are hidden from the queries of that block (on top of the other masks).
    /// Rows that see no key output 0 with lse `-inf`. Key tiles that no open block reaches are
    /// neither read nor computed (on the GPU: by the tiled kernels; paged and KV-cache calls
    /// check each key's block). Every kind of call, its blocks indexed per sequence, with the
    /// gradients and limits of [`bias`](Self::bias).
    pub fn block_mask(mut self, mask: &Tensor, block_q: usize, block_k: usize) -> Self {
        self.block_mask = Some(BlockMask {
            mask: mask.clone(),
            block_q,
            block_k,
        });
        self
    }

    /// With `true`, CUDA calls run the portable kernels (compute-capability 8.0 code, as on an
    /// A100) even on a Hopper GPU, where the sm_90a (wgmma + TMA) kernels would run: for
    /// comparing the two, or as an escape hatch. `CANDLE_FLASH_PORTABLE=1` in the environment,
    /// read once at the first CUDA call, does the same for every call of the process. No effect
    /// on the CPU.
    pub fn portable(mut self, on: bool) -> Self {
        self.portable = on;
        self
    }

    /// FlashAttention's `deterministic` argument, for callers that pass it. Every backward kernel
    /// of this crate, on every backend, writes each gradient element once in a fixed order, so
    /// the backward pass is bitwise reproducible whatever is passed here: `true` asks for that
    /// guarantee, and `false` (allowing a faster non-deterministic kernel where one exists)
    /// changes nothing, since none is faster (an atomic-dQ kernel measured no faster and is not
    /// built).
    pub fn deterministic(self, _on: bool) -> Self {
        self
    }

    /// Forces choices the planners would make on their own (see [`PlanOverride`]).
    pub fn plan_override(mut self, o: PlanOverride) -> Self {
        self.plan_override = Some(o);
        self
    }

    /// Reads K and V from a paged cache: with [`forward_varlen`](Self::forward_varlen), k and v
    /// are `(num_blocks, page_block_size, kv_heads, head_dim)` and key `j` of sequence `b` is
    /// row `j % page_block_size` of block `block_table[b][j / page_block_size]`; `seqlens_k`
    /// then holds the logical key lengths (cumulative, u32). Any page size `>= 1` works.
    ///
    /// `block_table` is an integer tensor `(batch, max_blocks)` (u32, i32 or i64, as callers of
    /// upstream pass them) on q's device; only the `⌈len / page⌉` entries a sequence uses are
    /// read. Cache rows past a sequence's length and blocks the table does not name are never
    /// read, so they may hold anything, NaN included. With
    /// [`forward_kvcache`](Self::forward_kvcache) the same table makes its cache paged.
    ///
    /// # Errors
    ///
    /// The forward call fails, naming the argument, when `block_table` is not an integer
    /// `(batch, max_blocks)` tensor on q's device, names a block `>= num_blocks` (or negative),
    /// holds fewer than `⌈seqlens_k[b] / page⌉` entries per row, `page_block_size` is 0 or
    /// differs from k's second dimension, or the call is a dense [`forward`](Self::forward).
    ///
    /// # Example
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// use candle_flash::FlashAttn;
    ///
    /// let dev = Device::Cpu;
    /// // Two sequences of 3 and 5 keys in pages of 2 rows; block 0 is unused and holds NaN.
    /// let kv = Tensor::randn(0f32, 1., (6, 2, 1, 8), &dev)?;
    /// let kv = kv.slice_assign(&[0..1, 0..2, 0..1, 0..8], &Tensor::full(f32::NAN, (1, 2, 1, 8), &dev)?)?;
    /// let table = Tensor::new(&[[4u32, 1, 0], [2, 5, 3]], &dev)?;
    /// let q = Tensor::randn(0f32, 1., (2, 2, 8), &dev)?; // one query per sequence
    /// let cu_q = Tensor::new(&[0u32, 1, 2], &dev)?;
    /// let cu_k = Tensor::new(&[0u32, 3, 8], &dev)?;
    /// let out = FlashAttn::new(0.35)
    ///     .causal()
    ///     .paged(&table, 2)
    ///     .forward_varlen(&q, &kv, &kv, &cu_q, &cu_k, 1, 5)?;
    /// assert_eq!(out.dims(), &[2, 2, 8]);
    /// assert!(out.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| x.is_finite()));
    ///
    /// // A table naming a block the cache does not have is an error.
    /// let bad = Tensor::new(&[[4u32, 9, 0], [2, 5, 3]], &dev)?;
    /// let err = FlashAttn::new(0.35).paged(&bad, 2).forward_varlen(&q, &kv, &kv, &cu_q, &cu_k, 1, 5);
    /// assert!(err.unwrap_err().to_string().contains("block_table"));
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn paged(mut self, block_table: &Tensor, page_block_size: usize) -> Self {
        self.block_table = Some(block_table.clone());
        self.page_block_size = page_block_size;
        self
    }

    /// Multimodal prefix ranges (upstream's `mm_prefix_ranges`): an integer (i32)
    /// `(batch, max_ranges, 2)` tensor of `[start, end)` ranges of absolute positions per
    /// sequence. Inside a range queries and keys see each other whatever the causal or window
    /// mask says: key `j` is visible to query `i` also when `start <= j < end` and
    /// `start <= i + seq_k - seq_q < end`. Ranges with `start >= end` are ignored (padding).
    /// See [`semantics::SeqMask`](crate::semantics::SeqMask).
    ///
    /// # Errors
    ///
    /// The forward call fails when the tensor is not an integer `(batch, max_ranges, 2)` tensor
    /// on q's device. [`naive_attention`](crate::naive_attention) refuses options with prefix
    /// ranges.
    ///
    /// # Example
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// use candle_flash::FlashAttn;
    ///
    /// let dev = Device::Cpu;
    /// // 6 tokens whose first 4 (an image) attend to each other bidirectionally, causal after.
    /// let q = Tensor::randn(0f32, 1., (1, 6, 2, 8), &dev)?;
    /// let kv = Tensor::randn(0f32, 1., (1, 6, 2, 8), &dev)?;
    /// let ranges = Tensor::new(&[[[0i32, 4]]], &dev)?;
    /// let out = FlashAttn::new(0.35).causal().mm_prefix_ranges(&ranges).forward(&q, &kv, &kv)?;
    /// assert_eq!(out.dims(), &[1, 6, 2, 8]);
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn mm_prefix_ranges(mut self, ranges: &Tensor) -> Self {
        self.mm_prefix_ranges = Some(ranges.clone());
        self
    }

    /// The masking band of this op.
    pub fn mask(&self) -> Window {
        Window::new(self.window_size_left, self.window_size_right)
    }

    /// q: `(batch, seq_q, heads, head_dim)`; k, v: `(batch, seq_k, kv_heads, head_dim)`.
    /// Returns the output, shaped and typed like q.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q, k, v)?.0)
    }

    /// Like [`forward`](Self::forward), also returning the log-sum-exp (natural log) of every
    /// row's scores, f32 of shape `(batch, heads, seq_q)`; `-inf` for rows that see no key.
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let problem = self.problem(q, k, v, None)?;
        self.run(problem, q, k, v)
    }

    /// Packed variable-length batch: q `(total_q, heads, head_dim)`, k and v
    /// `(total_k, kv_heads, head_dim)`, cumulative u32 lengths `seqlens_q`/`seqlens_k` of
    /// `batch + 1` entries starting at 0.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Tensor> {
        Ok(self
            .forward_varlen_with_lse(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?
            .0)
    }

    /// Varlen with log-sum-exp, f32 of shape `(heads, total_q)`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<(Tensor, Tensor)> {
        let vl = read_seqlens(
            q,
            k,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            self.block_table.is_some(),
        )?;
        let paged = match &self.block_table {
            None => None,
            Some(table) => {
                // On the GPU the lengths stay there (the kernels clamp to the table's capacity).
                let lens: Vec<usize> = match vl.device {
                    Some(_) => vec![0; vl.batch],
                    None => vl.cu_k.windows(2).map(|w| (w[1] - w[0]) as usize).collect(),
                };
                Some(read_paged(table, self.page_block_size, k, &lens)?)
            }
        };
        let problem = self.problem_with(q, k, v, Some(vl), paged)?;
        self.run(problem, q, k, v)
    }

    /// Gradients of q, k and v for the output gradient `grad_out`, from the `out` and `lse` that
    /// [`forward_with_lse`](Self::forward_with_lse) returned for the same q, k, v and options:
    /// the kernels `loss.backward()` runs, without autograd (custom training loops, activation
    /// recomputation). `grad_out` has the output's shape and any float dtype (it is converted
    /// to q's). Returns contiguous dq, dk, dv shaped and typed like q, k, v.
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// use candle_flash::FlashAttn;
    /// let q = Tensor::randn(0f32, 1., (1, 5, 4, 16), &Device::Cpu)?;
    /// let kv = Tensor::randn(0f32, 1., (1, 7, 2, 16), &Device::Cpu)?;
    /// let op = FlashAttn::new(0.25).causal();
    /// let (out, lse) = op.forward_with_lse(&q, &kv, &kv)?;
    /// let (dq, dk, dv) = op.backward(&q, &kv, &kv, &out, &out.ones_like()?, &lse)?;
    /// assert_eq!((dq.dims(), dk.dims(), dv.dims()), (q.dims(), kv.dims(), kv.dims()));
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let problem = self.problem(q, k, v, None)?;
        self.run_backward(problem, [q, k, v], out, grad_out, lse)
    }

    /// [`backward`](Self::backward) for a packed variable-length batch, with the arguments of
    /// [`forward_varlen_with_lse`](Self::forward_varlen_with_lse).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_varlen(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if self.block_table.is_some() {
            bail!("flash-attn backward: paged K/V calls have no backward pass (inference only)")
        }
        let vl = read_seqlens(
            q,
            k,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            false,
        )?;
        let problem = self.problem(q, k, v, Some(vl))?;
        self.run_backward(problem, [q, k, v], out, grad_out, lse)
    }

    /// [`backward`](Self::backward) with the gradients of the options that have one: `dsinks`
    /// `(heads,)` f32 when the op has [`sinks`](Self::sinks) (`None` otherwise), summed over
    /// every row of each head, and `dbias` shaped and typed like the [`bias`](Self::bias),
    /// summed over the dimensions along which it was broadcast. Same arguments as `backward`.
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// use candle_flash::FlashAttn;
    /// let q = Tensor::randn(0f32, 1., (1, 5, 2, 8), &Device::Cpu)?;
    /// let kv = Tensor::randn(0f32, 1., (1, 7, 2, 8), &Device::Cpu)?;
    /// let op = FlashAttn::new(0.35).causal().sinks(&Tensor::new(&[0.0f32, 1.0], &Device::Cpu)?);
    /// let (out, lse) = op.forward_with_lse(&q, &kv, &kv)?;
    /// let g = op.backward_all(&q, &kv, &kv, &out, &out.ones_like()?, &lse)?;
    /// assert_eq!(g.dsinks.unwrap().dims(), &[2]);
    /// # Ok::<(), candle::Error>(())
    /// ```
    pub fn backward_all(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
    ) -> Result<AttnGrads> {
        let (dq, dk, dv) = self.backward(q, k, v, out, grad_out, lse)?;
        self.with_option_grads((dq, dk, dv), [q, k, v], out, grad_out, lse, None)
    }

    /// [`backward_all`](Self::backward_all) for a packed variable-length batch, with the
    /// arguments of [`backward_varlen`](Self::backward_varlen).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_varlen_all(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<AttnGrads> {
        let grads = self.backward_varlen(
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )?;
        let offsets = [seqlens_q.clone(), seqlens_k.clone()];
        self.with_option_grads(grads, [q, k, v], out, grad_out, lse, Some(offsets))
    }

    fn with_option_grads(
        &self,
        (dq, dk, dv): (Tensor, Tensor, Tensor),
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
        offsets: Option<[Tensor; 2]>,
    ) -> Result<AttnGrads> {
        let dsinks = match &self.sinks {
            None => None,
            Some(s) => Some(sinks::grad(out, grad_out, lse, s, offsets.is_some())?),
        };
        let dbias = match (&self.bias, offsets) {
            (None, _) => None,
            (Some(b), None) => Some(bias_grad::grad(self, b, [q, k, v], grad_out, lse)?),
            (Some(b), Some(offsets)) => Some(bias_grad::grad_varlen(
                self,
                b,
                [q, k, v],
                grad_out,
                lse,
                &offsets,
            )?),
        };
        Ok(AttnGrads {
            dq,
            dk,
            dv,
            dsinks,
            dbias,
        })
    }

    fn run_backward(
        &self,
        problem: Problem,
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if fp8::Fp8::of(q, k, v)? != fp8::Fp8::None {
            bail!("flash-attn backward: FP8 (F8E4M3) attention is inference only: it has no backward pass")
        }
        validate::check_saved(&problem, q, out, grad_out, lse)?;
        if problem.out_shape().iter().product::<usize>() == 0 {
            // No query row: nothing flows back (dk and dv are zero too).
            let z = |t: &Tensor| empty_zeros(t.dims(), t.dtype(), t.device());
            return Ok((z(q)?, z(k)?, z(v)?));
        }
        backward::backward(
            &problem,
            self.alibi_slopes.as_ref(),
            q,
            k,
            v,
            out,
            grad_out,
            lse,
        )
    }

    fn run(
        &self,
        problem: Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        // FP8 operands: the same call on operands the kernels read (see `fp8`).
        if let Some(low) = fp8::Lowered::of(self, &problem, q, k, v)? {
            let mut inner =
                low.op
                    .problem_lowered(&low.q, &low.k, &low.v, problem.varlen, problem.paged)?;
            inner.seqused_k = problem.seqused_k;
            inner.kv8_descales = low.kernel_descales.clone();
            let (out, lse) = low.op.run_kernels(inner, &low.q, &low.k, &low.v)?;
            return Ok((low.finish(out)?, lse));
        }
        self.run_kernels(problem, q, k, v)
    }

    /// [`run`](Self::run) for operands the backends read as they are.
    fn run_kernels(
        &self,
        problem: Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let out_shape = problem.out_shape();
        let lse_shape = problem.lse_shape();
        if out_shape.iter().product::<usize>() == 0 {
            // Nothing to compute (empty batch, seq_q = 0 or heads = 0): no launch.
            let lse = empty_zeros(&lse_shape, DType::F32, q.device())?;
            if !(q.track_op() || k.track_op() || v.track_op()) {
                return Ok((empty_zeros(&out_shape, q.dtype(), q.device())?, lse));
            }
            // Under autograd the empty output is still linked to q, k and v (EmptyAttnOp).
            let out = q.apply_op3(k, v, EmptyAttnOp { out_shape })?;
            return Ok((out, lse));
        }
        let varlen = problem.varlen.is_some();
        // A tracked bias's gradient is rebuilt per sequence (packed calls: from their offsets);
        // paged and KV-cache calls have no backward pass.
        let bias_offsets = match (&self.bias, &problem.varlen) {
            (Some(b), Some(vl)) if b.track_op() => {
                if problem.paged.is_some() {
                    bail!(
                        "flash-attn: a tracked bias gets no gradient through a paged or KV-cache \
                         call (inference only): detach it"
                    )
                }
                Some(match &vl.device {
                    Some(d) => [d.cu_q.clone(), d.cu_k.clone()],
                    None => [
                        Tensor::new(vl.cu_q.as_slice(), &candle::Device::Cpu)?,
                        Tensor::new(vl.cu_k.as_slice(), &candle::Device::Cpu)?,
                    ],
                })
            }
            _ => None,
        };
        let op = FlashAttnOp::new(problem, self.alibi_slopes.clone());
        let (stash, saved) = (op.lse_stash.clone(), op.lse.clone());
        // Applied with backpropagation recorded: `loss.backward()` reaches `FlashAttnOp::bwd`
        // instead of silently treating the op as a constant.
        let out = q.apply_op3(k, v, op)?;
        let storage = stash
            .lock()
            .map_err(|_| candle::Error::Msg("lse slot poisoned".into()))?
            .take();
        let lse = match storage {
            Some(storage) => Tensor::from_storage(storage, lse_shape, BackpropOp::none(), false),
            None => bail!("flash-attn: backend returned no log-sum-exp"),
        };
        // Kept with the op for its backward pass (f32, one value per row).
        let _ = saved.set(lse.clone());
        let out = match &self.sinks {
            Some(s) if s.track_op() => sinks::track(&out, &lse, s, varlen)?,
            _ => out,
        };
        let out = match &self.bias {
            Some(bias) if bias.track_op() => {
                bias_grad::track(self, bias, q, k, v, &out, &lse, bias_offsets)?
            }
            _ => out,
        };
        Ok((out, lse))
    }
}

/// A block-sparse mask and its block sizes (see [`FlashAttn::block_mask`]).
#[derive(Clone, Debug)]
pub struct BlockMask {
    /// u8, broadcastable to `(batch, heads, ceil(seq_q / block_q), ceil(seq_k / block_k))`.
    pub mask: Tensor,
    pub block_q: usize,
    pub block_k: usize,
}

/// Gradients of one attention call, from [`FlashAttn::backward_all`]: q, k and v (contiguous,
/// shaped and typed like them) and those of the options that have one.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct AttnGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    /// `(heads,)` f32 when the call had [`sinks`](FlashAttn::sinks).
    pub dsinks: Option<Tensor>,
    /// Shaped and typed like the [`bias`](FlashAttn::bias) when the call had one: summed over
    /// the dimensions along which it was broadcast.
    pub dbias: Option<Tensor>,
}

/// Zeros of `shape`, which may hold no element, without a zero-byte allocation: candle 0.11 on
/// CUDA asks the driver for exactly the bytes a tensor holds, and the driver refuses 0
/// (`CUDA_ERROR_INVALID_VALUE`). An empty shape becomes a contiguous view of one allocated
/// element (however large its other dimensions).
pub(crate) fn empty_zeros(
    shape: &[usize],
    dtype: DType,
    device: &candle::Device,
) -> Result<Tensor> {
    if shape.iter().product::<usize>() > 0 {
        return Tensor::zeros(shape, dtype, device);
    }
    Tensor::zeros(1, dtype, device)?
        .narrow(0, 0, 0)?
        .reshape(shape)
}

/// The gradient handed back to candle's autograd for operand `t`. Candle seeds every gradient
/// it accumulates with `t.zeros_like()`, a zero-byte allocation on CUDA when `t` holds no
/// element, which the driver refuses; such an operand gets no gradient entry there (there is
/// nothing in it to differentiate).
pub(crate) fn grad_for(t: &Tensor, grad: Tensor) -> Option<Tensor> {
    (t.elem_count() > 0 || !t.device().is_cuda()).then_some(grad)
}
