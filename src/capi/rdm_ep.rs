//! `fid_ep` of an `FI_EP_RDM` endpoint over [`RdmEndpoint`]: `fi_msg(3)` and
//! `fi_tagged(3)` on unregistered memory (descriptors are accepted and not needed: messages
//! are copied through the endpoint's own registered buffers).

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;
use rfabric_sys::mem::ForeignBuf;
use rfabric_sys::verbs::MAX_IOV;

use crate::capi::av::CAv;
use crate::capi::cq::CCq;
use crate::capi::ep::{endpoint_opt, not_passive_listen, not_passive_reject, opt_value, put_opt};
use crate::capi::fid::{
    bytes, bytes_mut, enosys, fi_ops_of, fid, guarded, guarded_len, ops, Class, Obj,
};
use crate::capi::nosys::{self, n1, n5i};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpOpt, Flags};
use crate::core::info::Info;
use crate::core::srx::Kind;
use crate::verbs::rdm_ep::RX_IOV_MAX;
use crate::verbs::{Domain, RdmEndpoint, RecvBuf};

pub(crate) type CRdmEp = Obj<fi::fid_ep, Arc<RdmEndpoint>>;
impl Class for CRdmEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &RDM_EP_FI_OPS
    }
}

pub(crate) static RDM_EP_FI_OPS: fi::fi_ops = fi_ops_of!(rdm_close, rdm_bind, rdm_control);
pub(crate) static RDM_EP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(rdm_cancel),
    getopt: Some(rdm_getopt),
    setopt: Some(rdm_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static RDM_EP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(rdm_setname),
    getname: Some(rdm_getname),
    getpeer: Some(rdm_getpeer),
    connect: Some(rdm_connect),
    listen: Some(not_passive_listen),
    accept: Some(rdm_accept),
    reject: Some(not_passive_reject),
    shutdown: Some(rdm_shutdown),
    join: Some(rdm_join),
};
pub(crate) static RDM_EP_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(rdm_recv),
    recvv: Some(rdm_recvv),
    recvmsg: Some(rdm_recvmsg),
    send: Some(rdm_send),
    sendv: Some(rdm_sendv),
    sendmsg: Some(rdm_sendmsg),
    inject: Some(rdm_inject),
    senddata: Some(rdm_senddata),
    injectdata: Some(rdm_injectdata),
};
pub(crate) static RDM_EP_TAGGED: fi::fi_ops_tagged = fi::fi_ops_tagged {
    size: size_of::<fi::fi_ops_tagged>(),
    recv: Some(rdm_trecv),
    recvv: Some(rdm_trecvv),
    recvmsg: Some(rdm_trecvmsg),
    send: Some(rdm_tsend),
    sendv: Some(rdm_tsendv),
    sendmsg: Some(rdm_tsendmsg),
    inject: Some(rdm_tinject),
    senddata: Some(rdm_tsenddata),
    injectdata: Some(rdm_tinjectdata),
};

/// `fi_endpoint` of an `FI_EP_RDM` info.
pub(crate) fn open(
    domain: &Arc<Domain>,
    info: &Info,
    context: *mut c_void,
) -> Result<*mut fi::fid_ep> {
    let hdr = fi::fid_ep {
        fid: fid(fi::FI_CLASS_EP, context, &RDM_EP_FI_OPS),
        ops: ops(&RDM_EP_OPS),
        cm: ops(&RDM_EP_CM),
        msg: ops(&RDM_EP_MSG),
        rma: ops(&crate::capi::rdm_rma::RDM_EP_RMA),
        tagged: ops(&RDM_EP_TAGGED),
        atomic: ops(&crate::capi::rdm_atomic::RDM_EP_ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    };
    Ok(CRdmEp::into_raw(
        hdr,
        Arc::new(RdmEndpoint::open(domain, info)?),
    ))
}

unsafe extern "C" fn rdm_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_endpoint returned; its ops are checked first.
    guarded("fi_close(ep)", || unsafe {
        CRdmEp::close(f.cast(), |_| Ok(()))
    })
}

unsafe extern "C" fn rdm_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_ep_bind", || {
        // SAFETY: the application's endpoint fid (its ops are checked).
        let g = &unsafe { CRdmEp::from_c(f.cast(), "ep") }?.inner;
        if b.is_null() {
            return Err(Error::new(errno::EINVAL, "the fid to bind is NULL"));
        }
        // SAFETY: non-NULL fid from the application; each branch checks its ops.
        unsafe {
            match (*b).fclass as u32 {
                fi::FI_CLASS_CQ => g.bind_cq(
                    &CCq::from_c(b.cast(), "cq")?.inner,
                    Flags::from_bits_retain(flags),
                ),
                fi::FI_CLASS_AV => g.bind_av(&CAv::from_c(b.cast(), "av")?.inner),
                // Connection events are the endpoint's own business; an EQ bound for
                // asynchronous errors is proven ours and receives none yet.
                fi::FI_CLASS_EQ => crate::capi::eq::CEq::from_c(b.cast(), "eq").map(|_| ()),
                fi::FI_CLASS_CNTR => g.bind_cntr(
                    &crate::capi::cntr::CCntr::from_c(b.cast(), "cntr")?.inner,
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

unsafe extern "C" fn rdm_control(f: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control(ep)", || {
        // SAFETY: the application's endpoint fid.
        let g = &unsafe { CRdmEp::from_c(f.cast(), "ep") }?.inner;
        match cmd as u32 {
            // Peers on this host go over shm from the start (unless turned off).
            fi::FI_ENABLE => g
                .enable()
                .and_then(|()| crate::capi::ext::local::import_shm(g).map(|_| ())),
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an endpoint"),
            )),
        }
    })
}

unsafe extern "C" fn rdm_cancel(f: fi::fid_t, context: *mut c_void) -> isize {
    guarded_len("fi_cancel", || {
        // SAFETY: the application's endpoint fid.
        let g = &unsafe { CRdmEp::from_c(f.cast(), "ep") }?.inner;
        g.cancel(context as u64).map(|()| 0)
    })
}

fn no_option(level: i32, optname: i32) -> Error {
    match endpoint_opt(level, optname) {
        Ok(opt) => Error::new(
            errno::ENOPROTOOPT,
            format!("RDM endpoints have no option {opt:?} yet"),
        ),
        Err(e) => e,
    }
}

unsafe extern "C" fn rdm_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *mut c_void,
    optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt", || {
        // SAFETY: the application's endpoint fid.
        let g = &unsafe { CRdmEp::from_c(f.cast(), "ep") }?.inner;
        match endpoint_opt(level, optname)? {
            // SAFETY: the application's option buffer and length.
            EpOpt::MinMultiRecv => unsafe { put_opt(g.min_multi_recv()?, optval, optlen) },
            _ => Err(no_option(level, optname)),
        }
    })
}

unsafe extern "C" fn rdm_setopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *const c_void,
    optlen: usize,
) -> i32 {
    guarded("fi_setopt", || {
        // SAFETY: the application's endpoint fid.
        let g = &unsafe { CRdmEp::from_c(f.cast(), "ep") }?.inner;
        match endpoint_opt(level, optname)? {
            // SAFETY: the application's option value and length.
            EpOpt::MinMultiRecv => g.set_min_multi_recv(unsafe { opt_value(optval, optlen) }?),
            _ => Err(no_option(level, optname)),
        }
    })
}

unsafe extern "C" fn rdm_setname(f: fi::fid_t, _addr: *mut c_void, _addrlen: usize) -> i32 {
    guarded("fi_setname", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(f.cast(), "ep") }?;
        Err(enosys(
            "fi_setname on an RDM endpoint (its name is its listener's, chosen at enable)",
        ))
    })
}

unsafe extern "C" fn rdm_getname(f: fi::fid_t, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("fi_getname", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid; non-NULL addrlen; a buffer of *addrlen bytes.
        unsafe {
            let g = &CRdmEp::from_c(f.cast(), "ep")?.inner;
            let len = &mut *addrlen;
            g.getname_into(bytes_mut(addr, *len, "addr")?, len)
        }
    })
}

fn connectionless(what: &str) -> Error {
    Error::new(
        errno::EINVAL,
        format!(
            "{what} is for connected (FI_EP_MSG) endpoints: RDM endpoints connect on their own"
        ),
    )
}

unsafe extern "C" fn rdm_getpeer(ep: *mut fi::fid_ep, _a: *mut c_void, _l: *mut usize) -> i32 {
    guarded("fi_getpeer", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(ep, "ep") }?;
        Err(connectionless("fi_getpeer"))
    })
}

unsafe extern "C" fn rdm_connect(
    ep: *mut fi::fid_ep,
    _addr: *const c_void,
    _param: *const c_void,
    _paramlen: usize,
) -> i32 {
    guarded("fi_connect", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(ep, "ep") }?;
        Err(connectionless("fi_connect"))
    })
}

unsafe extern "C" fn rdm_accept(ep: *mut fi::fid_ep, _p: *const c_void, _l: usize) -> i32 {
    guarded("fi_accept", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(ep, "ep") }?;
        Err(connectionless("fi_accept"))
    })
}

unsafe extern "C" fn rdm_shutdown(ep: *mut fi::fid_ep, _flags: u64) -> i32 {
    guarded("fi_shutdown", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(ep, "ep") }?;
        Err(connectionless("fi_shutdown"))
    })
}

unsafe extern "C" fn rdm_join(
    ep: *mut fi::fid_ep,
    _addr: *const c_void,
    _flags: u64,
    _mc: *mut *mut fi::fid_mc,
    _context: *mut c_void,
) -> i32 {
    guarded("fi_join", || {
        // SAFETY: the application's endpoint fid.
        unsafe { CRdmEp::from_c(ep, "ep") }?;
        Err(enosys(
            "fi_join on RDM endpoints (multicast is a DGRAM feature)",
        ))
    })
}

// ---- data transfer ---------------------------------------------------------------------

/// The endpoint behind `ep`, for a data call.
///
/// # Safety
/// `ep` is the application's endpoint handle.
#[inline(always)]
pub(crate) unsafe fn rdm<'a>(ep: *mut fi::fid_ep) -> Result<&'a RdmEndpoint> {
    // An application's endpoint in a load and two compares, inlined in each data call.
    // SAFETY: the caller's contract.
    match unsafe { CRdmEp::proven(ep) } {
        Some(o) => Ok(&o.inner),
        // SAFETY: as above.
        None => unsafe { rdm_other(ep) },
    }
}

/// [`rdm`] for anything but an application's endpoint: a peer's transfer endpoint, or
/// the error.
///
/// # Safety
/// As [`rdm`].
#[inline(never)]
unsafe fn rdm_other<'a>(ep: *mut fi::fid_ep) -> Result<&'a RdmEndpoint> {
    // A peer's transfer endpoint shares these data calls (its handle marks them): told
    // apart by its ops table, so neither kind builds the other's error on the data path.
    // SAFETY: the caller's contract (ops_of checks for NULL).
    let ops = unsafe { crate::capi::fid::ops_of(ep.cast(), "ep") }?;
    if std::ptr::eq(ops, &RDM_TRANSFER_FI_OPS) {
        // SAFETY: as above; from_c proves the object whole.
        return Ok(&unsafe { CRdmTransferEp::from_c(ep, "ep") }?.inner.ep);
    }
    // SAFETY: as above; the ops are checked.
    Ok(&unsafe { CRdmEp::from_c(ep, "ep") }?.inner)
}

/// What closing a peer's transfer endpoint does first: the link's side (it lives with the
/// code that calls the peer, `capi::ext::transfer`) closes the peer's endpoint and ends
/// the link.
pub(crate) trait TransferClose: Send + Sync {
    fn close(&self, ep: &RdmEndpoint);
}

/// The endpoint a peer provider posts its transfers on over an RDM endpoint
/// (`fi_peer_transfer_context.ep`): the RDM data calls on a handle whose traffic is the
/// peer's (`RdmEndpoint::peer_transfer`).
pub(crate) struct RdmTransferEp {
    pub(crate) ep: RdmEndpoint,
    pub(crate) link: Box<dyn TransferClose>,
}

pub(crate) type CRdmTransferEp = Obj<fi::fid_ep, RdmTransferEp>;
impl Class for CRdmTransferEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &RDM_TRANSFER_FI_OPS
    }
}

pub(crate) static RDM_TRANSFER_FI_OPS: fi::fi_ops = fi_ops_of!(
    rdm_transfer_close,
    crate::capi::fid::no_bind,
    crate::capi::fid::no_control
);

unsafe extern "C" fn rdm_transfer_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid open_transfer returned; its ops are checked first.
    guarded("fi_close(peer transfer)", || unsafe {
        CRdmTransferEp::close(f.cast(), |t| {
            t.link.close(&t.ep);
            Ok(())
        })
    })
}

/// A receive buffer of the application's (`len` bytes at `buf`).
///
/// # Safety
/// `buf` has `len` writable bytes until the receive completes (fi_msg(3)).
pub(crate) unsafe fn recv_buf(buf: *mut c_void, len: usize) -> Result<RecvBuf> {
    if buf.is_null() && len > 0 {
        return Err(Error::new(errno::EINVAL, "buf is NULL"));
    }
    if len > isize::MAX as usize {
        return Err(Error::new(
            errno::EINVAL,
            format!("a receive of {len} bytes"),
        ));
    }
    // SAFETY: the caller's contract (non-NULL when non-empty).
    Ok(RecvBuf::Foreign(unsafe {
        ForeignBuf::new(buf.cast(), len)
    }))
}

/// The buffer of a receive iov: its one range, or up to `rx_attr.iov_limit` filled in order.
///
/// # Safety
/// `iov` is NULL or holds `count` elements, each writable until the receive completes.
unsafe fn recv_iov(iov: *const libc::iovec, count: usize) -> Result<RecvBuf> {
    if count > RX_IOV_MAX || (count > 0 && iov.is_null()) {
        return Err(Error::new(
            errno::EINVAL,
            format!("a receive iov of {count} ranges (0 to {RX_IOV_MAX}, rx_attr.iov_limit)"),
        ));
    }
    if count <= 1 {
        // SAFETY: at most one element, per the caller's contract.
        let v = (count == 1).then(|| unsafe { *iov });
        let (base, len) = v.map_or((std::ptr::null_mut(), 0), |v| (v.iov_base, v.iov_len));
        // SAFETY: the element's buffer, per the caller's contract.
        return unsafe { recv_buf(base, len) };
    }
    let mut parts: [RecvBuf; RX_IOV_MAX] =
        std::array::from_fn(|_| RecvBuf::Foreign(ForeignBuf::EMPTY));
    for (i, p) in parts.iter_mut().enumerate().take(count) {
        // SAFETY: count elements, each writable for iov_len bytes (the caller's contract).
        *p = unsafe {
            let v = *iov.add(i);
            recv_buf(v.iov_base, v.iov_len)?
        };
    }
    RecvBuf::scatter(parts.into_iter().take(count))
}

/// A send buffer of the application's, valid until the send completes (fi_msg(3)): read
/// after the call returns when the message is larger than the eager size.
///
/// # Safety
/// `buf` has `len` readable bytes, unchanged until the send completes.
pub(crate) unsafe fn send_buf(buf: *const c_void, len: usize) -> Result<ForeignBuf> {
    if buf.is_null() && len > 0 {
        return Err(Error::new(errno::EINVAL, "buf is NULL"));
    }
    if len > isize::MAX as usize {
        return Err(Error::new(errno::EINVAL, format!("a send of {len} bytes")));
    }
    // SAFETY: the caller's contract; the endpoint only reads (or registers) it.
    Ok(unsafe { ForeignBuf::new(buf as *mut u8, len) })
}

/// A send iov, as application buffers valid until the send completes: gathered into
/// bounce buffers when small, read by the receiver range by range when large.
///
/// # Safety
/// `iov` is NULL or holds `count` readable elements, unchanged until the send completes.
unsafe fn send_iov<R>(
    iov: *const libc::iovec,
    count: usize,
    f: impl FnOnce(&[ForeignBuf]) -> Result<R>,
) -> Result<R> {
    if count > MAX_IOV || (count > 0 && iov.is_null()) {
        return Err(Error::new(
            errno::EINVAL,
            format!("a send iov of {count} ranges (0 to {MAX_IOV})"),
        ));
    }
    let mut v = [ForeignBuf::EMPTY; MAX_IOV];
    for (i, slot) in v.iter_mut().enumerate().take(count) {
        // SAFETY: count elements, each with iov_len readable bytes (the caller's contract).
        *slot = unsafe {
            let e = *iov.add(i);
            send_buf(e.iov_base, e.iov_len)?
        };
    }
    f(&v[..count])
}

unsafe extern "C" fn rdm_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe { send_one("fi_send", ep, buf, len, dest, None, None, context) }
}

unsafe extern "C" fn rdm_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe { send_one("fi_senddata", ep, buf, len, dest, None, Some(data), context) }
}

unsafe extern "C" fn rdm_sendv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let m = Gather {
        iov,
        count,
        dest,
        tag: None,
        data: None,
        context: context as u64,
    };
    // SAFETY: the application's handle and iov (fi_msg(3)).
    unsafe { send_gather("fi_sendv", ep, m, None) }
}

/// One send of `len` bytes at `buf` (`fi_send`, `fi_senddata`, `fi_tsend`,
/// `fi_tsenddata`): tagged with `tag`, with `data` as remote CQ data.
///
/// # Safety
/// `ep` is the application's endpoint handle; `buf` has `len` readable bytes, unchanged
/// until the send completes.
#[allow(clippy::too_many_arguments)]
unsafe fn send_one(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
    tag: Option<u64>,
    data: Option<u64>,
    context: *mut c_void,
) -> isize {
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        unsafe {
            let e = rdm(ep)?;
            e.send_foreign(
                send_buf(buf, len)?,
                dest,
                tag,
                data,
                context as u64,
                e.tx_default(),
            )
        }
        .map(|()| 0)
    })
}

/// A send gathered from an iov (`fi_sendv`, `fi_tsendv` and the `*msg` calls).
#[derive(Clone, Copy)]
struct Gather {
    iov: *const libc::iovec,
    count: usize,
    dest: fi::fi_addr_t,
    tag: Option<u64>,
    data: Option<u64>,
    context: u64,
}

/// Posts `m` with `flags` (`None`: the endpoint's defaults, for calls without flags).
///
/// # Safety
/// `ep` is the application's endpoint handle; `m.iov` is NULL or holds `m.count` readable
/// elements, unchanged until the send completes.
unsafe fn send_gather(what: &str, ep: *mut fi::fid_ep, m: Gather, flags: Option<Flags>) -> isize {
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        unsafe {
            let e = rdm(ep)?;
            let flags = flags.unwrap_or_else(|| e.tx_default());
            send_iov(m.iov, m.count, |v| match v {
                [one] => e.send_foreign(*one, m.dest, m.tag, m.data, m.context, flags),
                _ => e.send_foreign_iov(v, m.dest, m.tag, m.data, m.context, flags),
            })
        }
        .map(|()| 0)
    })
}

/// `FI_REMOTE_CQ_DATA`'s data when the flag asks for it.
fn data_of(flags: Flags, data: u64) -> Option<u64> {
    flags.contains(Flags::REMOTE_CQ_DATA).then_some(data)
}

/// A `*msg` send: a NULL `msg` is `-FI_EINVAL`; otherwise `gather` reads it.
///
/// # Safety
/// `ep` is the application's endpoint handle; `msg` is NULL or the application's message,
/// whose iov stays unchanged until the send completes.
unsafe fn send_msg_of<M>(
    what: &str,
    ep: *mut fi::fid_ep,
    msg: *const M,
    flags: u64,
    gather: impl FnOnce(&M, Flags) -> Gather,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the caller's contract.
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return guarded_len(what, || Err(Error::new(errno::EINVAL, "msg is NULL")));
    };
    let g = gather(m, fl);
    // SAFETY: the caller's contract.
    unsafe { send_gather(what, ep, g, Some(fl)) }
}

unsafe extern "C" fn rdm_sendmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        send_msg_of("fi_sendmsg", ep, msg, flags, |m, fl| Gather {
            iov: m.msg_iov,
            count: m.iov_count,
            dest: m.addr,
            tag: None,
            data: data_of(fl, m.data),
            context: m.context as u64,
        })
    }
}

unsafe extern "C" fn rdm_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
) -> isize {
    guarded_len("fi_inject", || {
        // SAFETY: the application's handle and buffer (fi_msg(3)).
        unsafe { rdm(ep)?.inject(bytes(buf, len, "buf")?, dest) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
) -> isize {
    guarded_len("fi_injectdata", || {
        // SAFETY: the application's handle and buffer (fi_msg(3)).
        unsafe { rdm(ep)?.injectdata(bytes(buf, len, "buf")?, data, dest) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_recv", || {
        // SAFETY: the application's handle and buffer (fi_msg(3)).
        unsafe { rdm(ep)?.recv(recv_buf(buf, len)?, src, context as u64) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_recvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_recvv", || {
        // SAFETY: the application's handle and iov (fi_msg(3)).
        unsafe { rdm(ep)?.recv(recv_iov(iov, count)?, src, context as u64) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_recvmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    guarded_len("fi_recvmsg", || {
        // SAFETY: the application's handle and message (fi_msg(3)).
        unsafe {
            let e = rdm(ep)?;
            let m = msg
                .as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?;
            e.recvmsg(
                recv_iov(m.msg_iov, m.iov_count)?,
                Kind::Msg,
                m.addr,
                0,
                0,
                m.context as u64,
                fl,
            )
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn rdm_tsend(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi::fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_tagged(3)).
    unsafe { send_one("fi_tsend", ep, buf, len, dest, Some(tag), None, context) }
}

unsafe extern "C" fn rdm_tsenddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_tagged(3)).
    unsafe {
        send_one(
            "fi_tsenddata",
            ep,
            buf,
            len,
            dest,
            Some(tag),
            Some(data),
            context,
        )
    }
}

unsafe extern "C" fn rdm_tsendv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    let m = Gather {
        iov,
        count,
        dest,
        tag: Some(tag),
        data: None,
        context: context as u64,
    };
    // SAFETY: the application's handle and iov (fi_tagged(3)).
    unsafe { send_gather("fi_tsendv", ep, m, None) }
}

unsafe extern "C" fn rdm_tsendmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_tagged,
    flags: u64,
) -> isize {
    // SAFETY: the application's handle and message (fi_tagged(3)).
    unsafe {
        send_msg_of("fi_tsendmsg", ep, msg, flags, |m, fl| Gather {
            iov: m.msg_iov,
            count: m.iov_count,
            dest: m.addr,
            tag: Some(m.tag),
            data: data_of(fl, m.data),
            context: m.context as u64,
        })
    }
}

unsafe extern "C" fn rdm_tinject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
    tag: u64,
) -> isize {
    guarded_len("fi_tinject", || {
        // SAFETY: the application's handle and buffer (fi_tagged(3)).
        unsafe { rdm(ep)?.tinject(bytes(buf, len, "buf")?, tag, dest) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_tinjectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
    tag: u64,
) -> isize {
    guarded_len("fi_tinjectdata", || {
        // SAFETY: the application's handle and buffer (fi_tagged(3)).
        unsafe { rdm(ep)?.tinjectdata(bytes(buf, len, "buf")?, data, tag, dest) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_trecv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_trecv", || {
        // SAFETY: the application's handle and buffer (fi_tagged(3)).
        unsafe { rdm(ep)?.trecv(recv_buf(buf, len)?, src, tag, ignore, context as u64) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_trecvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_trecvv", || {
        // SAFETY: the application's handle and iov (fi_tagged(3)).
        unsafe { rdm(ep)?.trecv(recv_iov(iov, count)?, src, tag, ignore, context as u64) }
            .map(|()| 0)
    })
}

unsafe extern "C" fn rdm_trecvmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_tagged,
    flags: u64,
) -> isize {
    let fl = Flags::from_bits_retain(flags);
    guarded_len("fi_trecvmsg", || {
        // SAFETY: the application's handle and message (fi_tagged(3)).
        unsafe {
            let e = rdm(ep)?;
            let m = msg
                .as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?;
            e.recvmsg(
                recv_iov(m.msg_iov, m.iov_count)?,
                Kind::Tag,
                m.addr,
                m.tag,
                m.ignore,
                m.context as u64,
                fl,
            )
        }
        .map(|()| 0)
    })
}
