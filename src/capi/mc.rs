//! `fid_mc` over [`Multicast`]: a datagram endpoint's join of a group, whose address
//! (`fi_mc_addr` reads `fid_mc.fi_addr` directly) is known once `FI_JOIN_COMPLETE` is read.

use std::ffi::c_void;
use std::net::SocketAddr;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, no_control, Class, Obj};
use crate::core::error::Result;
use crate::core::flags::Flags;
use crate::verbs::{DgramEndpoint, Multicast};

pub(crate) type CMc = Obj<fi::fid_mc, Multicast>;
impl Class for CMc {
    type Header = fi::fid_mc;
    const FCLASS: u32 = fi::FI_CLASS_MC;
    fn fi_ops() -> &'static fi::fi_ops {
        &MC_FI_OPS
    }
}
pub(crate) static MC_FI_OPS: fi::fi_ops = fi_ops_of!(mc_close, no_bind, no_control);
/// `fi_join` of `group` by `ep`; the join completes on the endpoint's EQ.
pub(crate) fn join(
    ep: &std::sync::Arc<DgramEndpoint>,
    group: &SocketAddr,
    flags: Flags,
    context: *mut c_void,
) -> Result<*mut fi::fid_mc> {
    let hdr = fi::fid_mc {
        fid: fid(fi::FI_CLASS_MC, context, &MC_FI_OPS),
        fi_addr: fi::FI_ADDR_NOTAVAIL,
    };
    CMc::try_into_raw_with(hdr, |at| ep.join(group, flags, at))
}

/// Called when `FI_JOIN_COMPLETE` for `fid` is read: `fi_mc_addr` reads `fid_mc.fi_addr`
/// directly, so the group's address is written there.
pub(crate) fn join_completed(fid: u64) {
    let p = fid as *mut fi::fid_mc;
    // SAFETY: provider events name handles of ours, open or tombstones (readable); the
    // ops are checked.
    if let Ok(m) = unsafe { CMc::from_c(p, "mc") } {
        if let Ok(a) = m.inner.mc_addr() {
            // SAFETY: the header is ours; C only reads fi_addr.
            unsafe { (*p).fi_addr = a };
        }
    }
}
unsafe extern "C" fn mc_close(f: *mut fi::fid) -> i32 {
    guarded("fi_close(mc)", || {
        // SAFETY: the fid fi_join returned (class checked by close).
        unsafe {
            CMc::from_c(f.cast(), "mc")?;
            CMc::close(f.cast(), |_| Ok(()))
        }
    })
}
