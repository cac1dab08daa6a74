//! `fid_poll` over [`PollSet`] (`fi_poll(3)`): the CQs and counters added are proven ours
//! before the set holds them, and `fi_poll` hands back the contexts they were opened with.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::cntr::CCntr;
use crate::capi::cq::CCq;
use crate::capi::fid::{fi_ops_of, fid, guarded, guarded_len, no_bind, no_control, ops, put};
use crate::capi::fid::{Class, Obj};
use crate::core::error::{errno, Error, Result};
use crate::verbs::{Domain, PollSet, Pollable};

pub(crate) type CPoll = Obj<fi::fid_poll, Arc<PollSet>>;
impl Class for CPoll {
    type Header = fi::fid_poll;
    const FCLASS: u32 = fi::FI_CLASS_POLL;
    fn fi_ops() -> &'static fi::fi_ops {
        &POLL_FI_OPS
    }
}

pub(crate) static POLL_FI_OPS: fi::fi_ops = fi_ops_of!(poll_close, no_bind, no_control);
pub(crate) static POLL_OPS: fi::fi_ops_poll = fi::fi_ops_poll {
    size: size_of::<fi::fi_ops_poll>(),
    poll: Some(poll_run),
    poll_add: Some(poll_add),
    poll_del: Some(poll_del),
};

/// `fi_poll_open` on `domain` (whose handle `domain.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `pollset` is NULL or writable.
pub(crate) unsafe fn open(
    domain: &Arc<Domain>,
    attr: *mut fi::fi_poll_attr,
    pollset: *mut *mut fi::fid_poll,
) -> i32 {
    guarded("fi_poll_open", || {
        // SAFETY: NULL or a valid attr, per fi_poll_open(3).
        if let Some(a) = unsafe { attr.as_ref() } {
            if a.flags != 0 {
                return Err(Error::new(
                    errno::EINVAL,
                    format!("poll set flags {:#x}: none are defined", a.flags),
                ));
            }
        }
        let p = CPoll::into_raw(
            fi::fid_poll {
                // fi_poll_open takes no context: the set's own is NULL.
                fid: fid(fi::FI_CLASS_POLL, std::ptr::null_mut(), &POLL_FI_OPS),
                ops: ops(&POLL_OPS),
            },
            PollSet::open(domain),
        );
        // SAFETY: checked for NULL, writable per fi_poll_open(3).
        unsafe { put(pollset, p, "pollset") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CPoll::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn poll_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_poll_open returned.
    guarded("fi_close(pollset)", || unsafe {
        CPoll::close(f.cast(), |s| {
            s.close();
            Ok(())
        })
    })
}

/// The CQ or counter behind `f`, with the context it was opened with.
///
/// # Safety
/// `f` is NULL or a readable `struct fid`.
unsafe fn member(f: *mut fi::fid) -> Result<(Pollable, u64)> {
    if f.is_null() {
        return Err(Error::new(errno::EINVAL, "event_fid is NULL"));
    }
    // SAFETY: non-NULL and readable (the caller's contract); the class is only a claim,
    // which `from_c` proves.
    let (class, context) = unsafe { ((*f).fclass as u32, (*f).context as u64) };
    let what = match class {
        fi::FI_CLASS_CQ => {
            // SAFETY: as above.
            let q = unsafe { CCq::from_c(f.cast(), "event_fid") }?;
            Pollable::Cq(q.inner.clone())
        }
        fi::FI_CLASS_CNTR => {
            // SAFETY: as above.
            let c = unsafe { CCntr::from_c(f.cast(), "event_fid") }?;
            Pollable::Cntr(c.inner.clone())
        }
        c => {
            return Err(Error::new(
                errno::EINVAL,
                format!("a poll set holds CQs and counters, not fids of class {c}"),
            ))
        }
    };
    Ok((what, context))
}

/// `fi_poll_add` and `fi_poll_del`: `f` on the set and the member `event_fid` names.
///
/// # Safety
/// `p` and `event_fid` are NULL or readable `struct fid`s.
unsafe fn on_member(
    what: &str,
    p: *mut fi::fid_poll,
    event_fid: *mut fi::fid,
    flags: u64,
    f: impl FnOnce(&PollSet, Pollable, u64) -> Result<()>,
) -> i32 {
    guarded(what, || {
        // SAFETY: the application's poll set handle (its ops are checked).
        let s = &unsafe { CPoll::from_c(p, "pollset") }?.inner;
        if flags != 0 {
            return Err(Error::new(
                errno::EINVAL,
                format!("{what} flags {flags:#x}: none are defined"),
            ));
        }
        // SAFETY: the application's fid.
        let (m, context) = unsafe { member(event_fid) }?;
        f(s, m, context)
    })
}

unsafe extern "C" fn poll_add(p: *mut fi::fid_poll, event_fid: *mut fi::fid, flags: u64) -> i32 {
    // SAFETY: forwarded as received.
    unsafe { on_member("fi_poll_add", p, event_fid, flags, |s, m, c| s.add(m, c)) }
}

unsafe extern "C" fn poll_del(p: *mut fi::fid_poll, event_fid: *mut fi::fid, flags: u64) -> i32 {
    // SAFETY: forwarded as received.
    unsafe {
        on_member("fi_poll_del", p, event_fid, flags, |s, m, _| {
            s.del(&m);
            Ok(())
        })
    }
}

unsafe extern "C" fn poll_run(p: *mut fi::fid_poll, context: *mut *mut c_void, count: i32) -> i32 {
    let n = guarded_len("fi_poll", || {
        // SAFETY: the application's poll set handle (its ops are checked).
        let s = &unsafe { CPoll::from_c(p, "pollset") }?.inner;
        if count <= 0 {
            return Err(Error::new(
                errno::EINVAL,
                format!("fi_poll count {count}: room for one context at least"),
            ));
        }
        if context.is_null() {
            return Err(Error::new(errno::EINVAL, "context is NULL"));
        }
        // SAFETY: fi_poll(3): `context` has `count` slots, and `poll_with` passes i < count.
        s.poll_with(count as usize, |i, c| unsafe {
            *context.add(i) = c as *mut c_void;
        })
    });
    n as i32
}
