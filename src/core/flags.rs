//! libfabric's flags and enumerations, with the values of the 1.17 headers.

use bitflags::bitflags;
use rfabric_sys::fabric as fi;

bitflags! {
    /// Capabilities and operation flags (`FI_MSG`, `FI_SEND`, …): one 64-bit space in libfabric.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct Flags: u64 {
        const MSG = fi::FI_MSG;
        const RMA = fi::FI_RMA;
        const TAGGED = fi::FI_TAGGED;
        const ATOMIC = fi::FI_ATOMIC;
        const MULTICAST = fi::FI_MULTICAST;
        const COLLECTIVE = fi::FI_COLLECTIVE;
        const READ = fi::FI_READ;
        const WRITE = fi::FI_WRITE;
        const RECV = fi::FI_RECV;
        const SEND = fi::FI_SEND;
        const TRANSMIT = fi::FI_TRANSMIT;
        const REMOTE_READ = fi::FI_REMOTE_READ;
        const REMOTE_WRITE = fi::FI_REMOTE_WRITE;
        const MULTI_RECV = fi::FI_MULTI_RECV;
        const REMOTE_CQ_DATA = fi::FI_REMOTE_CQ_DATA;
        const MORE = fi::FI_MORE;
        const PEEK = fi::FI_PEEK;
        const TRIGGER = fi::FI_TRIGGER;
        const FENCE = fi::FI_FENCE;
        const COMPLETION = fi::FI_COMPLETION;
        const INJECT = fi::FI_INJECT;
        const INJECT_COMPLETE = fi::FI_INJECT_COMPLETE;
        const TRANSMIT_COMPLETE = fi::FI_TRANSMIT_COMPLETE;
        const DELIVERY_COMPLETE = fi::FI_DELIVERY_COMPLETE;
        const AFFINITY = fi::FI_AFFINITY;
        const COMMIT_COMPLETE = fi::FI_COMMIT_COMPLETE;
        const MATCH_COMPLETE = fi::FI_MATCH_COMPLETE;
        const HMEM = fi::FI_HMEM;
        const VARIABLE_MSG = fi::FI_VARIABLE_MSG;
        const RMA_PMEM = fi::FI_RMA_PMEM;
        const SOURCE_ERR = fi::FI_SOURCE_ERR;
        const SELECTIVE_COMPLETION = fi::FI_SELECTIVE_COMPLETION;
        const CLAIM = fi::FI_CLAIM;
        const DISCARD = fi::FI_DISCARD;
        const LOCAL_COMM = fi::FI_LOCAL_COMM;
        const REMOTE_COMM = fi::FI_REMOTE_COMM;
        const SHARED_AV = fi::FI_SHARED_AV;
        const PROV_ATTR_ONLY = fi::FI_PROV_ATTR_ONLY;
        const NUMERICHOST = fi::FI_NUMERICHOST;
        const RMA_EVENT = fi::FI_RMA_EVENT;
        const SOURCE = fi::FI_SOURCE;
        const NAMED_RX_CTX = fi::FI_NAMED_RX_CTX;
        const DIRECTED_RECV = fi::FI_DIRECTED_RECV;
    }
}

/// The RMA capabilities (`fi_rma(3)`): an info offers them together or not at all.
pub const RMA_CAPS: Flags = Flags::RMA
    .union(Flags::READ)
    .union(Flags::WRITE)
    .union(Flags::REMOTE_READ)
    .union(Flags::REMOTE_WRITE);

/// The capabilities that need remote keys: RMA, and atomics (`fi_atomic(3)`), which rverbs
/// offers where it offers RMA and which take its directions.
pub const REMOTE_KEY_CAPS: Flags = RMA_CAPS.union(Flags::ATOMIC);

/// The primary capabilities (fi_getinfo(3)): an application gets those it asks for, no
/// more. All others are secondary, reported where offered.
pub const PRIMARY_CAPS: Flags = Flags::MSG
    .union(RMA_CAPS)
    .union(Flags::TAGGED)
    .union(Flags::ATOMIC)
    .union(Flags::MULTICAST)
    .union(Flags::COLLECTIVE)
    .union(Flags::NAMED_RX_CTX)
    .union(Flags::DIRECTED_RECV)
    .union(Flags::VARIABLE_MSG)
    .union(Flags::HMEM)
    .union(Flags::SEND)
    .union(Flags::RECV)
    .union(Flags::LOCAL_COMM)
    .union(Flags::REMOTE_COMM);

bitflags! {
    /// Mode bits (`FI_CONTEXT`, `FI_MSG_PREFIX`, …): what the provider asks of the application.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct Mode: u64 {
        const CONTEXT = fi::FI_CONTEXT;
        const MSG_PREFIX = fi::FI_MSG_PREFIX;
        const ASYNC_IOV = fi::FI_ASYNC_IOV;
        const RX_CQ_DATA = fi::FI_RX_CQ_DATA;
        const LOCAL_MR = fi::FI_LOCAL_MR;
        const NOTIFY_FLAGS_ONLY = fi::FI_NOTIFY_FLAGS_ONLY;
        const RESTRICTED_COMP = fi::FI_RESTRICTED_COMP;
        const CONTEXT2 = fi::FI_CONTEXT2;
        const BUFFERED_RECV = fi::FI_BUFFERED_RECV;
    }
}

bitflags! {
    /// Memory registration mode bits (`FI_MR_LOCAL`, …).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct MrMode: u32 {
        const LOCAL = fi::FI_MR_LOCAL as u32;
        const RAW = fi::FI_MR_RAW as u32;
        const VIRT_ADDR = fi::FI_MR_VIRT_ADDR as u32;
        const ALLOCATED = fi::FI_MR_ALLOCATED as u32;
        const PROV_KEY = fi::FI_MR_PROV_KEY as u32;
        const MMU_NOTIFY = fi::FI_MR_MMU_NOTIFY as u32;
        const RMA_EVENT = fi::FI_MR_RMA_EVENT as u32;
        const ENDPOINT = fi::FI_MR_ENDPOINT as u32;
        const HMEM = fi::FI_MR_HMEM as u32;
        const COLLECTIVE = fi::FI_MR_COLLECTIVE as u32;
    }
}

/// Declares a C enumeration as a Rust enum with its header values and a checked conversion.
macro_rules! fi_enum {
    ($(#[$m:meta])* $name:ident : $($variant:ident = $value:expr),+ $(,)?) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum $name {
            #[default]
            $($variant = $value as u32),+
        }

        impl $name {
            /// The enumerator with C value `v`, if there is one.
            pub fn from_raw(v: u32) -> Option<Self> {
                $(if v == $value as u32 { return Some($name::$variant); })+
                None
            }

            /// The C value.
            pub fn raw(self) -> u32 {
                self as u32
            }
        }
    };
}

fi_enum!(
    /// `enum fi_ep_type`.
    EpType: Unspec = fi::FI_EP_UNSPEC, Msg = fi::FI_EP_MSG, Dgram = fi::FI_EP_DGRAM, Rdm = fi::FI_EP_RDM,
    SockStream = fi::FI_EP_SOCK_STREAM, SockDgram = fi::FI_EP_SOCK_DGRAM
);
fi_enum!(
    /// Address formats (`FI_FORMAT_UNSPEC`, `FI_SOCKADDR_IN`, …).
    AddrFormat: Unspec = fi::FI_FORMAT_UNSPEC, Sockaddr = fi::FI_SOCKADDR, SockaddrIn = fi::FI_SOCKADDR_IN,
    SockaddrIn6 = fi::FI_SOCKADDR_IN6, SockaddrIb = fi::FI_SOCKADDR_IB, Psmx = fi::FI_ADDR_PSMX,
    Gni = fi::FI_ADDR_GNI, Bgq = fi::FI_ADDR_BGQ, Mlx = fi::FI_ADDR_MLX, Str = fi::FI_ADDR_STR,
    Psmx2 = fi::FI_ADDR_PSMX2, IbUd = fi::FI_ADDR_IB_UD, Efa = fi::FI_ADDR_EFA
);
fi_enum!(
    /// `enum fi_threading`.
    Threading: Unspec = fi::FI_THREAD_UNSPEC, Safe = fi::FI_THREAD_SAFE, Fid = fi::FI_THREAD_FID,
    Domain = fi::FI_THREAD_DOMAIN, Completion = fi::FI_THREAD_COMPLETION, Endpoint = fi::FI_THREAD_ENDPOINT
);
fi_enum!(
    /// `enum fi_progress`.
    Progress: Unspec = fi::FI_PROGRESS_UNSPEC, Auto = fi::FI_PROGRESS_AUTO, Manual = fi::FI_PROGRESS_MANUAL
);
fi_enum!(
    /// `enum fi_resource_mgmt`.
    ResourceMgmt: Unspec = fi::FI_RM_UNSPEC, Disabled = fi::FI_RM_DISABLED, Enabled = fi::FI_RM_ENABLED
);
fi_enum!(
    /// `enum fi_av_type`.
    AvType: Unspec = fi::FI_AV_UNSPEC, Map = fi::FI_AV_MAP, Table = fi::FI_AV_TABLE
);
fi_enum!(
    /// `enum fi_cq_format`.
    CqFormat: Unspec = fi::FI_CQ_FORMAT_UNSPEC, Context = fi::FI_CQ_FORMAT_CONTEXT, Msg = fi::FI_CQ_FORMAT_MSG,
    Data = fi::FI_CQ_FORMAT_DATA, Tagged = fi::FI_CQ_FORMAT_TAGGED
);
fi_enum!(
    /// `enum fi_wait_obj`.
    WaitObj: None = fi::FI_WAIT_NONE, Unspec = fi::FI_WAIT_UNSPEC, Set = fi::FI_WAIT_SET, Fd = fi::FI_WAIT_FD,
    MutexCond = fi::FI_WAIT_MUTEX_COND, Yield = fi::FI_WAIT_YIELD, PollFd = fi::FI_WAIT_POLLFD
);

fi_enum!(
    /// Endpoint options at level `FI_OPT_ENDPOINT` (`fi_getopt` / `fi_setopt`).
    EpOpt: MinMultiRecv = fi::FI_OPT_MIN_MULTI_RECV, CmDataSize = fi::FI_OPT_CM_DATA_SIZE,
    BufferedMin = fi::FI_OPT_BUFFERED_MIN, BufferedLimit = fi::FI_OPT_BUFFERED_LIMIT,
    SendBufSize = fi::FI_OPT_SEND_BUF_SIZE, RecvBufSize = fi::FI_OPT_RECV_BUF_SIZE,
    TxSize = fi::FI_OPT_TX_SIZE, RxSize = fi::FI_OPT_RX_SIZE
);
fi_enum!(
    /// `enum fi_cq_wait_cond`.
    CqWaitCond: None = fi::FI_CQ_COND_NONE, Threshold = fi::FI_CQ_COND_THRESHOLD
);

/// Protocol of rverbs MSG endpoints (`FI_PROTO_RDMA_CM_IB_RC`).
pub const PROTO_RDMA_CM_IB_RC: u32 = fi::FI_PROTO_RDMA_CM_IB_RC;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_are_the_header_values() {
        assert_eq!(Flags::MSG.bits(), 1 << 1);
        assert_eq!(Flags::RECV.bits(), 1 << 10);
        assert_eq!(Flags::SEND.bits(), 1 << 11);
        assert_eq!(Flags::TRANSMIT, Flags::SEND);
        assert_eq!(Flags::SOURCE.bits(), 1 << 57);
        assert_eq!(MrMode::LOCAL.bits(), 1 << 2);
    }

    #[test]
    fn enums_convert_both_ways_and_reject_unknown_values() {
        assert_eq!(EpType::from_raw(1), Some(EpType::Msg));
        assert_eq!(EpType::Rdm.raw(), fi::FI_EP_RDM);
        assert_eq!(EpType::from_raw(99), None);
        assert_eq!(
            Progress::from_raw(fi::FI_PROGRESS_MANUAL),
            Some(Progress::Manual)
        );
        assert_eq!(CqFormat::default(), CqFormat::Unspec);
    }
}
