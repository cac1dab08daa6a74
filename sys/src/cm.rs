//! Owned handles over rdma_cm: event channels, communication identifiers and their events.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, OnceLock};

use rdma_sys as r;

use crate::last_errno;
use crate::verbs::{warn, Context, Cq, ProtectionDomain, QpCaps, QpHandle, Srq};

/// Largest private data rdma_cm carries on a connect request (IB CM REQ less its header).
pub const CONNECT_PRIVATE_DATA_MAX: usize = 56;
/// Largest private data on an accept (IB CM REP less rdma_cm's use).
pub const ACCEPT_PRIVATE_DATA_MAX: usize = 196;
/// Largest private data on a reject (IB CM REJ).
pub const REJECT_PRIVATE_DATA_MAX: usize = 148;

/// `rdma_cm_event_type` values.
pub mod event {
    pub use rdma_sys::rdma_cm_event_type::*;
}

/// Converts a socket address to the C form rdma_cm takes.
pub fn to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { ptr::write(ptr::addr_of_mut!(ss).cast::<libc::sockaddr_in>(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { ptr::write(ptr::addr_of_mut!(ss).cast::<libc::sockaddr_in6>(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Reads an IPv4 or IPv6 socket address. `None` for other families or NULL.
///
/// # Safety
/// `sa` is NULL or points to a sockaddr whose family field tells its real size.
pub unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: non-NULL per the caller; every sockaddr starts with its family.
    let family = unsafe { (*sa).sa_family } as i32;
    match family {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s.sin6_port),
                u32::from_be(s.sin6_flowinfo),
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// An rdma_cm event channel: the file descriptor that CM events arrive on.
#[derive(Debug)]
pub struct EventChannel {
    ch: NonNull<r::rdma_event_channel>,
}

// SAFETY: the channel is a file descriptor; rdma_get_cm_event is a read on it.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

/// A CM event, copied out of rdma_cm and acknowledged.
#[derive(Debug)]
pub struct CmEvent {
    pub kind: u32,
    pub status: i32,
    /// Identity of the cm_id the event is for (see [`CmId::ident`]).
    pub id: usize,
    /// Identity of the listening cm_id, for connect requests.
    pub listen_id: usize,
    /// Private data as delivered (for connect requests, padded to the transport's size).
    pub private_data: Vec<u8>,
    /// The new identifier of a connect request, now owned by the receiver of the event.
    pub new_id: Option<CmId>,
    /// A multicast join's group: the route to it (address handle attributes).
    pub mcast: Option<McastGroup>,
}

/// A joined multicast group, from `RDMA_CM_EVENT_MULTICAST_JOIN`.
#[derive(Clone, Copy)]
pub struct McastGroup {
    pub(crate) ah_attr: r::ibv_ah_attr,
}

impl std::fmt::Debug for McastGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McastGroup")
            .field("gid", &self.gid())
            .field("lid", &self.lid())
            .finish()
    }
}

impl McastGroup {
    /// The group's GID (for RoCE, the IPv4-mapped or IPv6 multicast address).
    pub fn gid(&self) -> [u8; 16] {
        // SAFETY: the raw view of the union is always valid bytes.
        unsafe { self.ah_attr.grh.dgid.raw }
    }

    pub fn lid(&self) -> u16 {
        self.ah_attr.dlid
    }
}

impl EventChannel {
    pub fn new() -> Result<Self, i32> {
        // SAFETY: no arguments; returns NULL with errno on failure.
        let ch = unsafe { r::rdma_create_event_channel() };
        let ch = NonNull::new(ch).ok_or_else(last_errno)?;
        let me = EventChannel { ch };
        let fd = me.fd();
        // SAFETY: fcntl on a descriptor we own.
        let rc = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(last_errno());
        }
        Ok(me)
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: valid channel.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    /// The channel's descriptor, borrowed for polling.
    pub fn borrow_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until the channel is destroyed in Drop, which
        // cannot happen while &self is borrowed.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd()) }
    }

    /// The next event, or `None` when none is pending (the channel is non-blocking).
    pub fn get_event(self: &Arc<Self>) -> Result<Option<CmEvent>, i32> {
        let mut ev: *mut r::rdma_cm_event = ptr::null_mut();
        // SAFETY: valid channel; ev receives an event we acknowledge below.
        let rc = unsafe { r::rdma_get_cm_event(self.ch.as_ptr(), &mut ev) };
        if rc != 0 {
            let e = last_errno();
            return if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                Ok(None)
            } else {
                Err(e)
            };
        }
        // SAFETY: rdma_get_cm_event succeeded, so ev is a valid event until acked.
        let e = unsafe { &*ev };
        // SAFETY: conn is the active union member for connection events; for others the
        // pointer is NULL or the length 0, and we copy only when both are set.
        let (pd, pd_len) = unsafe { (e.param.conn.private_data, e.param.conn.private_data_len) };
        let private_data = if !pd.is_null() && pd_len > 0 {
            // SAFETY: rdma_cm says pd_len bytes are readable at pd.
            unsafe { std::slice::from_raw_parts(pd.cast::<u8>(), pd_len as usize) }.to_vec()
        } else {
            Vec::new()
        };
        let mcast = if e.event == event::RDMA_CM_EVENT_MULTICAST_JOIN {
            Some(McastGroup {
                // SAFETY: ud is the active union member for multicast events.
                ah_attr: unsafe { e.param.ud.ah_attr },
            })
        } else {
            None
        };
        let new_id = if e.event == event::RDMA_CM_EVENT_CONNECT_REQUEST {
            NonNull::new(e.id).map(|id| CmId {
                id,
                qp: OnceLock::new(),
                srq: OnceLock::new(),
                channel: Mutex::new(Some(self.clone())),
            })
        } else {
            None
        };
        let out = CmEvent {
            kind: e.event,
            status: e.status,
            id: e.id as usize,
            listen_id: e.listen_id as usize,
            private_data,
            new_id,
            mcast,
        };
        // SAFETY: ev came from rdma_get_cm_event and is acked once; nothing refers to it after.
        unsafe { r::rdma_ack_cm_event(ev) };
        Ok(Some(out))
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: ours; ids using it were migrated away or destroyed (they hold an Arc).
        unsafe { r::rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

/// `rdma_event_str`.
pub fn event_str(kind: u32) -> &'static str {
    // SAFETY: returns a static string for every value.
    let p = unsafe { r::rdma_event_str(kind) };
    if p.is_null() {
        return "RDMA_CM_EVENT_UNKNOWN";
    }
    // SAFETY: static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .unwrap_or("RDMA_CM_EVENT_UNKNOWN")
}

/// An rdma_cm communication identifier, and the QP created on it.
#[derive(Debug)]
pub struct CmId {
    id: NonNull<r::rdma_cm_id>,
    qp: OnceLock<QpHandle>,
    /// The shared receive queue the QP takes its receives from: freed after the QP.
    srq: OnceLock<Arc<Srq>>,
    /// rdma_destroy_id writes to the id's channel: keep it open until then.
    channel: Mutex<Option<Arc<EventChannel>>>,
}

/// An rdma_cm identifier whose queue pair exists, with the QP's posting side at hand: a
/// connected endpoint reaches its QP with no check per post.
#[derive(Debug)]
pub struct CmQp {
    /// A copy of `id`'s handle: lent out by reference only, so it cannot outlive `id`,
    /// which destroys the QP when it goes (after this field).
    qp: QpHandle,
    id: CmId,
}

impl CmQp {
    /// `id` with its queue pair; `id` back when it has none yet.
    pub fn new(id: CmId) -> Result<CmQp, CmId> {
        match id.qp().map(QpHandle::duplicate) {
            Some(qp) => Ok(CmQp { qp, id }),
            None => Err(id),
        }
    }

    #[inline(always)]
    pub fn id(&self) -> &CmId {
        &self.id
    }

    #[inline(always)]
    pub fn qp(&self) -> &QpHandle {
        &self.qp
    }
}

// SAFETY: rdma_cm calls on one id are serialised by the kernel; the id is destroyed only in Drop.
unsafe impl Send for CmId {}
// SAFETY: as above; posting through the QP is thread-safe in rdma-core providers.
unsafe impl Sync for CmId {}

fn check(rc: i32) -> Result<(), i32> {
    if rc == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

impl CmId {
    /// A new RC (`RDMA_PS_TCP`) identifier. Without a channel, calls on it are synchronous:
    /// address and route resolution block until done.
    pub fn new(channel: Option<&Arc<EventChannel>>) -> Result<Self, i32> {
        Self::with_port_space(channel, r::rdma_port_space::RDMA_PS_TCP)
    }

    /// An identifier in the UDP port space, as multicast joins need.
    pub fn new_udp(channel: Option<&Arc<EventChannel>>) -> Result<Self, i32> {
        Self::with_port_space(channel, r::rdma_port_space::RDMA_PS_UDP)
    }

    fn with_port_space(
        channel: Option<&Arc<EventChannel>>,
        ps: r::rdma_port_space::Type,
    ) -> Result<Self, i32> {
        let ch = channel.map_or(ptr::null_mut(), |c| c.ch.as_ptr());
        let mut id = ptr::null_mut();
        // SAFETY: ch is NULL or a valid channel; id receives the new identifier.
        check(unsafe { r::rdma_create_id(ch, &mut id, ptr::null_mut(), ps) })?;
        NonNull::new(id)
            .map(|id| CmId {
                id,
                qp: OnceLock::new(),
                srq: OnceLock::new(),
                channel: Mutex::new(channel.cloned()),
            })
            .ok_or(libc::ENOMEM)
    }

    /// A stable identity, equal to [`CmEvent::id`] for this identifier's events.
    pub fn ident(&self) -> usize {
        self.id.as_ptr() as usize
    }

    pub fn bind_addr(&self, addr: &SocketAddr) -> Result<(), i32> {
        let (mut ss, _) = to_sockaddr(addr);
        // SAFETY: valid id; ss holds a sockaddr of the right family.
        check(unsafe { r::rdma_bind_addr(self.id.as_ptr(), ptr::addr_of_mut!(ss).cast()) })
    }

    pub fn resolve_addr(
        &self,
        src: Option<&SocketAddr>,
        dst: &SocketAddr,
        timeout_ms: i32,
    ) -> Result<(), i32> {
        let mut s = src.map(to_sockaddr);
        let sp = s
            .as_mut()
            .map_or(ptr::null_mut(), |(ss, _)| ptr::addr_of_mut!(*ss).cast());
        let (mut d, _) = to_sockaddr(dst);
        // SAFETY: valid id; sp NULL or a sockaddr; d a sockaddr.
        check(unsafe {
            r::rdma_resolve_addr(
                self.id.as_ptr(),
                sp,
                ptr::addr_of_mut!(d).cast(),
                timeout_ms,
            )
        })
    }

    pub fn resolve_route(&self, timeout_ms: i32) -> Result<(), i32> {
        // SAFETY: valid id.
        check(unsafe { r::rdma_resolve_route(self.id.as_ptr(), timeout_ms) })
    }

    /// Joins the multicast group `group`; `RDMA_CM_EVENT_MULTICAST_JOIN` says when.
    pub fn join_multicast(&self, group: &SocketAddr) -> Result<(), i32> {
        let (mut ss, _) = to_sockaddr(group);
        // SAFETY: valid id; ss holds a sockaddr of the right family.
        check(unsafe {
            r::rdma_join_multicast(
                self.id.as_ptr(),
                ptr::addr_of_mut!(ss).cast(),
                ptr::null_mut(),
            )
        })
    }

    /// Leaves a group joined with [`Self::join_multicast`].
    pub fn leave_multicast(&self, group: &SocketAddr) -> Result<(), i32> {
        let (mut ss, _) = to_sockaddr(group);
        // SAFETY: valid id; ss holds a sockaddr of the right family.
        check(unsafe { r::rdma_leave_multicast(self.id.as_ptr(), ptr::addr_of_mut!(ss).cast()) })
    }

    pub fn listen(&self, backlog: i32) -> Result<(), i32> {
        // SAFETY: valid id.
        check(unsafe { r::rdma_listen(self.id.as_ptr(), backlog) })
    }

    /// Moves the identifier's future events to `channel`.
    pub fn migrate(&self, channel: &Arc<EventChannel>) -> Result<(), i32> {
        let mut cur = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, channel)) {
            return Ok(());
        }
        // SAFETY: valid id and channel; the lock serialises migrations of this id.
        check(unsafe { r::rdma_migrate_id(self.id.as_ptr(), channel.ch.as_ptr()) })?;
        *cur = Some(channel.clone());
        Ok(())
    }

    /// Puts the identifier back in synchronous mode: its calls wait for their own events,
    /// as an identifier made with no channel does (rdma_migrate_id with a NULL channel).
    pub fn migrate_sync(&self) -> Result<(), i32> {
        let mut cur = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if cur.is_none() {
            return Ok(());
        }
        // SAFETY: valid id; a NULL channel asks librdmacm for a private synchronous one.
        check(unsafe { r::rdma_migrate_id(self.id.as_ptr(), ptr::null_mut()) })?;
        *cur = None;
        Ok(())
    }

    /// The device context the identifier is bound to, once bound or resolved.
    pub fn context(&self) -> Option<Context> {
        // SAFETY: valid id; verbs is NULL until bound to a device.
        Context::from_raw(unsafe { (*self.id.as_ptr()).verbs })
    }

    pub fn port_num(&self) -> u8 {
        // SAFETY: valid id.
        unsafe { (*self.id.as_ptr()).port_num }
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: valid id; rdma_get_local_addr points into the id's route.
        unsafe { from_sockaddr(r::rdma_get_local_addr(&*self.id.as_ptr())) }
    }

    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: valid id; rdma_get_peer_addr points into the id's route.
        unsafe { from_sockaddr(r::rdma_get_peer_addr(&*self.id.as_ptr())) }
    }

    /// Creates an RC QP on this identifier. Returns the capacities granted.
    pub fn create_qp(
        &self,
        pd: &ProtectionDomain,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: Option<&Arc<Srq>>,
    ) -> Result<QpCaps, i32> {
        if self.qp.get().is_some() {
            return Err(libc::EBUSY);
        }
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = send_cq.as_ptr();
        attr.recv_cq = recv_cq.as_ptr();
        attr.qp_type = r::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap = r::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        if let Some(srq) = srq {
            // Receives come from the SRQ: the QP has no receive queue of its own.
            attr.srq = srq.as_ptr();
            attr.cap.max_recv_wr = 0;
            attr.cap.max_recv_sge = 0;
        }
        // SAFETY: valid id, PD and CQs of the id's device; the caller keeps PD and CQs alive
        // for as long as this id (the endpoint holds Arcs of them).
        check(unsafe { r::rdma_create_qp(self.id.as_ptr(), pd.as_ptr(), &mut attr) })?;
        if let Some(srq) = srq {
            let _ = self.srq.set(srq.clone());
        }
        let got = QpCaps {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_send_sge: attr.cap.max_send_sge,
            max_recv_sge: attr.cap.max_recv_sge,
            max_inline_data: attr.cap.max_inline_data,
        };
        // SAFETY: rdma_create_qp succeeded, so id->qp is set.
        let qp = NonNull::new(unsafe { (*self.id.as_ptr()).qp }).ok_or(libc::EIO)?;
        // Devices may grant more inline space than asked (rxe reports its whole WQE); sends
        // go inline only up to what the caller asked for, its inject size.
        let posting = QpCaps {
            max_inline_data: caps.max_inline_data,
            ..got
        };
        if self.qp.set(QpHandle::new(qp, &posting)).is_err() {
            // Another thread created one first: ours must go.
            // SAFETY: rdma_create_qp just succeeded on this id; no handle names this QP.
            unsafe { r::rdma_destroy_qp(self.id.as_ptr()) };
            return Err(libc::EBUSY);
        }
        Ok(got)
    }

    /// The QP, once created.
    #[inline]
    pub fn qp(&self) -> Option<&QpHandle> {
        self.qp.get()
    }

    fn conn_param(data: &[u8], retry_count: u8) -> r::rdma_conn_param {
        // SAFETY: plain data; zero is valid.
        let mut p: r::rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = data.as_ptr().cast();
        p.private_data_len = data.len().min(255) as u8;
        p.responder_resources = 1;
        p.initiator_depth = 1;
        // Transport retries before a send fails with a retry-exceeded error (3 bits).
        p.retry_count = retry_count.min(7);
        // 7 means retry forever on receiver-not-ready: a slow receiver never loses a message.
        p.rnr_retry_count = 7;
        p
    }

    pub fn connect(&self, private_data: &[u8], rd_atomic: u8, retry_count: u8) -> Result<(), i32> {
        if private_data.len() > CONNECT_PRIVATE_DATA_MAX {
            return Err(libc::EINVAL);
        }
        let mut p = Self::conn_param(private_data, retry_count);
        p.responder_resources = rd_atomic;
        p.initiator_depth = rd_atomic;
        // SAFETY: valid id; p points at private_data, alive for the call.
        check(unsafe { r::rdma_connect(self.id.as_ptr(), &mut p) })
    }

    pub fn accept(&self, private_data: &[u8], rd_atomic: u8, retry_count: u8) -> Result<(), i32> {
        if private_data.len() > ACCEPT_PRIVATE_DATA_MAX {
            return Err(libc::EINVAL);
        }
        let mut p = Self::conn_param(private_data, retry_count);
        p.responder_resources = rd_atomic;
        p.initiator_depth = rd_atomic;
        // SAFETY: valid id; p points at private_data, alive for the call.
        check(unsafe { r::rdma_accept(self.id.as_ptr(), &mut p) })
    }

    pub fn reject(&self, private_data: &[u8]) -> Result<(), i32> {
        if private_data.len() > REJECT_PRIVATE_DATA_MAX {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid id; the data is read during the call.
        check(unsafe {
            r::rdma_reject(
                self.id.as_ptr(),
                private_data.as_ptr().cast(),
                private_data.len() as u8,
            )
        })
    }

    pub fn disconnect(&self) -> Result<(), i32> {
        // SAFETY: valid id.
        check(unsafe { r::rdma_disconnect(self.id.as_ptr()) })
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if self.qp.take().is_some() {
            // SAFETY: the QP was created on this id; no QpHandle borrow outlives &mut self.
            unsafe { r::rdma_destroy_qp(self.id.as_ptr()) };
        }
        // SAFETY: ours; rdma_destroy_id waits for unacked events, and we ack every event
        // as soon as it is read, so this cannot block forever.
        if unsafe { r::rdma_destroy_id(self.id.as_ptr()) } != 0 {
            warn(&format!(
                "rdma_destroy_id failed: {}",
                std::io::Error::from_raw_os_error(last_errno())
            ));
        }
        // Only now may the channel go.
        self.channel
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}
