//! `fid_mr` over [`MemoryRegion`]: a registration, whose descriptor (`fi_mr_desc`) is its
//! own handle, checked like any other before a data call uses it.

use std::ffi::c_void;

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MemoryRegion as SysMr;

use crate::capi::domain::CDomain;
use crate::capi::fid::{fi_ops_of, fid, guarded, no_control, put, Class, Obj};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::mr::verbs_access_checked;
use crate::verbs::{os_err, MemoryRegion};

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
pub(crate) static MR_FI_OPS: fi::fi_ops = fi_ops_of!(mr_close, mr_bind, no_control);
pub(crate) static MR_OPS: fi::fi_ops_mr = fi::fi_ops_mr {
    size: std::mem::size_of::<fi::fi_ops_mr>(),
    reg: Some(mr_reg),
    regv: Some(mr_regv),
    regattr: Some(mr_regattr),
};
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
