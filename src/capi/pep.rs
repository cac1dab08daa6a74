//! `fid_pep` over [`PassiveEndpoint`]: a listener whose connection requests arrive on
//! its EQ as `FI_CONNREQ`.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;

use crate::capi::ep::{endpoint_opt, put_opt};
use crate::capi::eq::{connreq_of, CConnReq, CEq};
use crate::capi::fid::{bytes, bytes_mut, fi_ops_of, fid, guarded, ops, Class, Obj};
use crate::capi::nosys::{n1, n2, n5i};
use crate::core::addr::parse_sockaddr;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::EpOpt;
use crate::core::info::Info;
use crate::verbs::{ConnRequest, Fabric, PassiveEndpoint};

pub(crate) type CPep = Obj<fi::fid_pep, Mutex<PassiveEndpoint>>;
impl Class for CPep {
    type Header = fi::fid_pep;
    const FCLASS: u32 = fi::FI_CLASS_PEP;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEP_FI_OPS
    }
}
pub(crate) static PEP_FI_OPS: fi::fi_ops = fi_ops_of!(pep_close, pep_bind, pep_control);
pub(crate) static PEP_OPS: fi::fi_ops_ep = fi::fi_ops_ep {
    size: size_of::<fi::fi_ops_ep>(),
    cancel: Some(n2),
    getopt: Some(pep_getopt),
    setopt: Some(pep_setopt),
    tx_ctx: Some(n5i),
    rx_ctx: Some(n5i),
    rx_size_left: Some(n1),
    tx_size_left: Some(n1),
};
pub(crate) static PEP_CM: fi::fi_ops_cm = fi::fi_ops_cm {
    size: size_of::<fi::fi_ops_cm>(),
    setname: Some(pep_setname),
    getname: Some(pep_getname),
    getpeer: Some(not_active_getpeer),
    connect: Some(not_active_connect),
    listen: Some(pep_listen),
    accept: Some(not_active_accept),
    reject: Some(pep_reject),
    shutdown: Some(not_active_shutdown),
    join: Some(not_active_join),
};
/// `fi_passive_ep` on `fabric`.
pub(crate) fn open(
    fabric: &Arc<Fabric>,
    info: &Info,
    context: *mut c_void,
) -> Result<*mut fi::fid_pep> {
    let hdr = fi::fid_pep {
        fid: fid(fi::FI_CLASS_PEP, context, &PEP_FI_OPS),
        ops: ops(&PEP_OPS),
        cm: ops(&PEP_CM),
    };
    CPep::try_into_raw_with(hdr, |at| {
        Ok(Mutex::new(PassiveEndpoint::open(fabric, info, at)?))
    })
}

pub(crate) fn pep_lock(p: &CPep) -> std::sync::MutexGuard<'_, PassiveEndpoint> {
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
unsafe extern "C" fn pep_setname(f: fi::fid_t, addr: *mut c_void, addrlen: usize) -> i32 {
    guarded("fi_setname", || {
        // SAFETY: the application's fid and address of addrlen bytes.
        let (p, sa) = unsafe {
            (
                CPep::from_c(f.cast(), "pep")?,
                parse_sockaddr(bytes(addr, addrlen, "addr")?)?,
            )
        };
        pep_lock(p).setname(&sa)
    })
}

unsafe extern "C" fn pep_getname(f: fi::fid_t, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("fi_getname", || {
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: the application's fid; non-NULL addrlen; a buffer of *addrlen bytes.
        unsafe {
            let p = CPep::from_c(f.cast(), "pep")?;
            let len = &mut *addrlen;
            pep_lock(p).getname_into(bytes_mut(addr, *len, "addr")?, len)
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
