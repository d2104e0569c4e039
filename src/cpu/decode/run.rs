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
//! Which thread runs which task changes no result: the plan fixes the tasks and the order of
//! every merge.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

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
    for _ in 0..helpers.min(n.saturating_sub(1)) {
        let s = Arc::clone(&shared);
        rayon::spawn(move || s.help());
    }
    {
        let _wait = Wait(&shared);
        shared.work();
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
