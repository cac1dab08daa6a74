//! `fid_fabric`, `fid_domain`, `fid_mr` and `fid_av` over [`Fabric`], [`Domain`],
//! [`MemoryRegion`] and [`AddressVector`].

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MemoryRegion as SysMr;

use crate::capi::fid::{
    bytes, bytes_mut, enosys, fi_ops_of, fid, guarded, guarded_ptr, no_control, ops, put, Class,
    Obj,
};
use crate::capi::info::{fabric_attr, from_c};
use crate::capi::nosys::{n3i, n4i, n5i};
use crate::capi::{cq, ep, eq};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{AvType, Flags};
use crate::verbs::mr::verbs_access_checked;
use crate::verbs::{os_err, AddressVector, AvAttr, Domain, Fabric, MemoryRegion, UdName};

pub(crate) type CFabric = Obj<fi::fid_fabric, Arc<Fabric>>;
impl Class for CFabric {
    type Header = fi::fid_fabric;
    const FCLASS: u32 = fi::FI_CLASS_FABRIC;
    fn fi_ops() -> &'static fi::fi_ops {
        &FABRIC_FI_OPS
    }
}

pub(crate) type CDomain = Obj<fi::fid_domain, Arc<Domain>>;
impl Class for CDomain {
    type Header = fi::fid_domain;
    const FCLASS: u32 = fi::FI_CLASS_DOMAIN;
    fn fi_ops() -> &'static fi::fi_ops {
        &DOMAIN_FI_OPS
    }
}

/// A registration of application memory. Its `mem_desc` (`fi_mr_desc`) is its own address,
/// so a descriptor leads back here after a class check.
pub(crate) type CMr = Obj<fi::fid_mr, MemoryRegion>;
impl Class for CMr {
    type Header = fi::fid_mr;
    const FCLASS: u32 = fi::FI_CLASS_MR;
    fn fi_ops() -> &'static fi::fi_ops {
        &MR_FI_OPS
    }
}

pub(crate) type CAv = Obj<fi::fid_av, Arc<AddressVector>>;
impl Class for CAv {
    type Header = fi::fid_av;
    const FCLASS: u32 = fi::FI_CLASS_AV;
    fn fi_ops() -> &'static fi::fi_ops {
        &AV_FI_OPS
    }
}

/// `EBUSY` while children (which hold the object alive) are open: fi_close order matters.
pub(crate) fn unshared<T>(a: &Arc<T>, what: &str) -> Result<()> {
    let n = Arc::strong_count(a) - 1;
    if n > 0 {
        return Err(Error::new(
            errno::EBUSY,
            format!("{n} objects opened from this {what} are still open: close them first"),
        ));
    }
    Ok(())
}

// ---- fabric ----------------------------------------------------------------------------

static FABRIC_FI_OPS: fi::fi_ops = fi_ops_of!(fabric_close, fabric_bind, no_control);
static FABRIC_OPS: fi::fi_ops_fabric = fi::fi_ops_fabric {
    size: std::mem::size_of::<fi::fi_ops_fabric>(),
    domain: Some(domain_open),
    passive_ep: Some(ep::pep_open),
    eq_open: Some(eq::eq_open),
    wait_open: Some(n3i),
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

/// `fi_trywait`: each CQ is armed; an EQ with an event ready answers `EAGAIN`.
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
                    unsafe { eq::CEq::from_c(f.cast(), "eq") }?.trywait()?
                }
                c => {
                    return Err(Error::new(
                        errno::EINVAL,
                        format!("fi_trywait on a fid of class {c}: only CQs and EQs wait"),
                    ))
                }
            }
        }
        Ok(())
    })
}

// ---- domain ----------------------------------------------------------------------------

static DOMAIN_FI_OPS: fi::fi_ops = fi::fi_ops {
    // The extension interface (fi_rverbs.h) opens on the domain.
    ops_open: Some(crate::capi::ext::domain_ops_open),
    ..fi_ops_of!(domain_close, domain_bind, no_control)
};
static DOMAIN_OPS: fi::fi_ops_domain = fi::fi_ops_domain {
    size: std::mem::size_of::<fi::fi_ops_domain>(),
    av_open: Some(av_open),
    cq_open: Some(cq::cq_open),
    endpoint: Some(ep::endpoint_open),
    scalable_ep: Some(n4i),
    cntr_open: Some(n4i),
    poll_open: Some(n3i),
    stx_ctx: Some(n4i),
    srx_ctx: Some(ep::srx_open),
    query_atomic: Some(n5i),
    query_collective: Some(n4i),
    endpoint2: Some(ep::endpoint_open2),
};
static MR_OPS: fi::fi_ops_mr = fi::fi_ops_mr {
    size: std::mem::size_of::<fi::fi_ops_mr>(),
    reg: Some(mr_reg),
    regv: Some(mr_regv),
    regattr: Some(mr_regattr),
};

unsafe extern "C" fn domain_open(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    dom: *mut *mut fi::fid_domain,
    context: *mut c_void,
) -> i32 {
    guarded("fi_domain", || {
        // SAFETY: libfabric's API contract: a fabric fid and an info from fi_getinfo.
        let (f, info) = unsafe {
            (
                CFabric::from_c(fabric, "fabric")?,
                from_c_nonnull(info, "info")?,
            )
        };
        let d = Domain::open(&f.inner, &info)?;
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

/// An `fi_info` the application passes back (from `fi_getinfo` or an `FI_CONNREQ`).
///
/// # Safety
/// `info` is NULL or a valid `fi_info`.
pub(crate) unsafe fn from_c_nonnull(
    info: *const fi::fi_info,
    what: &str,
) -> Result<crate::core::info::Info> {
    if info.is_null() {
        return Err(Error::new(errno::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract.
    unsafe { from_c(info) }
}

// ---- memory registration ---------------------------------------------------------------

static MR_FI_OPS: fi::fi_ops = fi_ops_of!(mr_close, mr_bind, no_control);

/// The memory region a descriptor (`fi_mr_desc`) names.
///
/// # Safety
/// `desc` is NULL or a descriptor returned by `fi_mr_desc` on an open region.
#[inline]
pub(crate) unsafe fn mr_of<'a>(desc: *mut c_void) -> Result<&'a MemoryRegion> {
    if desc.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            "desc is NULL: rverbs needs FI_MR_LOCAL, so pass fi_mr_desc() of the registered buffer",
        ));
    }
    // SAFETY: the caller's contract; the class is checked.
    Ok(&unsafe { CMr::from_c(desc.cast(), "desc") }?.inner)
}

/// Registers `len` bytes at `buf` and returns the `fid_mr`.
///
/// # Safety
/// `buf..buf+len` stays allocated until the region is closed (fi_mr_reg(3)'s contract).
unsafe fn register(
    domain: *mut fi::fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    flags: u64,
    context: *mut c_void,
) -> Result<*mut fi::fid_mr> {
    // SAFETY: the domain fid from the application; the class is checked.
    let d = unsafe { CDomain::from_c(domain.cast(), "domain") }?;
    if flags != 0 {
        return Err(Error::new(
            errno::EBADFLAGS,
            format!("registration flags {flags:#x} are not supported"),
        ));
    }
    if buf.is_null() && len > 0 {
        return Err(Error::new(errno::EINVAL, "buf is NULL"));
    }
    let access = verbs_access_checked(Flags::from_bits_retain(access))?;
    // SAFETY: forwarded from the caller.
    let sys = unsafe { SysMr::register(d.inner.pd(), buf.cast_mut().cast(), len, access) }
        .map_err(os_err("ibv_reg_mr"))?;
    let mr = MemoryRegion::from_registered(&d.inner, sys);
    let key = mr.key();
    let p = CMr::into_raw(
        fi::fid_mr {
            fid: fid(fi::FI_CLASS_MR, context, &MR_FI_OPS),
            mem_desc: std::ptr::null_mut(),
            key,
        },
        mr,
    );
    // SAFETY: p was just made; its descriptor is its own address.
    unsafe { (*p).mem_desc = p.cast() };
    Ok(p)
}

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
        let p = unsafe { register(domain, buf, len, access, flags, context) }?;
        // SAFETY: checked for NULL, writable per fi_mr_reg(3).
        unsafe { put(mr, p, "mr") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CMr::close(p, |_| Ok(())) };
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
        let p = unsafe { register(domain, buf, len, a.access, flags, a.context) }?;
        // SAFETY: checked for NULL, writable per fi_mr_regattr(3).
        unsafe { put(mr, p, "mr") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CMr::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn mr_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_mr_reg returned.
    guarded("fi_close(mr)", || unsafe {
        CMr::close(f.cast(), |m| {
            if m.in_use() {
                return Err(Error::new(
                    errno::EBUSY,
                    "the region is in use by posted receives (a multi-receive buffer, or a FI_SOURCE receive) the device may still write: close the endpoint or let them complete first",
                ));
            }
            Ok(())
        })
    })
}

unsafe extern "C" fn mr_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_mr_bind", || {
        Err(Error::new(
            errno::EINVAL,
            "rverbs regions are not bound (no FI_MR_ENDPOINT in mr_mode)",
        ))
    })
}

// ---- address vectors -------------------------------------------------------------------

static AV_FI_OPS: fi::fi_ops = fi_ops_of!(av_close, av_bind, no_control);
static AV_OPS: fi::fi_ops_av = fi::fi_ops_av {
    size: std::mem::size_of::<fi::fi_ops_av>(),
    insert: Some(av_insert),
    insertsvc: Some(crate::capi::nosys::n6i),
    insertsym: Some(crate::capi::nosys::n8i),
    remove: Some(av_remove),
    lookup: Some(av_lookup),
    straddr: Some(av_straddr),
    av_set: Some(crate::capi::avset::av_set_open),
};

unsafe extern "C" fn av_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_av_attr,
    av: *mut *mut fi::fid_av,
    context: *mut c_void,
) -> i32 {
    guarded("fi_av_open", || {
        // SAFETY: the application's domain fid and NULL or a valid attr.
        let (d, a) = unsafe {
            (
                CDomain::from_c(domain, "domain")?,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        crate::capi::fid::no_peer_open(a.flags, "fi_av_open")?;
        if a.flags & (fi::FI_EVENT as u64) != 0 {
            return Err(enosys("asynchronous address vectors (FI_EVENT)"));
        }
        if !a.name.is_null() {
            return Err(enosys("named (shared) address vectors"));
        }
        let av_type = AvType::from_raw(a.type_)
            .ok_or_else(|| Error::new(errno::EINVAL, format!("av type {}", a.type_)))?;
        let v = AddressVector::open(
            &d.inner,
            &AvAttr {
                av_type,
                count: a.count,
            },
        )?;
        let p = CAv::into_raw(
            fi::fid_av {
                fid: fid(fi::FI_CLASS_AV, context, &AV_FI_OPS),
                ops: ops(&AV_OPS),
            },
            v,
        );
        // SAFETY: checked for NULL, writable per fi_av_open(3).
        unsafe { put(av, p, "av") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CAv::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn av_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_av_open returned.
    guarded("fi_close(av)", || unsafe {
        CAv::close(f.cast(), |a| unshared(a, "address vector"))?;
        Ok(())
    })
}

unsafe extern "C" fn av_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_av_bind", || {
        Err(enosys("binding an EQ to an AV (asynchronous inserts)"))
    })
}

/// `fi_av_insert`: `count` names of `UdName::LEN` bytes; synchronous. Failed entries get
/// `FI_ADDR_NOTAVAIL`; the return is how many went in.
unsafe extern "C" fn av_insert(
    av: *mut fi::fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi::fi_addr_t,
    flags: u64,
    _context: *mut c_void,
) -> i32 {
    guarded_count("fi_av_insert", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if flags & !fi::FI_MORE != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("insert flags {flags:#x} are not supported"),
            ));
        }
        let n = count
            .checked_mul(UdName::LEN)
            .ok_or_else(|| Error::new(errno::EINVAL, "count overflows"))?;
        // SAFETY: `count` names of the AV's address length, per fi_av_insert(3).
        let names = unsafe { bytes(addr, n, "addr") }?;
        let mut inserted = 0;
        for (i, name) in names.chunks_exact(UdName::LEN).enumerate() {
            let r = a.inner.insert(name);
            if let Err(e) = &r {
                crate::fi_info!("av", "fi_av_insert of address {i}: {e}");
            }
            inserted += r.is_ok() as usize;
            if !fi_addr.is_null() {
                // SAFETY: fi_addr has `count` slots, per fi_av_insert(3).
                unsafe { *fi_addr.add(i) = r.unwrap_or(fi::FI_ADDR_NOTAVAIL) };
            }
        }
        Ok(inserted)
    })
}

/// As [`guarded`] for an `int` count.
fn guarded_count(what: &str, f: impl FnOnce() -> Result<usize>) -> i32 {
    let mut n = 0;
    let r = guarded(what, || {
        n = f()?;
        Ok(())
    });
    if r == 0 {
        n.min(i32::MAX as usize) as i32
    } else {
        r
    }
}

unsafe extern "C" fn av_remove(
    av: *mut fi::fid_av,
    fi_addr: *mut fi::fi_addr_t,
    count: usize,
    _flags: u64,
) -> i32 {
    guarded("fi_av_remove", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if count > 0 && fi_addr.is_null() {
            return Err(Error::new(errno::EINVAL, "fi_addr is NULL"));
        }
        let mut first_err = None;
        for i in 0..count {
            // SAFETY: `count` addresses, per fi_av_remove(3).
            let x = unsafe { *fi_addr.add(i) };
            if let Err(e) = a.inner.remove(x) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}

unsafe extern "C" fn av_lookup(
    av: *mut fi::fid_av,
    fi_addr: fi::fi_addr_t,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> i32 {
    guarded("fi_av_lookup", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: non-NULL; the buffer has *addrlen bytes (fi_av_lookup(3)).
        let (buf, len) = unsafe {
            let len = &mut *addrlen;
            (bytes_mut(addr, *len, "addr")?, len)
        };
        a.inner.lookup(fi_addr, buf, len)
    })
}

unsafe extern "C" fn av_straddr(
    _av: *mut fi::fid_av,
    addr: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    guarded_ptr("fi_av_straddr", || {
        // SAFETY: an address of the AV's format (UdName::LEN bytes), per fi_av_straddr(3).
        let name = unsafe { bytes(addr, UdName::LEN, "addr") }?;
        let s = AddressVector::straddr(name)?;
        // SAFETY: NULL or the application's length and buffer.
        unsafe { copy_cstr(&s, buf, len) }
    })
}

/// Writes `s` as a C string into `buf` of `*len` bytes (truncated, always terminated) and
/// sets `*len` to the size the whole string needs, as the `straddr` calls do.
///
/// # Safety
/// `len` is NULL or valid; `buf` has `*len` writable bytes.
pub(crate) unsafe fn copy_cstr(
    s: &str,
    buf: *mut c_char,
    len: *mut usize,
) -> Result<*const c_char> {
    if len.is_null() || buf.is_null() {
        return Err(Error::new(errno::EINVAL, "buf or len is NULL"));
    }
    // SAFETY: the caller's contract.
    unsafe {
        let cap = *len;
        if cap > 0 {
            let n = s.len().min(cap - 1);
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        *len = s.len() + 1;
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::provider::fi_prov_ini;
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
            assert_eq!(
                (o.wait_open.unwrap())(f, null_mut(), null_mut()),
                -errno::ENOSYS
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
