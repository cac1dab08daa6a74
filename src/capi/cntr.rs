//! `fid_cntr` over [`Counter`]: reads drive the CQs of the endpoints bound to it.

use std::ffi::c_void;
use std::mem::size_of;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, ops, put, Class, Obj};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{Flags, WaitObj};
use crate::verbs::{CntrAttr, Counter, Domain};

pub(crate) type CCntr = Obj<fi::fid_cntr, Arc<Counter>>;
impl Class for CCntr {
    type Header = fi::fid_cntr;
    const FCLASS: u32 = fi::FI_CLASS_CNTR;
    fn fi_ops() -> &'static fi::fi_ops {
        &CNTR_FI_OPS
    }
}

pub(crate) static CNTR_FI_OPS: fi::fi_ops = fi_ops_of!(cntr_close, no_bind, cntr_control);
pub(crate) static CNTR_OPS: fi::fi_ops_cntr = fi::fi_ops_cntr {
    size: size_of::<fi::fi_ops_cntr>(),
    read: Some(cntr_read),
    readerr: Some(cntr_readerr),
    add: Some(cntr_add),
    set: Some(cntr_set),
    wait: Some(cntr_wait),
    adderr: Some(cntr_adderr),
    seterr: Some(cntr_seterr),
};

/// `fi_cntr_open` on `domain` (whose handle `domain.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `cntr` is NULL or writable.
pub(crate) unsafe fn open(
    domain: &Arc<Domain>,
    attr: *mut fi::fi_cntr_attr,
    cntr: *mut *mut fi::fid_cntr,
    context: *mut c_void,
) -> i32 {
    guarded("fi_cntr_open", || {
        // fi_cntr(3): NULL attributes mean the defaults (FI_CNTR_EVENTS_COMP, FI_WAIT_NONE).
        // SAFETY: NULL or a valid attr, per fi_cntr_open(3).
        let a = unsafe { attr.as_ref() }.copied().unwrap_or_default();
        if a.events != fi::FI_CNTR_EVENTS_COMP {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "counter events {}: only FI_CNTR_EVENTS_COMP exists",
                    a.events
                ),
            ));
        }
        let wait_obj = WaitObj::from_raw(a.wait_obj)
            .ok_or_else(|| Error::new(errno::EINVAL, format!("wait_obj {}", a.wait_obj)))?;
        // SAFETY: NULL or the application's wait set (proven ours there).
        let set = unsafe { crate::capi::wait::named(wait_obj, a.wait_set) }?;
        let attr = CntrAttr {
            wait_obj,
            flags: Flags::from_bits_retain(a.flags),
        };
        let c = Counter::open(domain, &attr)?;
        if let Some(s) = &set {
            c.join(s)?;
        }
        let p = CCntr::into_raw(
            fi::fid_cntr {
                fid: fid(fi::FI_CLASS_CNTR, context, &CNTR_FI_OPS),
                ops: ops(&CNTR_OPS),
            },
            c,
        );
        // SAFETY: checked for NULL, writable per fi_cntr_open(3).
        unsafe { put(cntr, p, "cntr") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CCntr::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn cntr_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_cntr_open returned.
    guarded("fi_close(cntr)", || unsafe {
        CCntr::close(f.cast(), |c| c.close())
    })
}

unsafe extern "C" fn cntr_control(f: *mut fi::fid, cmd: i32, arg: *mut c_void) -> i32 {
    guarded("fi_control(cntr)", || {
        // SAFETY: the application's counter fid.
        let c = &unsafe { CCntr::from_c(f.cast(), "cntr") }?.inner;
        match cmd as u32 {
            fi::FI_GETWAITOBJ => {
                // SAFETY: FI_GETWAITOBJ writes an enum fi_wait_obj.
                unsafe { put(arg.cast::<fi::fi_wait_obj>(), c.wait_obj().raw(), "arg") }
            }
            fi::FI_GETWAIT if c.wait_obj() == WaitObj::MutexCond => {
                let (mutex, cond) = c.wait_mutex_cond()?.as_ptrs();
                let mc = fi::fi_mutex_cond {
                    mutex: mutex.cast(),
                    cond: cond.cast(),
                };
                // SAFETY: FI_GETWAIT on a mutex/cond wait object writes a fi_mutex_cond.
                unsafe { put(arg.cast::<fi::fi_mutex_cond>(), mc, "arg") }
            }
            fi::FI_GETWAIT => {
                let fd = c.wait_fd()?.as_raw_fd();
                // SAFETY: FI_GETWAIT on an FD wait object writes an int (fi_control(3)).
                unsafe { put(arg.cast::<i32>(), fd, "arg") }
            }
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on a counter"),
            )),
        }
    })
}

/// The counter behind a handle, or the error that the handle is not one of ours.
///
/// # Safety
/// `c` is the application's counter handle.
unsafe fn counter<'a>(c: *mut fi::fid_cntr) -> Result<&'a Arc<Counter>> {
    // SAFETY: the caller's contract; the ops table is checked.
    Ok(&unsafe { CCntr::from_c(c, "cntr") }?.inner)
}

/// A read of a value (`fi_cntr_read` has no error return): 0 for a handle that is not
/// a counter of ours, with the reason in the log.
fn read_value(what: &str, f: impl FnOnce() -> Result<u64>) -> u64 {
    let mut v = 0;
    guarded(what, || {
        v = f()?;
        Ok(())
    });
    v
}

unsafe extern "C" fn cntr_read(c: *mut fi::fid_cntr) -> u64 {
    // SAFETY: the application's counter handle.
    read_value("fi_cntr_read", || Ok(unsafe { counter(c) }?.read()))
}

unsafe extern "C" fn cntr_readerr(c: *mut fi::fid_cntr) -> u64 {
    // SAFETY: the application's counter handle.
    read_value("fi_cntr_readerr", || Ok(unsafe { counter(c) }?.readerr()))
}

/// `fi_cntr_add`, `set`, `adderr`, `seterr`: `f` on the counter behind `c`.
///
/// # Safety
/// `c` is the application's counter handle.
unsafe fn update(what: &str, c: *mut fi::fid_cntr, f: impl FnOnce(&Counter)) -> i32 {
    guarded(what, || {
        // SAFETY: the caller's contract.
        f(unsafe { counter(c) }?);
        Ok(())
    })
}

unsafe extern "C" fn cntr_add(c: *mut fi::fid_cntr, v: u64) -> i32 {
    // SAFETY: the application's counter handle.
    unsafe { update("fi_cntr_add", c, |k| k.add(v)) }
}

unsafe extern "C" fn cntr_set(c: *mut fi::fid_cntr, v: u64) -> i32 {
    // SAFETY: the application's counter handle.
    unsafe { update("fi_cntr_set", c, |k| k.set(v)) }
}

unsafe extern "C" fn cntr_adderr(c: *mut fi::fid_cntr, v: u64) -> i32 {
    // SAFETY: the application's counter handle.
    unsafe { update("fi_cntr_adderr", c, |k| k.adderr(v)) }
}

unsafe extern "C" fn cntr_seterr(c: *mut fi::fid_cntr, v: u64) -> i32 {
    // SAFETY: the application's counter handle.
    unsafe { update("fi_cntr_seterr", c, |k| k.seterr(v)) }
}

unsafe extern "C" fn cntr_wait(c: *mut fi::fid_cntr, threshold: u64, timeout: i32) -> i32 {
    guarded("fi_cntr_wait", || {
        // SAFETY: the application's counter handle.
        unsafe { counter(c) }?.wait(threshold, timeout)
    })
}
