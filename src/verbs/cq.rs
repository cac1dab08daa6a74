//! Completion queues on `ibv_cq`, read in manual progress.
//!
//! The fast path polls the device straight into the caller's entries, in the CQ's format.
//! An error completion, and whatever the same poll returned after it, is staged in the
//! software queue ([`CqState`]) that every later read drains first, so order is kept.
//! Software completions (protocols, peers) are staged there too.
//!
//! Blocking reads arm the verbs completion channel and sleep on one epoll descriptor that
//! also watches an eventfd, written for software completions and `fi_cq_signal`. With
//! `FI_WAIT_FD` that descriptor is the wait object `fi_control(FI_GETWAIT)` returns.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;
use rfabric_sys::lock::{Lock, LockGuard};
use rfabric_sys::verbs::{
    wc_opcode as op, wc_status as st, wc_status_str, CompChannel, Cq, WcBatch, WorkCompletion,
    WC_WITH_IMM,
};
use rfabric_sys::wait::MutexCond;

use crate::core::cq::{
    self as core_cq, CqEntry, CqErrEntry, CqState, ErrData, FormatEntry, Waitable,
};
use crate::core::env;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{CqFormat, CqWaitCond, Flags, Threading, WaitObj};
use crate::verbs::cntr::EpCounters;
use crate::verbs::wr_id::Kind;
use crate::verbs::{os_err, wr_id, Domain};

/// `fi_cq_attr`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqAttr {
    /// Entries; 0 means the provider default (`FI_RVERBS_CQ_SIZE`).
    pub size: usize,
    /// `FI_AFFINITY` makes `signaling_vector` choose the completion vector.
    pub flags: Flags,
    pub format: CqFormat,
    pub wait_obj: WaitObj,
    pub signaling_vector: i32,
    pub wait_cond: CqWaitCond,
}

/// `FI_CQ_FORMAT_UNSPEC` resolves to the tagged format: every field rverbs can fill.
pub const UNSPEC_FORMAT: CqFormat = CqFormat::Tagged;

const POLL_BATCH: usize = 16;

/// What a read of a CQ must look at besides the device (`CompletionQueue::features`).
mod feature {
    /// Peer providers or RDM endpoints to drive.
    pub(super) const PEERS: u8 = 1;
    /// Endpoints that place some completions themselves (`register_owner`).
    pub(super) const OWNERS: u8 = 2;
    /// Counters to count completions into.
    pub(super) const COUNTERS: u8 = 4;
    /// Entries staged in the software queue (in `CompletionQueue::gate` only).
    pub(super) const STAGED: u8 = 8;
    /// The device dropped completions (`device_events`): reads report the overrun once
    /// they have taken what it kept.
    pub(super) const OVERRUN: u8 = 16;
    /// The application prepared to sleep on the descriptor (`fi_trywait`) and told the
    /// peers so: its next read tells them it woke (`CompletionQueue::fd_sleep`).
    pub(super) const FD_ASLEEP: u8 = 32;
}

/// The peers a CQ's reads drive (`CompletionQueue::peer_list`).
struct PeerList(Arc<[Arc<dyn PeerProgress>]>);

impl std::fmt::Debug for PeerList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} peers", self.0.len())
    }
}

/// The value of `CompletionQueue::gate` that lets a read in `format` take the plain path.
#[inline(always)]
const fn gate_for(format: CqFormat) -> u32 {
    (format as u32) << 8
}

/// Device entries of a CQ no endpoint is bound to yet.
const IDLE_DEPTH: usize = 64;

/// The wait machinery of a CQ that supports blocking reads.
#[derive(Debug)]
enum Waiter {
    /// `FI_WAIT_FD` / `FI_WAIT_UNSPEC`: one epoll descriptor over the completion channel
    /// and an eventfd written for software completions and `fi_cq_signal`.
    Fd {
        epoll: Epoll,
        event: EventFd,
        /// `FI_WAIT_FD`: the application may wait on `epoll` itself, so software
        /// completions always write `event` (otherwise only when a thread sleeps in `sread`).
        external: bool,
        /// Made by the first `fi_trywait` with peers that need driving: a one-shot timer in
        /// `epoll` that wakes the application as `sread`'s timeout wakes its sleeper.
        timer: std::sync::OnceLock<TimerFd>,
    },
    /// `FI_WAIT_MUTEX_COND`: a pthread pair, broadcast by a notifier thread that watches
    /// the completion channel and peers' descriptors (an RDM endpoint's connection events,
    /// the local path's bell), and by software completions and `fi_cq_signal`.
    MutexCond {
        mc: Arc<MutexCond>,
        /// Set under the mutex by every wake-up and checked under it before waiting, so no
        /// wake-up falls between a sleeper's last check and its wait.
        pending: Arc<AtomicBool>,
        /// What the notifier watches: the completion channel, its stop, and peers'
        /// descriptors (edge-triggered: the woken sleeper, not the notifier, reads them).
        epoll: Arc<Epoll>,
        /// A peer's descriptor fired: the sleeper drives the peers when it wakes.
        peer_event: Arc<AtomicBool>,
        _notifier: Notifier,
    },
}

/// The thread that turns completion-channel events into condition broadcasts. It signals
/// a wait object only; progress stays in `cq_read`.
#[derive(Debug)]
struct Notifier {
    stop: Arc<EventFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Notifier {
    /// Starts the thread over `epoll`, which gets the channel and the stop descriptor.
    fn spawn(
        ch: Arc<CompChannel>,
        mc: Arc<MutexCond>,
        pending: Arc<AtomicBool>,
        epoll: Arc<Epoll>,
        peer_event: Arc<AtomicBool>,
    ) -> Result<Self> {
        let stop = Arc::new(
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(nix_err("eventfd"))?,
        );
        epoll
            .add(ch.borrow_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 0))
            .map_err(nix_err("epoll_ctl"))?;
        epoll
            .add(stop.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 1))
            .map_err(nix_err("epoll_ctl"))?;
        let thread = std::thread::Builder::new()
            .name("rverbs-cq-notify".into())
            .spawn(move || loop {
                let mut events = [EpollEvent::empty(); 8];
                let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
                    Ok(n) => n,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        crate::fi_warn!(
                            "cq",
                            "notifier epoll_wait failed, FI_WAIT_MUTEX_COND waiters will time out: {e}"
                        );
                        return;
                    }
                };
                let mut wake = false;
                for e in &events[..n] {
                    match e.data() {
                        1 => return,
                        PEER_FD_TOKEN => {
                            peer_event.store(true, Ordering::SeqCst);
                            wake = true;
                        }
                        _ => wake |= ch.drain() > 0,
                    }
                }
                if wake {
                    let _g = mc.lock();
                    pending.store(true, Ordering::SeqCst);
                    mc.broadcast();
                }
            })
            .map_err(|e| {
                Error::new(
                    errno::ENOMEM,
                    format!("cannot start the CQ notifier thread: {e}"),
                )
            })?;
        Ok(Notifier {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        let _ = self.stop.arm();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A completion queue (`fi_cq`).
#[derive(Debug)]
pub struct CompletionQueue {
    cq: Cq,
    /// Entries staged in `state`: the fast path checks this and skips the lock when 0.
    staged: AtomicUsize,
    /// What `state` can stage at least (its capacity at open).
    soft_min: usize,
    state: Lock<CqState>,
    /// Device entries promised to bound queue pairs; serialises resizes.
    reserved: Mutex<u32>,
    /// Endpoint bindings (a direction each); `close` refuses while any remain.
    bound: AtomicUsize,
    closed: AtomicBool,
    signaled: AtomicBool,
    /// Threads inside `sleep`: software completions wake them through the eventfd.
    sleepers: AtomicUsize,
    waiter: Option<Waiter>,
    attr: CqAttr,
    max_cqe: u32,
    /// Endpoints that place some of their receive completions themselves, by queue pair
    /// number (an RDM endpoint has one per connection). Changed rarely, read per owned
    /// completion.
    owners: RwLock<HashMap<u32, Weak<dyn RecvOwner>, QpnHash>>,
    /// Owners track their receives in posting order (GRH slots, capacities, multi-receive
    /// buffers): while any is registered, a poll and the owners' reading of what it polled
    /// are one step under `ordered`, so that two threads reading this CQ cannot take each
    /// other's place in an owner's queue. Without owners the read path takes no lock.
    /// (`feature::OWNERS`.)
    ordered: Mutex<()>,
    /// The domain's threading serialises reads of this CQ (`FI_THREAD_DOMAIN`,
    /// `FI_THREAD_COMPLETION`): `ordered` has nobody to keep apart.
    serial: bool,
    /// Owners found by the key their work requests carry (RDM endpoints: one key for all
    /// their connections, so no lookup by queue pair). Few per CQ; keys are never reused.
    keyed: RwLock<Vec<(u32, Weak<dyn RecvOwner>)>>,
    /// The first keyed owner (an RDM endpoint usually has its CQs to itself), found with
    /// no lock while `first_keyed_live` holds: cleared when it unregisters. The `Weak`
    /// stays (keys are never reused), holding the owner's allocation, not the owner.
    first_keyed: std::sync::OnceLock<(u32, Weak<dyn RecvOwner>)>,
    first_keyed_live: AtomicBool,
    /// A datagram endpoint whose plain receives (`Kind::DgramPlain`) this CQ reports
    /// without it, and how many it reported: the endpoint compares it with what it posted.
    plain_ud: AtomicBool,
    plain_ud_done: AtomicU64,
    /// Peer providers whose progress a read drives (fi_peer(3)); `feature::PEERS` keeps
    /// the lock off the plain verbs path.
    /// Each with whether it needs every read (a peer provider's messages move only then).
    peers: RwLock<Vec<(Weak<dyn PeerProgress>, bool)>>,
    /// The live ones, as one shared list that a read clones (one count) instead of
    /// copying, holding them: a read calls them without upgrading each (two atomics per
    /// peer per read). Whoever adds a peer removes it (`remove_peer`) before it could go.
    peer_list: RwLock<PeerList>,
    /// Peers that need every read; requests for every read from the others (an RDM
    /// endpoint setting up a connection); reads since the last call otherwise.
    peers_always: AtomicU32,
    peers_wanted: AtomicU32,
    peer_tick: AtomicU32,
    /// Peers, and those whose events a blocked read also waits on (`add_wait_fd`): while
    /// every peer has one, a blocked read sleeps until something happens instead of
    /// waking every millisecond to drive them.
    peers_total: AtomicU32,
    peer_fds: AtomicU32,
    /// Bells of peers in the wait set (`add_bell_fd`): a sleeper asks those peers
    /// whether their bell is enough to wake it (`PeerProgress::sleeping`).
    bells: AtomicU32,
    /// Times a blocked read came back from its wait object (`wakeups`).
    wakeups: AtomicU64,
    /// While the application sleeps on the descriptor (from `fi_trywait` to its next read):
    /// whether the peers were told (`peers_sleeping`, balanced by the read) and how many
    /// said their bell will wake it.
    fd_sleep: Mutex<Option<(bool, u32)>>,
    /// Another CQ's sleeper consumed this one's completion-channel events (`rearm`).
    events_taken: AtomicBool,
    /// Where the completions of peers' transfers go, by queue pair number.
    transfers: RwLock<Vec<(u32, Weak<dyn PeerTransferSink>)>>,
    /// The counters of endpoints that bound some, by queue pair number: each polled
    /// completion of theirs counts there. `feature::COUNTERS` keeps the lock off other reads.
    counters: RwLock<HashMap<u32, Arc<EpCounters>, QpnHash>>,
    /// What a read must look at besides the device (`feature`), each bit changed under the
    /// lock of what it stands for; `read_plain` runs while none in `plain_mask` is set.
    features: AtomicU8,
    /// `read`'s one test: the CQ's format in the high byte, and in the low byte the bits of
    /// `features` in `plain_mask` and `feature::STAGED` while entries are staged. A read in
    /// the CQ's format finds it equal to `gate_for(format)` exactly when `read_plain` may run.
    gate: AtomicU32,
    /// The features that keep reads off `read_plain`: owners only where readers can race.
    plain_mask: u8,
    /// The device reported an overrun not yet entered into the software queue's state.
    overran: AtomicBool,
    _domain: Arc<Domain>,
}

/// A key no owner has had in this process (`register_keyed_owner`): never reused, so a
/// completion of a closed endpoint left in a CQ cannot reach a later one.
pub(crate) fn new_owner_key() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The epoll token of peers' descriptors (`add_wait_fd`).
const PEER_FD_TOKEN: u64 = 2;

/// The epoll token of the timer `fi_trywait` sets while peers need driving.
const TIMER_TOKEN: u64 = 3;

/// Peer providers and RDM endpoints one CQ's reads drive, at most.
const MAX_PEERS: usize = 16;

/// Peers that do not need every read (RDM endpoints, whose own completions come through
/// the device) are driven by one read in this many, and by every read while they ask.
pub(crate) const PEER_POLL_EVERY: u32 = 64;

/// Hashes queue pair numbers (small, distinct integers from the device, not chosen by a
/// peer) with one multiplication: looked up for every received message.
#[derive(Clone, Copy, Default)]
pub(crate) struct QpnHash;

impl std::hash::BuildHasher for QpnHash {
    type Hasher = QpnHasher;
    fn build_hasher(&self) -> QpnHasher {
        QpnHasher(0)
    }
}

#[derive(Default)]
pub(crate) struct QpnHasher(u64);

impl std::hash::Hasher for QpnHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ *b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl std::fmt::Debug for QpnHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QpnHash")
    }
}

/// Where a read of a CQ takes the completions its own progress call makes (a local
/// peer's receive, say): straight into the reader's array, in its format, instead of
/// through the software queue and back out. Only while the CQ has nothing staged (what
/// was written before comes out first), and only as many as the array holds; the rest
/// are staged as usual.
pub struct ReadSink<'a> {
    cq: &'a CompletionQueue,
    out: &'a mut dyn SinkOut,
}

impl std::fmt::Debug for ReadSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadSink")
    }
}

/// The reader's array behind a [`ReadSink`].
trait SinkOut {
    /// Takes `e` from `src`, unless the array is full.
    fn put(&mut self, e: &CqEntry, src: u64) -> bool;
}

/// A read's entries of format `E` (and their sources, for `readfrom`), `n` written.
struct ReadOut<'a, 'b, E> {
    out: &'a mut [E],
    src: Option<&'b mut [u64]>,
    n: usize,
}

impl<E: FormatEntry> SinkOut for ReadOut<'_, '_, E> {
    #[inline]
    fn put(&mut self, e: &CqEntry, src: u64) -> bool {
        let Some(slot) = self.out.get_mut(self.n) else {
            return false;
        };
        *slot = E::from_tagged(e);
        if let Some(s) = self.src.as_deref_mut() {
            s[self.n] = src;
        }
        self.n += 1;
        true
    }
}

/// A peer provider sharing this CQ: each read of the CQ drives it (manual progress), and
/// it inserts its completions with [`CompletionQueue::write`]/[`CompletionQueue::writeerr`].
pub(crate) trait PeerProgress: Send + Sync {
    /// Called from a read of `cq`; what it completes on `cq` may go to the reader's
    /// `sink` (see [`CompletionQueue::write_via`]).
    fn progress(&self, cq: &CompletionQueue, sink: Option<&mut ReadSink<'_>>);
    /// A thread is about to sleep on `cq`, which holds this peer's bell (`on`), or woke
    /// (`!on`, once after each `true`). True when the bell will wake the sleeper for all
    /// the peer waits for, so the CQ need not wake to drive it.
    fn sleeping(&self, _cq: &CompletionQueue, _on: bool) -> bool {
        false
    }
    /// A descriptor the peer put in the CQ's wait set (`add_wait_fd`) woke a sleeping
    /// reader: its next progress call should look at it, whatever it rations.
    fn fd_woke(&self) {}
}

/// Where the completions of a peer provider's transfers go (fi_peer(3) `FI_PEER_TRANSFER`).
/// Called with no CQ lock held, from inside a read of the CQ.
pub(crate) trait PeerTransferSink: Send + Sync {
    /// A transfer completed (`src`: its source on a connectionless endpoint, else
    /// `FI_ADDR_NOTAVAIL`).
    fn completion(&self, c: std::result::Result<CqEntry, CqErrEntry>, src: u64);
}

/// An endpoint that turns some of its receive completions into CQ entries itself: where
/// in a multi-receive buffer a message landed, or which peer a datagram came from.
pub(crate) trait RecvOwner: Send + Sync {
    fn recv_completion(&self, wc: &WorkCompletion) -> Option<Owned>;
}

/// What an owner makes of a completion.
#[derive(Debug)]
pub(crate) enum Owned {
    /// An entry and its source address (`FI_ADDR_NOTAVAIL` when unknown).
    Entry(CqEntry, u64),
    /// Error entries: a failure, with the cancellations of what waited behind it.
    Errors(Vec<CqErrEntry>),
}

/// libfabric errno for a failed work completion.
pub(crate) fn status_errno(status: u32) -> i32 {
    match status {
        st::IBV_WC_WR_FLUSH_ERR => errno::ECANCELED,
        st::IBV_WC_LOC_LEN_ERR => errno::ETRUNC,
        st::IBV_WC_LOC_PROT_ERR | st::IBV_WC_REM_ACCESS_ERR | st::IBV_WC_MW_BIND_ERR => {
            errno::EACCES
        }
        st::IBV_WC_REM_INV_REQ_ERR => errno::EINVAL,
        st::IBV_WC_RETRY_EXC_ERR | st::IBV_WC_RESP_TIMEOUT_ERR => errno::ETIMEDOUT,
        st::IBV_WC_RNR_RETRY_EXC_ERR => errno::ECONNREFUSED,
        st::IBV_WC_REM_ABORT_ERR => errno::ECONNABORTED,
        _ => errno::EIO,
    }
}

/// Completion flags for a successful work completion, and whether it carries a length
/// (a receive's). Receive opcodes have bit 7 set (`IBV_WC_RECV` = 128), so one test splits
/// them from the initiator's, which index a table.
#[inline(always)]
fn wc_flags(wc: &WorkCompletion) -> (Flags, bool) {
    const INITIATOR: [Flags; 4] = [
        Flags::MSG.union(Flags::SEND),  // IBV_WC_SEND
        Flags::RMA.union(Flags::WRITE), // IBV_WC_RDMA_WRITE
        Flags::RMA.union(Flags::READ),  // IBV_WC_RDMA_READ
        Flags::empty(),                 // IBV_WC_COMP_SWAP (never posted)
    ];
    const _: () = assert!(
        op::IBV_WC_SEND == 0
            && op::IBV_WC_RDMA_WRITE == 1
            && op::IBV_WC_RDMA_READ == 2
            && op::IBV_WC_RECV == 128
            && op::IBV_WC_RECV_RDMA_WITH_IMM == 129
    );
    let o = wc.opcode();
    if o & op::IBV_WC_RECV == 0 {
        // Only a receive's immediate data is the peer's CQ data: rxe also marks an
        // initiator's send or write with immediate data.
        return (
            if o < 4 {
                INITIATOR[o as usize]
            } else {
                Flags::empty()
            },
            false,
        );
    }
    // `IBV_WC_WITH_IMM` shifted onto `FI_REMOTE_CQ_DATA`: no branch.
    const IMM_SHIFT: u32 =
        Flags::REMOTE_CQ_DATA.bits().trailing_zeros() - WC_WITH_IMM.trailing_zeros();
    let imm = Flags::from_bits_retain(u64::from(wc.wc_flags() & WC_WITH_IMM) << IMM_SHIFT);
    match o {
        op::IBV_WC_RECV => (Flags::MSG | Flags::RECV | imm, true),
        op::IBV_WC_RECV_RDMA_WITH_IMM => (
            Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA,
            true,
        ),
        _ => (Flags::empty(), false),
    }
}

/// Translates a successful work completion into a CQ entry: the fast path's whole work.
#[inline]
pub fn to_entry(wc: &WorkCompletion) -> CqEntry {
    let (flags, received) = wc_flags(wc);
    CqEntry {
        op_context: wr_id::context(wc.wr_id()),
        flags: flags.bits(),
        len: if received { wc.byte_len() as usize } else { 0 },
        buf: 0,
        data: if received {
            u64::from(wc.imm_data().unwrap_or(0))
        } else {
            0
        },
        tag: 0,
    }
}

/// A plain datagram receive's entry: the payload's length, after the GRH slot.
#[inline]
fn plain_ud_entry(w: &WorkCompletion) -> CqEntry {
    let mut e = to_entry(w);
    e.len = e.len.saturating_sub(rfabric_sys::verbs::GRH_LEN);
    e
}

/// Translates a failed work completion into an error entry.
pub fn to_err_entry(wc: &WorkCompletion) -> CqErrEntry {
    // Verbs leaves a failed completion's opcode undefined: the flags come from the work
    // request id, which names the operation.
    CqErrEntry {
        op_context: wr_id::context(wc.wr_id()),
        flags: wr_id::flags(wc.wr_id()).bits(),
        err: status_errno(wc.status()),
        prov_errno: wc.status() as i32,
        ..Default::default()
    }
}

/// `ibv_poll_cq` failed (the provider's CQ is broken): out of line, as every error.
#[cold]
#[inline(never)]
fn poll_error(e: i32) -> Error {
    os_err("ibv_poll_cq")(e)
}

/// The answer of a read that found nothing.
#[cold]
#[inline(never)]
fn no_completion() -> Error {
    Error::new(errno::EAGAIN, "no completion")
}

/// Queues one device completion in the software queue: successes nobody asked for are
/// dropped, errors always kept.
fn stage_one(s: &mut CqState, w: &WorkCompletion) {
    if wr_id::is_marker(w.wr_id()) {
        return; // shutdown's own: never reported
    }
    let r = if w.status() != st::IBV_WC_SUCCESS {
        let e = to_err_entry(w);
        crate::fi_info!(
            "cq",
            "completion error for context {:#x}: {} ({})",
            e.op_context,
            wc_status_str(w.status()),
            w.vendor_err()
        );
        s.push_error(e)
    } else if wr_id::is_suppressed(w.wr_id()) {
        return;
    } else {
        s.push_entry(to_entry(w))
    };
    if let Err(e) = r {
        crate::fi_warn!("cq", "{e}");
    }
}

fn nix_err(what: &'static str) -> impl Fn(nix::errno::Errno) -> Error {
    move |e| Error::os(e as i32, what)
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // Before the device CQ goes (its fields drop after this).
        super::device_events::forget_cq(self._domain.device().context, self.cq.id());
    }
}

impl CompletionQueue {
    pub fn open(domain: &Arc<Domain>, attr: &CqAttr) -> Result<Arc<Self>> {
        let mut attr = *attr;
        if !(attr.flags - Flags::AFFINITY).is_empty() {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!(
                    "CQ flags {:?}: only FI_AFFINITY is defined",
                    attr.flags - Flags::AFFINITY
                ),
            ));
        }
        match attr.wait_obj {
            WaitObj::None
            | WaitObj::Unspec
            | WaitObj::Fd
            | WaitObj::Yield
            | WaitObj::MutexCond
            | WaitObj::Set => {}
            w => {
                return Err(Error::new(
                    errno::ENOSYS,
                    format!("CQ wait object {w:?} is not implemented: use FI_WAIT_FD, FI_WAIT_SET, FI_WAIT_MUTEX_COND, FI_WAIT_UNSPEC or FI_WAIT_YIELD"),
                ))
            }
        }
        let dev = domain.device();
        let max_cqe = dev.attr.max_cqe;
        let size = if attr.size == 0 {
            env::get_usize_or("FI_RVERBS_CQ_SIZE", 2048)?
        } else {
            attr.size
        };
        if size > max_cqe as usize {
            return Err(Error::new(
                errno::EINVAL,
                format!("CQ size {size} exceeds the device's max_cqe {max_cqe}"),
            ));
        }
        let vector = if attr.flags.contains(Flags::AFFINITY) {
            (attr.signaling_vector.max(0) as u32 % dev.context.num_comp_vectors()) as i32
        } else {
            0
        };
        let (channel, waiter) = match attr.wait_obj {
            // A wait set's member keeps a descriptor of its own, which the set nests.
            WaitObj::Unspec | WaitObj::Fd | WaitObj::Set => {
                let ch =
                    CompChannel::new(dev.context).map_err(os_err("ibv_create_comp_channel"))?;
                let event = EventFd::from_value_and_flags(
                    0,
                    EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
                )
                .map_err(nix_err("eventfd"))?;
                let epoll =
                    Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(nix_err("epoll_create"))?;
                epoll
                    .add(ch.borrow_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 0))
                    .map_err(nix_err("epoll_ctl"))?;
                epoll
                    .add(event.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 1))
                    .map_err(nix_err("epoll_ctl"))?;
                (
                    Some(ch),
                    Some(Waiter::Fd {
                        epoll,
                        event,
                        external: attr.wait_obj != WaitObj::Unspec,
                        timer: std::sync::OnceLock::new(),
                    }),
                )
            }
            WaitObj::MutexCond => {
                let ch =
                    CompChannel::new(dev.context).map_err(os_err("ibv_create_comp_channel"))?;
                let mc = Arc::new(MutexCond::new().map_err(|e| Error::os(e, "pthread_cond_init"))?);
                let pending = Arc::new(AtomicBool::new(false));
                let epoll = Arc::new(
                    Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(nix_err("epoll_create"))?,
                );
                let peer_event = Arc::new(AtomicBool::new(false));
                let notifier = Notifier::spawn(
                    ch.clone(),
                    mc.clone(),
                    pending.clone(),
                    epoll.clone(),
                    peer_event.clone(),
                )?;
                (
                    Some(ch),
                    Some(Waiter::MutexCond {
                        mc,
                        pending,
                        epoll,
                        peer_event,
                        _notifier: notifier,
                    }),
                )
            }
            _ => (None, None),
        };
        // The device queue starts small and grows with the endpoints bound to it
        // (`reserve`): an idle CQ costs little, so `domain_attr.cq_cnt` of them can be open.
        let depth = size.clamp(1, IDLE_DEPTH);
        let cq =
            Cq::new(dev.context, depth as u32, vector, channel).map_err(os_err("ibv_create_cq"))?;
        attr.size = size;
        // What is staged (errors, flushes, peers' writes) is held up to the CQ's size, or
        // the device queue's when that grew past it; memory is taken only as it is used.
        let soft = size.max(cq.capacity() as usize).max(64);
        if attr.format == CqFormat::Unspec {
            attr.format = UNSPEC_FORMAT;
        }
        let serial = matches!(
            domain.info().domain_attr.threading,
            Threading::Domain | Threading::Completion
        );
        let context = dev.context;
        let cq = Arc::new(CompletionQueue {
            cq,
            staged: AtomicUsize::new(0),
            state: Lock::new(CqState::new(soft)),
            soft_min: soft,
            reserved: Mutex::new(0),
            bound: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            signaled: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            waiter,
            attr,
            max_cqe,
            owners: RwLock::new(HashMap::default()),
            ordered: Mutex::new(()),
            serial,
            keyed: RwLock::new(Vec::new()),
            first_keyed: std::sync::OnceLock::new(),
            first_keyed_live: AtomicBool::new(false),
            plain_ud: AtomicBool::new(false),
            plain_ud_done: AtomicU64::new(0),
            peers: RwLock::new(Vec::new()),
            peer_list: RwLock::new(PeerList(Arc::from(Vec::new()))),
            peers_always: AtomicU32::new(0),
            peers_wanted: AtomicU32::new(0),
            peer_tick: AtomicU32::new(0),
            peers_total: AtomicU32::new(0),
            peer_fds: AtomicU32::new(0),
            bells: AtomicU32::new(0),
            wakeups: AtomicU64::new(0),
            fd_sleep: Mutex::new(None),
            events_taken: AtomicBool::new(false),
            transfers: RwLock::new(Vec::new()),
            counters: RwLock::new(HashMap::default()),
            features: AtomicU8::new(0),
            gate: AtomicU32::new(gate_for(attr.format)),
            plain_mask: if serial {
                feature::PEERS | feature::COUNTERS | feature::OVERRUN | feature::FD_ASLEEP
            } else {
                feature::PEERS
                    | feature::COUNTERS
                    | feature::OWNERS
                    | feature::OVERRUN
                    | feature::FD_ASLEEP
            },
            overran: AtomicBool::new(false),
            _domain: domain.clone(),
        });
        super::device_events::watch_cq(context, cq.cq.id(), Arc::downgrade(&cq));
        Ok(cq)
    }

    /// The device dropped completions that did not fit (`IBV_EVENT_CQ_ERR`): reads go the
    /// general way, which reports the overrun once the device has nothing more.
    pub(crate) fn device_overran(&self) {
        self.overran.store(true, Ordering::SeqCst);
        self.set(feature::OVERRUN, true);
    }

    /// The attributes in force (size as granted, `UNSPEC` resolved).
    pub fn attr(&self) -> &CqAttr {
        &self.attr
    }

    /// Entries the device queue holds now (grows as endpoints are bound).
    pub fn capacity(&self) -> usize {
        self.cq.capacity() as usize
    }

    #[inline(always)]
    fn has(&self, f: u8) -> bool {
        self.features.load(Ordering::Acquire) & f != 0
    }

    /// Sets or clears feature `f`; the caller holds the lock of what `f` stands for.
    fn set(&self, f: u8, on: bool) {
        if on {
            self.features.fetch_or(f, Ordering::SeqCst);
        } else {
            self.features.fetch_and(!f, Ordering::SeqCst);
        }
        if f & self.plain_mask != 0 {
            self.set_gate(f, on);
        }
    }

    fn set_gate(&self, f: u8, on: bool) {
        if on {
            self.gate.fetch_or(u32::from(f), Ordering::SeqCst);
        } else {
            self.gate.fetch_and(!u32::from(f), Ordering::SeqCst);
        }
    }

    /// Stores how many entries are staged (the caller holds the state lock, under which
    /// every change of `staged` happens) and keeps `gate`'s `STAGED` bit in step.
    fn set_staged(&self, n: usize, order: Ordering) {
        let was = self.staged.load(Ordering::Relaxed);
        self.staged.store(n, order);
        if (was == 0) != (n == 0) {
            self.set_gate(feature::STAGED, n != 0);
        }
    }

    fn state(&self) -> LockGuard<'_, CqState> {
        // rfabric_sys's lock: no poisoning (every CqState method is one push or pop, which
        // a panic elsewhere cannot tear), and cheaper than std's per write and read.
        self.state.lock()
    }

    #[inline]
    fn check_format<E: FormatEntry>(&self) -> Result<()> {
        if E::FORMAT != self.attr.format {
            return Err(self.format_error(E::FORMAT));
        }
        Ok(())
    }

    #[cold]
    fn format_error(&self, f: CqFormat) -> Error {
        Error::new(
            errno::EINVAL,
            format!(
                "reading {f:?} entries from a CQ opened with format {:?}",
                self.attr.format
            ),
        )
    }

    /// Reads completions into `out` in the CQ's format (`fi_cq_read`), driving progress.
    /// `EAGAIN` when none is ready; `EAVAIL` when an error is next (see [`Self::readerr`]).
    /// A zero-length `out` only drives progress.
    #[inline(always)]
    pub fn read<E: FormatEntry>(&self, out: &mut [E]) -> Result<usize> {
        // One load and compare: the format is the CQ's, and nothing but the device is
        // there to read (no peers, counters, racing owners or staged entries).
        let g = self.gate.load(Ordering::Acquire);
        if g == gate_for(E::FORMAT) && !out.is_empty() {
            return self.read_plain(out);
        }
        // Peers to drive and otherwise the plain path (an RDM endpoint's CQ).
        if g == gate_for(E::FORMAT) | u32::from(feature::PEERS) && !out.is_empty() {
            return self.read_driving(out);
        }
        // An RDM endpoint's CQ read by threads that may race: the general read at once.
        if g == gate_for(E::FORMAT) | u32::from(feature::PEERS | feature::OWNERS) {
            return self.read_general(out, None, true);
        }
        self.read_other(out)
    }

    /// Every read `read`'s gate turns away: a wrong format, peers to drive, the rest.
    #[inline(never)]
    fn read_other<E: FormatEntry>(&self, out: &mut [E]) -> Result<usize> {
        self.check_format::<E>()?;
        let f = self.features.load(Ordering::Acquire) & self.plain_mask;
        if f == 0 && self.staged.load(Ordering::Acquire) == 0 && !out.is_empty() {
            return self.read_plain(out);
        }
        if f == feature::PEERS && !out.is_empty() {
            return self.read_driving(out);
        }
        self.read_impl(out, None)
    }

    /// A read with peers to drive (an RDM endpoint's connection events, a peer provider)
    /// and otherwise nothing but the device: the peers when due, then the plain path.
    #[inline(never)]
    fn read_driving<E: FormatEntry>(&self, out: &mut [E]) -> Result<usize> {
        if self.peers_due() {
            let n = self.drive_peers_for(out, None);
            if n > 0 {
                return Ok(n);
            }
        }
        if self.staged.load(Ordering::Acquire) == 0 {
            return self.read_plain_impl::<true, E>(out);
        }
        // What the peers staged (a local message's completion, say) is read without the
        // general read's frame; an error at the head, or nothing, goes the general way.
        match self.read_staged(out, None) {
            Ok(n) if n > 0 => Ok(n),
            _ => self.read_general(out, None, false),
        }
    }

    /// A read with nothing but the device to look at (no peers, counters, racing owners
    /// or staged entries): completions the CQ translates itself go straight to `out`;
    /// the first that needs more (an error, an owner's, a suppressed one) hands the rest
    /// of the poll to [`Self::read_plain_rest`]. Inlined into `read`'s callers: one
    /// completion then costs the poll and its translation, no frame of its own.
    #[inline(always)]
    fn read_plain<E: FormatEntry>(&self, out: &mut [E]) -> Result<usize> {
        let mut batch = WcBatch::<POLL_BATCH>::new();
        let wcs = match self.cq.poll_batch(&mut batch, out.len()) {
            Ok(w) => w,
            Err(e) => return Err(poll_error(e)),
        };
        if wcs.is_empty() {
            return Err(no_completion());
        }
        // `poll_batch` returns at most `out.len()` completions (the `min` says so to the
        // compiler: no bounds check in the loop).
        let n = wcs.len().min(out.len());
        for i in 0..n {
            let (w, id) = (&wcs[i], wcs[i].wr_id());
            out[i] = if w.status() == st::IBV_WC_SUCCESS && wr_id::is_plain(id) {
                E::from_tagged(&to_entry(w))
            } else if w.status() == st::IBV_WC_SUCCESS && wr_id::is_bare(id, Kind::DgramPlain) {
                self.plain_ud_done.fetch_add(1, Ordering::Relaxed);
                E::from_tagged(&plain_ud_entry(w))
            } else {
                return self.read_plain_rest(wcs, i, out, i);
            };
        }
        Ok(n)
    }

    /// The plain loop; with `OWNED`, owners' completions are placed in it too (no reader
    /// races them: `plain_mask`), else they hand the rest of the poll to `translate`.
    /// Two copies, so the plain path of CQs without peers keeps its small frame.
    #[inline(always)]
    fn read_plain_impl<const OWNED: bool, E: FormatEntry>(&self, out: &mut [E]) -> Result<usize> {
        let mut batch = WcBatch::<POLL_BATCH>::new();
        let wcs = self
            .cq
            .poll_batch(&mut batch, out.len())
            .map_err(os_err("ibv_poll_cq"))?;
        let mut n = 0;
        // Completions an owner took without an entry (a send buffer freed, a suppressed
        // one): the device may hold more behind them.
        let mut taken = false;
        for (i, w) in wcs.iter().enumerate() {
            let id = w.wr_id();
            let e = if w.status() != st::IBV_WC_SUCCESS {
                return self.read_plain_rest(wcs, i, out, n);
            } else if wr_id::is_plain(id) {
                to_entry(w)
            } else if wr_id::is_bare(id, Kind::DgramPlain) {
                self.plain_ud_done.fetch_add(1, Ordering::Relaxed);
                plain_ud_entry(w)
            } else if OWNED && wr_id::is_owned(id) {
                match self.owned_inline(w) {
                    Some(Owned::Entry(e, _)) => e,
                    Some(Owned::Errors(v)) => return self.read_plain_errors(v, wcs, i, n),
                    None => {
                        taken = true;
                        continue;
                    }
                }
            } else {
                return self.read_plain_rest(wcs, i, out, n);
            };
            out[n] = E::from_tagged(&e);
            n += 1;
        }
        if n > 0 {
            Ok(n)
        } else if OWNED && taken {
            self.read_general(out, None, false)
        } else {
            Err(Error::new(errno::EAGAIN, "no completion"))
        }
    }

    /// An owner's error entries for `wcs[i]` in a plain read (`n` entries written): staged
    /// with the rest of the poll behind them.
    #[cold]
    #[inline(never)]
    fn read_plain_errors(
        &self,
        v: Vec<CqErrEntry>,
        wcs: &[WorkCompletion],
        i: usize,
        n: usize,
    ) -> Result<usize> {
        if self.stage_owned_errors(v, &wcs[i + 1..]) {
            self.to_peers(&wcs[i + 1..]);
        }
        if n > 0 {
            Ok(n)
        } else {
            Err(Error::new(
                errno::EAVAIL,
                "an error completion is at the head: read it with readerr",
            ))
        }
    }

    /// The rest of a plain read's poll from `wcs[i]` on, `n` entries already written.
    #[cold]
    #[inline(never)]
    fn read_plain_rest<E: FormatEntry>(
        &self,
        wcs: &[WorkCompletion],
        i: usize,
        out: &mut [E],
        n: usize,
    ) -> Result<usize> {
        let order = self.order();
        let (m, peers) = self.translate(&wcs[i..], &mut out[n..], None);
        drop(order);
        if peers {
            self.to_peers(&wcs[i..]);
        }
        if n + m > 0 {
            return Ok(n + m);
        }
        // Only suppressed or staged completions: the general read goes on from here.
        self.read_general(out, None, false)
    }

    /// `fi_cq_readfrom`: as [`Self::read`], with each entry's source address in `src`
    /// (`FI_ADDR_NOTAVAIL` where unknown: always on connected endpoints).
    pub fn readfrom<E: FormatEntry>(&self, out: &mut [E], src: &mut [u64]) -> Result<usize> {
        self.check_format::<E>()?;
        if src.len() < out.len() {
            return Err(Error::new(
                errno::EINVAL,
                "the source address array is shorter than the entry array",
            ));
        }
        self.read_impl(out, Some(src))
    }

    /// The general read: peers, staged entries, owners, counters.
    #[inline]
    fn read_impl<E: FormatEntry>(&self, out: &mut [E], src: Option<&mut [u64]>) -> Result<usize> {
        self.read_general(out, src, true)
    }

    /// [`Self::read_impl`], driving the peers unless `drive` is false (the caller has).
    /// Kept out of line so that `read`'s plain path carries none of its registers or stack.
    #[inline(never)]
    fn read_general<E: FormatEntry>(
        &self,
        out: &mut [E],
        mut src: Option<&mut [u64]>,
        drive: bool,
    ) -> Result<usize> {
        if self.has(feature::FD_ASLEEP) {
            self.fd_woke();
        }
        if drive && self.has(feature::PEERS) && self.peers_due() {
            let n = self.drive_peers_for(out, src.as_deref_mut());
            if n > 0 {
                return Ok(n);
            }
        }
        if self.staged.load(Ordering::Acquire) != 0 {
            let n = self.read_staged(out, src.as_deref_mut())?;
            if n > 0 {
                return Ok(n);
            }
        }
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            let (n, polled) = if out.len() == 1 {
                self.poll_into::<1, E>(out, src.as_deref_mut())?
            } else {
                self.poll_into::<POLL_BATCH, E>(out, src.as_deref_mut())?
            };
            if n > 0 {
                return Ok(n);
            }
            // Only suppressed completions, or none: poll again while the device gave some.
            if polled == 0 || self.staged.load(Ordering::Acquire) != 0 {
                break;
            }
        }
        if self.overran.load(Ordering::Acquire) && self.staged.load(Ordering::Acquire) == 0 {
            return Err(self.enter_overrun());
        }
        Err(if self.staged.load(Ordering::Acquire) != 0 {
            Error::new(
                errno::EAVAIL,
                "an error completion is at the head: read it with readerr",
            )
        } else {
            Error::new(errno::EAGAIN, "no completion")
        })
    }

    /// The device overran and has given all it kept: the software queue enters the
    /// overrun state (every read from now on says `FI_EOVERRUN`).
    #[cold]
    fn enter_overrun(&self) -> Error {
        let mut s = self.state();
        s.mark_overrun();
        self.overran.store(false, Ordering::Release);
        self.set_staged(s.pending(), Ordering::Release);
        Error::new(
            errno::EOVERRUN,
            "completion queue overrun: the device dropped completions that did not fit",
        )
    }

    fn read_staged<E: FormatEntry>(&self, out: &mut [E], src: Option<&mut [u64]>) -> Result<usize> {
        let mut s = self.state();
        let r = s.read_into(out, src);
        self.set_staged(s.pending(), Ordering::Release);
        r
    }

    /// Polls the device into `out`; returns (entries written, completions polled).
    #[inline]
    fn poll_into<const N: usize, E: FormatEntry>(
        &self,
        out: &mut [E],
        src: Option<&mut [u64]>,
    ) -> Result<(usize, usize)> {
        let mut batch = WcBatch::<N>::new();
        let order = self.order();
        let wcs = self
            .cq
            .poll_batch(&mut batch, out.len())
            .map_err(os_err("ibv_poll_cq"))?;
        if self.has(feature::COUNTERS) {
            self.count(wcs);
        }
        let (n, peers) = self.translate(wcs, out, src);
        drop(order);
        if peers {
            self.to_peers(wcs);
        }
        Ok((n, wcs.len()))
    }

    /// Writes polled completions into `out`, staging from the first error on; returns the
    /// entries written and whether peers' transfers are among them (delivered by the
    /// caller once the order lock is released: their callbacks may read this CQ).
    #[inline(always)]
    fn translate<E: FormatEntry>(
        &self,
        wcs: &[WorkCompletion],
        out: &mut [E],
        mut src: Option<&mut [u64]>,
    ) -> (usize, bool) {
        let mut n = 0;
        let mut peers = false;
        for (i, w) in wcs.iter().enumerate() {
            if wr_id::is_peer(w.wr_id()) {
                peers = true;
                continue;
            }
            if w.status() != st::IBV_WC_SUCCESS {
                return (n, self.stage(&wcs[i..]) || peers);
            }
            // Owners see every completion of theirs (they count and track them) and apply
            // the suppression themselves.
            let (entry, from) = if wr_id::is_owned(w.wr_id()) {
                match self.owned(w) {
                    Some(Owned::Entry(e, from)) => (e, from),
                    Some(Owned::Errors(v)) => {
                        // Staged behind: the rest of this poll follows it there.
                        return (n, self.stage_owned_errors(v, &wcs[i + 1..]) || peers);
                    }
                    None => continue,
                }
            } else if wr_id::is_kind(w.wr_id(), Kind::DgramPlain) {
                match self.plain_ud_entry(w) {
                    Some(e) => (e, FI_ADDR_NOTAVAIL),
                    None => continue,
                }
            } else if wr_id::is_suppressed(w.wr_id()) {
                continue;
            } else {
                (to_entry(w), FI_ADDR_NOTAVAIL)
            };
            out[n] = E::from_tagged(&entry);
            if let Some(s) = src.as_deref_mut() {
                s[n] = from;
            }
            n += 1;
        }
        (n, peers)
    }

    /// Delivers the peers' transfers among `wcs`, in order (no CQ lock held).
    #[cold]
    fn to_peers(&self, wcs: &[WorkCompletion]) {
        for w in wcs.iter().filter(|w| wr_id::is_peer(w.wr_id())) {
            self.to_peer(w);
        }
    }

    /// Stages polled completions behind anything already staged, except peers'
    /// transfers; returns whether there were any (for the caller to deliver).
    #[cold]
    fn stage(&self, wcs: &[WorkCompletion]) -> bool {
        let mut peers = false;
        let mut s = self.state();
        for w in wcs {
            if wr_id::is_peer(w.wr_id()) {
                peers = true;
            } else if wr_id::is_kind(w.wr_id(), Kind::DgramPlain)
                && w.status() == st::IBV_WC_SUCCESS
            {
                if let Some(e) = self.plain_ud_entry(w) {
                    if let Err(e) = s.push_entry(e) {
                        crate::fi_warn!("cq", "{e}");
                    }
                }
            } else if wr_id::is_owned(w.wr_id()) {
                let r = match self.owned(w) {
                    Some(Owned::Entry(e, from)) => s.push_entry_from(e, from),
                    Some(Owned::Errors(v)) => v.into_iter().try_for_each(|e| s.push_error(e)),
                    None => Ok(()),
                };
                if let Err(e) = r {
                    crate::fi_warn!("cq", "{e}");
                }
            } else {
                stage_one(&mut s, w);
            }
        }
        self.set_staged(s.pending(), Ordering::SeqCst);
        peers
    }

    #[cold]
    fn stage_owned_errors(&self, v: Vec<CqErrEntry>, rest: &[WorkCompletion]) -> bool {
        {
            let mut s = self.state();
            if let Err(err) = v.into_iter().try_for_each(|e| s.push_error(e)) {
                crate::fi_warn!("cq", "{err}");
            }
            self.set_staged(s.pending(), Ordering::SeqCst);
        }
        self.stage(rest)
    }

    /// A plain datagram receive's entry (none when suppressed): the payload's length, after
    /// the GRH slot. Counted for its endpoint's view of its receive queue.
    #[inline]
    fn plain_ud_entry(&self, w: &WorkCompletion) -> Option<CqEntry> {
        self.plain_ud_done.fetch_add(1, Ordering::Relaxed);
        if wr_id::is_suppressed(w.wr_id()) {
            return None;
        }
        Some(plain_ud_entry(w))
    }

    /// A datagram endpoint asks to have its plain receives reported by the CQ (one per
    /// CQ): true when granted, until [`Self::release_plain_ud`].
    pub(crate) fn claim_plain_ud(&self) -> bool {
        let granted = self
            .plain_ud
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if granted {
            // Counted afresh for the new endpoint, whose count of posts starts at 0.
            self.plain_ud_done.store(0, Ordering::Relaxed);
        }
        granted
    }

    pub(crate) fn release_plain_ud(&self) {
        self.plain_ud.store(false, Ordering::Release);
    }

    /// Plain datagram receives reported so far.
    #[inline]
    pub(crate) fn plain_ud_done(&self) -> u64 {
        self.plain_ud_done.load(Ordering::Relaxed)
    }

    /// The entry for a completion whose endpoint places it (`wr_id::is_owned`).
    fn owned(&self, w: &WorkCompletion) -> Option<Owned> {
        self.owned_inline(w)
    }

    /// `owned`, in the plain read's own frame: a call less per owned completion (under TCG
    /// a call and its return end translated blocks).
    #[inline(always)]
    fn owned_inline(&self, w: &WorkCompletion) -> Option<Owned> {
        let owner = match wr_id::owner_key(w.wr_id()) {
            Some(k) => match self.first_keyed.get() {
                Some((first, o))
                    if *first == k && self.first_keyed_live.load(Ordering::Acquire) =>
                {
                    o.upgrade()
                }
                _ => self.keyed_owner(k),
            },
            None => self
                .owners
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(&w.qp_num())
                .and_then(Weak::upgrade),
        };
        match owner {
            Some(o) => o.recv_completion(w),
            None => {
                crate::fi_debug!("cq", "a completion of a closed endpoint dropped");
                None
            }
        }
    }

    /// The keyed owner of `k` from the registry.
    fn keyed_owner(&self, k: u32) -> Option<Arc<dyn RecvOwner>> {
        self.keyed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(key, _)| *key == k)
            .and_then(|(_, o)| o.upgrade())
    }

    /// Whether this read drives the peers: every read while one needs or asks for it,
    /// else one in `PEER_POLL_EVERY`.
    #[inline]
    fn peers_due(&self) -> bool {
        if self.peers_always.load(Ordering::Relaxed) != 0
            || self.peers_wanted.load(Ordering::Relaxed) != 0
        {
            return true;
        }
        // A plain load and store: a count lost to a race only shifts the next call.
        let t = self.peer_tick.load(Ordering::Relaxed);
        self.peer_tick.store(t.wrapping_add(1), Ordering::Relaxed);
        t % PEER_POLL_EVERY == 0
    }

    /// A peer asks for every read to drive it (`true`) until it says so no more (`false`,
    /// once per `true`).
    pub(crate) fn want_progress(&self, on: bool) {
        if on {
            self.peers_wanted.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = self
                .peers_wanted
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// Drives the peers that share this CQ; their completions land in the staged queue.
    fn progress_peers(&self) {
        self.progress_peers_into(None)
    }

    /// Drives the peers for a read into `out` (and `src`): what they complete on this CQ
    /// goes straight there while nothing is staged ahead of it. The entries written.
    #[inline(always)]
    fn drive_peers_for<E: FormatEntry>(&self, out: &mut [E], src: Option<&mut [u64]>) -> usize {
        if self.staged.load(Ordering::Acquire) != 0 || out.is_empty() {
            self.progress_peers();
            return 0;
        }
        let mut o = ReadOut { out, src, n: 0 };
        self.progress_peers_into(Some(&mut ReadSink {
            cq: self,
            out: &mut o,
        }));
        o.n
    }

    /// Calls `f` on each peer still alive, with no lock held (a peer may read or write this
    /// CQ from what `f` calls).
    #[inline(always)]
    fn for_each_peer(&self, mut f: impl FnMut(&dyn PeerProgress)) {
        let peers = Arc::clone(&self.peer_list.read().unwrap_or_else(|p| p.into_inner()).0);
        for p in peers.iter() {
            f(&**p);
        }
    }

    /// [`Self::progress_peers`], with the reader's `sink` for what they complete here.
    #[inline(always)]
    fn progress_peers_into(&self, mut sink: Option<&mut ReadSink<'_>>) {
        self.for_each_peer(|p| p.progress(self, sink.as_deref_mut()));
    }

    /// Adds a peer provider (or an RDM endpoint) whose progress reads of this CQ drive (at
    /// most `MAX_PEERS`): every read if `every_read`, else as `peers_due` says.
    pub(crate) fn add_peer(&self, peer: Weak<dyn PeerProgress>, every_read: bool) -> Result<()> {
        let mut v = self.peers.write().unwrap_or_else(|p| p.into_inner());
        v.retain(|(w, _)| w.strong_count() > 0);
        if v.len() == MAX_PEERS {
            return Err(Error::new(
                errno::ENOSPC,
                format!("a CQ drives {MAX_PEERS} peer providers and RDM endpoints at most: bind the next one to another CQ"),
            ));
        }
        v.push((peer, every_read));
        let old = self.peers_changed(&v);
        drop(v);
        drop(old);
        Ok(())
    }

    /// Removes a peer added with [`Self::add_peer`] (and any that are gone).
    pub(crate) fn remove_peer(&self, peer: &Weak<dyn PeerProgress>) {
        let mut v = self.peers.write().unwrap_or_else(|p| p.into_inner());
        v.retain(|(w, _)| w.strong_count() > 0 && !Weak::ptr_eq(w, peer));
        let old = self.peers_changed(&v);
        drop(v);
        // The removed peer may go with the old list: not under the locks (its drop may
        // call this CQ).
        drop(old);
    }

    /// Publishes the peers `v` holds (the live ones); returns the list it replaced, for
    /// the caller to drop once it has let go of `peers`.
    #[must_use]
    fn peers_changed(&self, v: &[(Weak<dyn PeerProgress>, bool)]) -> PeerList {
        let list: Vec<_> = v.iter().filter_map(|(w, _)| w.upgrade()).collect();
        let old = std::mem::replace(
            &mut *self.peer_list.write().unwrap_or_else(|p| p.into_inner()),
            PeerList(Arc::from(list)),
        );
        let always = v.iter().filter(|(_, a)| *a).count() as u32;
        self.peers_always.store(always, Ordering::SeqCst);
        self.peers_total.store(v.len() as u32, Ordering::SeqCst);
        self.set(feature::PEERS, !v.is_empty());
        old
    }

    /// A blocked read also wakes when `fd` is readable (an RDM endpoint's connection
    /// events), and then drives the peers. Returns whether the CQ has a descriptor to wait
    /// on (`FI_WAIT_FD`/`UNSPEC`); without one, blocked reads keep waking to drive peers.
    pub(crate) fn add_wait_fd(&self, fd: BorrowedFd<'_>) -> Result<bool> {
        self.watch_fd(fd, &self.peer_fds)
    }

    /// Puts a peer's `fd` in the wait set (a readable one drives the peers), counted in
    /// `count`; false when the CQ has no descriptor to wait on.
    fn watch_fd(&self, fd: BorrowedFd<'_>, count: &AtomicU32) -> Result<bool> {
        let (epoll, flags) = match &self.waiter {
            Some(Waiter::Fd { epoll, .. }) => (epoll, EpollFlags::EPOLLIN),
            // The notifier thread only signals: edge-triggered, it wakes once per event
            // and leaves the reading to the sleeper it woke.
            Some(Waiter::MutexCond { epoll, .. }) => {
                (&**epoll, EpollFlags::EPOLLIN | EpollFlags::EPOLLET)
            }
            None => return Ok(false),
        };
        epoll
            .add(fd, EpollEvent::new(flags, PEER_FD_TOKEN))
            .map_err(nix_err("epoll_ctl"))?;
        count.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    /// Undoes [`Self::watch_fd`].
    fn unwatch_fd(&self, fd: BorrowedFd<'_>, count: &AtomicU32) {
        let epoll = match &self.waiter {
            Some(Waiter::Fd { epoll, .. }) => Some(epoll),
            Some(Waiter::MutexCond { epoll, .. }) => Some(&**epoll),
            None => None,
        };
        if let Some(epoll) = epoll {
            if epoll.delete(fd).is_ok() {
                let _ =
                    count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            }
        }
    }

    /// The descriptor a counter's `FI_WAIT_FD` nests (its readiness is this CQ's: device
    /// completions once armed, software ones, connection events), if the CQ has one.
    pub(crate) fn epoll_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.waiter {
            Some(Waiter::Fd { epoll, .. }) => Some(epoll.0.as_fd()),
            _ => None,
        }
    }

    /// Before a counter's application blocks on its descriptor: as `fi_trywait` on the
    /// CQ, the counter checking what moved.
    pub(crate) fn arm_for_counter(&self) -> Result<()> {
        self.prepare_fd_wait()
    }

    /// A blocked read also wakes when a peer's bell (`rfabric_sys::bell`, or another CQ's
    /// completion channel that the peer arms) is readable, and then drives the peers; such a
    /// peer says, each time a thread goes to sleep, whether its bells are enough
    /// (`PeerProgress::sleeping`). False without a descriptor to wait on.
    pub(crate) fn add_bell_fd(&self, fd: BorrowedFd<'_>) -> Result<bool> {
        self.watch_fd(fd, &self.bells)
    }

    /// Undoes [`Self::add_bell_fd`].
    pub(crate) fn remove_bell_fd(&self, fd: BorrowedFd<'_>) {
        self.unwatch_fd(fd, &self.bells)
    }

    /// Tells the peers a thread sleeps (`on`) or woke; how many said their bell will wake it.
    fn peers_sleeping(&self, on: bool) -> u32 {
        let peers = Arc::clone(&self.peer_list.read().unwrap_or_else(|p| p.into_inner()).0);
        peers.iter().map(|p| u32::from(p.sleeping(self, on))).sum()
    }

    /// Undoes [`Self::add_wait_fd`].
    pub(crate) fn remove_wait_fd(&self, fd: BorrowedFd<'_>) {
        self.unwatch_fd(fd, &self.peer_fds)
    }

    /// Whether a blocked read must wake now and then to drive peers that have no
    /// descriptor of their own to wake it, or that asked to be driven on every read
    /// (`belled` of those have a bell that wakes it instead).
    fn peers_need_polling(&self, belled: u32) -> bool {
        self.has(feature::PEERS)
            && (self.peers_always.load(Ordering::Relaxed) > belled
                || self.peers_wanted.load(Ordering::Relaxed) != 0
                || self.peers_total.load(Ordering::Relaxed) > self.peer_fds.load(Ordering::Relaxed))
    }

    /// Hands a peer's transfer completion to its sink, or drops it once the link is closed.
    #[cold]
    fn to_peer(&self, w: &WorkCompletion) {
        let sink = self
            .transfers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(q, _)| *q == w.qp_num())
            .and_then(|(_, s)| s.upgrade());
        let Some(sink) = sink else {
            // Its link is closed: the peer's work never reaches the application's CQ.
            crate::fi_info!("cq", "a completion of a closed peer transfer link dropped");
            return;
        };
        if w.status() == st::IBV_WC_SUCCESS {
            sink.completion(Ok(to_entry(w)), FI_ADDR_NOTAVAIL);
        } else {
            sink.completion(Err(to_err_entry(w)), FI_ADDR_NOTAVAIL);
        }
    }

    /// Routes the completions of peers' transfers on queue pair `qp_num` to `sink`.
    pub(crate) fn register_transfer(&self, qp_num: u32, sink: Weak<dyn PeerTransferSink>) {
        let mut v = self.transfers.write().unwrap_or_else(|p| p.into_inner());
        v.retain(|(q, s)| *q != qp_num && s.strong_count() > 0);
        v.push((qp_num, sink));
    }

    pub(crate) fn unregister_transfer(&self, qp_num: u32) {
        let mut v = self.transfers.write().unwrap_or_else(|p| p.into_inner());
        v.retain(|(q, s)| *q != qp_num && s.strong_count() > 0);
    }

    /// Routes the owned completions of queue pair `qp_num` to `owner`.
    pub(crate) fn register_owner(&self, qp_num: u32, owner: Weak<dyn RecvOwner>) {
        let mut v = self.owners.write().unwrap_or_else(|p| p.into_inner());
        v.insert(qp_num, owner);
        self.set(feature::OWNERS, true);
    }

    /// Routes the owned completions whose work requests carry `key` (`wr_id::keyed`) to
    /// `owner`.
    pub(crate) fn register_keyed_owner(&self, key: u32, owner: Weak<dyn RecvOwner>) {
        let v = self.owners.read().unwrap_or_else(|p| p.into_inner());
        let mut k = self.keyed.write().unwrap_or_else(|p| p.into_inner());
        k.retain(|(_, o)| o.strong_count() > 0);
        if self.first_keyed.set((key, owner.clone())).is_ok() {
            self.first_keyed_live.store(true, Ordering::Release);
        }
        k.push((key, owner));
        self.set(feature::OWNERS, true);
        drop(v);
    }

    pub(crate) fn unregister_keyed_owner(&self, key: u32) {
        let v = self.owners.read().unwrap_or_else(|p| p.into_inner());
        let mut k = self.keyed.write().unwrap_or_else(|p| p.into_inner());
        if self
            .first_keyed
            .get()
            .is_some_and(|(first, _)| *first == key)
        {
            self.first_keyed_live.store(false, Ordering::Release);
        }
        k.retain(|(x, o)| *x != key && o.strong_count() > 0);
        self.set(feature::OWNERS, !v.is_empty() || !k.is_empty());
    }

    /// Held across a poll and its owners' translation while owners exist (see `ordered`),
    /// unless the threading level already keeps readers apart.
    #[inline]
    fn order(&self) -> Option<MutexGuard<'_, ()>> {
        (!self.serial && self.has(feature::OWNERS))
            .then(|| self.ordered.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn unregister_owner(&self, qp_num: u32) {
        let mut v = self.owners.write().unwrap_or_else(|p| p.into_inner());
        v.remove(&qp_num);
        v.retain(|_, o| o.strong_count() > 0);
        let k = self.keyed.read().unwrap_or_else(|p| p.into_inner());
        // With the last owner gone, reads take no lock again.
        self.set(feature::OWNERS, !v.is_empty() || !k.is_empty());
    }

    /// Moves device completions into the software queue, in order, until the flush of the
    /// work request `marker` appears or `timeout` passes. Returns whether it appeared.
    /// Polls busily at first (the flush is usually done at once), then every 50 µs: shutdown
    /// is not a fast path, and a spin there burns a CPU for as long as the device takes.
    pub(crate) fn flush_until(&self, marker: u64, timeout: Duration) -> Result<bool> {
        let deadline = std::time::Instant::now() + timeout;
        for polls in 0u32.. {
            if self.stage_device(Some(marker))? {
                return Ok(true);
            }
            if polls >= 64 {
                if std::time::Instant::now() > deadline {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(false)
    }

    /// Moves every completion the device holds now into the software queue, in order.
    /// Returns whether one of them was the work request `watch` (with no `watch`: whether
    /// there were any).
    fn stage_device(&self, watch: Option<u64>) -> Result<bool> {
        let mut batch = WcBatch::<POLL_BATCH>::new();
        let mut seen = false;
        loop {
            let order = self.order();
            let wcs = self
                .cq
                .poll_batch(&mut batch, POLL_BATCH)
                .map_err(os_err("ibv_poll_cq"))?;
            if wcs.is_empty() {
                return Ok(seen);
            }
            if self.has(feature::COUNTERS) {
                self.count(wcs);
            }
            seen |= watch.is_none_or(|m| wcs.iter().any(|w| w.wr_id() == m));
            let peers = self.stage(wcs);
            drop(order);
            if peers {
                self.to_peers(wcs);
            }
        }
    }

    /// Moves what the device holds into the software queue, translating owned
    /// completions: an endpoint bound to this CQ and another drives this one from reads of
    /// the other (its operations complete here, but their work may be needed there).
    pub(crate) fn drive(&self) {
        match self.stage_device(None) {
            // What it staged wakes this CQ's own sleeper if another CQ's sleeper consumed
            // the device's events (`rearm`); else those events wake it.
            Ok(true)
                if self.staged.load(Ordering::SeqCst) != 0
                    && (self.sleepers.load(Ordering::SeqCst) != 0
                        || self.events_taken.swap(false, Ordering::SeqCst)) =>
            {
                self.wake(false)
            }
            Ok(_) => {}
            Err(e) => crate::fi_warn!("cq", "{e}"),
        }
    }

    /// Consumes its completion channel's events and arms it for the next completion: a
    /// sleeper on another CQ whose wait set holds this channel (an RDM endpoint's other CQ)
    /// wakes then, and drives this one.
    pub(crate) fn rearm(&self) -> Result<()> {
        if let Some(ch) = self.cq.channel() {
            if ch.drain() > 0 {
                // This CQ's own waiter may have missed them: what is staged wakes it, now
                // and at the next `drive`.
                self.events_taken.store(true, Ordering::SeqCst);
                if self.staged.load(Ordering::SeqCst) != 0 {
                    self.wake(false);
                }
            }
        }
        self.arm()
    }

    /// Counts polled completions into the counters of the endpoints they belong to.
    #[cold]
    fn count(&self, wcs: &[WorkCompletion]) {
        let m = self.counters.read().unwrap_or_else(|p| p.into_inner());
        for w in wcs {
            if let Some(c) = m.get(&w.qp_num()) {
                c.count(w);
            }
        }
    }

    /// Counts the completions of queue pair `qp_num` into `cntrs` from now on.
    pub(crate) fn register_counters(&self, qp_num: u32, cntrs: Arc<EpCounters>) {
        let mut m = self.counters.write().unwrap_or_else(|p| p.into_inner());
        m.insert(qp_num, cntrs);
        self.set(feature::COUNTERS, true);
    }

    pub(crate) fn unregister_counters(&self, qp_num: u32) {
        let mut m = self.counters.write().unwrap_or_else(|p| p.into_inner());
        m.remove(&qp_num);
        self.set(feature::COUNTERS, !m.is_empty());
    }

    /// What a read of or a wait on a counter this CQ feeds does to it: drives its peers
    /// and moves what the device holds into the software queue (counting it there).
    /// Returns whether the device held anything.
    pub(crate) fn drive_for_counters(&self) -> Result<bool> {
        if self.has(feature::PEERS) {
            self.progress_peers();
        }
        self.stage_device(None)
    }

    /// Whether a read would find something now (`fi_poll`): the peers driven, and what
    /// the device holds moved to the software queue, so that the read finds it there.
    pub(crate) fn has_events(&self) -> Result<bool> {
        if self.has(feature::PEERS) {
            self.progress_peers();
        }
        self.stage_device(None)?;
        Ok(self.staged.load(Ordering::SeqCst) != 0 || self.overran.load(Ordering::SeqCst))
    }

    /// Whether blocking waits can sleep on this CQ (it has a wait object other than
    /// `FI_WAIT_YIELD`).
    pub(crate) fn has_wait_object(&self) -> bool {
        self.waiter.is_some()
    }

    /// Sleeps up to `left` for the device (the CQ armed first): a counter's wait. Entries
    /// already in the software queue, which a counter does not read, do not cut it short.
    pub(crate) fn sleep_for_device(&self, left: Duration) -> Result<()> {
        let Some(w) = &self.waiter else {
            std::thread::yield_now();
            return Ok(());
        };
        let r = match w {
            Waiter::Fd { epoll, .. } => {
                let t = EpollTimeout::try_from(left).unwrap_or(EpollTimeout::MAX);
                match epoll.wait(&mut [EpollEvent::empty(); 4], t) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
                    Err(e) => Err(Error::os(e as i32, "epoll_wait on the CQ")),
                }
            }
            Waiter::MutexCond { mc, pending, .. } => {
                let mut g = mc.lock();
                if !pending.swap(false, Ordering::SeqCst) {
                    g.wait(Some(left));
                }
                Ok(())
            }
        };
        self.drain_wakeups(w);
        r
    }

    /// Software completions that can be inserted before the CQ overruns.
    #[inline]
    pub fn room(&self) -> usize {
        // Nothing staged: all of it (at least its size at open; it only grows), unlocked.
        if self.staged.load(Ordering::Acquire) == 0 {
            return self.soft_min;
        }
        self.state().room()
    }

    /// Inserts a completion produced in software (a protocol's, or a peer's through
    /// `fid_peer_cq` owner ops `write`), after any already queued, and wakes waiters.
    pub fn write(&self, entry: CqEntry, src: u64) -> Result<()> {
        {
            let mut s = self.state();
            s.push_entry_from(entry, src)?;
            self.set_staged(s.pending(), Ordering::SeqCst);
        }
        self.wake(false);
        Ok(())
    }

    /// [`Self::write`] from the progress a read of a CQ drives: into that reader's `sink`
    /// when it reads this CQ, has room and nothing is staged ahead of the entry (no wake:
    /// the reader takes it), else as `write`.
    #[inline]
    pub fn write_via(
        &self,
        sink: Option<&mut ReadSink<'_>>,
        entry: CqEntry,
        src: u64,
    ) -> Result<()> {
        if let Some(s) = sink {
            if std::ptr::eq(s.cq, self)
                && self.staged.load(Ordering::Acquire) == 0
                && s.out.put(&entry, src)
            {
                return Ok(());
            }
        }
        self.write(entry, src)
    }

    /// Inserts a software error completion (owner ops `writeerr`) and wakes waiters.
    pub fn writeerr(&self, entry: CqErrEntry) -> Result<()> {
        {
            let mut s = self.state();
            s.push_error(entry)?;
            self.set_staged(s.pending(), Ordering::SeqCst);
        }
        self.wake(false);
        Ok(())
    }

    fn wake(&self, always: bool) {
        match &self.waiter {
            Some(Waiter::Fd {
                event, external, ..
            }) if always || *external || self.sleepers.load(Ordering::SeqCst) > 0 => {
                if let Err(e) = event.arm() {
                    crate::fi_warn!("cq", "eventfd write: {e}");
                }
            }
            Some(Waiter::Fd { .. }) => {}
            // The application may wait on the pair itself: always broadcast (cheap without waiters).
            Some(Waiter::MutexCond { mc, pending, .. }) => {
                let _g = mc.lock();
                pending.store(true, Ordering::SeqCst);
                mc.broadcast();
            }
            None => {}
        }
    }

    /// The head error completion (`fi_cq_readerr`); `EAGAIN` when the head is not an error.
    pub fn readerr(&self) -> Result<CqErrEntry> {
        let mut s = self.state();
        let r = s
            .readerr()
            .ok_or_else(|| Error::new(errno::EAGAIN, "no error completion at the head"));
        self.set_staged(s.pending(), Ordering::Release);
        r
    }

    /// `fi_cq_readerr` with the man page's two ways for error data: copied into
    /// `caller_buf` (truncated to fit), or, without a buffer, returned as provider-owned
    /// bytes valid until the next read. `f` sees the entry and where its data went.
    pub fn readerr_with<T>(
        &self,
        caller_buf: Option<&mut [u8]>,
        f: impl FnOnce(&CqErrEntry, ErrData<'_>) -> T,
    ) -> Result<T> {
        let mut s = self.state();
        let r = match s.readerr_with(caller_buf) {
            Some((e, d)) => Ok(f(&e, d)),
            None => Err(Error::new(errno::EAGAIN, "no error completion at the head")),
        };
        self.set_staged(s.pending(), Ordering::Release);
        r
    }

    /// `fi_cq_strerror`: the text of a provider errno (an `ibv_wc_status`).
    pub fn strerror(&self, prov_errno: i32) -> &'static str {
        wc_status_str(prov_errno.max(0) as u32)
    }

    fn require_wait(&self) -> Result<()> {
        match self.attr.wait_obj {
            WaitObj::None => Err(Error::new(
                errno::EINVAL,
                "blocking reads need a wait object: this CQ was opened with FI_WAIT_NONE",
            )),
            // fi_cq(3): invalid with FI_WAIT_NONE or FI_WAIT_SET.
            WaitObj::Set => Err(Error::new(
                errno::EINVAL,
                "fi_cq_sread on a CQ of a wait set: wait on the set (fi_wait), then read",
            )),
            _ => Ok(()),
        }
    }

    /// Puts the CQ (opened with `FI_WAIT_SET`) in `set`.
    pub fn join(self: &Arc<Self>, set: &crate::verbs::WaitSet) -> Result<()> {
        match (&self.waiter, self.attr.wait_obj) {
            (Some(Waiter::Fd { epoll, .. }), WaitObj::Set) => {
                let me: Weak<dyn crate::verbs::wait::WaitMember> = Arc::downgrade(self) as _;
                set.join(&[epoll.0.as_fd()], me)
            }
            _ => Err(Error::new(
                errno::EINVAL,
                "only a CQ opened with FI_WAIT_SET joins a wait set",
            )),
        }
    }

    /// `fi_cq_sread`: waits up to `timeout_ms` (negative: forever) for completions. With
    /// `FI_CQ_COND_THRESHOLD`, `cond` is how many to wait for. `EAGAIN` on timeout or
    /// when [`Self::signal`] wakes it.
    pub fn sread<E: FormatEntry>(
        &self,
        out: &mut [E],
        cond: usize,
        timeout_ms: i32,
    ) -> Result<usize> {
        self.check_format::<E>()?;
        self.require_wait()?;
        let threshold = if self.attr.wait_cond == CqWaitCond::Threshold {
            cond
        } else {
            1
        };
        core_cq::sread(self, out, None, threshold, timeout_ms)
    }

    /// `fi_cq_sreadfrom`.
    pub fn sreadfrom<E: FormatEntry>(
        &self,
        out: &mut [E],
        src: &mut [u64],
        cond: usize,
        timeout_ms: i32,
    ) -> Result<usize> {
        self.check_format::<E>()?;
        self.require_wait()?;
        if src.len() < out.len() {
            return Err(Error::new(
                errno::EINVAL,
                "the source address array is shorter than the entry array",
            ));
        }
        let threshold = if self.attr.wait_cond == CqWaitCond::Threshold {
            cond
        } else {
            1
        };
        core_cq::sread(self, out, Some(src), threshold, timeout_ms)
    }

    /// `fi_cq_signal`: wakes a thread blocked in `sread`, which returns `EAGAIN`.
    pub fn signal(&self) {
        self.signaled.store(true, Ordering::SeqCst);
        self.wake(true);
    }

    /// The descriptor of an `FI_WAIT_FD` CQ (`fi_control(FI_GETWAIT)`), usable in
    /// poll/epoll. Call [`Self::trywait`] before blocking on it.
    pub fn wait_fd(&self) -> Result<BorrowedFd<'_>> {
        match (&self.waiter, self.attr.wait_obj) {
            (Some(Waiter::Fd { epoll, .. }), WaitObj::Fd) => Ok(epoll.0.as_fd()),
            _ => Err(Error::new(
                errno::EINVAL,
                format!(
                    "FI_GETWAIT needs FI_WAIT_FD; this CQ has {:?}",
                    self.attr.wait_obj
                ),
            )),
        }
    }

    /// The mutex and condition variable of an `FI_WAIT_MUTEX_COND` CQ
    /// (`fi_control(FI_GETWAIT)`). Call [`Self::trywait`] before waiting on them.
    pub fn wait_mutex_cond(&self) -> Result<&MutexCond> {
        match &self.waiter {
            Some(Waiter::MutexCond { mc, .. }) => Ok(mc),
            _ => Err(Error::new(
                errno::EINVAL,
                format!(
                    "this CQ's wait object is {:?}, not FI_WAIT_MUTEX_COND",
                    self.attr.wait_obj
                ),
            )),
        }
    }

    /// `fi_trywait`: prepares the wait object for blocking. `EAGAIN` means completions
    /// are ready (read them instead of waiting).
    pub fn trywait(&self) -> Result<()> {
        let Some(w) = &self.waiter else {
            return Err(Error::new(
                errno::EINVAL,
                "this CQ has no wait object to wait on",
            ));
        };
        if let Waiter::MutexCond { peer_event, .. } = w {
            self.drain_wakeups(w);
            self.cq.req_notify().map_err(os_err("ibv_req_notify_cq"))?;
            if self.has(feature::PEERS) {
                // Its notifier watches the peers' descriptors and bells: they are told,
                // as for a descriptor's sleeper (the application times its own wait), and
                // driven, which takes what their descriptors said.
                peer_event.store(false, Ordering::SeqCst);
                self.peers_to_sleep();
            }
            self.stage_device(None)?;
        } else {
            self.prepare_fd_wait()?;
        }
        if self.staged.load(Ordering::SeqCst) != 0 {
            return Err(Error::new(
                errno::EAGAIN,
                "completions are ready: read them before waiting",
            ));
        }
        Ok(())
    }

    /// Readies the descriptor for an application about to block on it (`fi_trywait`, a
    /// counter's): consumes the wake-ups seen so far, arms the device, tells the peers
    /// (their bells ring from now on) and drives them once, moves completions that came
    /// before the arm to the software queue (they would never notify), and sets the timer
    /// that wakes it to drive peers with no descriptor here, as `sread`'s sleeper wakes.
    fn prepare_fd_wait(&self) -> Result<()> {
        let Some(w @ Waiter::Fd { epoll, timer, .. }) = &self.waiter else {
            return self.arm();
        };
        self.drain_wakeups(w);
        self.cq.req_notify().map_err(os_err("ibv_req_notify_cq"))?;
        let mut poll = None;
        if self.has(feature::PEERS) {
            let belled = self.peers_to_sleep();
            poll = self.peer_poll(belled);
        }
        self.stage_device(None)?;
        if let Some(d) = poll {
            let t = match timer.get() {
                Some(t) => t,
                None => {
                    let t = TimerFd::new(
                        ClockId::CLOCK_MONOTONIC,
                        TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
                    )
                    .map_err(nix_err("timerfd_create"))?;
                    epoll
                        .add(&t, EpollEvent::new(EpollFlags::EPOLLIN, TIMER_TOKEN))
                        .map_err(nix_err("epoll_ctl"))?;
                    timer.get_or_init(|| t)
                }
            };
            t.set(
                Expiration::OneShot(TimeSpec::from_duration(d)),
                TimerSetTimeFlags::empty(),
            )
            .map_err(nix_err("timerfd_settime"))?;
        }
        Ok(())
    }

    /// The application is about to sleep on the wait object itself (`fi_trywait`): the
    /// peers with a bell hear it (once until its next read, `fd_woke`), and are driven
    /// once, taking events already on their descriptors. How many said their bell wakes it.
    fn peers_to_sleep(&self) -> u32 {
        let belled = {
            let mut asleep = self.fd_sleep.lock().unwrap_or_else(|p| p.into_inner());
            let (told, n) = match *asleep {
                Some(t) => t,
                None if self.bells.load(Ordering::Relaxed) != 0 => {
                    (true, self.peers_sleeping(true))
                }
                None => (false, 0),
            };
            *asleep = Some((told, n));
            self.set(feature::FD_ASLEEP, true);
            n
        };
        self.for_each_peer(|p| p.fd_woke());
        self.progress_peers();
        belled
    }

    /// The application's first read after `fi_trywait`: the peers hear it woke (a local
    /// sender stops ringing).
    #[cold]
    #[inline(never)]
    fn fd_woke(&self) {
        let mut asleep = self.fd_sleep.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((true, _)) = asleep.take() {
            self.peers_sleeping(false);
        }
        self.set(feature::FD_ASLEEP, false);
    }

    /// How long a sleeper may wait before it must drive the peers (`None`: until woken),
    /// `belled` of them having said their bell wakes it.
    fn peer_poll(&self, belled: u32) -> Option<Duration> {
        // Peers progress only when driven and have no wait object here: wake to drive them.
        const PEER_POLL: Duration = Duration::from_millis(1);
        // With bells, a slow look still: a sender that cannot reach the bell (another
        // network namespace) delays a message by this at most, never holds it.
        const BELL_POLL: Duration = Duration::from_millis(50);
        if self.peers_need_polling(belled) {
            Some(PEER_POLL)
        } else if belled != 0 {
            Some(BELL_POLL)
        } else {
            None
        }
    }

    fn drain_wakeups(&self, w: &Waiter) {
        if let Some(ch) = self.cq.channel() {
            ch.drain();
        }
        match w {
            Waiter::Fd { event, timer, .. } => {
                let _ = event.read(); // EAGAIN when not written: nothing to drain.
                if let Some(t) = timer.get() {
                    // Disarming also clears an expiry not read yet (timerfd_settime).
                    let _ = t.unset();
                }
            }
            Waiter::MutexCond { pending, .. } => pending.store(false, Ordering::SeqCst),
        }
    }

    /// `fi_close` on a CQ: `EBUSY` while endpoints are bound to it. Resources go when the
    /// last handle is dropped.
    pub fn close(&self) -> Result<()> {
        let n = self.bound.load(Ordering::Acquire);
        if n > 0 {
            return Err(Error::new(
                errno::EBUSY,
                format!("{n} bindings (endpoints, poll sets) still use this CQ: close the endpoints and fi_poll_del it first"),
            ));
        }
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn bind(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(errno::EINVAL, "this CQ was closed"));
        }
        self.bound.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    pub(crate) fn unbind(&self) {
        self.bound.fetch_sub(1, Ordering::AcqRel);
    }

    /// Promises `n` more device entries to a queue pair, growing the CQ when needed, so
    /// the device queue can never overflow.
    pub(crate) fn reserve(&self, n: u32) -> Result<()> {
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let want = r.saturating_add(n);
        if want > self.cq.capacity() {
            if want > self.max_cqe {
                return Err(Error::new(
                    errno::ENOSPC,
                    format!("binding needs {want} CQ entries, over the device's max_cqe {}: use smaller tx/rx sizes or another CQ", self.max_cqe),
                ));
            }
            self.cq.resize(want).map_err(os_err("ibv_resize_cq"))?;
            self.state().grow_to(self.cq.capacity() as usize);
            crate::fi_info!(
                "cq",
                "grew CQ to {} entries for its endpoints",
                self.cq.capacity()
            );
        }
        *r = want;
        Ok(())
    }

    pub(crate) fn release(&self, n: u32) {
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        *r = r.saturating_sub(n);
    }

    pub(crate) fn raw(&self) -> &Cq {
        &self.cq
    }
}

impl crate::verbs::wait::WaitMember for CompletionQueue {
    fn try_wait(&self) -> Result<()> {
        self.trywait()
    }
}

impl Waitable for CompletionQueue {
    fn try_read<E: FormatEntry>(&self, out: &mut [E], src: Option<&mut [u64]>) -> Result<usize> {
        self.read_impl(out, src)
    }

    fn arm(&self) -> Result<()> {
        if self.waiter.is_some() {
            self.cq.req_notify().map_err(os_err("ibv_req_notify_cq"))?;
        }
        Ok(())
    }

    fn sleep(&self, timeout: Option<Duration>) -> Result<()> {
        // Peers with a bell here hear from now on that we sleep, then are driven once more:
        // what came before they knew is seen now, what comes after rings.
        let belling = self.bells.load(Ordering::Relaxed) != 0 && self.has(feature::PEERS);
        let belled = if belling {
            let n = self.peers_sleeping(true);
            self.progress_peers();
            n
        } else {
            0
        };
        let poll = self.peer_poll(belled);
        let timeout = match (timeout, poll) {
            (Some(t), Some(p)) => Some(t.min(p)),
            (t, p) => t.or(p),
        };
        let r = self.sleep_on(timeout);
        if belling {
            self.peers_sleeping(false);
        }
        r
    }

    fn take_signal(&self) -> bool {
        self.signaled.swap(false, Ordering::SeqCst)
    }
}

impl CompletionQueue {
    /// Blocks on the wait object (`sleep` without the peers' bells).
    fn sleep_on(&self, timeout: Option<Duration>) -> Result<()> {
        let Some(w) = &self.waiter else {
            std::thread::yield_now(); // FI_WAIT_YIELD
            return Ok(());
        };
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // A software completion staged before we counted ourselves would not wake us.
        let idle =
            || self.staged.load(Ordering::SeqCst) == 0 && !self.signaled.load(Ordering::SeqCst);
        let r = match w {
            Waiter::Fd { epoll, .. } if idle() => {
                let t = match timeout {
                    None => EpollTimeout::NONE,
                    Some(d) => EpollTimeout::try_from(d).unwrap_or(EpollTimeout::MAX),
                };
                let mut events = [EpollEvent::empty(); 4];
                match epoll.wait(&mut events, t) {
                    Ok(n) => {
                        // A peer's event (a connection request): drive the peers now,
                        // whatever the read count says.
                        if events[..n].iter().any(|e| e.data() == PEER_FD_TOKEN) {
                            self.for_each_peer(|p| p.fd_woke());
                            self.progress_peers();
                        }
                        Ok(())
                    }
                    Err(nix::errno::Errno::EINTR) => Ok(()),
                    Err(e) => Err(Error::os(e as i32, "epoll_wait on the CQ")),
                }
            }
            Waiter::MutexCond {
                mc,
                pending,
                peer_event,
                ..
            } => {
                {
                    let mut g = mc.lock();
                    if !pending.swap(false, Ordering::SeqCst)
                        && !peer_event.load(Ordering::SeqCst)
                        && idle()
                    {
                        g.wait(timeout);
                    }
                }
                // As the descriptor's sleeper: a peer's event is taken now.
                if peer_event.swap(false, Ordering::SeqCst) {
                    self.for_each_peer(|p| p.fd_woke());
                    self.progress_peers();
                }
                Ok(())
            }
            Waiter::Fd { .. } => Ok(()),
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        self.drain_wakeups(w);
        r
    }

    /// How many times blocked reads (`sread`) came back from the wait object, woken or
    /// timed out: a diagnostic of how often a sleeping reader looks (every millisecond while
    /// peers without a descriptor or bell need driving).
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_with_immediate_data_becomes_remote_cq_data() {
        let wc = WorkCompletion::new(7, st::IBV_WC_SUCCESS, op::IBV_WC_RECV, 64, Some(0xfeed));
        let e = to_entry(&wc);
        assert_eq!(e.op_context, 7);
        assert_eq!(e.flags(), Flags::MSG | Flags::RECV | Flags::REMOTE_CQ_DATA);
        assert_eq!((e.len, e.data), (64, 0xfeed));
    }

    #[test]
    fn sends_report_no_length_and_rma_gets_its_own_flags() {
        let s = to_entry(&WorkCompletion::new(
            1,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_SEND,
            99,
            None,
        ));
        assert_eq!((s.flags(), s.len), (Flags::MSG | Flags::SEND, 0));
        let w = to_entry(&WorkCompletion::new(
            2,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_RDMA_WRITE,
            0,
            None,
        ));
        assert_eq!(w.flags(), Flags::RMA | Flags::WRITE);
        let r = to_entry(&WorkCompletion::new(
            3,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_RECV_RDMA_WITH_IMM,
            8,
            Some(1),
        ));
        assert_eq!(
            r.flags(),
            Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA
        );
    }

    #[test]
    fn an_initiators_completion_with_immediate_data_is_no_remote_cq_data() {
        // rxe sets IBV_WC_WITH_IMM on the sender's side of a send or write with immediate.
        for (o, f) in [
            (op::IBV_WC_SEND, Flags::MSG | Flags::SEND),
            (op::IBV_WC_RDMA_WRITE, Flags::RMA | Flags::WRITE),
        ] {
            let e = to_entry(&WorkCompletion::new(4, st::IBV_WC_SUCCESS, o, 0, Some(3)));
            assert_eq!(e.flags(), f, "opcode {o}");
            assert_eq!(
                e.data, 0,
                "opcode {o}: an initiator's immediate data is not CQ data"
            );
        }
    }

    #[test]
    fn opcodes_without_a_libfabric_meaning_carry_no_flags() {
        for o in [
            op::IBV_WC_COMP_SWAP,
            op::IBV_WC_TSO,
            9,
            op::IBV_WC_TM_ADD,
            137,
            144,
            256,
            16,
        ] {
            let e = to_entry(&WorkCompletion::new(4, st::IBV_WC_SUCCESS, o, 5, None));
            assert_eq!((e.flags, e.len), (0, 0), "opcode {o}");
        }
    }

    #[test]
    fn plain_kinds_are_what_the_cq_translates_alone() {
        use wr_id::Kind;
        for k in [
            Kind::Send,
            Kind::SendData,
            Kind::Recv,
            Kind::Marker,
            Kind::Write,
            Kind::Read,
        ] {
            assert!(wr_id::is_plain(wr_id::encode(77, k, false)), "{k:?}");
            assert!(
                !wr_id::is_plain(wr_id::encode(77, k, true)),
                "{k:?} suppressed"
            );
            assert!(
                !wr_id::is_plain(wr_id::encode(77, k, false) | wr_id::PEER),
                "{k:?} peer"
            );
        }
        for k in [
            Kind::MultiRecv,
            Kind::DgramRecv,
            Kind::DgramShort,
            Kind::RdmRecv,
            Kind::RdmSend,
            Kind::RdmRead,
            Kind::DgramPlain,
        ] {
            assert!(!wr_id::is_plain(wr_id::encode(77, k, false)), "{k:?}");
        }
        assert!(wr_id::is_bare(
            wr_id::encode(1, Kind::DgramPlain, false),
            Kind::DgramPlain
        ));
        assert!(!wr_id::is_bare(
            wr_id::encode(1, Kind::DgramPlain, true),
            Kind::DgramPlain
        ));
    }

    #[test]
    fn failed_completions_map_to_libfabric_errnos() {
        let cases = [
            (st::IBV_WC_WR_FLUSH_ERR, errno::ECANCELED),
            (st::IBV_WC_LOC_LEN_ERR, errno::ETRUNC),
            (st::IBV_WC_REM_ACCESS_ERR, errno::EACCES),
            (st::IBV_WC_RETRY_EXC_ERR, errno::ETIMEDOUT),
            (st::IBV_WC_RNR_RETRY_EXC_ERR, errno::ECONNREFUSED),
            (st::IBV_WC_GENERAL_ERR, errno::EIO),
        ];
        for (status, err) in cases {
            let e = to_err_entry(&WorkCompletion::new(9, status, 0, 0, None));
            assert_eq!((e.op_context, e.err, e.prov_errno), (9, err, status as i32));
        }
    }
}
