//! `fid_wait` over [`WaitSet`] (`fi_wait_open`, `fi_wait`): CQs, counters and EQs opened
//! with `FI_WAIT_SET` name it in their attributes, proven ours before they join.

use std::ffi::c_void;
use std::mem::size_of;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, ops, put, Class, Obj};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::WaitObj;
use crate::verbs::{Fabric, WaitAttr, WaitSet};

pub(crate) type CWait = Obj<fi::fid_wait, Arc<WaitSet>>;
impl Class for CWait {
    type Header = fi::fid_wait;
    const FCLASS: u32 = fi::FI_CLASS_WAIT;
    fn fi_ops() -> &'static fi::fi_ops {
        &WAIT_FI_OPS
    }
}

pub(crate) static WAIT_FI_OPS: fi::fi_ops = fi_ops_of!(wait_close, no_bind, wait_control);
pub(crate) static WAIT_OPS: fi::fi_ops_wait = fi::fi_ops_wait {
    size: size_of::<fi::fi_ops_wait>(),
    wait: Some(wait_run),
};

/// `fi_wait_open` on `fabric` (whose handle `fabric.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `waitset` is NULL or writable.
pub(crate) unsafe fn open(
    fabric: &Arc<Fabric>,
    attr: *mut fi::fi_wait_attr,
    waitset: *mut *mut fi::fid_wait,
) -> i32 {
    guarded("fi_wait_open", || {
        // SAFETY: NULL or a valid attr, per fi_wait_open(3).
        let a =
            unsafe { attr.as_ref() }.ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?;
        if a.flags != 0 {
            return Err(Error::new(
                errno::EINVAL,
                format!("wait set flags {:#x}: none are defined", a.flags),
            ));
        }
        let wait_obj = WaitObj::from_raw(a.wait_obj)
            .ok_or_else(|| Error::new(errno::EINVAL, format!("wait_obj {}", a.wait_obj)))?;
        let s = WaitSet::open(fabric, &WaitAttr { wait_obj })?;
        let p = CWait::into_raw(
            fi::fid_wait {
                // fi_wait_open takes no context: the set's own is NULL.
                fid: fid(fi::FI_CLASS_WAIT, std::ptr::null_mut(), &WAIT_FI_OPS),
                ops: ops(&WAIT_OPS),
            },
            s,
        );
        // SAFETY: checked for NULL, writable per fi_wait_open(3).
        unsafe { put(waitset, p, "waitset") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CWait::close(p, |_| Ok(())) };
        })
    })
}

/// The wait set an open's attributes name, when its wait object is `FI_WAIT_SET` (the
/// field is ignored otherwise: fi_cq(3), fi_cntr(3), fi_eq(3)).
///
/// # Safety
/// `set` is NULL or a readable `struct fid_wait`.
pub(crate) unsafe fn named(
    wait_obj: WaitObj,
    set: *mut fi::fid_wait,
) -> Result<Option<Arc<WaitSet>>> {
    if wait_obj != WaitObj::Set {
        return Ok(None);
    }
    if set.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            "FI_WAIT_SET with no wait_set: open one with fi_wait_open",
        ));
    }
    // SAFETY: the caller's contract; `from_c` proves it a wait set of ours.
    Ok(Some(
        unsafe { CWait::from_c(set, "wait_set") }?.inner.clone(),
    ))
}

unsafe extern "C" fn wait_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_wait_open returned.
    guarded("fi_close(waitset)", || unsafe {
        CWait::close(f.cast(), |s| s.close())
    })
}

unsafe extern "C" fn wait_control(f: *mut fi::fid, cmd: i32, arg: *mut c_void) -> i32 {
    guarded("fi_control(waitset)", || {
        // SAFETY: the application's wait set fid.
        let s = &unsafe { CWait::from_c(f.cast(), "waitset") }?.inner;
        match cmd as u32 {
            fi::FI_GETWAIT => {
                // SAFETY: FI_GETWAIT on an FD wait object writes an int (fi_control(3)).
                unsafe { put(arg.cast::<i32>(), s.fd().as_raw_fd(), "arg") }
            }
            fi::FI_GETWAITOBJ => {
                // SAFETY: FI_GETWAITOBJ writes an enum fi_wait_obj.
                unsafe { put(arg.cast::<fi::fi_wait_obj>(), fi::FI_WAIT_FD, "arg") }
            }
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on a wait set"),
            )),
        }
    })
}

unsafe extern "C" fn wait_run(w: *mut fi::fid_wait, timeout: i32) -> i32 {
    guarded("fi_wait", || {
        // SAFETY: the application's wait set handle (its ops are checked).
        unsafe { CWait::from_c(w, "waitset") }?.inner.wait(timeout)
    })
}
