//! `fid_eq` over [`EventQueue`], and the connection request a `FI_CONNREQ` event carries in
//! `fi_info.handle` (a `fid` of class `FI_CLASS_CONNREQ`).

use std::ffi::{c_char, c_void};
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;

use crate::capi::fid::unshared;
use crate::capi::fid::{
    bytes_mut, enosys, fi_ops_of, fid, guarded, guarded_len, no_bind, open_context, ops, put,
    strerror_out, Class, Obj,
};
use crate::capi::info::to_c;
use crate::core::eq::{EqErrEntry, EqEvent};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::WaitObj;
use crate::core::info::Handle;
use crate::verbs::{EqAttr, EventQueue};

pub(crate) struct EqState {
    pub eq: Arc<EventQueue>,
    /// Error data handed out by the last `fi_eq_readerr` without a caller buffer.
    err_data: Mutex<Vec<u8>>,
    wait_obj: WaitObj,
    /// The `fi_info` made for a connection request read with `FI_PEEK`: later peeks and
    /// the read that takes the event hand out the same one, which the application frees
    /// once (as libfabric's EQs do), instead of a new one per peek.
    peeked: Mutex<Peeked>,
}

/// A peeked request's C info, by the identity of its request.
#[derive(Default)]
struct Peeked(Option<(usize, *mut fi::fi_info)>);
// SAFETY: the info is plain C memory only this EQ refers to until it is handed out.
unsafe impl Send for Peeked {}

impl Drop for Peeked {
    fn drop(&mut self) {
        if let Some((_, p)) = self.0.take() {
            // SAFETY: made by to_c, never handed out by a consuming read.
            unsafe { free_connreq_info(p) };
        }
    }
}

/// Frees a connection request's C info and its handle.
///
/// # Safety
/// `p` came from `to_c` with a handle made here, and is not used again.
unsafe fn free_connreq_info(p: *mut fi::fi_info) {
    // SAFETY: the caller's contract.
    unsafe {
        let req = (*p).handle;
        (*p).handle = std::ptr::null_mut();
        if !req.is_null() {
            let _ = CConnReq::close(req, |_| Ok(()));
        }
        fi::fi_freeinfo(p);
    }
}

pub(crate) type CEq = Obj<fi::fid_eq, EqState>;
impl Class for CEq {
    type Header = fi::fid_eq;
    const FCLASS: u32 = fi::FI_CLASS_EQ;
    fn fi_ops() -> &'static fi::fi_ops {
        &EQ_FI_OPS
    }
}

/// The `fi_info.handle` of a connection request: accepted by opening an endpoint on the
/// info (which takes it over) or refused with `fi_reject`.
pub(crate) type CConnReq = Obj<fi::fid, Handle>;
impl Class for CConnReq {
    type Header = fi::fid;
    const FCLASS: u32 = fi::FI_CLASS_CONNREQ;
    fn fi_ops() -> &'static fi::fi_ops {
        &CONNREQ_FI_OPS
    }
}

pub(crate) static EQ_FI_OPS: fi::fi_ops = fi_ops_of!(eq_close, no_bind, eq_control);
pub(crate) static EQ_OPS: fi::fi_ops_eq = fi::fi_ops_eq {
    size: size_of::<fi::fi_ops_eq>(),
    read: Some(eq_read),
    readerr: Some(eq_readerr),
    write: Some(eq_write),
    sread: Some(eq_sread),
    strerror: Some(eq_strerror),
};
pub(crate) static CONNREQ_FI_OPS: fi::fi_ops =
    fi_ops_of!(connreq_close, no_bind, crate::capi::fid::no_control);

/// `fi_eq_open` on `fabric` (whose handle `fabric.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `eq` is NULL or writable.
pub(crate) unsafe fn open(
    fabric: &Arc<crate::verbs::Fabric>,
    attr: *mut fi::fi_eq_attr,
    eq: *mut *mut fi::fid_eq,
    context: *mut c_void,
) -> i32 {
    guarded("fi_eq_open", || {
        // SAFETY: the application's fabric fid and NULL or a valid attr.
        let (f, a) = unsafe {
            (
                fabric,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        crate::capi::fid::no_peer_open(a.flags, "fi_eq_open")?;
        if a.flags & fi::FI_WRITE != 0 {
            return Err(enosys("fi_eq_write (FI_WRITE at fi_eq_open)"));
        }
        let wait_obj = WaitObj::from_raw(a.wait_obj)
            .ok_or_else(|| Error::new(errno::EINVAL, format!("wait_obj {}", a.wait_obj)))?;
        // SAFETY: NULL or the application's wait set (proven ours there).
        let set = unsafe { crate::capi::wait::named(wait_obj, a.wait_set) }?;
        let q = EventQueue::open(
            f,
            &EqAttr {
                size: a.size,
                wait_obj,
            },
        )?;
        if let Some(s) = &set {
            q.join(s)?;
        }
        let p = CEq::into_raw(
            fi::fid_eq {
                fid: fid(fi::FI_CLASS_EQ, context, &EQ_FI_OPS),
                ops: ops(&EQ_OPS),
            },
            EqState {
                eq: q,
                err_data: Mutex::default(),
                wait_obj,
                peeked: Mutex::default(),
            },
        );
        // SAFETY: checked for NULL, writable per fi_eq_open(3).
        unsafe { put(eq, p, "eq") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CEq::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn eq_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_eq_open returned.
    guarded("fi_close(eq)", || unsafe {
        CEq::close(f.cast(), |s| unshared(&s.eq, "event queue"))?;
        Ok(())
    })
}

unsafe extern "C" fn eq_control(f: *mut fi::fid, cmd: i32, arg: *mut c_void) -> i32 {
    guarded("fi_control(eq)", || {
        // SAFETY: the application's EQ fid.
        let q = unsafe { CEq::from_c(f.cast(), "eq") }?;
        match cmd as u32 {
            fi::FI_GETWAIT => {
                if matches!(q.inner.wait_obj, WaitObj::None) {
                    return Err(Error::new(
                        errno::EINVAL,
                        "this EQ was opened with FI_WAIT_NONE: it has no wait object",
                    ));
                }
                // SAFETY: FI_GETWAIT on an FD wait object writes an int (fi_control(3)).
                unsafe { put(arg.cast::<i32>(), q.inner.eq.fd(), "arg") }
            }
            fi::FI_GETWAITOBJ => {
                let w = match q.inner.wait_obj {
                    WaitObj::None => fi::FI_WAIT_NONE,
                    WaitObj::Set => fi::FI_WAIT_SET,
                    _ => fi::FI_WAIT_FD,
                };
                // SAFETY: FI_GETWAITOBJ writes an enum fi_wait_obj.
                unsafe { put(arg.cast::<fi::fi_wait_obj>(), w, "arg") }
            }
            _ => Err(Error::new(
                errno::ENOSYS,
                format!("fi_control command {cmd} is not supported on an EQ"),
            )),
        }
    })
}

/// The C info of a connection request, with its handle.
fn new_connreq_info(
    info: &crate::core::info::Info,
    handle: Arc<dyn std::any::Any + Send + Sync>,
) -> Result<*mut fi::fi_info> {
    let req = CConnReq::into_raw(
        crate::capi::fid::fid(fi::FI_CLASS_CONNREQ, std::ptr::null_mut(), &CONNREQ_FI_OPS),
        handle,
    );
    let p = to_c(info).inspect_err(|_| {
        // SAFETY: just made, never handed out.
        let _ = unsafe { CConnReq::close(req, |_| Ok(())) };
    })?;
    // SAFETY: to_c returned a valid fi_info.
    unsafe { (*p).handle = req };
    Ok(p)
}

/// Writes `ev` into the caller's buffer; the bytes written, or `ETOOSMALL` (the event then
/// stays queued).
///
/// # Safety
/// `event` is valid for a write; `buf` has `len` writable bytes.
unsafe fn write_event(
    ev: &EqEvent,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    consume: bool,
    peeked: &Mutex<Peeked>,
) -> Result<usize> {
    let cm = size_of::<fi::fi_eq_cm_entry>();
    let (fid, data): (u64, &[u8]) = match ev {
        EqEvent::ConnReq { fid, data, .. } => (*fid, data),
        EqEvent::Connected { fid, data } => (*fid, data),
        EqEvent::Shutdown { fid } => (*fid, &[]),
        EqEvent::Written { event: code, data } => {
            // SAFETY: the caller's contract.
            let out = unsafe { bytes_mut(buf, len, "buf") }?;
            if out.len() < data.len() {
                return Err(too_small(data.len(), len));
            }
            out[..data.len()].copy_from_slice(data);
            // SAFETY: the caller's contract.
            unsafe { event.write(*code) };
            return Ok(data.len());
        }
        EqEvent::JoinComplete { fid } => {
            let need = size_of::<fi::fi_eq_entry>();
            // SAFETY: the caller's contract.
            let out = unsafe { bytes_mut(buf, len, "buf") }?;
            if out.len() < need {
                return Err(too_small(need, len));
            }
            crate::capi::mc::join_completed(*fid);
            let e = fi::fi_eq_entry {
                fid: *fid as fi::fid_t,
                context: open_context(*fid),
                data: 0,
            };
            // SAFETY: out holds at least one fi_eq_entry; unaligned to be safe.
            unsafe {
                out.as_mut_ptr()
                    .cast::<fi::fi_eq_entry>()
                    .write_unaligned(e)
            };
            // SAFETY: the caller's contract.
            unsafe { event.write(ev.code()) };
            return Ok(need);
        }
    };
    let need = cm + data.len();
    // SAFETY: the caller's contract.
    let out = unsafe { bytes_mut(buf, len, "buf") }?;
    if out.len() < need {
        return Err(too_small(need, len));
    }
    let info = match ev {
        EqEvent::ConnReq { info, .. } => {
            let handle = info.handle.clone().ok_or_else(|| {
                Error::new(errno::EOTHER, "a connection request without its handle")
            })?;
            let key = Arc::as_ptr(&handle).cast::<()>() as usize;
            let mut pk = peeked.lock().unwrap_or_else(|e| e.into_inner());
            let p = match pk.0.take() {
                Some((k, p)) if k == key => p,
                stale => {
                    if let Some((_, p)) = stale {
                        // Its event is gone (its passive endpoint closed) unread.
                        // SAFETY: made below for that event, never handed out for good.
                        unsafe { free_connreq_info(p) };
                    }
                    new_connreq_info(info, handle)?
                }
            };
            if !consume {
                pk.0 = Some((key, p));
            }
            p
        }
        _ => std::ptr::null_mut(),
    };

    // SAFETY: out holds the header (fid, info) and data.len() bytes behind it.
    unsafe {
        let h = out.as_mut_ptr();
        h.cast::<fi::fid_t>().write_unaligned(fid as fi::fid_t);
        h.add(size_of::<fi::fid_t>())
            .cast::<*mut fi::fi_info>()
            .write_unaligned(info);
        std::ptr::copy_nonoverlapping(data.as_ptr(), h.add(cm), data.len());
        event.write(ev.code());
    }
    Ok(need)
}

fn too_small(need: usize, len: usize) -> Error {
    Error::new(
        errno::ETOOSMALL,
        format!("the event needs {need} bytes, the buffer has {len}"),
    )
}

fn consume(flags: u64) -> Result<bool> {
    if flags & !fi::FI_PEEK != 0 {
        return Err(Error::new(
            errno::EBADFLAGS,
            format!("EQ read flags {flags:#x}: only FI_PEEK"),
        ));
    }
    Ok(flags & fi::FI_PEEK == 0)
}

unsafe extern "C" fn eq_read(
    eq: *mut fi::fid_eq,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    flags: u64,
) -> isize {
    guarded_len("fi_eq_read", || {
        // SAFETY: the application's EQ fid.
        let q = unsafe { CEq::from_c(eq, "eq") }?;
        if event.is_null() {
            return Err(Error::new(errno::EINVAL, "event is NULL"));
        }
        let consume = consume(flags)?;
        // SAFETY: event checked; buf has len bytes (fi_eq_read(3)).
        q.inner.eq.read_with(consume, |ev| unsafe {
            write_event(ev, event, buf, len, consume, &q.inner.peeked)
        })
    })
}

unsafe extern "C" fn eq_sread(
    eq: *mut fi::fid_eq,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    timeout: i32,
    flags: u64,
) -> isize {
    guarded_len("fi_eq_sread", || {
        // SAFETY: the application's EQ fid.
        let q = unsafe { CEq::from_c(eq, "eq") }?;
        if event.is_null() {
            return Err(Error::new(errno::EINVAL, "event is NULL"));
        }
        if q.inner.wait_obj == WaitObj::None {
            return Err(Error::new(
                errno::EINVAL,
                "fi_eq_sread on an EQ opened with FI_WAIT_NONE",
            ));
        }
        let consume = consume(flags)?;
        q.inner.eq.sread_with(timeout, |e| {
            // SAFETY: event checked; buf has len bytes (fi_eq_sread(3)).
            e.read_with(consume, |ev| unsafe {
                write_event(ev, event, buf, len, consume, &q.inner.peeked)
            })
        })
    })
}

/// Fills an `fi_eq_err_entry` the way `fi_eq(3)` describes for API 1.5 and later: error
/// data is copied into the caller's `err_data` when it gives a size, else it points at
/// bytes kept until the next `fi_eq_readerr`.
///
/// # Safety
/// `out` is a valid entry whose `err_data` has `err_data_size` writable bytes when set.
unsafe fn write_err(e: &EqErrEntry, out: &mut fi::fi_eq_err_entry, keep: &Mutex<Vec<u8>>) {
    out.fid = e.fid as fi::fid_t;
    out.context = open_context(e.fid);
    out.data = e.data;
    out.err = e.err;
    out.prov_errno = e.prov_errno;
    if out.err_data_size > 0 && !out.err_data.is_null() {
        let n = e.err_data.len().min(out.err_data_size);
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(e.err_data.as_ptr(), out.err_data.cast(), n) };
        out.err_data_size = n;
    } else {
        let mut k = keep.lock().unwrap_or_else(|p| p.into_inner());
        k.clear();
        k.extend_from_slice(&e.err_data);
        out.err_data = if k.is_empty() {
            std::ptr::null_mut()
        } else {
            k.as_mut_ptr().cast()
        };
        out.err_data_size = k.len();
    }
}

unsafe extern "C" fn eq_readerr(
    eq: *mut fi::fid_eq,
    buf: *mut fi::fi_eq_err_entry,
    flags: u64,
) -> isize {
    guarded_len("fi_eq_readerr", || {
        // SAFETY: the application's EQ fid and NULL or a valid entry.
        let (q, out) = unsafe {
            (
                CEq::from_c(eq, "eq")?,
                buf.as_mut()
                    .ok_or_else(|| Error::new(errno::EINVAL, "buf is NULL"))?,
            )
        };
        let consume = consume(flags)?;
        q.inner.eq.readerr_with(consume, |e| {
            // SAFETY: out is the caller's entry, as fi_eq_readerr(3) describes it.
            unsafe { write_err(e, out, &q.inner.err_data) };
            Ok(size_of::<fi::fi_eq_err_entry>())
        })
    })
}

/// `fi_eq_write`: an event, its bytes kept as written and read back unchanged. A peer
/// provider sharing the EQ (fi_peer(3)) writes here too.
unsafe extern "C" fn eq_write(
    eq: *mut fi::fid_eq,
    event: u32,
    buf: *const c_void,
    len: usize,
    flags: u64,
) -> isize {
    guarded_len("fi_eq_write", || {
        // SAFETY: the caller's EQ and buffer of len bytes (fi_eq(3)).
        let (q, data) = unsafe {
            (
                &CEq::from_c(eq, "eq")?.inner.eq,
                crate::capi::fid::copy_in(buf, len, "buf")?,
            )
        };
        // 1.17 defines no fi_eq_write flags (its headers have no FI_ERROR).
        if flags != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_eq_write flags {flags:#x}: libfabric 1.17 defines none"),
            ));
        }
        q.write(EqEvent::Written { event, data })?;
        Ok(len)
    })
}

/// The text of an EQ error's `prov_errno`: a negative errno from rdma_cm, or a consumer or
/// IB reject reason.
pub(crate) fn cm_strerror(prov_errno: i32) -> String {
    if prov_errno < 0 {
        std::io::Error::from_raw_os_error(-prov_errno).to_string()
    } else if prov_errno == 28 {
        "rejected by the peer (consumer reject)".to_string()
    } else {
        format!("rdma_cm status {prov_errno}")
    }
}

unsafe extern "C" fn eq_strerror(
    _eq: *mut fi::fid_eq,
    prov_errno: i32,
    _err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    crate::capi::fid::guarded_ptr("fi_eq_strerror", || {
        // SAFETY: NULL or the caller's buffer of len bytes.
        Ok(unsafe { strerror_out(&cm_strerror(prov_errno), buf, len) })
    })
}

unsafe extern "C" fn connreq_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the handle an FI_CONNREQ event carried.
    guarded("fi_close(connreq)", || unsafe {
        CConnReq::close(f, |_| Ok(()))
    })
}

/// Takes the request out of an info's `handle` (for `fi_endpoint` or `fi_reject`): the
/// handle's own memory stays until it is closed or its endpoint is.
///
/// # Safety
/// `h` is NULL or a `fid` from an `fi_info.handle`.
pub(crate) unsafe fn connreq_of(h: *mut fi::fid) -> Result<Handle> {
    // SAFETY: the caller's contract; the class is checked.
    Ok(unsafe { CConnReq::from_c(h, "handle") }?.inner.clone())
}
