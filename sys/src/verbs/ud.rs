//! Unreliable datagram queue pairs and the address handles their sends name.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as r;

use super::{
    destroyed, rc_result, send_flags, with_sges, Cq, MrSlice, ProtectionDomain, QpCaps, QpHandle,
};
use crate::last_errno;

/// The bytes of the Global Route Header a UD receive starts with.
pub const GRH_LEN: usize = 40;

/// An address handle: the route to one remote port (`ibv_ah`), shared by every send to it.
#[derive(Debug)]
pub struct AddressHandle {
    ah: NonNull<r::ibv_ah>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: address handles are immutable once created; freed only in Drop.
unsafe impl Send for AddressHandle {}
// SAFETY: as above.
unsafe impl Sync for AddressHandle {}

impl AddressHandle {
    /// A handle to the port whose GID is `dgid`, reached from local port `port` through
    /// the local GID at `sgid_index` (RoCE: routed, so always global).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        port: u8,
        dgid: [u8; 16],
        sgid_index: u8,
    ) -> Result<Arc<Self>, i32> {
        // SAFETY: plain data; zero is valid.
        let mut attr: r::ibv_ah_attr = unsafe { std::mem::zeroed() };
        attr.is_global = 1;
        attr.port_num = port;
        attr.grh.dgid.raw = dgid;
        attr.grh.sgid_index = sgid_index;
        attr.grh.hop_limit = 64;
        // SAFETY: valid PD; attr initialised.
        let ah = unsafe { r::ibv_create_ah(pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(last_errno)?;
        Ok(Arc::new(AddressHandle {
            ah,
            _pd: pd.clone(),
        }))
    }

    /// A handle to a joined multicast group, from its join event.
    pub fn for_group(
        pd: &Arc<ProtectionDomain>,
        group: &crate::cm::McastGroup,
    ) -> Result<Arc<Self>, i32> {
        let mut attr = group.ah_attr;
        // SAFETY: valid PD; attr as rdma_cm filled it for this device.
        let ah = unsafe { r::ibv_create_ah(pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(last_errno)?;
        Ok(Arc::new(AddressHandle {
            ah,
            _pd: pd.clone(),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut r::ibv_ah {
        self.ah.as_ptr()
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        // SAFETY: ours; sends borrow it only for the duration of a post.
        destroyed("ibv_destroy_ah", unsafe {
            r::ibv_destroy_ah(self.ah.as_ptr())
        });
    }
}

/// Where a datagram goes: a port (address handle, held), a queue pair number and its Q_Key.
#[derive(Clone, Debug)]
pub struct UdDest {
    pub ah: Arc<AddressHandle>,
    pub qpn: u32,
    pub qkey: u32,
}

/// An unreliable datagram queue pair, ready to send and receive once created.
#[derive(Debug)]
pub struct UdQp {
    qp: NonNull<r::ibv_qp>,
    handle: QpHandle,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: posting is thread-safe in rdma-core providers; the QP is destroyed only in Drop.
unsafe impl Send for UdQp {}
// SAFETY: as above.
unsafe impl Sync for UdQp {}

impl UdQp {
    /// Creates a UD QP with `caps` and brings it to RTS on `port` with `qkey`. The caller
    /// keeps the CQs alive for as long as the QP (endpoints hold Arcs of them).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        port: u8,
        qkey: u32,
    ) -> Result<(Self, QpCaps), i32> {
        // SAFETY: plain data; zero is valid.
        let mut init: r::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_ptr();
        init.recv_cq = recv_cq.as_ptr();
        init.qp_type = r::ibv_qp_type::IBV_QPT_UD;
        init.cap = r::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: valid PD and CQs of one device; init initialised.
        let qp = unsafe { r::ibv_create_qp(pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(last_errno)?;
        let got = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        // Sends go inline only up to what was asked: the inject size.
        let posting = QpCaps {
            max_inline_data: caps.max_inline_data.min(got.max_inline_data),
            ..got
        };
        let ud = UdQp {
            qp,
            handle: QpHandle::new(qp, &posting),
            _pd: pd.clone(),
        };
        use r::ibv_qp_attr_mask as m;
        // SAFETY: plain data; zero is valid.
        let mut a: r::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = r::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = port;
        a.qkey = qkey;
        ud.modify(
            &mut a,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_QKEY,
        )?;
        a.qp_state = r::ibv_qp_state::IBV_QPS_RTR;
        ud.modify(&mut a, m::IBV_QP_STATE)?;
        a.qp_state = r::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = 0;
        ud.modify(&mut a, m::IBV_QP_STATE | m::IBV_QP_SQ_PSN)?;
        Ok((ud, got))
    }

    fn modify(&self, a: &mut r::ibv_qp_attr, mask: r::ibv_qp_attr_mask) -> Result<(), i32> {
        // SAFETY: valid QP; `a` initialised for the masked fields.
        rc_result(unsafe { r::ibv_modify_qp(self.qp.as_ptr(), a, mask.0 as i32) })
    }

    /// The posting side (receives are posted as on any QP).
    pub fn handle(&self) -> &QpHandle {
        &self.handle
    }

    pub fn qp_num(&self) -> u32 {
        self.handle.qp_num()
    }

    /// Receives the datagrams of a multicast group (`ibv_attach_mcast`).
    pub fn attach_mcast(&self, group: &crate::cm::McastGroup) -> Result<(), i32> {
        let gid = r::ibv_gid { raw: group.gid() };
        // SAFETY: valid QP; gid is read during the call.
        rc_result(unsafe { r::ibv_attach_mcast(self.qp.as_ptr(), &gid, group.lid()) })
    }

    /// Stops receiving a group's datagrams.
    pub fn detach_mcast(&self, group: &crate::cm::McastGroup) -> Result<(), i32> {
        let gid = r::ibv_gid { raw: group.gid() };
        // SAFETY: valid QP; gid is read during the call.
        rc_result(unsafe { r::ibv_detach_mcast(self.qp.as_ptr(), &gid, group.lid()) })
    }
}

impl Drop for UdQp {
    fn drop(&mut self) {
        // SAFETY: ours; the handle is borrowed from self, so no post is in flight.
        destroyed("ibv_destroy_qp", unsafe {
            r::ibv_destroy_qp(self.qp.as_ptr())
        });
    }
}

impl QpHandle {
    /// Sends a datagram whose payload the CPU copies into the work request now.
    pub fn post_ud_inline(
        &self,
        wr_id: u64,
        data: &[u8],
        flags: u32,
        imm: Option<u32>,
        to: &UdDest,
    ) -> Result<(), i32> {
        let (mut sge, n) = self.inline_sge(data)?;
        self.post_send_to(
            wr_id,
            &mut sge,
            n,
            flags | send_flags::INLINE,
            imm,
            Some(to),
        )
    }

    /// Sends a datagram from one range of a registered region (inline when it fits): the
    /// common case, with one element and no array to fill.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn post_ud_mr(
        &self,
        wr_id: u64,
        mr: &super::MemoryRegion,
        offset: usize,
        len: usize,
        flags: u32,
        imm: Option<u32>,
        to: &UdDest,
    ) -> Result<(), i32> {
        let mut sge = mr.sge(offset, len).ok_or(libc::EINVAL)?;
        // Inline is sound here: the element names memory of a live MemoryRegion.
        let flags = self.inline_if_fits(flags, len);
        self.post_send_to(wr_id, &mut sge, usize::from(len != 0), flags, imm, Some(to))
    }

    /// Sends a datagram of one element of a live region, inline when it fits, without
    /// immediate data: one element even when empty (it goes inline, where none is read).
    #[inline(always)]
    pub fn post_ud_sge(
        &self,
        wr_id: u64,
        sge: super::RegionSge<'_>,
        flags: u32,
        to: &UdDest,
    ) -> Result<(), i32> {
        // Inline is sound: the element names memory of a region the caller borrows.
        let flags = self.inline_if_fits(flags, sge.len() as usize);
        let mut sge = sge.sge;
        self.post_send_to(wr_id, &mut sge, 1, flags, None, Some(to))
    }

    /// Sends a datagram gathered from ranges of registered regions (inline when it fits).
    pub fn post_ud_iov(
        &self,
        wr_id: u64,
        iov: &[MrSlice<'_>],
        flags: u32,
        imm: Option<u32>,
        to: &UdDest,
    ) -> Result<(), i32> {
        with_sges(iov, self.max_send_sge, |sges, total| {
            // Inline is sound here: every element names memory of a live MemoryRegion.
            let flags = self.inline_if_fits(flags, total);
            let (p, n) = (sges.as_mut_ptr(), sges.len());
            self.post_send_to(wr_id, p, n, flags, imm, Some(to))
        })
    }
}
