//! The device side of one forward call, shared by the prefill and decode launches: q, k and v
//! as the kernel reads them, the output and lse buffers, the lengths, block table and prefix
//! ranges, the ALiBi slopes, and the parameter struct filled from all of them.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::{bail, CudaStorage, DType, Result, Storage, Tensor};

use super::ints::{int_ptr, DevInts};
use super::operands::{operand, Extent, Operand};
use crate::cuda::launch::{to_i32, MAX_SEQ};
use crate::cuda::params::Params;
use crate::problem::{Paged, Problem, Strides};
use crate::semantics::LOG2_E;

/// The fields of [`Params`] that follow from the validated problem alone, shared by the forward
/// and backward launches so the two cannot drift: the strides of q, k and v as the kernel reads
/// them (in place, or of packed copies), the contiguous output's layout, the lse layout, the
/// window, lengths (`seq_k`: the key bound, a paged cache's capacity included), heads, the
/// columns read (`d_load`) and written, and the score modifiers. Pointers and the decode / paged
/// / prefix fields stay at their defaults (0, null; one split; no page shift) for the caller.
pub(crate) fn problem_params(
    p: &Problem,
    [q, k, v]: [&Strides; 3],
    d_load: usize,
    seq_k: usize,
) -> Result<Params> {
    let (win_left, win_right) = p.window.as_i64();
    let softcap = p.score.softcap;
    let d = p.head_dim;
    Ok(Params {
        q_batch: q.batch as i64,
        q_seq: q.seq as i64,
        q_head: q.head as i64,
        q_dim: q.dim as i64,
        k_batch: k.batch as i64,
        k_seq: k.seq as i64,
        k_head: k.head as i64,
        k_dim: k.dim as i64,
        v_batch: v.batch as i64,
        v_seq: v.seq as i64,
        v_head: v.head as i64,
        v_dim: v.dim as i64,
        o_seq: (p.heads * d) as i64,
        o_head: d as i64,
        lse_head: p.lse_head_stride() as i64,
        win_left: window_side(win_left),
        win_right: window_side(win_right),
        seq_q: to_i32(p.max_seq_q, "seq_q")?,
        seq_k: to_i32(seq_k, "seq_k")?,
        heads: to_i32(p.heads, "heads")?,
        kv_group: to_i32(p.heads / p.kv_heads, "heads")?,
        d_load: to_i32(d_load, "head_dim")?,
        d_out: to_i32(d, "head_dim")?,
        scale_log2: p.score.scale * LOG2_E,
        softcap,
        scale_over_cap: if softcap > 0.0 {
            p.score.scale / softcap
        } else {
            0.0
        },
        cap_log2: softcap * LOG2_E,
        alibi_batch: to_i32(p.alibi_batch_stride, "alibi stride")?,
        dv_splits: 1,
        num_splits: 1,
        m_tiles: 1,
        total_q: to_i32(p.total_q, "total_q")?,
        total_k: to_i32(p.varlen.as_ref().map_or(0, |vl| vl.total_k), "total_k")?,
        page_shift: -1,
        batch: to_i32(p.batch, "batch")?,
        ..Params::default()
    })
}

/// Window sides for the kernels: -1 unbounded, otherwise clamped so `int` arithmetic on
/// diagonals (sequences < 2^30) cannot overflow; any window that wide already covers everything.
fn window_side(w: i64) -> i64 {
    if w < 0 {
        -1
    } else {
        w.min(MAX_SEQ as i64)
    }
}

/// A per-head f32 vector of the call (ALiBi slopes, sinks) as contiguous f32 on the GPU, with
/// its device address.
pub(crate) struct DevF32 {
    tensor: Tensor,
    name: &'static str,
}

impl DevF32 {
    pub fn new(name: &'static str, t: Option<&Tensor>) -> Result<Option<Self>> {
        match t {
            None => Ok(None),
            Some(a) => Ok(Some(Self {
                tensor: a.to_dtype(DType::F32)?.contiguous()?,
                name,
            })),
        }
    }

    pub fn ptr(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        let (st, l) = self.tensor.storage_and_layout();
        match &*st {
            Storage::Cuda(c) => {
                Ok(c.as_cuda_slice::<f32>()?.device_ptr(stream).0 + (l.start_offset() * 4) as u64)
            }
            _ => bail!(
                "flash-attn: {} must be on the same CUDA device as q",
                self.name
            ),
        }
    }
}

/// The lengths, block table and prefix ranges of a call, as device addresses.
struct Lengths {
    cu_q: Option<DevInts>,
    cu_k: Option<DevInts>,
    table: Option<DevInts>,
    prefix: Option<DevInts>,
    /// Every sequence holds `seq_q` query rows (known on the host): `cu_q` is not uploaded and
    /// the kernels find sequence `b` at row `b * seq_q`.
    q_uniform: bool,
}

impl Lengths {
    /// The caller's device tensors where validation left them on the GPU (no host round trip),
    /// else uploads of the host copies. A KV-cache step uploads nothing: its query lengths are
    /// uniform, its key counts come from `seqused_k`, and a contiguous cache needs no table.
    fn new(p: &Problem, stream: &Arc<CudaStream>) -> Result<Self> {
        let q_uniform = p.varlen.as_ref().is_some_and(|vl| vl.uniform_q());
        let (cu_q, cu_k) = match &p.varlen {
            None => (None, None),
            Some(vl) => match &vl.device {
                Some(d) => (
                    Some(DevInts::Tensor(d.cu_q.clone())),
                    Some(DevInts::Tensor(d.cu_k.clone())),
                ),
                None => (
                    match q_uniform {
                        true => None,
                        false => Some(DevInts::upload(stream, &vl.cu_q)?),
                    },
                    // KV-cache calls take their key counts from `seqused_k`.
                    match &p.seqused_k {
                        Some((t, _)) => Some(DevInts::Tensor(t.clone())),
                        None => Some(DevInts::upload(stream, &vl.cu_k)?),
                    },
                ),
            },
        };
        let table = match p.paged.as_ref().filter(|pg| !identity_table(p, pg)) {
            None => None,
            Some(pg) => Some(match &pg.device_table {
                Some(t) => DevInts::Tensor(t.clone()),
                None => DevInts::upload(stream, &pg.table)?,
            }),
        };
        let prefix = match &p.prefix {
            None => None,
            Some(pr) => Some(match &pr.device {
                Some(t) => DevInts::Tensor(t.clone()),
                None => {
                    let flat: Vec<u32> = pr
                        .ranges
                        .iter()
                        .flat_map(|r| {
                            r.map(|x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32 as u32)
                        })
                        .collect();
                    DevInts::upload(stream, &flat)?
                }
            }),
        };
        Ok(Self {
            cu_q,
            cu_k,
            table,
            prefix,
            q_uniform,
        })
    }
}

/// A contiguous KV cache (one block per sequence, in order: the table `forward_kvcache` builds)
/// is read without a table: with key counts from `seqused_k`, the kernels address row j of
/// sequence b as block b, row j, the same element.
fn identity_table(p: &Problem, pg: &Paged) -> bool {
    p.seqused_k.is_some()
        && pg.device_table.is_none()
        && pg.max_blocks == 1
        && pg.num_blocks == p.batch
        && pg.table.iter().enumerate().all(|(b, &t)| t as usize == b)
}

/// Everything one forward call hands its kernels, owned until the launches are queued.
pub(crate) struct ForwardCall<T> {
    pub q: Operand,
    pub k: Operand,
    pub v: Operand,
    /// Packed copies of operands the kernel cannot read in place.
    _scratch: Vec<CudaSlice<T>>,
    pub out: CudaSlice<T>,
    pub lse: CudaSlice<f32>,
    lengths: Lengths,
    slopes: Option<DevF32>,
    sinks: Option<DevF32>,
}

impl<T: CudaDType + candle::cuda_backend::cudarc::driver::DeviceRepr> ForwardCall<T> {
    /// Checks the storages against `p`, packs the operands `pack` names (reading `d_load`
    /// columns), allocates the output and lse, and makes the lengths device-resident.
    /// `scratch_f32` more f32 elements follow the lse in its allocation, at [`Self::scratch`]:
    /// one allocation (and one set of its events) fewer per call for the split decode's
    /// partial results, which live no longer than the lse.
    pub fn new(
        dev: &CudaDevice,
        p: &Problem,
        [q, k, v]: [&CudaStorage; 3],
        alibi: Option<&Tensor>,
        pack: [bool; 3],
        d_load: usize,
        scratch_f32: usize,
    ) -> Result<Self> {
        let stream = dev.cuda_stream();
        // Operands in T, or e4m3, read in place: K and V of FP8 caches (the decode kernels) and
        // all three of an FP8 call (the sm_90a FP8 forward, whose output is T).
        let kv = |s: &CudaStorage| -> Result<(u64, usize, usize)> {
            Ok(match s.dtype() {
                DType::F8E4M3 => {
                    let x = s.as_cuda_slice::<float8::F8E4M3>()?;
                    (x.device_ptr(&stream).0, x.len(), 1)
                }
                _ => {
                    let x = s.as_cuda_slice::<T>()?;
                    (x.device_ptr(&stream).0, x.len(), std::mem::size_of::<T>())
                }
            })
        };
        let (q, k, v) = (kv(q)?, kv(k)?, kv(v)?);
        p.check_bounds(q.1, k.1, v.1)?;
        if p.has_alibi != alibi.is_some() {
            bail!("flash-attn: ALiBi slopes do not match the validated problem")
        }
        let (q_rows, k_rows) = p.storage_rows();
        let (q_batch, k_batch) = p.storage_batches();
        let qe = Extent {
            batch: q_batch,
            rows: q_rows,
            heads: p.heads,
        };
        let ke = Extent {
            batch: k_batch,
            rows: k_rows,
            heads: p.kv_heads,
        };
        let mut scratch = Vec::new();
        let d = p.head_dim;
        let mut op = |(base, _, esize): (u64, usize, usize), s: Strides, e: Extent, pack: bool| {
            if esize != std::mem::size_of::<T>() {
                if pack {
                    bail!("flash-attn: FP8 operands are read in place, never packed")
                }
                return Ok(Operand {
                    ptr: base + (s.offset * esize) as u64,
                    s,
                });
            }
            operand::<T>(dev, &stream, base, s, e, d, d_load, pack, &mut scratch)
        };
        let (qo, ko, vo) = (
            op(q, p.q, qe, pack[0])?,
            op(k, p.k, ke, pack[1])?,
            op(v, p.v, ke, pack[2])?,
        );
        // SAFETY: every element of `out` and `lse` is written by the kernels before anyone
        // reads it (each (row, head, column block) belongs to exactly one block, which stores
        // all its columns and, for the first column block, the lse).
        let out = unsafe { dev.alloc::<T>(p.total_q * p.heads * d)? };
        // SAFETY: as above; the scratch after it is the caller's to write before reading.
        let lse = unsafe { dev.alloc::<f32>(p.total_q * p.heads + scratch_f32)? };
        Ok(Self {
            q: qo,
            k: ko,
            v: vo,
            _scratch: scratch,
            out,
            lse,
            lengths: Lengths::new(p, &stream)?,
            slopes: DevF32::new("alibi_slopes", alibi)?,
            sinks: DevF32::new("sinks", p.sinks.as_ref())?,
        })
    }

    /// The parameter struct of this call for a kernel reading `d_load` columns: pointers,
    /// strides, lengths, table, prefix and modifiers (the decode fields stay at one split).
    pub fn params(
        &mut self,
        p: &Problem,
        stream: &Arc<CudaStream>,
        d_load: usize,
    ) -> Result<Params> {
        let seq_k = p
            .paged
            .as_ref()
            .map_or(p.max_seq_k, |pg| p.max_seq_k.min(pg.max_blocks * pg.page));
        let ptr = |x: &Option<DevInts>| x.as_ref().map_or(Ok(0), |t| t.ptr(stream));
        let l = &self.lengths;
        let paged = p.paged.as_ref();
        Ok(Params {
            q: self.q.ptr,
            k: self.k.ptr,
            v: self.v.ptr,
            o: self.out.device_ptr_mut(stream).0,
            lse: self.lse.device_ptr_mut(stream).0,
            alibi: self.slopes.as_ref().map_or(Ok(0), |s| s.ptr(stream))?,
            sinks: self.sinks.as_ref().map_or(Ok(0), |s| s.ptr(stream))?,
            cu_q: ptr(&l.cu_q)?,
            cu_k: ptr(&l.cu_k)?,
            block_table: ptr(&l.table)?,
            seqused_k: match &p.seqused_k {
                Some((t, _)) => int_ptr(t, stream)?,
                None => 0,
            },
            prefix: ptr(&l.prefix)?,
            page: to_i32(paged.map_or(0, |pg| pg.page), "page_block_size")?,
            max_blocks: to_i32(paged.map_or(0, |pg| pg.max_blocks), "max_blocks")?,
            num_blocks: to_i32(paged.map_or(0, |pg| pg.num_blocks), "num_blocks")?,
            k_add: to_i32(p.seqused_k.as_ref().map_or(0, |(_, n)| *n), "seq_new")?,
            max_ranges: to_i32(
                p.prefix.as_ref().map_or(0, |pr| pr.max_ranges),
                "max_ranges",
            )?,
            page_shift: paged
                .filter(|pg| pg.page.is_power_of_two())
                .map_or(-1, |pg| pg.page.trailing_zeros() as i32),
            q_uniform: l.q_uniform as i32,
            page_dense: paged.is_some_and(|pg| {
                let (k, v) = (&self.k.s, &self.v.s);
                pg.page.checked_mul(k.seq) == Some(k.batch)
                    && pg.page.checked_mul(v.seq) == Some(v.batch)
                    && [k.seq, v.seq].iter().all(|&s| s <= (u32::MAX / 2) as usize)
                    && pg
                        .num_blocks
                        .checked_mul(pg.page)
                        .is_some_and(|n| n <= i32::MAX as usize)
            }) as i32,
            ..problem_params(p, [&self.q.s, &self.k.s, &self.v.s], d_load, seq_k)?
        })
    }

    /// The device address of the scratch after the lse (see [`Self::new`]).
    pub fn scratch(&mut self, p: &Problem, stream: &Arc<CudaStream>) -> u64 {
        self.lse.device_ptr_mut(stream).0 + (p.total_q * p.heads * 4) as u64
    }

    /// The output and lse storages (the lse storage may be longer than the lse: the scratch).
    pub fn finish(self, dev: &CudaDevice) -> (CudaStorage, CudaStorage) {
        (
            CudaStorage::wrap_cuda_slice(self.out, dev.clone()),
            CudaStorage::wrap_cuda_slice(self.lse, dev.clone()),
        )
    }
}
