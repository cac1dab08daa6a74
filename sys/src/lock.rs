//! A mutual-exclusion lock for data-path state: one compare-and-swap to take it, one swap
//! to release it, and a futex wait only when a second thread finds it held.
//!
//! `std::sync::Mutex` costs about 25 instructions per lock and unlock, most of them
//! poisoning (a check of the global panic count on each side); an RDM round trip takes
//! three. rfabric's users of this lock recover from a poisoned lock anyway (their state is
//! consistent between calls), so there is nothing to poison.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

const FREE: u32 = 0;
const HELD: u32 = 1;
/// Held, and a thread may sleep on it: its release wakes one.
const CONTENDED: u32 = 2;

/// A lock around `T`, as `std::sync::Mutex` without poisoning.
pub struct Lock<T: ?Sized> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time, as `Mutex<T>` does.
unsafe impl<T: ?Sized + Send> Send for Lock<T> {}
// SAFETY: as above: shared `&Lock` only yields access under the lock.
unsafe impl<T: ?Sized + Send> Sync for Lock<T> {}

impl<T> Lock<T> {
    pub const fn new(value: T) -> Self {
        Lock {
            state: AtomicU32::new(FREE),
            value: UnsafeCell::new(value),
        }
    }

    pub fn into_inner(self) -> T {
        self.value.into_inner()
    }
}

impl<T: ?Sized> Lock<T> {
    /// Takes the lock, sleeping while another thread holds it.
    #[inline(always)]
    pub fn lock(&self) -> LockGuard<'_, T> {
        if self
            .state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        LockGuard { lock: self }
    }

    /// Takes the lock if it is free.
    #[inline]
    pub fn try_lock(&self) -> Option<LockGuard<'_, T>> {
        self.state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| LockGuard { lock: self })
    }

    /// The value, through exclusive access to the lock (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        // A short spin first: holders keep the lock for a few hundred instructions.
        for _ in 0..100 {
            if self.state.load(Ordering::Relaxed) == FREE
                && self
                    .state
                    .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
            std::hint::spin_loop();
        }
        // Marked contended before sleeping, so that the holder's release wakes a sleeper;
        // taken as contended, since another may still sleep.
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            futex_wait(&self.state, CONTENDED);
        }
    }

    #[inline(always)]
    fn unlock(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            self.wake_one();
        }
    }

    #[cold]
    #[inline(never)]
    fn wake_one(&self) {
        futex_wake(&self.state);
    }
}

impl<T: Default> Default for Lock<T> {
    fn default() -> Self {
        Lock::new(T::default())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Lock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.try_lock() {
            Some(g) => f.debug_struct("Lock").field("value", &&*g).finish(),
            None => f.write_str("Lock { <held> }"),
        }
    }
}

/// Access to a [`Lock`]'s value; dropping it releases the lock.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard<'a, T: ?Sized> {
    lock: &'a Lock<T>,
}

// SAFETY: a guard shared between threads gives only `&T` (as `MutexGuard`).
unsafe impl<T: ?Sized + Sync> Sync for LockGuard<'_, T> {}

impl<T: ?Sized> Deref for LockGuard<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T: ?Sized> DerefMut for LockGuard<'_, T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard exists only while this thread holds the lock, and `&mut self`
        // makes this the only access through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T: ?Sized> Drop for LockGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for LockGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT on a live, aligned u32 of this process; it returns at once if the
    // word no longer holds `expected`, and spurious returns are handled by the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned u32 of this process wakes at most one waiter.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_under_contention() {
        // Four threads add to a non-atomic pair under the lock: no update may be lost or torn.
        let l = Arc::new(Lock::new((0u64, 0u64)));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        let mut g = l.lock();
                        g.0 += 1;
                        g.1 = g.0 * 2;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let g = l.lock();
        assert_eq!(*g, (200_000, 400_000));
    }

    #[test]
    fn try_lock_sees_the_holder() {
        let l = Lock::new(5);
        let g = l.lock();
        assert!(l.try_lock().is_none());
        drop(g);
        assert_eq!(*l.try_lock().expect("free again"), 5);
        assert_eq!(l.into_inner(), 5);
    }
}
