//! The software shared receive context: the receive engine (`core::srx`) as the SRX an
//! application posts to (`fi_srx_context`), and that peer providers share through
//! `fid_peer_srx` (fi_peer(3)). It matches tags and sources, which a verbs SRQ cannot, so
//! `fi_srx_context` makes one when the receive caps ask for `FI_TAGGED` or
//! `FI_DIRECTED_RECV`; otherwise the SRX is a verbs SRQ for MSG endpoints.
//!
//! Its messages come from peers (libfabric's shm, imported with `ShmImport`); their
//! completions, and its own (cancel, peek), go to the CQ bound with `fi_ep_bind(srx, cq,
//! FI_RECV)`.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, OnceLock};

use rfabric_sys::fabric as fi;

use crate::capi::cq::CCq;
use crate::capi::ep::{endpoint_opt, put_opt};
use crate::capi::fid::{fi_ops_of, fid, guarded, guarded_len, ops, Class, Obj};
use crate::capi::nosys::{self, n1, n5i, n6, n7, n8};
use crate::capi::peer::srx::{OwnerSrx, RxBuf, PEER_IOV};
use crate::capi::srx::SRX_CM;
use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpOpt, Flags};
use crate::core::srx::{Filter, Kind, ADDR_UNSPEC};
use crate::verbs::{CompletionQueue, Domain};

/// Receives and waiting messages together, unless `fi_rx_attr.size` says otherwise.
const DEFAULT_SIZE: usize = 1024;
/// The largest software SRX: every entry is allocated at open (a few hundred bytes each).
pub(crate) const MAX_SIZE: usize = 1 << 18;

pub(crate) struct SoftSrx {
    pub(crate) owner: Arc<OwnerSrx>,
    cq: OnceLock<Arc<CompletionQueue>>,
    /// `FI_DIRECTED_RECV`: receives match their source address; otherwise any source.
    directed: bool,
    _domain: Arc<Domain>,
}

impl SoftSrx {
    /// The CQ its completions go to.
    pub(crate) fn cq(&self) -> Result<&Arc<CompletionQueue>> {
        self.cq.get().ok_or_else(|| {
            Error::new(
                errno::EOPBADSTATE,
                "no CQ is bound to the SRX: fi_ep_bind(srx, cq, FI_RECV) first",
            )
        })
    }
}

pub(crate) type CSoftSrx = Obj<fi::fid_ep, SoftSrx>;
impl Class for CSoftSrx {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_SRX_CTX;
    fn fi_ops() -> &'static fi::fi_ops {
        &SOFT_FI_OPS
    }
}

/// Whether `fi_srx_context` with these receive caps needs the software SRX.
pub(crate) fn wanted(caps: u64) -> bool {
    caps & (fi::FI_TAGGED | fi::FI_DIRECTED_RECV) != 0
}

pub(crate) static SOFT_FI_OPS: fi::fi_ops = fi_ops_of!(soft_close, soft_bind, soft_control);
pub(crate) static SOFT_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(soft_cancel),
    getopt: Some(soft_getopt),
    setopt: Some(soft_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static SOFT_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(soft_recv),
    recvv: Some(soft_recvv),
    recvmsg: Some(soft_recvmsg),
    send: Some(n6),
    sendv: Some(n6),
    sendmsg: Some(nosys::n3),
    inject: Some(nosys::n4),
    senddata: Some(n7),
    injectdata: Some(nosys::n5),
};
pub(crate) static SOFT_TAGGED: fi::fi_ops_tagged = fi::fi_ops_tagged {
    size: size_of::<fi::fi_ops_tagged>(),
    recv: Some(soft_trecv),
    recvv: Some(soft_trecvv),
    recvmsg: Some(soft_trecvmsg),
    send: Some(n7),
    sendv: Some(n7),
    sendmsg: Some(nosys::n3),
    inject: Some(nosys::n5),
    senddata: Some(n8),
    injectdata: Some(nosys::n6),
};

/// `fi_srx_context` for caps that need matching in software.
pub(crate) fn open(
    domain: &Arc<Domain>,
    a: &fi::fi_rx_attr,
    context: *mut c_void,
) -> Result<*mut fi::fid_ep> {
    let size = if a.size == 0 { DEFAULT_SIZE } else { a.size };
    if size > MAX_SIZE {
        return Err(Error::new(
            errno::EINVAL,
            format!("rx_attr.size {size} is larger than a software SRX holds ({MAX_SIZE})"),
        ));
    }
    let s = SoftSrx {
        owner: OwnerSrx::new(size),
        cq: OnceLock::new(),
        directed: a.caps & fi::FI_DIRECTED_RECV != 0,
        _domain: domain.clone(),
    };
    let hdr = fi::fid_ep {
        fid: fid(fi::FI_CLASS_SRX_CTX, context, &SOFT_FI_OPS),
        ops: ops(&SOFT_OPS),
        cm: ops(&SRX_CM),
        msg: ops(&SOFT_MSG),
        rma: ops(&nosys::RMA),
        tagged: ops(&SOFT_TAGGED),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    };
    Ok(CSoftSrx::into_raw(hdr, s))
}

unsafe extern "C" fn soft_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_srx_context returned.
    guarded("fi_close(srx)", || unsafe {
        CSoftSrx::close(f.cast(), |s| {
            if Arc::strong_count(&s.owner) > 1 {
                return Err(Error::new(
                    errno::EBUSY,
                    "peers still share this SRX: close their imports first",
                ));
            }
            if let Some(cq) = s.cq.get() {
                cq.unbind();
            }
            Ok(())
        })
    })
}

unsafe extern "C" fn soft_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_ep_bind(srx)", || {
        // SAFETY: the application's SRX and CQ fids.
        let (s, q) = unsafe {
            (
                CSoftSrx::from_c(f.cast(), "srx")?,
                CCq::from_c(b.cast(), "cq")?,
            )
        };
        if flags & fi::FI_RECV == 0 || flags & !fi::FI_RECV != 0 {
            return Err(Error::new(
                errno::EINVAL,
                "a software SRX binds one CQ, with FI_RECV (selective completion is not offered)",
            ));
        }
        q.inner.bind()?;
        s.inner.cq.set(q.inner.clone()).map_err(|q| {
            q.unbind();
            Error::new(errno::EINVAL, "the SRX already has a CQ")
        })
    })
}

unsafe extern "C" fn soft_control(f: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control(srx)", || {
        // SAFETY: the application's SRX fid.
        unsafe { CSoftSrx::from_c(f.cast(), "srx") }?;
        match cmd as u32 {
            // Nothing to start: receives are taken as soon as it exists.
            fi::FI_ENABLE => Ok(()),
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an SRX"),
            )),
        }
    })
}

/// Ranges of a C iov as the engine carries them; peers need no descriptors.
///
/// # Safety
/// `iov` is NULL or has `count` elements.
unsafe fn rx_buf(iov: *const libc::iovec, count: usize) -> Result<RxBuf> {
    if count == 0 || count > PEER_IOV || iov.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("an iov of {count} ranges (1 to {PEER_IOV})"),
        ));
    }
    let mut b = RxBuf::one(std::ptr::null_mut(), 0);
    // SAFETY: the caller's contract.
    b.iov[..count].copy_from_slice(unsafe { std::slice::from_raw_parts(iov, count) });
    b.count = count;
    Ok(b)
}

/// One receive onto the engine; its match (now or later) is completed by the peer holding
/// the message.
#[allow(clippy::too_many_arguments)]
fn post(
    what: &str,
    ep: *mut fi::fid_ep,
    kind: Kind,
    buf: Result<RxBuf>,
    src: u64,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
    flags: u64,
) -> isize {
    guarded_len(what, || {
        // SAFETY: the application's handle (fi_msg(3), fi_tagged(3)).
        let s = &unsafe { CSoftSrx::from_c(ep, "srx") }?.inner;
        let fl = Flags::from_bits_retain(flags);
        let from = Filter {
            addr: if s.directed { src } else { ADDR_UNSPEC },
            tag,
            ignore,
        };
        if kind == Kind::Tag && fl.contains(Flags::PEEK) {
            return peek(s, from, context as u64, fl).map(|()| 0);
        }
        let extra = if kind == Kind::Msg {
            Flags::MULTI_RECV
        } else {
            Flags::empty()
        };
        crate::verbs::ep_common::check_recv_flags(fl, extra)?;
        let buf = buf?;
        if fl.contains(Flags::MULTI_RECV) && buf.count != 1 {
            return Err(Error::new(
                errno::EINVAL,
                "an FI_MULTI_RECV buffer is one range",
            ));
        }
        let refused = s.owner.recv(
            kind,
            from,
            buf,
            context as u64,
            (fl & Flags::MULTI_RECV) | Flags::COMPLETION,
        )?;
        if !refused.is_empty() {
            let cq = s.cq()?;
            for e in refused {
                cq.writeerr(e)?;
            }
        }
        Ok(0)
    })
}

/// `FI_PEEK` (with `FI_DISCARD`: and drop the message): a completion without data when a
/// message waits, an `FI_ENOMSG` error completion when none does (fi_tagged(3)).
fn peek(s: &SoftSrx, from: Filter, context: u64, fl: Flags) -> Result<()> {
    if fl.contains(Flags::CLAIM) {
        return Err(crate::capi::fid::enosys("FI_PEEK with FI_CLAIM"));
    }
    let cq = s.cq()?;
    let seen = if fl.contains(Flags::DISCARD) {
        s.owner.discard(Kind::Tag, from)?
    } else {
        s.owner.peek(Kind::Tag, from)
    };
    let flags = fi::FI_RECV | fi::FI_TAGGED;
    match seen {
        Some(m) => cq.write(
            CqEntry {
                op_context: context,
                flags,
                len: m.size,
                buf: 0,
                data: 0,
                tag: m.tag,
            },
            m.addr,
        ),
        None => cq.writeerr(CqErrEntry {
            op_context: context,
            flags,
            tag: from.tag,
            err: errno::ENOMSG,
            ..CqErrEntry::default()
        }),
    }
}

unsafe extern "C" fn soft_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let b = Ok(RxBuf::one(buf, len));
    post("fi_recv(srx)", ep, Kind::Msg, b, src, 0, 0, context, 0)
}

unsafe extern "C" fn soft_recvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's iov of count ranges (fi_msg(3)).
    let b = unsafe { rx_buf(iov, count) };
    post("fi_recvv(srx)", ep, Kind::Msg, b, src, 0, 0, context, 0)
}

unsafe extern "C" fn soft_recvmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    flags: u64,
) -> isize {
    // SAFETY: NULL or the application's message (fi_msg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(errno::EINVAL as isize);
    };
    // SAFETY: the message's iov of iov_count ranges.
    let b = unsafe { rx_buf(m.msg_iov, m.iov_count) };
    post(
        "fi_recvmsg(srx)",
        ep,
        Kind::Msg,
        b,
        m.addr,
        0,
        0,
        m.context,
        flags,
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn soft_trecv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    let b = Ok(RxBuf::one(buf, len));
    post(
        "fi_trecv(srx)",
        ep,
        Kind::Tag,
        b,
        src,
        tag,
        ignore,
        context,
        0,
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn soft_trecvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: the application's iov of count ranges (fi_tagged(3)).
    let b = unsafe { rx_buf(iov, count) };
    post(
        "fi_trecvv(srx)",
        ep,
        Kind::Tag,
        b,
        src,
        tag,
        ignore,
        context,
        0,
    )
}

unsafe extern "C" fn soft_trecvmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_tagged,
    flags: u64,
) -> isize {
    // SAFETY: NULL or the application's message (fi_tagged(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(errno::EINVAL as isize);
    };
    // A peek carries no buffer.
    let b = if flags & fi::FI_PEEK != 0 {
        Ok(RxBuf::one(std::ptr::null_mut(), 0))
    } else {
        // SAFETY: the message's iov of iov_count ranges.
        unsafe { rx_buf(m.msg_iov, m.iov_count) }
    };
    let (t, i) = (m.tag, m.ignore);
    post(
        "fi_trecvmsg(srx)",
        ep,
        Kind::Tag,
        b,
        m.addr,
        t,
        i,
        m.context,
        flags,
    )
}

unsafe extern "C" fn soft_cancel(f: fi::fid_t, context: *mut c_void) -> isize {
    guarded_len("fi_cancel(srx)", || {
        // SAFETY: the application's SRX fid.
        let s = &unsafe { CSoftSrx::from_c(f.cast(), "srx") }?.inner;
        let cq = s.cq()?;
        let e = s
            .owner
            .cancel(context as u64)
            .ok_or_else(|| Error::new(errno::ENOENT, "no receive with this context is posted"))?;
        let kind = if e.kind.tagged() {
            fi::FI_TAGGED
        } else {
            fi::FI_MSG
        };
        cq.writeerr(CqErrEntry {
            op_context: e.context,
            flags: fi::FI_RECV | kind | (e.flags & Flags::MULTI_RECV).bits(),
            tag: e.tag,
            err: errno::ECANCELED,
            ..CqErrEntry::default()
        })?;
        Ok(0)
    })
}

unsafe extern "C" fn soft_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *mut c_void,
    optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt(srx)", || {
        // SAFETY: the application's SRX fid.
        let s = &unsafe { CSoftSrx::from_c(f.cast(), "srx") }?.inner;
        match endpoint_opt(level, optname)? {
            // SAFETY: the application's option buffer.
            EpOpt::MinMultiRecv => unsafe { put_opt(s.owner.min_multi_recv(), optval, optlen) },
            o => Err(Error::new(
                errno::ENOPROTOOPT,
                format!("a software SRX has no option {o:?}"),
            )),
        }
    })
}

unsafe extern "C" fn soft_setopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *const c_void,
    optlen: usize,
) -> i32 {
    guarded("fi_setopt(srx)", || {
        // SAFETY: the application's SRX fid.
        let s = &unsafe { CSoftSrx::from_c(f.cast(), "srx") }?.inner;
        match endpoint_opt(level, optname)? {
            EpOpt::MinMultiRecv if optlen == size_of::<usize>() && !optval.is_null() => {
                // SAFETY: non-NULL and size_t-sized.
                let v = unsafe { optval.cast::<usize>().read_unaligned() };
                s.owner.set_min_multi_recv(v);
                Ok(())
            }
            EpOpt::MinMultiRecv => Err(Error::new(
                errno::EINVAL,
                "FI_OPT_MIN_MULTI_RECV is a size_t (optlen = sizeof(size_t))",
            )),
            o => Err(Error::new(
                errno::ENOPROTOOPT,
                format!("a software SRX has no option {o:?}"),
            )),
        }
    })
}
