//! Runs the tasks of a plan on the calling thread and the rayon pool together.
//!
//! A decode call is often short (tens of microseconds for a small cache), about as long as it
//! takes a sleeping pool thread to wake up on a VM. Handing every task to the pool
//! (`par_iter`, or a `scope` entered from outside the pool) puts those wake-ups on the critical
//! path twice: the pool's threads wake to start, then the caller wakes to go on. Here the
//! calling thread starts on the tasks at once, claiming them one at a time from a shared
//! counter; pool threads woken for the call claim from the same counter when they arrive, and
//! one that arrives after the last task was claimed leaves without touching anything of the
//! call. The caller returns once every claimed task has finished.
//!
//! Decode calls come back to back (one per layer and token), so a pool thread that has helped
//! with one keeps watching for the next for a while ([`LINGER`]) instead of going to sleep:
//! the next call offers its tasks ([`OFFER`]) to the threads watching and wakes only as many
//! others as it still needs. While it watches, the thread runs any other rayon job that comes
//! (`rayon::yield_now`) and otherwise yields its core to any other thread that wants it, so it
//! holds up no other work.
//!
//! Which thread runs which task changes no result: the plan fixes the tasks and the order of
//! every merge.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a pool thread watches for the next call after helping with one: a few times what
/// waking a sleeping pool thread costs on a VM (tens of microseconds), so that a thread that
/// would have been woken is there instead, and short against a decode step of a model (the
/// other layers' work between two calls takes longer, and the thread runs it meanwhile).
const LINGER: Duration = Duration::from_micros(200);

/// The tasks of the call in progress, offered to the pool threads watching ([`linger`]); the
/// counter changes with every offer, so that a watcher looks at the slot only then.
static OFFER: Mutex<Option<Arc<Shared>>> = Mutex::new(None);
static OFFERS: AtomicUsize = AtomicUsize::new(0);
/// Pool threads watching for an offer.
static WATCHING: AtomicUsize = AtomicUsize::new(0);

/// The state the caller and the pool threads share; it outlives the call (each pool job holds
/// it), the call's data does not.
struct Shared {
    /// The next task to claim; `n` or more: none left.
    next: AtomicUsize,
    n: usize,
    /// Pool threads between their arrival and their leaving.
    active: AtomicUsize,
    /// The call's task function. Only dereferenced by a thread that claimed a task index below
    /// `n`, which the caller waits for before returning.
    f: *const (dyn Fn(usize) + Sync),
    /// The first panic of a pool thread, for the caller to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `f` points to a `Sync` function, called only while the caller keeps it alive (see
// `run`); everything else is atomics and a mutex.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// Claims and runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n {
                return;
            }
            // SAFETY: task `i < n` was claimed, so the caller is still waiting in `run` (it
            // waits for every pool thread that arrived before the last claim) and `f` is alive.
            unsafe { (*self.f)(i) };
        }
    }

    /// A pool thread's share: arrive, work, leave; a panic stops further claims and is kept
    /// for the caller.
    fn help(&self) {
        self.active.fetch_add(1, SeqCst);
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| self.work())) {
            self.next.store(self.n, SeqCst);
            self.panic
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
        self.active.fetch_sub(1, SeqCst);
    }
}

/// A pool thread's job: help with the call of `s`, then with every call offered within
/// [`LINGER`] of the last one helped with.
fn linger(s: Arc<Shared>) {
    s.help();
    drop(s);
    let mut seen = OFFERS.load(SeqCst);
    WATCHING.fetch_add(1, SeqCst);
    let mut since = Instant::now();
    while since.elapsed() < LINGER {
        let now = OFFERS.load(SeqCst);
        if now != seen {
            seen = now;
            let offered = OFFER.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(s) = offered {
                WATCHING.fetch_sub(1, SeqCst);
                s.help();
                drop(s);
                WATCHING.fetch_add(1, SeqCst);
                since = Instant::now();
            }
        } else if rayon::yield_now() != Some(rayon::Yield::Executed) {
            // Nothing to run: let any other thread that wants this core have it.
            std::thread::yield_now();
        }
    }
    WATCHING.fetch_sub(1, SeqCst);
}

/// Waits, when dropped (also while the caller unwinds), until no pool thread can still be
/// running a task of the call.
struct Wait<'a>(&'a Shared);

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        // No claims from here on; a pool thread that arrives later finds none.
        self.0.next.fetch_max(self.0.n, SeqCst);
        let mut spins = 0u32;
        while self.0.active.load(SeqCst) != 0 {
            // Tasks are short: spin a little, then let other threads run.
            if spins < 1 << 10 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Runs `f(0)`, ..., `f(n - 1)`, each exactly once, on the calling thread and up to `helpers`
/// rayon pool threads; returns when all have run. A panic in any of them is resumed here.
pub(super) fn run(n: usize, helpers: usize, f: &(dyn Fn(usize) + Sync)) {
    let f: *const (dyn Fn(usize) + Sync + '_) = f;
    // SAFETY: only the lifetime bound changes; `Wait` below keeps this call from returning
    // (or unwinding past `f`) while a pool thread may still call it.
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
    let shared = Arc::new(Shared {
        next: AtomicUsize::new(0),
        n,
        active: AtomicUsize::new(0),
        f,
        panic: Mutex::new(None),
    });
    let helpers = helpers.min(n.saturating_sub(1));
    let watching = if helpers > 0 {
        *OFFER.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&shared));
        OFFERS.fetch_add(1, SeqCst);
        WATCHING.load(SeqCst)
    } else {
        0
    };
    for _ in watching.min(helpers)..helpers {
        let s = Arc::clone(&shared);
        rayon::spawn(move || linger(s));
    }
    {
        let _wait = Wait(&shared);
        shared.work();
    }
    if helpers > 0 {
        let mut offer = OFFER.lock().unwrap_or_else(|p| p.into_inner());
        if offer.as_ref().is_some_and(|o| Arc::ptr_eq(o, &shared)) {
            *offer = None;
        }
    }
    let panic = shared
        .panic
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(e) = panic {
        resume_unwind(e);
    }
}
