//! `fid_domain` over [`Domain`] (a protection domain): it opens CQs, endpoints, AVs,
//! SRXs and memory registrations; `fi_open_ops` finds the extension interface there.

use std::ffi::c_void;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{
    enosys, fi_ops_of, fid, from_c_nonnull, guarded, no_control, ops, put, unshared, Class, Obj,
};
use crate::capi::nosys::n4i;
use crate::capi::{av, cq, dgram_ep, mr, msg_ep, pep, rdm_ep, soft_srx, srx};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::EpType;
use crate::verbs::Domain;

pub(crate) type CDomain = Obj<fi::fid_domain, Arc<Domain>>;
impl Class for CDomain {
    type Header = fi::fid_domain;
    const FCLASS: u32 = fi::FI_CLASS_DOMAIN;
    fn fi_ops() -> &'static fi::fi_ops {
        &DOMAIN_FI_OPS
    }
}
pub(crate) static DOMAIN_FI_OPS: fi::fi_ops = fi::fi_ops {
    // The extension interface (fi_rverbs.h) opens on the domain.
    ops_open: Some(crate::capi::fid::domain_ops_open),
    ..fi_ops_of!(domain_close, domain_bind, no_control)
};
pub(crate) static DOMAIN_OPS: fi::fi_ops_domain = fi::fi_ops_domain {
    size: std::mem::size_of::<fi::fi_ops_domain>(),
    av_open: Some(av_open),
    cq_open: Some(cq_open),
    endpoint: Some(endpoint_open),
    scalable_ep: Some(n4i),
    cntr_open: Some(cntr_open),
    poll_open: Some(poll_open),
    stx_ctx: Some(n4i),
    srx_ctx: Some(srx_open),
    query_atomic: Some(query_atomic),
    query_collective: Some(n4i),
    endpoint2: Some(endpoint_open2),
};
/// `fi_domain` on `fabric` (whose handle `fabric.rs` proved).
///
/// # Safety
/// `info` is NULL or a valid `fi_info`; `dom` is NULL or writable.
pub(crate) unsafe fn open(
    fabric: &Arc<crate::verbs::Fabric>,
    info: *mut fi::fi_info,
    dom: *mut *mut fi::fid_domain,
    context: *mut c_void,
) -> i32 {
    guarded("fi_domain", || {
        // SAFETY: libfabric's API contract: an info from fi_getinfo.
        let info = unsafe { from_c_nonnull(info, "info") }?;
        let d = Domain::open(fabric, &info)?;
        let p = CDomain::into_raw(
            fi::fid_domain {
                fid: fid(fi::FI_CLASS_DOMAIN, context, &DOMAIN_FI_OPS),
                ops: ops(&DOMAIN_OPS),
                mr: ops(&MR_OPS),
            },
            d,
        );
        // SAFETY: checked for NULL; writable per fi_domain(3).
        unsafe { put(dom, p, "domain") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CDomain::close(p, |_| Ok(())) };
        })
    })
}
unsafe extern "C" fn domain_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the application passes the fid fi_domain returned.
    guarded("fi_close(domain)", || unsafe {
        CDomain::close(f.cast(), |d| unshared(d, "domain"))?;
        Ok(())
    })
}
unsafe extern "C" fn domain_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_domain_bind", || {
        Err(enosys(
            "fi_domain_bind (an EQ for asynchronous memory registration and AV events)",
        ))
    })
}
/// `fi_endpoint`: a MSG endpoint (active, from the address of the passive endpoint in
/// `info->handle` if there is one, or accepting the request there) or
/// a DGRAM one, each with its own ops tables.
unsafe extern "C" fn endpoint_open(
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
        let p = match i.ep_attr.ep_type {
            EpType::Dgram => dgram_ep::open(&d.inner, &i, context)?,
            EpType::Rdm => rdm_ep::open(&d.inner, &i, context)?,
            // SAFETY: a non-NULL handle is a fid whose class, then ops, are checked.
            _ if !handle.is_null() && unsafe { (*handle).fclass } == fi::FI_CLASS_PEP as usize => {
                // SAFETY: a passive endpoint's fid (its ops are checked).
                let mut pep = pep::pep_lock(unsafe { pep::CPep::from_c(handle.cast(), "handle") }?);
                let reserved = Arc::new(pep.grant_address()?);
                i.handle = Some(reserved.clone());
                msg_ep::open(&d.inner, &i, std::ptr::null_mut(), context).inspect_err(|_| {
                    pep.restore_address(&reserved);
                })?
            }
            _ => {
                if !handle.is_null() {
                    // SAFETY: fi_info.handle of an FI_CONNREQ event (its ops are checked).
                    i.handle = Some(unsafe { crate::capi::eq::connreq_of(handle) }?);
                }
                msg_ep::open(&d.inner, &i, handle, context)?
            }
        };
        // SAFETY: checked for NULL above, writable per fi_endpoint(3).
        unsafe { *ep = p };
        Ok(())
    })
}

unsafe extern "C" fn endpoint_open2(
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

/// `fi_srx_context`: a device SRQ for MSG endpoints, or the software one when the caps ask
/// for matching (tagged, directed receive).
unsafe extern "C" fn srx_open(
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
        if soft_srx::wanted(a.caps) {
            let p = soft_srx::open(&d.inner, a, context)?;
            // SAFETY: checked for NULL, writable per fi_srx_context(3).
            return unsafe { put(rx_ep, p, "rx_ep") }.inspect_err(|_| {
                // SAFETY: just made, never handed out.
                let _ = unsafe { soft_srx::CSoftSrx::close(p, |_| Ok(())) };
            });
        }
        let p = srx::open(&d.inner, a, context)?;
        // SAFETY: checked for NULL, writable per fi_srx_context(3).
        unsafe { put(rx_ep, p, "rx_ep") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { srx::CSrx::close(p, |_| Ok(())) };
        })
    })
}

/// `fi_av_open` on this object: the handle is proven here, the child opens itself.
unsafe extern "C" fn av_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_av_attr,
    av: *mut *mut fi::fid_av,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's handle (its ops are checked).
    match unsafe { CDomain::from_c(domain, "domain") } {
        // SAFETY: forwarded as received.
        Ok(p) => unsafe { av::open(&p.inner, attr, av, context) },
        Err(e) => guarded("fi_av_open", || Err(e)),
    }
}

/// `fi_cq_open` on this domain.
unsafe extern "C" fn cq_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_cq_attr,
    cq: *mut *mut fi::fid_cq,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's domain handle (its ops are checked).
    match unsafe { CDomain::from_c(domain, "domain") } {
        // SAFETY: forwarded as received.
        Ok(d) => unsafe { cq::open(&d.inner, attr, cq, context) },
        Err(e) => guarded("fi_cq_open", || Err(e)),
    }
}

/// `fi_query_atomic`: the atomics RDM endpoints of this domain carry.
unsafe extern "C" fn query_atomic(
    domain: *mut fi::fid_domain,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    attr: *mut fi::fi_atomic_attr,
    flags: u64,
) -> i32 {
    guarded("fi_query_atomic", || {
        // SAFETY: the application's domain handle (its ops are checked).
        unsafe { CDomain::from_c(domain, "domain") }?;
        if attr.is_null() {
            return Err(Error::new(errno::EINVAL, "attr is NULL"));
        }
        let a = crate::capi::rdm_atomic::query_atomic(datatype, op, flags)?;
        // SAFETY: non-NULL, the caller's writable attributes (fi_atomic(3)).
        unsafe {
            *attr = fi::fi_atomic_attr {
                count: a.count,
                size: a.size,
            }
        };
        Ok(())
    })
}

/// `fi_cntr_open` on this domain.
unsafe extern "C" fn cntr_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_cntr_attr,
    cntr: *mut *mut fi::fid_cntr,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's domain handle (its ops are checked).
    match unsafe { CDomain::from_c(domain, "domain") } {
        // SAFETY: forwarded as received.
        Ok(d) => unsafe { crate::capi::cntr::open(&d.inner, attr, cntr, context) },
        Err(e) => guarded("fi_cntr_open", || Err(e)),
    }
}

unsafe extern "C" fn poll_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_poll_attr,
    pollset: *mut *mut fi::fid_poll,
) -> i32 {
    // SAFETY: the application's domain handle (its ops are checked).
    match unsafe { CDomain::from_c(domain, "domain") } {
        // SAFETY: forwarded as received.
        Ok(d) => unsafe { crate::capi::poll::open(&d.inner, attr, pollset) },
        Err(e) => guarded("fi_poll_open", || Err(e)),
    }
}

// ---- memory registration (the domain's fi_ops_mr) ----------------------------------

pub(crate) static MR_OPS: fi::fi_ops_mr = fi::fi_ops_mr {
    size: std::mem::size_of::<fi::fi_ops_mr>(),
    reg: Some(mr_reg),
    regv: Some(mr_regv),
    regattr: Some(mr_regattr),
};
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn mr_reg(
    domain: *mut fi::fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    _offset: u64,
    _requested_key: u64,
    flags: u64,
    mr: *mut *mut fi::fid_mr,
    context: *mut c_void,
) -> i32 {
    guarded("fi_mr_reg", || {
        // SAFETY: the application's buffer contract (fi_mr_reg(3)).
        let p = unsafe {
            let d = CDomain::from_c(domain.cast(), "domain")?;
            mr::register(&d.inner, buf, len, access, flags, context)
        }?;
        // SAFETY: checked for NULL, writable per fi_mr_reg(3).
        unsafe { put(mr, p, "mr") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { mr::CMr::close(p, |_| Ok(())) };
        })
    })
}
/// One range of an iov registration: verbs registers contiguous memory only.
fn one_range(iov: *const libc::iovec, count: usize) -> Result<(*const c_void, usize)> {
    if count != 1 || iov.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("{count} ranges: rverbs registers one contiguous range (mr_iov_limit 1)"),
        ));
    }
    // SAFETY: non-NULL and one element long, per fi_mr_regv(3).
    let v = unsafe { *iov };
    Ok((v.iov_base.cast_const(), v.iov_len))
}
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn mr_regv(
    domain: *mut fi::fid,
    iov: *const libc::iovec,
    count: usize,
    access: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fi::fid_mr,
    context: *mut c_void,
) -> i32 {
    match one_range(iov, count) {
        // SAFETY: forwarded as received.
        Ok((buf, len)) => unsafe {
            mr_reg(
                domain,
                buf,
                len,
                access,
                offset,
                requested_key,
                flags,
                mr,
                context,
            )
        },
        Err(e) => guarded("fi_mr_regv", || Err(e)),
    }
}
unsafe extern "C" fn mr_regattr(
    domain: *mut fi::fid,
    attr: *const fi::fi_mr_attr,
    flags: u64,
    mr: *mut *mut fi::fid_mr,
) -> i32 {
    guarded("fi_mr_regattr", || {
        // SAFETY: NULL or a valid attribute struct from the application.
        let a =
            unsafe { attr.as_ref() }.ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?;
        if a.iface != fi::FI_HMEM_SYSTEM {
            return Err(Error::new(
                errno::ENOSYS,
                "device memory (fi_mr_attr.iface other than FI_HMEM_SYSTEM) is not supported",
            ));
        }
        let (buf, len) = one_range(a.mr_iov, a.iov_count)?;
        // SAFETY: the application's buffer contract (fi_mr_reg(3)).
        let p = unsafe {
            let d = CDomain::from_c(domain.cast(), "domain")?;
            mr::register(&d.inner, buf, len, a.access, flags, a.context)
        }?;
        // SAFETY: checked for NULL, writable per fi_mr_regattr(3).
        unsafe { put(mr, p, "mr") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { mr::CMr::close(p, |_| Ok(())) };
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::av::copy_cstr;
    use crate::capi::fabric::{CFabric, FABRIC_FI_OPS};
    use crate::capi::mr::mr_of;
    use crate::capi::mr::MR_FI_OPS;
    use crate::capi::provider::fi_prov_ini;
    use std::ffi::c_char;
    use std::ptr::{null, null_mut};

    /// Opens a fabric through the provider entry the core calls; no device needed.
    fn open_fabric() -> *mut fi::fid_fabric {
        let prov = fi_prov_ini();
        // SAFETY: a plain C struct of pointers and integers: all-zero is valid.
        let mut attr: fi::fi_fabric_attr = unsafe { std::mem::zeroed() };
        attr.prov_name = c"rverbs".as_ptr().cast_mut();
        attr.api_version = fi::RFABRIC_FI_VERSION;
        let mut f = null_mut();
        // SAFETY: the provider's own fabric entry with a valid attr and out-pointer.
        let rc = unsafe { ((*prov).fabric.unwrap())(&mut attr, &mut f, null_mut()) };
        assert_eq!(rc, 0);
        f
    }

    #[test]
    fn fabric_opens_and_closes_through_its_ops_and_refuses_bad_arguments() {
        let f = open_fabric();
        // SAFETY: f is the fabric just opened; every call below goes through its tables
        // as libfabric's inline wrappers do.
        unsafe {
            assert_eq!((*f).fid.fclass, fi::FI_CLASS_FABRIC as usize);
            let o = &*(*f).ops;
            assert_eq!(o.size, std::mem::size_of::<fi::fi_ops_fabric>());
            let mut eq = null_mut();
            assert_eq!(
                (o.eq_open.unwrap())(f, null_mut(), &mut eq, null_mut()),
                -errno::EINVAL
            );
            let mut d = null_mut();
            assert_eq!(
                (o.domain.unwrap())(f, null_mut(), &mut d, null_mut()),
                -errno::EINVAL
            );
            // NULL attributes (wait sets are fi_wait_open's, section `wait` of the C test).
            assert_eq!(
                (o.wait_open.unwrap())(f, null_mut(), null_mut()),
                -errno::EINVAL
            );
            assert_eq!((o.trywait.unwrap())(f, null_mut(), 0), 0);
            assert_eq!((o.trywait.unwrap())(f, null_mut(), 1), -errno::EINVAL);
            // A fid of another class is refused, not freed.
            let mut other = fid(fi::FI_CLASS_CQ, null_mut(), &FABRIC_FI_OPS);
            let close = (*(*f).fid.ops).close.unwrap();
            assert_eq!(close(&mut other), -errno::EINVAL);
            assert_eq!(close(null_mut()), -errno::EINVAL);
            assert_eq!(close(&mut (*f).fid), 0);
        }
    }

    #[test]
    fn a_busy_fabric_is_not_closed() {
        let f = open_fabric();
        // SAFETY: f is open; the extra reference stands for a child object.
        unsafe {
            let keep = CFabric::from_c(f, "fabric").unwrap().inner.clone();
            let close = (*(*f).fid.ops).close.unwrap();
            assert_eq!(close(&mut (*f).fid), -errno::EBUSY);
            drop(keep);
            assert_eq!(close(&mut (*f).fid), 0);
        }
    }

    #[test]
    fn unimplemented_slots_answer_enosys_and_descriptors_are_checked() {
        use crate::capi::nosys;
        // SAFETY: the no-op functions ignore their arguments.
        unsafe {
            let w = nosys::RMA.write.unwrap();
            assert_eq!(
                w(null_mut(), null(), 0, null_mut(), 0, 0, 0, null_mut()),
                -(errno::ENOSYS as isize)
            );
            let t = nosys::TAGGED.send.unwrap();
            assert_eq!(
                t(null_mut(), null(), 0, null_mut(), 0, 0, null_mut()),
                -(errno::ENOSYS as isize)
            );
            let v = nosys::ATOMIC.writevalid.unwrap();
            assert_eq!(v(null_mut(), 0, 0, null_mut()), -errno::ENOSYS);
            let b = nosys::COLLECTIVE.barrier.unwrap();
            assert_eq!(b(null_mut(), 0, null_mut()), -(errno::ENOSYS as isize));
            assert_eq!(mr_of(null_mut()).unwrap_err().errno(), errno::EINVAL);
            let mut not_mr = fid(fi::FI_CLASS_CQ, null_mut(), &MR_FI_OPS);
            assert_eq!(
                mr_of((&raw mut not_mr).cast()).unwrap_err().errno(),
                errno::EINVAL
            );
        }
        assert_eq!(nosys::RMA.size, std::mem::size_of::<fi::fi_ops_rma>());
        assert_eq!(
            nosys::COLLECTIVE.size,
            std::mem::size_of::<fi::fi_ops_collective>()
        );
    }

    #[test]
    fn straddr_copies_truncate_and_report_the_full_size() {
        let mut buf = [0x7f as c_char; 8];
        let mut len = buf.len();
        // SAFETY: buf has len bytes.
        let p = unsafe { copy_cstr("fi_addr_ib_ud://x", buf.as_mut_ptr(), &mut len) }.unwrap();
        assert_eq!(p, buf.as_ptr());
        assert_eq!(len, 18);
        assert_eq!(buf[7], 0);
        // SAFETY: NUL-terminated above.
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        assert_eq!(s.to_str().unwrap(), "fi_addr");
    }
}
