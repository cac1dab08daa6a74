//! `fi_atomic(3)` on `FI_EP_RDM` endpoints over [`RdmEndpoint::atomicmsg`]: the device's
//! atomics on one 8-byte word per call (`core::atomic` says which). Operands are read
//! during the call (the operation carries them), results land in a send buffer and are
//! copied to the application's at completion, so no buffer needs a descriptor; one given
//! for the result names the registration it is copied into (proven ours first).

use std::ffi::c_void;
use std::mem::size_of;

use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::MAX_IOV;

use crate::capi::ep::region;
use crate::capi::fid::{bytes, guarded, guarded_len};
use crate::capi::rdm_ep::rdm;
use crate::capi::rdm_rma::read_buf;
use crate::core::atomic::{self, AtomicKind, AtomicOp, Datatype};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::AtomicCall;
use crate::verbs::{RecvBuf, RmaIov};

pub(crate) static RDM_EP_ATOMIC: fi::fi_ops_atomic = fi::fi_ops_atomic {
    size: size_of::<fi::fi_ops_atomic>(),
    write: Some(rdm_atomic),
    writev: Some(rdm_atomicv),
    writemsg: Some(rdm_atomicmsg),
    inject: Some(rdm_inject_atomic),
    readwrite: Some(rdm_fetch_atomic),
    readwritev: Some(rdm_fetch_atomicv),
    readwritemsg: Some(rdm_fetch_atomicmsg),
    compwrite: Some(rdm_compare_atomic),
    compwritev: Some(rdm_compare_atomicv),
    compwritemsg: Some(rdm_compare_atomicmsg),
    writevalid: Some(rdm_atomicvalid),
    readwritevalid: Some(rdm_fetch_atomicvalid),
    compwritevalid: Some(rdm_compare_atomicvalid),
};

/// One buffer of a call: its first element's address, the elements it names, and the
/// descriptor of that element's range.
#[derive(Clone, Copy)]
struct Elements {
    addr: *mut c_void,
    count: usize,
    desc: *mut c_void,
}

impl Elements {
    const NONE: Elements = Elements {
        addr: std::ptr::null_mut(),
        count: 0,
        desc: std::ptr::null_mut(),
    };

    fn one(addr: *const c_void, count: usize, desc: *mut c_void) -> Elements {
        Elements {
            addr: addr.cast_mut(),
            count,
            desc,
        }
    }

    /// An `fi_ioc` array of `n` entries and their descriptors (`desc` NULL: none): the
    /// first entry with elements, and the count of all.
    ///
    /// # Safety
    /// `iov` holds `n` entries; `desc` is NULL or holds `n` descriptors.
    unsafe fn ioc(iov: *const fi::fi_ioc, desc: *mut *mut c_void, n: usize) -> Result<Elements> {
        if n > MAX_IOV || (n > 0 && iov.is_null()) {
            return Err(Error::new(
                errno::EINVAL,
                format!("an ioc array of {n} entries (0 to {MAX_IOV})"),
            ));
        }
        let mut e = Elements::NONE;
        for i in 0..n {
            // SAFETY: the caller's contract: n entries each.
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
            if e.count == 0 && v.count > 0 {
                (e.addr, e.desc) = (v.addr, d);
            }
            e.count = e.count.saturating_add(v.count);
        }
        Ok(e)
    }

    /// The first element's bytes (elements of at most 8 bytes: wider ones are not offered).
    ///
    /// # Safety
    /// `addr` holds `count` readable elements of `dt`.
    unsafe fn word(&self, dt: Datatype) -> Result<Option<[u8; 8]>> {
        if !self.desc.is_null() {
            // Not needed (the operand is copied), but one given must be ours.
            // SAFETY: the caller's contract: a descriptor from fi_mr_desc, or a bad pointer
            // `region` proves is not one before reading it.
            unsafe { region(self.addr, self.desc) }?;
        }
        let n = dt.size();
        if self.addr.is_null() || self.count == 0 || n > 8 {
            return Ok(None);
        }
        // SAFETY: the caller's contract: at least one element.
        let b = unsafe { bytes(self.addr, n, "buf") }?;
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(b);
        Ok(Some(w))
    }

    /// Where the first element's result goes.
    ///
    /// # Safety
    /// `addr` holds `count` writable elements of `dt` until the operation completes;
    /// `desc` is NULL or a descriptor from `fi_mr_desc`.
    unsafe fn result(&self, dt: Datatype) -> Result<Option<RecvBuf>> {
        if self.addr.is_null() || self.count == 0 {
            return Ok(None);
        }
        // SAFETY: the caller's contract.
        unsafe { read_buf(self.addr, dt.size(), self.desc) }.map(Some)
    }
}

/// The operands of one call, as C gave them.
struct Call {
    kind: AtomicKind,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    buf: Elements,
    compare: Elements,
    result: Elements,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
    /// `*msg` calls' flags; the endpoint's `tx_attr.op_flags` otherwise.
    flags: Option<Flags>,
    inject: bool,
}

impl Call {
    /// A call of `kind` on the remote element at `addr` under `key` of peer `dest`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: AtomicKind,
        datatype: fi::fi_datatype,
        op: fi::fi_op,
        dest: fi::fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Call {
        Call {
            kind,
            datatype,
            op,
            buf: Elements::NONE,
            compare: Elements::NONE,
            result: Elements::NONE,
            dest,
            addr,
            key,
            context,
            flags: None,
            inject: false,
        }
    }

    /// The target and context of an `fi_msg_atomic`, and its operands (`msg_iov`).
    ///
    /// # Safety
    /// `msg` is NULL or a valid message whose arrays hold their counts.
    unsafe fn msg(kind: AtomicKind, msg: *const fi::fi_msg_atomic, flags: u64) -> Result<Call> {
        // SAFETY: the caller's contract.
        let m = unsafe { msg.as_ref() }.ok_or_else(|| Error::new(errno::EINVAL, "msg is NULL"))?;
        if m.rma_iov_count != 1 || m.rma_iov.is_null() {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "{} remote ranges: rverbs takes one per atomic (rma_iov_limit 1)",
                    m.rma_iov_count
                ),
            ));
        }
        // SAFETY: one element, per the caller's contract.
        let r = unsafe { *m.rma_iov };
        let mut c = Call::new(kind, m.datatype, m.op, m.addr, r.addr, r.key, m.context);
        // SAFETY: the caller's contract.
        c.buf = unsafe { Elements::ioc(m.msg_iov, m.desc, m.iov_count) }?;
        c.flags = Some(Flags::from_bits_retain(flags));
        if r.count != c.buf.count && !(c.op == fi::FI_ATOMIC_READ && c.buf.count == 0) {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "the remote range has {} elements, the operand {}",
                    r.count, c.buf.count
                ),
            ));
        }
        Ok(c)
    }

    /// Posts the call on `ep`.
    ///
    /// # Safety
    /// `ep` is the application's handle; the buffers hold what they say (fi_atomic(3)).
    unsafe fn post(self, ep: *mut fi::fid_ep) -> Result<usize> {
        let datatype = Datatype::from_raw(self.datatype)?;
        let op = AtomicOp::from_raw(self.op)?;
        // FI_ATOMIC_READ ignores its source buffer: the count is the result's.
        let count = match (op, self.buf.count) {
            (AtomicOp::Read, 0) => self.result.count,
            (_, n) => n,
        };
        // SAFETY: the caller's contract.
        let a = unsafe {
            AtomicCall {
                kind: self.kind,
                datatype,
                op,
                count,
                operand: self.buf.word(datatype)?,
                compare: self.compare.word(datatype)?,
                result: self.result.result(datatype)?,
            }
        };
        let rma = RmaIov {
            addr: self.addr,
            len: count.saturating_mul(datatype.size()),
            key: self.key,
        };
        // SAFETY: the caller's contract.
        let ep = unsafe { rdm(ep) }?;
        let flags = self.flags.unwrap_or_else(|| ep.tx_op_flags());
        let flags = if self.inject {
            flags | Flags::INJECT
        } else {
            flags
        };
        ep.atomicmsg(&a, self.dest, &rma, self.context as u64, flags, self.inject)
            .map(|()| 0)
    }
}

/// The valid calls and `fi_query_atomic`: what rverbs carries (`core::atomic::valid`).
fn answer_valid(
    kind: AtomicKind,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
) -> Result<atomic::AtomicAttr> {
    atomic::valid(kind, Datatype::from_raw(datatype)?, AtomicOp::from_raw(op)?)
}

/// `fi_query_atomic` on a domain: `flags` picks the family (`FI_FETCH_ATOMIC`,
/// `FI_COMPARE_ATOMIC`, neither); atomics on tagged buffers (`FI_TAGGED`) are not offered.
pub(crate) fn query_atomic(
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    flags: u64,
) -> Result<atomic::AtomicAttr> {
    let (fetch, compare) = (
        flags & fi::FI_FETCH_ATOMIC != 0,
        flags & fi::FI_COMPARE_ATOMIC != 0,
    );
    if fetch && compare {
        return Err(Error::new(
            errno::EBADFLAGS,
            "FI_FETCH_ATOMIC and FI_COMPARE_ATOMIC together (fi_atomic(3): one or neither)",
        ));
    }
    if Flags::from_bits_retain(flags).contains(Flags::TAGGED) {
        return Err(Error::new(
            errno::EOPNOTSUPP,
            "atomics on tagged receive buffers (FI_TAGGED) are not offered",
        ));
    }
    let kind = if fetch {
        AtomicKind::Fetch
    } else if compare {
        AtomicKind::Compare
    } else {
        AtomicKind::Base
    };
    answer_valid(kind, datatype, op)
}

/// A valid call on endpoint `ep`.
///
/// # Safety
/// `ep` is the application's handle; `count` is NULL or writable.
unsafe fn valid_on(
    what: &str,
    ep: *mut fi::fid_ep,
    kind: AtomicKind,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> i32 {
    guarded(what, || {
        // SAFETY: the caller's contract.
        unsafe { rdm(ep) }?;
        if count.is_null() {
            return Err(Error::new(errno::EINVAL, "count is NULL"));
        }
        let a = answer_valid(kind, datatype, op)?;
        // SAFETY: non-NULL and writable, the caller's contract.
        unsafe { *count = a.count };
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_atomic(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    count: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_atomic", || {
        let mut c = Call::new(AtomicKind::Base, datatype, op, dest, addr, key, context);
        c.buf = Elements::one(buf, count, desc);
        // SAFETY: the application's handle and buffer (fi_atomic(3)).
        unsafe { c.post(ep) }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_atomicv(
    ep: *mut fi::fid_ep,
    iov: *const fi::fi_ioc,
    desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_atomicv", || {
        let mut c = Call::new(AtomicKind::Base, datatype, op, dest, addr, key, context);
        // SAFETY: the application's handle and arrays (fi_atomic(3)).
        unsafe {
            c.buf = Elements::ioc(iov, desc, count)?;
            c.post(ep)
        }
    })
}

unsafe extern "C" fn rdm_atomicmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_atomic,
    flags: u64,
) -> isize {
    guarded_len("fi_atomicmsg", || {
        // SAFETY: the application's handle and message (fi_atomic(3)).
        unsafe { Call::msg(AtomicKind::Base, msg, flags)?.post(ep) }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_inject_atomic(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
) -> isize {
    guarded_len("fi_inject_atomic", || {
        let none = std::ptr::null_mut();
        let mut c = Call::new(AtomicKind::Base, datatype, op, dest, addr, key, none);
        c.buf = Elements::one(buf, count, none);
        c.inject = true;
        // SAFETY: the application's handle and buffer (fi_atomic(3)).
        unsafe { c.post(ep) }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_fetch_atomic(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    count: usize,
    desc: *mut c_void,
    result: *mut c_void,
    result_desc: *mut c_void,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_fetch_atomic", || {
        let mut c = Call::new(AtomicKind::Fetch, datatype, op, dest, addr, key, context);
        c.buf = Elements::one(buf, count, desc);
        c.result = Elements::one(result, count, result_desc);
        // SAFETY: the application's handle and buffers (fi_atomic(3)).
        unsafe { c.post(ep) }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_fetch_atomicv(
    ep: *mut fi::fid_ep,
    iov: *const fi::fi_ioc,
    desc: *mut *mut c_void,
    count: usize,
    resultv: *mut fi::fi_ioc,
    result_desc: *mut *mut c_void,
    result_count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_fetch_atomicv", || {
        let mut c = Call::new(AtomicKind::Fetch, datatype, op, dest, addr, key, context);
        // SAFETY: the application's handle and arrays (fi_atomic(3)).
        unsafe {
            c.buf = Elements::ioc(iov, desc, count)?;
            c.result = Elements::ioc(resultv, result_desc, result_count)?;
            c.post(ep)
        }
    })
}

unsafe extern "C" fn rdm_fetch_atomicmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_atomic,
    resultv: *mut fi::fi_ioc,
    result_desc: *mut *mut c_void,
    result_count: usize,
    flags: u64,
) -> isize {
    guarded_len("fi_fetch_atomicmsg", || {
        // SAFETY: the application's handle, message and arrays (fi_atomic(3)).
        unsafe {
            let mut c = Call::msg(AtomicKind::Fetch, msg, flags)?;
            c.result = Elements::ioc(resultv, result_desc, result_count)?;
            c.post(ep)
        }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_compare_atomic(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    count: usize,
    desc: *mut c_void,
    compare: *const c_void,
    compare_desc: *mut c_void,
    result: *mut c_void,
    result_desc: *mut c_void,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_compare_atomic", || {
        let mut c = Call::new(AtomicKind::Compare, datatype, op, dest, addr, key, context);
        c.buf = Elements::one(buf, count, desc);
        c.compare = Elements::one(compare, count, compare_desc);
        c.result = Elements::one(result, count, result_desc);
        // SAFETY: the application's handle and buffers (fi_atomic(3)).
        unsafe { c.post(ep) }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_compare_atomicv(
    ep: *mut fi::fid_ep,
    iov: *const fi::fi_ioc,
    desc: *mut *mut c_void,
    count: usize,
    comparev: *const fi::fi_ioc,
    compare_desc: *mut *mut c_void,
    compare_count: usize,
    resultv: *mut fi::fi_ioc,
    result_desc: *mut *mut c_void,
    result_count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    context: *mut c_void,
) -> isize {
    guarded_len("fi_compare_atomicv", || {
        let mut c = Call::new(AtomicKind::Compare, datatype, op, dest, addr, key, context);
        // SAFETY: the application's handle and arrays (fi_atomic(3)).
        unsafe {
            c.buf = Elements::ioc(iov, desc, count)?;
            c.compare = Elements::ioc(comparev, compare_desc, compare_count)?;
            c.result = Elements::ioc(resultv, result_desc, result_count)?;
            c.post(ep)
        }
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rdm_compare_atomicmsg(
    ep: *mut fi::fid_ep,
    msg: *const fi::fi_msg_atomic,
    comparev: *const fi::fi_ioc,
    compare_desc: *mut *mut c_void,
    compare_count: usize,
    resultv: *mut fi::fi_ioc,
    result_desc: *mut *mut c_void,
    result_count: usize,
    flags: u64,
) -> isize {
    guarded_len("fi_compare_atomicmsg", || {
        // SAFETY: the application's handle, message and arrays (fi_atomic(3)).
        unsafe {
            let mut c = Call::msg(AtomicKind::Compare, msg, flags)?;
            c.compare = Elements::ioc(comparev, compare_desc, compare_count)?;
            c.result = Elements::ioc(resultv, result_desc, result_count)?;
            c.post(ep)
        }
    })
}

unsafe extern "C" fn rdm_atomicvalid(
    ep: *mut fi::fid_ep,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> i32 {
    // SAFETY: the application's handle and count (fi_atomic(3)).
    unsafe { valid_on("fi_atomicvalid", ep, AtomicKind::Base, datatype, op, count) }
}

unsafe extern "C" fn rdm_fetch_atomicvalid(
    ep: *mut fi::fid_ep,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> i32 {
    let k = AtomicKind::Fetch;
    // SAFETY: the application's handle and count (fi_atomic(3)).
    unsafe { valid_on("fi_fetch_atomicvalid", ep, k, datatype, op, count) }
}

unsafe extern "C" fn rdm_compare_atomicvalid(
    ep: *mut fi::fid_ep,
    datatype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> i32 {
    let k = AtomicKind::Compare;
    // SAFETY: the application's handle and count (fi_atomic(3)).
    unsafe { valid_on("fi_compare_atomicvalid", ep, k, datatype, op, count) }
}
