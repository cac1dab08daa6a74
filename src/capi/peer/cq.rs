//! A CQ as peers see it (`fid_peer_cq`): what a peer writes lands in the owner's CQ.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fid, guarded_len, no_bind, no_control, Class, Obj, Owned};
use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::error::{errno, Error, Result};
use crate::verbs::CompletionQueue;

/// Where a peer's completions go: the owner's CQ, which does the locking, wakes its wait
/// object and handles overflow.
pub(crate) trait PeerCqTarget: Send + Sync {
    fn write(&self, entry: CqEntry, src: u64) -> Result<()>;
    fn writeerr(&self, entry: CqErrEntry) -> Result<()>;
    /// Entries it takes before overrunning (what a drain may move without losing any).
    fn room(&self) -> usize;
}

impl PeerCqTarget for CompletionQueue {
    fn room(&self) -> usize {
        CompletionQueue::room(self)
    }
    fn write(&self, entry: CqEntry, src: u64) -> Result<()> {
        CompletionQueue::write(self, entry, src)
    }
    fn writeerr(&self, entry: CqErrEntry) -> Result<()> {
        CompletionQueue::writeerr(self, entry)
    }
}

/// A CQ as a peer sees it (`fid_peer_cq`): completions it writes land in the owner's CQ,
/// in the CQ's format.
pub(crate) type PeerCq = Obj<fi::fid_peer_cq, Arc<dyn PeerCqTarget>>;
impl Class for PeerCq {
    type Header = fi::fid_peer_cq;
    const FCLASS: u32 = fi::FI_CLASS_PEER_CQ;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEER_CQ_FI_OPS
    }
}

pub(crate) static PEER_CQ_FI_OPS: fi::fi_ops =
    crate::capi::fid::fi_ops_of!(peer_cq_close, no_bind, no_control);
pub(crate) static CQ_OWNER_OPS: fi::fi_ops_cq_owner = fi::fi_ops_cq_owner {
    size: size_of::<fi::fi_ops_cq_owner>(),
    write: Some(peer_cq_write),
    writeerr: Some(peer_cq_writeerr),
};

/// The `fid_peer_cq` to pass in a `fi_peer_cq_context` to a peer's `fi_cq_open(FI_PEER)`.
pub(crate) fn peer_cq(cq: Arc<dyn PeerCqTarget>) -> Owned<PeerCq> {
    Owned::new(
        fi::fid_peer_cq {
            fid: fid(fi::FI_CLASS_PEER_CQ, std::ptr::null_mut(), &PEER_CQ_FI_OPS),
            owner_ops: crate::capi::fid::ops(&CQ_OWNER_OPS),
        },
        cq,
    )
}

/// # Safety
/// `cq` is NULL or a `fid_peer_cq` made by [`peer_cq`].
unsafe fn peer_cq_of<'a>(cq: *mut fi::fid_peer_cq) -> Result<&'a PeerCq> {
    // SAFETY: the caller's contract; the ops are checked.
    unsafe { PeerCq::from_c(cq, "cq") }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn peer_cq_write(
    cq: *mut fi::fid_peer_cq,
    context: *mut c_void,
    flags: u64,
    len: usize,
    buf: *mut c_void,
    data: u64,
    tag: u64,
    src: fi::fi_addr_t,
) -> isize {
    guarded_len("peer cq write", || {
        // SAFETY: the fid_peer_cq the owner gave this peer.
        let q = unsafe { peer_cq_of(cq) }?;
        q.inner.write(
            CqEntry {
                op_context: context as u64,
                flags,
                len,
                buf: buf as u64,
                data,
                tag,
            },
            src,
        )?;
        Ok(0)
    })
}

unsafe extern "C" fn peer_cq_writeerr(
    cq: *mut fi::fid_peer_cq,
    e: *const fi::fi_cq_err_entry,
) -> isize {
    guarded_len("peer cq writeerr", || {
        // SAFETY: the fid_peer_cq the owner gave this peer, and NULL or a valid entry.
        let (q, e) = unsafe {
            (
                peer_cq_of(cq)?,
                e.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "err_entry is NULL"))?,
            )
        };
        // SAFETY: a valid entry from the peer.
        q.inner.writeerr(unsafe { err_entry(e) }?)?;
        Ok(0)
    })
}

/// An `fi_cq_err_entry` from C, with its error data copied.
///
/// # Safety
/// `err_data` has `err_data_size` readable bytes (NULL when 0), per fi_cq(3).
pub(crate) unsafe fn err_entry(e: &fi::fi_cq_err_entry) -> Result<CqErrEntry> {
    // SAFETY: the caller's contract.
    let data = unsafe { crate::capi::fid::copy_in(e.err_data, e.err_data_size, "err_data") }?;
    Ok(CqErrEntry {
        op_context: e.op_context as u64,
        flags: e.flags,
        len: e.len,
        buf: e.buf as u64,
        data: e.data,
        tag: e.tag,
        olen: e.olen,
        err: e.err,
        prov_errno: e.prov_errno,
        err_data: data,
    })
}

unsafe extern "C" fn peer_cq_close(_f: *mut fi::fid) -> i32 {
    // The owner frees a peer's fid_peer_cq when it is done with the peer.
    0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// A CQ for the host: the owner's software queue, as CompletionQueue::write feeds it.
    pub(crate) struct SoftCq(pub StdMutex<crate::core::cq::CqState>);
    impl PeerCqTarget for SoftCq {
        fn room(&self) -> usize {
            self.0.lock().unwrap().room()
        }
        fn write(&self, entry: CqEntry, src: u64) -> Result<()> {
            self.0.lock().unwrap().push_entry_from(entry, src)
        }
        fn writeerr(&self, entry: CqErrEntry) -> Result<()> {
            self.0.lock().unwrap().push_error(entry)
        }
    }

    #[test]
    fn a_peer_writes_completions_and_errors_into_the_owner_cq() {
        let soft = Arc::new(SoftCq(StdMutex::new(crate::core::cq::CqState::new(2))));
        let pc = peer_cq(soft.clone());
        let cq: *mut fi::fid_peer_cq = pc.raw();
        // SAFETY: the owner ops, called as a peer does.
        unsafe {
            let o = &*pc.hdr.owner_ops;
            let w = o.write.unwrap();
            assert_eq!(
                w(
                    cq,
                    7 as *mut c_void,
                    fi::FI_RECV | fi::FI_MSG,
                    64,
                    std::ptr::null_mut(),
                    0,
                    0,
                    3
                ),
                0
            );
            let err = fi::fi_cq_err_entry {
                op_context: 8 as *mut c_void,
                flags: fi::FI_RECV,
                len: 0,
                buf: std::ptr::null_mut(),
                data: 0,
                tag: 0,
                olen: 5,
                err: errno::ETRUNC,
                prov_errno: 0,
                err_data: b"xy".as_ptr() as *mut c_void,
                err_data_size: 2,
            };
            assert_eq!((o.writeerr.unwrap())(cq, &err), 0);
            // Overflow is the owner's to report.
            assert_eq!(
                w(cq, 9 as *mut c_void, 0, 0, std::ptr::null_mut(), 0, 0, 0),
                -(errno::EOVERRUN as isize)
            );
            assert_eq!(
                (o.writeerr.unwrap())(cq, std::ptr::null()),
                -(errno::EINVAL as isize)
            );
            let mut wrong = fid(fi::FI_CLASS_CQ, std::ptr::null_mut(), &PEER_CQ_FI_OPS);
            assert_eq!(
                w(
                    (&raw mut wrong).cast(),
                    std::ptr::null_mut(),
                    0,
                    0,
                    std::ptr::null_mut(),
                    0,
                    0,
                    0
                ),
                -(errno::EINVAL as isize)
            );
            // Error data a peer claims is 2^40 bytes: refused before a byte is read or an
            // allocation asked for.
            let huge = fi::fi_cq_err_entry {
                err_data_size: 1 << 40,
                ..err
            };
            assert_eq!((o.writeerr.unwrap())(cq, &huge), -(errno::EINVAL as isize));
            let past = fi::fi_cq_err_entry {
                err_data_size: usize::MAX,
                ..err
            };
            assert_eq!((o.writeerr.unwrap())(cq, &past), -(errno::EINVAL as isize));
        }
        let mut s = soft.0.lock().unwrap();
        let mut out = [CqEntry::default(); 2];
        let mut src = [0u64; 2];
        assert_eq!(s.read_into(&mut out, Some(&mut src)).unwrap(), 1);
        assert_eq!((out[0].op_context, out[0].len, src[0]), (7, 64, 3));
        let e = s.readerr().unwrap();
        assert_eq!(
            (e.op_context, e.olen, e.err, e.err_data.as_slice()),
            (8, 5, errno::ETRUNC, &b"xy"[..])
        );
    }
}
