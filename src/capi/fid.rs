//! What every C object shares: a libfabric header (`struct fid_*`, starting with `struct fid`)
//! followed by the Rust object it stands for, the checks that turn a C handle back into
//! that object, and the wrappers that keep errors and panics on our side of the boundary.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use rfabric_sys::fabric as fi;

use crate::core::error::{errno, Error, Result};

/// A C object: the libfabric header the application sees, then our state. `repr(C)` puts
/// the header at offset 0, so a `*mut H` handed out is also a `*mut Obj<H, T>`.
#[repr(C)]
pub(crate) struct Obj<H, T> {
    pub(crate) hdr: H,
    pub(crate) inner: T,
}

/// A Rust object with a C face: its `fid` class tells handles apart.
pub(crate) trait Class: Sized {
    type Header;
    const FCLASS: u32;
    /// For classes with two kinds of object (the verbs SRX and the software one): whether
    /// this fid, already of class `FCLASS`, is of this kind (told apart by its ops).
    fn owns(_f: &fi::fid) -> bool {
        true
    }
}

impl<H, T> Obj<H, T>
where
    Obj<H, T>: Class<Header = H>,
{
    /// Boxes the object and returns its C handle; `fid(&mut hdr)` must fill the header's
    /// `struct fid` (class, context, ops).
    pub(crate) fn into_raw(hdr: H, inner: T) -> *mut H {
        Box::into_raw(Box::new(Obj { hdr, inner })).cast::<H>()
    }

    /// As [`Self::into_raw`], for objects that report their own C handle (as the `fid` of
    /// their events): `make` gets the handle's address before the object exists. On
    /// failure nothing is left allocated.
    pub(crate) fn try_into_raw_with(hdr: H, make: impl FnOnce(u64) -> Result<T>) -> Result<*mut H> {
        let mut b = Box::<Self>::new_uninit();
        let at = b.as_mut_ptr();
        let inner = make(at as u64)?;
        b.write(Obj { hdr, inner });
        // SAFETY: fully written just above.
        Ok(Box::into_raw(unsafe { b.assume_init() }).cast::<H>())
    }

    /// The object behind a C handle, after checking it is one of ours of this class.
    ///
    /// # Safety
    /// `p` is NULL or points at a live `struct fid` (what libfabric's API requires).
    pub(crate) unsafe fn from_c<'a>(p: *const H, what: &str) -> Result<&'a Self> {
        // SAFETY: every header starts with `struct fid`; the caller's contract.
        unsafe { check_class(p.cast::<fi::fid>(), Self::FCLASS, what)? };
        // SAFETY: non-NULL (checked) and a live fid (the caller's contract).
        if !Self::owns(unsafe { &*p.cast::<fi::fid>() }) {
            return Err(Error::new(
                errno::EINVAL,
                format!("{what} is not an rverbs object of the kind expected"),
            ));
        }
        // SAFETY: the class (and kind) matched, so `into_raw` made this fid for this type.
        Ok(unsafe { &*p.cast::<Self>() })
    }

    /// Takes the object back from C (`fi_close`), after `busy` had its say.
    ///
    /// # Safety
    /// `p` came from `into_raw` of this type and is not used by C again.
    pub(crate) unsafe fn close(p: *mut H, busy: impl FnOnce(&T) -> Result<()>) -> Result<()> {
        // SAFETY: as `from_c`.
        let o = unsafe { Self::from_c(p, "fid")? };
        busy(&o.inner)?;
        // SAFETY: made by Box::into_raw in into_raw; C gives it up with fi_close.
        drop(unsafe { Box::from_raw(p.cast::<Self>()) });
        Ok(())
    }
}

/// Checks that `p` is non-NULL and of class `fclass`.
///
/// # Safety
/// `p` is NULL or points at a live `struct fid`.
pub(crate) unsafe fn check_class(p: *const fi::fid, fclass: u32, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::new(errno::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract.
    let class = unsafe { (*p).fclass };
    if class != fclass as usize {
        return Err(Error::new(
            errno::EINVAL,
            format!("{what} is a fid of class {class}, not {fclass}: not an rverbs object of the kind expected"),
        ));
    }
    Ok(())
}

/// The `struct fid` of a new object.
pub(crate) fn fid(fclass: u32, context: *mut c_void, ops: &'static fi::fi_ops) -> fi::fid {
    fi::fid {
        fclass: fclass as usize,
        context,
        ops: std::ptr::from_ref(ops).cast_mut(),
    }
}

/// A static ops table as the `*mut` libfabric's headers declare; nobody writes through it.
pub(crate) fn ops<T>(t: &'static T) -> *mut T {
    std::ptr::from_ref(t).cast_mut()
}

fn report(what: &str, e: &Error) {
    if e.errno() == errno::EAGAIN || e.errno() == errno::EAVAIL {
        crate::fi_debug!("capi", "{what}: {e}");
    } else {
        crate::fi_info!("capi", "{what}: {e}");
    }
}

fn panicked(what: &str) {
    crate::fi_warn!(
        "capi",
        "{what}: internal error (panic caught at the C boundary)"
    );
}

/// Runs `f`, turning an error into `-errno` and a panic into `-FI_EOTHER`.
pub(crate) fn guarded(what: &str, f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            report(what, &e);
            -e.errno()
        }
        Err(_) => {
            panicked(what);
            -errno::EOTHER
        }
    }
}

/// As [`guarded`], for calls that return a count or `-errno` as `ssize_t`.
pub(crate) fn guarded_len(what: &str, f: impl FnOnce() -> Result<usize>) -> isize {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(n)) => n as isize,
        Ok(Err(e)) => {
            report(what, &e);
            -(e.errno() as isize)
        }
        Err(_) => {
            panicked(what);
            -(errno::EOTHER as isize)
        }
    }
}

/// As [`guarded`], for calls that return a pointer (NULL on failure).
pub(crate) fn guarded_ptr<T>(what: &str, f: impl FnOnce() -> Result<*const T>) -> *const T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            report(what, &e);
            std::ptr::null()
        }
        Err(_) => {
            panicked(what);
            std::ptr::null()
        }
    }
}

/// rverbs is the owner of fi_peer(3)'s shared objects, never their peer: an `FI_PEER` open
/// of one of its own objects is refused with `-FI_EINVAL`, as fi_peer(3) asks of providers
/// that do not support it.
pub(crate) fn no_peer_open(flags: u64, what: &str) -> Result<()> {
    if flags & fi::FI_PEER != 0 {
        return Err(Error::new(
            errno::EINVAL,
            format!("{what} with FI_PEER: rverbs owns peer objects and imports peers, it does not open its own objects as another provider's peer"),
        ));
    }
    Ok(())
}

/// The error of a call rverbs does not implement yet (listed in the README).
pub(crate) fn enosys(what: &str) -> Error {
    Error::new(
        errno::ENOSYS,
        format!("{what} is not implemented by rverbs (see the README's list)"),
    )
}

/// Writes `v` through an out-pointer the application passed.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(Error::new(errno::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, and the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

/// A C string argument (NULL: none).
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(s: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(Some)
        .map_err(|_| Error::new(errno::EINVAL, format!("{what} is not UTF-8")))
}

/// `len` bytes at `p` (NULL is allowed when `len` is 0).
///
/// # Safety
/// `p` is NULL or valid for reads of `len` bytes for `'a`.
pub(crate) unsafe fn bytes<'a>(p: *const c_void, len: usize, what: &str) -> Result<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("{what} is NULL but its length is {len}"),
        ));
    }
    // SAFETY: non-NULL, and the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// `len` writable bytes at `p`.
///
/// # Safety
/// `p` is NULL or valid for writes of `len` bytes for `'a`, aliased by nothing in Rust.
pub(crate) unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize, what: &str) -> Result<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("{what} is NULL but its length is {len}"),
        ));
    }
    // SAFETY: non-NULL, and the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// `fi_ops.close` of a class with nothing else to do than dropping.
macro_rules! fi_ops_of {
    ($close:expr, $bind:expr, $control:expr) => {
        fi::fi_ops {
            size: std::mem::size_of::<fi::fi_ops>(),
            close: Some($close),
            bind: Some($bind),
            control: Some($control),
            ops_open: Some($crate::capi::fid::no_ops_open),
            tostr: None,
            ops_set: None,
        }
    };
}
pub(crate) use fi_ops_of;

/// `fi_open_ops`: rverbs has no extension interfaces.
pub(crate) unsafe extern "C" fn no_ops_open(
    _fid: *mut fi::fid,
    name: *const c_char,
    _flags: u64,
    _ops: *mut *mut c_void,
    _context: *mut c_void,
) -> i32 {
    guarded("fi_open_ops", || {
        // SAFETY: libfabric passes NULL or a string.
        let name = unsafe { c_str(name, "name") }?.unwrap_or("");
        Err(Error::new(
            errno::ENOSYS,
            format!("rverbs has no extension interface {name:?}"),
        ))
    })
}

/// `fi_ops.bind` of a class nothing binds to.
pub(crate) unsafe extern "C" fn no_bind(_fid: *mut fi::fid, _bfid: *mut fi::fid, _f: u64) -> i32 {
    guarded("fi_bind", || {
        Err(Error::new(
            errno::EINVAL,
            "nothing binds to this object in rverbs",
        ))
    })
}

/// `fi_ops.control` of a class without controls.
pub(crate) unsafe extern "C" fn no_control(_fid: *mut fi::fid, cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control", || {
        Err(Error::new(
            errno::ENOSYS,
            format!("fi_control command {cmd} is not supported on this object"),
        ))
    })
}

thread_local! {
    /// The text a `strerror` call returned without a caller buffer, valid until this
    /// thread's next such call (libfabric's providers return static strings; ours vary).
    static STRERROR: std::cell::RefCell<std::ffi::CString> = std::cell::RefCell::default();
}

/// Answers a `fi_cq_strerror` / `fi_eq_strerror`: `text` copied into `buf` (`len` bytes,
/// truncated and terminated) when given, else a thread-local copy.
///
/// # Safety
/// `buf` is NULL or has `len` writable bytes.
pub(crate) unsafe fn strerror_out(text: &str, buf: *mut c_char, len: usize) -> *const c_char {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller's contract; n < len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        return buf;
    }
    let c = std::ffi::CString::new(text.replace('\0', " ")).unwrap_or_default();
    STRERROR.with(|s| {
        *s.borrow_mut() = c;
        s.borrow().as_ptr()
    })
}

/// The C objects that events name (endpoints, passive endpoints, multicast joins), so an
/// event read after its object was closed is not followed to freed memory.
static LIVE: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn live_insert(p: *const c_void) {
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(p as usize);
}

pub(crate) fn live_remove(p: *const c_void) {
    let mut l = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = l.iter().position(|&x| x == p as usize) {
        l.swap_remove(i);
    }
}

/// Runs `f` on the fid at `p` if it is still open, holding it open meanwhile (closing
/// removes an object from the live list under the same lock before freeing it).
pub(crate) fn with_live<R>(p: u64, f: impl FnOnce(*mut fi::fid) -> R) -> Option<R> {
    let l = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    if p == 0 || !l.contains(&(p as usize)) {
        return None;
    }
    Some(f(p as *mut fi::fid))
}

/// The `context` of the live fid at `p` (NULL when it was closed).
pub(crate) fn live_context(p: u64) -> *mut c_void {
    // SAFETY: with_live hands over an open object, which starts with `struct fid`.
    with_live(p, |f| unsafe { (*f).context }).unwrap_or(std::ptr::null_mut())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_become_negative_errnos_and_panics_eother() {
        assert_eq!(guarded("t", || Ok(())), 0);
        assert_eq!(
            guarded("t", || Err(Error::new(errno::EINVAL, "bad"))),
            -errno::EINVAL
        );
        assert_eq!(guarded("t", || panic!("boom")), -errno::EOTHER);
        assert_eq!(guarded_len("t", || Ok(7)), 7);
        assert_eq!(
            guarded_len("t", || panic!("boom")),
            -(errno::EOTHER as isize)
        );
        assert!(guarded_ptr::<u8>("t", || panic!("boom")).is_null());
    }

    #[test]
    fn strerror_text_is_truncated_into_a_buffer_or_kept_per_thread() {
        let mut buf = [1 as c_char; 5];
        // SAFETY: buf has 5 bytes.
        let p = unsafe { strerror_out("flushed", buf.as_mut_ptr(), buf.len()) };
        assert_eq!(p, buf.as_ptr());
        // SAFETY: NUL-terminated by strerror_out.
        assert_eq!(unsafe { CStr::from_ptr(p) }.to_str().unwrap(), "flus");
        // SAFETY: no buffer: the thread-local copy.
        let q = unsafe { strerror_out("local", std::ptr::null_mut(), 0) };
        // SAFETY: valid until this thread's next call.
        assert_eq!(unsafe { CStr::from_ptr(q) }.to_str().unwrap(), "local");
    }

    #[test]
    fn closed_objects_are_not_followed() {
        let mut f = fi::fid {
            fclass: fi::FI_CLASS_EP as usize,
            context: 0x1234 as *mut c_void,
            ops: std::ptr::null_mut(),
        };
        let p = (&raw mut f).cast::<c_void>();
        assert!(live_context(p as u64).is_null());
        live_insert(p);
        assert_eq!(live_context(p as u64), 0x1234 as *mut c_void);
        live_remove(p);
        assert!(live_context(p as u64).is_null());
        assert!(live_context(0).is_null());
    }
}
