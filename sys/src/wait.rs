//! A pthread mutex and condition variable at a stable address: the `FI_WAIT_MUTEX_COND`
//! wait object, whose pointers `fi_control(FI_GETWAIT)` hands to C applications.

use std::cell::UnsafeCell;
use std::time::Duration;

#[repr(C)]
struct Pair {
    mutex: UnsafeCell<libc::pthread_mutex_t>,
    cond: UnsafeCell<libc::pthread_cond_t>,
}

/// `struct fi_mutex_cond`'s two objects, owned. Boxed: pthread objects must not move.
pub struct MutexCond {
    p: Box<Pair>,
}

// SAFETY: pthread mutexes and condition variables are made for sharing between threads.
unsafe impl Send for MutexCond {}
// SAFETY: as above; every access goes through pthread calls.
unsafe impl Sync for MutexCond {}

impl std::fmt::Debug for MutexCond {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MutexCond")
    }
}

/// A held lock of a [`MutexCond`]; unlocks on drop.
#[derive(Debug)]
pub struct MutexCondGuard<'a> {
    mc: &'a MutexCond,
}

impl MutexCond {
    /// A mutex and a condition variable timed on `CLOCK_MONOTONIC`.
    pub fn new() -> Result<Self, i32> {
        let p = Box::new(Pair {
            mutex: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
            cond: UnsafeCell::new(libc::PTHREAD_COND_INITIALIZER),
        });
        // SAFETY: attr is initialised before use and destroyed after; the cond lives in
        // the box, which does not move, and is initialised once here.
        unsafe {
            let mut attr: libc::pthread_condattr_t = std::mem::zeroed();
            let rc = libc::pthread_condattr_init(&mut attr);
            if rc != 0 {
                return Err(rc);
            }
            libc::pthread_condattr_setclock(&mut attr, libc::CLOCK_MONOTONIC);
            let rc = libc::pthread_cond_init(p.cond.get(), &attr);
            libc::pthread_condattr_destroy(&mut attr);
            if rc != 0 {
                return Err(rc);
            }
        }
        Ok(MutexCond { p })
    }

    pub fn lock(&self) -> MutexCondGuard<'_> {
        // SAFETY: initialised mutex at a stable address; unlocked by the guard's Drop.
        unsafe { libc::pthread_mutex_lock(self.p.mutex.get()) };
        MutexCondGuard { mc: self }
    }

    /// The lock if it is free; `None` while any thread (this one included) holds it.
    pub fn try_lock(&self) -> Option<MutexCondGuard<'_>> {
        // SAFETY: initialised mutex at a stable address; unlocked by the guard's Drop.
        let rc = unsafe { libc::pthread_mutex_trylock(self.p.mutex.get()) };
        (rc == 0).then_some(MutexCondGuard { mc: self })
    }

    /// Wakes every waiter (take the lock first, so no wake-up falls between a waiter's
    /// check and its wait).
    pub fn broadcast(&self) {
        // SAFETY: initialised condition variable.
        unsafe { libc::pthread_cond_broadcast(self.p.cond.get()) };
    }

    /// The two pointers of `struct fi_mutex_cond`, valid while this object lives.
    pub fn as_ptrs(&self) -> (*mut libc::pthread_mutex_t, *mut libc::pthread_cond_t) {
        (self.p.mutex.get(), self.p.cond.get())
    }
}

impl MutexCondGuard<'_> {
    /// Waits for a broadcast or `timeout` (`None`: no limit), releasing the lock meanwhile.
    /// Returns false on timeout.
    pub fn wait(&mut self, timeout: Option<Duration>) -> bool {
        let (m, c) = self.mc.as_ptrs();
        match timeout {
            None => {
                // SAFETY: the lock is held by this guard, as pthread_cond_wait requires.
                unsafe { libc::pthread_cond_wait(c, m) == 0 }
            }
            Some(d) => {
                // SAFETY: ts is written by clock_gettime before use.
                let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
                // SAFETY: valid clock and output pointer.
                unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
                let ns = ts.tv_nsec as u64 + u64::from(d.subsec_nanos());
                ts.tv_sec = ts.tv_sec.saturating_add(
                    (d.as_secs() + ns / 1_000_000_000).min(i64::MAX as u64 / 2) as libc::time_t,
                );
                ts.tv_nsec = (ns % 1_000_000_000) as libc::c_long;
                // SAFETY: the lock is held by this guard; the cond uses CLOCK_MONOTONIC.
                unsafe { libc::pthread_cond_timedwait(c, m, &ts) == 0 }
            }
        }
    }
}

impl Drop for MutexCondGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: locked by this guard.
        unsafe { libc::pthread_mutex_unlock(self.mc.p.mutex.get()) };
    }
}

impl Drop for MutexCond {
    fn drop(&mut self) {
        // SAFETY: no guard borrows self (they borrow it), so neither object is in use.
        unsafe {
            libc::pthread_cond_destroy(self.p.cond.get());
            libc::pthread_mutex_destroy(self.p.mutex.get());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_broadcast_wakes_a_waiter_and_a_timeout_expires() {
        let mc = Arc::new(MutexCond::new().unwrap());
        let mut g = mc.lock();
        let t0 = std::time::Instant::now();
        assert!(!g.wait(Some(Duration::from_millis(50))));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let m2 = mc.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let _g = m2.lock();
            m2.broadcast();
        });
        assert!(g.wait(Some(Duration::from_secs(10))));
        drop(g);
        t.join().unwrap();
    }
}
