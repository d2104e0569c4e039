//! One case type for every dense test (shape, dtype, options, layout), its inputs, and the forward
//! check that ties the op to the f64 reference.

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{naive_attention, FlashAttn};

use super::{
    assert_close, check_lse, head_dim_strided, randn, reference, scale, transposed_view,
    view_in_nan_buffer, Target,
};

/// How q, k and v are laid out in memory. Every layout holds the same values as the contiguous
/// one, so an op that reads strides right gives bitwise the contiguous result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Contiguous,
    /// q, k and v all `(b, h, s, d)` in storage, seen as `(b, s, h, d)` (the usual cache layout).
    Transposed,
    /// q, k and v each inside a larger NaN-filled buffer at a non-zero offset: an out-of-bounds
    /// read shows up as NaN.
    NanBuffers,
    /// k and v laid out differently from each other and from q: q contiguous, k transposed,
    /// v inside a NaN buffer.
    Mixed,
    /// q's last dimension not contiguous (storage `(b, s, d, h)`); k and v contiguous.
    StridedHeadDim,
    /// k and v broadcast views (stride 0 over the batch and the kv heads) of one sequence.
    BroadcastKv,
}

impl Layout {
    /// Every non-contiguous layout.
    pub const VIEWS: [Layout; 5] = [
        Layout::Transposed,
        Layout::NanBuffers,
        Layout::Mixed,
        Layout::StridedHeadDim,
        Layout::BroadcastKv,
    ];

    /// `(q, k, v)` (contiguous, on any device) in this layout. `BroadcastKv` changes the values
    /// of k and v (batch 0, kv head 0 / 1 everywhere): compare it with its own contiguous copy.
    pub fn apply(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(match self {
            Layout::Contiguous => (q.clone(), k.clone(), v.clone()),
            Layout::Transposed => (
                transposed_view(q)?,
                transposed_view(k)?,
                transposed_view(v)?,
            ),
            Layout::NanBuffers => (
                view_in_nan_buffer(q)?,
                view_in_nan_buffer(k)?,
                view_in_nan_buffer(v)?,
            ),
            Layout::Mixed => (q.clone(), transposed_view(k)?, view_in_nan_buffer(v)?),
            Layout::StridedHeadDim => (head_dim_strided(q)?, k.clone(), v.clone()),
            Layout::BroadcastKv => {
                let hk = k.dim(2)?;
                let other = if hk > 1 { 1 } else { 0 };
                (
                    q.clone(),
                    k.i((0..1, .., 0..1, ..))?.broadcast_as(k.dims())?,
                    v.i((0..1, .., other..other + 1, ..))?
                        .broadcast_as(v.dims())?,
                )
            }
        })
    }
}

/// One dense attention call: shape, dtype, options (ALiBi slopes on the CPU; [`Target::op`]
/// moves them) and layout.
#[derive(Clone)]
pub struct Case {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    pub dtype: DType,
    pub opts: FlashAttn,
    pub layout: Layout,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = &self.opts;
        write!(
            f,
            "b {} sq {} sk {} heads {}/{} d {} {:?} scale {} window ({:?}, {:?})",
            self.b,
            self.sq,
            self.sk,
            self.h,
            self.hk,
            self.d,
            self.dtype,
            o.softmax_scale,
            o.window_size_left,
            o.window_size_right
        )?;
        if let Some(c) = o.softcap {
            write!(f, " softcap {c}")?;
        }
        if let Some(s) = &o.alibi_slopes {
            write!(f, " alibi {:?}", s.dims())?;
        }
        if o.sinks.is_some() {
            write!(f, " sinks")?;
        }
        if self.layout != Layout::Contiguous {
            write!(f, " {:?}", self.layout)?;
        }
        Ok(())
    }
}

impl Case {
    /// Full attention at scale `1 / sqrt(d)`, contiguous.
    pub fn new(
        b: usize,
        sq: usize,
        sk: usize,
        h: usize,
        hk: usize,
        d: usize,
        dtype: DType,
    ) -> Self {
        Case {
            b,
            sq,
            sk,
            h,
            hk,
            d,
            dtype,
            opts: FlashAttn::new(scale(d)),
            layout: Layout::Contiguous,
        }
    }

    /// With these options instead.
    pub fn with(mut self, opts: FlashAttn) -> Self {
        self.opts = opts;
        self
    }

    pub fn causal(mut self) -> Self {
        self.opts = self.opts.causal();
        self
    }

    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.opts = self.opts.window(left, right);
        self
    }

    pub fn softcap(mut self, c: f32) -> Self {
        self.opts = self.opts.softcap(c);
        self
    }

    /// ALiBi with `(h,)` slopes `2^-1, 2^-2, ...`.
    pub fn alibi(mut self) -> Self {
        self.opts = self.opts.alibi(&head_slopes(self.h));
        self
    }

    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// q, k and v of the case on the target's device, in its layout: seeded N(0, 1) data.
    pub fn inputs(&self, t: &Target, seed: u64) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = (
            randn(&[self.b, self.sq, self.h, self.d], self.dtype, seed, &t.dev)?,
            randn(
                &[self.b, self.sk, self.hk, self.d],
                self.dtype,
                seed + 1,
                &t.dev,
            )?,
            randn(
                &[self.b, self.sk, self.hk, self.d],
                self.dtype,
                seed + 2,
                &t.dev,
            )?,
        );
        self.layout.apply(&q, &k, &v)
    }

    /// [`Case::inputs`] and an output gradient shaped like q (contiguous).
    pub fn grad_inputs(&self, t: &Target, seed: u64) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (q, k, v) = self.inputs(t, seed)?;
        let g = randn(q.dims(), self.dtype, seed + 3, &t.dev)?;
        Ok((q, k, v, g))
    }

    /// Runs the case on the target and checks output and lse against the f64 reference
    /// ([`check_forward`]). Returns the output.
    pub fn check(&self, t: &Target, seed: u64) -> Result<Tensor> {
        let (q, k, v) = self.inputs(t, seed)?;
        check_forward(t, &format!("{self:?}"), &q, &k, &v, &self.opts)
    }
}

/// ALiBi slopes `2^-1, 2^-2, ...` for `h` heads, f32 on the CPU.
pub fn head_slopes(h: usize) -> Tensor {
    let s: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 % 8 + 1)).collect();
    Tensor::from_vec(s, h, &Device::Cpu).unwrap()
}

/// Per-sequence ALiBi slopes `(b, h)`, seeded, in `[0, scale · 3)`, f32 on the CPU.
pub fn batch_slopes(b: usize, h: usize, seed: u64, scale: f64) -> Tensor {
    randn(&[b, h], DType::F32, seed, &Device::Cpu)
        .unwrap()
        .abs()
        .unwrap()
        .affine(scale, 0.0)
        .unwrap()
}

/// Byte counts of the output and the lse of attention over `rows` query rows (all sequences) of
/// `h` heads of dim `d`: what [`Target::poison`] poisons before a call.
pub fn out_and_lse_bytes(dtype: DType, rows: usize, h: usize, d: usize) -> [usize; 2] {
    [rows * h * d * dtype.size_in_bytes(), rows * h * 4]
}

/// The forward check every dense parity test goes through: the f64 reference of q, k, v (any
/// layout, on the target's device), the output pool poisoned, then `forward_with_lse` through the
/// target's configuration; output within the rule of `assert_close` against the reference, with
/// the naive (materialising) implementation in the same dtype on the same device as the
/// precision yardstick (on the host in sanitizer runs, so that only the flash kernels run under
/// compute-sanitizer), and the lse within `check_lse`. Returns the output.
pub fn check_forward(
    t: &Target,
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> Result<Tensor> {
    let (b, sq, h, d) = q.dims4()?;
    let (ref_out, ref_lse) = reference(q, k, v, opts)?;
    t.poison(&out_and_lse_bytes(q.dtype(), b * sq, h, d))?;
    let (out, lse) = t.op(opts).forward_with_lse(q, k, v)?;
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    assert_eq!(lse.dims(), &[b, h, sq], "{what}: lse shape");
    let y = t.yardstick();
    let naive = naive_attention(&y.put(q)?, &y.put(k)?, &y.put(v)?, &y.op(opts))?;
    assert_close(what, &out, &naive, &ref_out, true);
    check_lse(what, &lse, &ref_lse, q.dtype());
    Ok(out)
}

/// A ragged packed batch: empty sequences, odd lengths, more queries than keys and the reverse
/// (in sanitizer runs, three short ones).
pub struct Ragged {
    /// (queries, keys) of each sequence.
    pub lens: Vec<(usize, usize)>,
    /// Cumulative lengths, `lens.len() + 1` entries from 0.
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    pub total_q: usize,
    pub total_k: usize,
    pub max_q: usize,
    pub max_k: usize,
}

impl Ragged {
    pub fn new(lens: &[(usize, usize)]) -> Ragged {
        let qs: Vec<usize> = lens.iter().map(|l| l.0).collect();
        let ks: Vec<usize> = lens.iter().map(|l| l.1).collect();
        let (cu_q, cu_k) = (super::cumulative(&qs), super::cumulative(&ks));
        Ragged {
            lens: lens.to_vec(),
            total_q: cu_q[lens.len()] as usize,
            total_k: cu_k[lens.len()] as usize,
            max_q: qs.iter().copied().max().unwrap_or(0),
            max_k: ks.iter().copied().max().unwrap_or(0),
            cu_q,
            cu_k,
        }
    }

    /// The ragged batch of the varlen tests: sequences without queries, without keys, of one
    /// query, longer than a tile either way.
    pub fn standard(t: &Target) -> Ragged {
        if t.small() {
            Ragged::new(&[(5, 9), (70, 33), (1, 130)])
        } else {
            Ragged::new(&[
                (5, 9),
                (130, 129),
                (0, 7),
                (1, 300),
                (257, 64),
                (64, 0),
                (33, 33),
            ])
        }
    }

    /// The cumulative lengths as u32 tensors on the target's device.
    pub fn tensors(&self, t: &Target) -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::new(self.cu_q.as_slice(), &t.dev)?,
            Tensor::new(self.cu_k.as_slice(), &t.dev)?,
        ))
    }
}

/// The forward check of a packed varlen call: q `(total_q, h, d)`, k and v `(total_k, hk, d)` on
/// the target's device, lengths from `r`; as [`check_forward`], with the naive implementation
/// run per sequence as the yardstick. Returns the output.
pub fn check_varlen(
    t: &Target,
    what: &str,
    r: &Ragged,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> Result<Tensor> {
    let (total_q, h, d) = q.dims3()?;
    let (ref_out, ref_lse) = super::reference_varlen(q, k, v, &r.cu_q, &r.cu_k, opts)?;
    let (cq, ck) = r.tensors(t)?;
    t.poison(&out_and_lse_bytes(q.dtype(), total_q, h, d))?;
    let (out, lse) = t
        .op(opts)
        .forward_varlen_with_lse(q, k, v, &cq, &ck, r.max_q, r.max_k)?;
    assert_eq!(out.dims(), q.dims(), "{what}: output shape");
    assert_eq!(lse.dims(), &[h, total_q], "{what}: lse shape");
    let y = t.yardstick();
    let naive = super::naive_varlen(
        &y.put(q)?,
        &y.put(k)?,
        &y.put(v)?,
        &r.cu_q,
        &r.cu_k,
        &y.op(opts),
    )?;
    assert_close(what, &out, &naive, &ref_out, true);
    check_lse(what, &lse, &ref_lse, q.dtype());
    Ok(out)
}
