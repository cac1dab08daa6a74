//! What every C object shares: a libfabric header (`struct fid_*`, starting with `struct fid`)
//! followed by the Rust object it stands for, the checks that turn a C handle back into
//! that object, and the wrappers that keep errors and panics on our side of the boundary.

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;

use crate::core::error::{errno, Error, Result};
use crate::core::log::Level;

/// A C object: the libfabric header the application sees, then our state. `repr(C)` puts
/// the header at offset 0, so a `*mut H` handed out is also a `*mut Obj<H, T>`.
///
/// Closing drops the state but keeps the memory for a while as a tombstone whose ops table
/// is [`CLOSED_FI_OPS`] (see [`retire`]): a handle used after `fi_close`, or closed twice,
/// meets that table and gets `-FI_EINVAL`, and no new object can take its address meanwhile.
#[repr(C)]
pub(crate) struct Obj<H, T> {
    pub(crate) hdr: H,
    pub(crate) inner: T,
    /// What peers were handed that names this object (fi_peer(3) contexts, `fid_peer_av`s):
    /// kept until it closes, as fi_peer(3) has owner objects outlive their peers.
    peers: Mutex<Vec<Box<dyn Send>>>,
}

/// A Rust object with a C face.
pub(crate) trait Class: Sized + Retire {
    type Header;
    const FCLASS: u32;
    /// The `fi_ops` table that only objects of this type carry: what proves a handle ours
    /// (DESIGN.md decision 10), where the class is only what a handle claims to be.
    fn fi_ops() -> &'static fi::fi_ops;
}

impl<H, T> Obj<H, T>
where
    Obj<H, T>: Class<Header = H>,
{
    /// Boxes the object and returns its C handle; the header's `struct fid` must carry
    /// [`Class::fi_ops`].
    pub(crate) fn into_raw(hdr: H, inner: T) -> *mut H {
        Box::into_raw(Box::new(Obj {
            hdr,
            inner,
            peers: Mutex::default(),
        }))
        .cast::<H>()
    }

    /// As [`Self::into_raw`], for objects that report their own C handle (as the `fid` of
    /// their events): `make` gets the handle's address before the object exists. On
    /// failure nothing is left allocated.
    pub(crate) fn try_into_raw_with(hdr: H, make: impl FnOnce(u64) -> Result<T>) -> Result<*mut H> {
        let mut b = Box::<Self>::new_uninit();
        let at = b.as_mut_ptr();
        let inner = make(at as u64)?;
        b.write(Obj {
            hdr,
            inner,
            peers: Mutex::default(),
        });
        // SAFETY: fully written just above.
        Ok(Box::into_raw(unsafe { b.assume_init() }).cast::<H>())
    }

    /// The object behind a C handle, once its ops table proves it one of ours of this
    /// type: NULL, closed, foreign (another provider's object of the same class) and
    /// wrong-class handles are `-FI_EINVAL`.
    ///
    /// # Safety
    /// `p` is NULL or points at a readable `struct fid` (what libfabric's API requires; a
    /// closed handle of ours stays readable as a tombstone).
    #[inline]
    pub(crate) unsafe fn from_c<'a>(p: *const H, what: &str) -> Result<&'a Self> {
        // SAFETY: the caller's contract.
        if let Some(o) = unsafe { Self::proven(p) } {
            return Ok(o);
        }
        let f = p.cast::<fi::fid>();
        // SAFETY: the caller's contract.
        let ops = unsafe { ops_of(f, what)? };
        // SAFETY: as above.
        Err(unsafe { not_ours(f, ops, Self::FCLASS, what) })
    }

    /// [`Self::from_c`]'s proof alone, for data calls: `None` for any handle it does not
    /// prove an open object of this type (`from_c` then says why). No error is built, so
    /// a caller that inlines it carries a load and two compares.
    ///
    /// # Safety
    /// As [`Self::from_c`].
    #[inline(always)]
    pub(crate) unsafe fn proven<'a>(p: *const H) -> Option<&'a Self> {
        let f = p.cast::<fi::fid>();
        if f.is_null() {
            return None;
        }
        // SAFETY: the caller's contract; not NULL.
        let ops = unsafe { load_ops(f) };
        // SAFETY: as above (the class too, for a header rewritten by the application).
        if !std::ptr::eq(ops, Self::fi_ops()) || unsafe { (*f).fclass } != Self::FCLASS as usize {
            return None;
        }
        // SAFETY: only `into_raw` of this type puts this ops table in a header, and a
        // closed object no longer carries it.
        Some(unsafe { &*p.cast::<Self>() })
    }

    /// Keeps `b` (something handed to a peer that names this object) until it closes.
    pub(crate) fn keep_for_peer(&self, b: Box<dyn Send>) {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).push(b);
    }

    /// Takes the object back from C (`fi_close`), after `busy` had its say: its state is
    /// dropped and the handle becomes a tombstone ([`retire`]). A second close, or one
    /// racing this one, is `-FI_EINVAL`.
    ///
    /// # Safety
    /// `p` is NULL or a readable `struct fid`; no call on this object runs meanwhile.
    pub(crate) unsafe fn close(p: *mut H, busy: impl FnOnce(&T) -> Result<()>) -> Result<()> {
        // SAFETY: as `from_c`.
        let o = unsafe { Self::from_c(p, "fid")? };
        busy(&o.inner)?;
        // SAFETY: ours (checked) and not used by the caller again.
        unsafe { retire::<Self>(p.cast(), Self::fi_ops()) }
    }
}

/// The ops table of every closed handle of ours: each call is `-FI_EINVAL`.
pub(crate) static CLOSED_FI_OPS: fi::fi_ops = fi_ops_of!(closed_close, closed_bind, closed_control);

fn closed_error(what: &str) -> Error {
    Error::new(
        errno::EINVAL,
        format!(
            "{what} on a handle that was already closed (use after fi_close, or a double close)"
        ),
    )
}

unsafe extern "C" fn closed_close(_f: *mut fi::fid) -> i32 {
    guarded("fi_close", || Err(closed_error("fi_close")))
}
unsafe extern "C" fn closed_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_bind", || Err(closed_error("fi_bind")))
}
unsafe extern "C" fn closed_control(_f: *mut fi::fid, _cmd: i32, _arg: *mut c_void) -> i32 {
    guarded("fi_control", || Err(closed_error("fi_control")))
}

/// The ops table of the `struct fid` at `f`, read atomically (a close may swap it).
///
/// # Safety
/// `f` is NULL or a readable `struct fid`.
#[inline]
pub(crate) unsafe fn ops_of(f: *const fi::fid, what: &str) -> Result<*const fi::fi_ops> {
    if f.is_null() {
        return Err(Error::new(errno::EINVAL, format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract; not NULL.
    Ok(unsafe { load_ops(f) })
}

/// The ops table in `f`'s header.
///
/// # Safety
/// `f` is a readable `struct fid`.
#[inline(always)]
unsafe fn load_ops(f: *const fi::fid) -> *const fi::fi_ops {
    // SAFETY: readable (the caller's contract) and pointer-aligned as a `struct fid`; our
    // own writes of this field are atomic (retire).
    let ops = unsafe { AtomicPtr::from_ptr((&raw const (*f).ops).cast_mut()) };
    ops.load(Ordering::Acquire).cast_const()
}

/// Why the fid at `f`, carrying `ops`, is not an open object of class `fclass` of ours.
///
/// # Safety
/// `f` is a readable `struct fid`.
#[cold]
pub(crate) unsafe fn not_ours(
    f: *const fi::fid,
    ops: *const fi::fi_ops,
    fclass: u32,
    what: &str,
) -> Error {
    if std::ptr::eq(ops, &CLOSED_FI_OPS) {
        return closed_error(what);
    }
    // SAFETY: the caller's contract.
    let class = unsafe { (*f).fclass };
    if class != fclass as usize {
        Error::new(
            errno::EINVAL,
            format!("{what} is a fid of class {class}, not {fclass}: not an rverbs object of the kind expected"),
        )
    } else {
        Error::new(
            errno::EINVAL,
            format!("{what} has the class expected ({fclass}) but not rverbs' ops: another provider's object, or not a handle"),
        )
    }
}

/// How many closed handles stay tombstones before their memory is reused: a stale handle
/// is recognised through the next `QUARANTINE` closes of the process.
pub(crate) const QUARANTINE: usize = 16384;

type Tombstone = (usize, unsafe fn(usize));

/// Closed handles, oldest first, with how to free each.
static TOMBSTONES: Mutex<VecDeque<Tombstone>> = Mutex::new(VecDeque::new());

/// Closes the object of type `O` at `p` that carries `live`: swaps its ops to
/// [`CLOSED_FI_OPS`] (only one of racing closers wins), drops its state and what it kept
/// for peers, and keeps its memory as a tombstone for the next [`QUARANTINE`] closes.
///
/// # Safety
/// `p` is a readable `struct fid`; if it carries `live`, it was made by `O`'s `into_raw`.
pub(crate) unsafe fn retire<O: Retire>(p: *mut fi::fid, live: &'static fi::fi_ops) -> Result<()> {
    // SAFETY: a readable fid (the caller's contract), written atomically by us.
    let ops = unsafe { AtomicPtr::from_ptr(&raw mut (*p).ops) };
    ops.compare_exchange(
        std::ptr::from_ref(live).cast_mut(),
        std::ptr::from_ref(&CLOSED_FI_OPS).cast_mut(),
        Ordering::AcqRel,
        Ordering::Acquire,
    )
    .map_err(|_| closed_error("fi_close"))?;
    // SAFETY: this call won the swap, so it alone drops the state, once.
    unsafe { O::drop_state(p.cast()) };
    let evicted = {
        let mut t = TOMBSTONES.lock().unwrap_or_else(|e| e.into_inner());
        t.push_back((p as usize, O::free as unsafe fn(usize)));
        if t.len() > QUARANTINE {
            t.pop_front()
        } else {
            None
        }
    };
    if let Some((old, free)) = evicted {
        // SAFETY: a tombstone of `free`'s type, evicted once.
        unsafe { free(old) };
    }
    Ok(())
}

/// A handle rverbs made for a peer and keeps itself (`fid_peer_srx`, `fid_peer_cq`,
/// `fid_peer_av`): closed ([`retire`]d) when dropped, so a peer that uses it later meets a
/// tombstone, not freed memory.
pub(crate) struct Owned<O: Class>(std::ptr::NonNull<O::Header>);

// SAFETY: an owner of the object, as a Box would be; the object is Send/Sync itself.
unsafe impl<O: Class + Send> Send for Owned<O> {}
// SAFETY: as above.
unsafe impl<O: Class + Sync> Sync for Owned<O> {}

impl<H, T> Owned<Obj<H, T>>
where
    Obj<H, T>: Class<Header = H>,
{
    pub(crate) fn new(hdr: H, inner: T) -> Self {
        // SAFETY: Box::into_raw is never NULL.
        Owned(unsafe { std::ptr::NonNull::new_unchecked(Obj::into_raw(hdr, inner)) })
    }

    /// The C handle, for the peer.
    pub(crate) fn raw(&self) -> *mut H {
        self.0.as_ptr()
    }
}

impl<H, T> std::ops::Deref for Owned<Obj<H, T>>
where
    Obj<H, T>: Class<Header = H>,
{
    type Target = Obj<H, T>;
    fn deref(&self) -> &Self::Target {
        // SAFETY: open while owned (only Drop retires it).
        unsafe { &*self.0.as_ptr().cast() }
    }
}

impl<O: Class> Drop for Owned<O> {
    fn drop(&mut self) {
        // SAFETY: made by Obj::into_raw of `O`, retired only here.
        let _ = unsafe { retire::<O>(self.0.as_ptr().cast(), O::fi_ops()) };
    }
}

/// The two halves of freeing an [`Obj`]: its state at close, its memory at eviction.
pub(crate) trait Retire {
    /// # Safety
    /// Once, at close, with nothing using the state.
    unsafe fn drop_state(p: *mut u8);
    /// # Safety
    /// Once, after `drop_state`.
    unsafe fn free(p: usize);
}

impl<H, T> Retire for Obj<H, T> {
    unsafe fn drop_state(p: *mut u8) {
        let o = p.cast::<Self>();
        // SAFETY: the caller's contract: dropped once, and nothing uses the state.
        unsafe {
            std::ptr::drop_in_place(&raw mut (*o).inner);
            std::ptr::drop_in_place(&raw mut (*o).peers);
        }
    }
    unsafe fn free(p: usize) {
        // SAFETY: made by Box::into_raw of this type (so with this layout); its fields
        // were dropped by drop_state, so only the memory is left.
        unsafe { std::alloc::dealloc(p as *mut u8, std::alloc::Layout::new::<Self>()) };
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
    unsafe { crate::capi::info::from_c(info) }
}
/// What `fi_open_ops` on a domain opens: the extension interface, which `capi::ext`
/// installs at `fi_prov_ini` (so the provider face does not import the part that calls
/// other providers).
pub(crate) type OpsOpen =
    unsafe extern "C" fn(*mut fi::fid, *const c_char, u64, *mut *mut c_void, *mut c_void) -> i32;
pub(crate) static DOMAIN_EXTENSION: std::sync::OnceLock<OpsOpen> = std::sync::OnceLock::new();

/// `fi_open_ops` of a domain: the installed extension interface, else none.
pub(crate) unsafe extern "C" fn domain_ops_open(
    fid: *mut fi::fid,
    name: *const c_char,
    flags: u64,
    ops: *mut *mut c_void,
    context: *mut c_void,
) -> i32 {
    match DOMAIN_EXTENSION.get() {
        // SAFETY: forwarded as received.
        Some(f) => unsafe { f(fid, name, flags, ops, context) },
        // SAFETY: as above.
        None => unsafe { no_ops_open(fid, name, flags, ops, context) },
    }
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

/// Logs a call's error: "try again" (an empty CQ read, polled in a loop) at debug, the rest
/// at info. The level test is inline, so a silent empty read costs no call.
#[inline(always)]
fn report(what: &str, e: &Error) {
    let level = if e.errno() == errno::EAGAIN || e.errno() == errno::EAVAIL {
        Level::Debug
    } else {
        Level::Info
    };
    if crate::core::log::enabled(level) {
        report_at(level, what, e);
    }
}

#[cold]
#[inline(never)]
fn report_at(level: Level, what: &str, e: &Error) {
    crate::fi_log!(level, "capi", "{what}: {e}");
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

/// Checks that `count` items of `T` from C can be one slice (at most `isize::MAX` bytes, as
/// Rust requires; a larger length is a caller's mistake, `-FI_EINVAL`).
pub(crate) fn slice_len<T>(count: usize, what: &str) -> Result<()> {
    match count.checked_mul(std::mem::size_of::<T>()) {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Error::new(
            errno::EINVAL,
            format!("{what}: a length of {count} is more than any buffer can hold"),
        )),
    }
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
    slice_len::<u8>(len, what)?;
    // SAFETY: non-NULL, at most isize::MAX bytes, and the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// The most bytes of caller data rverbs copies in one call (event data, a peer's error
/// data): a length past it is a caller's mistake, `-FI_EINVAL`.
pub(crate) const MAX_COPY: usize = 1 << 30;

/// A copy of the `len` bytes at `p`, with the allocation tried before any byte is read: a
/// length past [`MAX_COPY`] is `-FI_EINVAL`, one no allocation can hold `-FI_ENOMEM`, never
/// an abort.
///
/// # Safety
/// `p` is NULL or valid for reads of `len` bytes.
pub(crate) unsafe fn copy_in(p: *const c_void, len: usize, what: &str) -> Result<Vec<u8>> {
    if len > MAX_COPY {
        return Err(Error::new(
            errno::EINVAL,
            format!("{what}: {len} bytes is more than rverbs copies ({MAX_COPY})"),
        ));
    }
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::new(
            errno::ENOMEM,
            format!("{what}: {len} bytes cannot be allocated"),
        )
    })?;
    // SAFETY: the caller's contract.
    v.extend_from_slice(unsafe { bytes(p, len, what) }?);
    Ok(v)
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
    slice_len::<u8>(len, what)?;
    // SAFETY: non-NULL, at most isize::MAX bytes, and the caller's contract.
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

/// The `context` of the object of ours at `p` that an event names, NULL once it is closed.
/// Provider events only name endpoints, passive endpoints and joins, and an EQ forgets an
/// object's events when it closes; a late one meets a tombstone ([`retire`]).
pub(crate) fn open_context(p: u64) -> *mut c_void {
    let f = p as *const fi::fid;
    // SAFETY: `p` is NULL or a handle of ours, open or a tombstone, so readable.
    match unsafe { ops_of(f, "fid") } {
        // SAFETY: as above.
        Ok(o) if !std::ptr::eq(o, &CLOSED_FI_OPS) => unsafe { (*f).context },
        _ => std::ptr::null_mut(),
    }
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

    struct Thing(#[allow(dead_code)] std::sync::Arc<()>);
    type CThing = Obj<fi::fid, Thing>;
    static THING_FI_OPS: fi::fi_ops = fi_ops_of!(no_close, no_bind, no_control);
    unsafe extern "C" fn no_close(_f: *mut fi::fid) -> i32 {
        0
    }
    impl Class for CThing {
        type Header = fi::fid;
        const FCLASS: u32 = fi::FI_CLASS_CQ;
        fn fi_ops() -> &'static fi::fi_ops {
            &THING_FI_OPS
        }
    }

    #[test]
    fn handles_are_proven_by_their_ops_and_closed_ones_stay_tombstones() {
        let alive = std::sync::Arc::new(());
        let p = CThing::into_raw(
            fid(fi::FI_CLASS_CQ, 0x1234 as *mut c_void, &THING_FI_OPS),
            Thing(alive.clone()),
        );
        // SAFETY: a handle just made.
        unsafe {
            assert!(CThing::from_c(p, "thing").is_ok());
            assert_eq!(open_context(p as u64), 0x1234 as *mut c_void);
            // Same class, another table: a foreign object. Plain data with the class: not ours.
            static FOREIGN_FI_OPS: fi::fi_ops = fi_ops_of!(no_close, no_bind, no_control);
            let foreign = fid(fi::FI_CLASS_CQ, std::ptr::null_mut(), &FOREIGN_FI_OPS);
            let e = CThing::from_c(&raw const foreign, "cq").err().unwrap();
            assert!(e.to_string().contains("another provider's"), "{e}");
            let wrong = fid(fi::FI_CLASS_EQ, std::ptr::null_mut(), &FOREIGN_FI_OPS);
            let e = CThing::from_c(&raw const wrong, "cq").err().unwrap();
            assert!(e.to_string().contains("of the kind expected"), "{e}");
            let data = [fi::FI_CLASS_CQ as usize, 0, 0];
            let e = CThing::from_c(data.as_ptr().cast(), "desc").err().unwrap();
            assert_eq!(e.errno(), errno::EINVAL);
            assert!(e.to_string().contains("not rverbs' ops"), "{e}");
            assert_eq!(
                CThing::from_c(std::ptr::null(), "x").err().unwrap().errno(),
                errno::EINVAL
            );
            CThing::close(p, |_| Ok(())).unwrap();
            // The state is gone at close; the memory stays, so a stale handle is told so.
            assert_eq!(std::sync::Arc::strong_count(&alive), 1);
            let e = CThing::close(p, |_| Ok(())).unwrap_err();
            assert_eq!(e.errno(), errno::EINVAL);
            assert!(e.to_string().contains("already closed"), "{e}");
            assert!(CThing::from_c(p, "x").is_err());
            assert!(open_context(p as u64).is_null());
            // SAFETY: the tombstone's fid_ops is CLOSED_FI_OPS: its close says so too.
            let close = (*(*p).ops).close.unwrap();
            assert_eq!(close(p), -errno::EINVAL);
        }
        assert!(open_context(0).is_null());
    }

    #[test]
    fn racing_closes_drop_the_state_once() {
        for _ in 0..200 {
            let alive = std::sync::Arc::new(());
            let p = CThing::into_raw(
                fid(fi::FI_CLASS_CQ, std::ptr::null_mut(), &THING_FI_OPS),
                Thing(alive.clone()),
            ) as usize;
            let ok: usize = std::thread::scope(|s| {
                let h: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(move || {
                            // SAFETY: a handle of ours, open or a tombstone.
                            unsafe { CThing::close(p as *mut fi::fid, |_| Ok(())) }.is_ok()
                        })
                    })
                    .collect();
                h.into_iter().map(|h| usize::from(h.join().unwrap())).sum()
            });
            assert_eq!(ok, 1);
            assert_eq!(std::sync::Arc::strong_count(&alive), 1);
        }
    }
}
