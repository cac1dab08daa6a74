//! The verbs shared receive context (`fid_ep` of class `FI_CLASS_SRX_CTX` over a device
//! SRQ, for MSG endpoints): only receives apply. The software one, for caps that need
//! matching, is `soft_srx`.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::ep::{on_buf_or_none, on_iov, on_msg_or_none};
use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, ops, unshared, Class, Obj};
use crate::capi::nosys::{self, n1, n1i, n2, n2i, n3i, n4i, n5i, n6, n7};
use crate::core::error::Result;
use crate::core::flags::Flags;
use crate::verbs::{Domain, SharedRxContext};

pub(crate) type CSrx = Obj<fi::fid_ep, Arc<SharedRxContext>>;
impl Class for CSrx {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_SRX_CTX;
    fn fi_ops() -> &'static fi::fi_ops {
        &SRX_FI_OPS
    }
}
pub(crate) static SRX_FI_OPS: fi::fi_ops =
    fi_ops_of!(srx_close, no_bind, crate::capi::fid::no_control);
/// A shared receive context is not an endpoint of its own: only receives apply.
pub(crate) static SRX_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(nosys::n5i),
    setopt: Some(nosys::n5i),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static SRX_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(n3i),
    getname: Some(n3i),
    getpeer: Some(n3i),
    connect: Some(n4i),
    listen: Some(n1i),
    accept: Some(n3i),
    reject: Some(n4i),
    shutdown: Some(n2i),
    join: Some(n5i),
};
pub(crate) static SRX_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(srx_recv),
    recvv: Some(srx_recvv),
    recvmsg: Some(srx_recvmsg),
    send: Some(n6),
    sendv: Some(n6),
    sendmsg: Some(nosys::n3),
    inject: Some(nosys::n4),
    senddata: Some(n7),
    injectdata: Some(nosys::n5),
};
/// `fi_srx_context` of a verbs SRX on `domain`.
pub(crate) fn open(
    domain: &Arc<Domain>,
    attr: &fi::fi_rx_attr,
    context: *mut c_void,
) -> Result<*mut fi::fid_ep> {
    let s = SharedRxContext::open(domain, &crate::capi::info::rx_attr(attr))?;
    let hdr = fi::fid_ep {
        fid: fid(fi::FI_CLASS_SRX_CTX, context, &SRX_FI_OPS),
        ops: ops(&SRX_OPS),
        cm: ops(&SRX_CM),
        msg: ops(&SRX_MSG),
        rma: ops(&nosys::RMA),
        tagged: ops(&nosys::TAGGED),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    };
    Ok(CSrx::into_raw(hdr, s))
}

unsafe extern "C" fn srx_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_srx_context returned.
    guarded("fi_close(srx)", || unsafe {
        CSrx::close(f.cast(), |s| unshared(s, "shared receive context"))
    })
}
unsafe extern "C" fn srx_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf_or_none(
            "fi_recv(srx)",
            ep,
            buf,
            len,
            desc,
            true,
            |s: &CSrx, mr, off| s.inner.recv(mr, off, len, context as u64),
            |s| s.inner.recvv(&[], context as u64),
        )
    }
}
unsafe extern "C" fn srx_recvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov("fi_recvv(srx)", ep, iov, desc, count, |s: &CSrx, v| {
            s.inner.recvv(v, context as u64)
        })
    }
}
unsafe extern "C" fn srx_recvmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg_or_none(
            "fi_recvmsg(srx)",
            ep,
            msg,
            true,
            |s: &CSrx, v, m| match v {
                &[(mr, off, len)] => s.inner.recvmsg(mr, off, len, m.context as u64, fl),
                v => {
                    crate::verbs::ep_common::check_recv_flags(fl, Flags::empty())?;
                    s.inner.recvv(v, m.context as u64)
                }
            },
            |s, m| {
                crate::verbs::ep_common::check_recv_flags(fl, Flags::empty())?;
                s.inner.recvv(&[], m.context as u64)
            },
        )
    }
}
