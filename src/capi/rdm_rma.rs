//! `fi_rma(3)` on `FI_EP_RDM` endpoints over [`RdmEndpoint`]'s writes and reads. The
//! application's buffers need no descriptor (RDM's `mr_mode` has no `FI_MR_LOCAL`); one
//! given names the registration the device uses (proven ours first), and without one the
//! endpoint copies small transfers and registers larger ones for the operation.

use std::ffi::c_void;
use std::mem::size_of;

use rfabric_sys::fabric as fi;
use rfabric_sys::mem::ForeignBuf;
use rfabric_sys::verbs::MAX_IOV;

use crate::capi::ep::{msg_range, region};
use crate::capi::fid::{bytes, guarded_len};
use crate::capi::rdm_ep::{rdm, recv_buf, send_buf};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::{MemoryRegion, RecvBuf, RmaIov};

pub(crate) static RDM_EP_RMA: fi::fi_ops_rma = fi::fi_ops_rma {
    size: size_of::<fi::fi_ops_rma>(),
    read: Some(rdm_read),
    readv: Some(rdm_readv),
    readmsg: Some(rdm_readmsg),
    write: Some(rdm_write),
    writev: Some(rdm_writev),
    writemsg: Some(rdm_writemsg),
    inject: Some(rdm_inject_write),
    writedata: Some(rdm_writedata),
    injectdata: Some(rdm_inject_writedata),
};

/// A write's source: the application's buffer, and the region its descriptor names.
type WriteBuf<'a> = (ForeignBuf, Option<(&'a MemoryRegion, usize)>);

/// The region `desc` names and `buf`'s offset in it, or `None` for a NULL descriptor.
///
/// # Safety
/// `desc` is NULL or a descriptor from `fi_mr_desc`.
unsafe fn described<'a>(
    buf: *const c_void,
    desc: *mut c_void,
) -> Result<Option<(&'a MemoryRegion, usize)>> {
    if desc.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    unsafe { region(buf, desc) }.map(Some)
}

/// # Safety
/// `buf` has `len` readable bytes, unchanged until the write completes; `desc` as
/// [`described`].
unsafe fn write_buf<'a>(buf: *const c_void, len: usize, desc: *mut c_void) -> Result<WriteBuf<'a>> {
    // SAFETY: the caller's contract.
    unsafe { Ok((send_buf(buf, len)?, described(buf, desc)?)) }
}

/// # Safety
/// `buf` has `len` writable bytes until the read completes; `desc` as [`described`].
pub(crate) unsafe fn read_buf(buf: *mut c_void, len: usize, desc: *mut c_void) -> Result<RecvBuf> {
    // SAFETY: the caller's contract.
    match unsafe { described(buf, desc) }? {
        Some((mr, off)) => RecvBuf::region(mr, off, len),
        // SAFETY: the caller's contract.
        None => unsafe { recv_buf(buf, len) },
    }
}

/// Reads `count` elements of an iov and their descriptors (`desc` NULL: none) with `at`.
///
/// # Safety
/// `iov` holds `count` elements; `desc` is NULL or holds `count` descriptors.
unsafe fn iov_each<T>(
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    out: &mut [T],
    mut at: impl FnMut(libc::iovec, *mut c_void) -> Result<T>,
) -> Result<()> {
    if count > MAX_IOV || (count > 0 && iov.is_null()) {
        return Err(Error::new(
            errno::EINVAL,
            format!("an iov of {count} ranges (0 to {MAX_IOV})"),
        ));
    }
    for (i, o) in out.iter_mut().enumerate().take(count) {
        // SAFETY: the caller's contract: count elements each.
        let (v, d) = unsafe {
            (
                *iov.add(i),
                if desc.is_null() {
                    std::ptr::null_mut()
                } else {
                    *desc.add(i)
                },
            )
        };
        *o = at(v, d)?;
    }
    Ok(())
}

/// A write from an iov and its descriptors.
///
/// # Safety
/// As [`iov_each`], each range readable and unchanged until the write completes.
#[allow(clippy::too_many_arguments)]
unsafe fn write_iov(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    rma: &RmaIov,
    data: Option<u64>,
    context: u64,
    flags: Option<Flags>,
) -> Result<()> {
    let mut v: [WriteBuf<'_>; MAX_IOV] = [(ForeignBuf::EMPTY, None); MAX_IOV];
    // SAFETY: the caller's contract.
    unsafe {
        iov_each(iov, desc, count, &mut v, |e, d| {
            write_buf(e.iov_base, e.iov_len, d)
        })?;
        let ep = rdm(ep)?;
        let flags = flags.unwrap_or_else(|| ep.tx_op_flags());
        ep.write_foreign(&v[..count], dest, rma, data, context, flags)
    }
}

/// A read into an iov and its descriptors.
///
/// # Safety
/// As [`iov_each`], each range writable until the read completes.
#[allow(clippy::too_many_arguments)]
unsafe fn read_iov(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    rma: &RmaIov,
    context: u64,
    flags: Option<Flags>,
) -> Result<()> {
    let mut v: [RecvBuf; MAX_IOV] = std::array::from_fn(|_| RecvBuf::Foreign(ForeignBuf::EMPTY));
    // SAFETY: the caller's contract.
    unsafe {
        iov_each(iov, desc, count, &mut v, |e, d| {
            read_buf(e.iov_base, e.iov_len, d)
        })?;
        let ep = rdm(ep)?;
        let flags = flags.unwrap_or_else(|| ep.tx_op_flags());
        ep.readmsg(&v[..count], src, rma, context, flags)
    }
}

/// The total length of `count` iov elements (`iov` checked by the caller's use of it).
///
/// # Safety
/// `iov` is NULL or holds `count` elements.
unsafe fn iov_len(iov: *const libc::iovec, count: usize) -> usize {
    if iov.is_null() || count > MAX_IOV {
        return 0;
    }
    // SAFETY: the caller's contract.
    (0..count).map(|i| unsafe { (*iov.add(i)).iov_len }).sum()
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_read(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_read", || {
        // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
        unsafe { rdm(ep)?.read(read_buf(buf, len, desc)?, src, addr, key, context as u64) }
            .map(|()| 0)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_readv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_readv", || {
        // SAFETY: the application's handle, iov and descriptors (fi_rma(3)).
        unsafe {
            let rma = RmaIov {
                addr,
                len: iov_len(iov, count),
                key,
            };
            read_iov(ep, iov, desc, count, src, &rma, context as u64, None)
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn rdm_readmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_rma,
    flags: u64,
) -> isize {
    guarded_len("fi_readmsg", || {
        // SAFETY: the application's handle and message (fi_rma(3)).
        unsafe {
            let m = msg
                .as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?;
            let rma = msg_range(m)?;
            let fl = Some(Flags::from_bits_retain(flags));
            let ctx = m.context as u64;
            read_iov(ep, m.msg_iov, m.desc, m.iov_count, m.addr, &rma, ctx, fl)
        }
        .map(|()| 0)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_write(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_write", || {
        let rma = RmaIov { addr, len, key };
        // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
        unsafe {
            let ep = rdm(ep)?;
            let b = [write_buf(buf, len, desc)?];
            ep.write_foreign(&b, dest, &rma, None, context as u64, ep.tx_op_flags())
        }
        .map(|()| 0)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_writev(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_writev", || {
        // SAFETY: the application's handle, iov and descriptors (fi_rma(3)).
        unsafe {
            let rma = RmaIov {
                addr,
                len: iov_len(iov, count),
                key,
            };
            write_iov(ep, iov, desc, count, dest, &rma, None, context as u64, None)
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn rdm_writemsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_rma,
    flags: u64,
) -> isize {
    guarded_len("fi_writemsg", || {
        // SAFETY: the application's handle and message (fi_rma(3)).
        unsafe {
            let m = msg
                .as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?;
            let rma = msg_range(m)?;
            let fl = Flags::from_bits_retain(flags);
            let data = fl.contains(Flags::REMOTE_CQ_DATA).then_some(m.data);
            let ctx = m.context as u64;
            write_iov(
                ep,
                m.msg_iov,
                m.desc,
                m.iov_count,
                m.addr,
                &rma,
                data,
                ctx,
                Some(fl),
            )
        }
        .map(|()| 0)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_writedata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_writedata", || {
        let rma = RmaIov { addr, len, key };
        // SAFETY: the application's handle, buffer and descriptor (fi_rma(3)).
        unsafe {
            let ep = rdm(ep)?;
            let b = [write_buf(buf, len, desc)?];
            let flags = ep.tx_op_flags() | Flags::REMOTE_CQ_DATA;
            ep.write_foreign(&b, dest, &rma, Some(data), context as u64, flags)
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn rdm_inject_write(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    guarded_len("fi_inject_write", || {
        // SAFETY: the application's handle and buffer (fi_rma(3)).
        unsafe { rdm(ep)?.inject_write(bytes(buf, len, "buf")?, dest, addr, key) }.map(|()| 0)
    })
}

unsafe extern "C" fn rdm_inject_writedata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    guarded_len("fi_inject_writedata", || {
        // SAFETY: the application's handle and buffer (fi_rma(3)).
        unsafe { rdm(ep)?.inject_writedata(bytes(buf, len, "buf")?, data, dest, addr, key) }
            .map(|()| 0)
    })
}
