//! Wait sets (`fi_wait_open`, `fi_wait`): one descriptor over the descriptors of the CQs,
//! counters and EQs opened with `FI_WAIT_SET` on it.
//!
//! Each member keeps its own descriptor (a CQ's epoll over its completion channel and
//! eventfd, a counter's over its feeding CQs, an EQ's rdma_cm channel); the set's epoll
//! nests them. `fi_wait` first readies every member as `fi_trywait` does (arming the
//! device, driving peers) and returns at once when one has something to read, then sleeps
//! on the set.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, Weak};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use crate::core::error::{errno, Error, Result};
use crate::core::flags::WaitObj;
use crate::verbs::Fabric;

/// `fi_wait_attr`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitAttr {
    pub wait_obj: WaitObj,
}

/// What a wait set holds: something with descriptors that `fi_trywait` readies.
pub(crate) trait WaitMember: Send + Sync + std::fmt::Debug {
    /// As `fi_trywait`: `Ok` when the caller may sleep, `EAGAIN` when something is ready.
    fn try_wait(&self) -> Result<()>;

    /// What moves with each of its events that nothing queues (a counter's counts): a
    /// wait returns when it moved.
    fn generation(&self) -> u64 {
        0
    }
}

/// `fid_wait`.
#[derive(Debug)]
pub struct WaitSet {
    epoll: Epoll,
    members: Mutex<Vec<Weak<dyn WaitMember>>>,
    _fabric: Arc<Fabric>,
}

fn timed_out() -> Error {
    Error::new(
        errno::ETIMEDOUT,
        "nothing happened on the wait set's members before the timeout",
    )
}

impl WaitSet {
    /// `fi_wait_open`: a set whose wait object is a descriptor (`FI_WAIT_FD`, or
    /// `FI_WAIT_UNSPEC`, which is one here).
    pub fn open(fabric: &Arc<Fabric>, attr: &WaitAttr) -> Result<Arc<Self>> {
        match attr.wait_obj {
            WaitObj::Unspec | WaitObj::Fd => {}
            WaitObj::None | WaitObj::Set => {
                return Err(Error::new(
                    errno::EINVAL,
                    format!("a wait set's wait object cannot be {:?}", attr.wait_obj),
                ))
            }
            w => {
                return Err(Error::new(
                    errno::ENOSYS,
                    format!(
                        "wait sets of {w:?} are not implemented: use FI_WAIT_FD or FI_WAIT_UNSPEC"
                    ),
                ))
            }
        }
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| Error::os(e as i32, "epoll_create for the wait set"))?;
        Ok(Arc::new(WaitSet {
            epoll,
            members: Mutex::new(Vec::new()),
            _fabric: fabric.clone(),
        }))
    }

    /// Adds `member`, whose readiness shows on `fds`.
    pub(crate) fn join(&self, fds: &[BorrowedFd<'_>], member: Weak<dyn WaitMember>) -> Result<()> {
        for (i, fd) in fds.iter().enumerate() {
            if let Err(e) = self.epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 0)) {
                for f in &fds[..i] {
                    let _ = self.epoll.delete(f);
                }
                return Err(Error::os(e as i32, "epoll_ctl on the wait set"));
            }
        }
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|w| w.strong_count() > 0);
        m.push(member);
        Ok(())
    }

    /// Members still open.
    pub fn len(&self) -> usize {
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|w| w.strong_count() > 0);
        m.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `fi_trywait` on the set: each member readied; `EAGAIN` when one has something.
    pub fn trywait(&self) -> Result<()> {
        self.live().iter().try_for_each(|x| x.try_wait())
    }

    fn live(&self) -> Vec<Arc<dyn WaitMember>> {
        let m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().filter_map(Weak::upgrade).collect()
    }

    /// `fi_wait`: returns once a member has something to read or a counter counted
    /// (`Ok`), or `ETIMEDOUT` after `timeout_ms` (negative: no limit). A member's
    /// descriptor may wake it for work of its own (a connection request, a peer to
    /// drive): the set readies its members again and sleeps on unless that brought
    /// something.
    pub fn wait(&self, timeout_ms: i32) -> Result<()> {
        let deadline = (timeout_ms >= 0).then(|| {
            std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms as u64)
        });
        let live = self.live();
        let marks: Vec<u64> = live.iter().map(|x| x.generation()).collect();
        let mut events = [EpollEvent::empty(); 8];
        loop {
            match live.iter().try_for_each(|x| x.try_wait()) {
                Err(e) if e.is_again() => return Ok(()),
                r => r?,
            }
            if live.iter().zip(&marks).any(|(x, m)| x.generation() != *m) {
                return Ok(());
            }
            let t = match deadline {
                None => EpollTimeout::NONE,
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Err(timed_out());
                    }
                    EpollTimeout::try_from(left).unwrap_or(EpollTimeout::MAX)
                }
            };
            match self.epoll.wait(&mut events, t) {
                Ok(0) => return Err(timed_out()),
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::os(e as i32, "epoll_wait on the wait set")),
            }
        }
    }

    /// The set's descriptor (`fi_control(FI_GETWAIT)`): readable when a member's is,
    /// once the members are readied (`fi_trywait` on the set).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }

    /// `fi_close`: `EBUSY` while members are open (close them first).
    pub fn close(&self) -> Result<()> {
        match self.len() {
            0 => Ok(()),
            n => Err(Error::new(
                errno::EBUSY,
                format!("{n} CQs, counters or EQs still use this wait set: close them first"),
            )),
        }
    }
}
