//! Datagram (`FI_EP_DGRAM`) endpoints on UD queue pairs.
//!
//! Every UD receive starts with a 40-byte Global Route Header. An application that accepts
//! `FI_MSG_PREFIX` provides that room at the start of its buffers (and its sends start
//! after a prefix of the same size); one that does not gets a provider-owned first
//! scatter element for it, so it never sees the header. Nothing waits for an
//! acknowledgement: a datagram that finds no receive posted is dropped by the device.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rfabric_sys::cm::{CmId, McastGroup};
use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;
use rfabric_sys::verbs::{
    wc_status as st, AddressHandle, QpCaps, QpHandle, Sge, UdDest, UdQp, WorkCompletion, GRH_LEN,
    MAX_IOV,
};

use crate::core::addr::fill_name;
use crate::core::cq::CqErrEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpType, Flags, Mode};
use crate::core::info::Info;
use crate::verbs::av::{UdName, DGRAM_QKEY};
use crate::verbs::cq::{to_entry, to_err_entry, Owned, RecvOwner};
use crate::verbs::ep_common::{
    check_domain, check_inject, check_recv_flags, check_sendmsg, cq_data, lock, post_error,
    region_post_error, region_sge, send_imm, with_slices,
};
use crate::verbs::ep_common::{wanted_caps, CqBinding, SendBatch, Signalling};
use crate::verbs::eq::{CmJoin, Owner};
use crate::verbs::wr_id::{self, Kind};
use crate::verbs::{
    os_err, AddressVector, CompletionQueue, Counter, Domain, EventQueue, Iov, MemoryRegion,
};

#[derive(Debug, Default)]
struct Control {
    cqs: CqBinding,
    av: Option<Arc<AddressVector>>,
    /// Where multicast joins complete (`FI_JOIN_COMPLETE`).
    eq: Option<Arc<EventQueue>>,
}

/// A datagram endpoint (`fi_endpoint` with `FI_EP_DGRAM`).
#[derive(Debug)]
pub struct DgramEndpoint {
    /// What `enable` fixes, reached with one check on the data path. Dropped first: the QP
    /// goes before the CQs and regions it uses.
    ready: OnceLock<Ready>,
    caps: OnceLock<QpCaps>,
    /// Where the GRH of every receive goes when the application has no prefix room.
    grh: OnceLock<MemoryRegion>,
    /// One MTU that absorbs the rest of a datagram longer than its receive (never read).
    sink: OnceLock<MemoryRegion>,
    signalling: Signalling,
    /// Sends chained under `FI_MORE`.
    sends: SendBatch,
    ctl: Mutex<Control>,
    /// `FI_MSG_PREFIX`: buffers start with `GRH_LEN` bytes of room for the provider.
    prefix: bool,
    max_msg_size: usize,
    /// `FI_SOURCE` / `FI_SOURCE_ERR` in the endpoint's caps.
    source: bool,
    source_err: bool,
    /// Each receive's GRH kept until its completion: for `FI_SOURCE`, and for `FI_MULTICAST`
    /// (a multicast datagram is known by the destination in its GRH).
    track_grh: bool,
    /// With `FI_SOURCE`: where each posted receive's GRH lands, in posting order.
    track: Mutex<GrhTrack>,
    /// Receives posted and not yet completed; reaching 0 means datagrams get dropped.
    /// Plain receives (`Kind::DgramPlain`) count in `plain_posted` instead, against what
    /// the CQ reported of them.
    outstanding: AtomicU32,
    plain_posted: AtomicU64,
    /// The `plain_posted` of the last dry episode counted (`queue_was_dry`).
    dry_mark: AtomicU64,
    /// Registered with the receive CQ as the owner of its other receives (on first use).
    owner_registered: AtomicBool,
    dry: AtomicU64,
    /// The endpoint's own handle, for the CQ to route completions to it.
    me: Weak<DgramEndpoint>,
    info: Info,
    domain: Arc<Domain>,
}

/// What `enable` fixes.
#[derive(Debug)]
struct Ready {
    /// First: dropped before the CQ `plain` holds.
    qp: UdQp,
    /// The address vector sends resolve through.
    av: Arc<AddressVector>,
    /// The receive CQ.
    rx_cq: Arc<CompletionQueue>,
    /// It reports this endpoint's plain receives (it granted `claim_plain_ud`).
    plain: bool,
    /// The work request id bits of a plain receive posted with the default flags
    /// (`fi_recv`), or 0 where those go the general way (no plain receives, other flags).
    recv_base: u64,
    /// The provider's GRH slot every plain receive overwrites.
    grh: Sge,
}

impl Drop for DgramEndpoint {
    fn drop(&mut self) {
        let c = self.ctl.get_mut().unwrap_or_else(|p| p.into_inner());
        if let (Some(cq), Some(r)) = (&c.cqs.rx_cq, self.ready.get()) {
            if *self.owner_registered.get_mut() {
                cq.unregister_owner(r.qp.qp_num());
            }
        }
        if let Some(cq) = self.plain_rx() {
            cq.release_plain_ud();
        }
    }
}

/// Binds `v` into `slot`, once (`-FI_EINVAL` the second time).
fn bind_once<T>(slot: &mut Option<Arc<T>>, v: &Arc<T>, what: &str) -> Result<()> {
    if slot.is_some() {
        return Err(Error::new(
            errno::EINVAL,
            format!("endpoint already bound to {what}"),
        ));
    }
    *slot = Some(v.clone());
    Ok(())
}

fn not_enabled() -> Error {
    Error::new(
        errno::EOPBADSTATE,
        "endpoint not enabled: bind its CQs and address vector, then call enable",
    )
}

impl DgramEndpoint {
    /// Opens a datagram endpoint from a `FI_EP_DGRAM` info (`fi_endpoint`).
    pub fn open(domain: &Arc<Domain>, info: &Info) -> Result<Arc<Self>> {
        if info.ep_attr.ep_type != EpType::Dgram {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "{:?} info given to a DGRAM endpoint: ask fi_getinfo for FI_EP_DGRAM",
                    info.ep_attr.ep_type
                ),
            ));
        }
        let mtu = domain.device().port.active_mtu as usize;
        let max_msg_size = match info.ep_attr.max_msg_size {
            0 => mtu,
            n => n.min(mtu),
        };
        let source = info.caps.contains(Flags::SOURCE);
        Ok(Arc::new_cyclic(|me| DgramEndpoint {
            me: me.clone(),
            source,
            source_err: source && info.caps.contains(Flags::SOURCE_ERR),
            track_grh: source || info.caps.contains(Flags::MULTICAST),
            track: Mutex::default(),
            outstanding: AtomicU32::new(0),
            plain_posted: AtomicU64::new(0),
            dry_mark: AtomicU64::new(0),
            owner_registered: AtomicBool::new(false),
            dry: AtomicU64::new(0),
            ready: OnceLock::new(),
            caps: OnceLock::new(),
            grh: OnceLock::new(),
            sink: OnceLock::new(),
            signalling: Signalling::default(),
            sends: SendBatch::default(),
            ctl: Mutex::default(),
            prefix: info.mode.contains(Mode::MSG_PREFIX),
            max_msg_size,
            info: info.clone(),
            domain: domain.clone(),
        }))
    }

    fn check_not_enabled(&self, what: &str) -> Result<()> {
        if self.caps.get().is_some() {
            return Err(Error::new(
                errno::EOPBADSTATE,
                format!("bind {what} before enabling the endpoint"),
            ));
        }
        Ok(())
    }

    /// Binds a completion queue for `FI_TRANSMIT` and/or `FI_RECV` completions.
    pub fn bind_cq(&self, cq: &Arc<CompletionQueue>, flags: Flags) -> Result<()> {
        let enabled = self.caps.get().is_some();
        let mut c = lock(&self.ctl);
        self.signalling.bind_cq(&mut c.cqs, cq, flags, enabled)
    }

    /// Binds a counter for `FI_SEND` and/or `FI_RECV` completions, before `enable`.
    pub fn bind_cntr(&self, cntr: &Arc<Counter>, flags: Flags) -> Result<()> {
        if flags.intersects(Flags::READ | Flags::WRITE) {
            return Err(Error::new(
                errno::EINVAL,
                "datagram endpoints have no RMA: bind counters for FI_SEND and/or FI_RECV",
            ));
        }
        let enabled = self.caps.get().is_some();
        let mut c = lock(&self.ctl);
        self.signalling.bind_cntr(&mut c.cqs, cntr, flags, enabled)
    }

    /// Binds the address vector whose addresses sends name (`fi_ep_bind` of an AV).
    pub fn bind_av(&self, av: &Arc<AddressVector>) -> Result<()> {
        self.check_not_enabled("the address vector")?;
        if !Arc::ptr_eq(av.domain(), &self.domain) {
            return Err(Error::new(
                errno::EINVAL,
                "the address vector belongs to another domain",
            ));
        }
        bind_once(&mut lock(&self.ctl).av, av, "an address vector")
    }

    /// Binds the event queue that multicast joins complete on (`fi_ep_bind` of an EQ).
    pub fn bind_eq(&self, eq: &Arc<EventQueue>) -> Result<()> {
        bind_once(&mut lock(&self.ctl).eq, eq, "an event queue")
    }

    /// Joins the multicast group `group` (`fi_join`): `FI_JOIN_COMPLETE` with `context`
    /// arrives on the bound EQ, after which [`Multicast::mc_addr`] is the address to send to
    /// with `FI_MULTICAST`. `flags`: `FI_SEND` and/or `FI_RECV` restrict the join (none: both;
    /// a send-only member does not receive the group's datagrams). Dropping the returned
    /// object leaves the group.
    pub fn join(
        self: &Arc<Self>,
        group: &SocketAddr,
        flags: Flags,
        context: u64,
    ) -> Result<Multicast> {
        if !self.info.caps.contains(Flags::MULTICAST) {
            return Err(Error::new(
                errno::EINVAL,
                "multicast needs FI_MULTICAST in the endpoint's caps: ask fi_getinfo for it",
            ));
        }
        if !(flags - (Flags::SEND | Flags::RECV)).is_empty() {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!(
                    "join flags {:?}: FI_SEND and/or FI_RECV",
                    flags - (Flags::SEND | Flags::RECV)
                ),
            ));
        }
        if !group.ip().is_multicast() {
            return Err(Error::new(
                errno::EINVAL,
                format!("{} is not a multicast address", group.ip()),
            ));
        }
        self.qp()?;
        let eq = lock(&self.ctl).eq.clone().ok_or_else(|| {
            Error::new(
                errno::ENOEQ,
                "bind an event queue first: FI_JOIN_COMPLETE is reported there",
            )
        })?;
        let ip = self.domain.device().ipv4.ok_or_else(|| {
            Error::new(
                errno::EADDRNOTAVAIL,
                "the device has no IPv4 address to join a group from",
            )
        })?;
        let id = CmId::new_udp(Some(eq.channel())).map_err(os_err("rdma_create_id"))?;
        id.bind_addr(&SocketAddr::new(ip.into(), 0))
            .map_err(os_err("rdma_bind_addr"))?;
        let sh = Arc::new(McShared {
            id,
            group: *group,
            recv: flags.contains(Flags::RECV) || !flags.contains(Flags::SEND),
            ep: self.clone(),
            eq: eq.clone(),
            joined: OnceLock::new(),
        });
        eq.register(
            sh.id.ident(),
            Owner::Multicast {
                fid: context,
                mc: Arc::downgrade(&(sh.clone() as Arc<dyn CmJoin>)),
            },
        );
        if let Err(e) = sh.id.join_multicast(group) {
            eq.unregister(sh.id.ident());
            return Err(Error::os(e, format!("rdma_join_multicast {group}")));
        }
        Ok(Multicast { sh })
    }

    /// Creates the UD queue pair (`fi_enable`).
    pub fn enable(&self) -> Result<()> {
        let mut c = lock(&self.ctl);
        if self.caps.get().is_some() {
            return Ok(());
        }
        let Some(av) = c.av.clone() else {
            return Err(Error::new(
                errno::ENOAV,
                "bind an address vector before enabling: sends name their peers through it",
            ));
        };
        let dev = self.domain.device();
        let mut want = wanted_caps(&self.info, &dev.attr, None, None);
        // One more element per receive for the overflow sink.
        want.max_recv_sge = (want.max_recv_sge + 1).min(dev.attr.max_sge);
        let sink = MemoryRegion::alloc(&self.domain, self.max_msg_size.max(1), Flags::RECV)?;
        let _ = self.sink.set(sink);
        if !self.prefix {
            // One more element per receive: the provider's GRH slot.
            want.max_recv_sge = (want.max_recv_sge + 1).min(dev.attr.max_sge);
            // With FI_SOURCE a slot per receive until its completion is read; else one
            // slot that every receive overwrites.
            let slots = if self.track_grh {
                2 * want.max_recv_wr as usize
            } else {
                1
            };
            let mr = MemoryRegion::alloc(&self.domain, slots * GRH_LEN, Flags::RECV)?;
            let _ = self.grh.set(mr);
            let mut t = lock(&self.track);
            t.free = (0..slots).rev().collect();
            t.ring.reserve(slots);
        }
        c.cqs.reserve(want.max_send_wr, want.max_recv_wr)?;
        let (Some(tx), Some(rx)) = (c.cqs.tx_cq.clone(), c.cqs.rx_cq.clone()) else {
            unreachable!("reserve checked both CQs are bound")
        };
        let (qp, got) = match UdQp::new(
            self.domain.pd(),
            tx.raw(),
            rx.raw(),
            want,
            dev.port.port_num,
            DGRAM_QKEY,
        ) {
            Ok(q) => q,
            Err(e) => {
                c.cqs.unreserve();
                return Err(Error::os(e, format!("creating a UD QP ({want:?})")));
            }
        };
        crate::fi_debug!("ep", "UD QP {} created: {:?}", qp.qp_num(), got);
        c.cqs.count_on(qp.qp_num());
        // Plain receives are the CQ's to report (one such endpoint per CQ): until another
        // kind is posted, the CQ reads them with no owner to find and no lock to order it.
        let (mut plain, mut recv_base, mut grh) = (false, 0, Sge::default());
        if !self.prefix && !self.track_grh && rx.claim_plain_ud() {
            match self.grh.get().and_then(|m| m.sys().sge(0, GRH_LEN)) {
                Some(g) => {
                    let flags = self.info.rx_attr.op_flags;
                    if (flags - Flags::COMPLETION).is_empty() {
                        let suppressed = self.signalling.recv_suppressed(flags);
                        recv_base = wr_id::encode(0, Kind::DgramPlain, suppressed);
                    }
                    (plain, grh) = (true, g);
                }
                None => rx.release_plain_ud(),
            }
        }
        let _ = self.ready.set(Ready {
            qp,
            av,
            rx_cq: rx,
            plain,
            recv_base,
            grh,
        });
        self.signalling.set_tx_depth(got.max_send_wr);
        self.signalling.fix_default(self.info.tx_attr.op_flags);
        // `fi_send` posts straight when its default flags hold nothing but `FI_COMPLETION`
        // and there is no prefix to skip.
        if (self.info.tx_attr.op_flags - Flags::COMPLETION).is_empty() && !self.prefix {
            self.sends.open_plain(wr_id::encode(0, Kind::Send, false));
        }
        let _ = self.caps.set(got);
        Ok(())
    }

    /// The CQ that reports this endpoint's plain receives, when it does.
    #[inline(always)]
    fn plain_rx(&self) -> Option<&Arc<CompletionQueue>> {
        self.ready.get().filter(|r| r.plain).map(|r| &r.rx_cq)
    }

    #[inline]
    fn qp(&self) -> Result<&QpHandle> {
        self.ready
            .get()
            .map(|r| r.qp.handle())
            .ok_or_else(not_enabled)
    }

    /// The endpoint's name, what a peer inserts into its address vector (`fi_getname`).
    pub fn getname(&self) -> Result<UdName> {
        let qp = self.ready.get().map(|r| &r.qp).ok_or_else(|| {
            Error::new(
                errno::EADDRNOTAVAIL,
                "a datagram endpoint has its name once enabled",
            )
        })?;
        Ok(UdName {
            gid: self.domain.device().ud_gid,
            qpn: qp.qp_num(),
            qkey: DGRAM_QKEY,
        })
    }

    /// `fi_getname` into a caller's buffer, with fi_cm(3)'s `addrlen` rules.
    pub fn getname_into(&self, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        fill_name(&self.getname()?.to_bytes(), buf, addrlen)
    }

    /// `FI_MSG_PREFIX` in force: buffers start with `msg_prefix_size` (40) bytes.
    pub fn prefix_size(&self) -> usize {
        if self.prefix {
            GRH_LEN
        } else {
            0
        }
    }

    /// The largest datagram payload: the port's active path MTU.
    pub fn max_msg_size(&self) -> usize {
        self.max_msg_size
    }

    /// The largest payload sent inline (`inject_size`).
    pub fn inject_size(&self) -> usize {
        self.qp().map(|q| q.max_inline() as usize).unwrap_or(0)
    }

    /// The payload of a send buffer: after the prefix in prefix mode. The datagram size
    /// is checked where the whole payload is known.
    fn payload(&self, offset: usize, len: usize) -> Result<(usize, usize)> {
        let p = self.prefix_size();
        if len < p {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "{len} bytes: in FI_MSG_PREFIX mode a buffer starts with {p} bytes of prefix"
                ),
            ));
        }
        Ok((offset + p, len - p))
    }

    /// Sends `len` bytes at `offset` of `mr` to `dest`, an address of the bound AV (`fi_send`).
    #[inline]
    pub fn send(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        dest: u64,
        context: u64,
    ) -> Result<()> {
        // Nothing to apply but FI_COMPLETION, no prefix to skip, no chain to join: straight.
        if let Some(base) = self.sends.plain() {
            return self.send_plain(mr, offset, len, dest, context, base);
        }
        self.sendmsg(
            mr,
            offset,
            len,
            dest,
            context,
            0,
            self.info.tx_attr.op_flags,
        )
    }

    /// `fi_send` with nothing to apply: the id's kind bits `base` from the send gate, the
    /// signalling fixed at enable.
    #[inline(always)]
    fn send_plain(
        &self,
        mr: &MemoryRegion,
        off: usize,
        len: usize,
        dest: u64,
        context: u64,
        base: u64,
    ) -> Result<()> {
        let r = self.check_one(mr, len, context)?;
        // `len` is within the datagram size, so within a u32.
        let sge = mr
            .sys()
            .region_sge(off, len as u32)
            .ok_or_else(|| mr.range_error(off, len))?;
        let (id, vflags) = self.signalling.send_default(context | base);
        r.av.post_to_peer(
            dest,
            #[inline(always)]
            |to| {
                r.qp.handle()
                    .post_ud_sge(id, sge, vflags, to)
                    .map_err(|e| post_error(e, "send"))
            },
        )
    }

    /// One range posted at once (no `FI_MORE` chain): the whole of a plain send.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn send_one(
        &self,
        mr: &MemoryRegion,
        off: usize,
        len: usize,
        dest: u64,
        context: u64,
        imm: Option<u32>,
        flags: Flags,
    ) -> Result<()> {
        let qp = self.check_one(mr, len, context)?.qp.handle();
        let (id, vflags) = self.send_slot(context, imm, flags);
        self.to_peer(
            dest,
            #[inline(always)]
            |to| qp.post_ud_mr(id, mr.sys(), off, len, vflags, imm, to),
        )?
        .map_err(|e| region_post_error(e, mr, off, len, "send"))
    }

    /// The checks of a send of `len` bytes of `mr` with `context`, and the enabled state.
    #[inline(always)]
    fn check_one(&self, mr: &MemoryRegion, len: usize, context: u64) -> Result<&Ready> {
        wr_id::check(context)?;
        self.check_size(len)?;
        check_domain(mr, &self.domain)?;
        self.ready.get().ok_or_else(not_enabled)
    }

    /// `EMSGSIZE` past the datagram size.
    #[inline]
    fn check_size(&self, total: usize) -> Result<()> {
        if total > self.max_msg_size {
            return Err(Error::new(
                errno::EMSGSIZE,
                format!(
                    "{total} bytes exceed the datagram size {} (the path MTU)",
                    self.max_msg_size
                ),
            ));
        }
        Ok(())
    }

    /// The work request id and verbs flags of a send (signalled as `flags` ask).
    #[inline(always)]
    fn send_slot(&self, context: u64, imm: Option<u32>, flags: Flags) -> (u64, u32) {
        let kind = wr_id::send_kind(imm);
        self.signalling
            .send(wr_id::encode(context, kind, false), flags)
    }

    /// `fi_senddata`: a send carrying 4 bytes of remote CQ data.
    #[allow(clippy::too_many_arguments)]
    pub fn senddata(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        data: u64,
        dest: u64,
        context: u64,
    ) -> Result<()> {
        let flags = self.info.tx_attr.op_flags | Flags::REMOTE_CQ_DATA;
        self.sendmsg(mr, offset, len, dest, context, data, flags)
    }

    /// `fi_sendmsg` with one range: `FI_COMPLETION`, `FI_INJECT`, `FI_REMOTE_CQ_DATA`,
    /// `FI_FENCE`, `FI_MORE` (chained for one doorbell, as on MSG endpoints; a multi-range
    /// `sendv` posts the chain first), the completion levels (a datagram meets
    /// transmit complete). `FI_MULTICAST` with a group's address from [`Multicast::mc_addr`].
    #[allow(clippy::too_many_arguments)]
    pub fn sendmsg(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        dest: u64,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        // FI_MULTICAST names a group's address (fi_mc_addr), which sends like any other.
        let (off, n) = self.payload(offset, len)?;
        check_sendmsg(flags - Flags::MULTICAST, n, self.inject_size())?;
        self.sendv_flags(&[(mr, off, n)], dest, context, data, flags)
    }

    /// `fi_sendv`: one datagram gathered from `iov` (in prefix mode the first range starts
    /// with the prefix).
    pub fn sendv(&self, iov: &[Iov<'_>], dest: u64, context: u64) -> Result<()> {
        self.sendmsgv(iov, dest, context, 0, self.info.tx_attr.op_flags)
    }

    /// `fi_sendmsg` with several ranges; `flags` and `data` as in [`Self::sendmsg`].
    pub fn sendmsgv(
        &self,
        iov: &[Iov<'_>],
        dest: u64,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        let Some(&(mr, offset, len)) = iov.first() else {
            return Err(Error::new(errno::EINVAL, "an empty iov"));
        };
        if iov.len() > MAX_IOV {
            return Err(Error::new(
                errno::EINVAL,
                format!("{} ranges exceed the iov limit {MAX_IOV}", iov.len()),
            ));
        }
        let mut v = [(mr, offset, len); MAX_IOV];
        v[..iov.len()].copy_from_slice(iov);
        let (off, n) = self.payload(offset, len)?;
        v[0] = (mr, off, n);
        let total = v[..iov.len()].iter().map(|r| r.2).sum();
        check_sendmsg(flags - Flags::MULTICAST, total, self.inject_size())?;
        self.sendv_flags(&v[..iov.len()], dest, context, data, flags)
    }

    fn sendv_flags(
        &self,
        iov: &[Iov<'_>],
        dest: u64,
        context: u64,
        data: u64,
        flags: Flags,
    ) -> Result<()> {
        let imm = send_imm(flags, data)?;
        if let [(mr, off, len)] = iov {
            if !flags.contains(Flags::MORE) && !self.sends.is_open() {
                // One range, nothing chained: one element, posted straight away.
                return self.send_one(mr, *off, *len, dest, context, imm, flags);
            }
        }
        wr_id::check(context)?;
        self.check_size(iov.iter().map(|v| v.2).sum())?;
        let qp = self.qp()?;
        let (id, vflags) = self.send_slot(context, imm, flags);
        let cq = || lock(&self.ctl).cqs.tx_cq.clone();
        if let [(mr, off, len)] = iov {
            check_domain(mr, &self.domain)?;
            let post_err = |e| region_post_error(e, mr, *off, *len, "send");
            // An inject's buffer is free on return: it ends the batch.
            let more = flags.contains(Flags::MORE) && !flags.contains(Flags::INJECT);
            return self.to_peer(dest, |to| {
                self.sends.add(qp, more, &cq, |ch| {
                    qp.chain_send(ch, id, mr.sys(), *off, *len, vflags, imm, Some(to))
                        .map_err(post_err)
                })
            })?;
        }
        with_slices(&self.domain, iov, |slices| {
            self.sends.ring(qp, &cq)?;
            self.to_peer(dest, |to| qp.post_ud_iov(id, slices, vflags, imm, to))?
                .map_err(|e| match e {
                    libc::E2BIG => Error::new(
                        errno::EINVAL,
                        format!("{} ranges exceed the iov limit", iov.len()),
                    ),
                    libc::EINVAL => {
                        Error::new(errno::EINVAL, "a range lies outside its memory region")
                    }
                    e => post_error(e, "send"),
                })
        })
    }

    /// `fi_inject`: sends `data` inline to `dest` with no completion; the buffer is free on return.
    pub fn inject(&self, data: &[u8], dest: u64) -> Result<()> {
        self.post_inject(data, None, dest)
    }

    /// `fi_injectdata`: `inject` with remote CQ data.
    pub fn injectdata(&self, data: &[u8], cq: u64, dest: u64) -> Result<()> {
        self.post_inject(data, Some(cq_data(cq)?), dest)
    }

    fn post_inject(&self, data: &[u8], imm: Option<u32>, dest: u64) -> Result<()> {
        let (off, n) = self.payload(0, data.len())?;
        let data = &data[off..off + n];
        check_inject(data.len(), self.inject_size())?;
        let qp = self.qp()?;
        let kind = wr_id::send_kind(imm);
        let (id, vflags) = self.signalling.unsignaled(wr_id::encode(0, kind, false));
        self.sends.ring(qp, &|| lock(&self.ctl).cqs.tx_cq.clone())?;
        self.to_peer(dest, |to| qp.post_ud_inline(id, data, vflags, imm, to))?
            .map_err(|e| post_error(e, "send"))
    }

    /// Runs `post` with the destination of `dest`.
    #[inline(always)]
    fn to_peer<R>(&self, dest: u64, post: impl FnOnce(&UdDest) -> R) -> Result<R> {
        let av = &self.ready.get().ok_or_else(not_enabled)?.av;
        av.with_peer(dest, post)
    }

    /// Posts a receive of up to `len` bytes at `offset` of `mr` (`fi_recv`). In prefix
    /// mode the first 40 bytes receive the GRH and the length reported includes them.
    #[inline(always)]
    pub fn recv(&self, mr: &MemoryRegion, offset: usize, len: usize, context: u64) -> Result<()> {
        // A plain receive (room for any datagram, on an endpoint whose CQ reports them: no
        // prefix, no GRH kept for FI_SOURCE, default flags): the provider's GRH slot and the
        // range, straight.
        if let Some(r) = self.ready.get().filter(|r| {
            r.recv_base != 0
                && len >= self.max_msg_size
                && context & !wr_id::CONTEXT == 0
                && Arc::ptr_eq(mr.domain(), &self.domain)
        }) {
            // The element covers a whole datagram (the rest of a longer range is never
            // written), checked against the whole range.
            let sge = mr
                .sys()
                .sge_within(offset, len, self.max_msg_size as u32)
                .ok_or_else(|| mr.range_error(offset, len))?;
            r.qp.handle()
                .post_recv_pair(context | r.recv_base, r.grh, sge)
                .map_err(|e| post_error(e, "receive"))?;
            // All posted ones reported: the queue was empty (the first post finds 0 and 0,
            // which `queue_was_dry` knows for no episode).
            let before = self.plain_posted.fetch_add(1, Ordering::Relaxed);
            if before == r.rx_cq.plain_ud_done() && self.outstanding.load(Ordering::Relaxed) == 0 {
                self.queue_was_dry(Some(before));
            }
            return Ok(());
        }
        self.recvmsg(mr, offset, len, context, self.info.rx_attr.op_flags)
    }

    /// `fi_recvmsg` with one range: `FI_COMPLETION` under selective completion, `FI_MORE`
    /// (posted at once). Out of line, so that `recv`'s plain path inlines alone.
    #[inline(never)]
    pub fn recvmsg(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        check_recv_flags(flags, Flags::empty())?;
        self.recvv_flags(&[(mr, offset, len)], context, flags)
    }

    /// `fi_recvv`: one datagram scattered over `iov`.
    pub fn recvv(&self, iov: &[Iov<'_>], context: u64) -> Result<()> {
        self.recvv_flags(iov, context, self.info.rx_attr.op_flags)
    }

    /// `fi_recvmsg` with several ranges: `FI_COMPLETION` and `FI_MORE`.
    pub fn recvmsgv(&self, iov: &[Iov<'_>], context: u64, flags: Flags) -> Result<()> {
        check_recv_flags(flags, Flags::empty())?;
        self.recvv_flags(iov, context, flags)
    }

    fn recvv_flags(&self, iov: &[Iov<'_>], context: u64, flags: Flags) -> Result<()> {
        // A receive takes a GRH slot, its ranges and an overflow element: most fit in 4,
        // whose array is cheaper to set up than one of MAX_IOV.
        if iov.len() + 2 <= 4 {
            self.post_recv_sges::<4>(iov, context, flags)
        } else {
            self.post_recv_sges::<MAX_IOV>(iov, context, flags)
        }
    }

    fn post_recv_sges<const N: usize>(
        &self,
        iov: &[Iov<'_>],
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        wr_id::check(context)?;
        let qp = self.qp()?;
        if !self.owner_registered.load(Ordering::Acquire) {
            self.register_owner(qp);
        }
        let suppressed = self.signalling.recv_suppressed(flags);
        let first = iov
            .first()
            .ok_or_else(|| Error::new(errno::EINVAL, "an empty iov"))?;
        if self.prefix && first.2 < GRH_LEN {
            return Err(Error::new(
                errno::EINVAL,
                format!("in FI_MSG_PREFIX mode a receive buffer starts with {GRH_LEN} bytes for the GRH"),
            ));
        }
        let slots = usize::from(self.grh.get().is_some());
        let capacity = iov.iter().map(|v| v.2).sum::<usize>() - self.prefix_size();
        let short = capacity < self.max_msg_size;
        if iov.len() + slots + usize::from(short) > N {
            return Err(Error::new(
                errno::EINVAL,
                format!("{} ranges exceed the iov limit", iov.len()),
            ));
        }
        let mut sges = [Sge::default(); N];
        for (g, (mr, off, len)) in sges[slots..].iter_mut().zip(iov) {
            *g = region_sge(mr, &self.domain, *off, *len)?;
        }
        let n = slots + iov.len();
        let kind = if short {
            let sink = self.sink.get().ok_or_else(not_enabled)?;
            sges[n] = region_sge(sink, &self.domain, 0, self.max_msg_size - capacity)?;
            Kind::DgramShort
        } else {
            Kind::DgramRecv
        };
        let id = wr_id::encode(context, kind, suppressed);
        // With FI_SOURCE each receive's GRH must stay until its completion is read: it gets
        // its own slot (or its own prefix), remembered in posting order, which is the
        // order UD receives complete in.
        let mut track = (self.track_grh || short).then(|| lock(&self.track));
        let loc = match (self.grh.get(), track.as_deref_mut()) {
            (Some(mr), Some(t)) if self.track_grh => {
                let slot = t.free.pop().ok_or_else(|| {
                    Error::new(
                        errno::EAGAIN,
                        "receive queue full: read the CQ to free room",
                    )
                })?;
                sges[0] = region_sge(mr, &self.domain, slot * GRH_LEN, GRH_LEN)?;
                Some(GrhLoc::Slot(slot))
            }
            (Some(mr), _) => {
                sges[0] = region_sge(mr, &self.domain, 0, GRH_LEN)?;
                None
            }
            (None, _) if self.track_grh => Some(GrhLoc::App(first.0.clone(), first.1)),
            (None, _) => None,
        };
        let r = qp.post_recv(id, &sges[..n + usize::from(short)]);
        if let Some(t) = track.as_deref_mut() {
            match (&r, loc) {
                (Ok(()), Some(l)) => t.ring.push_back(l),
                (Err(_), Some(GrhLoc::Slot(slot))) => t.free.push(slot),
                _ => {}
            }
            if r.is_ok() && short {
                t.short.push_back(capacity);
            }
        }
        r.map_err(|e| match e {
            libc::EINVAL => Error::new(
                errno::EINVAL,
                format!("{} ranges exceed the iov limit", iov.len()),
            ),
            e => post_error(e, "receive"),
        })?;
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Its receive CQ sends it the completions of the receives it places itself.
    #[cold]
    fn register_owner(&self, qp: &QpHandle) {
        let c = lock(&self.ctl);
        if self.owner_registered.load(Ordering::Acquire) {
            return;
        }
        if let Some(rx) = &c.cqs.rx_cq {
            let owner: Weak<dyn RecvOwner> = self.me.clone();
            rx.register_owner(qp.qp_num(), owner);
        }
        self.owner_registered.store(true, Ordering::Release);
    }

    /// The receive queue went empty (datagrams arriving then were dropped): said once as a
    /// warning, after that at `FI_LOG_LEVEL=info`. Seen by the CQ's count of plain
    /// receives (`Some` of the `plain_posted` all were reported at: one episode, however
    /// many times it is seen, counts once), or by the completion of the last other one.
    #[cold]
    fn queue_was_dry(&self, plain: Option<u64>) {
        let mark = plain.unwrap_or_else(|| self.plain_posted.load(Ordering::Relaxed));
        if self.dry_mark.swap(mark, Ordering::AcqRel) == mark && plain.is_some() {
            return;
        }
        let n = self.dry.fetch_add(1, Ordering::Relaxed);
        let msg = format!(
            "UD QP {}: no receive was posted for a while; datagrams arriving then were dropped (post receives sooner, or more of them)",
            self.qp().map_or(0, |q| q.qp_num())
        );
        if n == 0 {
            crate::fi_warn!("ep", "{msg}");
        } else {
            crate::fi_info!("ep", "{msg}");
        }
    }

    /// Plain receives posted and not yet reported by the CQ.
    #[inline]
    fn plain_outstanding(&self) -> u64 {
        match self.plain_rx() {
            Some(p) => self
                .plain_posted
                .load(Ordering::Relaxed)
                .saturating_sub(p.plain_ud_done()),
            None => 0,
        }
    }

    /// How many times the receive queue ran dry (datagrams arriving then were dropped).
    pub fn rx_dry_events(&self) -> u64 {
        // Plain receives are seen dry here or at the next post, whichever comes first.
        if let Some(p) = self.plain_rx() {
            let posted = self.plain_posted.load(Ordering::Relaxed);
            if posted != 0
                && posted == p.plain_ud_done()
                && self.outstanding.load(Ordering::Relaxed) == 0
            {
                self.queue_was_dry(Some(posted));
            }
        }
        self.dry.load(Ordering::Relaxed)
    }

    /// The 40 bytes of GRH the next completion's datagram brought.
    fn take_grh(&self) -> Option<[u8; GRH_LEN]> {
        let mut t = lock(&self.track);
        let loc = t.ring.pop_front()?;
        let mut grh = [0u8; GRH_LEN];
        let read = match &loc {
            GrhLoc::Slot(slot) => self
                .grh
                .get()
                .map(|mr| mr.read_at(slot * GRH_LEN, &mut grh)),
            GrhLoc::App(mr, off) => Some(mr.read_at(*off, &mut grh)),
        };
        if let GrhLoc::Slot(slot) = loc {
            t.free.push(slot);
        }
        read.and_then(|r| r.ok()).map(|_| grh)
    }
}

/// Where a posted receive's GRH lands.
#[derive(Debug)]
enum GrhLoc {
    /// A provider slot of this index.
    Slot(usize),
    /// The prefix at this offset of the application's region.
    App(MemoryRegion, usize),
}

/// The GRH places of posted receives, in posting order (with `FI_SOURCE`).
#[derive(Debug, Default)]
struct GrhTrack {
    ring: VecDeque<GrhLoc>,
    free: Vec<usize>,
    /// Payload capacities of the receives posted short of the MTU, in posting order.
    short: VecDeque<usize>,
}

/// The sender's GID from a GRH. RoCE v2 over IPv4 leaves the first 20 bytes zero and puts
/// the IPv4 header in the last 20: the GID is the IPv4-mapped source address.
fn source_gid(grh: &[u8; GRH_LEN]) -> [u8; 16] {
    let mut gid = [0u8; 16];
    if grh[..20].iter().all(|&b| b == 0) && grh[20] >> 4 == 4 {
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&grh[32..36]);
    } else {
        gid.copy_from_slice(&grh[8..24]);
    }
    gid
}

/// Whether a GRH's destination is a multicast group: IPv4 224.0.0.0/4 in the IPv4 header
/// RoCE v2 leaves in the last 20 bytes, else an `ff00::/8` destination GID.
fn to_a_group(grh: &[u8; GRH_LEN]) -> bool {
    if grh[..20].iter().all(|&b| b == 0) && grh[20] >> 4 == 4 {
        (224..=239).contains(&grh[36])
    } else {
        grh[24] == 0xff
    }
}

impl RecvOwner for DgramEndpoint {
    fn recv_completion(&self, wc: &WorkCompletion) -> Option<Owned> {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1
            && wc.status() == st::IBV_WC_SUCCESS
            && self.plain_outstanding() == 0
        {
            self.queue_was_dry(None);
        }
        let grh = if self.track_grh {
            self.take_grh()
        } else {
            None
        };
        let id = wc.wr_id();
        let capacity = if wr_id::is_kind(id, Kind::DgramShort) {
            lock(&self.track).short.pop_front()
        } else {
            None
        };
        if wc.status() != st::IBV_WC_SUCCESS {
            return Some(Owned::Errors(vec![to_err_entry(wc)]));
        }
        let mut e = to_entry(wc);
        if !self.prefix {
            e.len = e.len.saturating_sub(GRH_LEN);
        }
        let payload = (wc.byte_len() as usize).saturating_sub(GRH_LEN);
        if let Some(cap) = capacity.filter(|&c| payload > c) {
            // The rest went to the sink: the receive holds the first `cap` bytes.
            return Some(Owned::Errors(vec![CqErrEntry {
                op_context: e.op_context,
                flags: e.flags,
                len: cap + self.prefix_size(),
                data: e.data,
                olen: payload - cap,
                err: errno::ETRUNC,
                ..Default::default()
            }]));
        }
        let mut from = FI_ADDR_NOTAVAIL;
        let grh = grh.filter(|_| wc.has_grh());
        if grh.as_ref().is_some_and(to_a_group) {
            e.flags |= Flags::MULTICAST.bits();
        }
        if let Some(grh) = grh.filter(|_| self.source) {
            let name = UdName {
                gid: source_gid(&grh),
                qpn: wc.src_qp(),
                qkey: DGRAM_QKEY,
            };
            match self.ready.get().and_then(|r| r.av.find(&name)) {
                Some(a) => from = a,
                None if self.source_err => {
                    return Some(Owned::Errors(vec![CqErrEntry {
                        op_context: e.op_context,
                        flags: e.flags,
                        len: e.len,
                        data: e.data,
                        err: errno::EADDRNOTAVAIL,
                        err_data: name.to_bytes().to_vec(),
                        ..Default::default()
                    }]));
                }
                None => {}
            }
        }
        if wr_id::is_suppressed(id) {
            return None;
        }
        Some(Owned::Entry(e, from))
    }
}

/// A multicast group a datagram endpoint joined (`fi_join`). Dropping it leaves the group.
#[derive(Debug)]
pub struct Multicast {
    sh: Arc<McShared>,
}

impl Multicast {
    /// The address to send to with `FI_MULTICAST` (`fi_mc_addr`), once `FI_JOIN_COMPLETE`
    /// was seen.
    pub fn mc_addr(&self) -> Result<u64> {
        self.sh.joined.get().map(|(_, a)| *a).ok_or_else(|| {
            Error::new(
                errno::EOPBADSTATE,
                "the join has not completed: wait for FI_JOIN_COMPLETE on the EQ",
            )
        })
    }
}

/// A join's state, shared with the EQ that completes it.
#[derive(Debug)]
pub(crate) struct McShared {
    id: CmId,
    group: SocketAddr,
    /// Attach the endpoint's QP: it receives the group's datagrams.
    recv: bool,
    ep: Arc<DgramEndpoint>,
    eq: Arc<EventQueue>,
    /// The group's route and its address in the endpoint's AV, once joined.
    joined: OnceLock<(McastGroup, u64)>,
}

impl CmJoin for McShared {
    /// `RDMA_CM_EVENT_MULTICAST_JOIN`: an address handle to the group in the AV, and the QP
    /// attached when the join receives.
    fn joined(&self, g: &McastGroup) -> Result<()> {
        let ep = &self.ep;
        let r = ep.ready.get().ok_or_else(not_enabled)?;
        let (qp, av) = (&r.qp, &r.av);
        let ah = AddressHandle::for_group(ep.domain.pd(), g).map_err(os_err("ibv_create_ah"))?;
        if self.recv {
            qp.attach_mcast(g).map_err(os_err("ibv_attach_mcast"))?;
        }
        // Datagrams to a group go to every attached QP: QP number 0xFFFFFF.
        let dest = UdDest {
            ah,
            qpn: 0xff_ffff,
            qkey: DGRAM_QKEY,
        };
        let name = UdName {
            gid: g.gid(),
            qpn: dest.qpn,
            qkey: dest.qkey,
        };
        let addr = av.insert_dest(&name, dest);
        crate::fi_info!("ep", "joined {} as fi_addr {addr:#x}", self.group);
        let _ = self.joined.set((*g, addr));
        Ok(())
    }
}

impl Drop for McShared {
    fn drop(&mut self) {
        self.eq.unregister(self.id.ident());
        if let Some((g, addr)) = self.joined.get() {
            if self.recv {
                if let Some(qp) = self.ep.ready.get().map(|r| &r.qp) {
                    if let Err(e) = qp.detach_mcast(g) {
                        crate::fi_debug!("ep", "ibv_detach_mcast: errno {e}");
                    }
                }
            }
            if let Some(av) = self.ep.ready.get().map(|r| &r.av) {
                let _ = av.remove(*addr);
            }
        }
        if let Err(e) = self.id.leave_multicast(&self.group) {
            crate::fi_debug!("ep", "rdma_leave_multicast {}: errno {e}", self.group);
        }
    }
}
