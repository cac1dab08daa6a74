//! `rverbs`: the verbs main provider.
//!
//! Domains are protection domains, CQs are `ibv_cq`s read in manual progress, MSG endpoints
//! are RC queue pairs connected with rdma_cm, and the EQ is the rdma_cm event channel.

#![forbid(unsafe_code)]

pub mod av;
pub mod cntr;
pub mod cq;
pub(crate) mod device_events;
pub mod dgram_ep;
pub mod domain;
pub(crate) mod ep_common;
pub mod eq;
pub mod fabric;
pub mod info;
pub mod mr;
pub(crate) mod mr_cache;
pub mod msg_ep;
pub(crate) mod multi_recv;
pub mod pep;
pub mod poll;
pub mod rdm_ep;
pub mod srx;
pub mod wait;
pub(crate) mod wr_id;

pub use av::{AddressVector, AvAttr, UdName};
pub use cntr::{CntrAttr, Counter};
pub use cq::{CompletionQueue, CqAttr, ReadSink};
pub use dgram_ep::{DgramEndpoint, Multicast};
pub use domain::Domain;
pub use ep_common::Iov;
pub use eq::{ConnRequest, EqAttr, EventQueue};
pub use fabric::Fabric;
pub use info::{devices, getinfo, Device};
pub use mr::MemoryRegion;
pub use msg_ep::{MsgEndpoint, RmaIov};
pub use pep::{PassiveEndpoint, ReservedAddress};
pub use poll::{PollSet, Pollable};
pub use rdm_ep::{AtomicCall, RdmEndpoint, RecvBuf};
pub use srx::SharedRxContext;
pub use wait::{WaitAttr, WaitSet};

use crate::core::error::{errno, Error};

/// The provider name, as `fi_info -p` and `FI_PROVIDER` use it.
pub const PROVIDER_NAME: &str = "rverbs";
/// The provider's own version (`FI_VERSION(0, 1)`).
pub const PROVIDER_VERSION: u32 = rfabric_sys::fabric::fi_version_of(0, 1);

/// The error for a machine without an RDMA device, naming the fix.
pub fn no_device_error() -> Error {
    Error::new(
        errno::ENODATA,
        "no RDMA device found: load rdma_rxe (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <netdev>) \
         or run the SoftRoCE VM script (ci/vm-run, or scripts/bench and scripts/test, which boot it)",
    )
}

/// Maps an OS errno from a verbs or rdma_cm call to an [`Error`] naming the call.
pub(crate) fn os_err(what: &'static str) -> impl Fn(i32) -> Error {
    move |e| Error::os(e, what)
}

/// Routes warnings from `rfabric-sys` destructors to the provider's log.
pub(crate) fn install_sys_log() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| rfabric_sys::verbs::set_warn_hook(|m| crate::fi_warn!("core", "{m}")));
}
