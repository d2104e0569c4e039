//! Ring (context-parallel) attention: attention over a sequence sharded across the ranks of a
//! ring, for sequences one device cannot hold.
//!
//! Each rank holds a shard of q, k and v along the sequence. K/V blocks travel round the ring
//! (one [`Communicator`] shift per step, started before and finished after the attention of the
//! block in hand, so the transfer overlaps the compute), each rank attends its queries to every
//! block with [`FlashAttn::forward_with_lse`], and the partial results merge through their
//! log-sum-exps ([`merge_states`], accumulated in f32). The backward pass
//! runs [`FlashAttn::backward`] per block with the merged output and log-sum-exp; dq stays on
//! its rank and dK/dV accumulate while travelling with their blocks, in f32, reaching their
//! owner after one last shift (as ring-flash-attention does).
//!
//! Communicators: [`Loopback`] (ranks as threads of one process, any device; the CPU stand-in
//! the tests run) and, with the `nccl` feature, `Nccl` (one thread per GPU over NCCL, with the
//! transfers on a stream of their own).
//!
//! # Sharding
//!
//! Without a mask any sharding works, as long as q's rows and k/v's rows are each split the
//! same way on every rank. A causal mask needs the **zigzag** sharding of [`zigzag_shard`]
//! (positions ↔ ranks: see [`zigzag_local`]), which gives every rank the same work: with chunks
//! of `c` rows, rank `r` holds global chunks `r` and `2W - 1 - r`, and the block that started on
//! rank `s` is, for the queries of rank `r`:
//!
//! * `s = r`: the local causal mask over the `2c × 2c` block (q and k are in the same order
//!   with the same gap, so the bottom-right aligned causal mask of the op is the global one);
//! * `s < r`: both query chunks see the early key chunk `s` whole and the late one not at all:
//!   full attention of all `2c` queries to the first `c` keys;
//! * `s > r`: the early query chunk sees nothing, the late one sees both key chunks whole:
//!   full attention of the last `c` queries to all `2c` keys.
//!
//! Every step past the first is thus `2c × c` or `c × 2c` of unmasked work on every rank.
//!
//! # Options
//!
//! GQA/MQA, the softmax scale and the softcap work as in the single-device op, in f32, f16 and
//! bf16; the log-sum-exp is returned as [`FlashAttn::forward_with_lse`] returns it. Sliding
//! windows (other than causal), ALiBi, paged K/V and prefix ranges depend on global positions
//! the blocks do not carry and are refused with an error.
//!
//! # Failures
//!
//! The ranks first exchange the shapes, dtype and options of their call and refuse to start if
//! any rank's differ (every rank returns the error). A rank whose call fails at any point
//! [aborts](Communicator::abort) the ring, so the others return an error naming it instead of
//! waiting forever.
//!
//! ```
//! use candle::{Device, Tensor};
//! use candle_flash::ring::{self, Loopback};
//! use candle_flash::FlashAttn;
//!
//! let world = 2;
//! let (q, k, v) = (
//!     Tensor::randn(0f32, 1., (1, 16, 4, 8), &Device::Cpu)?,
//!     Tensor::randn(0f32, 1., (1, 16, 2, 8), &Device::Cpu)?,
//!     Tensor::randn(0f32, 1., (1, 16, 2, 8), &Device::Cpu)?,
//! );
//! let op = FlashAttn::new(0.35).causal();
//! // One thread per simulated rank, each with its zigzag shard of q, k and v.
//! let outs = std::thread::scope(|s| {
//!     let ranks: Vec<_> = Loopback::ring(world)
//!         .into_iter()
//!         .enumerate()
//!         .map(|(r, mut comm)| {
//!             let (q, k, v, op) = (&q, &k, &v, &op);
//!             s.spawn(move || -> candle::Result<Tensor> {
//!                 let shard = |t: &Tensor| ring::zigzag_shard(t, 1, r, world);
//!                 let (out, _lse) = ring::ring_attention_forward(&mut comm, op, &shard(q)?, &shard(k)?, &shard(v)?)?;
//!                 Ok(out)
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().unwrap()).collect::<candle::Result<Vec<_>>>()
//! })?;
//! let out = ring::zigzag_unshard(&outs, 1)?;
//! let whole = op.forward(&q, &k, &v)?;
//! let diff = (out - whole)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
//! assert!(diff < 1e-5);
//! # Ok::<(), candle::Error>(())
//! ```

mod comm;
#[cfg(feature = "nccl")]
mod nccl;
mod zigzag;

pub use comm::{Communicator, Loopback};
#[cfg(feature = "nccl")]
pub use nccl::{Nccl, NcclRing};
pub use zigzag::{zigzag_global, zigzag_local, zigzag_shard, zigzag_unshard};

use candle::{bail, DType, Device, Result, Tensor};

use crate::{merge_states, FlashAttn};

/// Ring attention forward on this rank's shards: q `(batch, seq_q, heads, head_dim)`, k and v
/// `(batch, seq_k, kv_heads, head_dim)`, zigzag-sharded when `op` is causal (then
/// `seq_q = seq_k`, even). Every rank of `comm` calls it with tensors of the same shapes and
/// the same `op`. Returns this rank's rows of the output (q's dtype) and of the log-sum-exp (f32
/// `(batch, heads, seq_q)`), in the shard's row order.
///
/// # Errors
///
/// When `op` holds a window other than causal, ALiBi, paged K/V or prefix ranges; a causal call
/// whose q and k lengths differ or are odd; shapes, dtypes or devices the op refuses; ranks whose
/// shapes, dtype or options differ; a failure of the op or of `comm`; or another rank's failure.
pub fn ring_attention_forward<C: Communicator + ?Sized>(
    comm: &mut C,
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    guarded(comm, |comm| forward(comm, op, q, k, v))
}

/// Ring attention backward on this rank's shards: q, k, v and `op` as given to
/// [`ring_attention_forward`], `out` and `lse` as it returned them, `grad_out` shaped like `out`
/// (any float dtype). Returns this rank's dq, dk and dv (contiguous, shaped and typed like q, k,
/// v): the gradients of the whole ring's attention, each on the rank that holds its rows.
///
/// # Errors
///
/// As [`ring_attention_forward`], and when `out`, `grad_out` or `lse` do not fit q.
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_backward<C: Communicator + ?Sized>(
    comm: &mut C,
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    guarded(comm, |comm| {
        backward(comm, op, [q, k, v], out, grad_out, lse)
    })
}

/// Runs `f`; when it fails, tells the other ranks before returning the error.
fn guarded<C: Communicator + ?Sized, R>(
    comm: &mut C,
    f: impl FnOnce(&mut C) -> Result<R>,
) -> Result<R> {
    let r = f(comm);
    if let Err(e) = &r {
        comm.abort(&e.to_string());
    }
    r
}

/// The keys and rows of one step's block (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// All rows, all keys, under the op's own mask.
    Whole,
    /// All rows, the first half of the keys, unmasked.
    EarlyKeys,
    /// The second half of the rows, all keys, unmasked.
    LateRows,
}

fn part(causal: bool, rank: usize, src: usize) -> Part {
    match (causal, src.cmp(&rank)) {
        (false, _) | (true, std::cmp::Ordering::Equal) => Part::Whole,
        (true, std::cmp::Ordering::Less) => Part::EarlyKeys,
        (true, std::cmp::Ordering::Greater) => Part::LateRows,
    }
}

/// Checks what this rank can check alone; returns whether the call is causal.
fn check_local(op: &FlashAttn, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
    if op.alibi_slopes.is_some() {
        bail!("ring attention: ALiBi is not supported (its bias depends on global positions)")
    }
    if op.block_table.is_some() || op.mm_prefix_ranges.is_some() {
        bail!("ring attention: paged K/V and mm_prefix_ranges are not supported")
    }
    let mask = op.mask();
    let causal = match (mask.is_full(), mask.is_causal()) {
        (true, _) => false,
        (_, true) => true,
        _ => bail!(
            "ring attention: only full and causal masks are supported, got window ({:?}, {:?})",
            op.window_size_left,
            op.window_size_right
        ),
    };
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            bail!(
                "ring attention: {name} must be (batch, seq, heads, head_dim), got {:?}",
                t.dims()
            )
        }
    }
    if k.dims() != v.dims() {
        bail!(
            "ring attention: k {:?} and v {:?} must have one shape",
            k.dims(),
            v.dims()
        )
    }
    let (sq, sk) = (q.dim(1)?, k.dim(1)?);
    if causal && (sq != sk || !sq.is_multiple_of(2)) {
        bail!(
            "ring attention: a causal call takes zigzag shards (two chunks each of q and k/v): \
             q's length {sq} and k's length {sk} must be equal and even"
        )
    }
    Ok(causal)
}

/// What every rank's call must agree on, as u32s: the shapes of q, k, v, the dtype, the mask,
/// the softcap, the scale and the pass.
fn meta(op: &FlashAttn, causal: bool, pass: u32, [q, k, v]: [&Tensor; 3]) -> Result<Vec<u32>> {
    let mut m = Vec::with_capacity(17);
    for t in [q, k, v] {
        for &d in t.dims() {
            let Ok(d) = u32::try_from(d) else {
                bail!(
                    "ring attention: dimension {d} of {:?} exceeds u32",
                    t.dims()
                )
            };
            m.push(d);
        }
    }
    let dtype = [DType::F32, DType::F16, DType::BF16]
        .iter()
        .position(|&d| d == q.dtype())
        .map_or(u32::MAX, |i| i as u32);
    m.extend([
        dtype,
        causal as u32,
        op.softcap.unwrap_or(0.0).to_bits(),
        op.softmax_scale.to_bits(),
        pass,
    ]);
    Ok(m)
}

fn describe(m: &[u32]) -> String {
    if m.len() != 17 {
        return format!("{m:?}");
    }
    let dtype = ["f32", "f16", "bf16"]
        .get(m[12] as usize)
        .unwrap_or(&"other");
    format!(
        "q {:?}, k {:?}, v {:?}, {dtype}, {}, softcap {}, scale {}, {}",
        &m[0..4],
        &m[4..8],
        &m[8..12],
        ["full", "causal"][(m[13] != 0) as usize],
        f32::from_bits(m[14]),
        f32::from_bits(m[15]),
        ["forward", "backward"][(m[16] != 0) as usize],
    )
}

/// Passes every rank's `meta` round the ring (`world - 1` shifts, so every rank sees every
/// other's) and fails on every rank if any differs.
fn agree<C: Communicator + ?Sized>(comm: &mut C, mine: &[u32], dev: &Device) -> Result<()> {
    let (w, r) = (comm.world_size(), comm.rank());
    let mut cur = Tensor::new(mine, dev)?;
    let mut differs = None;
    for step in 1..w {
        comm.start_shift(&[cur])?;
        cur = take::<1>(comm.finish_shift()?)?[0].clone();
        let theirs = cur.to_vec1::<u32>()?;
        if theirs != mine && differs.is_none() {
            differs = Some(((r + w - step) % w, theirs));
        }
    }
    if let Some((other, theirs)) = differs {
        bail!(
            "ring attention: the ranks disagree: rank {other} called with {}, rank {r} (this \
             one) with {}",
            describe(&theirs),
            describe(mine)
        )
    }
    Ok(())
}

/// The `N` tensors of a shift, or an error if the peer sent another number.
fn take<const N: usize>(got: Vec<Tensor>) -> Result<[Tensor; N]> {
    let n = got.len();
    got.try_into()
        .map_err(|_| candle::Error::Msg(format!("ring: expected {N} tensors in a shift, got {n}")))
}

fn forward<C: Communicator + ?Sized>(
    comm: &mut C,
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let causal = check_local(op, q, k, v)?;
    agree(comm, &meta(op, causal, 0, [q, k, v])?, q.device())?;
    let (w, r) = (comm.world_size(), comm.rank());
    let full = op.clone().window(None, None);
    let c = q.dim(1)? / 2;
    // f32 partial states of the row segments: both halves (causal), or all rows.
    let mut acc = Acc::new(causal, c);
    let (mut kc, mut vc) = (k.clone(), v.clone());
    for step in 0..w {
        let more = step + 1 < w;
        if more {
            comm.start_shift(&[kc.clone(), vc.clone()])?;
        }
        match part(causal, r, (r + w - step) % w) {
            Part::Whole => {
                let (o, l) = op.forward_with_lse(q, &kc, &vc)?;
                acc.fold_all(o, l)?;
            }
            Part::EarlyKeys => {
                let (ke, ve) = (kc.narrow(1, 0, c)?, vc.narrow(1, 0, c)?);
                let (o, l) = full.forward_with_lse(q, &ke, &ve)?;
                acc.fold_all(o, l)?;
            }
            Part::LateRows => {
                let (o, l) = full.forward_with_lse(&q.narrow(1, c, c)?, &kc, &vc)?;
                acc.fold(1, o, l)?;
            }
        }
        if more {
            [kc, vc] = take(comm.finish_shift()?)?;
        }
    }
    let (o, l) = acc.finish()?;
    Ok((o.to_dtype(q.dtype())?, l))
}

/// The merged states of a rank's rows so far, per row segment.
struct Acc {
    segs: Vec<Option<(Tensor, Tensor)>>,
    c: usize,
}

impl Acc {
    fn new(causal: bool, c: usize) -> Self {
        Acc {
            segs: vec![None; if causal { 2 } else { 1 }],
            c,
        }
    }

    /// Folds the state of all rows into every segment.
    fn fold_all(&mut self, o: Tensor, l: Tensor) -> Result<()> {
        if self.segs.len() == 1 {
            return self.fold(0, o, l);
        }
        let c = self.c;
        self.fold(0, o.narrow(1, 0, c)?, l.narrow(2, 0, c)?)?;
        self.fold(1, o.narrow(1, c, c)?, l.narrow(2, c, c)?)
    }

    fn fold(&mut self, seg: usize, o: Tensor, l: Tensor) -> Result<()> {
        let o = o.to_dtype(DType::F32)?;
        self.segs[seg] = Some(match self.segs[seg].take() {
            None => (o, l),
            Some((ao, al)) => merge_states(&ao, &al, &o, &l)?,
        });
        Ok(())
    }

    fn finish(self) -> Result<(Tensor, Tensor)> {
        let mut outs = Vec::new();
        let mut lses = Vec::new();
        for s in self.segs {
            let Some((o, l)) = s else {
                bail!("ring attention: a row segment received no block")
            };
            outs.push(o);
            lses.push(l);
        }
        Ok((Tensor::cat(&outs, 1)?, Tensor::cat(&lses, 2)?))
    }
}

/// `acc` (f32) plus `part` (any float dtype) added to its rows `start..` along dim 1.
fn add_rows(acc: &Tensor, part: &Tensor, start: usize) -> Result<Tensor> {
    let part = part.to_dtype(DType::F32)?;
    let (n, m) = (acc.dim(1)?, part.dim(1)?);
    if start == 0 && m == n {
        return acc + part;
    }
    let mid = (acc.narrow(1, start, m)? + part)?;
    let mut pieces = Vec::with_capacity(3);
    if start > 0 {
        pieces.push(acc.narrow(1, 0, start)?);
    }
    pieces.push(mid);
    if start + m < n {
        pieces.push(acc.narrow(1, start + m, n - start - m)?);
    }
    Tensor::cat(&pieces, 1)
}

fn backward<C: Communicator + ?Sized>(
    comm: &mut C,
    op: &FlashAttn,
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let causal = check_local(op, q, k, v)?;
    for (name, t) in [("out", out), ("grad_out", grad_out)] {
        if t.dims() != q.dims() {
            bail!(
                "ring attention backward: {name} must have q's shape {:?}, got {:?}",
                q.dims(),
                t.dims()
            )
        }
    }
    let (b, sq, h, _) = q.dims4()?;
    if lse.dims() != [b, h, sq] || lse.dtype() != DType::F32 {
        bail!(
            "ring attention backward: lse must be f32 ({b}, {h}, {sq}), got {:?} {:?}",
            lse.dtype(),
            lse.dims()
        )
    }
    agree(comm, &meta(op, causal, 1, [q, k, v])?, q.device())?;
    let (w, r) = (comm.world_size(), comm.rank());
    let full = op.clone().window(None, None);
    let c = sq / 2;
    let zeros = |t: &Tensor| Tensor::zeros(t.dims(), DType::F32, t.device());
    let mut dq = zeros(q)?;
    let (mut kc, mut vc) = (k.clone(), v.clone());
    // The finished gradients of the block held at the previous step, to send on; then, after
    // the last step, of the block held last.
    let mut done: Option<[Tensor; 2]> = None;
    for step in 0..w {
        let more = step + 1 < w;
        // One shift per step: this block's K/V for the next rank (if it still needs it) and the
        // gradients of the previous block, which the next rank holds now.
        let mut send = Vec::with_capacity(4);
        if more {
            send.extend([kc.clone(), vc.clone()]);
        }
        if let Some(g) = &done {
            send.extend(g.iter().cloned());
        }
        if !send.is_empty() {
            comm.start_shift(&send)?;
        }
        let (dk_b, dv_b) = match part(causal, r, (r + w - step) % w) {
            Part::Whole => {
                let (dq_b, dk_b, dv_b) = op.backward(q, &kc, &vc, out, grad_out, lse)?;
                dq = add_rows(&dq, &dq_b, 0)?;
                (dk_b, dv_b)
            }
            Part::EarlyKeys => {
                let (ke, ve) = (kc.narrow(1, 0, c)?, vc.narrow(1, 0, c)?);
                let (dq_b, dk_b, dv_b) = full.backward(q, &ke, &ve, out, grad_out, lse)?;
                dq = add_rows(&dq, &dq_b, 0)?;
                (dk_b, dv_b)
            }
            Part::LateRows => {
                let rows = |t: &Tensor| t.narrow(1, c, c);
                let (dq_b, dk_b, dv_b) = full.backward(
                    &rows(q)?,
                    &kc,
                    &vc,
                    &rows(out)?,
                    &rows(grad_out)?,
                    &lse.narrow(2, c, c)?,
                )?;
                dq = add_rows(&dq, &dq_b, c)?;
                (dk_b, dv_b)
            }
        };
        // What earlier ranks accumulated for this block (nothing yet for this rank's own).
        let (mut dk, mut dv) = (zeros(k)?, zeros(v)?);
        if !send.is_empty() {
            let mut got = comm.finish_shift()?.into_iter();
            if more {
                [kc, vc] = take([got.next(), got.next()].into_iter().flatten().collect())?;
            }
            if done.is_some() {
                [dk, dv] = take(got.collect())?;
            }
        }
        // (Early-keys blocks add to the first half of the rows only.)
        done = Some([add_rows(&dk, &dk_b, 0)?, add_rows(&dv, &dv_b, 0)?]);
    }
    let Some(mut grads) = done else {
        bail!("ring attention backward: a ring of no rank")
    };
    if w > 1 {
        // The block held last belongs to the next rank: one more shift brings each its own.
        comm.start_shift(&grads)?;
        grads = take(comm.finish_shift()?)?;
    }
    let [dk, dv] = grads;
    Ok((
        dq.to_dtype(q.dtype())?,
        dk.to_dtype(k.dtype())?,
        dv.to_dtype(v.dtype())?,
    ))
}
