//! What the ring needs of a communicator, and an in-process implementation of it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use candle::{bail, Result, Tensor};

/// The ranks of a ring, as ring attention sees them: rank `r` sends to rank `r + 1` and receives
/// from rank `r - 1` (mod [`world_size`](Self::world_size)), one *shift* at a time, and can tell
/// every other rank that it failed.
///
/// A shift is split in two so that the transfer overlaps with compute: the ring starts it,
/// computes on the block in hand, then finishes it. Every rank starts the same shifts in the
/// same order with tensors of the same shapes and dtypes (the ring checks that the ranks agree
/// before its first shift), so an implementation may allocate its receive buffers from the
/// tensors it sends. At most one shift is in flight per rank.
pub trait Communicator {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the ring.
    fn world_size(&self) -> usize;

    /// Starts sending `tensors` to the next rank and receiving what the previous rank sends in
    /// the same shift; returns without waiting for either.
    ///
    /// # Errors
    ///
    /// When a shift is already in flight, another rank has aborted, or the transport fails.
    fn start_shift(&mut self, tensors: &[Tensor]) -> Result<()>;

    /// Waits for the shift in flight and returns what the previous rank sent, in its order.
    ///
    /// # Errors
    ///
    /// When no shift is in flight, another rank aborted (the error names it and its reason),
    /// or the transport fails.
    fn finish_shift(&mut self) -> Result<Vec<Tensor>>;

    /// Tells every other rank that this one failed with `reason`: their shifts in flight and
    /// later ones return an error instead of waiting for this rank forever. Best effort: it
    /// never fails itself.
    fn abort(&mut self, reason: &str);
}

/// A ring of `N` simulated ranks in one process (threads over channels): the CPU stand-in for
/// a multi-GPU ring, so the ring algorithm runs in `cargo test` without GPUs.
///
/// Tensors pass by reference (candle tensors are immutable and shared), so a shift copies
/// nothing. [`Loopback::ring`] makes the `N` ends; move each into its own thread.
///
/// ```
/// use candle::{Device, Tensor};
/// use candle_flash::ring::{Communicator, Loopback};
///
/// let ends = Loopback::ring(3);
/// let got: Vec<u32> = std::thread::scope(|s| {
///     let handles: Vec<_> = ends
///         .into_iter()
///         .map(|mut c| {
///             s.spawn(move || -> candle::Result<u32> {
///                 let mine = Tensor::new(&[c.rank() as u32], &Device::Cpu)?;
///                 c.start_shift(&[mine])?;
///                 c.finish_shift()?[0].to_vec1::<u32>().map(|v| v[0])
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
/// });
/// assert_eq!(got, [2, 0, 1]); // each rank received its predecessor's rank
/// ```
pub struct Loopback {
    rank: usize,
    world: usize,
    inbox: Receiver<Msg>,
    /// One sender into every rank's inbox (this one's included), indexed by rank.
    peers: Vec<Sender<Msg>>,
    /// The first failure any rank reported: `(rank, reason)`.
    failed: Arc<Mutex<Option<(usize, String)>>>,
    in_flight: bool,
}

enum Msg {
    Data(Vec<Tensor>),
    Abort(usize, String),
}

impl Loopback {
    /// The `world` ends of one ring, in rank order (none for `world = 0`).
    pub fn ring(world: usize) -> Vec<Loopback> {
        let (senders, inboxes): (Vec<_>, Vec<_>) = (0..world).map(|_| channel()).unzip();
        let failed = Arc::new(Mutex::new(None));
        inboxes
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| Loopback {
                rank,
                world,
                inbox,
                peers: senders.clone(),
                failed: failed.clone(),
                in_flight: false,
            })
            .collect()
    }

    fn check_failed(&self) -> Result<()> {
        let failed = self.failed.lock().map(|f| f.clone()).unwrap_or(None);
        match failed {
            Some((r, reason)) => aborted(self.rank, r, &reason),
            None => Ok(()),
        }
    }
}

fn aborted<T>(me: usize, r: usize, reason: &str) -> Result<T> {
    bail!("ring: rank {me} stopped because rank {r} failed: {reason}")
}

impl Communicator for Loopback {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn start_shift(&mut self, tensors: &[Tensor]) -> Result<()> {
        if self.in_flight {
            bail!(
                "ring: rank {} started a shift with one in flight",
                self.rank
            )
        }
        self.check_failed()?;
        let next = (self.rank + 1) % self.world;
        if self.peers[next].send(Msg::Data(tensors.to_vec())).is_err() {
            bail!("ring: rank {next} has gone (its end of the loopback was dropped)")
        }
        self.in_flight = true;
        Ok(())
    }

    fn finish_shift(&mut self) -> Result<Vec<Tensor>> {
        if !self.in_flight {
            bail!("ring: rank {} finished a shift it never started", self.rank)
        }
        self.in_flight = false;
        // Messages of one sender arrive in order, and only the previous rank sends data here,
        // so the next data message is the one this shift waits for.
        match self.inbox.recv() {
            Ok(Msg::Data(t)) => Ok(t),
            Ok(Msg::Abort(r, reason)) => aborted(self.rank, r, &reason),
            Err(_) => bail!("ring: every other rank of the loopback has gone"),
        }
    }

    fn abort(&mut self, reason: &str) {
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert_with(|| (self.rank, reason.to_string()));
        }
        for (r, peer) in self.peers.iter().enumerate() {
            if r != self.rank {
                // A rank that has gone needs no message.
                let _ = peer.send(Msg::Abort(self.rank, reason.to_string()));
            }
        }
    }
}
