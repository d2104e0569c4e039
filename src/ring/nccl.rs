//! A [`Communicator`] over NCCL (feature `nccl`): one thread per GPU in one process.
//!
//! Why threads, not processes: the NCCL id and a failure both pass through memory the ranks
//! share ([`NcclRing`]), so a failing rank stops the others without a side channel, and a
//! program (or a test) needs no launcher. The cost is one process driving every GPU, which
//! matters little here: each step launches a few long kernels. (A one-process-per-GPU build
//! would send the id through a file or socket, as candle's multi-process example does, and
//! would need that channel for aborts too.)
//!
//! Transfers run on a communication stream of their own: a shift records an event on candle's
//! stream (the tensors are ready), makes the communication stream wait for it, posts NCCL's
//! send to the next rank and receive from the previous one as one group, and records a second
//! event; finishing the shift makes candle's stream wait for that. The attention of the block
//! in hand, launched between the two, overlaps the transfer.
//!
//! ```no_run
//! # fn main() -> candle::Result<()> {
//! use candle::Device;
//! use candle_flash::ring::{NcclRing, Communicator};
//!
//! let world = 2;
//! let ring = NcclRing::new(world)?;
//! std::thread::scope(|s| {
//!     for rank in 0..world {
//!         let ring = ring.clone();
//!         s.spawn(move || -> candle::Result<()> {
//!             let dev = Device::new_cuda(rank)?;
//!             // Collective: every rank joins at once, each in its own thread.
//!             let mut comm = ring.join(rank, &dev)?;
//!             // ... candle_flash::ring::ring_attention_forward(&mut comm, ...)
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok(())
//! # }
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle::backend::{BackendDevice, BackendStorage};
use candle::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr};
use candle::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, Id, NcclType};
use candle::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle::op::BackpropOp;
use candle::{bail, CudaStorage, DType, Device, Result, Shape, Storage, Tensor};

use super::Communicator;

type Failure = Arc<Mutex<Option<(usize, String)>>>;

/// What the ranks of one NCCL ring share: the NCCL id and the first failure. Clone it into each
/// rank's thread and [`join`](Self::join) there.
#[derive(Clone)]
pub struct NcclRing {
    id: Id,
    world: usize,
    failed: Failure,
}

impl NcclRing {
    /// A new ring of `world` ranks (a fresh NCCL id).
    ///
    /// # Errors
    ///
    /// When `world` is 0 or the NCCL library cannot make an id (it is loaded at run time:
    /// `libnccl.so.2` from the system or NVIDIA's `nvidia-nccl` wheel on the library path).
    pub fn new(world: usize) -> Result<Self> {
        if world == 0 {
            bail!("NcclRing: a ring needs at least one rank")
        }
        let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(Self {
            id,
            world,
            failed: Arc::new(Mutex::new(None)),
        })
    }

    /// This thread's end of the ring, rank `rank` on the CUDA device `device`. Collective:
    /// every rank's thread calls it, concurrently, once.
    ///
    /// # Errors
    ///
    /// When `rank >= world`, `device` is not a CUDA device, or NCCL fails to initialise.
    pub fn join(&self, rank: usize, device: &Device) -> Result<Nccl> {
        if rank >= self.world {
            bail!(
                "NcclRing::join: rank {rank} is not below the world size {}",
                self.world
            )
        }
        let dev = device.as_cuda_device()?.clone();
        // NCCL initialises on the thread's current device: this rank's.
        dev.cuda_stream().context().bind_to_thread().w()?;
        let stream = dev.cuda_stream().context().new_stream().w()?;
        let comm = Comm::from_rank(stream.clone(), rank, self.world, self.id)
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Nccl {
            comm,
            dev,
            stream,
            rank,
            world: self.world,
            failed: self.failed.clone(),
            pending: None,
        })
    }
}

/// One rank of an [`NcclRing`]; see the module docs. Dropping it aborts its NCCL communicator
/// (`ncclCommAbort`), which also ends transfers a failed peer left waiting.
pub struct Nccl {
    comm: Comm,
    dev: CudaDevice,
    /// The communication stream.
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    failed: Failure,
    pending: Option<Pending>,
}

/// A shift in flight: the tensors sent (kept alive until it is done), the receive buffers and
/// the event the communication stream records after both.
struct Pending {
    _sent: Vec<Tensor>,
    received: Vec<(Buf, Shape)>,
    done: CudaEvent,
}

enum Buf {
    F32(CudaSlice<f32>),
    F16(CudaSlice<half::f16>),
    BF16(CudaSlice<half::bf16>),
    U32(CudaSlice<u32>),
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> candle::Error {
    candle::Error::Msg(format!("nccl: {what} failed: {e:?}"))
}

impl Nccl {
    fn check_failed(&self) -> Result<()> {
        let failed = self.failed.lock().map(|f| f.clone()).unwrap_or(None);
        match failed {
            Some((r, reason)) => {
                bail!(
                    "ring: rank {} stopped because rank {r} failed: {reason}",
                    self.rank
                )
            }
            None => Ok(()),
        }
    }

    /// Posts the send of `t` (contiguous, on this GPU) and the receive of a buffer like it.
    fn post<T: CudaDType + DeviceRepr + NcclType>(
        &self,
        t: &Tensor,
        wrap: fn(CudaSlice<T>) -> Buf,
    ) -> Result<Buf> {
        let n = t.elem_count();
        let (next, prev) = (
            (self.rank + 1) % self.world,
            (self.rank + self.world - 1) % self.world,
        );
        // SAFETY: the receive below writes all `n` elements before the shift's `done` event,
        // after which alone the buffer is read.
        let mut buf = unsafe { self.dev.alloc::<T>(n)? };
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!(
                "nccl: rank {} was given a tensor that is not on a CUDA device",
                self.rank
            )
        };
        if !s.device().same_device(&self.dev) {
            bail!(
                "nccl: rank {} was given a tensor on another GPU than its own",
                self.rank
            )
        }
        let start = layout.start_offset();
        let view = s.as_cuda_slice::<T>()?.slice(start..start + n);
        self.comm
            .send(&view, next as i32)
            .map_err(|e| nccl_err("ncclSend", e))?;
        self.comm
            .recv(&mut buf, prev as i32)
            .map_err(|e| nccl_err("ncclRecv", e))?;
        Ok(wrap(buf))
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn start_shift(&mut self, tensors: &[Tensor]) -> Result<()> {
        if self.pending.is_some() {
            bail!(
                "ring: rank {} started a shift with one in flight",
                self.rank
            )
        }
        self.check_failed()?;
        let sent = tensors
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<Vec<_>>>()?;
        // The communication stream starts after everything candle's stream has queued so far:
        // the kernels that wrote the tensors sent, and the receive buffers' allocations.
        let compute = self.dev.cuda_stream();
        let ready = compute.record_event(None).w()?;
        self.stream.wait(&ready).w()?;
        // One group: NCCL pairs each rank's send with the next rank's receive without
        // deadlocking the ring.
        group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let posted: Result<Vec<(Buf, Shape)>> = sent
            .iter()
            .map(|t| {
                let buf = match t.dtype() {
                    DType::F32 => self.post::<f32>(t, Buf::F32)?,
                    DType::F16 => self.post::<half::f16>(t, Buf::F16)?,
                    DType::BF16 => self.post::<half::bf16>(t, Buf::BF16)?,
                    DType::U32 => self.post::<u32>(t, Buf::U32)?,
                    dt => bail!("nccl: no transfer for dtype {dt:?}"),
                };
                Ok((buf, t.shape().clone()))
            })
            .collect();
        // The group is closed whatever happened inside it.
        group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
        let received = posted?;
        let done = self.stream.record_event(None).w()?;
        self.pending = Some(Pending {
            _sent: sent,
            received,
            done,
        });
        Ok(())
    }

    fn finish_shift(&mut self) -> Result<Vec<Tensor>> {
        let Some(p) = self.pending.take() else {
            bail!("ring: rank {} finished a shift it never started", self.rank)
        };
        // Poll rather than block, so that a peer's abort ends the wait.
        loop {
            let done = p.done.try_is_complete().w();
            let failed = self.check_failed();
            match (done, failed) {
                (Ok(true), _) => break,
                (Ok(false), Ok(())) => std::thread::sleep(Duration::from_micros(20)),
                (Err(e), _) | (_, Err(e)) => {
                    // NCCL may still read the tensors sent and write the buffers: leave them
                    // allocated (dropping this rank aborts its communicator).
                    std::mem::forget(p);
                    return Err(e);
                }
            }
        }
        self.dev.cuda_stream().wait(&p.done).w()?;
        let dev = self.dev.clone();
        let tensor = |s: CudaStorage, shape: Shape| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        };
        Ok(p.received
            .into_iter()
            .map(|(buf, shape)| {
                let s = match buf {
                    Buf::F32(b) => CudaStorage::wrap_cuda_slice(b, dev.clone()),
                    Buf::F16(b) => CudaStorage::wrap_cuda_slice(b, dev.clone()),
                    Buf::BF16(b) => CudaStorage::wrap_cuda_slice(b, dev.clone()),
                    Buf::U32(b) => CudaStorage::wrap_cuda_slice(b, dev.clone()),
                };
                tensor(s, shape)
            })
            .collect())
    }

    fn abort(&mut self, reason: &str) {
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert_with(|| (self.rank, reason.to_string()));
        }
    }
}
