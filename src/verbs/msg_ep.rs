//! Connected (`FI_EP_MSG`) endpoints on RC queue pairs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use rfabric_sys::cm::{CmId, CmQp, ACCEPT_PRIVATE_DATA_MAX, CONNECT_PRIVATE_DATA_MAX};
use rfabric_sys::verbs::{send_flags, MrSlice, QpCaps, QpHandle, Sge, WorkCompletion};

use crate::core::addr::{fill_name, sockaddr_bytes};
use crate::core::cq::CqErrEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpOpt, EpType, Flags};
use crate::core::info::Info;
use crate::verbs::cq::{Owned, PeerTransferSink, RecvOwner};
use crate::verbs::ep_common::{
    check_domain, check_inject, check_recv_flags, check_rma_cap, check_send_flags, check_sendmsg,
    cq_data, gate, iov_error, lock, post_error, region_post_error, region_sge, send_imm,
    wanted_caps, with_slices, CqBinding, Iov, RecvBatch, SendBatch, Signalling,
};
use crate::verbs::eq::{encode_cm_data, CmEndpoint, ConnRequest, Owner, CM_DATA_SIZE};
use crate::verbs::info::{resolve_route, route_on};
use crate::verbs::multi_recv::{MultiBuf, MultiRecvQueue, DEFAULT_MIN_MULTI_RECV};
use crate::verbs::wr_id::{self, Kind};
use crate::verbs::{
    os_err, CompletionQueue, Counter, Domain, EventQueue, MemoryRegion, ReservedAddress,
    SharedRxContext,
};
use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;

const IDLE: u8 = 0;
const CONNECTING: u8 = 1;
const CONNECTED: u8 = 2;
const LOCAL_SHUTDOWN: u8 = 3;
const PEER_SHUTDOWN: u8 = 4;

#[derive(Debug, Default)]
struct Control {
    /// `FI_OPT_TX_SIZE` / `FI_OPT_RX_SIZE` set before enable.
    tx_size: Option<usize>,
    rx_size: Option<usize>,
    /// The rdma_cm identifier until `enable` fixes it in `EpShared::id` (`fi_setname`
    /// replaces it meanwhile, under this lock).
    id: Option<CmId>,
    eq: Option<Arc<EventQueue>>,
    cqs: CqBinding,
    /// A connection of an RDM endpoint, which reserves CQ entries for all of its
    /// connections at once (its send buffers and its SRQ bound them).
    reserved_by_owner: bool,
    /// RDMA reads in flight either way (rdma_cm's initiator depth and responder
    /// resources); with none, the QP grants no remote read.
    rd_atomic: u8,
}

/// State shared between the endpoint and its event queue.
#[derive(Debug)]
pub(crate) struct EpShared {
    /// Dropped first: the QP goes before the CQs and PD it uses. Set by `enable`, with the
    /// QP it created; read without a lock from then on (the data path's queue pair).
    id: OnceLock<CmQp>,
    state: AtomicU8,
    /// `FI_SHUTDOWN` was written for this endpoint: once, whichever side disconnected.
    shutdown_reported: AtomicBool,
    caps: OnceLock<QpCaps>,
    /// The shared receive context receives come from, when one is bound.
    srx: OnceLock<Arc<SharedRxContext>>,
    /// `FI_SELECTIVE_COMPLETION` per direction and the bound on unsignalled sends.
    signalling: Signalling,
    /// Work requests chained under `FI_MORE`, and whether any wait (checked without the
    /// lock, so posts without `FI_MORE` pay nothing while no chain is open).
    sends: SendBatch,
    recvs: RecvBatch,
    /// `FI_MULTI_RECV` buffers and the receives behind them; `multi_active` says (without
    /// the lock) whether receives must queue there.
    multi: Mutex<MultiRecvQueue>,
    multi_active: AtomicBool,
    min_multi_recv: AtomicUsize,
    ctl: Mutex<Control>,
    max_msg_size: usize,
    info: Info,
    context: u64,
    domain: Arc<Domain>,
}

impl EpShared {
    /// The queue pair, once enabled.
    #[inline]
    fn qp(&self) -> Option<&QpHandle> {
        self.id.get().map(CmQp::qp)
    }

    /// Runs `f` on the rdma_cm identifier: the enabled one, or the one `ctl` holds before
    /// (the caller must not hold `ctl`).
    fn with_id<R>(&self, f: impl FnOnce(&CmId) -> R) -> R {
        if let Some(id) = self.id.get() {
            return f(id.id());
        }
        let c = self.ctl();
        match (self.id.get().map(CmQp::id), &c.id) {
            (Some(id), _) | (None, Some(id)) => f(id),
            (None, None) => unreachable!("an endpoint's identifier is in ctl until enable"),
        }
    }

    /// The endpoint's own work request context, unique among live endpoints (its address).
    fn token(&self) -> u64 {
        (self as *const Self as u64) & wr_id::CONTEXT
    }

    /// Receives in flight at most: the queue pair's receive depth.
    fn rx_depth(&self) -> usize {
        self.caps.get().map_or(0, |c| c.max_recv_wr as usize)
    }

    fn ctl(&self) -> MutexGuard<'_, Control> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether receives queue behind `FI_MULTI_RECV` buffers (under `multi`'s lock).
    fn set_multi_active(&self, on: bool) {
        self.multi_active.store(on, Ordering::Release);
        self.recvs.set_gate(gate::MULTI, on);
    }
}

impl CmEndpoint for EpShared {
    fn mark_connected(&self) {
        let _ =
            self.state
                .compare_exchange(CONNECTING, CONNECTED, Ordering::AcqRel, Ordering::Acquire);
        let _ = self
            .state
            .compare_exchange(IDLE, CONNECTED, Ordering::AcqRel, Ordering::Acquire);
        // rdma_cm leaves min_rnr_timer at 0, which is 655 ms: a sender that finds no
        // receive posted would stall that long. Ask for a short retry instead.
        if let Some(qp) = self.qp() {
            let code = min_rnr_timer();
            if let Err(e) = qp.set_min_rnr_timer(code) {
                crate::fi_debug!("ep", "min_rnr_timer {code} not set: errno {e}");
            }
        }
    }

    /// Records a disconnect, which rdma_cm reports on both sides whoever began it; true the
    /// first time, when `FI_SHUTDOWN` is due. libfabric's verbs provider reports it on both
    /// sides too, and applications wait for it after their own `fi_shutdown`.
    fn mark_disconnected(&self) -> bool {
        self.state.swap(PEER_SHUTDOWN, Ordering::AcqRel);
        !self.shutdown_reported.swap(true, Ordering::AcqRel)
    }

    fn disconnect_quietly(&self) {
        if let Err(e) = self.with_id(|i| i.disconnect()) {
            crate::fi_debug!(
                "ep",
                "rdma_disconnect after the peer's: {}",
                std::io::Error::from_raw_os_error(e)
            );
        }
    }
}

impl RecvOwner for EpShared {
    fn recv_completion(&self, wc: &WorkCompletion) -> Option<Owned> {
        let mut m = lock(&self.multi);
        let min = self.min_multi_recv.load(Ordering::Relaxed);
        let r = m.completion(self.qp(), wc, min);
        self.set_multi_active(!m.is_idle());
        r.map(|r| match r {
            Ok(e) => Owned::Entry(e, FI_ADDR_NOTAVAIL),
            Err(v) => Owned::Errors(v),
        })
    }
}

impl Drop for EpShared {
    fn drop(&mut self) {
        let qpn = self.qp().map(|q| q.qp_num());
        let c = self.ctl.get_mut().unwrap_or_else(|p| p.into_inner());
        let ident = self
            .id
            .get()
            .map(CmQp::id)
            .or(c.id.as_ref())
            .map(|i| i.ident());
        if let (Some(eq), Some(ident)) = (c.eq.take(), ident) {
            eq.unregister(ident);
        }
        // An RDM endpoint's connection: its owner keeps routing the QP's completions still
        // in the CQ, and unregisters it when it closes.
        if let (Some(cq), Some(q), false) = (&c.cqs.rx_cq, qpn, c.reserved_by_owner) {
            cq.unregister_owner(q);
        }
    }
}

/// RDMA reads in flight either way on a connection: none unless the endpoint's
/// capabilities include reads (fi_getinfo(3): `FI_RMA` alone means all four directions),
/// so a QP grants remote read only where the application asked for RMA; else as many as
/// the device allows (128 on rxe, as perftest uses: fewer keep a read window short).
fn rd_atomic(domain: &Domain, caps: Flags) -> u8 {
    let dirs = Flags::READ | Flags::WRITE | Flags::REMOTE_READ | Flags::REMOTE_WRITE;
    let reads = caps.intersects(Flags::READ | Flags::REMOTE_READ)
        || (caps.contains(Flags::RMA) && !caps.intersects(dirs));
    if !reads {
        return 0;
    }
    let a = &domain.device().attr;
    a.max_qp_rd_atom
        .min(a.max_qp_init_rd_atom)
        .clamp(1, u8::MAX.into()) as u8
}

impl MsgEndpoint {
    /// The QP's access flags: what a remote peer may do to it.
    pub fn qp_access_flags(&self) -> Result<u32> {
        self.qp()?.access_flags().map_err(os_err("ibv_query_qp"))
    }
}

/// `FI_RVERBS_MIN_RNR_TIMER`: the IB code of the receiver-not-ready delay (12 = 0.64 ms).
fn min_rnr_timer() -> u8 {
    crate::core::env::get_usize_or("FI_RVERBS_MIN_RNR_TIMER", 12)
        .ok()
        .filter(|v| *v <= 31)
        .unwrap_or(12) as u8
}

/// `FI_RVERBS_RETRY_COUNT`: transport retries (0-7) before a send to a peer that stopped
/// answering fails with `FI_ETIMEDOUT`. 7, as perftest and libfabric's verbs provider use;
/// rxe treats 7 as "forever", so on SoftRoCE a dead link fails RC only below 7.
fn retry_count() -> Result<u8> {
    match crate::core::env::get_usize_or("FI_RVERBS_RETRY_COUNT", 7)? {
        v @ 0..=7 => Ok(v as u8),
        v => Err(Error::new(
            errno::EINVAL,
            format!("FI_RVERBS_RETRY_COUNT={v}: the transport counts 0 to 7 retries"),
        )),
    }
}

/// One range of the peer's memory (`struct fi_rma_iov`): a virtual address in a region the
/// peer registered for remote access, a length, and the region's `fi_mr_key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmaIov {
    pub addr: u64,
    pub len: usize,
    pub key: u64,
}

impl RmaIov {
    /// The verbs rkey, once the range is known to hold the `len` bytes moved.
    pub(crate) fn check(&self, len: usize) -> Result<u32> {
        if len > self.len {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "{len} local bytes exceed the {}-byte remote range",
                    self.len
                ),
            ));
        }
        u32::try_from(self.key).map_err(|_| {
            Error::new(
                errno::EINVAL,
                format!(
                    "key {:#x} is not a key fi_mr_key gave (rverbs keys are 4 bytes)",
                    self.key
                ),
            )
        })
    }
}

/// A connected endpoint (`fi_endpoint` with `FI_EP_MSG`).
#[derive(Debug)]
pub struct MsgEndpoint {
    shared: Arc<EpShared>,
    /// `wr_id::PEER` on a peer provider's handle ([`Self::peer_transfer`]), else 0.
    peer: u64,
}

fn not_enabled() -> Error {
    Error::new(
        errno::EOPBADSTATE,
        "endpoint not enabled: bind its CQs and call enable first",
    )
}

impl MsgEndpoint {
    /// Opens an endpoint. With `info.handle` from an `FI_CONNREQ` event it is the accepting
    /// side of that request; otherwise `info.dest_addr` names the peer to connect to, from
    /// the address of the passive endpoint `info.handle` names, if it names one.
    /// `context` is reported as the `fid` of its events.
    pub fn open(domain: &Arc<Domain>, info: &Info, context: u64) -> Result<Self> {
        if info.ep_attr.ep_type != EpType::Msg && info.ep_attr.ep_type != EpType::Unspec {
            return Err(Error::new(
                errno::EINVAL,
                format!("{:?} info given to a MSG endpoint", info.ep_attr.ep_type),
            ));
        }
        let dest = || {
            info.dest_addr.ok_or_else(|| {
                Error::new(errno::EINVAL, "no destination: give fi_getinfo the server's node and service, or set dest_addr")
            })
        };
        let reserved = info
            .handle
            .as_ref()
            .and_then(|h| h.downcast_ref::<ReservedAddress>());
        let id = match (reserved, &info.handle) {
            (Some(reserved), _) => {
                let id = reserved.take().ok_or_else(|| {
                    Error::new(
                        errno::EINVAL,
                        "the passive endpoint's address was already given to an endpoint",
                    )
                })?;
                match dest().and_then(|dst| route_on(&id, None, &dst)) {
                    Ok(()) => id,
                    Err(e) => {
                        reserved.put_back(id);
                        return Err(e);
                    }
                }
            }
            (None, Some(h)) => h
                .clone()
                .downcast::<ConnRequest>()
                .map_err(|_| {
                    Error::new(
                        errno::EINVAL,
                        "info.handle is neither an rverbs connection request nor passive endpoint",
                    )
                })?
                .take()?,
            (None, None) => resolve_route(info.src_addr.as_ref(), &dest()?)?,
        };
        let dev = id.context().map(|c| c.name()).unwrap_or_default();
        if dev != domain.device().name {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "the peer is reached through {dev}, not this domain's {}",
                    domain.device().name
                ),
            ));
        }
        // One element of a work request carries at most 2^32 - 1 bytes.
        let max_msg_size = if info.ep_attr.max_msg_size == 0 {
            domain.device().port.max_msg_sz as usize
        } else {
            info.ep_attr.max_msg_size
        }
        .min(u32::MAX as usize);
        Ok(MsgEndpoint {
            peer: 0,
            shared: Arc::new(EpShared {
                id: OnceLock::new(),
                state: AtomicU8::new(IDLE),
                shutdown_reported: AtomicBool::new(false),
                caps: OnceLock::new(),
                srx: OnceLock::new(),
                signalling: Signalling::default(),
                sends: SendBatch::default(),
                recvs: RecvBatch::default(),
                multi: Mutex::default(),
                multi_active: AtomicBool::new(false),
                min_multi_recv: AtomicUsize::new(DEFAULT_MIN_MULTI_RECV),
                ctl: Mutex::new(Control {
                    id: Some(id),
                    rd_atomic: rd_atomic(domain, info.caps),
                    ..Control::default()
                }),
                max_msg_size,
                info: info.clone(),
                context,
                domain: domain.clone(),
            }),
        })
    }

    /// Binds the event queue for connection events (`fi_ep_bind` of an EQ).
    pub fn bind_eq(&self, eq: &Arc<EventQueue>) -> Result<()> {
        let mut c = self.shared.ctl();
        if c.eq.is_some() {
            return Err(Error::new(
                errno::EINVAL,
                "endpoint already bound to an event queue",
            ));
        }
        let id = self
            .shared
            .id
            .get()
            .map(CmQp::id)
            .or(c.id.as_ref())
            .ok_or_else(not_enabled)?;
        id.migrate(eq.channel())
            .map_err(os_err("rdma_migrate_id"))?;
        self.register(eq, id.ident());
        c.eq = Some(eq.clone());
        Ok(())
    }

    /// Binds a completion queue for `FI_TRANSMIT` and/or `FI_RECV` completions.
    pub fn bind_cq(&self, cq: &Arc<CompletionQueue>, flags: Flags) -> Result<()> {
        let enabled = self.shared.caps.get().is_some();
        let mut c = self.shared.ctl();
        self.shared
            .signalling
            .bind_cq(&mut c.cqs, cq, flags, enabled)
    }

    /// Binds a counter for the directions in `flags` (`FI_SEND`, `FI_RECV`, `FI_READ`,
    /// `FI_WRITE`), before `enable`; CQs must be bound too (fi_endpoint(3)).
    pub fn bind_cntr(&self, cntr: &Arc<Counter>, flags: Flags) -> Result<()> {
        let enabled = self.shared.caps.get().is_some();
        let mut c = self.shared.ctl();
        self.shared
            .signalling
            .bind_cntr(&mut c.cqs, cntr, flags, enabled)
    }

    /// Takes receives from `srx` instead of a receive queue of its own (`fi_ep_bind` of a
    /// shared receive context), before `enable`. Receives are then posted to `srx`.
    pub fn bind_srx(&self, srx: &Arc<SharedRxContext>) -> Result<()> {
        if !Arc::ptr_eq(srx.domain(), &self.shared.domain) {
            return Err(Error::new(
                errno::EINVAL,
                "the shared receive context belongs to another domain",
            ));
        }
        if self.shared.caps.get().is_some() {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "bind the shared receive context before enabling the endpoint",
            ));
        }
        self.shared.srx.set(srx.clone()).map_err(|_| {
            Error::new(
                errno::EINVAL,
                "endpoint already bound to a shared receive context",
            )
        })
    }

    /// Creates the queue pair (`fi_enable`).
    pub fn enable(&self) -> Result<()> {
        let mut c = self.shared.ctl();
        if self.shared.caps.get().is_some() {
            return Ok(());
        }
        let srx = self.shared.srx.get();
        if srx.is_some() && self.shared.signalling.rx_selective() {
            return Err(Error::new(
                errno::EINVAL,
                "FI_SELECTIVE_COMPLETION on the receive CQ of an endpoint with a shared receive context: every shared receive completes",
            ));
        }
        let want = wanted_caps(
            &self.shared.info,
            &self.shared.domain.device().attr,
            c.tx_size,
            c.rx_size,
        );
        // Each receive the QP can complete needs a CQ entry: its own queue's, or the SRQ's.
        let rx_depth = srx.map_or(want.max_recv_wr, |s| s.size() as u32);
        if c.reserved_by_owner {
            c.cqs.reserve(0, 0)?;
        } else {
            c.cqs.reserve(want.max_send_wr, rx_depth)?;
        }
        let (tx, rx) = (c.cqs.tx_cq.clone(), c.cqs.rx_cq.clone());
        let (Some(tx), Some(rx)) = (tx, rx) else {
            unreachable!("reserve checked both CQs are bound")
        };
        let pd = self.shared.domain.pd();
        let srq = srx.map(|s| s.srq());
        let Some(id) = c.id.take() else {
            return Err(not_enabled());
        };
        let got = match id.create_qp(pd, tx.raw(), rx.raw(), want, srq) {
            Ok(g) => {
                // From here on the identifier is fixed and read without the lock.
                match CmQp::new(id) {
                    Ok(q) => {
                        let _ = self.shared.id.set(q);
                    }
                    Err(id) => {
                        // create_qp succeeded, so this does not happen: refuse, unchanged.
                        c.id = Some(id);
                        c.cqs.unreserve();
                        return Err(Error::new(errno::EIO, "rdma_create_qp left no QP"));
                    }
                }
                g
            }
            Err(e) => {
                c.id = Some(id);
                c.cqs.unreserve();
                return Err(Error::os(
                    e,
                    format!(
                        "rdma_create_qp ({want:?}); FI_RVERBS_INLINE_SIZE lowers the inline size"
                    ),
                ));
            }
        };
        let qpn = self.qp()?.qp_num();
        crate::fi_debug!("ep", "RC QP {qpn} created: {got:?}");
        c.cqs.count_on(qpn);
        self.shared.signalling.set_tx_depth(got.max_send_wr);
        self.shared
            .signalling
            .fix_default(self.shared.info.tx_attr.op_flags);
        let _ = self.shared.caps.set(got);
        let flags = self.shared.info.rx_attr.op_flags;
        if self.shared.srx.get().is_none() && !flags.contains(Flags::MULTI_RECV) {
            let suppressed = self.shared.signalling.recv_suppressed(flags);
            let base = wr_id::encode(0, Kind::Recv, suppressed);
            self.shared.recvs.open_plain(base);
        }
        if !self
            .shared
            .info
            .tx_attr
            .op_flags
            .intersects(Flags::MORE | Flags::FENCE)
        {
            let base = wr_id::encode(0, Kind::Send, false);
            self.shared.sends.open_plain(base);
        }
        Ok(())
    }

    /// A handle on this endpoint for a peer provider (fi_peer(3) `FI_PEER_TRANSFER`): what
    /// it posts through the handle completes to `sink`, never on the endpoint's CQs. The
    /// endpoint must be enabled; [`Self::end_peer_transfer`] undoes the routing.
    pub(crate) fn peer_transfer(&self, sink: Weak<dyn PeerTransferSink>) -> Result<MsgEndpoint> {
        if self.peer != 0 {
            return Err(Error::new(errno::EINVAL, "this is already a peer's handle"));
        }
        let qpn = self.qp()?.qp_num();
        let (tx, rx) = {
            let c = self.shared.ctl();
            (c.cqs.tx_cq.clone(), c.cqs.rx_cq.clone())
        };
        for cq in [tx, rx].into_iter().flatten() {
            cq.register_transfer(qpn, sink.clone());
        }
        Ok(MsgEndpoint {
            shared: self.shared.clone(),
            peer: wr_id::PEER,
        })
    }

    /// Work requests in flight at most (send and receive queues together).
    pub(crate) fn queue_depth(&self) -> usize {
        self.shared
            .caps
            .get()
            .map_or(0, |c| (c.max_send_wr + c.max_recv_wr) as usize)
    }

    /// Ends the routing [`Self::peer_transfer`] set up (on the peer's handle).
    pub(crate) fn end_peer_transfer(&self) {
        let Ok(qp) = self.qp() else { return };
        let c = self.shared.ctl();
        for cq in [&c.cqs.tx_cq, &c.cqs.rx_cq].into_iter().flatten() {
            cq.unregister_transfer(qp.qp_num());
        }
    }

    #[inline]
    pub(crate) fn qp(&self) -> Result<&QpHandle> {
        self.shared.qp().ok_or_else(not_enabled)
    }

    /// Marks the endpoint a connection of an RDM endpoint, before `enable`: its CQ entries
    /// are the owner's to reserve.
    pub(crate) fn reserved_by_owner(&self) {
        self.shared.ctl().reserved_by_owner = true;
    }

    /// Lets the peer read what this side exposes, `depth` reads at a time (an RDM
    /// connection's rendezvous), before connecting or accepting.
    pub(crate) fn allow_reads(&self, depth: u8) {
        self.shared.ctl().rd_atomic = depth;
    }

    /// Disconnects without waiting for a flush (an RDM endpoint's connection closing).
    pub(crate) fn disconnect(&self) {
        self.shared.disconnect_quietly();
    }

    fn require_eq(&self) -> Result<()> {
        if self.shared.ctl().eq.is_none() {
            return Err(Error::new(
                errno::ENOEQ,
                "bind an event queue first: connection events are reported there",
            ));
        }
        Ok(())
    }

    /// Checks that connecting may start (EQ bound, QP created, not yet connecting) and
    /// moves to the connecting state.
    fn begin_connecting(&self) -> Result<()> {
        self.require_eq()?;
        self.qp()?;
        self.shared
            .state
            .compare_exchange(IDLE, CONNECTING, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| {
                Error::new(
                    errno::EISCONN,
                    "endpoint is already connecting or connected",
                )
            })
    }

    /// Starts connecting; `FI_CONNECTED` (or an error entry) arrives on the EQ (`fi_connect`).
    pub fn connect(&self, data: &[u8]) -> Result<()> {
        let enc = encode_cm_data(data, CONNECT_PRIVATE_DATA_MAX)?;
        let retry = retry_count()?;
        let rd = self.shared.ctl().rd_atomic;
        self.begin_connecting()?;
        self.shared
            .with_id(|i| i.connect(&enc, rd, retry))
            .map_err(|e| {
                self.shared.state.store(IDLE, Ordering::Release);
                Error::os(e, "rdma_connect")
            })
    }

    /// Accepts the request this endpoint was opened on (`fi_accept`).
    pub fn accept(&self, data: &[u8]) -> Result<()> {
        let enc = encode_cm_data(data, ACCEPT_PRIVATE_DATA_MAX.min(CONNECT_PRIVATE_DATA_MAX))?;
        let retry = retry_count()?;
        let rd = self.shared.ctl().rd_atomic;
        self.begin_connecting()?;
        self.shared
            .with_id(|i| i.accept(&enc, rd, retry))
            .map_err(os_err("rdma_accept"))
    }

    /// Disconnects (`fi_shutdown`): the peer sees `FI_SHUTDOWN`; operations still posted
    /// complete with `FI_ECANCELED`.
    pub fn shutdown(&self) -> Result<()> {
        // Chained work goes to the device first, so the disconnect cancels it like the rest.
        if let Ok(qp) = self.qp() {
            let _ = self.ring_sends(qp);
            let _ = self.ring_recvs(qp);
        }
        let prev = self.shared.state.swap(LOCAL_SHUTDOWN, Ordering::AcqRel);
        if prev == PEER_SHUTDOWN {
            self.shared.state.store(PEER_SHUTDOWN, Ordering::Release);
        }
        match self.shared.with_id(|i| i.disconnect()) {
            Ok(()) => {
                self.write_cancellations();
                Ok(())
            }
            // Not connected (yet, or any more): nothing to tear down.
            Err(e) if e == libc::EINVAL || e == libc::ENOTCONN => Ok(()),
            Err(e) => Err(Error::os(e, "rdma_disconnect")),
        }
    }

    /// fi_cm(3): canceled operations are written before `fi_shutdown` returns. The
    /// disconnect moved the QP to the error state, where the device flushes posted work
    /// in order but in its own time; a marker posted behind it on each queue says when the
    /// flush is complete, and until then the device's completions move to the CQs'
    /// software queues (where reads find them first, in order).
    fn write_cancellations(&self) {
        let Some(qp) = self.shared.qp() else {
            return;
        };
        let (tx, rx) = {
            let c = self.shared.ctl();
            (c.cqs.tx_cq.clone(), c.cqs.rx_cq.clone())
        };
        // The endpoint's address is unique among live endpoints: a marker no other can post.
        let marker = wr_id::encode(self.shared.token(), Kind::Marker, true);
        let wait = std::time::Duration::from_secs(2);
        let mut done = true;
        // A shared receive queue is not the endpoint's to flush.
        if let Some(rx) = rx.filter(|_| self.shared.srx.get().is_none()) {
            // Posted behind the rest, then the error state asserted again so that every
            // device flushes it (rxe would leave it, and shutdown would wait its 2 s).
            done &= qp.post_recv(marker, &[]).is_ok()
                && qp.set_error().is_ok()
                && rx.flush_until(marker, wait).unwrap_or(false);
            // The flush of a multi-receive buffer cancels what waited behind it; anything
            // still waiting (a buffer not flushed in time) is canceled here.
            let left = lock(&self.shared.multi).take_backlog();
            for (context, flags) in left {
                let e = CqErrEntry {
                    op_context: context,
                    flags: flags.bits(),
                    err: errno::ECANCELED,
                    prov_errno: 0,
                    ..Default::default()
                };
                if let Err(err) = rx.writeerr(e) {
                    crate::fi_warn!("ep", "shutdown: a cancellation was lost: {err}");
                }
            }
        }
        if let Some(tx) = tx {
            // As for receives: the error state asserted again behind the marker, so that a
            // send still waiting for its acknowledgement is flushed too.
            done &= qp
                .post_send_inline(marker, &[], send_flags::SIGNALED, None)
                .is_ok()
                && qp.set_error().is_ok()
                && tx.flush_until(marker, wait).unwrap_or(false);
        }
        if !done {
            crate::fi_warn!("ep", "shutdown: the device did not flush posted operations within 2 s; some cancellations may follow");
        }
    }

    /// `fi_getopt` at `FI_OPT_ENDPOINT`: `FI_OPT_CM_DATA_SIZE` (the CM data `connect`,
    /// `accept` and `reject` carry), `FI_OPT_TX_SIZE` / `FI_OPT_RX_SIZE` (queue depths: as
    /// granted once enabled). Other options: `-FI_ENOPROTOOPT`.
    pub fn getopt(&self, opt: EpOpt) -> Result<usize> {
        let c = self.shared.ctl();
        let granted = self.shared.caps.get();
        match opt {
            EpOpt::CmDataSize => Ok(CM_DATA_SIZE),
            EpOpt::MinMultiRecv => Ok(self.shared.min_multi_recv.load(Ordering::Relaxed)),
            EpOpt::TxSize => Ok(granted
                .map_or(c.tx_size.unwrap_or(self.shared.info.tx_attr.size), |g| {
                    g.max_send_wr as usize
                })),
            EpOpt::RxSize => Ok(granted
                .map_or(c.rx_size.unwrap_or(self.shared.info.rx_attr.size), |g| {
                    g.max_recv_wr as usize
                })),
            other => Err(no_such_option(other)),
        }
    }

    /// `fi_setopt` at `FI_OPT_ENDPOINT`: `FI_OPT_TX_SIZE` / `FI_OPT_RX_SIZE` before the
    /// endpoint is enabled. `FI_OPT_CM_DATA_SIZE` is read-only. Others: `-FI_ENOPROTOOPT`.
    pub fn setopt(&self, opt: EpOpt, value: usize) -> Result<()> {
        let mut c = self.shared.ctl();
        let max = self.shared.domain.device().attr.max_qp_wr as usize;
        match opt {
            EpOpt::TxSize | EpOpt::RxSize if self.shared.caps.get().is_some() => Err(Error::new(
                errno::EOPBADSTATE,
                "queue sizes are fixed once the endpoint is enabled",
            )),
            EpOpt::TxSize | EpOpt::RxSize if value == 0 || value > max => Err(Error::new(
                errno::EINVAL,
                format!("queue size {value}: use 1 to the device's max_qp_wr {max}"),
            )),
            EpOpt::TxSize => {
                c.tx_size = Some(value);
                Ok(())
            }
            EpOpt::MinMultiRecv => {
                self.shared.min_multi_recv.store(value, Ordering::Relaxed);
                Ok(())
            }
            EpOpt::RxSize => {
                c.rx_size = Some(value);
                Ok(())
            }
            EpOpt::CmDataSize => Err(Error::new(
                errno::ENOPROTOOPT,
                "FI_OPT_CM_DATA_SIZE is read-only",
            )),
            other => Err(no_such_option(other)),
        }
    }

    /// Whether `FI_CONNECTED` was seen and no disconnect since.
    pub fn is_connected(&self) -> bool {
        self.shared.state.load(Ordering::Acquire) == CONNECTED
    }

    /// The local address (`fi_getname`).
    pub fn getname(&self) -> Option<SocketAddr> {
        self.shared.with_id(|i| i.local_addr())
    }

    /// The peer's address (`fi_getpeer`).
    /// The peer an active endpoint connects to (`fi_info.dest_addr`); none when accepting.
    pub fn dest_addr(&self) -> Option<SocketAddr> {
        self.shared.info.dest_addr.filter(|_| !self.accepting())
    }

    /// Whether this endpoint answers a connection request (its info's handle is one).
    fn accepting(&self) -> bool {
        let h = self.shared.info.handle.as_ref();
        h.is_some_and(|h| h.is::<ConnRequest>())
    }

    pub fn getpeer(&self) -> Option<SocketAddr> {
        self.shared.with_id(|i| i.peer_addr())
    }

    /// `fi_getname` into a caller's buffer, with fi_cm(3)'s `addrlen` rules.
    pub fn getname_into(&self, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        let name = self.getname().ok_or_else(|| {
            Error::new(
                errno::EADDRNOTAVAIL,
                "the endpoint has no local address yet",
            )
        })?;
        fill_name(&sockaddr_bytes(&name), buf, addrlen)
    }

    /// `fi_getpeer` into a caller's buffer; valid once `FI_CONNECTED` was seen.
    pub fn getpeer_into(&self, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        let state = self.shared.state.load(Ordering::Acquire);
        let peer = self
            .getpeer()
            .filter(|_| state != IDLE && state != CONNECTING);
        let peer = peer.ok_or_else(|| {
            Error::new(
                errno::ENOTCONN,
                "fi_getpeer before FI_CONNECTED: the peer's address is not known yet",
            )
        })?;
        fill_name(&sockaddr_bytes(&peer), buf, addrlen)
    }

    /// `fi_setname`: the local address to connect from (port 0: any), before `enable`.
    /// The route to the peer is resolved again from it; on failure nothing changes.
    pub fn setname(&self, addr: &SocketAddr) -> Result<()> {
        if self.shared.caps.get().is_some() {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "fi_setname after fi_enable: set the address before enabling",
            ));
        }
        let Some(dst) = self.dest_addr() else {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "an accepting endpoint's address is the one its connection request arrived at",
            ));
        };
        let id = resolve_route(Some(addr), &dst)?;
        let dev = id.context().map(|c| c.name()).unwrap_or_default();
        if dev != self.shared.domain.device().name {
            return Err(Error::new(
                errno::EADDRNOTAVAIL,
                format!("{addr} is on {dev}, not this domain's device"),
            ));
        }
        // Under the lock that `enable` and `bind_eq` take: the identifier is replaced
        // before anything else can use it, and the old one is dropped after.
        let old = {
            let mut c = self.shared.ctl();
            if self.shared.id.get().is_some() {
                return Err(Error::new(
                    errno::EOPBADSTATE,
                    "fi_setname after fi_enable: set the address before enabling",
                ));
            }
            if let Some(eq) = &c.eq {
                id.migrate(eq.channel())
                    .map_err(os_err("rdma_migrate_id"))?;
                let old = c.id.as_ref().map(|i| i.ident());
                if let Some(o) = old {
                    eq.unregister(o);
                }
                self.register(eq, id.ident());
            }
            c.id.replace(id)
        };
        drop(old);
        Ok(())
    }

    fn register(&self, eq: &EventQueue, ident: usize) {
        eq.register(
            ident,
            Owner::Active {
                fid: self.shared.context,
                ep: Arc::downgrade(&(self.shared.clone() as Arc<dyn CmEndpoint>)),
            },
        );
    }

    /// Capacities the queue pair was given (after `enable`).
    pub fn qp_caps(&self) -> Option<QpCaps> {
        self.shared.caps.get().copied()
    }

    /// The largest payload of one send (`fi_tx_attr.inject_size` is what goes inline).
    pub fn inject_size(&self) -> usize {
        self.qp().map(|q| q.max_inline() as usize).unwrap_or(0)
    }

    #[inline]
    fn check_mr(&self, mr: &MemoryRegion) -> Result<()> {
        check_domain(mr, &self.shared.domain)
    }

    /// Sends `len` bytes at `offset` of `mr` (`fi_send`); `context` comes back in the
    /// completion. Under `FI_SELECTIVE_COMPLETION` a completion is written only when the
    /// endpoint's default `tx_attr.op_flags` contain `FI_COMPLETION`.
    #[inline]
    pub fn send(&self, mr: &MemoryRegion, offset: usize, len: usize, context: u64) -> Result<()> {
        let sh = &*self.shared;
        // The plain send: enabled, no fence or chain by default nor open, a context and
        // length within bounds and a region of this domain. Anything else (and any error,
        // reported there) goes the general way.
        if let Some(base) = sh.sends.plain().filter(|_| {
            context & !wr_id::CONTEXT == 0
                && len <= sh.max_msg_size
                && Arc::ptr_eq(mr.domain(), &sh.domain)
        }) {
            if let Some(qp) = sh.qp() {
                let (id, vflags) = sh.signalling.send_default(context | base | self.peer);
                // `len` is within max_msg_size, so within a u32.
                let sge = mr
                    .sys()
                    .region_sge(offset, len as u32)
                    .ok_or_else(|| mr.range_error(offset, len))?;
                return qp
                    .post_send_sge(id, sge, vflags)
                    .map_err(|e| post_error(e, "send"));
            }
        }
        self.post_send(mr, offset, len, context, None, sh.info.tx_attr.op_flags)
    }

    /// Sends with 4 bytes of remote CQ data, delivered as `data` with `FI_REMOTE_CQ_DATA` (`fi_senddata`).
    #[inline]
    pub fn senddata(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        data: u64,
        context: u64,
    ) -> Result<()> {
        let flags = self.shared.info.tx_attr.op_flags | Flags::REMOTE_CQ_DATA;
        self.post_send(mr, offset, len, context, Some(cq_data(data)?), flags)
    }

    /// `fi_sendv`: one message gathered from `iov` (at most `tx_attr.iov_limit` ranges).
    pub fn sendv(&self, iov: &[Iov<'_>], context: u64) -> Result<()> {
        self.sendmsgv(iov, context, 0, self.shared.info.tx_attr.op_flags)
    }

    /// `fi_sendmsg` with several ranges: `flags` and `data` as in [`Self::sendmsg`]. The
    /// message is posted at once, behind any `FI_MORE` chain. No range at all sends a
    /// message of no bytes (what a C call with a NULL descriptor and length 0 is).
    pub fn sendmsgv(&self, iov: &[Iov<'_>], context: u64, data: u64, flags: Flags) -> Result<()> {
        if iov.is_empty() {
            return self.post_sendv(&[], 0, context, data, flags);
        }
        with_slices(&self.shared.domain, iov, |slices| {
            let total: usize = iov.iter().map(|v| v.2).sum();
            self.post_sendv(slices, total, context, data, flags)
        })
    }

    fn post_sendv(
        &self,
        slices: &[MrSlice<'_>],
        total: usize,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        self.check_len(total)?;
        check_sendmsg(flags, total, self.inject_size())?;
        let imm = send_imm(flags, data)?;
        wr_id::check(context)?;
        let (id, vflags) = self.signalling(
            wr_id::encode(context, wr_id::send_kind(imm), false) | self.peer,
            flags,
        );
        let qp = self.qp()?;
        self.ring_sends(qp)?;
        qp.post_send_iov(id, slices, vflags, imm)
            .map_err(|e| iov_error(e, "send", slices.len()))
    }

    pub fn recvv(&self, iov: &[Iov<'_>], context: u64) -> Result<()> {
        self.recvmsgv(iov, context, self.shared.info.rx_attr.op_flags)
    }

    /// `fi_recvmsg` with several ranges: `FI_COMPLETION` under selective completion and
    /// `FI_MORE` (posted at once); an `FI_MULTI_RECV` buffer is one range (`EINVAL`). No
    /// range at all takes a message of no bytes (a longer one completes in error).
    pub fn recvmsgv(&self, iov: &[Iov<'_>], context: u64, flags: Flags) -> Result<()> {
        check_recv_flags(flags, Flags::empty())?;
        if iov.is_empty() {
            return self.post_recvv(&[], context, flags);
        }
        with_slices(&self.shared.domain, iov, |slices| {
            self.post_recvv(slices, context, flags)
        })
    }

    fn post_recvv(&self, slices: &[MrSlice<'_>], context: u64, flags: Flags) -> Result<()> {
        let id = self.recv_id(context, flags)?;
        let qp = self.qp()?;
        if self.shared.multi_active.load(Ordering::Acquire) {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "a vectored receive cannot queue behind an FI_MULTI_RECV buffer: post it once the buffer is released",
            ));
        }
        self.ring_recvs(qp)?;
        qp.post_recv_iov(id, slices)
            .map_err(|e| iov_error(e, "receive", slices.len()))
    }

    /// The work request id of a receive. Verbs completes every receive: under selective
    /// completion, one posted without `FI_COMPLETION` is marked for the CQ to drop.
    #[inline]
    fn recv_id(&self, context: u64, flags: Flags) -> Result<u64> {
        wr_id::check(context)?;
        if self.shared.srx.get().is_some() {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "this endpoint takes its receives from a shared receive context: post them there",
            ));
        }
        let suppressed = self.shared.signalling.recv_suppressed(flags);
        Ok(wr_id::encode(context, Kind::Recv, suppressed) | self.peer)
    }

    #[inline]
    fn check_len(&self, len: usize) -> Result<()> {
        if len > self.shared.max_msg_size {
            return Err(Error::new(
                errno::EMSGSIZE,
                format!(
                    "{len} bytes exceed max_msg_size {}",
                    self.shared.max_msg_size
                ),
            ));
        }
        Ok(())
    }

    /// `fi_sendmsg`: a send with per-operation flags. `FI_COMPLETION` asks for a completion
    /// under selective completion; `FI_INJECT` sends inline (at most `inject_size` bytes)
    /// so the buffer is free on return; `FI_REMOTE_CQ_DATA` carries `data`; `FI_FENCE`
    /// waits for earlier operations; `FI_MORE` chains it for one doorbell with the next
    /// send without `FI_MORE`; the completion levels are accepted (every level is met on
    /// RC, see the README). `FI_MULTICAST`, `FI_CLAIM` and `FI_DISCARD`
    /// do not apply to a MSG endpoint's sends: `EINVAL`.
    pub fn sendmsg(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        check_sendmsg(flags, len, self.inject_size())?;
        let imm = send_imm(flags, data)?;
        self.post_send(mr, offset, len, context, imm, flags)
    }

    /// `fi_inject`: sends `data` inline with no completion; the buffer is free on return.
    pub fn inject(&self, data: &[u8]) -> Result<()> {
        self.post_inject(data, None)
    }

    /// `fi_injectdata`: `inject` with remote CQ data.
    pub fn injectdata(&self, data: &[u8], cq: u64) -> Result<()> {
        self.post_inject(data, Some(cq_data(cq)?))
    }

    fn post_inject(&self, data: &[u8], imm: Option<u32>) -> Result<()> {
        check_inject(data.len(), self.inject_size())?;
        let qp = self.qp()?;
        // An inject never completes; errors are reported with a NULL (0) context.
        let kind = wr_id::send_kind(imm);
        let (id, vflags) = self.unsignaled_slot(wr_id::encode(0, kind, false) | self.peer);
        self.ring_sends(qp)?;
        qp.post_send_inline(id, data, vflags, imm)
            .map_err(|e| post_error(e, "send"))
    }

    #[inline]
    fn signalling(&self, id: u64, flags: Flags) -> (u64, u32) {
        self.shared.signalling.send(id, flags)
    }

    #[inline]
    fn unsignaled_slot(&self, id: u64) -> (u64, u32) {
        self.shared.signalling.unsignaled(id)
    }

    #[inline]
    fn post_send(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        imm: Option<u32>,
        flags: Flags,
    ) -> Result<()> {
        self.check_mr(mr)?;
        wr_id::check(context)?;
        let kind = wr_id::send_kind(imm);
        let context = wr_id::encode(context, kind, false) | self.peer;
        self.check_len(len)?;
        let qp = self.qp()?;
        let (id, vflags) = self.signalling(context, flags);
        // One test keeps the plain send's path short: fences and chains go out of line.
        if flags.intersects(Flags::MORE | Flags::FENCE) || self.shared.sends.is_open() {
            return self.send_fenced_or_chained(qp, id, mr, offset, len, vflags, imm, flags);
        }
        qp.post_send_mr(id, mr.sys(), offset, len, vflags, imm)
            .map_err(|e| region_post_error(e, mr, offset, len, "send"))
    }

    /// A send with `FI_FENCE`, with `FI_MORE` or behind an open chain.
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn send_fenced_or_chained(
        &self,
        qp: &QpHandle,
        id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        mut vflags: u32,
        imm: Option<u32>,
        flags: Flags,
    ) -> Result<()> {
        if flags.contains(Flags::FENCE) {
            vflags |= send_flags::FENCE;
        }
        if flags.contains(Flags::MORE) || self.shared.sends.is_open() {
            // `FI_MORE`: chain it, and post the chain with one doorbell once a send without
            // `FI_MORE` ends the batch (or the chain is full). An inject's buffer is free on
            // return: it ends the batch.
            let more = flags.contains(Flags::MORE) && !flags.contains(Flags::INJECT);
            let cq = || self.shared.ctl().cqs.tx_cq.clone();
            return self.shared.sends.add(qp, more, &cq, |ch| {
                qp.chain_send(ch, id, mr.sys(), offset, len, vflags, imm, None)
                    .map_err(|e| {
                        if e == libc::EINVAL {
                            mr.range_error(offset, len)
                        } else {
                            post_error(e, "send")
                        }
                    })
            });
        }
        qp.post_send_mr(id, mr.sys(), offset, len, vflags, imm)
            .map_err(|e| region_post_error(e, mr, offset, len, "send"))
    }

    /// The default flags of this endpoint's transmit operations (`tx_attr.op_flags`).
    pub fn tx_op_flags(&self) -> Flags {
        self.shared.info.tx_attr.op_flags
    }

    /// `fi_write`: writes `len` bytes at `offset` of `mr` to `addr` (a virtual address of
    /// the peer's region) under `key` (its `fi_mr_key`). The peer sees nothing.
    pub fn write(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        let rma = RmaIov { addr, len, key };
        let flags = self.shared.info.tx_attr.op_flags;
        if !self.plain_rma(flags) {
            return self.writemsg(&[(mr, offset, len)], &rma, context, 0, flags);
        }
        self.check_mr(mr)?;
        let (rkey, id, vflags, qp) = self.rma_checked(len, &rma, Kind::Write, context, flags)?;
        qp.post_write_mr(id, mr.sys(), offset, len, addr, rkey, vflags)
            .map_err(|e| region_post_error(e, mr, offset, len, "write"))
    }

    /// Whether a one-region call with these default flags posts straight: nothing to apply
    /// but `FI_COMPLETION`, and no `FI_MORE` chain open to join.
    #[inline(always)]
    fn plain_rma(&self, flags: Flags) -> bool {
        (flags - Flags::COMPLETION).is_empty() && !self.shared.sends.is_open()
    }

    /// `fi_writedata`: a write whose 4 bytes of `data` complete a receive at the peer with
    /// `FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA` (write with immediate data).
    #[allow(clippy::too_many_arguments)]
    pub fn writedata(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        data: u64,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        let rma = RmaIov { addr, len, key };
        let flags = self.shared.info.tx_attr.op_flags | Flags::REMOTE_CQ_DATA;
        self.writemsg(&[(mr, offset, len)], &rma, context, data, flags)
    }

    /// `fi_writemsg` (and `fi_writev`): one write gathered from `iov` into the one remote
    /// range `rma` (`rma_iov_limit` is 1), with the flags of [`Self::sendmsg`].
    pub fn writemsg(
        &self,
        iov: &[Iov<'_>],
        rma: &RmaIov,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        let imm = send_imm(flags, data)?;
        let total: usize = iov.iter().map(|v| v.2).sum();
        check_sendmsg(flags, total, self.inject_size())?;
        with_slices(&self.shared.domain, iov, |slices| {
            let (rkey, id, vflags, qp) =
                self.rma_prepare(total, rma, Kind::Write, context, flags)?;
            qp.post_write(id, slices, rma.addr, rkey, vflags, imm)
                .map_err(|e| iov_error(e, "write", iov.len()))
        })
    }

    /// `fi_inject_write`: writes `data` inline with no completion; the buffer is free on
    /// return.
    pub fn inject_write(&self, data: &[u8], addr: u64, key: u64) -> Result<()> {
        self.post_inject_write(data, addr, key, None)
    }

    /// `fi_inject_writedata`: `inject_write` with remote CQ data.
    pub fn inject_writedata(&self, data: &[u8], cq: u64, addr: u64, key: u64) -> Result<()> {
        self.post_inject_write(data, addr, key, Some(cq_data(cq)?))
    }

    fn post_inject_write(&self, data: &[u8], addr: u64, key: u64, imm: Option<u32>) -> Result<()> {
        check_inject(data.len(), self.inject_size())?;
        let rkey = RmaIov {
            addr,
            len: data.len(),
            key,
        }
        .check(data.len())?;
        self.check_cap(Flags::WRITE)?;
        let qp = self.qp()?;
        let (id, vflags) = self.unsignaled_slot(wr_id::encode(0, Kind::Write, false) | self.peer);
        self.ring_sends(qp)?;
        qp.post_write_inline(id, data, addr, rkey, vflags, imm)
            .map_err(|e| post_error(e, "write"))
    }

    /// `fi_read`: reads `len` bytes at `addr` under `key` of the peer's region into
    /// `offset` of `mr`.
    pub fn read(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        let rma = RmaIov { addr, len, key };
        let flags = self.shared.info.tx_attr.op_flags;
        if !self.plain_rma(flags) {
            return self.readmsg(&[(mr, offset, len)], &rma, context, flags);
        }
        self.check_mr(mr)?;
        let (rkey, id, vflags, qp) = self.rma_checked(len, &rma, Kind::Read, context, flags)?;
        let sge = mr
            .sys()
            .sge(offset, len)
            .ok_or_else(|| mr.range_error(offset, len))?;
        qp.post_read(id, sge, addr, rkey, vflags)
            .map_err(|e| region_post_error(e, mr, offset, len, "read"))
    }

    /// `fi_readmsg` (and `fi_readv`): one read of the remote range `rma` scattered into
    /// `iov`. `FI_INJECT` and `FI_REMOTE_CQ_DATA` do not apply to reads: `EINVAL`.
    pub fn readmsg(&self, iov: &[Iov<'_>], rma: &RmaIov, context: u64, flags: Flags) -> Result<()> {
        check_send_flags(flags)?;
        if flags.intersects(Flags::INJECT | Flags::REMOTE_CQ_DATA) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_INJECT and FI_REMOTE_CQ_DATA apply to writes, not reads",
            ));
        }
        let total: usize = iov.iter().map(|v| v.2).sum();
        with_slices(&self.shared.domain, iov, |slices| {
            let (rkey, id, vflags, qp) =
                self.rma_prepare(total, rma, Kind::Read, context, flags)?;
            qp.post_read_iov(id, slices, rma.addr, rkey, vflags)
                .map_err(|e| iov_error(e, "read", iov.len()))
        })
    }

    /// Refuses an RMA operation the endpoint was not opened for (its info's caps name no
    /// `FI_RMA`, or name directions without this one): its QP may not be set up for it.
    #[inline]
    fn check_cap(&self, dir: Flags) -> Result<()> {
        check_rma_cap(self.shared.info.caps, dir)
    }

    /// What a write and a read check and prepare alike (the local ranges are checked
    /// already): the remote key, the endpoint's caps and size limit, the work request id and
    /// verbs flags (`FI_FENCE` waits for the reads and writes before it), and the queue pair
    /// with any `FI_MORE` chain rung first.
    #[inline]
    fn rma_prepare(
        &self,
        total: usize,
        rma: &RmaIov,
        kind: Kind,
        context: u64,
        flags: Flags,
    ) -> Result<(u32, u64, u32, &QpHandle)> {
        let (rkey, id, mut vflags, qp) = self.rma_checked(total, rma, kind, context, flags)?;
        if flags.contains(Flags::FENCE) {
            vflags |= send_flags::FENCE;
        }
        self.ring_sends(qp)?;
        Ok((rkey, id, vflags, qp))
    }

    /// The checks of every RMA call, and its work request id and verbs flags: all a plain
    /// one-region call (`plain_rma`: no fence, no chain) needs.
    #[inline(always)]
    fn rma_checked(
        &self,
        total: usize,
        rma: &RmaIov,
        kind: Kind,
        context: u64,
        flags: Flags,
    ) -> Result<(u32, u64, u32, &QpHandle)> {
        let rkey = rma.check(total)?;
        self.check_cap(if kind == Kind::Read {
            Flags::READ
        } else {
            Flags::WRITE
        })?;
        self.check_len(total)?;
        wr_id::check(context)?;
        let qp = self.qp()?;
        let (id, vflags) = self.signalling(wr_id::encode(context, kind, false) | self.peer, flags);
        Ok((rkey, id, vflags, qp))
    }

    /// Posts a receive of up to `len` bytes at `offset` of `mr` (`fi_recv`), with the
    /// endpoint's default flags: `FI_MULTI_RECV` there makes it a multi-receive buffer, as
    /// fabtests' multi_recv test and others post theirs.
    #[inline]
    pub fn recv(&self, mr: &MemoryRegion, offset: usize, len: usize, context: u64) -> Result<()> {
        let sh = &*self.shared;
        // The plain receive: default flags, no multi-receive buffer or chain to queue
        // behind (the gate's one load), a context within bounds and a region of this
        // domain; anything else (and any error, reported there) goes the general way.
        if let Some(base) = sh
            .recvs
            .plain()
            .filter(|_| context & !wr_id::CONTEXT == 0 && Arc::ptr_eq(mr.domain(), &sh.domain))
        {
            if let Some(qp) = sh.qp() {
                let sge = mr
                    .sys()
                    .recv_sge(offset, len)
                    .ok_or_else(|| mr.range_error(offset, len))?;
                return qp
                    .post_recv_one(context | base | self.peer, sge)
                    .map_err(|e| post_error(e, "receive"));
            }
        }
        let flags = self.shared.info.rx_attr.op_flags;
        if flags.contains(Flags::MULTI_RECV) {
            return self.recvmsg(mr, offset, len, context, flags);
        }
        self.post_recv(mr, offset, len, context, flags)
    }

    /// `fi_recvmsg`: a receive with per-operation flags: `FI_COMPLETION` under selective
    /// completion, `FI_MORE` (chained, one doorbell), `FI_MULTI_RECV`. `FI_CLAIM` /
    /// `FI_DISCARD` need buffered receives, which MSG endpoints do not offer: `EINVAL`.
    pub fn recvmsg(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        check_recv_flags(flags, Flags::MULTI_RECV)?;
        if flags.contains(Flags::MULTI_RECV) {
            if self.peer != 0 {
                return Err(Error::new(
                    errno::EINVAL,
                    "FI_MULTI_RECV is not offered to peer transfers",
                ));
            }
            return self.post_multi_recv(mr, offset, len, context, flags);
        }
        self.post_recv(mr, offset, len, context, flags)
    }

    /// `FI_MULTI_RECV`: messages are packed into `len` bytes at `offset` of `mr`, each
    /// completion's `buf` saying where; the one that leaves less than
    /// `FI_OPT_MIN_MULTI_RECV` free carries `FI_MULTI_RECV` (the buffer is released).
    fn post_multi_recv(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        region_sge(mr, &self.shared.domain, offset, len)?;
        self.recv_id(context, flags)?;
        let qp = self.qp()?;
        self.ring_recvs(qp)?;
        let sh = &self.shared;
        if let Some(rx) = sh.ctl().cqs.rx_cq.clone() {
            let owner: Arc<dyn RecvOwner> = sh.clone();
            rx.register_owner(qp.qp_num(), Arc::downgrade(&owner));
        }
        let buf = MultiBuf {
            mr: mr.clone(),
            next: offset,
            end: offset + len,
            context,
            suppress: sh.signalling.recv_suppressed(flags),
        };
        let mut m = lock(&sh.multi);
        if !m.has_overflow() {
            m.set_overflow(MemoryRegion::alloc(
                &sh.domain,
                crate::verbs::multi_recv::OVERFLOW_LEN,
                Flags::RECV,
            )?);
        }
        let r = m.post_multi(qp, buf, sh.rx_depth());
        sh.set_multi_active(!m.is_idle());
        r
    }

    #[inline]
    fn post_recv(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        let sge = region_sge(mr, &self.shared.domain, offset, len)?;
        let id = self.recv_id(context, flags)?;
        let qp = self.qp()?;
        if self.shared.multi_active.load(Ordering::Acquire) {
            return self.queue_behind_multi(qp, id, sge);
        }
        if flags.contains(Flags::MORE) || self.shared.recvs.is_open() {
            return self.chain_recv(qp, id, sge, flags.contains(Flags::MORE));
        }
        qp.post_recv(id, &[sge])
            .map_err(|e| post_error(e, "receive"))
    }

    /// A receive posted while a multi-receive buffer is active waits behind it.
    #[cold]
    fn queue_behind_multi(&self, qp: &QpHandle, id: u64, sge: Sge) -> Result<()> {
        self.ring_recvs(qp)?;
        let mut m = lock(&self.shared.multi);
        let r = m.post_recv(qp, id, sge, self.shared.rx_depth());
        self.shared
            .multi_active
            .store(!m.is_idle(), Ordering::Release);
        r
    }

    /// Posts any sends still chained, before an operation that must not pass them.
    fn ring_sends(&self, qp: &QpHandle) -> Result<()> {
        self.shared
            .sends
            .ring(qp, &|| self.shared.ctl().cqs.tx_cq.clone())
    }

    fn ring_recvs(&self, qp: &QpHandle) -> Result<()> {
        self.shared
            .recvs
            .ring(qp, &|| self.shared.ctl().cqs.rx_cq.clone())
    }

    /// `FI_MORE` on a receive: chain it; the chain is posted when a receive without
    /// `FI_MORE` ends the batch (or the chain is full).
    fn chain_recv(&self, qp: &QpHandle, id: u64, sge: Sge, more: bool) -> Result<()> {
        let cq = || self.shared.ctl().cqs.rx_cq.clone();
        self.shared.recvs.add(qp, more, &cq, |ch| {
            ch.push_recv(id, sge).map_err(|e| post_error(e, "receive"))
        })
    }
}

fn no_such_option(opt: EpOpt) -> Error {
    Error::new(
        errno::ENOPROTOOPT,
        format!("endpoint option {opt:?} is not supported on rverbs MSG endpoints"),
    )
}
