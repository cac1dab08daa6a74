//! `FI_MULTI_RECV` on RC queue pairs.
//!
//! Verbs places one message per receive work request, and only the completion says how
//! long it was. So the active buffer is posted as one work request over its free space;
//! each completion says where the message landed (`buf`), and the rest is posted again
//! until less than `FI_OPT_MIN_MULTI_RECV` is left, when the buffer is released with
//! `FI_MULTI_RECV`. Receives posted behind the buffer wait here, in order, and go to the
//! device when it is released. A message arriving before the rest is posted again waits
//! in the sender's receiver-not-ready retry (endpoints ask for a short one), never lost.
//!
//! A legal message can be longer than the rest of a buffer (the minimum left free is only
//! what the application asked for). On RC a receive too short for its message breaks the
//! connection, so each post carries, behind the buffer's free part, scatter entries into
//! a provider overflow region (the same region repeated, as the device writes them in
//! turn): such a message completes `FI_ETRUNC`, with the bytes that fit and `olen`, the
//! buffer is released, and the connection lives on.

use std::collections::VecDeque;

use rfabric_sys::verbs::{wc_status as st, QpHandle, Sge, WorkCompletion, MAX_IOV};

use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::cq::status_errno;
use crate::verbs::wr_id::{self, Kind};
use crate::verbs::MemoryRegion;

/// The overflow region behind multi-receive posts; repeated up to the QP's scatter limit
/// (on rxe, 31 entries: 2 MiB past the buffer's rest).
pub(crate) const OVERFLOW_LEN: usize = 64 * 1024;

/// `FI_OPT_MIN_MULTI_RECV` until set: room for a small message and its alignment.
pub(crate) const DEFAULT_MIN_MULTI_RECV: usize = 64;

/// A multi-receive buffer: the free part of its region and the operation's context.
#[derive(Debug)]
pub(crate) struct MultiBuf {
    pub(crate) mr: MemoryRegion,
    pub(crate) next: usize,
    pub(crate) end: usize,
    pub(crate) context: u64,
    /// Posted without `FI_COMPLETION` under selective completion: only the release reports.
    pub(crate) suppress: bool,
}

#[derive(Debug)]
enum Pending {
    Recv { id: u64, sge: Sge },
    Multi(MultiBuf),
}

/// The receive side of an endpoint while multi-receive buffers are in use.
#[derive(Debug, Default)]
pub(crate) struct MultiRecvQueue {
    active: Option<MultiBuf>,
    backlog: VecDeque<Pending>,
    /// The active buffer was flushed: the QP is in error, and what waits is canceled here
    /// (work posted to a QP in error is not flushed by every device).
    flushed: bool,
    /// Where a message longer than a buffer's rest spills (see the module's comment).
    overflow: Option<MemoryRegion>,
}

impl MultiRecvQueue {
    /// True when no buffer is active and nothing waits: receives may go straight to the QP.
    pub(crate) fn is_idle(&self) -> bool {
        self.active.is_none() && self.backlog.is_empty()
    }

    /// Sets the overflow region once (before the first buffer is posted).
    pub(crate) fn set_overflow(&mut self, mr: MemoryRegion) {
        self.overflow.get_or_insert(mr);
    }

    pub(crate) fn has_overflow(&self) -> bool {
        self.overflow.is_some()
    }

    /// Posts `buf` now if nothing is ahead of it, else queues it (`cap` entries at most).
    pub(crate) fn post_multi(&mut self, qp: &QpHandle, buf: MultiBuf, cap: usize) -> Result<()> {
        if self.is_idle() {
            post_rest(qp, &buf, self.overflow.as_ref()).map_err(post_err)?;
            self.active = Some(buf);
            return Ok(());
        }
        self.queue(Pending::Multi(buf), cap)
    }

    /// Queues a plain receive behind the active buffer (or posts it when none is left).
    pub(crate) fn post_recv(&mut self, qp: &QpHandle, id: u64, sge: Sge, cap: usize) -> Result<()> {
        if self.is_idle() {
            return qp.post_recv(id, &[sge]).map_err(post_err);
        }
        self.queue(Pending::Recv { id, sge }, cap)
    }

    fn queue(&mut self, p: Pending, cap: usize) -> Result<()> {
        if self.backlog.len() >= cap {
            return Err(Error::new(
                errno::EAGAIN,
                "receive queue full behind a multi-receive buffer: read the CQ to free room",
            ));
        }
        if self.backlog.capacity() == 0 {
            self.backlog.reserve(cap);
        }
        self.backlog.push_back(p);
        Ok(())
    }

    /// The CQ entry for a completion of the active buffer, which is posted again or
    /// released (and the receives behind it posted).
    pub(crate) fn completion(
        &mut self,
        qp: Option<&QpHandle>,
        wc: &WorkCompletion,
        min: usize,
    ) -> Option<std::result::Result<CqEntry, Vec<CqErrEntry>>> {
        let Some(buf) = self.active.as_mut() else {
            crate::fi_warn!("ep", "a multi-receive completion without an active buffer");
            return None;
        };
        if wc.status() != st::IBV_WC_SUCCESS {
            let e = CqErrEntry {
                op_context: buf.context,
                flags: (Flags::MSG | Flags::RECV | Flags::MULTI_RECV).bits(),
                err: status_errno(wc.status()),
                prov_errno: wc.status() as i32,
                buf: buf.mr.addr() + buf.next as u64,
                ..Default::default()
            };
            self.active = None;
            self.flushed = true;
            let mut v = vec![e];
            v.extend(
                self.take_backlog()
                    .into_iter()
                    .map(|(context, flags)| CqErrEntry {
                        op_context: context,
                        flags: flags.bits(),
                        err: errno::ECANCELED,
                        prov_errno: st::IBV_WC_WR_FLUSH_ERR as i32,
                        ..Default::default()
                    }),
            );
            return Some(Err(v));
        }
        let n = wc.byte_len() as usize;
        let mut flags = Flags::MSG | Flags::RECV;
        if wc.imm_data().is_some() {
            flags |= Flags::REMOTE_CQ_DATA;
        }
        let at = buf.mr.addr() + buf.next as u64;
        let rest = buf.end - buf.next;
        if n > rest {
            // It spilled into the overflow region: what fit, and how much did not.
            let e = CqErrEntry {
                op_context: buf.context,
                flags: (flags | Flags::MULTI_RECV).bits(),
                len: rest,
                buf: at,
                data: u64::from(wc.imm_data().unwrap_or(0)),
                olen: n - rest,
                err: errno::ETRUNC,
                ..Default::default()
            };
            self.active = None;
            self.advance(qp);
            return Some(Err(vec![e]));
        }
        buf.next = (buf.next + n).min(buf.end);
        let left = buf.end - buf.next;
        let mut release = left == 0 || left < min;
        if !release {
            match qp.map(|q| post_rest(q, buf, self.overflow.as_ref())) {
                Some(Ok(())) => {}
                other => {
                    crate::fi_warn!(
                        "ep",
                        "multi-receive buffer released early: posting its rest failed ({other:?})"
                    );
                    release = true;
                }
            }
        }
        let (context, suppress) = (buf.context, buf.suppress);
        if release {
            flags |= Flags::MULTI_RECV;
            self.active = None;
            self.advance(qp);
        } else if suppress {
            return None;
        }
        Some(Ok(CqEntry {
            op_context: context,
            flags: flags.bits(),
            len: n,
            buf: at,
            data: u64::from(wc.imm_data().unwrap_or(0)),
            tag: 0,
        }))
    }

    /// Posts what waits behind a released buffer, up to and including the next buffer.
    fn advance(&mut self, qp: Option<&QpHandle>) {
        let Some(qp) = qp.filter(|_| !self.flushed) else {
            return;
        };
        while let Some(p) = self.backlog.pop_front() {
            let r = match &p {
                Pending::Recv { id, sge } => qp.post_recv(*id, &[*sge]),
                Pending::Multi(b) => post_rest(qp, b, self.overflow.as_ref()),
            };
            if let Err(e) = r {
                crate::fi_warn!(
                    "ep",
                    "a receive behind a multi-receive buffer waits: post failed ({e})"
                );
                self.backlog.push_front(p);
                return;
            }
            if let Pending::Multi(b) = p {
                self.active = Some(b);
                return;
            }
        }
    }

    /// Receives still waiting (shutdown cancels them).
    pub(crate) fn take_backlog(&mut self) -> Vec<(u64, Flags)> {
        self.backlog
            .drain(..)
            .map(|p| match p {
                Pending::Recv { id, .. } => (wr_id::context(id), wr_id::flags(id)),
                Pending::Multi(b) => (b.context, Flags::MSG | Flags::RECV | Flags::MULTI_RECV),
            })
            .collect()
    }
}

/// Posts the free part of `buf` as one receive, with the overflow region behind it.
fn post_rest(
    qp: &QpHandle,
    buf: &MultiBuf,
    overflow: Option<&MemoryRegion>,
) -> std::result::Result<(), i32> {
    let mut sges = [Sge::default(); MAX_IOV];
    sges[0] = buf
        .mr
        .sys()
        .sge(buf.next, buf.end - buf.next)
        .ok_or(libc::EINVAL)?;
    let mut n = 1;
    if let Some(o) = overflow.and_then(|o| o.sys().sge(0, o.len())) {
        let room = (qp.max_recv_sge() as usize).min(MAX_IOV);
        while n < room {
            sges[n] = o;
            n += 1;
        }
    }
    // The CQ routes it to the endpoint by QP number; the context is the buffer's.
    qp.post_recv(
        wr_id::encode(buf.context, Kind::MultiRecv, false),
        &sges[..n],
    )
}

fn post_err(e: i32) -> Error {
    if e == libc::ENOMEM || e == libc::EAGAIN {
        Error::new(
            errno::EAGAIN,
            "receive queue full: read the CQ to free room",
        )
    } else {
        Error::os(e, "post receive")
    }
}
