//! `fid_fabric` over [`Fabric`]: opened by the core's `fi_fabric`; it opens domains,
//! passive endpoints and EQs.

use std::ffi::c_void;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{
    enosys, fi_ops_of, fid, from_c_nonnull, guarded, no_control, ops, put, unshared, Class, Obj,
};
use crate::capi::info::fabric_attr;
use crate::capi::{cntr, cq, domain, eq, pep, wait};
use crate::core::error::{errno, Error};
use crate::verbs::Fabric;

pub(crate) type CFabric = Obj<fi::fid_fabric, Arc<Fabric>>;
impl Class for CFabric {
    type Header = fi::fid_fabric;
    const FCLASS: u32 = fi::FI_CLASS_FABRIC;
    fn fi_ops() -> &'static fi::fi_ops {
        &FABRIC_FI_OPS
    }
}
pub(crate) static FABRIC_FI_OPS: fi::fi_ops = fi_ops_of!(fabric_close, fabric_bind, no_control);
pub(crate) static FABRIC_OPS: fi::fi_ops_fabric = fi::fi_ops_fabric {
    size: std::mem::size_of::<fi::fi_ops_fabric>(),
    domain: Some(domain_open),
    passive_ep: Some(pep_open),
    eq_open: Some(eq_open),
    wait_open: Some(wait_open),
    trywait: Some(trywait),
    domain2: Some(domain_open2),
};
/// `fi_fabric` (the provider's `fabric` entry).
pub(crate) unsafe extern "C" fn fabric_open(
    attr: *mut fi::fi_fabric_attr,
    fabric: *mut *mut fi::fid_fabric,
    context: *mut c_void,
) -> i32 {
    guarded("fi_fabric", || {
        // SAFETY: libfabric passes a valid attribute struct (checked for NULL).
        let attr = unsafe { attr.as_ref() }
            .ok_or_else(|| Error::new(errno::EINVAL, "fabric attributes are NULL"))?;
        // SAFETY: its strings are NULL or NUL-terminated, per fi_fabric(3).
        let mut a = unsafe { fabric_attr(attr)? };
        // The core names layered providers "a;b"; ours is the last part.
        if let Some((_, last)) = a.prov_name.rsplit_once(';') {
            a.prov_name = last.to_string();
        }
        let f = Fabric::open(&a)?;
        let p = CFabric::into_raw(
            fi::fid_fabric {
                fid: fid(fi::FI_CLASS_FABRIC, context, &FABRIC_FI_OPS),
                ops: ops(&FABRIC_OPS),
                api_version: attr.api_version,
            },
            f,
        );
        // SAFETY: fabric is checked for NULL and writable, per fi_fabric(3).
        unsafe { put(fabric, p, "fabric") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CFabric::close(p, |_| Ok(())) };
        })
    })
}
unsafe extern "C" fn fabric_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the core passes the fid it got from fabric_open.
    guarded("fi_close(fabric)", || unsafe {
        CFabric::close(f.cast(), |x| unshared(x, "fabric"))
    })
}
unsafe extern "C" fn fabric_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_fabric_bind", || Err(enosys("binding to a fabric")))
}
unsafe extern "C" fn wait_open(
    fabric: *mut fi::fid_fabric,
    attr: *mut fi::fi_wait_attr,
    waitset: *mut *mut fi::fid_wait,
) -> i32 {
    // SAFETY: the application's fabric handle (its ops are checked).
    match unsafe { CFabric::from_c(fabric, "fabric") } {
        // SAFETY: forwarded as received.
        Ok(f) => unsafe { wait::open(&f.inner, attr, waitset) },
        Err(e) => guarded("fi_wait_open", || Err(e)),
    }
}

/// `fi_trywait`: each CQ (and each counter's CQs) is armed; an EQ with an event ready,
/// or a counter that moved, answers `EAGAIN`.
unsafe extern "C" fn trywait(
    _fabric: *mut fi::fid_fabric,
    fids: *mut *mut fi::fid,
    count: i32,
) -> i32 {
    guarded("fi_trywait", || {
        if count < 0 {
            return Err(Error::new(errno::EINVAL, "negative fid count"));
        }
        if count > 0 && fids.is_null() {
            return Err(Error::new(errno::EINVAL, "fids is NULL"));
        }
        for i in 0..count as usize {
            // SAFETY: the application passes `count` fids.
            let f = unsafe { *fids.add(i) };
            if f.is_null() {
                return Err(Error::new(errno::EINVAL, format!("fids[{i}] is NULL")));
            }
            // SAFETY: non-NULL fid from the application.
            match unsafe { (*f).fclass } as u32 {
                fi::FI_CLASS_CQ => {
                    // SAFETY: class checked.
                    unsafe { cq::CCq::from_c(f.cast(), "cq") }?
                        .inner
                        .trywait()?
                }
                fi::FI_CLASS_EQ => {
                    // SAFETY: class checked.
                    unsafe { eq::CEq::from_c(f.cast(), "eq") }?
                        .inner
                        .eq
                        .trywait()?
                }
                fi::FI_CLASS_CNTR => {
                    // SAFETY: class checked.
                    unsafe { cntr::CCntr::from_c(f.cast(), "cntr") }?
                        .inner
                        .trywait()?
                }
                fi::FI_CLASS_WAIT => {
                    // SAFETY: class checked.
                    unsafe { wait::CWait::from_c(f.cast(), "waitset") }?
                        .inner
                        .trywait()?
                }
                c => {
                    return Err(Error::new(
                        errno::EINVAL,
                        format!(
                            "fi_trywait on a fid of class {c}: only CQs, EQs, counters and wait sets wait"
                        ),
                    ))
                }
            }
        }
        Ok(())
    })
}
/// `fi_passive_ep` on this fabric.
unsafe extern "C" fn pep_open(
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
        let p = pep::open(&f.inner, &i, context)?;
        // SAFETY: checked for NULL above, writable per fi_passive_ep(3).
        unsafe { *pep = p };
        Ok(())
    })
}

/// `fi_eq_open` on this object: the handle is proven here, the child opens itself.
unsafe extern "C" fn eq_open(
    fabric: *mut fi::fid_fabric,
    attr: *mut fi::fi_eq_attr,
    eq: *mut *mut fi::fid_eq,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's handle (its ops are checked).
    match unsafe { CFabric::from_c(fabric, "fabric") } {
        // SAFETY: forwarded as received.
        Ok(p) => unsafe { eq::open(&p.inner, attr, eq, context) },
        Err(e) => guarded("fi_eq_open", || Err(e)),
    }
}

/// `fi_domain` on this fabric.
unsafe extern "C" fn domain_open(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    dom: *mut *mut fi::fid_domain,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's fabric handle (its ops are checked).
    match unsafe { CFabric::from_c(fabric, "fabric") } {
        // SAFETY: forwarded as received.
        Ok(f) => unsafe { domain::open(&f.inner, info, dom, context) },
        Err(e) => guarded("fi_domain", || Err(e)),
    }
}

/// `fi_domain2`: flags are for peer domains, which rverbs does not open as a peer.
unsafe extern "C" fn domain_open2(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    dom: *mut *mut fi::fid_domain,
    flags: u64,
    context: *mut c_void,
) -> i32 {
    if flags != 0 {
        return guarded("fi_domain2", || {
            crate::capi::fid::no_peer_open(flags, "fi_domain2")?;
            Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_domain2 flags {flags:#x}: only FI_PEER is defined"),
            ))
        });
    }
    // SAFETY: forwarded as received.
    unsafe { domain_open(fabric, info, dom, context) }
}
