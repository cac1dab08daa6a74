//! Completion counters (`fi_cntr`) fed by the endpoints bound to them.
//!
//! A counter keeps no queue. The CQs of its endpoints count each completion of a bound
//! direction as they poll it from the device, whether or not it makes a CQ entry
//! (fi_cntr(3): counters increment on all completions, separately from the CQ), and a read
//! of or a wait on the counter drives those CQs, as a CQ read does (manual progress). An
//! endpoint with a transmit counter signals every send and RMA operation, so none passes
//! uncounted; the CQ drops the entries selective completion did not ask for.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use rfabric_sys::verbs::{wc_opcode as op, wc_status as st, WorkCompletion};
use rfabric_sys::wait::MutexCond;

use crate::core::cq::Waitable;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{Flags, WaitObj};
use crate::verbs::{wr_id, CompletionQueue, Domain};

/// `fi_cntr_attr` (`events` is always `FI_CNTR_EVENTS_COMP`, the only kind).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CntrAttr {
    pub wait_obj: WaitObj,
    /// Reserved by fi_cntr(3): must be 0.
    pub flags: Flags,
}

/// How long a blocked `wait` sleeps before looking again: a value another thread sets
/// (`add`, `set`) and completions of a second CQ are seen within this.
const WAIT_SLICE: Duration = Duration::from_millis(1);

/// A completion counter (`fi_cntr`): a success count and an error count.
#[derive(Debug)]
pub struct Counter {
    value: AtomicU64,
    err: AtomicU64,
    wait_obj: WaitObj,
    /// The CQs whose completions count here: reads and waits drive them. A shared list a
    /// read clones (one count) rather than copies: counter reads allocate nothing.
    feeds: RwLock<Arc<[Weak<CompletionQueue>]>>,
    /// Endpoint bindings (a direction each); `close` refuses while any remain.
    bound: AtomicUsize,
    closed: AtomicBool,
    /// `FI_WAIT_FD`: what `fi_control(FI_GETWAIT)` hands out. `FI_WAIT_UNSPEC`: what
    /// `fi_cntr_wait` sleeps on, woken by any feeding CQ.
    fd: Option<CntrFd>,
    /// `FI_WAIT_MUTEX_COND`: the pair `fi_control(FI_GETWAIT)` hands out, broadcast
    /// whenever a count changes (progress in any thread, or a value call).
    mc: Option<MutexCond>,
    _domain: Arc<Domain>,
}

impl crate::verbs::wait::WaitMember for Counter {
    fn try_wait(&self) -> Result<()> {
        match &self.fd {
            Some(f) => self.prepare_sleep(f),
            None => Ok(()),
        }
    }

    fn generation(&self) -> u64 {
        self.value
            .load(Ordering::Acquire)
            .wrapping_add(self.err.load(Ordering::Acquire))
    }
}

/// A counter's descriptor: one epoll over its feeding CQs' descriptors and an eventfd that
/// `add`/`set` (and their error twins) write, so an application blocked on it wakes for a
/// completion that may count and for a value another thread changed.
#[derive(Debug)]
struct CntrFd {
    epoll: Epoll,
    event: EventFd,
    /// A feeding CQ has no descriptor to nest (`FI_WAIT_NONE`, `FI_WAIT_MUTEX_COND`): its
    /// completions would never wake the descriptor, so `trywait` always says `EAGAIN`.
    blind: AtomicBool,
    /// Threads in `fi_cntr_wait` asleep on `epoll`: a count made by another thread's
    /// progress wakes them (one made by the device's completion wakes them through its CQ).
    sleepers: AtomicU32,
    /// Times a wait came back from `epoll` (`Counter::wakeups`).
    wakeups: AtomicU64,
}

impl CntrFd {
    fn new() -> Result<Self> {
        let os = |what: &'static str| move |e: nix::errno::Errno| Error::os(e as i32, what);
        let event =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(os("eventfd for the counter"))?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(os("epoll_create"))?;
        epoll
            .add(event.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 0))
            .map_err(os("epoll_ctl"))?;
        Ok(CntrFd {
            epoll,
            event,
            blind: AtomicBool::new(false),
            sleepers: AtomicU32::new(0),
            wakeups: AtomicU64::new(0),
        })
    }

    fn wake(&self) {
        if let Err(e) = self.event.write(1) {
            crate::fi_warn!("cntr", "eventfd write: {e}");
        }
    }
}

impl Counter {
    /// `fi_cntr_open`.
    pub fn open(domain: &Arc<Domain>, attr: &CntrAttr) -> Result<Arc<Self>> {
        if !attr.flags.is_empty() {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "counter flags {:#x}: fi_cntr(3) reserves them, pass 0",
                    attr.flags.bits()
                ),
            ));
        }
        match attr.wait_obj {
            WaitObj::None
            | WaitObj::Unspec
            | WaitObj::Fd
            | WaitObj::MutexCond
            | WaitObj::Yield
            | WaitObj::Set => {}
            w => {
                return Err(Error::new(
                    errno::ENOSYS,
                    format!("counter wait object {w:?} is not implemented"),
                ))
            }
        }
        Ok(Arc::new(Counter {
            value: AtomicU64::new(0),
            err: AtomicU64::new(0),
            wait_obj: attr.wait_obj,
            feeds: RwLock::new(Arc::from(Vec::new())),
            bound: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            fd: match attr.wait_obj {
                // A wait set nests the descriptor.
                WaitObj::Fd | WaitObj::Unspec | WaitObj::Set => Some(CntrFd::new()?),
                _ => None,
            },
            mc: match attr.wait_obj {
                WaitObj::MutexCond => {
                    Some(MutexCond::new().map_err(|e| Error::os(e, "pthread_cond_init"))?)
                }
                _ => None,
            },
            _domain: domain.clone(),
        }))
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self._domain
    }

    pub fn wait_obj(&self) -> WaitObj {
        self.wait_obj
    }

    /// `fi_cntr_read`: the successes so far, after driving the CQs that feed the counter.
    pub fn read(&self) -> u64 {
        self.progress();
        self.value.load(Ordering::Acquire)
    }

    /// `fi_cntr_readerr`: the failures so far, after driving progress.
    pub fn readerr(&self) -> u64 {
        self.progress();
        self.err.load(Ordering::Acquire)
    }

    /// `fi_cntr_add`.
    pub fn add(&self, v: u64) {
        self.value.fetch_add(v, Ordering::AcqRel);
        self.changed();
    }

    /// `fi_cntr_set`.
    pub fn set(&self, v: u64) {
        self.value.store(v, Ordering::Release);
        self.changed();
    }

    /// `fi_cntr_adderr`.
    pub fn adderr(&self, v: u64) {
        self.err.fetch_add(v, Ordering::AcqRel);
        self.changed();
    }

    /// `fi_cntr_seterr`.
    pub fn seterr(&self, v: u64) {
        self.err.store(v, Ordering::Release);
        self.changed();
    }

    /// An application changed a value: one blocked on the descriptor or the pair wakes
    /// to look.
    fn changed(&self) {
        if let Some(f) = &self.fd {
            f.wake();
        }
        self.broadcast();
    }

    /// One more success (`ok`) or failure, from progress.
    #[inline]
    pub(crate) fn count(&self, ok: bool) {
        let n = if ok { &self.value } else { &self.err };
        // SeqCst with the sleeper's count and its look at the values: one of the two sees
        // the other (on x86 both are the instructions AcqRel would give).
        n.fetch_add(1, Ordering::SeqCst);
        if let Some(f) = &self.fd {
            if f.sleepers.load(Ordering::SeqCst) != 0 {
                f.wake();
            }
        }
        self.broadcast();
    }

    /// Wakes the threads waiting on an `FI_WAIT_MUTEX_COND` counter's pair: under its
    /// mutex when it is free (a waiter between taking it and waiting is then asleep
    /// already), without it when held, since the holder may be the thread driving this
    /// progress (an application that reads a CQ under it must not deadlock).
    #[inline]
    fn broadcast(&self) {
        if let Some(mc) = &self.mc {
            let _g = mc.try_lock();
            mc.broadcast();
        }
    }

    /// The pair of an `FI_WAIT_MUTEX_COND` counter (`fi_control(FI_GETWAIT)`), broadcast
    /// whenever a count changes: by a value call, or by progress in any thread. Progress
    /// is manual, so a thread that waits on it while none reads should wait with a timeout
    /// (as should one that takes the mutex just before waiting: a change in that instant
    /// broadcasts without it).
    pub fn wait_mutex_cond(&self) -> Result<&MutexCond> {
        self.mc.as_ref().ok_or_else(|| {
            Error::new(
                errno::EINVAL,
                format!(
                    "this counter's wait object is {:?}, not FI_WAIT_MUTEX_COND",
                    self.wait_obj
                ),
            )
        })
    }

    /// The descriptor of an `FI_WAIT_FD` counter (`fi_control(FI_GETWAIT)`), for poll or
    /// epoll: readable when a feeding CQ has something to progress or a value was set.
    /// Call [`Self::trywait`] before blocking on it, and read the counter after.
    pub fn wait_fd(&self) -> Result<BorrowedFd<'_>> {
        match &self.fd {
            Some(f) if self.wait_obj == WaitObj::Fd => Ok(f.epoll.0.as_fd()),
            _ => Err(Error::new(
                errno::EINVAL,
                format!(
                    "FI_GETWAIT needs a counter opened with FI_WAIT_FD or FI_WAIT_MUTEX_COND; this one has {:?}",
                    self.wait_obj
                ),
            )),
        }
    }

    /// `fi_trywait` on an `FI_WAIT_FD` counter: arms its CQs and drives them once; `EAGAIN`
    /// when that changed the counts (read them instead of blocking) or when a CQ it counts
    /// from has no descriptor to wake it.
    pub fn trywait(&self) -> Result<()> {
        match &self.fd {
            Some(f) if matches!(self.wait_obj, WaitObj::Fd | WaitObj::Set) => self.prepare_sleep(f),
            _ => Err(Error::new(
                errno::EINVAL,
                "fi_trywait on a counter needs FI_WAIT_FD or FI_WAIT_SET",
            )),
        }
    }

    /// Puts the counter (opened with `FI_WAIT_SET`) in `set`.
    pub fn join(self: &Arc<Self>, set: &crate::verbs::WaitSet) -> Result<()> {
        match &self.fd {
            Some(f) if self.wait_obj == WaitObj::Set => {
                let me: Weak<dyn crate::verbs::wait::WaitMember> = Arc::downgrade(self) as _;
                set.join(&[f.epoll.0.as_fd()], me)
            }
            _ => Err(Error::new(
                errno::EINVAL,
                "only a counter opened with FI_WAIT_SET joins a wait set",
            )),
        }
    }

    /// [`Self::trywait`] on the counter's descriptor `f`.
    fn prepare_sleep(&self, f: &CntrFd) -> Result<()> {
        let _ = f.event.read(); // EAGAIN when not written: nothing to consume.
        let before = (
            self.value.load(Ordering::Acquire),
            self.err.load(Ordering::Acquire),
        );
        for cq in self.feeds().iter().filter_map(Weak::upgrade) {
            cq.arm_for_counter()?;
        }
        // Completions that came before the arm would never wake the descriptor.
        self.progress();
        let after = (
            self.value.load(Ordering::Acquire),
            self.err.load(Ordering::Acquire),
        );
        if after != before || f.blind.load(Ordering::Acquire) {
            return Err(Error::new(
                errno::EAGAIN,
                "the counter moved (or counts from a CQ without a descriptor): read it before waiting",
            ));
        }
        Ok(())
    }

    /// `fi_cntr_wait`: returns once the count reaches `threshold`; `EAVAIL` when the error
    /// count changes first, `ETIMEDOUT` after `timeout_ms` (negative: no limit). Drives
    /// progress meanwhile and sleeps on a feeding CQ's wait object between looks.
    pub fn wait(&self, threshold: u64, timeout_ms: i32) -> Result<()> {
        if self.wait_obj == WaitObj::None {
            return Err(Error::new(
                errno::EINVAL,
                "fi_cntr_wait on a counter opened with FI_WAIT_NONE (fi_cntr(3) forbids it): open it with FI_WAIT_UNSPEC",
            ));
        }
        let deadline =
            (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
        let err0 = self.err.load(Ordering::Acquire);
        loop {
            self.progress();
            if self.value.load(Ordering::Acquire) >= threshold {
                return Ok(());
            }
            if self.err.load(Ordering::Acquire) != err0 {
                return Err(Error::new(
                    errno::EAVAIL,
                    "an operation completed in error: fi_cntr_readerr counts it",
                ));
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => {
                        return Err(Error::new(
                            errno::ETIMEDOUT,
                            format!("the counter stayed below {threshold} for {timeout_ms} ms"),
                        ))
                    }
                },
            };
            self.sleep(left, || {
                self.value.load(Ordering::SeqCst) >= threshold
                    || self.err.load(Ordering::SeqCst) != err0
            })?;
        }
    }

    /// Sleeps up to `left` (`None`: until woken) unless `done`: on the counter's descriptor,
    /// which any feeding CQ and any count wakes; else a slice of it on the first feeding CQ
    /// that has a wait object, else yields.
    fn sleep(&self, left: Option<Duration>, done: impl Fn() -> bool) -> Result<()> {
        if let Some(f) = self
            .fd
            .as_ref()
            .filter(|f| !f.blind.load(Ordering::Acquire))
        {
            // Counted first: a count from now on either wakes the descriptor after
            // `prepare_sleep` consumed its wake-ups, or is seen by `done` after it.
            f.sleepers.fetch_add(1, Ordering::SeqCst);
            let r = match self.prepare_sleep(f) {
                Ok(()) if done() => Ok(()),
                Ok(()) => {
                    let t = left.map_or(EpollTimeout::NONE, |l| {
                        EpollTimeout::try_from(l).unwrap_or(EpollTimeout::MAX)
                    });
                    let r = f.epoll.wait(&mut [EpollEvent::empty(); 4], t);
                    f.wakeups.fetch_add(1, Ordering::Relaxed);
                    match r {
                        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
                        Err(e) => Err(Error::os(e as i32, "epoll_wait on the counter")),
                    }
                }
                // The counts moved while it readied: the caller looks again.
                Err(e) if e.errno() == errno::EAGAIN => Ok(()),
                Err(e) => Err(e),
            };
            f.sleepers.fetch_sub(1, Ordering::SeqCst);
            return r;
        }
        let left = left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE));
        let cq = self
            .feeds()
            .iter()
            .filter_map(Weak::upgrade)
            .find(|q| q.has_wait_object());
        let Some(cq) = cq.filter(|_| self.wait_obj != WaitObj::Yield) else {
            std::thread::yield_now();
            return Ok(());
        };
        cq.arm()?;
        // Completions polled before the arm would never wake the sleep.
        if cq.drive_for_counters()? {
            return Ok(());
        }
        cq.sleep_for_device(left)
    }

    /// How many times `fi_cntr_wait` came back from sleeping on the counter's descriptor,
    /// woken or timed out: a diagnostic of how often a waiter looks.
    pub fn wakeups(&self) -> u64 {
        self.fd
            .as_ref()
            .map_or(0, |f| f.wakeups.load(Ordering::Relaxed))
    }

    /// `fi_close`: `EBUSY` while endpoints are bound to it.
    pub fn close(&self) -> Result<()> {
        let n = self.bound.load(Ordering::Acquire);
        if n > 0 {
            return Err(Error::new(
                errno::EBUSY,
                format!(
                    "{n} bindings (endpoints, regions, poll sets) still use this counter: close them (fi_poll_del) first"
                ),
            ));
        }
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn bind(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(errno::EINVAL, "this counter was closed"));
        }
        self.bound.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    pub(crate) fn unbind(&self) {
        self.bound.fetch_sub(1, Ordering::AcqRel);
    }

    /// Reads and waits drive `cq` from now on (once, however many endpoints share it).
    pub(crate) fn feed_from(&self, cq: &Arc<CompletionQueue>) {
        let mut v = self.feeds.write().unwrap_or_else(|p| p.into_inner());
        if v.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(cq))) {
            return;
        }
        let mut list: Vec<_> = v.iter().filter(|w| w.strong_count() > 0).cloned().collect();
        list.push(Arc::downgrade(cq));
        *v = Arc::from(list);
        if let Some(f) = &self.fd {
            let nested = cq
                .epoll_fd()
                .map(|fd| f.epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1)));
            match nested {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    crate::fi_warn!("cntr", "epoll_ctl nesting a CQ's descriptor: {e}");
                    f.blind.store(true, Ordering::Release);
                }
                None => f.blind.store(true, Ordering::Release),
            }
        }
    }

    fn feeds(&self) -> Arc<[Weak<CompletionQueue>]> {
        Arc::clone(&self.feeds.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn progress(&self) {
        for cq in self.feeds().iter().filter_map(Weak::upgrade) {
            if let Err(e) = cq.drive_for_counters() {
                crate::fi_warn!("cntr", "{e}");
            }
        }
    }
}

/// The counters one endpoint bound, by direction; a CQ counts the endpoint's completions
/// into them (found by queue pair number).
#[derive(Clone, Debug, Default)]
pub(crate) struct EpCounters {
    pub(crate) send: Option<Arc<Counter>>,
    pub(crate) recv: Option<Arc<Counter>>,
    pub(crate) read: Option<Arc<Counter>>,
    pub(crate) write: Option<Arc<Counter>>,
    /// RMA that targets the endpoint (`FI_RMA_EVENT` endpoints only).
    pub(crate) remote_read: Option<Arc<Counter>>,
    pub(crate) remote_write: Option<Arc<Counter>>,
}

/// The directions a counter may count, in `EpCounters` order.
const CNTR_DIRS: [Flags; 6] = [
    Flags::SEND,
    Flags::RECV,
    Flags::READ,
    Flags::WRITE,
    Flags::REMOTE_READ,
    Flags::REMOTE_WRITE,
];

impl EpCounters {
    /// `fi_ep_bind` of `cntr` for the directions in `flags`. `FI_REMOTE_READ` and
    /// `FI_REMOTE_WRITE` need an endpoint made with `FI_RMA_EVENT` (`rma_event`).
    pub(crate) fn bind(
        &mut self,
        cntr: &Arc<Counter>,
        flags: Flags,
        rma_event: bool,
    ) -> Result<()> {
        if flags.intersects(Flags::REMOTE_READ | Flags::REMOTE_WRITE) && !rma_event {
            return Err(Error::new(
                errno::EINVAL,
                "FI_REMOTE_READ/FI_REMOTE_WRITE counters need an endpoint made with FI_RMA_EVENT (fi_endpoint(3)); rverbs offers it on RDM endpoints",
            ));
        }
        let all = CNTR_DIRS.iter().fold(Flags::empty(), |a, f| a | *f);
        if flags.is_empty() || !(flags - all).is_empty() {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!(
                    "counter bind flags {flags:?}: use FI_SEND, FI_RECV, FI_READ, FI_WRITE, FI_REMOTE_READ and/or FI_REMOTE_WRITE"
                ),
            ));
        }
        if CNTR_DIRS
            .iter()
            .any(|f| flags.contains(*f) && self.slot(*f).is_some())
        {
            return Err(Error::new(
                errno::EINVAL,
                "a counter is already bound for one of those directions (fi_endpoint(3): one each)",
            ));
        }
        for f in CNTR_DIRS.iter().filter(|f| flags.contains(**f)) {
            cntr.bind()?;
            *self.slot(*f) = Some(cntr.clone());
        }
        Ok(())
    }

    fn slot(&mut self, f: Flags) -> &mut Option<Arc<Counter>> {
        match f {
            Flags::SEND => &mut self.send,
            Flags::RECV => &mut self.recv,
            Flags::READ => &mut self.read,
            Flags::WRITE => &mut self.write,
            Flags::REMOTE_READ => &mut self.remote_read,
            _ => &mut self.remote_write,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.all().next().is_none()
    }

    /// Whether operations the endpoint initiates are counted (each must then be signalled).
    pub(crate) fn counts_transmits(&self) -> bool {
        self.send.is_some() || self.read.is_some() || self.write.is_some()
    }

    /// Counts one operation an endpoint finished in software (an RDM endpoint's), by its
    /// completion flags: `FI_REMOTE_READ`, `FI_REMOTE_WRITE`, `FI_READ`, `FI_WRITE`,
    /// `FI_SEND` or `FI_RECV`.
    pub(crate) fn done(&self, flags: Flags, ok: bool) {
        let cntr = if flags.contains(Flags::REMOTE_READ) {
            &self.remote_read
        } else if flags.contains(Flags::REMOTE_WRITE) {
            &self.remote_write
        } else if flags.contains(Flags::READ) {
            &self.read
        } else if flags.contains(Flags::WRITE) {
            &self.write
        } else if flags.contains(Flags::SEND) {
            &self.send
        } else if flags.contains(Flags::RECV) {
            &self.recv
        } else {
            return;
        };
        if let Some(c) = cntr {
            c.count(ok);
        }
    }

    /// `done` for a receive: one test on an RDM endpoint's arrival path.
    #[inline(always)]
    pub(crate) fn recv_done(&self, ok: bool) {
        if let Some(c) = &self.recv {
            c.count(ok);
        }
    }

    /// `done` for a send: one test on an RDM endpoint's local path.
    #[inline(always)]
    pub(crate) fn send_done(&self, ok: bool) {
        if let Some(c) = &self.send {
            c.count(ok);
        }
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &Arc<Counter>> {
        [
            &self.send,
            &self.recv,
            &self.read,
            &self.write,
            &self.remote_read,
            &self.remote_write,
        ]
        .into_iter()
        .flatten()
    }

    /// Counts one device completion of the endpoint's: a success by its opcode, a failure
    /// by the operation its work request id names (verbs leaves a failure's opcode undefined).
    pub(crate) fn count(&self, w: &WorkCompletion) {
        let id = w.wr_id();
        if wr_id::is_marker(id) || wr_id::is_peer(id) {
            return; // shutdown's own, or a peer provider's transfer
        }
        let ok = w.status() == st::IBV_WC_SUCCESS;
        let cntr = if ok {
            match w.opcode() {
                op::IBV_WC_SEND => &self.send,
                op::IBV_WC_RECV => &self.recv,
                op::IBV_WC_RDMA_READ => &self.read,
                op::IBV_WC_RDMA_WRITE => &self.write,
                _ => return, // a write with immediate data: FI_REMOTE_WRITE
            }
        } else {
            // The operation its work request id names (one direction each).
            return self.done(wr_id::flags(id), false);
        };
        if let Some(c) = cntr {
            c.count(true);
        }
    }
}
