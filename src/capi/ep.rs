//! What the endpoint objects share (MSG and DGRAM endpoints, the verbs SRX, peers'
//! transfer endpoints): turning a C buffer, iov or `fi_msg` with its descriptors into
//! regions and offsets, endpoint options, socket addresses, and the CM slots of objects
//! that are not passive endpoints. Each endpoint type has its own ops tables in its own
//! file; nothing here matches on the type at run time.

use std::ffi::c_void;
use std::mem::size_of;

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MAX_IOV;

use crate::capi::fid::{bytes, guarded, guarded_len, put, Class, Obj};
use crate::capi::mr::mr_of;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::EpOpt;
use crate::verbs::{Iov, MemoryRegion, RmaIov};

// ---- options ---------------------------------------------------------------------------

/// The option a `fi_getopt`/`fi_setopt` names, with its `size_t` value's length checked.
pub(crate) fn endpoint_opt(level: i32, optname: i32) -> Result<EpOpt> {
    if level as u32 != fi::FI_OPT_ENDPOINT {
        return Err(Error::new(
            errno::ENOPROTOOPT,
            format!("option level {level}: rverbs has FI_OPT_ENDPOINT options only"),
        ));
    }
    EpOpt::from_raw(optname as u32).ok_or_else(|| {
        Error::new(
            errno::ENOPROTOOPT,
            format!("option {optname} is not an endpoint option"),
        )
    })
}
/// Writes a `size_t` option value.
///
/// # Safety
/// `optlen` is NULL or valid; `optval` has `*optlen` writable bytes.
pub(crate) unsafe fn put_opt(v: usize, optval: *mut c_void, optlen: *mut usize) -> Result<()> {
    if optlen.is_null() {
        return Err(Error::new(errno::EINVAL, "optlen is NULL"));
    }
    // SAFETY: the caller's contract.
    unsafe {
        if *optlen < size_of::<usize>() {
            *optlen = size_of::<usize>();
            return Err(Error::new(errno::ETOOSMALL, "the option is a size_t"));
        }
        put(optval.cast::<usize>(), v, "optval")?;
        *optlen = size_of::<usize>();
    }
    Ok(())
}
/// The `size_t` value a `fi_setopt` of an endpoint option passes.
///
/// # Safety
/// `optval` is NULL or has `optlen` readable bytes.
pub(crate) unsafe fn opt_value(optval: *const c_void, optlen: usize) -> Result<usize> {
    if optlen != size_of::<usize>() || optval.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            "endpoint options are size_t values (optlen = sizeof(size_t))",
        ));
    }
    // SAFETY: non-NULL and size_t-sized (the caller's contract).
    Ok(unsafe { optval.cast::<usize>().read_unaligned() })
}

// ---- connection management -------------------------------------------------------------

/// The bytes of a `sockaddr_in` / `sockaddr_in6` at `p`.
///
/// # Safety
/// `p` points at a sockaddr of the family it names.
pub(crate) unsafe fn sockaddr_bytes<'a>(p: *const c_void) -> Result<&'a [u8]> {
    // SAFETY: every sockaddr starts with its family.
    let family = unsafe { (*p.cast::<libc::sockaddr>()).sa_family } as i32;
    let len = match family {
        libc::AF_INET => size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => size_of::<libc::sockaddr_in6>(),
        f => {
            return Err(Error::new(
                errno::EINVAL,
                format!("address family {f}: rverbs connects to IPv4 or IPv6 addresses"),
            ))
        }
    };
    // SAFETY: the caller's contract for that family.
    unsafe { bytes(p, len, "addr") }
}
pub(crate) unsafe extern "C" fn not_passive_listen(_p: *mut fi::fid_pep) -> i32 {
    guarded("fi_listen", || {
        Err(Error::new(
            errno::EINVAL,
            "fi_listen is for passive endpoints",
        ))
    })
}
pub(crate) unsafe extern "C" fn not_passive_reject(
    _p: *mut fi::fid_pep,
    _h: fi::fid_t,
    _d: *const c_void,
    _l: usize,
) -> i32 {
    guarded("fi_reject", || {
        Err(Error::new(
            errno::EINVAL,
            "fi_reject is for passive endpoints",
        ))
    })
}
// ---- data transfer ---------------------------------------------------------------------

/// The region a descriptor names and the offset of `buf` in it (bounds are checked by the
/// endpoint when it builds the work request).
///
/// # Safety
/// `desc` is NULL or a descriptor from `fi_mr_desc`.
#[inline]
pub(crate) unsafe fn region<'a>(
    buf: *const c_void,
    desc: *mut c_void,
) -> Result<(&'a MemoryRegion, usize)> {
    // SAFETY: the caller's contract.
    let mr = unsafe { mr_of(desc) }?;
    let off = (buf as u64).checked_sub(mr.addr()).ok_or_else(|| {
        Error::new(
            errno::EINVAL,
            "buf lies before the region its descriptor names",
        )
    })?;
    Ok((mr, off as usize))
}
/// The ranges of an iov with their descriptors, on the stack.
///
/// # Safety
/// `iov` and `desc` are NULL or hold `count` elements; descriptors from `fi_mr_desc`.
#[inline]
unsafe fn with_iov<R>(
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    f: impl FnOnce(&[Iov<'_>]) -> Result<R>,
) -> Result<R> {
    if count == 0 || count > MAX_IOV || iov.is_null() || desc.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!("an iov of {count} ranges (1 to {MAX_IOV}, each with its descriptor)"),
        ));
    }
    // SAFETY: the caller's contract: count elements each.
    unsafe {
        let at = |i: usize| -> Result<Iov<'_>> {
            let v = *iov.add(i);
            let (mr, off) = region(v.iov_base, *desc.add(i))?;
            Ok((mr, off, v.iov_len))
        };
        let first = at(0)?;
        let mut v = [first; MAX_IOV];
        for (i, slot) in v.iter_mut().enumerate().take(count).skip(1) {
            *slot = at(i)?;
        }
        f(&v[..count])
    }
}
/// One data call on an endpoint `O` with a buffer and its descriptor: `f` gets the object,
/// the region and the offset; the C result is 0 or `-errno`.
///
/// # Safety
/// `ep` is the application's endpoint handle; `desc` is NULL or from `fi_mr_desc`.
#[inline]
pub(crate) unsafe fn on_buf<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    desc: *mut c_void,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &MemoryRegion, usize) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        let (o, (mr, off)) =
            unsafe { (Obj::<fi::fid_ep, T>::from_c(ep, "ep")?, region(buf, desc)?) };
        f(o, mr, off).map(|()| 0)
    })
}
/// Whether a call names no memory, which needs no descriptor even under `FI_MR_LOCAL`: a
/// NULL descriptor with nothing to describe (length 0) or, for a receive, with a NULL
/// buffer, which can hold no byte (libfabric's verbs provider posts both; fabtests'
/// `fi_shared_ctx` does so on MSG endpoints). Such a receive takes a message of no bytes;
/// a longer one completes in error.
#[inline]
fn no_memory(buf: *const c_void, len: usize, desc: *mut c_void, recv: bool) -> bool {
    desc.is_null() && (len == 0 || (recv && buf.is_null()))
}
/// As [`on_buf`], with `none(object)` for a call that names no memory ([`no_memory`]).
///
/// # Safety
/// As [`on_buf`].
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn on_buf_or_none<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    recv: bool,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &MemoryRegion, usize) -> Result<()>,
    none: impl FnOnce(&Obj<fi::fid_ep, T>) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    if !no_memory(buf, len, desc, recv) {
        // SAFETY: the caller's contract.
        return unsafe { on_buf(what, ep, buf, desc, f) };
    }
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        none(unsafe { Obj::<fi::fid_ep, T>::from_c(ep, "ep") }?).map(|()| 0)
    })
}
/// As [`on_buf`], for an iov with its descriptors.
///
/// # Safety
/// `ep` is the application's endpoint handle; `iov` and `desc` hold `count` elements.
#[inline]
pub(crate) unsafe fn on_iov<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>]) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the class is checked.
        let o = unsafe { Obj::<fi::fid_ep, T>::from_c(ep, "ep") }?;
        // SAFETY: the caller's contract.
        unsafe { with_iov(iov, desc, count, |v| f(o, v)) }.map(|()| 0)
    })
}
/// The endpoint a message call names (checked) and its message (`fi_msg`, `fi_msg_rma`).
///
/// # Safety
/// `ep` is the application's endpoint handle; `msg` is NULL or valid.
#[inline]
unsafe fn ep_and_msg<'a, T, M>(
    ep: *mut fi::fid_ep,
    msg: *const M,
) -> Result<(&'a Obj<fi::fid_ep, T>, &'a M)>
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    // SAFETY: the caller's contract; the class is checked.
    unsafe {
        Ok((
            Obj::<fi::fid_ep, T>::from_c(ep, "ep")?,
            msg.as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?,
        ))
    }
}
/// As [`on_iov`], for an `fi_msg` (its context, data and address go to `f`).
///
/// # Safety
/// `ep` is the application's endpoint handle; `msg` is NULL or a valid `fi_msg`.
#[inline]
pub(crate) unsafe fn on_msg<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>], &fi::fi_msg) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        let (o, m) = unsafe { ep_and_msg::<T, _>(ep, msg) }?;
        // SAFETY: msg_iov and desc hold iov_count elements, per fi_msg(3).
        unsafe { with_iov(m.msg_iov, m.desc, m.iov_count, |v| f(o, v, m)) }.map(|()| 0)
    })
}
/// As [`on_msg`], with `none(object, msg)` for a message that names no memory: no range,
/// or one as [`no_memory`] says.
///
/// # Safety
/// As [`on_msg`].
#[inline]
pub(crate) unsafe fn on_msg_or_none<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg,
    recv: bool,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>], &fi::fi_msg) -> Result<()>,
    none: impl FnOnce(&Obj<fi::fid_ep, T>, &fi::fi_msg) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    // SAFETY: the caller's contract: msg is NULL or valid, its iov and descriptors hold
    // iov_count elements (either may be NULL).
    let bare = unsafe {
        msg.as_ref().is_some_and(|m| match m.iov_count {
            0 => true,
            1 if !m.msg_iov.is_null() => {
                let v = *m.msg_iov;
                let d = if m.desc.is_null() {
                    std::ptr::null_mut()
                } else {
                    *m.desc
                };
                no_memory(v.iov_base, v.iov_len, d, recv)
            }
            _ => false,
        })
    };
    if !bare {
        // SAFETY: the caller's contract.
        return unsafe { on_msg(what, ep, msg, f) };
    }
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        let (o, m) = unsafe { ep_and_msg::<T, _>(ep, msg) }?;
        none(o, m).map(|()| 0)
    })
}
/// As [`on_msg`], for an `fi_msg_rma`: its one remote range (`rma_iov_limit` is 1) goes to
/// `f` with the local ranges.
///
/// # Safety
/// `ep` is the application's endpoint handle; `msg` is NULL or a valid `fi_msg_rma`.
#[inline]
pub(crate) unsafe fn on_msg_rma<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_rma,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[Iov<'_>], &RmaIov, &fi::fi_msg_rma) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract.
        let (o, m) = unsafe { ep_and_msg::<T, _>(ep, msg) }?;
        // SAFETY: the application's fi_msg_rma (fi_rma(3)).
        let rma = unsafe { msg_range(m) }?;
        // SAFETY: msg_iov and desc hold iov_count elements, per fi_rma(3).
        unsafe { with_iov(m.msg_iov, m.desc, m.iov_count, |v| f(o, v, &rma, m)) }.map(|()| 0)
    })
}
/// The one remote range of an `fi_msg_rma` (`rma_iov_limit` is 1).
///
/// # Safety
/// `m.rma_iov` holds `m.rma_iov_count` elements (fi_rma(3)).
pub(crate) unsafe fn msg_range(m: &fi::fi_msg_rma) -> Result<RmaIov> {
    if m.rma_iov_count != 1 || m.rma_iov.is_null() {
        return Err(Error::new(
            errno::EINVAL,
            format!(
                "{} remote ranges: rverbs moves one per operation (rma_iov_limit 1)",
                m.rma_iov_count
            ),
        ));
    }
    // SAFETY: one element, per the caller's contract.
    let r = unsafe { &*m.rma_iov };
    Ok(RmaIov {
        addr: r.addr,
        len: r.len,
        key: r.key,
    })
}
/// `fi_inject` / `fi_injectdata`: `len` bytes at `buf`, copied before the call returns.
///
/// # Safety
/// `ep` is the application's endpoint handle; `buf` has `len` readable bytes.
#[inline]
pub(crate) unsafe fn on_inject<T>(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    f: impl FnOnce(&Obj<fi::fid_ep, T>, &[u8]) -> Result<()>,
) -> isize
where
    Obj<fi::fid_ep, T>: Class<Header = fi::fid_ep>,
{
    guarded_len(what, || {
        // SAFETY: the caller's contract; the handle is checked.
        let (e, data) = unsafe {
            (
                Obj::<fi::fid_ep, T>::from_c(ep, "ep")?,
                bytes(buf, len, "buf")?,
            )
        };
        f(e, data).map(|()| 0)
    })
}
