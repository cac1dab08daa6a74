//! `fid_ep` over [`MsgEndpoint`] and [`DgramEndpoint`], `fid_pep` over
//! [`PassiveEndpoint`], the shared receive context (`fid_ep` of class `FI_CLASS_SRX_CTX`)
//! and multicast joins (`fid_mc`). The data calls translate a buffer and its descriptor
//! into a region and an offset and call the Rust endpoint; nothing is allocated.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MAX_IOV;

use crate::capi::cq::CCq;
use crate::capi::domain::{from_c_nonnull, mr_of, unshared, CAv, CDomain, CFabric};
use crate::capi::eq::{connreq_of, CConnReq, CEq};
use crate::capi::fid::{
    bytes, bytes_mut, enosys, fi_ops_of, fid, guarded, guarded_len, has_ops, no_bind, ops, put,
    Class, Obj,
};
use crate::capi::nosys::{self, n1, n1i, n2, n2i, n3i, n4i, n5i, n6, n7};
use crate::core::addr::parse_sockaddr;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpOpt, EpType, Flags};
use crate::verbs::{
    ConnRequest, DgramEndpoint, Iov, MemoryRegion, MsgEndpoint, Multicast, PassiveEndpoint,
    SharedRxContext,
};

/// The Rust endpoint behind an `fid_ep`.
pub(crate) enum Ep {
    Msg(MsgEndpoint),
    Dgram(Arc<DgramEndpoint>),
}

pub(crate) struct EpState {
    ep: Ep,
    /// The connection request this endpoint accepts, closed with the endpoint.
    connreq: *mut fi::fid,
}

pub(crate) type CEp = Obj<fi::fid_ep, EpState>;
impl Class for CEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &EP_FI_OPS
    }
}

pub(crate) type CPep = Obj<fi::fid_pep, Mutex<PassiveEndpoint>>;
impl Class for CPep {
    type Header = fi::fid_pep;
    const FCLASS: u32 = fi::FI_CLASS_PEP;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEP_FI_OPS
    }
}

pub(crate) type CSrx = Obj<fi::fid_ep, Arc<SharedRxContext>>;
impl Class for CSrx {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_SRX_CTX;
    fn fi_ops() -> &'static fi::fi_ops {
        &SRX_FI_OPS
    }
}

pub(crate) type CMc = Obj<fi::fid_mc, Multicast>;
impl Class for CMc {
    type Header = fi::fid_mc;
    const FCLASS: u32 = fi::FI_CLASS_MC;
    fn fi_ops() -> &'static fi::fi_ops {
        &MC_FI_OPS
    }
}

impl CEp {
    #[inline]
    pub(crate) fn ep(&self) -> &Ep {
        &self.inner.ep
    }
}

// ---- ops tables ------------------------------------------------------------------------

static EP_FI_OPS: fi::fi_ops = fi_ops_of!(ep_close, ep_bind, ep_control);
static EP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(ep_getopt),
    setopt: Some(ep_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
static EP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(cm_setname),
    getname: Some(cm_getname),
    getpeer: Some(ep_getpeer),
    connect: Some(ep_connect),
    listen: Some(not_passive_listen),
    accept: Some(ep_accept),
    reject: Some(not_passive_reject),
    shutdown: Some(ep_shutdown),
    join: Some(ep_join),
};
static EP_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(ep_recv),
    recvv: Some(ep_recvv),
    recvmsg: Some(ep_recvmsg),
    send: Some(ep_send),
    sendv: Some(ep_sendv),
    sendmsg: Some(ep_sendmsg),
    inject: Some(ep_inject),
    senddata: Some(ep_senddata),
    injectdata: Some(ep_injectdata),
};

static PEP_FI_OPS: fi::fi_ops = fi_ops_of!(pep_close, pep_bind, pep_control);
static PEP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(pep_getopt),
    setopt: Some(pep_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
static PEP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(cm_setname),
    getname: Some(cm_getname),
    getpeer: Some(not_active_getpeer),
    connect: Some(not_active_connect),
    listen: Some(pep_listen),
    accept: Some(not_active_accept),
    reject: Some(pep_reject),
    shutdown: Some(not_active_shutdown),
    join: Some(not_active_join),
};

static SRX_FI_OPS: fi::fi_ops = fi_ops_of!(srx_close, no_bind, crate::capi::fid::no_control);
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
static SRX_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
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

static MC_FI_OPS: fi::fi_ops = fi_ops_of!(mc_close, no_bind, crate::capi::fid::no_control);

fn ep_header(class: u32, context: *mut c_void, fi_ops: &'static fi::fi_ops) -> fi::fid_ep {
    fi::fid_ep {
        fid: fid(class, context, fi_ops),
        ops: ops(&EP_OPS),
        cm: ops(&EP_CM),
        msg: ops(&EP_MSG),
        rma: ops(&nosys::RMA),
        tagged: ops(&nosys::TAGGED),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    }
}

// ---- opening and closing ---------------------------------------------------------------

pub(crate) unsafe extern "C" fn endpoint_open(
    domain: *mut fi::fid_domain,
    info: *mut fi::fi_info,
    ep: *mut *mut fi::fid_ep,
    context: *mut c_void,
) -> i32 {
    guarded("fi_endpoint", || {
        if ep.is_null() {
            return Err(Error::new(errno::EINVAL, "ep is NULL"));
        }
        // SAFETY: the application's domain fid and an info from fi_getinfo or an event.
        let (d, mut i, handle) = unsafe {
            (
                CDomain::from_c(domain, "domain")?,
                from_c_nonnull(info, "info")?,
                (*info).handle,
            )
        };
        if !handle.is_null() {
            // SAFETY: fi_info.handle of an FI_CONNREQ event (the class is checked).
            i.handle = Some(unsafe { connreq_of(handle) }?);
        }
        let p = CEp::try_into_raw_with(ep_header(fi::FI_CLASS_EP, context, &EP_FI_OPS), |at| {
            let e = match i.ep_attr.ep_type {
                EpType::Dgram => Ep::Dgram(DgramEndpoint::open(&d.inner, &i)?),
                _ => Ep::Msg(MsgEndpoint::open(&d.inner, &i, at)?),
            };
            Ok(EpState {
                ep: e,
                connreq: handle,
            })
        })?;
        // SAFETY: checked for NULL above, writable per fi_endpoint(3).
        unsafe { *ep = p };
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn endpoint_open2(
    domain: *mut fi::fid_domain,
    info: *mut fi::fi_info,
    ep: *mut *mut fi::fid_ep,
    flags: u64,
    context: *mut c_void,
) -> i32 {
    if flags != 0 {
        return guarded("fi_endpoint2", || {
            Err(enosys(
                "fi_endpoint2 with flags (FI_PEER_TRANSFER endpoints)",
            ))
        });
    }
    // SAFETY: forwarded as received.
    unsafe { endpoint_open(domain, info, ep, context) }
}

unsafe extern "C" fn ep_close(f: *mut fi::fid) -> i32 {
    guarded("fi_close(ep)", || {
        // SAFETY: the fid fi_endpoint returned; the class is checked first.
        unsafe {
            let e = CEp::from_c(f.cast(), "ep")?;
            let req = e.inner.connreq;
            CEp::close(f.cast(), |_| Ok(()))?;
            if !req.is_null() {
                let _ = CConnReq::close(req, |_| Ok(()));
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn ep_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_ep_bind", || {
        // SAFETY: the application's endpoint fid and the fid to bind (classes checked).
        let e = unsafe { CEp::from_c(f.cast(), "ep") }?;
        if b.is_null() {
            return Err(Error::new(errno::EINVAL, "the fid to bind is NULL"));
        }
        // SAFETY: non-NULL fid from the application.
        let class = unsafe { (*b).fclass } as u32;
        let fl = Flags::from_bits_retain(flags);
        // SAFETY: b is a live fid from the application; from_c checks its class.
        let eq = || unsafe { CEq::from_c(b.cast(), "eq") }.map(|q| &q.inner.eq);
        // SAFETY: as above.
        let cq = || unsafe { CCq::from_c(b.cast(), "cq") }.map(|q| &q.inner);
        // SAFETY: as above.
        let av = || unsafe { CAv::from_c(b.cast(), "av") }.map(|a| &a.inner);
        // SAFETY: as above.
        let srx = || unsafe { CSrx::from_c(b.cast(), "srx") }.map(|s| &s.inner);
        match (class, e.ep()) {
            (fi::FI_CLASS_EQ, Ep::Msg(m)) => m.bind_eq(eq()?),
            (fi::FI_CLASS_EQ, Ep::Dgram(g)) => g.bind_eq(eq()?),
            (fi::FI_CLASS_CQ, Ep::Msg(m)) => m.bind_cq(cq()?, fl),
            (fi::FI_CLASS_CQ, Ep::Dgram(g)) => g.bind_cq(cq()?, fl),
            (fi::FI_CLASS_AV, Ep::Dgram(g)) => g.bind_av(av()?),
            (fi::FI_CLASS_AV, Ep::Msg(_)) => Err(Error::new(
                errno::EINVAL,
                "MSG endpoints are connected: they take no address vector",
            )),
            (fi::FI_CLASS_SRX_CTX, Ep::Msg(m)) => m.bind_srx(srx()?),
            (fi::FI_CLASS_CNTR, _) => Err(enosys("counters")),
            (c, _) => Err(Error::new(
                errno::EINVAL,
                format!("an endpoint cannot be bound to a fid of class {c}"),
            )),
        }
    })
}

unsafe extern "C" fn ep_control(f: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control(ep)", || {
        // SAFETY: the application's endpoint fid.
        let e = unsafe { CEp::from_c(f.cast(), "ep") }?;
        match (cmd as u32, e.ep()) {
            (fi::FI_ENABLE, Ep::Msg(m)) => m.enable(),
            (fi::FI_ENABLE, Ep::Dgram(g)) => g.enable(),
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an endpoint"),
            )),
        }
    })
}

pub(crate) unsafe extern "C" fn pep_open(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    pep: *mut *mut fi::fid_pep,
    context: *mut c_void,
) -> i32 {
    guarded("fi_passive_ep", || {
        if pep.is_null() {
            return Err(Error::new(errno::EINVAL, "pep is NULL"));
        }
        // SAFETY: the application's fabric fid and info.
        let (f, i) = unsafe {
            (
                CFabric::from_c(fabric, "fabric")?,
                from_c_nonnull(info, "info")?,
            )
        };
        let hdr = fi::fid_pep {
            fid: fid(fi::FI_CLASS_PEP, context, &PEP_FI_OPS),
            ops: ops(&PEP_OPS),
            cm: ops(&PEP_CM),
        };
        let p = CPep::try_into_raw_with(hdr, |at| {
            Ok(Mutex::new(PassiveEndpoint::open(&f.inner, &i, at)?))
        })?;
        // SAFETY: checked for NULL above, writable per fi_passive_ep(3).
        unsafe { *pep = p };
        Ok(())
    })
}

fn pep_lock(p: &CPep) -> std::sync::MutexGuard<'_, PassiveEndpoint> {
    p.inner.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe extern "C" fn pep_close(f: *mut fi::fid) -> i32 {
    guarded("fi_close(pep)", || {
        // SAFETY: the fid fi_passive_ep returned (class checked by close).
        unsafe {
            CPep::from_c(f.cast(), "pep")?;
            CPep::close(f.cast(), |_| Ok(()))
        }
    })
}

unsafe extern "C" fn pep_bind(f: *mut fi::fid, b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_pep_bind", || {
        // SAFETY: the application's fids; classes checked.
        let (p, q) = unsafe { (CPep::from_c(f.cast(), "pep")?, CEq::from_c(b.cast(), "eq")?) };
        pep_lock(p).bind_eq(&q.inner.eq)
    })
}

unsafe extern "C" fn pep_control(f: *mut fi::fid, cmd: i32, arg: *mut c_void) -> i32 {
    guarded("fi_control(pep)", || {
        // SAFETY: the application's pep fid.
        let p = unsafe { CPep::from_c(f.cast(), "pep") }?;
        match cmd as u32 {
            fi::FI_BACKLOG => {
                if arg.is_null() {
                    return Err(Error::new(errno::EINVAL, "FI_BACKLOG needs an int"));
                }
                // SAFETY: FI_BACKLOG passes an int (fi_control(3)).
                pep_lock(p).set_backlog(unsafe { *arg.cast::<i32>() })
            }
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on a passive endpoint"),
            )),
        }
    })
}

pub(crate) unsafe extern "C" fn srx_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_rx_attr,
    rx_ep: *mut *mut fi::fid_ep,
    context: *mut c_void,
) -> i32 {
    guarded("fi_srx_context", || {
        // SAFETY: the application's domain fid and NULL or a valid attr.
        let (d, a) = unsafe {
            (
                CDomain::from_c(domain, "domain")?,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        // fi_peer(3) (1.17) marks a peer SRX open in op_flags.
        crate::capi::fid::no_peer_open(a.op_flags, "fi_srx_context")?;
        if crate::capi::srx::wanted(a.caps) {
            let p = crate::capi::srx::open(&d.inner, a, context)?;
            // SAFETY: checked for NULL, writable per fi_srx_context(3).
            return unsafe { put(rx_ep, p, "rx_ep") }.inspect_err(|_| {
                // SAFETY: just made, never handed out.
                let _ = unsafe { crate::capi::srx::CSoftSrx::close(p, |_| Ok(())) };
            });
        }
        let s = SharedRxContext::open(&d.inner, &crate::capi::info::rx_attr(a))?;
        let mut hdr = ep_header(fi::FI_CLASS_SRX_CTX, context, &SRX_FI_OPS);
        hdr.ops = ops(&SRX_OPS);
        hdr.cm = ops(&SRX_CM);
        hdr.msg = ops(&SRX_MSG);
        let p = CSrx::into_raw(hdr, s);
        // SAFETY: checked for NULL, writable per fi_srx_context(3).
        unsafe { put(rx_ep, p, "rx_ep") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CSrx::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn srx_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_srx_context returned.
    guarded("fi_close(srx)", || unsafe {
        CSrx::close(f.cast(), |s| unshared(s, "shared receive context"))
    })
}

// ---- options ---------------------------------------------------------------------------

/// The option a `fi_getopt`/`fi_setopt` names, with its `size_t` value's length checked.
pub(crate) fn endpoint_opt(level: i32, optname: i32) -> Result<EpOpt> {
    if level as u32 != fi::FI_OPT_ENDPOINT {
        return Err(Error::new(
            errno::ENOPROTOOPT,
            format!("option level {level}: rverbs has FI_OPT_ENDPOINT options only"),
        ));
    }
    EpOpt::from_raw(optname as u32).ok_or_else(|| {
        Error::new(
            errno::ENOPROTOOPT,
            format!("option {optname} is not an endpoint option"),
        )
    })
}

/// Writes a `size_t` option value.
///
/// # Safety
/// `optlen` is NULL or valid; `optval` has `*optlen` writable bytes.
pub(crate) unsafe fn put_opt(v: usize, optval: *mut c_void, optlen: *mut usize) -> Result<()> {
    if optlen.is_null() {
        return Err(Error::new(errno::EINVAL, "optlen is NULL"));
    }
    // SAFETY: the caller's contract.
    unsafe {
        if *optlen < size_of::<usize>() {
            *optlen = size_of::<usize>();
            return Err(Error::new(errno::ETOOSMALL, "the option is a size_t"));
        }
        put(optval.cast::<usize>(), v, "optval")?;
        *optlen = size_of::<usize>();
    }
    Ok(())
}

unsafe extern "C" fn ep_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *mut c_void,
    optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt", || {
        // SAFETY: the application's endpoint fid.
        let e = unsafe { CEp::from_c(f.cast(), "ep") }?;
        let opt = endpoint_opt(level, optname)?;
        let v = match e.ep() {
            Ep::Msg(m) => m.getopt(opt)?,
            Ep::Dgram(_) => {
                return Err(Error::new(
                    errno::ENOPROTOOPT,
                    format!("datagram endpoints have no option {opt:?}"),
                ))
            }
        };
        // SAFETY: the application's option buffer.
        unsafe { put_opt(v, optval, optlen) }
    })
}

unsafe extern "C" fn ep_setopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *const c_void,
    optlen: usize,
) -> i32 {
    guarded("fi_setopt", || {
        // SAFETY: the application's endpoint fid.
        let e = unsafe { CEp::from_c(f.cast(), "ep") }?;
        let opt = endpoint_opt(level, optname)?;
        if optlen != size_of::<usize>() || optval.is_null() {
            return Err(Error::new(
                errno::EINVAL,
                "endpoint options are size_t values (optlen = sizeof(size_t))",
            ));
        }
        // SAFETY: non-NULL and size_t-sized.
        let v = unsafe { optval.cast::<usize>().read_unaligned() };
        match e.ep() {
            Ep::Msg(m) => m.setopt(opt, v),
            Ep::Dgram(_) => Err(Error::new(
                errno::ENOPROTOOPT,
                format!("datagram endpoints have no option {opt:?}"),
            )),
        }
    })
}

unsafe extern "C" fn pep_getopt(
    f: fi::fid_t,
    level: i32,
    optname: i32,
    optval: *mut c_void,
    optlen: *mut usize,
) -> i32 {
    guarded("fi_getopt(pep)", || {
        // SAFETY: the application's pep fid.
        let p = unsafe { CPep::from_c(f.cast(), "pep") }?;
        match endpoint_opt(level, optname)? {
            // SAFETY: the application's option buffer.
            EpOpt::CmDataSize => unsafe { put_opt(pep_lock(p).cm_data_size(), optval, optlen) },
            o => Err(Error::new(
                errno::ENOPROTOOPT,
                format!("passive endpoints have no option {o:?}"),
            )),
        }
    })
}

unsafe extern "C" fn pep_setopt(
    _f: fi::fid_t,
    level: i32,
    optname: i32,
    _optval: *const c_void,
    _optlen: usize,
) -> i32 {
    guarded("fi_setopt(pep)", || {
        let o = endpoint_opt(level, optname)?;
        Err(Error::new(
            errno::ENOPROTOOPT,
            format!("option {o:?} cannot be set on a passive endpoint"),
        ))
    })
}

// ---- connection management -------------------------------------------------------------

/// `fi_setname` / `fi_getname` take any fid: endpoint or passive endpoint.
unsafe extern "C" fn cm_setname(f: fi::fid_t, addr: *mut c_void, addrlen: usize) -> i32 {
    guarded("fi_setname", || {
        // SAFETY: the application's address of addrlen bytes.
        let sa = parse_sockaddr(unsafe { bytes(addr, addrlen, "addr") }?)?;
        // SAFETY: the application's fid; each branch checks the class.
        unsafe {
            if has_ops(f, &PEP_FI_OPS) {
                return pep_lock(CPep::from_c(f.cast(), "pep")?).setname(&sa);
            }
            let e = CEp::from_c(f.cast(), "fid")?;
            match e.ep() {
                Ep::Msg(m) => m.setname(&sa),
                Ep::Dgram(_) => Err(enosys(
                    "fi_setname on a datagram endpoint (its name is the queue pair the device assigns)",
                )),
            }
        }
    })
}

unsafe extern "C" fn cm_getname(f: fi::fid_t, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("fi_getname", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: non-NULL; the buffer has *addrlen bytes (fi_cm(3)); the fid's class is
        // checked in each branch.
        unsafe {
            let len = &mut *addrlen;
            let buf = bytes_mut(addr, *len, "addr")?;
            if has_ops(f, &PEP_FI_OPS) {
                return pep_lock(CPep::from_c(f.cast(), "pep")?).getname_into(buf, len);
            }
            match CEp::from_c(f.cast(), "fid")?.ep() {
                Ep::Msg(m) => m.getname_into(buf, len),
                Ep::Dgram(g) => g.getname_into(buf, len),
            }
        }
    })
}

unsafe extern "C" fn ep_getpeer(
    ep: *mut fi::fid_ep,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> i32 {
    guarded("fi_getpeer", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid and buffer of *addrlen bytes.
        unsafe {
            let len = &mut *addrlen;
            let buf = bytes_mut(addr, *len, "addr")?;
            match CEp::from_c(ep, "ep")?.ep() {
                Ep::Msg(m) => m.getpeer_into(buf, len),
                Ep::Dgram(_) => Err(Error::new(
                    errno::EINVAL,
                    "datagram endpoints have no peer: look addresses up in the AV",
                )),
            }
        }
    })
}

fn msg_only<'a>(e: &'a CEp, what: &str) -> Result<&'a MsgEndpoint> {
    match e.ep() {
        Ep::Msg(m) => Ok(m),
        Ep::Dgram(_) => Err(Error::new(
            errno::EINVAL,
            format!("{what} is for connected (FI_EP_MSG) endpoints"),
        )),
    }
}

unsafe extern "C" fn ep_connect(
    ep: *mut fi::fid_ep,
    addr: *const c_void,
    param: *const c_void,
    paramlen: usize,
) -> i32 {
    guarded("fi_connect", || {
        // SAFETY: the application's fid and buffers.
        let (e, data) = unsafe { (CEp::from_c(ep, "ep")?, bytes(param, paramlen, "param")?) };
        let m = msg_only(e, "fi_connect")?;
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

/// The bytes of a `sockaddr_in` / `sockaddr_in6` at `p`.
///
/// # Safety
/// `p` points at a sockaddr of the family it names.
unsafe fn sockaddr_bytes<'a>(p: *const c_void) -> Result<&'a [u8]> {
    // SAFETY: every sockaddr starts with its family.
    let family = unsafe { (*p.cast::<libc::sockaddr>()).sa_family } as i32;
    let len = match family {
        libc::AF_INET => size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => size_of::<libc::sockaddr_in6>(),
        f => {
            return Err(Error::new(
                errno::EINVAL,
                format!("address family {f}: rverbs connects to IPv4 or IPv6 addresses"),
            ))
        }
    };
    // SAFETY: the caller's contract for that family.
    unsafe { bytes(p, len, "addr") }
}

unsafe extern "C" fn ep_accept(ep: *mut fi::fid_ep, param: *const c_void, paramlen: usize) -> i32 {
    guarded("fi_accept", || {
        // SAFETY: the application's fid and buffer.
        let (e, data) = unsafe { (CEp::from_c(ep, "ep")?, bytes(param, paramlen, "param")?) };
        msg_only(e, "fi_accept")?.accept(data)
    })
}

unsafe extern "C" fn ep_shutdown(ep: *mut fi::fid_ep, flags: u64) -> i32 {
    guarded("fi_shutdown", || {
        // SAFETY: the application's fid.
        let e = unsafe { CEp::from_c(ep, "ep") }?;
        if flags != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_shutdown flags {flags:#x}: none are defined"),
            ));
        }
        msg_only(e, "fi_shutdown")?.shutdown()
    })
}

unsafe extern "C" fn ep_join(
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
        let (e, group) = unsafe {
            (
                CEp::from_c(ep, "ep")?,
                parse_sockaddr(sockaddr_bytes(addr)?)?,
            )
        };
        let Ep::Dgram(g) = e.ep() else {
            return Err(Error::new(
                errno::EINVAL,
                "fi_join is for datagram (FI_EP_DGRAM) endpoints",
            ));
        };
        let hdr = fi::fid_mc {
            fid: fid(fi::FI_CLASS_MC, context, &MC_FI_OPS),
            fi_addr: fi::FI_ADDR_NOTAVAIL,
        };
        let p =
            CMc::try_into_raw_with(hdr, |at| g.join(&group, Flags::from_bits_retain(flags), at))?;
        // SAFETY: checked for NULL above, writable per fi_join(3).
        unsafe { *mc = p };
        Ok(())
    })
}

/// The name of a datagram endpoint, for a peer asking where it is in the AV (`ep_addr`);
/// `None` for anything else.
///
/// # Safety
/// `ep` is NULL or a live `fid_ep`.
pub(crate) unsafe fn dgram_name(ep: *mut fi::fid_ep) -> Option<crate::verbs::UdName> {
    // SAFETY: the caller's contract; the class is checked.
    match unsafe { CEp::from_c(ep, "ep") }.ok()?.ep() {
        Ep::Dgram(g) => g.getname().ok(),
        Ep::Msg(_) => None,
    }
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

unsafe extern "C" fn pep_listen(pep: *mut fi::fid_pep) -> i32 {
    guarded("fi_listen", || {
        // SAFETY: the application's fid.
        pep_lock(unsafe { CPep::from_c(pep, "pep") }?).listen()
    })
}

unsafe extern "C" fn pep_reject(
    pep: *mut fi::fid_pep,
    handle: fi::fid_t,
    param: *const c_void,
    paramlen: usize,
) -> i32 {
    guarded("fi_reject", || {
        // SAFETY: the application's fids and buffer.
        let (p, h, data) = unsafe {
            (
                CPep::from_c(pep, "pep")?,
                connreq_of(handle)?,
                bytes(param, paramlen, "param")?,
            )
        };
        let req = h.downcast_ref::<ConnRequest>().ok_or_else(|| {
            Error::new(errno::EINVAL, "handle is not an rverbs connection request")
        })?;
        pep_lock(p).reject(req, data)?;
        // The request is answered: its handle goes.
        // SAFETY: the handle's class was checked by connreq_of; C gives it up here.
        unsafe { CConnReq::close(handle, |_| Ok(())) }
    })
}

unsafe extern "C" fn not_passive_listen(_p: *mut fi::fid_pep) -> i32 {
    guarded("fi_listen", || {
        Err(Error::new(
            errno::EINVAL,
            "fi_listen is for passive endpoints",
        ))
    })
}

unsafe extern "C" fn not_passive_reject(
    _p: *mut fi::fid_pep,
    _h: fi::fid_t,
    _d: *const c_void,
    _l: usize,
) -> i32 {
    guarded("fi_reject", || {
        Err(Error::new(
            errno::EINVAL,
            "fi_reject is for passive endpoints",
        ))
    })
}

fn not_active(what: &str) -> Error {
    Error::new(
        errno::EINVAL,
        format!("{what} is for active endpoints, not passive ones"),
    )
}

unsafe extern "C" fn not_active_getpeer(
    _e: *mut fi::fid_ep,
    _a: *mut c_void,
    _l: *mut usize,
) -> i32 {
    guarded("fi_getpeer", || Err(not_active("fi_getpeer")))
}
unsafe extern "C" fn not_active_connect(
    _e: *mut fi::fid_ep,
    _a: *const c_void,
    _p: *const c_void,
    _l: usize,
) -> i32 {
    guarded("fi_connect", || Err(not_active("fi_connect")))
}
unsafe extern "C" fn not_active_accept(_e: *mut fi::fid_ep, _p: *const c_void, _l: usize) -> i32 {
    guarded("fi_accept", || Err(not_active("fi_accept")))
}
unsafe extern "C" fn not_active_shutdown(_e: *mut fi::fid_ep, _f: u64) -> i32 {
    guarded("fi_shutdown", || Err(not_active("fi_shutdown")))
}
unsafe extern "C" fn not_active_join(
    _e: *mut fi::fid_ep,
    _a: *const c_void,
    _f: u64,
    _m: *mut *mut fi::fid_mc,
    _c: *mut c_void,
) -> i32 {
    guarded("fi_join", || Err(not_active("fi_join")))
}

// ---- data transfer ---------------------------------------------------------------------

/// The region a descriptor names and the offset of `buf` in it (bounds are checked by the
/// endpoint when it builds the work request).
///
/// # Safety
/// `desc` is NULL or a descriptor from `fi_mr_desc`.
#[inline]
unsafe fn region<'a>(buf: *const c_void, desc: *mut c_void) -> Result<(&'a MemoryRegion, usize)> {
    // SAFETY: the caller's contract.
    let mr = unsafe { mr_of(desc) }?;
    let off = (buf as u64).checked_sub(mr.addr()).ok_or_else(|| {
        Error::new(
            errno::EINVAL,
            "buf lies before the region its descriptor names",
        )
    })?;
    Ok((mr, off as usize))
}

/// The ranges of an iov with their descriptors, on the stack.
///
/// # Safety
/// `iov` and `desc` are NULL or hold `count` elements; descriptors from `fi_mr_desc`.
#[inline]
unsafe fn with_iov<R>(
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    f: impl FnOnce(&[Iov<'_>]) -> Result<R>,
) -> Result<R> {
    if count == 0 || count > MAX_IOV || iov.is_null() || desc.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("an iov of {count} ranges (1 to {MAX_IOV}, each with its descriptor)"),
        ));
    }
    // SAFETY: the caller's contract: count elements each.
    unsafe {
        let at = |i: usize| -> Result<Iov<'_>> {
            let v = *iov.add(i);
            let (mr, off) = region(v.iov_base, *desc.add(i))?;
            Ok((mr, off, v.iov_len))
        };
        let first = at(0)?;
        let mut v = [first; MAX_IOV];
        for (i, slot) in v.iter_mut().enumerate().take(count).skip(1) {
            *slot = at(i)?;
        }
        f(&v[..count])
    }
}

/// One data call on an endpoint `O` with a buffer and its descriptor: `f` gets the object,
/// the region and the offset; the C result is 0 or `-errno`.
///
/// # Safety
/// `ep` is the application's endpoint handle; `desc` is NULL or from `fi_mr_desc`.
#[inline]
pub(crate) unsafe fn on_buf<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    desc: *mut c_void,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &MemoryRegion, usize) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        let (o, (mr, off)) =
            unsafe { (Obj::<fi::fid_ep, T>::from_c(ep, "ep")?, region(buf, desc)?) };
        f(o, mr, off).map(|()| 0)
    })
}

/// As [`on_buf`], for an iov with its descriptors.
///
/// # Safety
/// `ep` is the application's endpoint handle; `iov` and `desc` hold `count` elements.
#[inline]
pub(crate) unsafe fn on_iov<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>]) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        let o = unsafe { Obj::<fi::fid_ep, T>::from_c(ep, "ep") }?;
        // SAFETY: the caller's contract.
        unsafe { with_iov(iov, desc, count, |v| f(o, v)) }.map(|()| 0)
    })
}

/// As [`on_iov`], for an `fi_msg` (its context, data and address go to `f`).
///
/// # Safety
/// `ep` is the application's endpoint handle; `msg` is NULL or a valid `fi_msg`.
#[inline]
pub(crate) unsafe fn on_msg<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>], &fi::fi_msg) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        let (o, m) = unsafe {
            (
                Obj::<fi::fid_ep, T>::from_c(ep, "ep")?,
                msg.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?,
            )
        };
        // SAFETY: msg_iov and desc hold iov_count elements, per fi_msg(3).
        unsafe { with_iov(m.msg_iov, m.desc, m.iov_count, |v| f(o, v, m)) }.map(|()| 0)
    })
}

unsafe extern "C" fn ep_send(
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
        on_buf("fi_send", ep, buf, desc, |e: &CEp, mr, off| match e.ep() {
            Ep::Msg(m) => m.send(mr, off, len, ctx),
            Ep::Dgram(g) => g.send(mr, off, len, dest, ctx),
        })
    }
}

unsafe extern "C" fn ep_senddata(
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
        on_buf("fi_senddata", ep, buf, desc, |e: &CEp, mr, off| {
            match e.ep() {
                Ep::Msg(m) => m.senddata(mr, off, len, data, ctx),
                Ep::Dgram(g) => g.senddata(mr, off, len, data, dest, ctx),
            }
        })
    }
}

unsafe extern "C" fn ep_sendv(
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
        on_iov("fi_sendv", ep, iov, desc, count, |e: &CEp, v| {
            match e.ep() {
                Ep::Msg(m) => m.sendv(v, ctx),
                Ep::Dgram(g) => g.sendv(v, dest, ctx),
            }
        })
    }
}

unsafe extern "C" fn ep_sendmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg("fi_sendmsg", ep, msg, |e: &CEp, v, m| {
            let ctx = m.context as u64;
            match (e.ep(), v) {
                (Ep::Msg(x), &[(mr, off, len)]) => x.sendmsg(mr, off, len, ctx, m.data, fl),
                (Ep::Msg(x), v) => x.sendmsgv(v, ctx, m.data, fl),
                (Ep::Dgram(g), &[(mr, off, len)]) => {
                    g.sendmsg(mr, off, len, m.addr, ctx, m.data, fl)
                }
                (Ep::Dgram(g), v) => g.sendmsgv(v, m.addr, ctx, m.data, fl),
            }
        })
    }
}

/// `fi_inject` / `fi_injectdata`: `len` bytes at `buf`, copied before the call returns.
///
/// # Safety
/// `ep` is the application's endpoint handle; `buf` has `len` readable bytes.
unsafe fn inject(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    f: impl FnOnce(&Ep, &[u8]) -> Result<()>,
) -> isize {
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        let (e, data) = unsafe { (CEp::from_c(ep, "ep")?, bytes(buf, len, "buf")?) };
        f(e.ep(), data).map(|()| 0)
    })
}

unsafe extern "C" fn ep_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        inject("fi_inject", ep, buf, len, |e, data| match e {
            Ep::Msg(m) => m.inject(data),
            Ep::Dgram(g) => g.inject(data, dest),
        })
    }
}

unsafe extern "C" fn ep_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    cq_data: u64,
    dest: fi::fi_addr_t,
) -> isize {
    // SAFETY: the application's handle and buffer (fi_msg(3)).
    unsafe {
        inject("fi_injectdata", ep, buf, len, |e, data| match e {
            Ep::Msg(m) => m.injectdata(data, cq_data),
            Ep::Dgram(g) => g.injectdata(data, cq_data, dest),
        })
    }
}

unsafe extern "C" fn ep_recv(
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
        on_buf("fi_recv", ep, buf, desc, |e: &CEp, mr, off| match e.ep() {
            Ep::Msg(m) => m.recv(mr, off, len, ctx),
            Ep::Dgram(g) => g.recv(mr, off, len, ctx),
        })
    }
}

unsafe extern "C" fn ep_recvv(
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
        on_iov("fi_recvv", ep, iov, desc, count, |e: &CEp, v| {
            match e.ep() {
                Ep::Msg(m) => m.recvv(v, ctx),
                Ep::Dgram(g) => g.recvv(v, ctx),
            }
        })
    }
}

unsafe extern "C" fn ep_recvmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags);
    // SAFETY: the application's handle and message (fi_msg(3)).
    unsafe {
        on_msg("fi_recvmsg", ep, msg, |e: &CEp, v, m| {
            let ctx = m.context as u64;
            match (e.ep(), v) {
                (Ep::Msg(x), &[(mr, off, len)]) => x.recvmsg(mr, off, len, ctx, fl),
                (Ep::Msg(x), v) => x.recvmsgv(v, ctx, fl),
                (Ep::Dgram(g), &[(mr, off, len)]) => g.recvmsg(mr, off, len, ctx, fl),
                (Ep::Dgram(g), v) => g.recvmsgv(v, ctx, fl),
            }
        })
    }
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
        on_buf("fi_recv(srx)", ep, buf, desc, |s: &CSrx, mr, off| {
            s.inner.recv(mr, off, len, context as u64)
        })
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
        on_msg("fi_recvmsg(srx)", ep, msg, |s: &CSrx, v, m| match v {
            &[(mr, off, len)] => s.inner.recvmsg(mr, off, len, m.context as u64, fl),
            v => {
                crate::verbs::ep_common::check_recv_flags(fl, Flags::empty())?;
                s.inner.recvv(v, m.context as u64)
            }
        })
    }
}
