//! Completion queues on `ibv_cq`, read in manual progress.
//!
//! The fast path polls the device straight into the caller's entries. An error completion,
//! and whatever the same poll returned after it, is staged in the software queue
//! ([`CqState`]) that every later read drains first, so order is kept.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rfabric_sys::verbs::{
    wc_opcode as op, wc_status as st, wc_status_str, Cq, WcBatch, WorkCompletion,
};

use crate::core::cq::{CqEntry, CqErrEntry, CqState};
use crate::core::env;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{CqFormat, Flags, WaitObj};
use crate::verbs::{os_err, Domain};

/// `fi_cq_attr`, as far as rverbs uses it today.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqAttr {
    /// Entries; 0 means the provider default (`FI_RVERBS_CQ_SIZE`).
    pub size: usize,
    pub format: CqFormat,
    pub wait_obj: WaitObj,
    pub signaling_vector: i32,
}

/// A completion queue (`fi_cq`).
#[derive(Debug)]
pub struct CompletionQueue {
    cq: Cq,
    /// Entries staged in `state`: the fast path checks this and skips the lock when 0.
    staged: AtomicUsize,
    state: Mutex<CqState>,
    /// Device entries promised to bound queue pairs; serialises resizes.
    reserved: Mutex<u32>,
    attr: CqAttr,
    max_cqe: u32,
    _domain: Arc<Domain>,
}

/// `FI_CQ_FORMAT_UNSPEC` resolves to the tagged format: every field rverbs can fill.
pub const UNSPEC_FORMAT: CqFormat = CqFormat::Tagged;

const POLL_BATCH: usize = 16;

/// libfabric errno for a failed work completion.
pub(crate) fn status_errno(status: u32) -> i32 {
    match status {
        st::IBV_WC_WR_FLUSH_ERR => errno::ECANCELED,
        st::IBV_WC_LOC_LEN_ERR => errno::ETRUNC,
        st::IBV_WC_LOC_PROT_ERR | st::IBV_WC_REM_ACCESS_ERR | st::IBV_WC_MW_BIND_ERR => {
            errno::EACCES
        }
        st::IBV_WC_REM_INV_REQ_ERR => errno::EINVAL,
        st::IBV_WC_RETRY_EXC_ERR | st::IBV_WC_RESP_TIMEOUT_ERR => errno::ETIMEDOUT,
        st::IBV_WC_RNR_RETRY_EXC_ERR => errno::ECONNREFUSED,
        st::IBV_WC_REM_ABORT_ERR => errno::ECONNABORTED,
        _ => errno::EIO,
    }
}

/// Completion flags for a successful work completion.
#[inline]
fn wc_flags(wc: &WorkCompletion) -> Flags {
    match wc.opcode() {
        op::IBV_WC_SEND => Flags::MSG | Flags::SEND,
        op::IBV_WC_RECV if wc.imm_data().is_some() => {
            Flags::MSG | Flags::RECV | Flags::REMOTE_CQ_DATA
        }
        op::IBV_WC_RECV => Flags::MSG | Flags::RECV,
        op::IBV_WC_RDMA_WRITE => Flags::RMA | Flags::WRITE,
        op::IBV_WC_RDMA_READ => Flags::RMA | Flags::READ,
        op::IBV_WC_RECV_RDMA_WITH_IMM => Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA,
        _ => Flags::empty(),
    }
}

/// Translates a successful work completion into a CQ entry: the fast path's whole work.
#[inline]
pub fn to_entry(wc: &WorkCompletion) -> CqEntry {
    let flags = wc_flags(wc);
    CqEntry {
        op_context: wc.wr_id(),
        flags: flags.bits(),
        len: if flags.contains(Flags::RECV) || flags.contains(Flags::REMOTE_WRITE) {
            wc.byte_len() as usize
        } else {
            0
        },
        buf: 0,
        data: u64::from(wc.imm_data().unwrap_or(0)),
        tag: 0,
    }
}

/// Translates a failed work completion into an error entry.
pub fn to_err_entry(wc: &WorkCompletion) -> CqErrEntry {
    // The opcode of a failed completion is undefined in verbs, so no flags are claimed.
    CqErrEntry {
        op_context: wc.wr_id(),
        err: status_errno(wc.status()),
        prov_errno: wc.status() as i32,
        ..Default::default()
    }
}

impl CompletionQueue {
    pub fn open(domain: &Arc<Domain>, attr: &CqAttr) -> Result<Arc<Self>> {
        match attr.wait_obj {
            WaitObj::None | WaitObj::Unspec => {}
            w => {
                return Err(Error::new(
                    errno::ENOSYS,
                    format!("CQ wait object {w:?} is not implemented yet: use FI_WAIT_NONE"),
                ))
            }
        }
        let max_cqe = domain.device().attr.max_cqe;
        let size = if attr.size == 0 {
            env::get_usize_or("FI_RVERBS_CQ_SIZE", 2048)?
        } else {
            attr.size
        };
        if size > max_cqe as usize {
            return Err(Error::new(
                errno::EINVAL,
                format!("CQ size {size} exceeds the device's max_cqe {max_cqe}"),
            ));
        }
        let cq = Cq::new(
            domain.device().context,
            size as u32,
            attr.signaling_vector.max(0),
        )
        .map_err(os_err("ibv_create_cq"))?;
        let mut attr = *attr;
        attr.size = cq.capacity() as usize;
        if attr.format == CqFormat::Unspec {
            attr.format = UNSPEC_FORMAT;
        }
        Ok(Arc::new(CompletionQueue {
            cq,
            staged: AtomicUsize::new(0),
            state: Mutex::new(CqState::new(size.max(64))),
            reserved: Mutex::new(0),
            attr,
            max_cqe,
            _domain: domain.clone(),
        }))
    }

    pub fn attr(&self) -> &CqAttr {
        &self.attr
    }

    /// Entries the device queue holds now (grows as endpoints are bound).
    pub fn capacity(&self) -> usize {
        self.cq.capacity() as usize
    }

    fn state(&self) -> MutexGuard<'_, CqState> {
        // A panic elsewhere cannot leave CqState half-updated: every method is one push/pop.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads completions into `out` (`fi_cq_read`). Drives progress: polls the device.
    /// `EAGAIN` when none is ready; `EAVAIL` when an error is next (see [`Self::readerr`]).
    #[inline]
    pub fn read(&self, out: &mut [CqEntry]) -> Result<usize> {
        if self.staged.load(Ordering::Acquire) != 0 {
            let n = self.read_staged(out)?;
            if n > 0 {
                return Ok(n);
            }
        }
        if out.is_empty() {
            return Ok(0);
        }
        let n = if out.len() == 1 {
            self.poll_into::<1>(out)?
        } else {
            self.poll_into::<POLL_BATCH>(out)?
        };
        if n == 0 {
            return Err(if self.staged.load(Ordering::Acquire) != 0 {
                Error::new(
                    errno::EAVAIL,
                    "an error completion is at the head: read it with readerr",
                )
            } else {
                Error::new(errno::EAGAIN, "no completion")
            });
        }
        Ok(n)
    }

    fn read_staged(&self, out: &mut [CqEntry]) -> Result<usize> {
        let mut s = self.state();
        let r = s.read_into(out);
        self.staged.store(s.len(), Ordering::Release);
        r
    }

    #[inline]
    fn poll_into<const N: usize>(&self, out: &mut [CqEntry]) -> Result<usize> {
        let mut batch = WcBatch::<N>::new();
        let wcs = self
            .cq
            .poll_batch(&mut batch, out.len())
            .map_err(os_err("ibv_poll_cq"))?;
        for (i, (w, o)) in wcs.iter().zip(out.iter_mut()).enumerate() {
            if w.status() != st::IBV_WC_SUCCESS {
                self.stage(&wcs[i..]);
                return Ok(i);
            }
            *o = to_entry(w);
        }
        Ok(wcs.len())
    }

    /// Stages polled completions (the first one an error) behind anything already staged.
    #[cold]
    fn stage(&self, wcs: &[WorkCompletion]) {
        let mut s = self.state();
        for w in wcs {
            let r = if w.status() == st::IBV_WC_SUCCESS {
                s.push_entry(to_entry(w))
            } else {
                let e = to_err_entry(w);
                crate::fi_info!(
                    "cq",
                    "completion error for context {:#x}: {} ({})",
                    e.op_context,
                    wc_status_str(w.status()),
                    w.vendor_err()
                );
                s.push_error(e)
            };
            if let Err(e) = r {
                crate::fi_warn!("cq", "{e}");
            }
        }
        self.staged.store(s.len(), Ordering::Release);
    }

    /// The head error completion (`fi_cq_readerr`); `EAGAIN` when the head is not an error.
    pub fn readerr(&self) -> Result<CqErrEntry> {
        let mut s = self.state();
        let r = s
            .readerr()
            .ok_or_else(|| Error::new(errno::EAGAIN, "no error completion at the head"));
        self.staged.store(s.len(), Ordering::Release);
        r
    }

    /// `fi_cq_strerror`: the text of a provider errno (an `ibv_wc_status`).
    pub fn strerror(&self, prov_errno: i32) -> &'static str {
        wc_status_str(prov_errno.max(0) as u32)
    }

    /// Promises `n` more device entries to a queue pair, growing the CQ when needed, so
    /// the device queue can never overflow.
    pub(crate) fn reserve(&self, n: u32) -> Result<()> {
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let want = r.saturating_add(n);
        if want > self.cq.capacity() {
            if want > self.max_cqe {
                return Err(Error::new(
                    errno::ENOSPC,
                    format!("binding needs {want} CQ entries, over the device's max_cqe {}: use smaller tx/rx sizes or another CQ", self.max_cqe),
                ));
            }
            self.cq.resize(want).map_err(os_err("ibv_resize_cq"))?;
            crate::fi_info!(
                "cq",
                "grew CQ to {} entries for its endpoints",
                self.cq.capacity()
            );
        }
        *r = want;
        Ok(())
    }

    pub(crate) fn release(&self, n: u32) {
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        *r = r.saturating_sub(n);
    }

    pub(crate) fn raw(&self) -> &Cq {
        &self.cq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_with_immediate_data_becomes_remote_cq_data() {
        let wc = WorkCompletion::new(7, st::IBV_WC_SUCCESS, op::IBV_WC_RECV, 64, Some(0xfeed));
        let e = to_entry(&wc);
        assert_eq!(e.op_context, 7);
        assert_eq!(e.flags(), Flags::MSG | Flags::RECV | Flags::REMOTE_CQ_DATA);
        assert_eq!((e.len, e.data), (64, 0xfeed));
    }

    #[test]
    fn sends_report_no_length_and_rma_gets_its_own_flags() {
        let s = to_entry(&WorkCompletion::new(
            1,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_SEND,
            99,
            None,
        ));
        assert_eq!((s.flags(), s.len), (Flags::MSG | Flags::SEND, 0));
        let w = to_entry(&WorkCompletion::new(
            2,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_RDMA_WRITE,
            0,
            None,
        ));
        assert_eq!(w.flags(), Flags::RMA | Flags::WRITE);
        let r = to_entry(&WorkCompletion::new(
            3,
            st::IBV_WC_SUCCESS,
            op::IBV_WC_RECV_RDMA_WITH_IMM,
            8,
            Some(1),
        ));
        assert_eq!(
            r.flags(),
            Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA
        );
    }

    #[test]
    fn failed_completions_map_to_libfabric_errnos() {
        let cases = [
            (st::IBV_WC_WR_FLUSH_ERR, errno::ECANCELED),
            (st::IBV_WC_LOC_LEN_ERR, errno::ETRUNC),
            (st::IBV_WC_REM_ACCESS_ERR, errno::EACCES),
            (st::IBV_WC_RETRY_EXC_ERR, errno::ETIMEDOUT),
            (st::IBV_WC_RNR_RETRY_EXC_ERR, errno::ECONNREFUSED),
            (st::IBV_WC_GENERAL_ERR, errno::EIO),
        ];
        for (status, err) in cases {
            let e = to_err_entry(&WorkCompletion::new(9, status, 0, 0, None));
            assert_eq!((e.op_context, e.err, e.prov_errno), (9, err, status as i32));
        }
    }
}
