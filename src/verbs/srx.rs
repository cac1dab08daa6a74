//! Shared receive contexts (`fi_srx_context`) on verbs SRQs: receives posted once, taken by
//! whichever bound MSG endpoint a message arrives on, completed on that endpoint's receive CQ.

use std::sync::Arc;

use rfabric_sys::verbs::{Srq, MAX_IOV};

use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::info::RxAttr;
use crate::verbs::ep_common::{check_recv_flags, region_sge, with_slices};
use crate::verbs::wr_id::{self, Kind};
use crate::verbs::{os_err, Domain, Iov, MemoryRegion};

/// A shared receive context of MSG endpoints (`fi_srx_context`).
#[derive(Debug)]
pub struct SharedRxContext {
    srq: Arc<Srq>,
    domain: Arc<Domain>,
}

impl SharedRxContext {
    /// Opens a shared receive context holding `attr.size` receives (0: the provider's
    /// default receive depth) of up to `attr.iov_limit` ranges each.
    pub fn open(domain: &Arc<Domain>, attr: &RxAttr) -> Result<Arc<Self>> {
        let dev = &domain.device().attr;
        if dev.max_srq == 0 {
            return Err(Error::new(
                errno::ENOSYS,
                format!("{} has no shared receive queues", domain.device().name),
            ));
        }
        let size = if attr.size == 0 {
            crate::core::env::get_usize_or("FI_RVERBS_RX_SIZE", 384)?
        } else {
            attr.size
        };
        if size > dev.max_srq_wr as usize || attr.iov_limit > dev.max_srq_sge as usize {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "shared receive context of {size} receives of {} ranges: the device allows {} of {}",
                    attr.iov_limit, dev.max_srq_wr, dev.max_srq_sge
                ),
            ));
        }
        let iov_limit = attr.iov_limit.clamp(1, MAX_IOV);
        let srq = Srq::new(domain.pd(), size as u32, iov_limit as u32)
            .map_err(os_err("ibv_create_srq"))?;
        crate::fi_debug!("srx", "SRQ of {} receives created", srq.max_wr());
        Ok(Arc::new(SharedRxContext {
            srq,
            domain: domain.clone(),
        }))
    }

    /// Receives it holds at most.
    pub fn size(&self) -> usize {
        self.srq.max_wr() as usize
    }

    pub(crate) fn srq(&self) -> &Arc<Srq> {
        &self.srq
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// Posts a receive of up to `len` bytes at `offset` of `mr` (`fi_recv` on the SRX).
    /// Every receive on a shared context completes (see the README).
    #[inline]
    pub fn recv(&self, mr: &MemoryRegion, offset: usize, len: usize, context: u64) -> Result<()> {
        wr_id::check(context)?;
        let sge = region_sge(mr, &self.domain, offset, len)?;
        self.srq
            .post_recv(wr_id::encode(context, Kind::Recv, false), &[sge])
            .map_err(|e| srq_error(e, 1))
    }

    /// `fi_recvv` on the SRX: one receive scattered over `iov`; no range at all takes a
    /// message of no bytes (a longer one completes in error).
    pub fn recvv(&self, iov: &[Iov<'_>], context: u64) -> Result<()> {
        wr_id::check(context)?;
        if iov.is_empty() {
            return self
                .srq
                .post_recv_iov(wr_id::encode(context, Kind::Recv, false), &[])
                .map_err(|e| srq_error(e, 0));
        }
        with_slices(&self.domain, iov, |slices| {
            self.srq
                .post_recv_iov(wr_id::encode(context, Kind::Recv, false), slices)
                .map_err(|e| srq_error(e, iov.len()))
        })
    }

    /// `fi_recvmsg` on the SRX. `FI_COMPLETION` and `FI_MORE` are accepted (every receive
    /// completes; each is posted at once); `FI_MULTI_RECV`, `FI_CLAIM` and `FI_DISCARD`
    /// need the software receive engine of RDM endpoints: `EINVAL`.
    pub fn recvmsg(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        check_recv_flags(flags, Flags::empty())?;
        self.recv(mr, offset, len, context)
    }
}

#[cold]
fn srq_error(e: i32, n: usize) -> Error {
    match e {
        libc::ENOMEM | libc::EAGAIN => Error::new(
            errno::EAGAIN,
            "shared receive context full: read the CQs to free room",
        ),
        libc::E2BIG => Error::new(errno::EINVAL, format!("{n} ranges exceed the iov limit")),
        libc::EINVAL => Error::new(errno::EINVAL, "a range lies outside its memory region"),
        e => Error::os(e, "ibv_post_srq_recv"),
    }
}
