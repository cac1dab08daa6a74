//! `fid_ep` of an `FI_EP_MSG` endpoint over [`MsgEndpoint`] (an RC queue pair connected
//! with rdma_cm), with ops tables of its own: every call knows its endpoint's type.

use std::ffi::c_void;
use std::mem::size_of;

use rfabric_sys::fabric as fi;

use crate::capi::cntr::CCntr;
use crate::capi::cq::CCq;
use crate::capi::ep::{
    endpoint_opt, not_passive_listen, not_passive_reject, on_buf, on_buf_or_none, on_inject,
    on_iov, on_msg_or_none, on_msg_rma, opt_value, put_opt, sockaddr_bytes,
};
use crate::capi::eq::{CConnReq, CEq};
use crate::capi::fid::{bytes, bytes_mut, fi_ops_of, fid, guarded, ops, Class, Obj};
use crate::capi::nosys::{self, n1, n2, n5i};
use crate::capi::srx::CSrx;
use crate::core::addr::parse_sockaddr;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::info::Info;
use crate::verbs::{Domain, MsgEndpoint, RmaIov};

/// A connected endpoint, and the connection request it accepts (closed with it).
pub(crate) struct MsgEpState {
    pub(crate) ep: MsgEndpoint,
    connreq: *mut fi::fid,
}

pub(crate) type CMsgEp = Obj<fi::fid_ep, MsgEpState>;
impl Class for CMsgEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &MSG_EP_FI_OPS
    }
}

pub(crate) static MSG_EP_FI_OPS: fi::fi_ops = fi_ops_of!(msg_close, msg_bind, msg_control);
pub(crate) static MSG_EP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(msg_getopt),
    setopt: Some(msg_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static MSG_EP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(msg_setname),
    getname: Some(msg_getname),
    getpeer: Some(msg_getpeer),
    connect: Some(msg_connect),
    listen: Some(not_passive_listen),
    accept: Some(msg_accept),
    reject: Some(not_passive_reject),
    shutdown: Some(msg_shutdown),
    join: Some(msg_join),
};
pub(crate) static MSG_EP_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(msg_recv),
    recvv: Some(msg_recvv),
    recvmsg: Some(msg_recvmsg),
    send: Some(msg_send),
    sendv: Some(msg_sendv),
    sendmsg: Some(msg_sendmsg),
    inject: Some(msg_inject),
    senddata: Some(msg_senddata),
    injectdata: Some(msg_injectdata),
};

pub(crate) static MSG_EP_RMA: fi::fi_ops_rma = fi::fi_ops_rma {
    size: size_of::<fi::fi_ops_rma>(),
    read: Some(msg_read),
    readv: Some(msg_readv),
    readmsg: Some(msg_readmsg),
    write: Some(msg_write),
    writev: Some(msg_writev),
    writemsg: Some(msg_writemsg),
    inject: Some(msg_inject_write),
    writedata: Some(msg_writedata),
    injectdata: Some(msg_inject_writedata),
};

/// `fi_endpoint` of an `FI_EP_MSG` info: active (`dest_addr`) or accepting (`handle`, the
/// connection request, closed with the endpoint).
pub(crate) fn open(
    domain: &std::sync::Arc<Domain>,
    info: &Info,
    connreq: *mut fi::fid,
    context: *mut c_void,
) -> Result<*mut fi::fid_ep> {
    let hdr = fi::fid_ep {
        fid: fid(fi::FI_CLASS_EP, context, &MSG_EP_FI_OPS),
        ops: ops(&MSG_EP_OPS),
        cm: ops(&MSG_EP_CM),
        msg: ops(&MSG_EP_MSG),
        rma: ops(&MSG_EP_RMA),
        tagged: ops(&nosys::TAGGED),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    };
    CMsgEp::try_into_raw_with(hdr, |at| {
        Ok(MsgEpState {
            ep: MsgEndpoint::open(domain, info, at)?,
            connreq,
        })
    })
}

unsafe extern "C" fn msg_close(f: *mut fi::fid) -> i32 {
    guarded("fi_close(ep)", || {
        // SAFETY: the fid fi_endpoint returned; its ops are checked first.
        unsafe {
            let req = CMsgEp::from_c(f.cast(), "ep")?.inner.connreq;
            CMsgEp::close(f.cast(), |_| Ok(()))?;
            if !req.is_null() {
                let _ = CConnReq::close(req, |_| Ok(()));
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn msg_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_ep_bind", || {
        // SAFETY: the application's endpoint fid (its ops are checked).
        let m = &unsafe { CMsgEp::from_c(f.cast(), "ep") }?.inner.ep;
        if b.is_null() {
            return Err(Error::new(errno::EINVAL, "the fid to bind is NULL"));
        }
        // SAFETY: non-NULL fid from the application; each branch checks its ops.
        unsafe {
            match (*b).fclass as u32 {
                fi::FI_CLASS_EQ => m.bind_eq(&CEq::from_c(b.cast(), "eq")?.inner.eq),
                fi::FI_CLASS_CQ => m.bind_cq(
                    &CCq::from_c(b.cast(), "cq")?.inner,
                    Flags::from_bits_retain(flags),
                ),
                fi::FI_CLASS_SRX_CTX => m.bind_srx(&CSrx::from_c(b.cast(), "srx")?.inner),
                fi::FI_CLASS_AV => Err(Error::new(
                    errno::EINVAL,
                    "MSG endpoints are connected: they take no address vector",
                )),
                fi::FI_CLASS_CNTR => m.bind_cntr(
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

unsafe extern "C" fn msg_control(f: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control(ep)", || {
        // SAFETY: the application's endpoint fid.
        let m = &unsafe { CMsgEp::from_c(f.cast(), "ep") }?.inner.ep;
        match cmd as u32 {
            fi::FI_ENABLE => m.enable(),
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an endpoint"),
            )),
        }
    })
}

unsafe extern "C" fn msg_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *mut c_void,
    optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt", || {
        // SAFETY: the application's endpoint fid.
        let m = &unsafe { CMsgEp::from_c(f.cast(), "ep") }?.inner.ep;
        let v = m.getopt(endpoint_opt(level, optname)?)?;
        // SAFETY: the application's option buffer.
        unsafe { put_opt(v, optval, optlen) }
    })
}

unsafe extern "C" fn msg_setopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *const c_void,
    optlen: usize,
) -> i32 {
    guarded("fi_setopt", || {
        // SAFETY: the application's endpoint fid and option buffer.
        let (m, v) = unsafe {
            (
                &CMsgEp::from_c(f.cast(), "ep")?.inner.ep,
                opt_value(optval, optlen)?,
            )
        };
        m.setopt(endpoint_opt(level, optname)?, v)
    })
}

unsafe extern "C" fn msg_setname(f: fi::fid_t, addr: *mut c_void, addrlen: usize) -> i32 {
    guarded("fi_setname", || {
        // SAFETY: the application's fid and address of addrlen bytes.
        let (m, sa) = unsafe {
            (
                &CMsgEp::from_c(f.cast(), "ep")?.inner.ep,
                parse_sockaddr(bytes(addr, addrlen, "addr")?)?,
            )
        };
        m.setname(&sa)
    })
}

unsafe extern "C" fn msg_getname(f: fi::fid_t, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("fi_getname", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid; non-NULL addrlen; a buffer of *addrlen bytes.
        unsafe {
            let m = &CMsgEp::from_c(f.cast(), "ep")?.inner.ep;
            let len = &mut *addrlen;
            m.getname_into(bytes_mut(addr, *len, "addr")?, len)
        }
    })
}

unsafe extern "C" fn msg_getpeer(
    ep: *mut fi::fid_ep,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> i32 {
    guarded("fi_getpeer", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid; non-NULL addrlen; a buffer of *addrlen bytes.
        unsafe {
            let m = &CMsgEp::from_c(ep, "ep")?.inner.ep;
            let len = &mut *addrlen;
            m.getpeer_into(bytes_mut(addr, *len, "addr")?, len)
        }
    })
}

unsafe extern "C" fn msg_connect(
    ep: *mut fi::fid_ep,
    addr: *const c_void,
    param: *const c_void,
    paramlen: usize,
) -> i32 {
    guarded("fi_connect", || {
        // SAFETY: the application's fid and buffers.
        let (m, data) = unsafe {
            (
                &CMsgEp::from_c(ep, "ep")?.inner.ep,
                bytes(param, paramlen, "param")?,
            )
        };
        if !addr.is_null() {
            // SAFETY: a sockaddr: its family says how long it is.
            let sa = parse_sockaddr(unsafe { sockaddr_bytes(addr) }?)?;
            if m.dest_addr() != Some(sa) {
                return Err(Error::new(
                    errno::EINVAL,
                    format!(
                        "fi_connect to {sa}, but the endpoint was opened for {:?}: rverbs resolves the route at fi_endpoint from fi_info.dest_addr",
                        m.dest_addr()
                    ),
                ));
            }
        }
        m.connect(data)
    })
}

unsafe extern "C" fn msg_accept(ep: *mut fi::fid_ep, param: *const c_void, paramlen: usize) -> i32 {
    guarded("fi_accept", || {
        // SAFETY: the application's fid and buffer.
        let (m, data) = unsafe {
            (
                &CMsgEp::from_c(ep, "ep")?.inner.ep,
                bytes(param, paramlen, "param")?,
            )
        };
        m.accept(data)
    })
}

unsafe extern "C" fn msg_shutdown(ep: *mut fi::fid_ep, flags: u64) -> i32 {
    guarded("fi_shutdown", || {
        // SAFETY: the application's fid.
        let m = &unsafe { CMsgEp::from_c(ep, "ep") }?.inner.ep;
        if flags != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_shutdown flags {flags:#x}: none are defined"),
            ));
        }
        m.shutdown()
    })
}

unsafe extern "C" fn msg_join(
    _ep: *mut fi::fid_ep,
    _addr: *const c_void,
    _flags: u64,
    _mc: *mut *mut fi::fid_mc,
    _context: *mut c_void,
) -> i32 {
    guarded("fi_join", || {
        Err(Error::new(
            errno::EINVAL,
            "fi_join is for datagram (FI_EP_DGRAM) endpoints",
        ))
    })
}

// ---- data transfer ---------------------------------------------------------------------

unsafe extern "C" fn msg_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf_or_none(
            "fi_send",
            ep,
            buf,
            len,
            desc,
            false,
            |e: &CMsgEp, mr, off| e.inner.ep.send(mr, off, len, ctx),
            |e| e.inner.ep.sendv(&[], ctx),
        )
    }
}

unsafe extern "C" fn msg_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf_or_none(
            "fi_senddata",
            ep,
            buf,
            len,
            desc,
            false,
            |e: &CMsgEp, mr, off| e.inner.ep.senddata(mr, off, len, data, ctx),
            |e| {
                let flags = e.inner.ep.tx_op_flags() | Flags::REMOTE_CQ_DATA;
                e.inner.ep.sendmsgv(&[], ctx, data, flags)
            },
        )
    }
}

unsafe extern "C" fn msg_sendv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov("fi_sendv", ep, iov, desc, count, |e: &CMsgEp, v| {
            e.inner.ep.sendv(v, ctx)
        })
    }
}

unsafe extern "C" fn msg_sendmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg_or_none(
            "fi_sendmsg",
            ep,
            msg,
            false,
            |e: &CMsgEp, v, m| {
                let ctx = m.context as u64;
                match v {
                    &[(mr, off, len)] => e.inner.ep.sendmsg(mr, off, len, ctx, m.data, fl),
                    v => e.inner.ep.sendmsgv(v, ctx, m.data, fl),
                }
            },
            |e, m| e.inner.ep.sendmsgv(&[], m.context as u64, m.data, fl),
        )
    }
}

unsafe extern "C" fn msg_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        on_inject("fi_inject", ep, buf, len, |e: &CMsgEp, data| {
            e.inner.ep.inject(data)
        })
    }
}

unsafe extern "C" fn msg_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    cq_data: u64,
    _dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        on_inject("fi_injectdata", ep, buf, len, |e: &CMsgEp, data| {
            e.inner.ep.injectdata(data, cq_data)
        })
    }
}

unsafe extern "C" fn msg_recv(
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
        on_buf_or_none(
            "fi_recv",
            ep,
            buf,
            len,
            desc,
            true,
            |e: &CMsgEp, mr, off| e.inner.ep.recv(mr, off, len, ctx),
            |e| e.inner.ep.recvv(&[], ctx),
        )
    }
}

unsafe extern "C" fn msg_recvv(
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
        on_iov("fi_recvv", ep, iov, desc, count, |e: &CMsgEp, v| {
            e.inner.ep.recvv(v, ctx)
        })
    }
}

unsafe extern "C" fn msg_recvmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg_or_none(
            "fi_recvmsg",
            ep,
            msg,
            true,
            |e: &CMsgEp, v, m| {
                let ctx = m.context as u64;
                match v {
                    &[(mr, off, len)] => e.inner.ep.recvmsg(mr, off, len, ctx, fl),
                    v => e.inner.ep.recvmsgv(v, ctx, fl),
                }
            },
            |e, m| e.inner.ep.recvmsgv(&[], m.context as u64, fl),
        )
    }
}

// fi_rma(3) on the connected peer: the address arguments of a connected endpoint are ignored.

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_read(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    _src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
    unsafe {
        on_buf("fi_read", ep, buf, desc, |e: &CMsgEp, mr, off| {
            e.inner.ep.read(mr, off, len, addr, key, ctx)
        })
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_readv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, iov and descriptors (fi_rma(3)).
    unsafe {
        on_iov("fi_readv", ep, iov, desc, count, |e: &CMsgEp, v| {
            let len = v.iter().map(|r| r.2).sum();
            let rma = RmaIov { addr, len, key };
            let flags = e.inner.ep.tx_op_flags();
            e.inner.ep.readmsg(v, &rma, ctx, flags)
        })
    }
}

unsafe extern "C" fn msg_readmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_rma,
    flags: u64,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_rma(3)).
    unsafe {
        on_msg_rma("fi_readmsg", ep, msg, |e: &CMsgEp, v, rma, m| {
            e.inner.ep.readmsg(v, rma, m.context as u64, fl)
        })
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_write(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    _dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
    unsafe {
        on_buf("fi_write", ep, buf, desc, |e: &CMsgEp, mr, off| {
            e.inner.ep.write(mr, off, len, addr, key, ctx)
        })
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_writev(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, iov and descriptors (fi_rma(3)).
    unsafe {
        on_iov("fi_writev", ep, iov, desc, count, |e: &CMsgEp, v| {
            let len = v.iter().map(|r| r.2).sum();
            let rma = RmaIov { addr, len, key };
            let flags = e.inner.ep.tx_op_flags();
            e.inner.ep.writemsg(v, &rma, ctx, 0, flags)
        })
    }
}

unsafe extern "C" fn msg_writemsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_rma,
    flags: u64,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_rma(3)).
    unsafe {
        on_msg_rma("fi_writemsg", ep, msg, |e: &CMsgEp, v, rma, m| {
            e.inner.ep.writemsg(v, rma, m.context as u64, m.data, fl)
        })
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_writedata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    _dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    let ctx = context as u64;
    // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
    unsafe {
        on_buf("fi_writedata", ep, buf, desc, |e: &CMsgEp, mr, off| {
            e.inner.ep.writedata(mr, off, len, data, addr, key, ctx)
        })
    }
}

unsafe extern "C" fn msg_inject_write(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_rma(3)).
    unsafe {
        on_inject("fi_inject_write", ep, buf, len, |e: &CMsgEp, data| {
            e.inner.ep.inject_write(data, addr, key)
        })
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn msg_inject_writedata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    _dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_rma(3)).
    unsafe {
        on_inject("fi_inject_writedata", ep, buf, len, |e: &CMsgEp, d| {
            e.inner.ep.inject_writedata(d, data, addr, key)
        })
    }
}
