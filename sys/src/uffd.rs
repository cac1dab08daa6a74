//! A userfaultfd that reports what happens to address ranges of this process: unmapped
//! (`munmap`, `brk` shrinking), emptied (`madvise(MADV_DONTNEED/REMOVE)`), moved (`mremap`),
//! and faults on missing pages. The registration cache's memory monitor: a cached
//! registration must not outlive the memory it describes. Layouts and numbers are those of
//! `linux/userfaultfd.h` (API 0xAA).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::last_errno;

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const FEATURE_EVENT_REMAP: u64 = 1 << 2;
const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const REGISTER_MODE_MISSING: u64 = 1;
// _IOWR(0xAA, 0x3F, struct uffdio_api), _IOWR(0xAA, 0x00, struct uffdio_register),
// _IOR(0xAA, 0x01, struct uffdio_range).
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
// _IOR(0xAA, 0x02, struct uffdio_range).
const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// What the kernel reported (`struct uffd_msg`, 32 bytes: the event in its first byte, its
/// arguments from byte 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `start..end` was unmapped (`munmap`, a shrinking `brk`, `mremap` shrinking).
    Unmap { start: u64, end: u64 },
    /// `start..end` lost its pages (`madvise` `MADV_DONTNEED`/`MADV_REMOVE`).
    Remove { start: u64, end: u64 },
    /// `len` bytes moved from `from` to `to` (`mremap`).
    Remap { from: u64, to: u64, len: u64 },
    /// A thread faulted on a missing page at `addr` of a registered range; it sleeps until
    /// the range is unregistered (or the page is supplied).
    PageFault { addr: u64 },
    /// An event this monitor does not ask for.
    Other(u8),
}

/// Set in a child process after `fork`: a userfaultfd acts on the address space that opened
/// it, so the child must not use its parent's (it would watch the parent's memory).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// An open userfaultfd with the unmap, remove and remap events enabled.
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
    /// An eventfd that ends a `wait` early ([`Userfaultfd::interrupt`]).
    bell: OwnedFd,
    /// Opened with `UFFD_USER_MODE_ONLY` (unprivileged): faults the kernel takes on a
    /// registered missing page fail instead of waiting for the monitor.
    user_mode_only: bool,
}

impl Userfaultfd {
    /// Opens one: with every fault reported when the process may (root, or
    /// `vm.unprivileged_userfaultfd=1`), else for user-mode faults only (`EPERM` when even
    /// that is refused, `ENOSYS` without userfaultfd).
    pub fn open() -> Result<Self, i32> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let mut user_mode_only = false;
        // SAFETY: userfaultfd(2) takes flags only; the result is checked before use.
        let mut fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) } as libc::c_int;
        if fd < 0 && last_errno() == libc::EPERM {
            user_mode_only = true;
            // SAFETY: as above.
            fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) }
                as libc::c_int;
        }
        if fd < 0 {
            return Err(last_errno());
        }
        // SAFETY: a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let want = FEATURE_EVENT_UNMAP | FEATURE_EVENT_REMOVE | FEATURE_EVENT_REMAP;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes a struct uffdio_api, which `api` is.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(last_errno());
        }
        if api.features & want != want {
            return Err(libc::ENOTSUP);
        }
        // SAFETY: eventfd(2) takes a count and flags; the result is checked before use.
        let bell = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if bell < 0 {
            return Err(last_errno());
        }
        // SAFETY: a new descriptor that nothing else owns.
        let bell = unsafe { OwnedFd::from_raw_fd(bell) };
        static ATFORK: std::sync::Once = std::sync::Once::new();
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        ATFORK.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(after_fork_in_child));
        });
        Ok(Userfaultfd {
            fd,
            bell,
            user_mode_only,
        })
    }

    /// Whether this process opened it (not a child that inherited it across `fork`).
    #[inline]
    pub fn ours(&self) -> bool {
        !FORKED.load(Ordering::Relaxed)
    }

    pub fn user_mode_only(&self) -> bool {
        self.user_mode_only
    }

    /// Asks for the events of `start..start+len` (page-aligned): `EINVAL` for memory the
    /// kernel cannot watch (file mappings other than shmem, unaligned ranges, ranges with a
    /// hole), `EBUSY` when another userfaultfd watches part of it.
    pub fn register(&self, start: u64, len: u64) -> Result<(), i32> {
        let mut reg = UffdioRegister {
            range: UffdioRange { start, len },
            mode: REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes a struct uffdio_register, which `reg` is.
        match unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } {
            0 => Ok(()),
            _ => Err(last_errno()),
        }
    }

    /// Stops watching `start..start+len` (page-aligned), then wakes any thread that faulted
    /// there; its pages then fault as usual. The kernel's own wake in UFFDIO_UNREGISTER runs
    /// before the mapping changes, so a fault taken under the per-VMA lock can queue after
    /// it and sleep for good (seen on 6.18): hence an explicit UFFDIO_WAKE once the
    /// registration is gone.
    pub fn unregister(&self, start: u64, len: u64) -> Result<(), i32> {
        let range = UffdioRange { start, len };
        // SAFETY: UFFDIO_UNREGISTER reads a struct uffdio_range, which `range` is.
        let rc = match unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &range) } {
            0 => Ok(()),
            _ => Err(last_errno()),
        };
        // SAFETY: UFFDIO_WAKE reads a struct uffdio_range, which `range` is. Its error (a
        // range no longer mapped) is no news.
        unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &range) };
        rc
    }

    /// Sleeps until an event is pending (`true`), or `timeout_ms` passes (-1: no limit) or
    /// [`Userfaultfd::interrupt`] is called (`false`).
    pub fn wait(&self, timeout_ms: i32) -> Result<bool, i32> {
        let mut fds = [self.fd.as_raw_fd(), self.bell.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two valid pollfds.
        match unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) } {
            n if n > 0 => Ok(fds[0].revents != 0),
            0 => Ok(false),
            _ => match last_errno() {
                libc::EINTR => Ok(false),
                e => Err(e),
            },
        }
    }

    /// Ends the current and every later [`Userfaultfd::wait`] at once.
    pub fn interrupt(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from `one` to our eventfd; a full counter (EAGAIN) still
        // leaves it readable, which is all a waiter needs.
        unsafe { libc::write(self.bell.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The next event, without blocking (`None`: nothing pending). Reading an unmap,
    /// remove or remap event is what lets the thread that caused it go on.
    pub fn read_event(&self) -> Result<Option<Event>, i32> {
        let mut msg = [0u8; 32];
        // SAFETY: reads at most 32 bytes into `msg`, which has them.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len()) };
        if n < 0 {
            return match last_errno() {
                libc::EAGAIN | libc::EINTR => Ok(None),
                e => Err(e),
            };
        }
        if n != 32 {
            return Err(libc::EIO);
        }
        let arg = |i: usize| u64::from_ne_bytes(msg[8 + 8 * i..16 + 8 * i].try_into().unwrap());
        Ok(Some(match msg[0] {
            EVENT_UNMAP => Event::Unmap {
                start: arg(0),
                end: arg(1),
            },
            EVENT_REMOVE => Event::Remove {
                start: arg(0),
                end: arg(1),
            },
            EVENT_REMAP => Event::Remap {
                from: arg(0),
                to: arg(1),
                len: arg(2),
            },
            EVENT_PAGEFAULT => Event::PageFault { addr: arg(1) },
            e => Event::Other(e),
        }))
    }
}

impl AsFd for Userfaultfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Anonymous private memory mapped for this process: what tests unmap, empty and move under
/// the monitor. Its bytes are read and written through it alone.
#[derive(Debug)]
pub struct AnonMap {
    addr: usize,
    len: usize,
}

impl AnonMap {
    /// `len` bytes (rounded up to pages), zeroed; at `hint` if that address is free.
    pub fn new(len: usize, hint: Option<u64>) -> Result<Self, i32> {
        let len = len.div_ceil(4096).max(1) * 4096;
        // SAFETY: a new private anonymous mapping; a hint never replaces existing mappings
        // (no MAP_FIXED).
        let p = unsafe {
            libc::mmap(
                hint.unwrap_or(0) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_errno());
        }
        Ok(AnonMap {
            addr: p as usize,
            len,
        })
    }

    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fill(&mut self, byte: u8) {
        // SAFETY: the mapping is ours, `len` bytes, and readable and writable.
        unsafe { std::ptr::write_bytes(self.addr as *mut u8, byte, self.len) };
    }

    pub fn byte(&self, at: usize) -> u8 {
        assert!(at < self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { std::ptr::read_volatile((self.addr as *const u8).add(at)) }
    }

    /// `madvise(MADV_DONTNEED)` over `off..off+len` (page-aligned): the pages read as zero
    /// afterwards.
    pub fn discard(&mut self, off: usize, len: usize) -> Result<(), i32> {
        if off % 4096 != 0 || off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(libc::EINVAL);
        }
        // SAFETY: a range of our mapping.
        match unsafe {
            libc::madvise(
                (self.addr + off) as *mut libc::c_void,
                len,
                libc::MADV_DONTNEED,
            )
        } {
            0 => Ok(()),
            _ => Err(last_errno()),
        }
    }

    /// `mremap` to `new_len` bytes, moved if it must be.
    pub fn remap(&mut self, new_len: usize) -> Result<(), i32> {
        let new_len = new_len.div_ceil(4096).max(1) * 4096;
        // SAFETY: our mapping, moved as a whole; nothing else refers to its old address.
        let p = unsafe {
            libc::mremap(
                self.addr as *mut libc::c_void,
                self.len,
                new_len,
                libc::MREMAP_MAYMOVE,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_errno());
        }
        self.addr = p as usize;
        self.len = new_len;
        Ok(())
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn unmap_remove_and_remap_of_a_watched_range_are_reported() {
        let u = Arc::new(Userfaultfd::open().expect("userfaultfd"));
        let mut m = AnonMap::new(4 * 4096, None).unwrap();
        m.fill(7);
        u.register(m.addr(), m.len() as u64).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        // Events are read on another thread: the thread that unmaps waits until one is.
        let reader = {
            let (u, done) = (u.clone(), done.clone());
            std::thread::spawn(move || {
                let mut out = vec![];
                while !done.load(Ordering::Acquire) {
                    if u.wait(10).unwrap() {
                        while let Some(e) = u.read_event().unwrap() {
                            if let Event::PageFault { addr } = e {
                                // Unwatching the page wakes the thread that faulted on it.
                                u.unregister(addr & !4095, 4096).unwrap();
                            }
                            out.push(e);
                        }
                    }
                }
                out
            })
        };
        let base = m.addr();
        m.remap(64 * 4096).unwrap();
        let moved = m.addr();
        m.discard(4096, 4096).unwrap();
        assert_eq!(
            m.byte(4096),
            0,
            "an emptied page reads as zero, once unwatched"
        );
        drop(m);
        done.store(true, Ordering::Release);
        let ev = reader.join().unwrap();
        assert!(
            ev.contains(&Event::Remove {
                start: moved + 4096,
                end: moved + 8192
            }),
            "{ev:?}"
        );
        assert!(
            ev.contains(&Event::PageFault { addr: moved + 4096 }),
            "{ev:?}"
        );
        if moved != base {
            assert!(ev.contains(&Event::Remap {
                from: base,
                to: moved,
                len: 4 * 4096
            }));
        }
        assert!(
            ev.iter()
                .any(|e| matches!(e, Event::Unmap { start, .. } if *start == moved)),
            "{ev:?}"
        );
    }

    #[test]
    fn unaligned_or_doubly_watched_ranges_are_refused_until_unregistered() {
        let u = Userfaultfd::open().expect("userfaultfd");
        let m = AnonMap::new(4096, None).unwrap();
        assert_eq!(u.register(m.addr() + 1, 4096), Err(libc::EINVAL));
        u.register(m.addr(), 4096).unwrap();
        let v = Userfaultfd::open().unwrap();
        assert_eq!(v.register(m.addr(), 4096), Err(libc::EBUSY));
        u.unregister(m.addr(), 4096).unwrap();
        v.register(m.addr(), 4096).unwrap();
        assert_eq!(u.read_event(), Ok(None));
    }

    #[test]
    fn a_child_after_fork_knows_the_userfaultfd_is_its_parents() {
        let u = Userfaultfd::open().expect("userfaultfd");
        assert!(u.ours());
        // SAFETY: the child only reads an atomic and exits without unwinding.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: leaves the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if u.ours() { 1 } else { 0 }) };
        }
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status:#x}"
        );
        assert!(u.ours(), "the parent's own is still its own");
    }
}
