//! A doorbell between processes of one host, for an RDM endpoint's local path: its owner
//! says in a page of shared memory whether it sleeps, and a sender that sees it asleep
//! sends a datagram to its abstract unix socket, which the owner's CQ waits on. Nothing is
//! sent while the owner is awake, so sending makes no system call then.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};

const PAGE: usize = 4096;

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// The shared object's name (`/dev/shm/rfabric-bell-NAME`) and the socket's abstract
/// address (`\0rfabric-bell-NAME`).
fn names(name: &str) -> Result<(CString, libc::sockaddr_un, libc::socklen_t), i32> {
    let full = format!("rfabric-bell-{name}");
    let shm = CString::new(format!("/{full}")).map_err(|_| libc::EINVAL)?;
    // SAFETY: sockaddr_un is plain data; all-zero is a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // The first byte stays 0: an abstract name, which goes away with its socket.
    if full.len() + 1 > addr.sun_path.len() {
        return Err(libc::ENAMETOOLONG);
    }
    for (d, s) in addr.sun_path[1..].iter_mut().zip(full.bytes()) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + full.len();
    Ok((shm, addr, len as libc::socklen_t))
}

fn dgram_socket() -> Result<OwnedFd, i32> {
    // SAFETY: plain socket(2) call; the result is checked before it is owned.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(last_errno());
    }
    // SAFETY: fd is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A shared mapping of the page; its first word counts the owner's sleeping threads, its
/// second is the owner's process id (for `reap_stale`).
#[derive(Debug)]
struct Page(NonNull<AtomicU32>);

// SAFETY: the page is only ever touched through the atomic word.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

impl Page {
    fn map(fd: &OwnedFd, write: bool) -> Result<Self, i32> {
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new shared mapping of PAGE bytes of an object at least that long;
        // MAP_FAILED is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_errno());
        }
        NonNull::new(p.cast()).map(Page).ok_or(libc::EIO)
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: the mapping lives as long as self and is page-aligned; every process
        // reads and writes the word atomically only (a 4-byte atomic load is sound on a
        // read-only mapping).
        unsafe { self.0.as_ref() }
    }

    fn owner(&self) -> &AtomicU32 {
        // SAFETY: as `word`: the second 4-byte word of the page, atomically accessed only.
        unsafe { &*self.0.as_ptr().add(1) }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.0.as_ptr().cast(), PAGE) };
    }
}

/// The owner's side: the page it writes and the socket it waits on.
#[derive(Debug)]
pub struct Bell {
    page: Page,
    sock: OwnedFd,
    shm: CString,
}

/// Removes the bells of processes that died without closing them (killed: nothing of
/// theirs ran), so that none outlives its owner for long.
fn reap_stale() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        let file = e.file_name();
        let Some(name) = file.to_str().and_then(|f| f.strip_prefix("rfabric-bell-")) else {
            continue;
        };
        let Ok(b) = BellRemote::open(name) else {
            continue; // not ours to read, or not yet sized: its owner lives
        };
        let pid = b.page.owner().load(Ordering::Relaxed) as libc::pid_t;
        // SAFETY: signal 0 only checks whether the process exists.
        let dead = pid > 0 && unsafe { libc::kill(pid, 0) } != 0 && last_errno() == libc::ESRCH;
        // Its socket too (another pid namespace may hold a live owner under that id).
        if dead && b.socket_gone() {
            if let Ok(c) = CString::new(format!("/{}", file.to_string_lossy())) {
                // SAFETY: a NUL-terminated name of a dead process's bell.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

impl Bell {
    /// Creates the bell named `name` (unique on the host: an endpoint's name).
    pub fn create(name: &str) -> Result<Self, i32> {
        reap_stale();
        let (shm, addr, len) = names(name)?;
        let open = || {
            // SAFETY: shm is a NUL-terminated name; the result is checked.
            unsafe {
                libc::shm_open(
                    shm.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600,
                )
            }
        };
        let mut fd = open();
        if fd < 0 && last_errno() == libc::EEXIST {
            // Left by a process that died with the same name: it is nobody's now.
            // SAFETY: as above.
            unsafe { libc::shm_unlink(shm.as_ptr()) };
            fd = open();
        }
        if fd < 0 {
            return Err(last_errno());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let made = (|| {
            // SAFETY: sizing our own new object.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), PAGE as libc::off_t) } != 0 {
                return Err(last_errno());
            }
            let page = Page::map(&fd, true)?;
            page.owner().store(std::process::id(), Ordering::Relaxed);
            let sock = dgram_socket()?;
            // SAFETY: addr is a valid sockaddr_un of len bytes.
            let rc = unsafe {
                libc::bind(
                    sock.as_raw_fd(),
                    (&addr as *const libc::sockaddr_un).cast(),
                    len,
                )
            };
            if rc != 0 {
                return Err(last_errno());
            }
            Ok((page, sock))
        })();
        match made {
            Ok((page, sock)) => Ok(Bell { page, sock, shm }),
            Err(e) => {
                // SAFETY: the name created above.
                unsafe { libc::shm_unlink(shm.as_ptr()) };
                Err(e)
            }
        }
    }

    /// The descriptor that is readable once a sender rang.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// A thread of the owner is about to sleep: senders ring from now on. The caller looks
    /// at its queues once more after this, before sleeping.
    pub fn sleep_begin(&self) {
        self.page.word().fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The thread is awake: what the bell holds is consumed.
    pub fn sleep_end(&self) {
        // Never below 0: an end without its begin (a bell attached while a thread slept)
        // must not leave the owner looking asleep for good.
        let _ = self
            .page
            .word()
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        let mut b = [0u8; 16];
        // SAFETY: a non-blocking receive into a local buffer, until nothing is left.
        while unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                b.as_mut_ptr().cast(),
                b.len(),
                libc::MSG_DONTWAIT,
            )
        } > 0
        {}
    }
}

impl Drop for Bell {
    fn drop(&mut self) {
        // SAFETY: the name this bell created; the mapping and socket go with their fields.
        unsafe { libc::shm_unlink(self.shm.as_ptr()) };
    }
}

/// A sender's side of another process's bell.
#[derive(Debug)]
pub struct BellRemote {
    page: Page,
    sock: OwnedFd,
    addr: libc::sockaddr_un,
    len: libc::socklen_t,
}

impl BellRemote {
    /// Opens the bell named `name`; `ENOENT` until its owner made it.
    pub fn open(name: &str) -> Result<Self, i32> {
        let (shm, addr, len) = names(name)?;
        // SAFETY: shm is a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::shm_open(shm.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(last_errno());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: libc::stat is plain data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat of our descriptor into a local struct.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(last_errno());
        }
        if (st.st_size as usize) < PAGE {
            // Its owner has not sized it yet: not a bell until then.
            return Err(libc::ENOENT);
        }
        Ok(BellRemote {
            page: Page::map(&fd, false)?,
            sock: dgram_socket()?,
            addr,
            len,
        })
    }

    /// After a message was queued for the owner: wakes it if it sleeps.
    #[inline]
    pub fn ring(&self) {
        // Pairs with `sleep_begin`'s fence: either the owner sees the message when it
        // looks again, or this sees it asleep.
        fence(Ordering::SeqCst);
        if self.page.word().load(Ordering::Relaxed) != 0 {
            self.ring_now();
        }
    }

    /// Whether nothing is bound at the owner's address any more.
    fn socket_gone(&self) -> bool {
        // SAFETY: connect of our own unbound socket to a valid address of `len` bytes.
        let rc = unsafe {
            libc::connect(
                self.sock.as_raw_fd(),
                (&self.addr as *const libc::sockaddr_un).cast(),
                self.len,
            )
        };
        rc != 0 && last_errno() == libc::ECONNREFUSED
    }

    #[cold]
    fn ring_now(&self) {
        // Errors are no matter: a full socket has woken its owner already, and a closed
        // one has nobody to wake.
        // SAFETY: a one-byte datagram to a valid address of `len` bytes.
        unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                [1u8].as_ptr().cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                (&self.addr as *const libc::sockaddr_un).cast(),
                self.len,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: BorrowedFd<'_>) -> bool {
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn a_bell_rings_only_while_its_owner_sleeps_and_goes_with_it() {
        let name = format!("test-{}", std::process::id());
        assert_eq!(BellRemote::open(&name).unwrap_err(), libc::ENOENT);
        let bell = Bell::create(&name).unwrap();
        let remote = BellRemote::open(&name).unwrap();
        remote.ring();
        assert!(!readable(bell.fd()), "rang an owner that is awake");
        bell.sleep_begin();
        remote.ring();
        remote.ring();
        assert!(readable(bell.fd()), "a sleeping owner was not rung");
        bell.sleep_end();
        assert!(!readable(bell.fd()), "waking left rings behind");
        remote.ring();
        assert!(!readable(bell.fd()));
        bell.sleep_end(); // an end without a begin
        remote.ring();
        assert!(
            !readable(bell.fd()),
            "an unmatched end left the owner asleep"
        );
        drop(bell);
        assert_eq!(BellRemote::open(&name).unwrap_err(), libc::ENOENT);
        // The owner is gone: ringing is no error.
        remote.ring();
    }

    #[test]
    fn the_bell_of_a_dead_process_is_removed_by_the_next_one_made() {
        let name = format!("test-stale-{}", std::process::id());
        // Killed: its Drop never runs, and the kernel closed its socket.
        let stale = std::mem::ManuallyDrop::new(Bell::create(&name).unwrap());
        // A process id no process has (above the kernel's pid_max).
        stale.page.owner().store(1 << 30, Ordering::Relaxed);
        // SAFETY: the socket's descriptor, never closed again (its owner is not dropped).
        unsafe { libc::close(stale.sock.as_raw_fd()) };
        assert!(BellRemote::open(&name).is_ok());
        let other = Bell::create(&format!("{name}-next")).unwrap();
        assert_eq!(BellRemote::open(&name).unwrap_err(), libc::ENOENT);
        drop(other);
    }
}
