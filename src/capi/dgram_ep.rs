//! `fid_ep` of an `FI_EP_DGRAM` endpoint over [`DgramEndpoint`] (a UD queue pair), with
//! ops tables of its own, and `fi_join` of its multicast groups.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::av::CAv;
use crate::capi::cntr::CCntr;
use crate::capi::cq::CCq;
use crate::capi::ep::{
    endpoint_opt, not_passive_listen, not_passive_reject, on_buf, on_inject, on_iov, on_msg,
    sockaddr_bytes,
};
use crate::capi::eq::CEq;
use crate::capi::fid::{bytes_mut, enosys, fi_ops_of, fid, guarded, ops, Class, Obj};
use crate::capi::nosys::{self, n1, n2, n5i};
use crate::core::addr::parse_sockaddr;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::info::Info;
use crate::verbs::{DgramEndpoint, Domain};

pub(crate) type CDgramEp = Obj<fi::fid_ep, Arc<DgramEndpoint>>;
impl Class for CDgramEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &DGRAM_EP_FI_OPS
    }
}

pub(crate) static DGRAM_EP_FI_OPS: fi::fi_ops = fi_ops_of!(dgram_close, dgram_bind, dgram_control);
pub(crate) static DGRAM_EP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(dgram_getopt),
    setopt: Some(dgram_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static DGRAM_EP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(dgram_setname),
    getname: Some(dgram_getname),
    getpeer: Some(dgram_getpeer),
    connect: Some(dgram_connect),
    listen: Some(not_passive_listen),
    accept: Some(dgram_accept),
    reject: Some(not_passive_reject),
    shutdown: Some(dgram_shutdown),
    join: Some(dgram_join),
};
pub(crate) static DGRAM_EP_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(dgram_recv),
    recvv: Some(dgram_recvv),
    recvmsg: Some(dgram_recvmsg),
    send: Some(dgram_send),
    sendv: Some(dgram_sendv),
    sendmsg: Some(dgram_sendmsg),
    inject: Some(dgram_inject),
    senddata: Some(dgram_senddata),
    injectdata: Some(dgram_injectdata),
};

/// `fi_endpoint` of an `FI_EP_DGRAM` info.
pub(crate) fn open(
    domain: &Arc<Domain>,
    info: &Info,
    context: *mut c_void,
) -> Result<*mut fi::fid_ep> {
    let hdr = fi::fid_ep {
        fid: fid(fi::FI_CLASS_EP, context, &DGRAM_EP_FI_OPS),
        ops: ops(&DGRAM_EP_OPS),
        cm: ops(&DGRAM_EP_CM),
        msg: ops(&DGRAM_EP_MSG),
        rma: ops(&nosys::RMA),
        tagged: ops(&nosys::TAGGED),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    };
    Ok(CDgramEp::into_raw(hdr, DgramEndpoint::open(domain, info)?))
}

/// The name of a datagram endpoint, for a peer asking where it is in the AV (`ep_addr`);
/// `None` for anything else.
///
/// # Safety
/// `ep` is NULL or a readable `fid_ep`.
pub(crate) unsafe fn dgram_name(ep: *mut fi::fid_ep) -> Option<crate::verbs::UdName> {
    // SAFETY: the caller's contract; the ops are checked.
    unsafe { CDgramEp::from_c(ep, "ep") }
        .ok()?
        .inner
        .getname()
        .ok()
}

unsafe extern "C" fn dgram_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_endpoint returned; its ops are checked first.
    guarded("fi_close(ep)", || unsafe {
        CDgramEp::close(f.cast(), |_| Ok(()))
    })
}

unsafe extern "C" fn dgram_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_ep_bind", || {
        // SAFETY: the application's endpoint fid (its ops are checked).
        let g = &unsafe { CDgramEp::from_c(f.cast(), "ep") }?.inner;
        if b.is_null() {
            return Err(Error::new(errno::EINVAL, "the fid to bind is NULL"));
        }
        // SAFETY: non-NULL fid from the application; each branch checks its ops.
        unsafe {
            match (*b).fclass as u32 {
                fi::FI_CLASS_EQ => g.bind_eq(&CEq::from_c(b.cast(), "eq")?.inner.eq),
                fi::FI_CLASS_CQ => g.bind_cq(
                    &CCq::from_c(b.cast(), "cq")?.inner,
                    Flags::from_bits_retain(flags),
                ),
                fi::FI_CLASS_AV => g.bind_av(&CAv::from_c(b.cast(), "av")?.inner),
                fi::FI_CLASS_CNTR => g.bind_cntr(
                    &CCntr::from_c(b.cast(), "cntr")?.inner,
                    Flags::from_bits_retain(flags),
                ),
                c => Err(Error::new(
                    errno::EINVAL,
                    format!("an endpoint cannot be bound to a fid of class {c}"),
                )),
            }
        }
    })
}

unsafe extern "C" fn dgram_control(f: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control(ep)", || {
        // SAFETY: the application's endpoint fid.
        let g = &unsafe { CDgramEp::from_c(f.cast(), "ep") }?.inner;
        match cmd as u32 {
            fi::FI_ENABLE => g.enable(),
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an endpoint"),
            )),
        }
    })
}

fn no_option(level: i32, optname: i32) -> Error {
    match endpoint_opt(level, optname) {
        Ok(opt) => Error::new(
            errno::ENOPROTOOPT,
            format!("datagram endpoints have no option {opt:?}"),
        ),
        Err(e) => e,
    }
}

unsafe extern "C" fn dgram_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    _optval: *mut c_void,
    _optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(f.cast(), "ep") }?;
        Err(no_option(level, optname))
    })
}

unsafe extern "C" fn dgram_setopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    _optval: *const c_void,
    _optlen: usize,
) -> i32 {
    guarded("fi_setopt", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(f.cast(), "ep") }?;
        Err(no_option(level, optname))
    })
}

unsafe extern "C" fn dgram_setname(f: fi::fid_t, _addr: *mut c_void, _addrlen: usize) -> i32 {
    guarded("fi_setname", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(f.cast(), "ep") }?;
        Err(enosys(
            "fi_setname on a datagram endpoint (its name is the queue pair the device assigns)",
        ))
    })
}

unsafe extern "C" fn dgram_getname(f: fi::fid_t, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("fi_getname", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid; non-NULL addrlen; a buffer of *addrlen bytes.
        unsafe {
            let g = &CDgramEp::from_c(f.cast(), "ep")?.inner;
            let len = &mut *addrlen;
            g.getname_into(bytes_mut(addr, *len, "addr")?, len)
        }
    })
}

fn not_connected(what: &str) -> Error {
    Error::new(
        errno::EINVAL,
        format!("{what} is for connected (FI_EP_MSG) endpoints"),
    )
}

unsafe extern "C" fn dgram_getpeer(
    ep: *mut fi::fid_ep,
    _addr: *mut c_void,
    addrlen: *mut usize,
) -> i32 {
    guarded("fi_getpeer", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(ep, "ep") }?;
        Err(Error::new(
            errno::EINVAL,
            "datagram endpoints have no peer: look addresses up in the AV",
        ))
    })
}

unsafe extern "C" fn dgram_connect(
    ep: *mut fi::fid_ep,
    _addr: *const c_void,
    _param: *const c_void,
    _paramlen: usize,
) -> i32 {
    guarded("fi_connect", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(ep, "ep") }?;
        Err(not_connected("fi_connect"))
    })
}

unsafe extern "C" fn dgram_accept(ep: *mut fi::fid_ep, _p: *const c_void, _l: usize) -> i32 {
    guarded("fi_accept", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(ep, "ep") }?;
        Err(not_connected("fi_accept"))
    })
}

unsafe extern "C" fn dgram_shutdown(ep: *mut fi::fid_ep, _flags: u64) -> i32 {
    guarded("fi_shutdown", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CDgramEp::from_c(ep, "ep") }?;
        Err(not_connected("fi_shutdown"))
    })
}

unsafe extern "C" fn dgram_join(
    ep: *mut fi::fid_ep,
    addr: *const c_void,
    flags: u64,
    mc: *mut *mut fi::fid_mc,
    context: *mut c_void,
) -> i32 {
    guarded("fi_join", || {
        if mc.is_null() || addr.is_null() {
            return Err(Error::new(errno::EINVAL, "addr or mc is NULL"));
        }
        // SAFETY: the application's fid and group address.
        let (g, group) = unsafe {
            (
                &CDgramEp::from_c(ep, "ep")?.inner,
                parse_sockaddr(sockaddr_bytes(addr)?)?,
            )
        };
        let p = crate::capi::mc::join(g, &group, Flags::from_bits_retain(flags), context)?;
        // SAFETY: checked for NULL above, writable per fi_join(3).
        unsafe { *mc = p };
        Ok(())
    })
}

// ---- data transfer ---------------------------------------------------------------------

unsafe extern "C" fn dgram_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf("fi_send", ep, buf, desc, |e: &CDgramEp, mr, off| {
            e.inner.send(mr, off, len, dest, ctx)
        })
    }
}

unsafe extern "C" fn dgram_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf("fi_senddata", ep, buf, desc, |e: &CDgramEp, mr, off| {
            e.inner.senddata(mr, off, len, data, dest, ctx)
        })
    }
}

unsafe extern "C" fn dgram_sendv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov("fi_sendv", ep, iov, desc, count, |e: &CDgramEp, v| {
            e.inner.sendv(v, dest, ctx)
        })
    }
}

unsafe extern "C" fn dgram_sendmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    flags: u64,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg("fi_sendmsg", ep, msg, |e: &CDgramEp, v, m| {
            let ctx = m.context as u64;
            match v {
                &[(mr, off, len)] => e.inner.sendmsg(mr, off, len, m.addr, ctx, m.data, fl),
                v => e.inner.sendmsgv(v, m.addr, ctx, m.data, fl),
            }
        })
    }
}

unsafe extern "C" fn dgram_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        on_inject("fi_inject", ep, buf, len, |e: &CDgramEp, data| {
            e.inner.inject(data, dest)
        })
    }
}

unsafe extern "C" fn dgram_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    cq_data: u64,
    dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        on_inject("fi_injectdata", ep, buf, len, |e: &CDgramEp, data| {
            e.inner.injectdata(data, cq_data, dest)
        })
    }
}

unsafe extern "C" fn dgram_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf("fi_recv", ep, buf, desc, |e: &CDgramEp, mr, off| {
            e.inner.recv(mr, off, len, ctx)
        })
    }
}

unsafe extern "C" fn dgram_recvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov("fi_recvv", ep, iov, desc, count, |e: &CDgramEp, v| {
            e.inner.recvv(v, ctx)
        })
    }
}

unsafe extern "C" fn dgram_recvmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    flags: u64,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg("fi_recvmsg", ep, msg, |e: &CDgramEp, v, m| {
            let ctx = m.context as u64;
            match v {
                &[(mr, off, len)] => e.inner.recvmsg(mr, off, len, ctx, fl),
                v => e.inner.recvmsgv(v, ctx, fl),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_open_datagram_endpoint_has_a_name_for_a_peer() {
        // SAFETY: a zeroed fid_ep is readable and carries no ops of ours.
        let mut z: fi::fid_ep = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert!(unsafe { dgram_name(&mut z) }.is_none());
        // SAFETY: NULL is refused.
        assert!(unsafe { dgram_name(std::ptr::null_mut()) }.is_none());
    }
}
