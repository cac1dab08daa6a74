//! `fid_mr` over [`MemoryRegion`]: a registration, whose descriptor (`fi_mr_desc`) is its
//! own handle, checked like any other before a data call uses it.

use std::ffi::c_void;

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MemoryRegion as SysMr;

use crate::capi::cntr::CCntr;
use crate::capi::fid::{fi_ops_of, fid, guarded, no_control, Class, Obj};
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
pub(crate) unsafe fn register(
    d: &std::sync::Arc<crate::verbs::Domain>,
    buf: *const c_void,
    len: usize,
    access: u64,
    flags: u64,
    context: *mut c_void,
) -> Result<*mut fi::fid_mr> {
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
    let sys = unsafe { SysMr::register(d.pd(), buf.cast_mut().cast(), len, access) }
        .map_err(os_err("ibv_reg_mr"))?;
    let mr = MemoryRegion::from_registered(d, sys)?;
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
unsafe extern "C" fn mr_bind(f: *mut fi::fid, b: *mut fi::fid, flags: u64) -> i32 {
    guarded("fi_mr_bind", || {
        // SAFETY: the application's region fid (its ops are checked).
        let mr = &unsafe { CMr::from_c(f.cast(), "mr") }?.inner;
        if b.is_null() {
            return Err(Error::new(errno::EINVAL, "the fid to bind is NULL"));
        }
        // SAFETY: a non-NULL fid from the application: its class, then its ops, are checked.
        match unsafe { (*b).fclass } as u32 {
            fi::FI_CLASS_CNTR => {
                // SAFETY: a counter's fid (its ops are checked).
                let cntr = &unsafe { CCntr::from_c(b.cast(), "cntr") }?.inner;
                mr.bind_cntr(cntr, Flags::from_bits_retain(flags))
            }
            fi::FI_CLASS_EP => Err(Error::new(
                errno::EINVAL,
                "rverbs regions serve every endpoint of their domain: no FI_MR_ENDPOINT, so no endpoint binding",
            )),
            c => Err(Error::new(
                errno::EINVAL,
                format!("a region binds to a counter (FI_REMOTE_WRITE), not to a fid of class {c}"),
            )),
        }
    })
}
