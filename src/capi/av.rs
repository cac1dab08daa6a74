//! `fid_av` over [`AddressVector`]: datagram endpoints' peers, by `fi_addr_t`.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{
    bytes, bytes_mut, enosys, fi_ops_of, fid, guarded, guarded_ptr, no_control, ops, put, unshared,
    Class, Obj,
};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::AvType;
use crate::verbs::{AddressVector, AvAttr};

pub(crate) type CAv = Obj<fi::fid_av, Arc<AddressVector>>;
impl Class for CAv {
    type Header = fi::fid_av;
    const FCLASS: u32 = fi::FI_CLASS_AV;
    fn fi_ops() -> &'static fi::fi_ops {
        &AV_FI_OPS
    }
}
pub(crate) static AV_FI_OPS: fi::fi_ops = fi_ops_of!(av_close, av_bind, no_control);
pub(crate) static AV_OPS: fi::fi_ops_av = fi::fi_ops_av {
    size: std::mem::size_of::<fi::fi_ops_av>(),
    insert: Some(av_insert),
    insertsvc: Some(crate::capi::nosys::n6i),
    insertsym: Some(crate::capi::nosys::n8i),
    remove: Some(av_remove),
    lookup: Some(av_lookup),
    straddr: Some(av_straddr),
    av_set: Some(av_set_open),
};
/// `fi_av_open` on `domain` (whose handle `domain.rs` proved).
///
/// # Safety
/// `attr` is NULL or valid; `av` is NULL or writable.
pub(crate) unsafe fn open(
    domain: &Arc<crate::verbs::Domain>,
    attr: *mut fi::fi_av_attr,
    av: *mut *mut fi::fid_av,
    context: *mut c_void,
) -> i32 {
    guarded("fi_av_open", || {
        // SAFETY: the application's domain fid and NULL or a valid attr.
        let (d, a) = unsafe {
            (
                domain,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        crate::capi::fid::no_peer_open(a.flags, "fi_av_open")?;
        if a.flags & (fi::FI_EVENT as u64) != 0 {
            return Err(enosys("asynchronous address vectors (FI_EVENT)"));
        }
        if !a.name.is_null() {
            return Err(enosys("named (shared) address vectors"));
        }
        let av_type = AvType::from_raw(a.type_)
            .ok_or_else(|| Error::new(errno::EINVAL, format!("av type {}", a.type_)))?;
        let v = AddressVector::open(
            d,
            &AvAttr {
                av_type,
                count: a.count,
            },
        )?;
        let p = CAv::into_raw(
            fi::fid_av {
                fid: fid(fi::FI_CLASS_AV, context, &AV_FI_OPS),
                ops: ops(&AV_OPS),
            },
            v,
        );
        // SAFETY: checked for NULL, writable per fi_av_open(3).
        unsafe { put(av, p, "av") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CAv::close(p, |_| Ok(())) };
        })
    })
}
unsafe extern "C" fn av_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_av_open returned.
    guarded("fi_close(av)", || unsafe {
        CAv::close(f.cast(), |a| unshared(a, "address vector"))?;
        Ok(())
    })
}
unsafe extern "C" fn av_bind(_f: *mut fi::fid, _b: *mut fi::fid, _flags: u64) -> i32 {
    guarded("fi_av_bind", || {
        Err(enosys("binding an EQ to an AV (asynchronous inserts)"))
    })
}
/// `fi_av_insert`: `count` names of the AV's name length (its domain's endpoint type's); synchronous. Failed entries get
/// `FI_ADDR_NOTAVAIL`; the return is how many went in.
unsafe extern "C" fn av_insert(
    av: *mut fi::fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi::fi_addr_t,
    flags: u64,
    _context: *mut c_void,
) -> i32 {
    guarded_count("fi_av_insert", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if flags & !fi::FI_MORE != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("insert flags {flags:#x} are not supported"),
            ));
        }
        let name_len = a.inner.name_len();
        let n = count
            .checked_mul(name_len)
            .ok_or_else(|| Error::new(errno::EINVAL, "count overflows"))?;
        // SAFETY: `count` names of the AV's address length, per fi_av_insert(3).
        let names = unsafe { bytes(addr, n, "addr") }?;
        let mut inserted = 0;
        for (i, name) in names.chunks_exact(name_len).enumerate() {
            let r = a.inner.insert(name);
            if let Err(e) = &r {
                crate::fi_info!("av", "fi_av_insert of address {i}: {e}");
            }
            inserted += r.is_ok() as usize;
            if !fi_addr.is_null() {
                // SAFETY: fi_addr has `count` slots, per fi_av_insert(3).
                unsafe { *fi_addr.add(i) = r.unwrap_or(fi::FI_ADDR_NOTAVAIL) };
            }
        }
        Ok(inserted)
    })
}
/// As [`guarded`] for an `int` count.
fn guarded_count(what: &str, f: impl FnOnce() -> Result<usize>) -> i32 {
    let mut n = 0;
    let r = guarded(what, || {
        n = f()?;
        Ok(())
    });
    if r == 0 {
        n.min(i32::MAX as usize) as i32
    } else {
        r
    }
}
unsafe extern "C" fn av_remove(
    av: *mut fi::fid_av,
    fi_addr: *mut fi::fi_addr_t,
    count: usize,
    _flags: u64,
) -> i32 {
    guarded("fi_av_remove", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if count > 0 && fi_addr.is_null() {
            return Err(Error::new(errno::EINVAL, "fi_addr is NULL"));
        }
        let mut first_err = None;
        for i in 0..count {
            // SAFETY: `count` addresses, per fi_av_remove(3).
            let x = unsafe { *fi_addr.add(i) };
            if let Err(e) = a.inner.remove(x) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}
unsafe extern "C" fn av_lookup(
    av: *mut fi::fid_av,
    fi_addr: fi::fi_addr_t,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> i32 {
    guarded("fi_av_lookup", || {
        // SAFETY: the application's AV fid.
        let a = unsafe { CAv::from_c(av, "av") }?;
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: non-NULL; the buffer has *addrlen bytes (fi_av_lookup(3)).
        let (buf, len) = unsafe {
            let len = &mut *addrlen;
            (bytes_mut(addr, *len, "addr")?, len)
        };
        a.inner.lookup(fi_addr, buf, len)
    })
}
unsafe extern "C" fn av_straddr(
    av: *mut fi::fid_av,
    addr: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    guarded_ptr("fi_av_straddr", || {
        // SAFETY: the application's AV fid; an address of the AV's format, per
        // fi_av_straddr(3).
        let name = unsafe {
            let a = CAv::from_c(av, "av")?;
            bytes(addr, a.inner.name_len(), "addr")?
        };
        let s = AddressVector::straddr(name)?;
        // SAFETY: NULL or the application's length and buffer.
        unsafe { copy_cstr(&s, buf, len) }
    })
}
/// Writes `s` as a C string into `buf` of `*len` bytes (truncated, always terminated) and
/// sets `*len` to the size the whole string needs, as the `straddr` calls do.
///
/// # Safety
/// `len` is NULL or valid; `buf` has `*len` writable bytes.
pub(crate) unsafe fn copy_cstr(
    s: &str,
    buf: *mut c_char,
    len: *mut usize,
) -> Result<*const c_char> {
    if len.is_null() || buf.is_null() {
        return Err(Error::new(errno::EINVAL, "buf or len is NULL"));
    }
    // SAFETY: the caller's contract.
    unsafe {
        let cap = *len;
        if cap > 0 {
            let n = s.len().min(cap - 1);
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        *len = s.len() + 1;
    }
    Ok(buf)
}

/// `fi_av_set` on this object: the handle is proven here, the child opens itself.
unsafe extern "C" fn av_set_open(
    av: *mut fi::fid_av,
    attr: *mut fi::fi_av_set_attr,
    set: *mut *mut fi::fid_av_set,
    context: *mut c_void,
) -> i32 {
    // SAFETY: the application's handle (its ops are checked).
    match unsafe { CAv::from_c(av, "av") } {
        // SAFETY: forwarded as received.
        Ok(p) => unsafe { crate::capi::avset::open(&p.inner, attr, set, context) },
        Err(e) => guarded("fi_av_set", || Err(e)),
    }
}
