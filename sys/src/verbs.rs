//! Owned handles over rdma-core verbs objects.
//!
//! Soundness rests on two rules, stated once here:
//! 1. Every scatter/gather element handed to the device names memory through an lkey, and
//!    the device checks the range against the registration. Memory registered by
//!    [`MemoryRegion::alloc`] is owned by the region and freed only after a successful
//!    deregistration, after which the device can no longer reach it; memory registered by
//!    [`MemoryRegion::register`] is the caller's promise (see its `# Safety`).
//! 2. Data the CPU reads at post time (inline sends) is passed as a borrowed slice.
//!
//! Posting a work request is therefore safe: the worst a wrong [`Sge`] can do is fail with
//! a local protection error completion.

use std::alloc::{self, Layout};
use std::ffi::CStr;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use rdma_sys as r;

use crate::last_errno;

mod ud;
pub use ud::{AddressHandle, UdDest, UdQp, GRH_LEN};

/// The provider's data-path entries, called as verbs.h's inline functions call them:
/// straight through the context's ops table, which every provider fills (verbs.h calls
/// these entries without a check), so no test for a missing one.
mod entry {
    use super::r;

    /// `ibv_post_send`.
    ///
    /// # Safety
    /// `qp` is a live QP; `wr` a work request chain whose elements the provider may read.
    #[inline(always)]
    pub(super) unsafe fn post_send(
        qp: *mut r::ibv_qp,
        wr: *mut r::ibv_send_wr,
        bad: *mut *mut r::ibv_send_wr,
    ) -> i32 {
        // SAFETY: the caller's QP; providers always set post_send.
        unsafe { ((*(*qp).context).ops.post_send.unwrap_unchecked())(qp, wr, bad) }
    }

    /// `ibv_post_recv`.
    ///
    /// # Safety
    /// As [`post_send`].
    #[inline(always)]
    pub(super) unsafe fn post_recv(
        qp: *mut r::ibv_qp,
        wr: *mut r::ibv_recv_wr,
        bad: *mut *mut r::ibv_recv_wr,
    ) -> i32 {
        // SAFETY: the caller's QP; providers always set post_recv.
        unsafe { ((*(*qp).context).ops.post_recv.unwrap_unchecked())(qp, wr, bad) }
    }

    /// `ibv_poll_cq`.
    ///
    /// # Safety
    /// `cq` is a live CQ and `wc` has room for `n` entries.
    #[inline(always)]
    pub(super) unsafe fn poll_cq(cq: *mut r::ibv_cq, n: i32, wc: *mut r::ibv_wc) -> i32 {
        // SAFETY: the caller's CQ and room; providers always set poll_cq.
        unsafe { ((*(*cq).context).ops.poll_cq.unwrap_unchecked())(cq, n, wc) }
    }
}

/// A hook for messages that cannot be returned (failures inside `Drop`).
static WARN_HOOK: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());

/// Reports a failed destroy call from a `Drop`, where nothing can be returned.
fn destroyed(call: &str, rc: i32) {
    if rc != 0 {
        warn(&format!(
            "{call} failed: {}",
            std::io::Error::from_raw_os_error(rc.abs())
        ));
    }
}

/// Installs the function that receives warnings from destructors.
pub fn set_warn_hook(hook: fn(&str)) {
    WARN_HOOK.store(hook as *mut (), Ordering::Release);
}

pub(crate) fn warn(msg: &str) {
    let p = WARN_HOOK.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: the only non-null value ever stored is a `fn(&str)` (set_warn_hook).
        let hook: fn(&str) = unsafe { std::mem::transmute::<*mut (), fn(&str)>(p) };
        hook(msg);
    }
}

/// A device context opened by rdma_cm.
///
/// rdma_cm keeps its device contexts open for the life of the process, and QPs created
/// through rdma_cm must use PDs of those same contexts, so this handle never closes it.
#[derive(Clone, Copy, Debug)]
pub struct Context {
    ctx: NonNull<r::ibv_context>,
}

// SAFETY: ibv_context calls are thread-safe in rdma-core; the pointer is never freed.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// A device's asynchronous event, as [`Context::read_async_event`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// `IBV_EVENT_CQ_ERR`: the CQ ([`Cq::id`]) overran and the device dropped completions.
    CqError(usize),
    /// An event of queue pair `qp_num`.
    Qp { qp_num: u32, what: &'static str },
    /// A port, SRQ or device event.
    Other(&'static str),
}

/// What rfabric uses of `ibv_device_attr`.
#[derive(Clone, Debug, Default)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub max_mr_size: u64,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub phys_port_cnt: u8,
    pub device_cap_flags: u32,
}

/// What rfabric uses of `ibv_port_attr`.
#[derive(Clone, Debug, Default)]
pub struct PortAttr {
    pub port_num: u8,
    /// `IBV_PORT_ACTIVE` is 4.
    pub state: u32,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    pub max_msg_sz: u32,
    pub gid_tbl_len: u32,
    pub lid: u16,
    /// `IBV_LINK_LAYER_INFINIBAND` 1, `IBV_LINK_LAYER_ETHERNET` 2.
    pub link_layer: u8,
    pub active_speed: u8,
    pub active_width: u8,
}

impl PortAttr {
    pub fn is_active(&self) -> bool {
        self.state == r::ibv_port_state::IBV_PORT_ACTIVE
    }
}

/// Converts an `ibv_mtu` enumerator to bytes.
fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) {
        128 << mtu
    } else {
        0
    }
}

impl Context {
    /// All devices rdma_cm knows, in its order. An empty list is not an error.
    pub fn devices() -> Result<Vec<Context>, i32> {
        let mut n: i32 = 0;
        // SAFETY: rdma_get_devices writes the count and returns a NULL-terminated array
        // (or NULL with errno set).
        let list = unsafe { r::rdma_get_devices(&mut n) };
        if list.is_null() {
            let e = last_errno();
            // No RDMA subsystem at all (no /dev/infiniband) reads as "no device".
            return if e == libc::ENODEV || e == libc::ENOENT || e == libc::ENOSYS {
                Ok(Vec::new())
            } else {
                Err(e)
            };
        }
        let mut out = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n, the number of entries rdma_get_devices returned.
            let p = unsafe { *list.add(i) };
            if let Some(ctx) = NonNull::new(p) {
                out.push(Context { ctx });
            }
        }
        // SAFETY: frees only the array; the contexts stay open inside rdma_cm.
        unsafe { r::rdma_free_devices(list) };
        Ok(out)
    }

    /// An identity for the context (its address), to key per-device state by.
    pub fn id(&self) -> usize {
        self.ctx.as_ptr() as usize
    }

    /// Blocks until the device reports an asynchronous event (`ibv_get_async_event`), gives
    /// it to `f`, then acknowledges it: until then a destroy of the object it names waits,
    /// so `f` sees that object alive (or being destroyed), never a successor at its address.
    /// `f` must not destroy that object itself (the destroy would wait for this thread):
    /// what it returns is dropped after the acknowledgement.
    pub fn read_async_event<R>(&self, f: impl FnOnce(AsyncEvent) -> R) -> Result<R, i32> {
        use r::ibv_event_type as t;
        // SAFETY: a plain C struct the call fills.
        let mut ev: r::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: a valid context; `ev` is ours to fill.
        if unsafe { r::ibv_get_async_event(self.ctx.as_ptr(), &mut ev) } != 0 {
            return Err(last_errno());
        }
        let qp = |what| {
            // SAFETY: a QP event's element is the QP, alive until the event is acknowledged.
            let qp_num = unsafe { ev.element.qp.as_ref() }.map_or(0, |q| q.qp_num);
            AsyncEvent::Qp { qp_num, what }
        };
        let e = match ev.event_type {
            // SAFETY: a CQ event's element is the CQ; only its address is kept.
            t::IBV_EVENT_CQ_ERR => AsyncEvent::CqError(unsafe { ev.element.cq } as usize),
            t::IBV_EVENT_QP_FATAL => qp("QP fatal error"),
            t::IBV_EVENT_QP_REQ_ERR => qp("QP invalid request"),
            t::IBV_EVENT_QP_ACCESS_ERR => qp("QP access error"),
            t::IBV_EVENT_COMM_EST => qp("communication established"),
            t::IBV_EVENT_SQ_DRAINED => qp("send queue drained"),
            t::IBV_EVENT_QP_LAST_WQE_REACHED => qp("last WQE reached"),
            t::IBV_EVENT_PATH_MIG | t::IBV_EVENT_PATH_MIG_ERR => qp("path migration"),
            t::IBV_EVENT_DEVICE_FATAL => AsyncEvent::Other("device fatal error"),
            t::IBV_EVENT_PORT_ACTIVE => AsyncEvent::Other("port active"),
            t::IBV_EVENT_PORT_ERR => AsyncEvent::Other("port error"),
            t::IBV_EVENT_SRQ_ERR => AsyncEvent::Other("SRQ error"),
            t::IBV_EVENT_SRQ_LIMIT_REACHED => AsyncEvent::Other("SRQ limit reached"),
            t::IBV_EVENT_GID_CHANGE => AsyncEvent::Other("GID table changed"),
            _ => AsyncEvent::Other("device event"),
        };
        let out = f(e);
        // SAFETY: the event just read, acknowledged once.
        unsafe { r::ibv_ack_async_event(&mut ev) };
        Ok(out)
    }

    pub(crate) fn from_raw(p: *mut r::ibv_context) -> Option<Context> {
        NonNull::new(p).map(|ctx| Context { ctx })
    }

    pub(crate) fn as_ptr(&self) -> *mut r::ibv_context {
        self.ctx.as_ptr()
    }

    /// The kernel device name (`rxe0`, `mlx5_0`).
    pub fn name(&self) -> String {
        // SAFETY: an open context always points to its device; the name is NUL-terminated.
        unsafe {
            let dev = (*self.ctx.as_ptr()).device;
            let n = r::ibv_get_device_name(dev);
            if n.is_null() {
                return String::new();
            }
            CStr::from_ptr(n).to_string_lossy().into_owned()
        }
    }

    /// Completion vectors (interrupt targets) the device offers.
    pub fn num_comp_vectors(&self) -> u32 {
        // SAFETY: valid context; the field is set at open and never changes.
        unsafe { (*self.ctx.as_ptr()).num_comp_vectors.max(1) as u32 }
    }

    pub fn query_device(&self) -> Result<DeviceAttr, i32> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid value for every field.
        let mut a: r::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and a writable attr struct.
        let rc = unsafe { r::ibv_query_device(self.ctx.as_ptr(), &mut a) };
        if rc != 0 {
            return Err(rc.abs());
        }
        // SAFETY: fw_ver is a NUL-terminated char array inside `a`.
        let fw = unsafe { CStr::from_ptr(a.fw_ver.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let u = |v: i32| v.max(0) as u32;
        Ok(DeviceAttr {
            fw_ver: fw,
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_mr_size: a.max_mr_size,
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_sge_rd: u(a.max_sge_rd),
            max_cq: u(a.max_cq),
            max_cqe: u(a.max_cqe),
            max_mr: u(a.max_mr),
            max_pd: u(a.max_pd),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
            max_srq: u(a.max_srq),
            max_srq_wr: u(a.max_srq_wr),
            max_srq_sge: u(a.max_srq_sge),
            phys_port_cnt: a.phys_port_cnt,
            device_cap_flags: a.device_cap_flags,
        })
    }

    pub fn query_port(&self, port: u8) -> Result<PortAttr, i32> {
        // SAFETY: plain data, zero-valid.
        let mut a: r::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context; rdma-sys's port of the static inline ibv_query_port.
        let rc = unsafe { r::___ibv_query_port(self.ctx.as_ptr(), port, &mut a) };
        if rc != 0 {
            return Err(rc.abs());
        }
        Ok(PortAttr {
            port_num: port,
            state: a.state,
            active_mtu: mtu_bytes(a.active_mtu),
            max_msg_sz: a.max_msg_sz,
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            lid: a.lid,
            link_layer: a.link_layer,
            active_speed: a.active_speed,
            active_width: a.active_width,
        })
    }

    pub fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16], i32> {
        // SAFETY: ibv_gid is a 16-byte union; zero is valid.
        let mut g: r::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and a writable gid.
        let rc = unsafe { r::ibv_query_gid(self.ctx.as_ptr(), port, index, &mut g) };
        if rc != 0 {
            return Err(last_errno());
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { g.raw })
    }
}

/// A protection domain: the verbs object behind a libfabric domain.
#[derive(Debug)]
pub struct ProtectionDomain {
    pd: NonNull<r::ibv_pd>,
    /// Memory registrations made in it: tests count a domain's own, which other tests
    /// running at the same time do not move.
    registrations: std::sync::atomic::AtomicU64,
}

// SAFETY: PD verbs are thread-safe; the PD is freed only in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: Context) -> Result<Arc<Self>, i32> {
        // SAFETY: valid context.
        let pd = unsafe { r::ibv_alloc_pd(ctx.as_ptr()) };
        NonNull::new(pd)
            .map(|pd| {
                Arc::new(ProtectionDomain {
                    pd,
                    registrations: 0.into(),
                })
            })
            .ok_or_else(last_errno)
    }

    pub(crate) fn as_ptr(&self) -> *mut r::ibv_pd {
        self.pd.as_ptr()
    }

    /// Memory registrations (`ibv_reg_mr`) made in this PD so far: what tests count to
    /// show a path registers nothing.
    pub fn registrations(&self) -> u64 {
        self.registrations
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: the PD is ours; every child holds an Arc of it, so none is left.
        destroyed("ibv_dealloc_pd", unsafe {
            r::ibv_dealloc_pd(self.pd.as_ptr())
        });
    }
}

/// Access rights of a registration (`IBV_ACCESS_*`).
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
}

/// A scatter/gather element, laid out as `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// An element naming a range of a live [`MemoryRegion`], borrowed from it: memory the
/// CPU may read during a post (an inline send), as a borrowed slice would be.
#[derive(Clone, Copy, Debug)]
pub struct RegionSge<'a> {
    sge: Sge,
    _region: std::marker::PhantomData<&'a MemoryRegion>,
}

impl RegionSge<'_> {
    /// Bytes it names.
    #[inline(always)]
    pub fn len(&self) -> u32 {
        self.sge.length
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.sge.length == 0
    }
}

const PAGE: usize = 4096;

/// A registered memory region.
#[derive(Debug)]
pub struct MemoryRegion {
    mr: NonNull<r::ibv_mr>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    /// The verbs access it was registered with (`access::*`).
    access: u32,
    /// Present when the region owns its memory (allocated with [`MemoryRegion::alloc`]).
    owned: Option<Layout>,
    /// The region whose memory this one registers again ([`MemoryRegion::register_view`]):
    /// kept alive, so the memory outlives this registration (dropped after deregistration).
    _parent: Option<Arc<MemoryRegion>>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: ibv_mr is immutable after registration; deregistration happens only in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; byte access goes through raw copies (see read_at/write_at).
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Allocates `len` zeroed, page-aligned bytes and registers them.
    pub fn alloc(pd: &Arc<ProtectionDomain>, len: usize, access: u32) -> Result<Self, i32> {
        let layout = Layout::from_size_align(len.max(1), PAGE).map_err(|_| libc::EINVAL)?;
        // SAFETY: layout has a non-zero size.
        let buf = unsafe { alloc::alloc_zeroed(layout) };
        if buf.is_null() {
            return Err(libc::ENOMEM);
        }
        // SAFETY: the buffer is ours, `len` bytes long, and freed only after deregistration.
        match unsafe { Self::register_inner(pd, buf, len, access) } {
            Ok(mut mr) => {
                mr.owned = Some(layout);
                Ok(mr)
            }
            Err(e) => {
                // SAFETY: allocated above with this layout and never registered.
                unsafe { alloc::dealloc(buf, layout) };
                Err(e)
            }
        }
    }

    /// Registers caller memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay allocated (not freed or unmapped) until this region is
    /// dropped, and while the device may write into it the caller must not rely on its
    /// contents. This is the contract `fi_mr_reg(3)` places on applications.
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Self, i32> {
        // SAFETY: forwarded to the caller.
        unsafe { Self::register_inner(pd, addr, len, access) }
    }

    /// Registers `other`'s memory again, addressed by remote peers from `iova` (libfabric's
    /// offset addressing: `iova` 0, so a remote address is an offset into the region). The
    /// new registration holds `other`, so the memory stays allocated while it exists. Only
    /// its rkey is for use: local elements address `other`.
    pub fn register_iova(other: &Arc<MemoryRegion>, iova: u64) -> Result<Self, i32> {
        // SAFETY: `other`'s memory, which stays allocated while the new region holds it;
        // valid PD.
        let mr = unsafe {
            r::ibv_reg_mr_iova2(
                other._pd.as_ptr(),
                other.addr as *mut std::ffi::c_void,
                other.len,
                iova,
                other.access,
            )
        };
        let mut mr = Self::wrap(
            &other._pd,
            mr,
            other.addr as *mut u8,
            other.len,
            other.access,
        )?;
        mr._parent = Some(other.clone());
        Ok(mr)
    }

    unsafe fn register_inner(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Self, i32> {
        // SAFETY: valid PD; memory validity is the caller's contract.
        let mr = unsafe { r::ibv_reg_mr(pd.as_ptr(), addr.cast(), len, access as i32) };
        Self::wrap(pd, mr, addr, len, access)
    }

    /// The region of a registration call's result (NULL: its errno).
    fn wrap(
        pd: &Arc<ProtectionDomain>,
        mr: *mut r::ibv_mr,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Self, i32> {
        let mr = NonNull::new(mr).ok_or_else(last_errno)?;
        pd.registrations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: a successful registration returns a valid ibv_mr.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(MemoryRegion {
            mr,
            addr: addr as u64,
            len,
            lkey,
            rkey,
            access,
            owned: None,
            _parent: None,
            _pd: pd.clone(),
        })
    }

    /// Registers `offset..offset+len` of `parent`'s memory again, with `access` (an RDM
    /// rendezvous exposing part of an application's region to one peer's read). The new
    /// region holds `parent`, so the memory stays allocated while it is registered.
    pub fn register_view(
        parent: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        access: u32,
    ) -> Result<Self, i32> {
        parent.sge(offset, len).ok_or(libc::EINVAL)?;
        // SAFETY: in bounds of `parent`, whose memory stays allocated while the view holds it.
        let mut mr = unsafe {
            Self::register_inner(
                &parent._pd,
                (parent.addr as usize + offset) as *mut u8,
                len,
                access,
            )
        }?;
        mr._parent = Some(parent.clone());
        Ok(mr)
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// The verbs access it was registered with (`access::*`; local read is implied).
    pub fn access(&self) -> u32 {
        self.access
    }

    /// The element naming `offset..offset+len` of this region, if it lies inside it.
    #[inline]
    pub fn sge(&self, offset: usize, len: usize) -> Option<Sge> {
        let end = offset.checked_add(len)?;
        if end > self.len || len > u32::MAX as usize {
            return None;
        }
        Some(Sge {
            addr: self.addr + offset as u64,
            length: len as u32,
            lkey: self.lkey,
        })
    }

    /// The element of a receive into `offset..offset+len` of this region, if it lies
    /// inside it: a range longer than an element can say gets the most one says (no
    /// message is longer: max_msg_size fits a u32).
    #[inline]
    pub fn recv_sge(&self, offset: usize, len: usize) -> Option<Sge> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(Sge {
            addr: self.addr + offset as u64,
            length: len.min(u32::MAX as usize) as u32,
            lkey: self.lkey,
        })
    }

    /// The element naming the first `most` bytes of `offset..offset+len` of this region,
    /// if the whole range lies inside it (a receive that takes at most `most`).
    #[inline]
    pub fn sge_within(&self, offset: usize, len: usize, most: u32) -> Option<Sge> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(Sge {
            addr: self.addr + offset as u64,
            length: len.min(most as usize) as u32,
            lkey: self.lkey,
        })
    }

    /// [`Self::sge_u32`], borrowed from the region ([`RegionSge`]).
    #[inline(always)]
    pub fn region_sge(&self, offset: usize, len: u32) -> Option<RegionSge<'_>> {
        Some(RegionSge {
            sge: self.sge_u32(offset, len)?,
            _region: std::marker::PhantomData,
        })
    }

    /// [`Self::sge`] of a length that fits an element by its type.
    #[inline]
    pub fn sge_u32(&self, offset: usize, len: u32) -> Option<Sge> {
        let end = offset.checked_add(len as usize)?;
        if end > self.len {
            return None;
        }
        Some(Sge {
            addr: self.addr + offset as u64,
            length: len,
            lkey: self.lkey,
        })
    }

    /// The element naming `addr..addr+len` (absolute addresses), if inside this region.
    #[inline]
    pub fn sge_at(&self, addr: u64, len: usize) -> Option<Sge> {
        let off = addr.checked_sub(self.addr)?;
        self.sge(off as usize, len)
    }

    /// Copies `src` into the region at `offset`.
    #[inline]
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), i32> {
        self.sge(offset, src.len()).ok_or(libc::EINVAL)?;
        // SAFETY: bounds checked above; the region is valid memory (owned, or the
        // registrant's contract). Raw copies, because the device may also access it.
        unsafe {
            crate::mem::copy_bytes(src.as_ptr(), (self.addr as *mut u8).add(offset), src.len())
        };
        Ok(())
    }

    /// Copies bytes of the region at `offset` into `dst`.
    #[inline]
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), i32> {
        self.sge(offset, dst.len()).ok_or(libc::EINVAL)?;
        // SAFETY: bounds checked above; see write_at.
        unsafe {
            crate::mem::copy_bytes(
                (self.addr as *const u8).add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// The byte at `offset`, read from memory every call (the device may have written it
    /// since: a remote write's last byte that a polling loop waits for).
    pub fn load_byte(&self, offset: usize) -> Result<u8, i32> {
        self.sge(offset, 1).ok_or(libc::EINVAL)?;
        // SAFETY: bounds checked above; a byte read races only with the device's writes,
        // which leave it either old or new.
        Ok(unsafe { ptr::read_volatile((self.addr as *const u8).add(offset)) })
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), i32> {
        self.sge(offset, len).ok_or(libc::EINVAL)?;
        // SAFETY: bounds checked above; see write_at.
        unsafe { ptr::write_bytes((self.addr as *mut u8).add(offset), byte, len) };
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the registration is ours and deregistered once.
        let rc = unsafe { r::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            // The device may still reach the memory: keep it rather than free it.
            warn(&format!(
                "ibv_dereg_mr failed ({}); keeping its memory allocated",
                std::io::Error::from_raw_os_error(rc)
            ));
            return;
        }
        if let Some(layout) = self.owned {
            // SAFETY: allocated in `alloc` with this layout; deregistered above, so the
            // device can no longer access it.
            unsafe { alloc::dealloc(self.addr as *mut u8, layout) };
        }
    }
}

/// Pages of the application's registered for the device alone (a registration cache's
/// entry). Whatever is mapped there when it is made stays pinned with it, even after the
/// application unmaps the range, and it offers no CPU access to the memory: so it is sound
/// whatever the application does with that memory meanwhile. The device writes into it only
/// where a work request names it, whose poster vouches for the memory (a [`ForeignBuf`]'s
/// contract).
///
/// [`ForeignBuf`]: crate::mem::ForeignBuf
#[derive(Debug)]
pub struct PinnedPages(MemoryRegion);

impl PinnedPages {
    /// Registers `addr..addr+len` (`EFAULT` if part of it is not mapped).
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        addr: u64,
        len: usize,
        access: u32,
    ) -> Result<Self, i32> {
        // SAFETY: ibv_reg_mr pins what is mapped there or fails; nothing reads or writes the
        // memory through the result (no CPU access is offered).
        unsafe { MemoryRegion::register_inner(pd, addr as *mut u8, len, access) }.map(PinnedPages)
    }

    pub fn rkey(&self) -> u32 {
        self.0.rkey
    }
    /// The element for `len` bytes at `addr`, if inside.
    pub fn sge_at(&self, addr: u64, len: usize) -> Option<Sge> {
        self.0.sge_at(addr, len)
    }
}

/// A work completion, laid out as `struct ibv_wc`.
#[repr(transparent)]
pub struct WorkCompletion(r::ibv_wc);

impl std::fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .finish()
    }
}

impl Default for WorkCompletion {
    fn default() -> Self {
        // SAFETY: ibv_wc is plain data (integers and a union of integers).
        WorkCompletion(unsafe { std::mem::zeroed() })
    }
}

/// Room for `N` work completions, left uninitialised until the device writes them.
pub struct WcBatch<const N: usize>([std::mem::MaybeUninit<WorkCompletion>; N]);

impl<const N: usize> WcBatch<N> {
    #[inline(always)]
    pub fn new() -> Self {
        WcBatch([const { std::mem::MaybeUninit::uninit() }; N])
    }
}

impl<const N: usize> Default for WcBatch<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> std::fmt::Debug for WcBatch<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WcBatch<{N}>")
    }
}

/// `ibv_wc_status` values rfabric distinguishes.
pub mod wc_status {
    pub use rdma_sys::ibv_wc_status::*;
}
/// `ibv_wc_opcode` values.
pub mod wc_opcode {
    pub use rdma_sys::ibv_wc_opcode::*;
}
/// `IBV_WC_WITH_IMM`.
pub const WC_WITH_IMM: u32 = 1 << 1;

impl WorkCompletion {
    /// An all-zero completion, to initialise poll arrays.
    // SAFETY: ibv_wc is plain data; all-zero is a valid value.
    pub const ZERO: WorkCompletion = WorkCompletion(unsafe { std::mem::zeroed() });

    /// A completion as a device would report it: for tests and benchmarks of translation.
    pub fn new(wr_id: u64, status: u32, opcode: u32, byte_len: u32, imm: Option<u32>) -> Self {
        let mut w = WorkCompletion::ZERO;
        w.0.wr_id = wr_id;
        w.0.status = status;
        w.0.opcode = opcode;
        w.0.byte_len = byte_len;
        if let Some(v) = imm {
            w.0.wc_flags |= WC_WITH_IMM;
            w.0.imm_data_invalidated_rkey_union.imm_data = v.to_be();
        }
        w
    }

    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    #[inline]
    pub fn status(&self) -> u32 {
        self.0.status
    }
    #[inline]
    pub fn opcode(&self) -> u32 {
        self.0.opcode
    }
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    #[inline]
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    #[inline]
    /// The sending queue pair of a UD receive.
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// Whether a UD receive's first 40 bytes hold a Global Route Header.
    pub fn has_grh(&self) -> bool {
        self.0.wc_flags & r::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }

    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
    #[inline]
    pub fn wc_flags(&self) -> u32 {
        self.0.wc_flags
    }
    /// Immediate data in host order, when `WC_WITH_IMM` is set.
    #[inline]
    pub fn imm_data(&self) -> Option<u32> {
        if self.0.wc_flags & WC_WITH_IMM != 0 {
            // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
            Some(u32::from_be(unsafe {
                self.0.imm_data_invalidated_rkey_union.imm_data
            }))
        } else {
            None
        }
    }
}

/// `ibv_wc_status_str`.
pub fn wc_status_str(status: u32) -> &'static str {
    // SAFETY: returns a pointer to a static string for any value.
    let p = unsafe { r::ibv_wc_status_str(status) };
    if p.is_null() {
        return "unknown status";
    }
    // SAFETY: static NUL-terminated string owned by libibverbs.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .unwrap_or("unknown status")
}

/// A completion channel: the file descriptor a CQ's armed notifications arrive on.
#[derive(Debug)]
pub struct CompChannel {
    ch: NonNull<r::ibv_comp_channel>,
}

// SAFETY: the channel is a file descriptor; reading events from it is thread-safe.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub fn new(ctx: Context) -> Result<Arc<Self>, i32> {
        // SAFETY: valid context.
        let ch = NonNull::new(unsafe { r::ibv_create_comp_channel(ctx.as_ptr()) })
            .ok_or_else(last_errno)?;
        let me = CompChannel { ch };
        // SAFETY: fcntl on a descriptor the channel owns.
        let rc = unsafe {
            let fd = me.fd();
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(last_errno());
        }
        Ok(Arc::new(me))
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        // SAFETY: valid channel.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    /// The descriptor, borrowed for polling.
    pub fn borrow_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: open until Drop, which cannot run while &self is borrowed.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd()) }
    }

    /// Reads and acknowledges every pending notification; returns how many there were.
    pub fn drain(&self) -> usize {
        let mut n = 0;
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: valid channel, non-blocking descriptor; outputs are written on success.
            if unsafe { r::ibv_get_cq_event(self.ch.as_ptr(), &mut cq, &mut ctx) } != 0 {
                return n;
            }
            // SAFETY: cq came from the event just read; acknowledged exactly once, at once,
            // so destroying the CQ never waits on unacknowledged events.
            unsafe { r::ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: ours; every CQ using it holds an Arc of it, so none is left.
        if unsafe { r::ibv_destroy_comp_channel(self.ch.as_ptr()) } != 0 {
            warn("ibv_destroy_comp_channel failed");
        }
    }
}

/// A verbs completion queue.
#[derive(Debug)]
pub struct Cq {
    cq: NonNull<r::ibv_cq>,
    capacity: std::sync::atomic::AtomicU32,
    /// Destroyed after the CQ (fields drop after Drop::drop runs).
    channel: Option<Arc<CompChannel>>,
}

// SAFETY: verbs CQ calls are thread-safe in rdma-core providers (they lock internally
// unless a thread domain says otherwise, which rfabric does not use).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// A CQ of at least `cqe` entries; with a channel, armed notifications go there.
    pub fn new(
        ctx: Context,
        cqe: u32,
        comp_vector: i32,
        channel: Option<Arc<CompChannel>>,
    ) -> Result<Self, i32> {
        let ch = channel.as_ref().map_or(ptr::null_mut(), |c| c.ch.as_ptr());
        // SAFETY: valid context; ch is NULL or a channel of the same context kept alive below.
        let cq =
            unsafe { r::ibv_create_cq(ctx.as_ptr(), cqe as i32, ptr::null_mut(), ch, comp_vector) };
        let cq = NonNull::new(cq).ok_or_else(last_errno)?;
        // SAFETY: just created; nobody else sees it yet.
        let got = unsafe { (*cq.as_ptr()).cqe }.max(0) as u32;
        Ok(Cq {
            cq,
            capacity: got.into(),
            channel,
        })
    }

    /// Asks for one notification on the channel at the next completion (`ibv_req_notify_cq`).
    pub fn req_notify(&self) -> Result<(), i32> {
        if self.channel.is_none() {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid CQ with a channel.
        rc_result(unsafe { r::ibv_req_notify_cq(self.cq.as_ptr(), 0) })
    }

    pub fn channel(&self) -> Option<&Arc<CompChannel>> {
        self.channel.as_ref()
    }

    /// The number of entries the device gave (at least what was asked).
    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Acquire)
    }

    /// Grows the CQ to at least `cqe` entries. Callers serialise resizes of one CQ; polls
    /// may run concurrently (rdma-core providers lock the CQ in both paths).
    pub fn resize(&self, cqe: u32) -> Result<(), i32> {
        // SAFETY: valid CQ.
        let rc = unsafe { r::ibv_resize_cq(self.cq.as_ptr(), cqe as i32) };
        if rc != 0 {
            return Err(rc.abs());
        }
        self.capacity.store(cqe, Ordering::Release);
        Ok(())
    }

    /// Polls up to `max` (at most `N`) completions into `batch` without initialising it
    /// first: an empty poll costs only the provider's check. Returns the polled entries.
    #[inline]
    pub fn poll_batch<'b, const N: usize>(
        &self,
        batch: &'b mut WcBatch<N>,
        max: usize,
    ) -> Result<&'b [WorkCompletion], i32> {
        let n = max.min(N) as i32;
        // SAFETY: the batch has room for N >= n entries laid out as ibv_wc; the provider
        // writes the first `rc` of them.
        let rc = unsafe { entry::poll_cq(self.cq.as_ptr(), n, batch.0.as_mut_ptr().cast()) };
        if rc < 0 {
            return Err(libc::EIO);
        }
        // SAFETY: ibv_poll_cq initialised exactly the first rc (<= n <= N) entries.
        Ok(unsafe {
            std::slice::from_raw_parts(batch.0.as_ptr().cast::<WorkCompletion>(), rc as usize)
        })
    }

    /// An identity for the CQ (its address), as [`AsyncEvent::CqError`] names it.
    pub fn id(&self) -> usize {
        self.cq.as_ptr() as usize
    }

    pub(crate) fn as_ptr(&self) -> *mut r::ibv_cq {
        self.cq.as_ptr()
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: ours; QPs using it hold an Arc of their CQ, so none is left.
        destroyed("ibv_destroy_cq", unsafe {
            r::ibv_destroy_cq(self.cq.as_ptr())
        });
    }
}

/// Capacities of a queue pair, as asked and as granted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `IBV_SEND_*` flags.
pub mod send_flags {
    pub const FENCE: u32 = 1;
    pub const SIGNALED: u32 = 1 << 1;
    pub const SOLICITED: u32 = 1 << 2;
    pub const INLINE: u32 = 1 << 3;
}

/// Most elements one work request gathers or scatters (rdma-core devices offer up to 32).
pub const MAX_IOV: usize = 32;

/// A range of a registered region: one element of a vectored operation.
#[derive(Clone, Copy, Debug)]
pub struct MrSlice<'a> {
    pub mr: &'a MemoryRegion,
    pub offset: usize,
    pub len: usize,
}

/// Checks each range against its region and writes the elements; returns (count, bytes).
fn fill_sges(sges: &mut [Sge], iov: &[MrSlice<'_>], max: u32) -> Result<(usize, usize), i32> {
    if iov.len() > max as usize || iov.len() > sges.len() {
        return Err(libc::E2BIG);
    }
    let mut total = 0usize;
    for (g, s) in sges.iter_mut().zip(iov) {
        *g = s.mr.sge(s.offset, s.len).ok_or(libc::EINVAL)?;
        total = total.checked_add(s.len).ok_or(libc::EINVAL)?;
    }
    Ok((iov.len(), total))
}

/// Fills the elements of `iov` (at most `max`) on the stack and runs `f` on them and their
/// total length: in an array of 4 when they fit (most posts name one range), else of
/// `MAX_IOV`, whose setting up alone costs more than a post's own work.
#[inline(always)]
pub(crate) fn with_sges<R>(
    iov: &[MrSlice<'_>],
    max: u32,
    f: impl FnOnce(&mut [Sge], usize) -> Result<R, i32>,
) -> Result<R, i32> {
    if iov.len() <= 4 {
        let mut sges = [Sge::default(); 4];
        let (n, total) = fill_sges(&mut sges, iov, max)?;
        f(&mut sges[..n], total)
    } else {
        let mut sges = [Sge::default(); MAX_IOV];
        let (n, total) = fill_sges(&mut sges, iov, max)?;
        f(&mut sges[..n], total)
    }
}

/// A send work request (`struct ibv_send_wr`), built on the stack for each post.
#[repr(transparent)]
pub struct SendWr(r::ibv_send_wr);

impl std::fmt::Debug for SendWr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendWr")
            .field("wr_id", &self.0.wr_id)
            .field("num_sge", &self.0.num_sge)
            .field("opcode", &self.0.opcode)
            .field("send_flags", &self.0.send_flags)
            .finish()
    }
}

impl SendWr {
    /// A send (with immediate data when `imm` is set) of `n` elements at `sges`.
    /// Building one touches nothing the pointer names; only posting does.
    #[inline(always)]
    pub fn new(wr_id: u64, sges: *mut Sge, n: usize, flags: u32, imm: Option<u32>) -> Self {
        // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of those).
        let mut wr: r::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sges.cast();
        wr.num_sge = n as i32;
        wr.send_flags = flags;
        match imm {
            Some(v) => {
                wr.opcode = r::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = v.to_be();
            }
            None => wr.opcode = r::ibv_wr_opcode::IBV_WR_SEND,
        }
        SendWr(wr)
    }

    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Addresses a UD queue pair's send to `d`; the caller keeps `d`'s handle alive until
    /// the work request is posted.
    fn set_dest(&mut self, d: &UdDest) {
        self.0.wr.ud = r::ud_t {
            ah: d.ah.as_ptr(),
            remote_qpn: d.qpn,
            remote_qkey: d.qkey,
        };
    }

    pub fn opcode(&self) -> u32 {
        self.0.opcode
    }
}

/// The RDMA operation of a work request: a write (with immediate data when set) or a read.
#[derive(Clone, Copy, Debug)]
enum Rdma {
    Write(Option<u32>),
    Read,
    /// Fetch-and-add of the operand to the remote 8-byte word.
    FetchAdd(u64),
    /// Compare-and-swap of the remote 8-byte word: `(compare, swap)`.
    CmpSwap(u64, u64),
}

/// A verbs atomic on one remote 8-byte word, whose original value the device writes to the
/// local element (`fi_fetch_atomic`, `fi_compare_atomic`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicWr {
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD`.
    FetchAdd(u64),
    /// `IBV_WR_ATOMIC_CMP_AND_SWP`: `compare`, `swap`.
    CmpSwap(u64, u64),
}

/// A queue pair's posting side. Owned by its [`crate::cm::CmId`], which lends it out by
/// reference, so it cannot outlive the QP.
#[derive(Debug)]
pub struct QpHandle {
    qp: NonNull<r::ibv_qp>,
    max_inline: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    /// A UD QP: every send names its destination, which providers read unchecked.
    ud: bool,
}

// SAFETY: posting is thread-safe in rdma-core providers; the handle is only used while
// its CmId (which owns the QP) is alive — CmId hands it out by reference.
unsafe impl Send for QpHandle {}
// SAFETY: as above.
unsafe impl Sync for QpHandle {}

impl QpHandle {
    pub(crate) fn new(qp: NonNull<r::ibv_qp>, caps: &QpCaps) -> Self {
        // SAFETY: a QP just created by its owner, valid.
        let qp_type = unsafe { (*qp.as_ptr()).qp_type };
        QpHandle {
            qp,
            max_inline: caps.max_inline_data,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            ud: qp_type == r::ibv_qp_type::IBV_QPT_UD,
        }
    }

    /// `EINVAL` for a send without a destination on a UD QP (a connected QP's call on a
    /// datagram one), whose provider would follow the missing address handle.
    #[inline(always)]
    fn check_connected(&self, to: Option<&UdDest>) -> Result<(), i32> {
        if to.is_none() && self.ud {
            return Err(no_destination());
        }
        Ok(())
    }

    /// A second handle on the same QP, for an owner that holds the QP's owner too
    /// ([`crate::cm::CmQp`]).
    pub(crate) fn duplicate(&self) -> QpHandle {
        QpHandle { ..*self }
    }

    pub fn qp_num(&self) -> u32 {
        // SAFETY: valid QP while the owning CmId lives.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// Scatter entries one receive may have.
    pub fn max_recv_sge(&self) -> u32 {
        self.max_recv_sge
    }

    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// Posts one send whose payload the CPU copies into the work request now.
    #[inline]
    pub fn post_send_inline(
        &self,
        wr_id: u64,
        data: &[u8],
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        let (mut sge, n) = self.inline_sge(data)?;
        self.post_send_raw(wr_id, &mut sge, n, flags | send_flags::INLINE, imm)
    }

    /// `post_send_inline` of an application's buffer (`EINVAL` past the inline size).
    #[inline]
    pub fn post_send_inline_foreign(
        &self,
        wr_id: u64,
        buf: &crate::mem::ForeignBuf,
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        if buf.len() > self.max_inline as usize {
            return Err(libc::EINVAL);
        }
        let mut sge = Sge {
            addr: buf.addr(),
            length: buf.len() as u32,
            lkey: 0,
        };
        // Inline: the provider reads the bytes during the call, which ForeignBuf's contract
        // (readable for a send) covers.
        let n = usize::from(!buf.is_empty());
        self.post_send_raw(wr_id, &mut sge, n, flags | send_flags::INLINE, imm)
    }

    #[inline(always)]
    fn post_send_raw(
        &self,
        wr_id: u64,
        sges: *mut Sge,
        n: usize,
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        self.post_send_to(wr_id, sges, n, flags, imm, None)
    }

    /// Posts one send; `to` names the destination of a UD queue pair's datagram.
    #[inline(always)]
    fn post_send_to(
        &self,
        wr_id: u64,
        sges: *mut Sge,
        n: usize,
        flags: u32,
        imm: Option<u32>,
        to: Option<&UdDest>,
    ) -> Result<(), i32> {
        self.check_connected(to)?;
        let mut wr = std::mem::MaybeUninit::<r::ibv_send_wr>::uninit();
        let w = wr.as_mut_ptr();
        let (opcode, imm) = match imm {
            Some(v) => (r::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, v.to_be()),
            None => (r::ibv_wr_opcode::IBV_WR_SEND, 0),
        };
        // SAFETY: field writes into our own uninitialised request, through raw pointers.
        // Every field a send reads is written: the header, the immediate data and, on a
        // UD QP, the destination. The unions' other members (RDMA and atomic operands,
        // XRC, memory windows, TSO) belong to other opcodes and QP types, which providers
        // do not read for a send (rxe, mlx5: by opcode and QP type); Rust never reads them.
        unsafe {
            ptr::addr_of_mut!((*w).wr_id).write(wr_id);
            ptr::addr_of_mut!((*w).next).write(ptr::null_mut());
            ptr::addr_of_mut!((*w).sg_list).write(sges.cast());
            ptr::addr_of_mut!((*w).num_sge).write(n as i32);
            ptr::addr_of_mut!((*w).opcode).write(opcode);
            ptr::addr_of_mut!((*w).send_flags).write(flags);
            ptr::addr_of_mut!((*w).imm_data_invalidated_rkey_union.imm_data).write(imm);
            if let Some(d) = to {
                ptr::addr_of_mut!((*w).wr.ud).write(r::ud_t {
                    ah: d.ah.as_ptr(),
                    remote_qpn: d.qpn,
                    remote_qkey: d.qkey,
                });
            }
        }
        // Written by the provider on failure only, and never read here.
        let mut bad = std::mem::MaybeUninit::uninit();
        // SAFETY: the QP is valid while its owner lives (QpHandle is borrowed from it); the
        // SGEs either name registered memory (device-checked) or, with INLINE, point at a
        // live slice that the provider copies before returning; a UD destination's address
        // handle is borrowed, so alive for the call.
        rc_result(unsafe { entry::post_send(self.qp.as_ptr(), w, bad.as_mut_ptr()) })
    }

    /// Posts one send of `len` bytes at `offset` in `mr`: inline when it fits, so the
    /// buffer is free again at once and the device skips a DMA read.
    #[inline(always)]
    pub fn post_send_mr(
        &self,
        wr_id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        let mut sge = mr.sge(offset, len).ok_or(libc::EINVAL)?;
        let n = usize::from(len != 0);
        if len <= self.max_inline as usize {
            // The CPU reads the bytes during the call: valid memory by MemoryRegion's invariant.
            self.post_send_raw(wr_id, &mut sge, n, flags | send_flags::INLINE, imm)
        } else {
            self.post_send_raw(wr_id, &mut sge, n, flags & !send_flags::INLINE, imm)
        }
    }

    /// Posts one send of one element of a live region, inline when it fits, without
    /// immediate data: one element even for an empty message (it goes inline, where none
    /// is read).
    #[inline(always)]
    pub fn post_send_sge(&self, wr_id: u64, sge: RegionSge<'_>, flags: u32) -> Result<(), i32> {
        let len = sge.len();
        let mut sge = sge.sge;
        if len <= self.max_inline {
            // The CPU reads the bytes during the call: valid memory by MemoryRegion's invariant.
            self.post_send_raw(wr_id, &mut sge, 1, flags | send_flags::INLINE, None)
        } else {
            self.post_send_raw(wr_id, &mut sge, 1, flags & !send_flags::INLINE, None)
        }
    }

    /// Posts one send gathered from several ranges of registered regions (`fi_sendv`),
    /// inline when the total fits the inline size.
    pub fn post_send_iov(
        &self,
        wr_id: u64,
        iov: &[MrSlice<'_>],
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        with_sges(iov, self.max_send_sge, |sges, total| {
            // Inline is sound here: every element names memory of a live MemoryRegion.
            let flags = self.inline_if_fits(flags, total);
            self.post_send_raw(wr_id, sges.as_mut_ptr(), sges.len(), flags, imm)
        })
    }

    /// Posts an RDMA write (with immediate data when `imm` is set) gathered from `iov` to
    /// `remote_addr` under `rkey` of the connected peer (`fi_write`, `fi_writedata`);
    /// inline when the total fits the inline size.
    pub fn post_write(
        &self,
        wr_id: u64,
        iov: &[MrSlice<'_>],
        remote_addr: u64,
        rkey: u32,
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        with_sges(iov, self.max_send_sge, |sges, total| {
            // Inline is sound here: every element names memory of a live MemoryRegion.
            let flags = self.inline_if_fits(flags, total);
            let (p, n) = (sges.as_mut_ptr(), sges.len());
            self.post_rdma(wr_id, p, n, flags, Rdma::Write(imm), remote_addr, rkey)
        })
    }

    /// Posts an RDMA write of `len` bytes at `offset` of `mr` (`fi_write` of one region),
    /// inline when it fits the inline size.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn post_write_mr(
        &self,
        wr_id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        flags: u32,
    ) -> Result<(), i32> {
        let mut sge = mr.sge(offset, len).ok_or(libc::EINVAL)?;
        // Inline is sound: the range lies in a live MemoryRegion (checked just above).
        let flags = self.inline_if_fits(flags, len);
        let n = usize::from(len != 0);
        self.post_rdma(
            wr_id,
            &mut sge,
            n,
            flags,
            Rdma::Write(None),
            remote_addr,
            rkey,
        )
    }

    /// Posts an RDMA write of `data`, copied into the work request now (`fi_inject_write`).
    pub fn post_write_inline(
        &self,
        wr_id: u64,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
        flags: u32,
        imm: Option<u32>,
    ) -> Result<(), i32> {
        let (mut sge, n) = self.inline_sge(data)?;
        let flags = flags | send_flags::INLINE;
        let op = Rdma::Write(imm);
        self.post_rdma(wr_id, &mut sge, n, flags, op, remote_addr, rkey)
    }

    /// Posts an RDMA read from `remote_addr` under `rkey` of the connected peer, scattered
    /// into `iov` (`fi_read`, `fi_readv`).
    pub fn post_read_iov(
        &self,
        wr_id: u64,
        iov: &[MrSlice<'_>],
        remote_addr: u64,
        rkey: u32,
        flags: u32,
    ) -> Result<(), i32> {
        with_sges(iov, self.max_send_sge, |sges, _| {
            let flags = flags & !send_flags::INLINE;
            let (p, n) = (sges.as_mut_ptr(), sges.len());
            self.post_rdma(wr_id, p, n, flags, Rdma::Read, remote_addr, rkey)
        })
    }

    /// Posts an RDMA read of `local.length` bytes from `remote_addr` (under `rkey`) of the
    /// connected peer into `local`.
    pub fn post_read(
        &self,
        wr_id: u64,
        mut local: Sge,
        remote_addr: u64,
        rkey: u32,
        flags: u32,
    ) -> Result<(), i32> {
        let flags = flags & !send_flags::INLINE;
        self.post_rdma(wr_id, &mut local, 1, flags, Rdma::Read, remote_addr, rkey)
    }

    /// Posts a verbs atomic on the 8-byte word at `remote_addr` (under `rkey`) of the
    /// connected peer; the word's original value lands in `local` (8 bytes of registered
    /// memory, written by the device).
    pub fn post_atomic(
        &self,
        wr_id: u64,
        mut local: Sge,
        remote_addr: u64,
        rkey: u32,
        flags: u32,
        op: AtomicWr,
    ) -> Result<(), i32> {
        if local.length != 8 {
            return Err(libc::EINVAL);
        }
        let flags = flags & !send_flags::INLINE;
        let op = match op {
            AtomicWr::FetchAdd(a) => Rdma::FetchAdd(a),
            AtomicWr::CmpSwap(c, s) => Rdma::CmpSwap(c, s),
        };
        self.post_rdma(wr_id, &mut local, 1, flags, op, remote_addr, rkey)
    }

    /// Posts an RDMA write of `local` (registered memory, checked by the device under its
    /// lkey) to `remote_addr` under `rkey`. Never inline: the CPU would read `local` unchecked.
    pub fn post_write_sge(
        &self,
        wr_id: u64,
        mut local: Sge,
        remote_addr: u64,
        rkey: u32,
        flags: u32,
    ) -> Result<(), i32> {
        let flags = flags & !send_flags::INLINE;
        let op = Rdma::Write(None);
        self.post_rdma(wr_id, &mut local, 1, flags, op, remote_addr, rkey)
    }

    /// `flags` with `INLINE` when `total` bytes fit the inline size, without it otherwise.
    #[inline(always)]
    fn inline_if_fits(&self, flags: u32, total: usize) -> u32 {
        if total <= self.max_inline as usize {
            flags | send_flags::INLINE
        } else {
            flags & !send_flags::INLINE
        }
    }

    /// The one element of an inline payload, and how many elements to post (none when empty).
    #[inline(always)]
    fn inline_sge(&self, data: &[u8]) -> Result<(Sge, usize), i32> {
        if data.len() > self.max_inline as usize {
            return Err(libc::EINVAL);
        }
        let sge = Sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        Ok((sge, usize::from(!data.is_empty())))
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn post_rdma(
        &self,
        wr_id: u64,
        sges: *mut Sge,
        n: usize,
        flags: u32,
        op: Rdma,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), i32> {
        // RDMA needs a connected QP (a UD provider reads the operands as a destination).
        self.check_connected(None)?;
        let (opcode, imm) = match op {
            Rdma::Write(None) => (r::ibv_wr_opcode::IBV_WR_RDMA_WRITE, None),
            Rdma::Write(imm) => (r::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, imm),
            Rdma::Read => (r::ibv_wr_opcode::IBV_WR_RDMA_READ, None),
            Rdma::FetchAdd(_) => (r::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD, None),
            Rdma::CmpSwap(..) => (r::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP, None),
        };
        let mut wr = SendWr::new(wr_id, sges, n, flags, imm);
        wr.0.opcode = opcode;
        wr.0.wr = match op {
            Rdma::FetchAdd(add) => r::wr_t {
                atomic: r::atomic_t {
                    remote_addr,
                    compare_add: add,
                    swap: 0,
                    rkey,
                },
            },
            Rdma::CmpSwap(compare, swap) => r::wr_t {
                atomic: r::atomic_t {
                    remote_addr,
                    compare_add: compare,
                    swap,
                    rkey,
                },
            },
            _ => r::wr_t {
                rdma: r::rdma_t { remote_addr, rkey },
            },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP (see post_send_raw); the SGEs name registered memory (checked by
        // the device, which writes it for a read) or, with INLINE, a live slice the provider
        // copies before returning; the remote range is checked by the peer's device under
        // its rkey.
        rc_result(unsafe { r::ibv_post_send(self.qp.as_ptr(), &mut wr.0, &mut bad) })
    }

    /// Posts one receive scattered over several ranges of registered regions (`fi_recvv`).
    pub fn post_recv_iov(&self, wr_id: u64, iov: &[MrSlice<'_>]) -> Result<(), i32> {
        with_sges(iov, self.max_recv_sge, |sges, _| {
            self.post_recv(wr_id, sges)
        })
    }

    /// Posts one receive into one element naming registered memory (the device checks
    /// it; the provider checks the count against the queue's `max_recv_sge` itself).
    #[inline(always)]
    pub fn post_recv_one(&self, wr_id: u64, sge: Sge) -> Result<(), i32> {
        let mut wr = recv_wr(wr_id, std::slice::from_ref(&sge));
        // Written by the provider on failure only, and never read here.
        let mut bad = std::mem::MaybeUninit::uninit();
        // SAFETY: valid QP (see post_send_raw); the element names registered memory, which
        // the device checks.
        rc_result(unsafe { entry::post_recv(self.qp.as_ptr(), &mut wr, bad.as_mut_ptr()) })
    }

    /// Posts one receive into two elements (a provider slot and a range, say), both
    /// naming registered memory.
    #[inline(always)]
    pub fn post_recv_pair(&self, wr_id: u64, first: Sge, second: Sge) -> Result<(), i32> {
        let sges = [first, second];
        let mut wr = recv_wr(wr_id, &sges);
        // Written by the provider on failure only, and never read here.
        let mut bad = std::mem::MaybeUninit::uninit();
        // SAFETY: valid QP (see post_send_raw); the elements name registered memory, which
        // the device checks (as it checks their number against the queue's).
        rc_result(unsafe { entry::post_recv(self.qp.as_ptr(), &mut wr, bad.as_mut_ptr()) })
    }

    /// Posts one receive into the memory named by `sges` (checked by the device).
    #[inline(always)]
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<(), i32> {
        if sges.len() > self.max_recv_sge as usize {
            return Err(libc::EINVAL);
        }
        let mut wr = recv_wr(wr_id, sges);
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP (see post_send_raw); SGEs are device-checked registered memory.
        rc_result(unsafe { entry::post_recv(self.qp.as_ptr(), &mut wr, &mut bad) })
    }
}

/// Most work requests one `FI_MORE` chain holds; a fuller batch is posted early.
pub const CHAIN_MAX: usize = 32;

/// A work request type that can be chained: sends (`ibv_send_wr`) or receives (`ibv_recv_wr`).
pub trait ChainLink: Sized {
    /// What an entry holds alive until it is posted.
    type Keep;
    /// Whether these are receives (else sends).
    const RECEIVE: bool;
    fn zeroed() -> Self;
    fn wr_id(&self) -> u64;
    fn link(&mut self, sge: *mut Sge, next: *mut Self);
    /// Posts the chain at `head` on `qp`: `ibv_post_send` or `ibv_post_recv`.
    ///
    /// # Safety
    /// `qp` is a live QP and `head` a linked chain whose elements name registered memory
    /// (or, inline, memory the chain holds alive).
    unsafe fn post(qp: *mut r::ibv_qp, head: *mut Self, bad: &mut *mut Self) -> i32;
}

/// Implements [`ChainLink`] for a verbs work request type and its post function.
macro_rules! chain_link {
    ($wr:ty, $keep:ty, $receive:expr, $post:path) => {
        impl ChainLink for $wr {
            type Keep = $keep;
            const RECEIVE: bool = $receive;
            fn zeroed() -> Self {
                // SAFETY: verbs work requests are plain data (integers, pointers, unions).
                unsafe { std::mem::zeroed() }
            }
            fn wr_id(&self) -> u64 {
                self.wr_id
            }
            fn link(&mut self, sge: *mut Sge, next: *mut Self) {
                self.sg_list = sge.cast();
                self.next = next;
            }
            unsafe fn post(qp: *mut r::ibv_qp, head: *mut Self, bad: &mut *mut Self) -> i32 {
                // SAFETY: the caller's contract.
                unsafe { $post(qp, head, bad) }
            }
        }
    };
}

// A send holds its region (inline entries are read by the CPU at post time) and, for a
// datagram, its address handle.
chain_link!(
    r::ibv_send_wr,
    (Arc<MemoryRegion>, Option<UdDest>),
    false,
    r::ibv_post_send
);
chain_link!(r::ibv_recv_wr, (), true, r::ibv_post_recv);

/// Work requests chained under `FI_MORE` and posted by one call (one doorbell) when the
/// batch ends. Each has one element; the links are made only at post time.
pub struct Chain<W: ChainLink> {
    wrs: [W; CHAIN_MAX],
    sges: [Sge; CHAIN_MAX],
    keep: [Option<W::Keep>; CHAIN_MAX],
    len: usize,
}

/// Sends chained under `FI_MORE`, each holding its region.
pub type SendChain = Chain<r::ibv_send_wr>;
/// Receives chained under `FI_MORE`.
pub type RecvChain = Chain<r::ibv_recv_wr>;

// SAFETY: the pointers inside `wrs` are rebuilt from the chain's own arrays at each post;
// nothing they name is shared with another thread.
unsafe impl<W: ChainLink> Send for Chain<W> where W::Keep: Send {}

impl<W: ChainLink> std::fmt::Debug for Chain<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain").field("len", &self.len).finish()
    }
}

impl<W: ChainLink> Default for Chain<W> {
    fn default() -> Self {
        Chain {
            wrs: std::array::from_fn(|_| W::zeroed()),
            sges: [Sge::default(); CHAIN_MAX],
            keep: std::array::from_fn(|_| None),
            len: 0,
        }
    }
}

impl<W: ChainLink> Chain<W> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn is_full(&self) -> bool {
        self.len == CHAIN_MAX
    }
    /// The work request ids waiting to be posted, oldest first.
    pub fn pending(&self) -> impl Iterator<Item = u64> + '_ {
        self.wrs[..self.len].iter().map(|w| w.wr_id())
    }
    /// Drops the newest entry (one whose post failed and is reported to its caller).
    pub fn pop(&mut self) {
        if self.len > 0 {
            self.len -= 1;
            self.keep[self.len] = None;
        }
    }
    /// Drops every entry (after reporting them failed).
    pub fn clear(&mut self) {
        while self.len > 0 {
            self.pop();
        }
    }

    fn push(&mut self, wr: W, sge: Sge, keep: Option<W::Keep>) -> Result<(), i32> {
        if self.is_full() {
            return Err(libc::ENOSPC);
        }
        self.wrs[self.len] = wr;
        self.sges[self.len] = sge;
        self.keep[self.len] = keep;
        self.len += 1;
        Ok(())
    }
}

impl RecvChain {
    /// Appends a receive into `sge` (device-checked memory). `ENOSPC` when full.
    pub fn push_recv(&mut self, wr_id: u64, sge: Sge) -> Result<(), i32> {
        let mut wr = r::ibv_recv_wr::zeroed();
        wr.wr_id = wr_id;
        wr.num_sge = i32::from(sge.length != 0);
        self.push(wr, sge, None)
    }
}

impl QpHandle {
    /// Appends a send of `len` bytes at `offset` in `mr` to `chain` (inline when it fits,
    /// as [`Self::post_send_mr`]). `ENOSPC` when the chain is full, `EINVAL` for a range
    /// outside the region.
    #[allow(clippy::too_many_arguments)]
    pub fn chain_send(
        &self,
        chain: &mut SendChain,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        flags: u32,
        imm: Option<u32>,
        to: Option<&UdDest>,
    ) -> Result<(), i32> {
        self.check_connected(to)?;
        let sge = mr.sge(offset, len).ok_or(libc::EINVAL)?;
        let flags = if len <= self.max_inline as usize {
            flags | send_flags::INLINE
        } else {
            flags & !send_flags::INLINE
        };
        let mut wr = SendWr::new(wr_id, ptr::null_mut(), usize::from(len != 0), flags, imm);
        if let Some(d) = to {
            wr.set_dest(d);
        }
        chain.push(wr.0, sge, Some((mr.clone(), to.cloned())))
    }

    /// Posts every work request of `chain` with one call (one doorbell). On failure the
    /// entries the device did not take (the failed one first) stay in the chain.
    pub fn post_chain<W: ChainLink>(&self, chain: &mut Chain<W>) -> Result<(), i32> {
        let n = chain.len;
        if n == 0 {
            return Ok(());
        }
        let head = chain.wrs.as_mut_ptr();
        let sge = chain.sges.as_mut_ptr();
        for i in 0..n {
            let next = if i + 1 < n {
                // SAFETY: i + 1 < n <= CHAIN_MAX: in bounds.
                unsafe { head.add(i + 1) }
            } else {
                ptr::null_mut()
            };
            // SAFETY: i < n <= CHAIN_MAX: in bounds of both arrays, which outlive the post.
            let (w, g) = unsafe { (&mut *head.add(i), sge.add(i)) };
            w.link(g, next);
        }
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP (see post_send_raw); the chain was just linked over its own
        // arrays; each element names registered memory (device-checked), and inline ones
        // memory of a region the chain holds alive.
        let rc = unsafe { W::post(self.qp.as_ptr(), head, &mut bad) };
        if rc == 0 {
            chain.clear();
            return Ok(());
        }
        let k = first_unposted(bad, head, n);
        chain.wrs[..n].rotate_left(k);
        chain.sges[..n].rotate_left(k);
        chain.keep[..n].rotate_left(k);
        for slot in &mut chain.keep[n - k..n] {
            *slot = None;
        }
        chain.len = n - k;
        Err(rc.abs())
    }
}

/// A receive work request over `sges`, which must outlive its posting.
#[inline(always)]
fn recv_wr(wr_id: u64, sges: &[Sge]) -> r::ibv_recv_wr {
    r::ibv_recv_wr {
        wr_id,
        next: ptr::null_mut(),
        sg_list: sges.as_ptr() as *mut r::ibv_sge,
        num_sge: sges.len() as i32,
    }
}

/// A verbs post's return code as a result (providers return errno, some negated).
#[inline(always)]
fn rc_result(rc: i32) -> Result<(), i32> {
    if rc != 0 {
        Err(rc_errno(rc))
    } else {
        Ok(())
    }
}

/// A UD QP's send without its destination: out of line, as every error.
#[cold]
#[inline(never)]
fn no_destination() -> i32 {
    libc::EINVAL
}

/// A failed call's errno, positive: out of line, so a post's success costs one test.
#[cold]
#[inline(never)]
fn rc_errno(rc: i32) -> i32 {
    rc.abs()
}

/// The index of the first work request of a chain that a failed post did not take.
fn first_unposted<T>(bad: *mut T, base: *mut T, n: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    // SAFETY: on failure verbs points bad_wr at an element of the chain that starts at base.
    let k = unsafe { bad.offset_from(base) };
    usize::try_from(k).unwrap_or(0).min(n)
}

/// A shared receive queue: receives posted once, consumed by whichever of its queue pairs
/// a message arrives on (the verbs object behind `fi_srx_context` on MSG endpoints).
#[derive(Debug)]
pub struct Srq {
    srq: NonNull<r::ibv_srq>,
    max_wr: u32,
    max_sge: u32,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: posting to an SRQ is thread-safe in rdma-core providers; freed only in Drop.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    /// Creates an SRQ of at least `max_wr` receives of up to `max_sge` elements.
    pub fn new(pd: &Arc<ProtectionDomain>, max_wr: u32, max_sge: u32) -> Result<Arc<Self>, i32> {
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = max_wr;
        attr.attr.max_sge = max_sge;
        // SAFETY: valid PD; attr initialised; the SRQ holds the PD alive.
        let srq = unsafe { r::ibv_create_srq(pd.as_ptr(), &mut attr) };
        let srq = NonNull::new(srq).ok_or_else(last_errno)?;
        Ok(Arc::new(Srq {
            srq,
            max_wr: attr.attr.max_wr,
            max_sge: attr.attr.max_sge.max(max_sge),
            _pd: pd.clone(),
        }))
    }

    /// Receives the SRQ holds at most, as granted.
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// Posts one receive into the memory named by `sges` (checked by the device).
    #[inline]
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<(), i32> {
        if sges.len() > self.max_sge as usize {
            return Err(libc::E2BIG);
        }
        let mut wr = recv_wr(wr_id, sges);
        let mut bad = ptr::null_mut();
        // SAFETY: valid SRQ; the SGEs name registered memory, checked by the device.
        rc_result(unsafe { r::ibv_post_srq_recv(self.srq.as_ptr(), &mut wr, &mut bad) })
    }

    /// Posts one receive scattered over several ranges of registered regions.
    pub fn post_recv_iov(&self, wr_id: u64, iov: &[MrSlice<'_>]) -> Result<(), i32> {
        with_sges(iov, self.max_sge, |sges, _| self.post_recv(wr_id, sges))
    }

    /// Posts `n` receives (at most [`Self::POST_EACH_MAX`]) of one or two elements each, the
    /// `i`th being `item(i)` (its work request id, element and second element), in one call
    /// (one chain: the device provider takes its queue's lock once). On failure, how many
    /// were posted (the first ones) and the error.
    #[inline]
    pub fn post_recv_each(
        &self,
        n: usize,
        mut item: impl FnMut(usize) -> (u64, Sge, Option<Sge>),
    ) -> Result<(), (usize, i32)> {
        const N: usize = Srq::POST_EACH_MAX;
        if n == 0 {
            return Ok(());
        }
        if n > N {
            return Err((0, libc::E2BIG));
        }
        let mut sges = [const { std::mem::MaybeUninit::<Sge>::uninit() }; 2 * N];
        let mut wrs = [const { std::mem::MaybeUninit::<r::ibv_recv_wr>::uninit() }; N];
        // Every element is written through these, the pointers the chain itself holds.
        let sbase = sges.as_mut_ptr().cast::<Sge>();
        let base = wrs.as_mut_ptr().cast::<r::ibv_recv_wr>();
        for i in 0..n {
            let (id, sge, second) = item(i);
            let mut wr = r::ibv_recv_wr::zeroed();
            wr.wr_id = id;
            wr.sg_list = sbase.wrapping_add(2 * i).cast();
            wr.num_sge = 1 + i32::from(second.is_some());
            wr.next = if i + 1 < n {
                base.wrapping_add(i + 1)
            } else {
                ptr::null_mut()
            };
            // SAFETY: `i < n <= N`: `2 i + 1 < 2 N` and `i < N`, inside both arrays, which
            // outlive the post below.
            unsafe {
                sbase.add(2 * i).write(sge);
                if let Some(t) = second {
                    sbase.add(2 * i + 1).write(t);
                }
                base.add(i).write(wr);
            }
        }
        let mut bad = ptr::null_mut();
        // SAFETY: valid SRQ; the first `n` work requests are written and linked in order
        // (the last ends the chain), each naming its element in `sges`, written and alive
        // for the call; the elements name registered memory, checked by the device.
        let rc = unsafe { r::ibv_post_srq_recv(self.srq.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        Err((first_unposted(bad, base, n), rc.abs()))
    }

    /// Receives [`Self::post_recv_each`] takes at most.
    pub const POST_EACH_MAX: usize = 32;

    pub(crate) fn as_ptr(&self) -> *mut r::ibv_srq {
        self.srq.as_ptr()
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: ours; every QP using it holds an Arc of it, so none is left.
        destroyed("ibv_destroy_srq", unsafe {
            r::ibv_destroy_srq(self.srq.as_ptr())
        });
    }
}

impl QpHandle {
    /// Sets the receiver-not-ready delay this QP asks senders to wait (`min_rnr_timer`, the
    /// IB 5-bit encoding: 1 = 0.01 ms … 12 = 0.64 ms … 0 = 655 ms). Valid once connected.
    pub fn set_min_rnr_timer(&self, code: u8) -> Result<(), i32> {
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.min_rnr_timer = code & 0x1f;
        let mask = r::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32;
        // SAFETY: valid QP; attr initialised for the masked field.
        rc_result(unsafe { r::ibv_modify_qp(self.qp.as_ptr(), &mut attr, mask) })
    }

    /// The QP's access flags (`qp_access_flags`: what remote peers may do to it).
    pub fn access_flags(&self) -> Result<u32, i32> {
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: plain data; zero is valid.
        let mut init: r::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = r::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 as i32;
        // SAFETY: valid QP; writable attributes.
        rc_result(unsafe { r::ibv_query_qp(self.qp.as_ptr(), &mut attr, mask, &mut init) })?;
        Ok(attr.qp_access_flags)
    }

    /// Moves the QP to the error state (again): the device flushes what is posted. A
    /// software device (rxe) flushes receives only when told, since posting a receive
    /// there makes no system call: one posted after the QP failed waits for this.
    pub fn set_error(&self) -> Result<(), i32> {
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = r::ibv_qp_state::IBV_QPS_ERR;
        let mask = r::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: valid QP; attr initialised for the masked field.
        rc_result(unsafe { r::ibv_modify_qp(self.qp.as_ptr(), &mut attr, mask) })
    }
}
