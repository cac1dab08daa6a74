//! `fid_cq` over [`CompletionQueue`]: reads go straight into the application's array in
//! the CQ's format, since our entry types are laid out as libfabric's.

use std::ffi::{c_char, c_void};
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{
    fi_ops_of, fid, guarded, guarded_len, no_bind, ops, put, strerror_out, Class, Obj,
};
use crate::core::cq::{CqContextEntry, CqDataEntry, CqEntry, CqMsgEntry, ErrData, FormatEntry};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{CqFormat, CqWaitCond, Flags, WaitObj};
use crate::verbs::{CompletionQueue, CqAttr};

pub(crate) type CCq = Obj<fi::fid_cq, Arc<CompletionQueue>>;
impl Class for CCq {
    type Header = fi::fid_cq;
    const FCLASS: u32 = fi::FI_CLASS_CQ;
    fn fi_ops() -> &'static fi::fi_ops {
        &CQ_FI_OPS
    }
}

pub(crate) static CQ_FI_OPS: fi::fi_ops = fi_ops_of!(cq_close, no_bind, cq_control);
pub(crate) static CQ_OPS: fi::fi_ops_cq = fi::fi_ops_cq {
    size: size_of::<fi::fi_ops_cq>(),
    read: Some(cq_read),
    readfrom: Some(cq_readfrom),
    readerr: Some(cq_readerr),
    sread: Some(cq_sread),
    sreadfrom: Some(cq_sreadfrom),
    signal: Some(cq_signal),
    strerror: Some(cq_strerror),
};

/// An error entry's fields into libfabric's layout; `err_data` is the caller's business.
pub(crate) fn put_err_entry(out: &mut fi::fi_cq_err_entry, e: &crate::core::cq::CqErrEntry) {
    out.op_context = e.op_context as *mut c_void;
    out.flags = e.flags;
    out.len = e.len;
    out.buf = e.buf as *mut c_void;
    out.data = e.data;
    out.tag = e.tag;
    out.olen = e.olen;
    out.err = e.err;
    out.prov_errno = e.prov_errno;
}

/// `fi_cq_open` on `domain` (whose handle `domain.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `cq` is NULL or writable.
pub(crate) unsafe fn open(
    domain: &Arc<crate::verbs::Domain>,
    attr: *mut fi::fi_cq_attr,
    cq: *mut *mut fi::fid_cq,
    context: *mut c_void,
) -> i32 {
    guarded("fi_cq_open", || {
        // SAFETY: the application's domain fid and NULL or a valid attr.
        let (d, a) = unsafe {
            (
                domain,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        crate::capi::fid::no_peer_open(a.flags, "fi_cq_open")?;
        let bad = |what: &str, v: u32| Error::new(errno::EINVAL, format!("{what} {v}"));
        let attr = CqAttr {
            size: a.size,
            flags: Flags::from_bits_retain(a.flags),
            format: CqFormat::from_raw(a.format).ok_or_else(|| bad("format", a.format))?,
            wait_obj: WaitObj::from_raw(a.wait_obj).ok_or_else(|| bad("wait_obj", a.wait_obj))?,
            signaling_vector: a.signaling_vector,
            wait_cond: CqWaitCond::from_raw(a.wait_cond)
                .ok_or_else(|| bad("wait_cond", a.wait_cond))?,
        };
        // SAFETY: NULL or the application's wait set (proven ours there).
        let set = unsafe { crate::capi::wait::named(attr.wait_obj, a.wait_set) }?;
        let q = CompletionQueue::open(d, &attr)?;
        if let Some(s) = &set {
            q.join(s)?;
        }
        let p = CCq::into_raw(
            fi::fid_cq {
                fid: fid(fi::FI_CLASS_CQ, context, &CQ_FI_OPS),
                ops: ops(&CQ_OPS),
            },
            q,
        );
        // SAFETY: checked for NULL, writable per fi_cq_open(3).
        unsafe { put(cq, p, "cq") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CCq::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn cq_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_cq_open returned.
    guarded("fi_close(cq)", || unsafe {
        CCq::close(f.cast(), |q| q.close())
    })
}

unsafe extern "C" fn cq_control(f: *mut fi::fid, cmd: i32, arg: *mut c_void) -> i32 {
    guarded("fi_control(cq)", || {
        // SAFETY: the application's CQ fid.
        let q = &unsafe { CCq::from_c(f.cast(), "cq") }?.inner;
        match (cmd as u32, q.attr().wait_obj) {
            (fi::FI_GETWAIT, WaitObj::MutexCond) => {
                let (mutex, cond) = q.wait_mutex_cond()?.as_ptrs();
                let mc = fi::fi_mutex_cond {
                    mutex: mutex.cast(),
                    cond: cond.cast(),
                };
                // SAFETY: FI_GETWAIT on a mutex/cond wait object writes a fi_mutex_cond.
                unsafe { put(arg.cast::<fi::fi_mutex_cond>(), mc, "arg") }
            }
            (fi::FI_GETWAIT, _) => {
                use std::os::fd::AsRawFd;
                let fd = q.wait_fd()?.as_raw_fd();
                // SAFETY: FI_GETWAIT on an FD wait object writes an int (fi_control(3)).
                unsafe { put(arg.cast::<i32>(), fd, "arg") }
            }
            (fi::FI_GETWAITOBJ, w) => {
                // SAFETY: FI_GETWAITOBJ writes an enum fi_wait_obj.
                unsafe { put(arg.cast::<fi::fi_wait_obj>(), w.raw(), "arg") }
            }
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on a CQ"),
            )),
        }
    })
}

/// `count` entries of type `E` at `buf`.
///
/// # Safety
/// `buf` is NULL or holds `count` writable entries of the CQ's format.
unsafe fn entries<'a, E: FormatEntry>(buf: *mut c_void, count: usize) -> Result<&'a mut [E]> {
    if count == 0 {
        return Ok(&mut []);
    }
    if buf.is_null() {
        return Err(Error::new(errno::EINVAL, "buf is NULL"));
    }
    crate::capi::fid::slice_len::<E>(count, "count")?;
    // SAFETY: the caller's contract; C arrays of these structs are suitably aligned.
    Ok(unsafe { std::slice::from_raw_parts_mut(buf.cast::<E>(), count) })
}

/// Runs `$body` with `$out` bound to the caller's array typed by the CQ's format.
macro_rules! by_format {
    ($q:expr, $buf:expr, $count:expr, |$out:ident| $body:expr) => {
        match $q.attr().format {
            CqFormat::Context => {
                // SAFETY: fi_cq_read(3): buf holds count entries of the CQ's format.
                let $out = unsafe { entries::<CqContextEntry>($buf, $count)? };
                $body
            }
            CqFormat::Msg => {
                // SAFETY: fi_cq_read(3): buf holds count entries of the CQ's format.
                let $out = unsafe { entries::<CqMsgEntry>($buf, $count)? };
                $body
            }
            CqFormat::Data => {
                // SAFETY: fi_cq_read(3): buf holds count entries of the CQ's format.
                let $out = unsafe { entries::<CqDataEntry>($buf, $count)? };
                $body
            }
            _ => {
                // SAFETY: fi_cq_read(3): buf holds count entries of the CQ's format.
                let $out = unsafe { entries::<CqEntry>($buf, $count)? };
                $body
            }
        }
    };
}

unsafe fn src_addrs<'a>(src: *mut fi::fi_addr_t, count: usize) -> Result<&'a mut [u64]> {
    if count > 0 && src.is_null() {
        return Err(Error::new(errno::EINVAL, "src_addr is NULL"));
    }
    if count == 0 {
        return Ok(&mut []);
    }
    crate::capi::fid::slice_len::<u64>(count, "count")?;
    // SAFETY: fi_cq_readfrom(3): src_addr has count slots.
    Ok(unsafe { std::slice::from_raw_parts_mut(src, count) })
}

unsafe extern "C" fn cq_read(cq: *mut fi::fid_cq, buf: *mut c_void, count: usize) -> isize {
    guarded_len("fi_cq_read", || {
        // SAFETY: the application's CQ fid.
        let q = &unsafe { CCq::from_c(cq, "cq") }?.inner;
        by_format!(q, buf, count, |out| q.read(out))
    })
}

unsafe extern "C" fn cq_readfrom(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src_addr: *mut fi::fi_addr_t,
) -> isize {
    guarded_len("fi_cq_readfrom", || {
        // SAFETY: the application's CQ fid and src_addr array.
        let (q, src) = unsafe { (&CCq::from_c(cq, "cq")?.inner, src_addrs(src_addr, count)?) };
        by_format!(q, buf, count, |out| q.readfrom(out, src))
    })
}

/// The threshold an `sread` waits for.
///
/// # Safety
/// `cond` is NULL or points at a `size_t` when the CQ waits on a threshold.
unsafe fn threshold(q: &CompletionQueue, cond: *const c_void) -> usize {
    if q.attr().wait_cond == CqWaitCond::Threshold && !cond.is_null() {
        // SAFETY: the caller's contract (fi_cq_sread(3)).
        unsafe { *cond.cast::<usize>() }
    } else {
        1
    }
}

unsafe extern "C" fn cq_sread(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    cond: *const c_void,
    timeout: i32,
) -> isize {
    guarded_len("fi_cq_sread", || {
        // SAFETY: the application's CQ fid and condition.
        let (q, t) = unsafe {
            let q = &CCq::from_c(cq, "cq")?.inner;
            (q, threshold(q, cond))
        };
        by_format!(q, buf, count, |out| q.sread(out, t, timeout))
    })
}

unsafe extern "C" fn cq_sreadfrom(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src_addr: *mut fi::fi_addr_t,
    cond: *const c_void,
    timeout: i32,
) -> isize {
    guarded_len("fi_cq_sreadfrom", || {
        // SAFETY: the application's CQ fid, src_addr array and condition.
        let (q, src, t) = unsafe {
            let q = &CCq::from_c(cq, "cq")?.inner;
            (q, src_addrs(src_addr, count)?, threshold(q, cond))
        };
        by_format!(q, buf, count, |out| q.sreadfrom(out, src, t, timeout))
    })
}

/// `fi_cq_readerr`: with `err_data_size` set, error data is copied into the caller's
/// `err_data`; without, `err_data` points at bytes the CQ keeps until the next read.
unsafe extern "C" fn cq_readerr(
    cq: *mut fi::fid_cq,
    buf: *mut fi::fi_cq_err_entry,
    flags: u64,
) -> isize {
    guarded_len("fi_cq_readerr", || {
        // SAFETY: the application's CQ fid and NULL or a valid entry.
        let (q, out) = unsafe {
            (
                &CCq::from_c(cq, "cq")?.inner,
                buf.as_mut()
                    .ok_or_else(|| Error::new(errno::EINVAL, "buf is NULL"))?,
            )
        };
        if flags != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_cq_readerr flags {flags:#x}: none are defined"),
            ));
        }
        let caller = if out.err_data_size > 0 && !out.err_data.is_null() {
            // SAFETY: fi_cq_readerr(3): err_data has err_data_size writable bytes.
            Some(unsafe {
                crate::capi::fid::bytes_mut(out.err_data, out.err_data_size, "err_data")?
            })
        } else {
            None
        };
        q.readerr_with(caller, |e, d| {
            put_err_entry(out, e);
            match d {
                ErrData::Copied(n) => out.err_data_size = n,
                ErrData::Held(b) => {
                    out.err_data = if b.is_empty() {
                        std::ptr::null_mut()
                    } else {
                        b.as_ptr().cast_mut().cast()
                    };
                    out.err_data_size = b.len();
                }
            }
        })?;
        Ok(1)
    })
}

unsafe extern "C" fn cq_signal(cq: *mut fi::fid_cq) -> i32 {
    guarded("fi_cq_signal", || {
        // SAFETY: the application's CQ fid.
        unsafe { CCq::from_c(cq, "cq") }?.inner.signal();
        Ok(())
    })
}

unsafe extern "C" fn cq_strerror(
    cq: *mut fi::fid_cq,
    prov_errno: i32,
    _err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    crate::capi::fid::guarded_ptr("fi_cq_strerror", || {
        // SAFETY: the application's CQ fid (a bad one is tolerated: the text does not
        // depend on it).
        let text = match unsafe { CCq::from_c(cq, "cq") } {
            Ok(q) => q.inner.strerror(prov_errno),
            Err(_) => rfabric_sys::verbs::wc_status_str(prov_errno.max(0) as u32),
        };
        // SAFETY: NULL or the caller's buffer of len bytes.
        Ok(unsafe { strerror_out(text, buf, len) })
    })
}
