//! A mutual-exclusion lock for data-path state: one compare-and-swap to take it, one swap
//! to release it, and a futex wait only when a second thread finds it held.
//!
//! `std::sync::Mutex` costs about 25 instructions per lock and unlock, most of them
//! poisoning (a check of the global panic count on each side); an RDM round trip takes
//! three. rfabric's users of this lock recover from a poisoned lock anyway (their state is
//! consistent between calls), so there is nothing to poison.
//!
//! [`RwLock`] is its reader-writer form, for tables that every operation reads and few
//! change (an address vector): a compare-and-swap to read, a subtraction to leave.

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

/// Readers in a [`RwLock`]'s state word (its low bits).
const READERS: u32 = (1 << 29) - 1;
/// A writer waits to take the [`RwLock`]: new readers wait behind it, so that a stream of
/// readers cannot starve it.
const WRITER_WAITING: u32 = 1 << 29;
/// A writer holds the [`RwLock`].
const WRITER: u32 = 1 << 30;
/// A thread may sleep on the [`RwLock`]'s word: whoever frees it for them wakes them all.
const WAITING: u32 = 1 << 31;

/// A reader-writer lock around `T`, as `std::sync::RwLock` without poisoning. Readers go
/// in while no writer holds it or waits for it; a writer waits for the readers in it to
/// leave. As with `std`'s, a thread that reads again while it reads may deadlock.
pub struct RwLock<T: ?Sized> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: as `std::sync::RwLock<T>`: `&mut T` to one writer at a time, `&T` to readers
// (several threads at once, hence `T: Sync` to share it).
unsafe impl<T: ?Sized + Send> Send for RwLock<T> {}
// SAFETY: as above.
unsafe impl<T: ?Sized + Send + Sync> Sync for RwLock<T> {}

impl<T> RwLock<T> {
    pub const fn new(value: T) -> Self {
        RwLock {
            state: AtomicU32::new(0),
            value: UnsafeCell::new(value),
        }
    }
}

/// Whether a reader may enter at state `s`: one test, the count's top bit standing for
/// "full" (2^28 readers at most).
#[inline(always)]
fn readable(s: u32) -> bool {
    s & (WRITER | WRITER_WAITING | (1 << 28)) == 0
}

impl<T: ?Sized> RwLock<T> {
    /// Takes the lock to read, sleeping while a writer holds it or waits for it. A reader
    /// counts itself in first (one add, no retry) and leaves again if it finds a writer.
    #[inline(always)]
    pub fn read(&self) -> ReadGuard<'_, T> {
        if !readable(self.state.fetch_add(1, Ordering::Acquire)) {
            self.read_backed_off();
        }
        ReadGuard { lock: self }
    }

    /// A reader that counted itself in beside a writer: out again (waking a writer that
    /// waits for the readers to leave), then in the careful way.
    #[cold]
    #[inline(never)]
    fn read_backed_off(&self) {
        self.read_unlock();
        self.read_contended();
    }

    /// Takes the lock to read if no writer holds it or waits for it.
    #[inline]
    pub fn try_read(&self) -> Option<ReadGuard<'_, T>> {
        let s = self.state.load(Ordering::Relaxed);
        (readable(s)
            && self
                .state
                .compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok())
        // A closure: a guard made eagerly would leave the lock when dropped unused.
        .then(|| ReadGuard { lock: self })
    }

    /// Takes the lock to write, sleeping while readers or a writer hold it.
    #[inline]
    pub fn write(&self) -> WriteGuard<'_, T> {
        if self
            .state
            .compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.write_contended();
        }
        WriteGuard { lock: self }
    }

    /// The value, through exclusive access to the lock (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    #[cold]
    #[inline(never)]
    fn read_contended(&self) {
        self.acquire(readable, |s| s + 1, 0);
    }

    #[cold]
    #[inline(never)]
    fn write_contended(&self) {
        // Taking it clears WRITER_WAITING: another waiting writer sets it again.
        self.acquire(
            |s| s & (WRITER | READERS) == 0,
            |s| (s & !WRITER_WAITING) | WRITER,
            WRITER_WAITING,
        );
    }

    /// Moves the state from `s` to `take(s)` once `free(s)`: a short spin, then sleeps,
    /// each announced by `WAITING` (and `announce`) so that the holder's release wakes the
    /// sleepers.
    fn acquire(&self, free: impl Fn(u32) -> bool, take: impl Fn(u32) -> u32, announce: u32) {
        let mut spins = 0;
        loop {
            let s = self.state.load(Ordering::Relaxed);
            if free(s) {
                if self
                    .state
                    .compare_exchange_weak(s, take(s), Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            if spins < 100 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let w = s | WAITING | announce;
            if s == w
                || self
                    .state
                    .compare_exchange(s, w, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                futex_wait(&self.state, w);
            }
        }
    }

    #[inline(always)]
    fn read_unlock(&self) {
        let prev = self.state.fetch_sub(1, Ordering::Release);
        if prev & WAITING != 0 && prev & READERS == 1 {
            self.wake_all();
        }
    }

    #[inline(always)]
    fn write_unlock(&self) {
        if self.state.fetch_and(!(WRITER | WAITING), Ordering::Release) & WAITING != 0 {
            futex_wake_all(&self.state);
        }
    }

    /// The last reader out wakes the sleepers (writers waiting for it to leave).
    #[cold]
    #[inline(never)]
    fn wake_all(&self) {
        self.state.fetch_and(!WAITING, Ordering::Relaxed);
        futex_wake_all(&self.state);
    }
}

impl<T: Default> Default for RwLock<T> {
    fn default() -> Self {
        RwLock::new(T::default())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never waits: formatting must not hang on a lock this thread may hold.
        match self.try_read() {
            Some(g) => f.debug_struct("RwLock").field("value", &&*g).finish(),
            None => f.write_str("RwLock { <written> }"),
        }
    }
}

/// Shared access to a [`RwLock`]'s value; dropping it leaves the lock.
#[must_use = "the lock is left as soon as the guard is dropped"]
pub struct ReadGuard<'a, T: ?Sized> {
    lock: &'a RwLock<T>,
}

// SAFETY: a read guard gives only `&T`, which `T: Sync` lets threads share.
unsafe impl<T: ?Sized + Sync> Sync for ReadGuard<'_, T> {}

impl<T: ?Sized> Deref for ReadGuard<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: no writer holds the lock while this reader is in it.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for ReadGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl<T: ?Sized> Drop for ReadGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.lock.read_unlock();
    }
}

/// Exclusive access to a [`RwLock`]'s value; dropping it releases the lock.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct WriteGuard<'a, T: ?Sized> {
    lock: &'a RwLock<T>,
}

// SAFETY: a guard shared between threads gives only `&T` (as `RwLockWriteGuard`).
unsafe impl<T: ?Sized + Sync> Sync for WriteGuard<'_, T> {}

impl<T: ?Sized> Deref for WriteGuard<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: this writer alone holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T: ?Sized> DerefMut for WriteGuard<'_, T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this writer alone holds the lock, and `&mut self` makes this the only
        // access through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for WriteGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl<T: ?Sized> Drop for WriteGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.lock.write_unlock();
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

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned u32 of this process wakes every waiter.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
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

    #[test]
    fn rwlock_readers_never_see_a_write_half_done() {
        // Two writers keep a pair equal to (n, 2n) while three readers check it: a torn
        // read, or a lost write, fails. Each writer's updates are counted.
        let l = Arc::new(RwLock::new((0u64, 0u64)));
        let writers: Vec<_> = (0..2)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut g = l.write();
                        g.0 += 1;
                        std::hint::spin_loop();
                        g.1 = g.0 * 2;
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let mut seen = 0;
                    for _ in 0..50_000 {
                        let g = l.read();
                        assert_eq!(g.1, g.0 * 2, "a reader saw a write half done");
                        seen = seen.max(g.0);
                    }
                    seen
                })
            })
            .collect();
        for h in writers {
            h.join().unwrap();
        }
        for h in readers {
            assert!(h.join().unwrap() <= 40_000);
        }
        assert_eq!(*l.read(), (40_000, 80_000));
        assert_eq!(
            l.state.load(Ordering::Relaxed),
            0,
            "nothing left held or waiting"
        );
    }

    #[test]
    fn rwlock_readers_share_and_a_writer_waits_for_them() {
        let l = Arc::new(RwLock::new(1));
        let (a, b) = (l.read(), l.read());
        assert_eq!(*a + *b, 2);
        let w = {
            let l = l.clone();
            std::thread::spawn(move || {
                *l.write() = 7;
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(*a, 1, "the writer waits while readers are in");
        drop((a, b));
        w.join().unwrap();
        let g = l.write();
        assert!(l.try_read().is_none(), "no reader while a writer holds it");
        assert_eq!(
            format!("{l:?}"),
            "RwLock { <written> }",
            "Debug never waits"
        );
        drop(g);
        assert_eq!(format!("{l:?}"), "RwLock { value: 7 }");
        assert_eq!(*l.read(), 7);
        assert_eq!(l.state.load(Ordering::Relaxed), 0);
    }
}
