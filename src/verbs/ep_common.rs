//! What every verbs endpoint has: its CQ and counter bindings, how its sends are signalled, and the
//! checks and translations of its data calls (flags, ranges, immediate data, full queues).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rfabric_sys::verbs::{
    send_flags, Chain, ChainLink, DeviceAttr, MrSlice, QpCaps, QpHandle, Sge, MAX_IOV,
};

use crate::core::cq::CqErrEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::info::Info;
use crate::verbs::cntr::{Counter, EpCounters};
use crate::verbs::{wr_id, CompletionQueue, Domain, MemoryRegion};

/// The completion queues an endpoint is bound to, and the device entries it reserved in
/// them (released, with the bindings, when it goes).
#[derive(Debug, Default)]
pub(crate) struct CqBinding {
    pub(crate) tx_cq: Option<Arc<CompletionQueue>>,
    pub(crate) rx_cq: Option<Arc<CompletionQueue>>,
    pub(crate) reserved: (u32, u32),
    /// Counters bound for each direction, and the queue pair whose completions the CQs
    /// count into them once it exists (`count_on`).
    cntrs: EpCounters,
    counted_qp: Option<u32>,
}

impl CqBinding {
    /// Reserves `tx` and `rx` entries in the bound CQs (they grow to cover them).
    pub(crate) fn reserve(&mut self, tx: u32, rx: u32) -> Result<()> {
        let (Some(t), Some(r)) = (&self.tx_cq, &self.rx_cq) else {
            return Err(Error::new(
                errno::ENOCQ,
                "bind a CQ for FI_TRANSMIT and one for FI_RECV (they may be the same) before enabling",
            ));
        };
        t.reserve(tx)?;
        if let Err(e) = r.reserve(rx) {
            t.release(tx);
            return Err(e);
        }
        self.reserved = (tx, rx);
        Ok(())
    }

    /// Gives back what `reserve` took (after a failed enable).
    pub(crate) fn unreserve(&mut self) {
        let (tx, rx) = std::mem::take(&mut self.reserved);
        if let Some(t) = &self.tx_cq {
            t.release(tx);
        }
        if let Some(r) = &self.rx_cq {
            r.release(rx);
        }
    }
}

impl CqBinding {
    /// `fi_ep_bind` of a counter for the directions in `flags`.
    pub(crate) fn bind_cntr(
        &mut self,
        cntr: &Arc<Counter>,
        flags: Flags,
        rma_event: bool,
    ) -> Result<()> {
        self.cntrs.bind(cntr, flags, rma_event)
    }

    /// The counters bound so far.
    pub(crate) fn cntrs(&self) -> &EpCounters {
        &self.cntrs
    }

    /// Once queue pair `qp_num` exists: the CQs count its completions into the bound
    /// counters, whose reads drive those CQs.
    pub(crate) fn count_on(&mut self, qp_num: u32) {
        if self.cntrs.is_empty() {
            return;
        }
        let cntrs = Arc::new(self.cntrs.clone());
        for cq in [&self.tx_cq, &self.rx_cq].into_iter().flatten() {
            cq.register_counters(qp_num, cntrs.clone());
            for c in self.cntrs.all() {
                c.feed_from(cq);
            }
        }
        self.counted_qp = Some(qp_num);
    }
}

impl Drop for CqBinding {
    fn drop(&mut self) {
        self.unreserve();
        for cq in [&self.tx_cq, &self.rx_cq].into_iter().flatten() {
            if let Some(q) = self.counted_qp {
                cq.unregister_counters(q);
            }
            cq.unbind();
        }
        for c in self.cntrs.all() {
            c.unbind();
        }
    }
}

/// `FI_SELECTIVE_COMPLETION` per direction, and the bound on unsignalled sends.
#[derive(Debug)]
pub(crate) struct Signalling {
    /// How sends are signalled: `tx_mode::*` bits, one load per send.
    tx_mode: AtomicU8,
    rx_selective: AtomicBool,
    /// Unsignalled sends left before the next signalled one: counted down, so that the send
    /// queue (whose entries a signalled completion frees) never fills with unsignalled work.
    credit: AtomicI32,
    /// Unsignalled sends allowed in a row: half the send queue, less one (the signalled
    /// send ends the run), set at enable ([`Self::set_tx_depth`]).
    run: AtomicI32,
    /// The same for sends with the endpoint's default flags, fixed at enable
    /// ([`Self::fix_default`]): a run of 0 when each is signalled. Two runs of half the
    /// queue less one leave a signalled send in every `depth - 1`, so the queue never
    /// fills with unsignalled work.
    default_credit: AtomicI32,
    default_run: AtomicI32,
    /// What a signalled default send's id carries: `SUPPRESSED` unless it is reported.
    default_mark: AtomicU64,
}

impl Default for Signalling {
    fn default() -> Self {
        Signalling {
            tx_mode: AtomicU8::new(0),
            rx_selective: AtomicBool::new(false),
            credit: AtomicI32::new(0),
            run: AtomicI32::new(0),
            default_credit: AtomicI32::new(0),
            default_run: AtomicI32::new(0),
            default_mark: AtomicU64::new(0),
        }
    }
}

/// Bits of [`Signalling`]'s `tx_mode`.
mod tx_mode {
    /// `FI_SELECTIVE_COMPLETION` on the transmit binding.
    pub(super) const SELECTIVE: u8 = 1;
    /// A counter counts sends, reads or writes: every one is signalled (its completion
    /// suppressed when no CQ entry is due), so the CQ can count it.
    pub(super) const COUNTED: u8 = 2;
}

impl Signalling {
    /// `fi_ep_bind` of a CQ for `FI_TRANSMIT` and/or `FI_RECV` (with
    /// `FI_SELECTIVE_COMPLETION`), into `c`, on an endpoint not yet `enabled`.
    pub(crate) fn bind_cq(
        &self,
        c: &mut CqBinding,
        cq: &Arc<CompletionQueue>,
        flags: Flags,
        enabled: bool,
    ) -> Result<()> {
        let dirs = flags & (Flags::TRANSMIT | Flags::RECV);
        if dirs.is_empty()
            || !(flags - (Flags::TRANSMIT | Flags::RECV | Flags::SELECTIVE_COMPLETION)).is_empty()
        {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("CQ bind flags {flags:?}: use FI_TRANSMIT and/or FI_RECV"),
            ));
        }
        let selective = flags.contains(Flags::SELECTIVE_COMPLETION);
        if enabled {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "bind CQs before enabling the endpoint",
            ));
        }
        if (dirs.contains(Flags::TRANSMIT) && c.tx_cq.is_some())
            || (dirs.contains(Flags::RECV) && c.rx_cq.is_some())
        {
            return Err(Error::new(
                errno::EINVAL,
                "a CQ is already bound for that direction",
            ));
        }
        if dirs.contains(Flags::TRANSMIT) {
            cq.bind()?;
            c.tx_cq = Some(cq.clone());
            self.set_tx_mode(tx_mode::SELECTIVE, selective);
        }
        if dirs.contains(Flags::RECV) {
            if let Err(e) = cq.bind() {
                if let Some(tx) = c.tx_cq.take().filter(|_| dirs.contains(Flags::TRANSMIT)) {
                    tx.unbind();
                }
                return Err(e);
            }
            c.rx_cq = Some(cq.clone());
            self.rx_selective.store(selective, Ordering::Release);
        }
        Ok(())
    }

    /// `fi_ep_bind` of a counter for the directions in `flags`, into `c`, on an endpoint
    /// not yet `enabled`.
    pub(crate) fn bind_cntr(
        &self,
        c: &mut CqBinding,
        cntr: &Arc<Counter>,
        flags: Flags,
        enabled: bool,
    ) -> Result<()> {
        if enabled {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "bind counters before enabling the endpoint",
            ));
        }
        // RMA events are RDM's only (an RC write leaves its target no trace to count).
        c.bind_cntr(cntr, flags, false)?;
        self.set_tx_mode(tx_mode::COUNTED, c.cntrs.counts_transmits());
        Ok(())
    }

    pub(crate) fn rx_selective(&self) -> bool {
        self.rx_selective.load(Ordering::Relaxed)
    }

    /// Whether a receive posted with `flags` completes unseen (selective, no `FI_COMPLETION`).
    #[inline]
    pub(crate) fn recv_suppressed(&self, flags: Flags) -> bool {
        self.rx_selective() && !flags.contains(Flags::COMPLETION)
    }

    fn set_tx_mode(&self, bit: u8, on: bool) {
        if on {
            self.tx_mode.fetch_or(bit, Ordering::Release);
        } else {
            self.tx_mode.fetch_and(!bit, Ordering::Release);
        }
    }

    /// The send queue's depth, granted at enable: it bounds unsignalled sends to half.
    pub(crate) fn set_tx_depth(&self, depth: u32) {
        let run = ((depth / 2).max(1) - 1).min(i32::MAX as u32) as i32;
        self.run.store(run, Ordering::Relaxed);
        self.credit.store(run, Ordering::Relaxed);
    }

    /// The work request id and signalling of a send: signalled when a completion is due
    /// (no selective completion, or `FI_COMPLETION` asked), else counted as unsignalled.
    #[inline(always)]
    pub(crate) fn send(&self, id: u64, flags: Flags) -> (u64, u32) {
        let mode = self.tx_mode.load(Ordering::Relaxed);
        if mode == tx_mode::SELECTIVE && !flags.contains(Flags::COMPLETION) {
            return self.next_unsignaled(id);
        }
        if mode & tx_mode::SELECTIVE == 0 || flags.contains(Flags::COMPLETION) {
            (id, send_flags::SIGNALED)
        } else {
            self.unsignaled_in(mode, id)
        }
    }

    /// Fixes how sends with the default flags `op_flags` are signalled, at enable (the
    /// bindings that decide it are made before, and the queue's depth is set).
    pub(crate) fn fix_default(&self, op_flags: Flags) {
        let mode = self.tx_mode.load(Ordering::Relaxed);
        let (run, mark) = if mode & tx_mode::SELECTIVE == 0 || op_flags.contains(Flags::COMPLETION)
        {
            (0, 0) // each signalled and reported
        } else if mode & tx_mode::COUNTED != 0 {
            (0, wr_id::SUPPRESSED) // each signalled for a counter
        } else {
            (self.run.load(Ordering::Relaxed), wr_id::SUPPRESSED)
        };
        self.default_run.store(run, Ordering::Relaxed);
        self.default_credit.store(run, Ordering::Relaxed);
        self.default_mark.store(mark, Ordering::Relaxed);
    }

    /// [`Self::send`] with the default flags given to [`Self::fix_default`].
    #[inline(always)]
    pub(crate) fn send_default(&self, id: u64) -> (u64, u32) {
        if self.default_credit.fetch_sub(1, Ordering::Relaxed) > 0 {
            return (id, 0);
        }
        self.default_credit
            .store(self.default_run.load(Ordering::Relaxed), Ordering::Relaxed);
        (
            id | self.default_mark.load(Ordering::Relaxed),
            send_flags::SIGNALED,
        )
    }

    /// The work request id and signalling of a send that reports no completion: every
    /// `depth / 2`-th one is signalled anyway (its completion suppressed) to free the queue,
    /// and every one while a counter counts it.
    #[inline]
    pub(crate) fn unsignaled(&self, id: u64) -> (u64, u32) {
        self.unsignaled_in(self.tx_mode.load(Ordering::Relaxed), id)
    }

    #[inline(always)]
    fn unsignaled_in(&self, mode: u8, id: u64) -> (u64, u32) {
        if mode & tx_mode::COUNTED != 0 {
            return (id | wr_id::SUPPRESSED, send_flags::SIGNALED);
        }
        self.next_unsignaled(id)
    }

    /// One send of an unsignalled run: the run's last is signalled (its completion
    /// suppressed) and starts the next run.
    #[inline(always)]
    fn next_unsignaled(&self, id: u64) -> (u64, u32) {
        if self.credit.fetch_sub(1, Ordering::Relaxed) > 0 {
            return (id, 0);
        }
        self.credit
            .store(self.run.load(Ordering::Relaxed), Ordering::Relaxed);
        (id | wr_id::SUPPRESSED, send_flags::SIGNALED)
    }
}

/// The queue pair capacities an endpoint asks for: its info's sizes (or those set with
/// `fi_setopt` before enable) within the device's limits, inline up to the inject size.
pub(crate) fn wanted_caps(
    info: &Info,
    dev: &DeviceAttr,
    tx_size: Option<usize>,
    rx_size: Option<usize>,
) -> QpCaps {
    QpCaps {
        max_send_wr: (tx_size.unwrap_or(info.tx_attr.size).max(1) as u32).min(dev.max_qp_wr),
        max_recv_wr: (rx_size.unwrap_or(info.rx_attr.size).max(1) as u32).min(dev.max_qp_wr),
        max_send_sge: (info.tx_attr.iov_limit.max(1) as u32).min(dev.max_sge),
        max_recv_sge: (info.rx_attr.iov_limit.max(1) as u32).min(dev.max_sge),
        max_inline_data: info.tx_attr.inject_size as u32,
    }
}

/// Work requests chained under `FI_MORE` for one queue, and the queue's gate: one word
/// that a post with the default flags loads to learn whether it may go straight to the
/// device (`Batch::plain`).
pub(crate) struct Batch<W: ChainLink> {
    chain: Mutex<Chain<W>>,
    /// The work request id bits of a plain post (its kind, in the top byte) with, in the
    /// low bits, the reasons it may not be plain (`gate::*`), each set and cleared alone.
    gate: AtomicU64,
}

/// The reasons a queue's posts may not go straight to the device (`Batch::gate`).
pub(crate) mod gate {
    /// Work requests are chained under `FI_MORE`: later posts queue behind them.
    pub(crate) const OPEN: u64 = 1;
    /// An `FI_MULTI_RECV` buffer is posted: receives queue behind it.
    pub(crate) const MULTI: u64 = 2;
    /// Not enabled yet, or the default flags never allow it (a fence, a chain, a shared
    /// receive context, multi-receive buffers by default).
    pub(crate) const OFF: u64 = 4;
    pub(super) const ANY: u64 = OPEN | MULTI | OFF;
}

/// Sends and receives chained under `FI_MORE`.
pub(crate) type SendBatch = Batch<rfabric_sys::rdma_sys::ibv_send_wr>;
pub(crate) type RecvBatch = Batch<rfabric_sys::rdma_sys::ibv_recv_wr>;

impl<W: ChainLink> Default for Batch<W> {
    fn default() -> Self {
        Batch {
            chain: Mutex::default(),
            gate: AtomicU64::new(gate::OFF),
        }
    }
}

impl<W: ChainLink> std::fmt::Debug for Batch<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("open", &self.is_open())
            .finish()
    }
}

/// The CQ an endpoint writes the failures of a refused chain to.
pub(crate) type FailureCq<'a> = &'a dyn Fn() -> Option<Arc<CompletionQueue>>;

impl<W: ChainLink> Batch<W> {
    #[inline]
    pub(crate) fn is_open(&self) -> bool {
        self.gate.load(Ordering::Acquire) & gate::OPEN != 0
    }

    /// The id bits of a post that may go straight to the device, or `None`: one load.
    #[inline(always)]
    pub(crate) fn plain(&self) -> Option<u64> {
        let g = self.gate.load(Ordering::Acquire);
        // The reasons are in the low byte: one test of it.
        if g as u8 & gate::ANY as u8 == 0 {
            Some(g)
        } else {
            None
        }
    }

    /// Lets plain posts through with id bits `base` (top byte only), at enable.
    pub(crate) fn open_plain(&self, base: u64) {
        debug_assert_eq!(base & !wr_id::KIND_BITS, 0);
        let _ = self
            .gate
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
                Some((g & gate::ANY & !gate::OFF) | base)
            });
    }

    /// Sets or clears one reason of `gate::*` (each has one owner that changes it).
    pub(crate) fn set_gate(&self, reason: u64, on: bool) {
        if on {
            self.gate.fetch_or(reason, Ordering::AcqRel);
        } else {
            self.gate.fetch_and(!reason, Ordering::AcqRel);
        }
    }

    /// Appends one work request with `push` (posting a full chain first), then posts the
    /// chain unless `more`.
    pub(crate) fn add(
        &self,
        qp: &QpHandle,
        more: bool,
        cq: FailureCq<'_>,
        push: impl FnOnce(&mut Chain<W>) -> Result<()>,
    ) -> Result<()> {
        let mut ch = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        if ch.is_full() {
            post_chained(qp, &mut ch, false, cq)?;
        }
        push(&mut ch)?;
        let r = if more {
            Ok(())
        } else {
            post_chained(qp, &mut ch, true, cq).inspect_err(|_| ch.pop())
        };
        self.set_gate(gate::OPEN, !ch.is_empty());
        r
    }

    /// Posts what waits, before an operation that must not pass it.
    pub(crate) fn ring(&self, qp: &QpHandle, cq: FailureCq<'_>) -> Result<()> {
        if !self.is_open() {
            return Ok(());
        }
        let mut ch = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        let r = post_chained(qp, &mut ch, false, cq);
        self.set_gate(gate::OPEN, !ch.is_empty());
        r
    }
}

/// Posts a chain. When the device takes only some, the rest stay chained for the next post
/// (after a full queue, `-FI_EAGAIN`); on any other failure they complete in error, so no
/// accepted operation is lost without a word. `own`: the newest entry is the caller's,
/// reported by the returned error instead.
fn post_chained<W: ChainLink>(
    qp: &QpHandle,
    ch: &mut Chain<W>,
    own: bool,
    cq: FailureCq<'_>,
) -> Result<()> {
    let what = if W::RECEIVE { "receive" } else { "send" };
    match qp.post_chain(ch) {
        Ok(()) => Ok(()),
        Err(e) if e == libc::ENOMEM || e == libc::EAGAIN => Err(post_error(e, what)),
        Err(e) => {
            abandon(
                cq().as_deref(),
                ch.pending().take(ch.len() - usize::from(own)),
                e,
            );
            ch.clear();
            Err(post_error(e, what))
        }
    }
}

/// Writes an error completion for each chained operation the device refused.
#[cold]
fn abandon(cq: Option<&CompletionQueue>, ids: impl Iterator<Item = u64>, e: i32) {
    for id in ids {
        let entry = CqErrEntry {
            op_context: wr_id::context(id),
            flags: wr_id::flags(id).bits(),
            err: errno::EIO,
            prov_errno: e,
            ..Default::default()
        };
        match cq {
            Some(cq) => {
                if let Err(err) = cq.writeerr(entry) {
                    crate::fi_warn!("ep", "chained operation lost: {err}");
                }
            }
            None => crate::fi_warn!("ep", "chained operation {id:#x} failed to post: errno {e}"),
        }
    }
}

#[inline(always)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Checks a receive's flags: `FI_COMPLETION`, `FI_MORE` and `extra` are understood;
/// `FI_CLAIM`, `FI_DISCARD` (and `FI_MULTI_RECV` unless in `extra`) need the software
/// receive engine of RDM endpoints: `EINVAL`; anything else: `EBADFLAGS`.
pub(crate) fn check_recv_flags(flags: Flags, extra: Flags) -> Result<()> {
    let refused = (Flags::CLAIM | Flags::DISCARD | Flags::MULTI_RECV) - extra;
    if flags.intersects(refused) {
        return Err(Error::new(
            errno::EINVAL,
            format!(
                "receive flags {:?} are not offered here (they need buffered receives)",
                flags & refused
            ),
        ));
    }
    let known = Flags::COMPLETION | Flags::MORE | extra;
    if !(flags - known - refused).is_empty() {
        return Err(Error::new(
            errno::EBADFLAGS,
            format!("receive flags {:?} are not supported", flags - known),
        ));
    }
    Ok(())
}

/// The element naming `len` bytes at `offset` of `mr`, a region of `domain`.
#[inline(always)]
pub(crate) fn region_sge(
    mr: &MemoryRegion,
    domain: &Arc<Domain>,
    offset: usize,
    len: usize,
) -> Result<Sge> {
    check_domain(mr, domain)?;
    mr.sys()
        .sge(offset, len)
        .ok_or_else(|| mr.range_error(offset, len))
}

/// Checks that `mr` is registered in `domain`.
#[inline]
pub(crate) fn check_domain(mr: &MemoryRegion, domain: &Arc<Domain>) -> Result<()> {
    if !Arc::ptr_eq(mr.domain(), domain) {
        return Err(Error::new(
            errno::EINVAL,
            "memory region belongs to another domain",
        ));
    }
    Ok(())
}

/// Runs `f` on the `rfabric-sys` view of an iov, every region checked to be `domain`'s.
/// The view is built on this frame and never moved: in an array of 4 when it fits (most
/// iovs name one range), else of `MAX_IOV`, whose copying alone costs more than a post.
#[inline(always)]
pub(crate) fn with_slices<'a, R>(
    domain: &Arc<Domain>,
    iov: &[Iov<'a>],
    f: impl FnOnce(&[MrSlice<'a>]) -> Result<R>,
) -> Result<R> {
    if iov.len() > MAX_IOV {
        return Err(Error::new(
            errno::EINVAL,
            format!("{} ranges exceed the iov limit {MAX_IOV}", iov.len()),
        ));
    }
    if iov.len() <= 4 {
        let a: [MrSlice<'a>; 4] = fill_slices(domain, iov)?;
        f(&a[..iov.len()])
    } else {
        let a: [MrSlice<'a>; MAX_IOV] = fill_slices(domain, iov)?;
        f(&a[..iov.len()])
    }
}

#[inline(always)]
fn fill_slices<'a, const N: usize>(
    domain: &Arc<Domain>,
    iov: &[Iov<'a>],
) -> Result<[MrSlice<'a>; N]> {
    let first = iov
        .first()
        .ok_or_else(|| Error::new(errno::EINVAL, "an empty iov"))?;
    let mut out = [MrSlice {
        mr: first.0.sys(),
        offset: 0,
        len: 0,
    }; N];
    for (o, (mr, offset, len)) in out.iter_mut().zip(iov) {
        check_domain(mr, domain)?;
        *o = MrSlice {
            mr: mr.sys(),
            offset: *offset,
            len: *len,
        };
    }
    Ok(out)
}

/// One range of a vectored operation: a region, an offset in it and a length.
pub type Iov<'a> = (&'a MemoryRegion, usize, usize);

pub(crate) fn iov_error(e: i32, what: &str, n: usize) -> Error {
    match e {
        libc::E2BIG => Error::new(
            errno::EINVAL,
            format!("{n} ranges exceed the endpoint's iov limit"),
        ),
        libc::EINVAL => Error::new(errno::EINVAL, "a range lies outside its memory region"),
        e => post_error(e, what),
    }
}

/// Flags a MSG endpoint's `sendmsg` understands.
const SEND_FLAGS: Flags = Flags::COMPLETION
    .union(Flags::INJECT)
    .union(Flags::REMOTE_CQ_DATA)
    .union(Flags::MORE)
    .union(Flags::FENCE)
    .union(Flags::INJECT_COMPLETE)
    .union(Flags::TRANSMIT_COMPLETE)
    .union(Flags::DELIVERY_COMPLETE);

/// Refuses an RMA operation in direction `dir` (`FI_READ` or `FI_WRITE`) to an endpoint
/// whose info's `caps` name no `FI_RMA`, or name directions without this one: its queue
/// pairs may not be set up for it.
#[inline]
pub(crate) fn check_rma_cap(caps: Flags, dir: Flags) -> Result<()> {
    let dirs = Flags::READ | Flags::WRITE | Flags::REMOTE_READ | Flags::REMOTE_WRITE;
    if caps.contains(Flags::RMA) && (caps.contains(dir) || !caps.intersects(dirs)) {
        return Ok(());
    }
    let name = if dir == Flags::READ {
        "FI_READ"
    } else {
        "FI_WRITE"
    };
    Err(Error::new(
        errno::EOPNOTSUPP,
        format!("the endpoint was opened without FI_RMA | {name} in its info's caps: ask fi_getinfo for them"),
    ))
}

pub(crate) fn check_send_flags(flags: Flags) -> Result<()> {
    if flags.contains(Flags::MULTICAST) {
        return Err(Error::new(
            errno::EINVAL,
            "FI_MULTICAST needs a DGRAM endpoint and a multicast address",
        ));
    }
    if flags.intersects(Flags::CLAIM | Flags::DISCARD) {
        return Err(Error::new(
            errno::EINVAL,
            "FI_CLAIM / FI_DISCARD apply to receives on endpoints with buffered receives",
        ));
    }
    if !(flags - SEND_FLAGS).is_empty() {
        return Err(Error::new(
            errno::EBADFLAGS,
            format!("send flags {:?} are not supported", flags - SEND_FLAGS),
        ));
    }
    Ok(())
}

/// The checks of a flagged send (`fi_sendmsg`): its flags, and its size under `FI_INJECT`.
pub(crate) fn check_sendmsg(flags: Flags, len: usize, inject_size: usize) -> Result<()> {
    check_send_flags(flags)?;
    if flags.contains(Flags::INJECT) {
        check_inject(len, inject_size)?;
    }
    Ok(())
}

/// The immediate data a send carries: `data` under `FI_REMOTE_CQ_DATA`.
#[inline]
pub(crate) fn send_imm(flags: Flags, data: u64) -> Result<Option<u32>> {
    if flags.contains(Flags::REMOTE_CQ_DATA) {
        cq_data(data).map(Some)
    } else {
        Ok(None)
    }
}

pub(crate) fn cq_data(data: u64) -> Result<u32> {
    u32::try_from(data).map_err(|_| {
        Error::new(
            errno::EINVAL,
            "remote CQ data exceeds cq_data_size (4 bytes)",
        )
    })
}

/// `FI_INJECT` payloads fit the inject size (`-FI_EINVAL` otherwise).
#[inline]
pub(crate) fn check_inject(len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(Error::new(
            errno::EINVAL,
            format!("{len} bytes exceed the inject size {max}: send without FI_INJECT"),
        ));
    }
    Ok(())
}

/// A failed post of one range of `mr`: `EINVAL` is the range outside the region.
#[cold]
pub(crate) fn region_post_error(
    e: i32,
    mr: &crate::verbs::MemoryRegion,
    offset: usize,
    len: usize,
    what: &str,
) -> Error {
    if e == libc::EINVAL {
        mr.range_error(offset, len)
    } else {
        post_error(e, what)
    }
}

/// A full work queue is `-FI_EAGAIN`: reading the CQ frees room.
#[cold]
pub(crate) fn post_error(e: i32, what: &str) -> Error {
    if e == libc::ENOMEM || e == libc::EAGAIN {
        // Static text: a full queue is routine on the data path, and allocates nothing.
        Error::new(
            errno::EAGAIN,
            if what == "receive" {
                "receive queue full: read the CQ to free room"
            } else {
                "send queue full: read the CQ to free room"
            },
        )
    } else {
        Error::os(e, format!("post {what}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Signals sends `n` times through `send`, returning which were signalled and which
    /// of those carried the suppression mark.
    fn run(n: usize, mut send: impl FnMut(u64) -> (u64, u32)) -> Vec<(bool, bool)> {
        (0..n as u64)
            .map(|i| {
                let (id, f) = send(i);
                (f & send_flags::SIGNALED != 0, wr_id::is_suppressed(id))
            })
            .collect()
    }

    #[test]
    fn default_sends_signal_one_in_half_the_queue_under_selective_completion() {
        let s = Signalling::default();
        s.set_tx_mode(tx_mode::SELECTIVE, true);
        s.set_tx_depth(8);
        s.fix_default(Flags::empty());
        let got = run(12, |i| s.send_default(i));
        // Runs of 3 unsignalled, then one signalled whose completion nobody asked for.
        let want: Vec<_> = (0..12).map(|i| (i % 4 == 3, i % 4 == 3)).collect();
        assert_eq!(got, want);
        // The flags-driven path counts its own run the same way.
        assert_eq!(run(12, |i| s.send(i, Flags::empty())), want);
    }

    #[test]
    fn default_sends_follow_completion_flags_counters_and_plain_binding() {
        // No selective completion: every send signalled and reported.
        let s = Signalling::default();
        s.set_tx_depth(8);
        s.fix_default(Flags::empty());
        assert!(run(6, |i| s.send_default(i))
            .iter()
            .all(|&x| x == (true, false)));
        // Selective, but FI_COMPLETION by default: the same.
        let s = Signalling::default();
        s.set_tx_mode(tx_mode::SELECTIVE, true);
        s.set_tx_depth(8);
        s.fix_default(Flags::COMPLETION);
        assert!(run(6, |i| s.send_default(i))
            .iter()
            .all(|&x| x == (true, false)));
        // Selective with a counter counting sends: each signalled, none reported.
        let s = Signalling::default();
        s.set_tx_mode(tx_mode::SELECTIVE | tx_mode::COUNTED, true);
        s.set_tx_depth(8);
        s.fix_default(Flags::empty());
        assert!(run(6, |i| s.send_default(i))
            .iter()
            .all(|&x| x == (true, true)));
        // A queue of one: each send signalled.
        let s = Signalling::default();
        s.set_tx_mode(tx_mode::SELECTIVE, true);
        s.set_tx_depth(1);
        s.fix_default(Flags::empty());
        assert!(run(4, |i| s.send_default(i))
            .iter()
            .all(|&x| x == (true, true)));
    }

    #[test]
    fn a_full_queue_is_eagain_with_static_text() {
        for (e, what) in [(libc::ENOMEM, "send"), (libc::EAGAIN, "receive")] {
            let err = post_error(e, what);
            assert_eq!(err.errno(), errno::EAGAIN);
            assert!(err.cause_is_static(), "{err}");
            assert!(err.to_string().starts_with(what), "{err}");
        }
        assert_eq!(post_error(libc::EINVAL, "send").errno(), errno::EINVAL);
    }
}
