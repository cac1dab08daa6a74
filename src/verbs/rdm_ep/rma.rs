//! `fi_rma(3)` on RDM endpoints: RDMA writes and reads over the connection to the peer,
//! made on first use as for messages. Each work request of an operation takes a send
//! buffer, so that it waits for the connection, is ordered with the peer's messages, and is
//! flushed and accounted as they are. Small writes are copied into the buffer (the
//! application's is free at once, `FI_INJECT` up to the inject size); small reads land in it
//! and are copied out when they complete; larger ones use the application's memory, its own
//! registration or one made for the operation.

use std::sync::Arc;

use rfabric_sys::lock::LockGuard;
use rfabric_sys::mem::{copy, ForeignBuf, Place};
use rfabric_sys::verbs::{self as sv, send_flags, MrSlice, QpHandle, MAX_IOV};

use super::{
    check_send_flags, peer_of, release_tx, to_owned, Enabled, Exposed, Inner, RdmEndpoint, RecvBuf,
    Src, TxMeta, MAX_SEGS, NONE,
};
use crate::core::atomic::{self, AtomicKind, AtomicOp, Datatype, DeviceAtomic, Emulated};
use crate::core::cq::CqEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::rdm::{Header, Op};
use crate::verbs::cq::Owned;
use crate::verbs::ep_common::{check_inject, check_rma_cap};
use crate::verbs::{wr_id, MemoryRegion, RmaIov};

/// One RDMA work request of an operation, kept with its send buffer until it completes.
#[derive(Debug)]
pub(super) struct RmaPiece {
    pub(super) wr: RmaWr,
    /// Where a read that landed in the send buffer goes once it succeeds.
    land: Option<RecvBuf>,
    /// Keeps the application's memory registered while the device uses it.
    _hold: Option<Arc<Exposed>>,
    /// A part before the operation's last work request: one more than that one's send
    /// buffer, which reports the operation (and this part's failure); 0 for the last.
    last: u32,
    /// An atomic done on its element's word by compare-and-swap (`core::atomic::Emulated`),
    /// and the word its last swap expected (none: the first step read it).
    emul: Option<(Emulated, Option<u64>)>,
}

impl RmaPiece {
    /// The send buffer of the operation's last work request, when this is an earlier part.
    pub(super) fn last(&self) -> Option<u32> {
        self.last.checked_sub(1)
    }
}

/// What the work request moves (copied out of the lock's reach to post it).
#[derive(Clone, Copy, Debug)]
pub(super) struct RmaWr {
    /// The application's memory, or `None`: the first `len` bytes of the send buffer.
    local: Option<sv::Sge>,
    len: u32,
    addr: u64,
    rkey: u32,
    read: bool,
    fence: bool,
    /// A device atomic on the remote word (the original value lands as a read's bytes do).
    atomic: Option<sv::AtomicWr>,
}

/// Posts `w` (send buffer at `off` of the pool) on `qp` as work request `wr`.
#[inline]
pub(super) fn post_wr(
    en: &Enabled,
    qp: &QpHandle,
    wr: u64,
    off: usize,
    w: &RmaWr,
    flags: u32,
) -> Result<()> {
    let flags = if w.fence {
        flags | send_flags::FENCE
    } else {
        flags
    };
    let len = w.len as usize;
    let pool = en.tx_pool.sys();
    if let Some(op) = w.atomic {
        let r = match pool.sge(off, len) {
            Some(sge) => qp.post_atomic(wr, sge, w.addr, w.rkey, flags, op),
            None => Err(libc::EINVAL),
        };
        return r.map_err(|e| Error::os(e, "ibv_post_send (atomic)"));
    }
    let r = match (w.local, w.read) {
        (Some(sge), false) => qp.post_write_sge(wr, sge, w.addr, w.rkey, flags),
        (Some(sge), true) => qp.post_read(wr, sge, w.addr, w.rkey, flags),
        (None, false) => {
            let s = MrSlice {
                mr: pool,
                offset: off,
                len,
            };
            qp.post_write(wr, &[s], w.addr, w.rkey, flags, None)
        }
        (None, true) => match pool.sge(off, len) {
            Some(sge) => qp.post_read(wr, sge, w.addr, w.rkey, flags),
            None => Err(libc::EINVAL),
        },
    };
    r.map_err(|e| {
        Error::os(
            e,
            if w.read {
                "ibv_post_send (RDMA read)"
            } else {
                "ibv_post_send (RDMA write)"
            },
        )
    })
}

/// A read of send buffer `slot` completed: what landed in the buffer goes to the
/// application's. Returns the work completion status the operation completes with.
pub(super) fn land(en: &Enabled, g: &mut Inner, slot: u32) -> u32 {
    let Some(p) = g.tx_rma[slot as usize].as_ref() else {
        return sv::wc_status::IBV_WC_SUCCESS;
    };
    let Some(to) = p.land.as_ref() else {
        return sv::wc_status::IBV_WC_SUCCESS;
    };
    // An emulated atomic's element lies at its place in the word that landed.
    let (at, len) = match p.emul {
        Some((e, _)) => (e.shift as usize, e.datatype.size()),
        None => (0, p.wr.len as usize),
    };
    let from = Place::Region(en.tx_pool.sys(), slot as usize * en.slot + at);
    match copy(from, to.target(0), len) {
        Ok(()) => sv::wc_status::IBV_WC_SUCCESS,
        Err(_) => sv::wc_status::IBV_WC_LOC_PROT_ERR,
    }
}

/// An emulated atomic's step in send buffer `slot` completed (the word it found landed in
/// the buffer): when the word must change and the last swap did not find what it expected,
/// swaps again, from the word found, on connection `conn` (`Some(Ok)`: posted again, the
/// operation goes on). `None`: the operation is done (its element lands as a read's does).
pub(super) fn atomic_step(en: &Enabled, g: &mut Inner, slot: u32, conn: u32) -> Option<Result<()>> {
    let (e, expected) = g.tx_rma[slot as usize].as_ref()?.emul?;
    let mut b = [0u8; WORD];
    if let Err(err) = en.tx_pool.read_at(slot as usize * en.slot, &mut b) {
        return Some(Err(err));
    }
    let found = u64::from_ne_bytes(b);
    if expected == Some(found) {
        return None;
    }
    let new = e.next(found)?;
    if let Some(p) = g.tx_rma[slot as usize].as_mut() {
        p.wr.atomic = Some(sv::AtomicWr::CmpSwap(found, new));
        p.wr.fence = false;
        p.emul = Some((e, Some(found)));
    }
    Some(super::post_on(en, g, conn, slot))
}

/// A write's notice (`Op::WriteData` in bounce buffer `id`, from `src`): the write is in
/// place. `FI_REMOTE_WRITE` counts it, on the endpoint's counter and those bound to the
/// region written (its key in `total`); remote CQ data makes `FI_RMA | FI_REMOTE_WRITE |
/// FI_REMOTE_CQ_DATA` on the receive CQ, with the bytes written. It consumes no receive of
/// the application's (RDM's mode has no `FI_RX_CQ_DATA`).
pub(super) fn remote_write(en: &Enabled, id: u32, h: &Header, src: u64) -> Option<Owned> {
    if let Err(e) = super::post_bounce(en, id) {
        crate::fi_warn!("rdm", "a bounce buffer is lost to its SRQ: {e}");
    }
    en.cntrs.done(Flags::REMOTE_WRITE, true);
    en.domain.region_written(u64::from(h.total));
    let data = h.data?;
    let entry = CqEntry {
        flags: (Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA).bits(),
        len: h.tag as usize,
        data,
        ..Default::default()
    };
    to_owned(Some(Ok((entry, src))))
}

/// A read's notice (`Op::ReadEvent` in bounce buffer `id`): the read was served, which
/// `FI_REMOTE_READ` counts (`FI_RMA_EVENT`).
pub(super) fn remote_read(en: &Enabled, id: u32) -> Option<Owned> {
    if let Err(e) = super::post_bounce(en, id) {
        crate::fi_warn!("rdm", "a bounce buffer is lost to its SRQ: {e}");
    }
    en.cntrs.done(Flags::REMOTE_READ, true);
    None
}

/// The local memory of one range of an operation larger than a send buffer: its first
/// element, and what keeps it registered.
type Exposure = (sv::Sge, Arc<Exposed>);

/// The bytes of the one element an atomic call takes (the device's word).
const WORD: usize = 8;

/// One `fi_atomic(3)` call's operation and operands.
#[derive(Clone, Debug)]
pub struct AtomicCall {
    pub kind: AtomicKind,
    pub datatype: Datatype,
    pub op: AtomicOp,
    /// Elements the call names (`count`, or the sum of its iov's counts).
    pub count: usize,
    /// The first element of the source buffer (none for `FI_ATOMIC_READ`).
    pub operand: Option<[u8; 8]>,
    /// The first element of the compare buffer (compare calls).
    pub compare: Option<[u8; 8]>,
    /// Where a fetching call's original value goes.
    pub result: Option<RecvBuf>,
}

/// Atomics need `FI_ATOMIC` in the endpoint's caps.
fn check_atomic_cap(caps: Flags) -> Result<()> {
    if caps.contains(Flags::ATOMIC) {
        return Ok(());
    }
    Err(Error::new(
        errno::EOPNOTSUPP,
        "the endpoint was opened without FI_ATOMIC in its info's caps: ask fi_getinfo for it",
    ))
}

/// The remote range of a one-buffer call: `len` bytes at `addr` under `key`.
fn whole(len: usize, addr: u64, key: u64) -> RmaIov {
    RmaIov { addr, len, key }
}

/// `len` bytes at `offset` of `mr`: the application's registration, held.
fn region_sge(mr: &MemoryRegion, offset: usize, len: usize) -> Result<Exposure> {
    let m = mr.sys();
    let sge = m
        .sge(offset, len)
        .ok_or_else(|| mr.range_error(offset, len))?;
    Ok((sge, Arc::new(Exposed::App(m.clone()))))
}

impl RdmEndpoint {
    /// `fi_write`: `buf` to `addr` under `key` at peer `dest`. Up to the send buffer size
    /// the bytes are copied before the call returns; larger writes come from a registered
    /// region ([`Self::write_region`]).
    pub fn write(&self, buf: &[u8], dest: u64, addr: u64, key: u64, context: u64) -> Result<()> {
        let rma = whole(buf.len(), addr, key);
        self.writemsg(&[buf], dest, &rma, None, context, self.tx_op_flags())
    }

    /// `fi_writedata`: a write whose `data` completes at the peer's receive CQ with
    /// `FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA` once the bytes are in place.
    pub fn writedata(
        &self,
        buf: &[u8],
        data: u64,
        dest: u64,
        addr: u64,
        key: u64,
        context: u64,
    ) -> Result<()> {
        let rma = whole(buf.len(), addr, key);
        let flags = self.tx_op_flags() | Flags::REMOTE_CQ_DATA;
        self.writemsg(&[buf], dest, &rma, Some(data), context, flags)
    }

    /// `fi_inject_write`: copied at once, no completion.
    pub fn inject_write(&self, buf: &[u8], dest: u64, addr: u64, key: u64) -> Result<()> {
        let rma = whole(buf.len(), addr, key);
        self.rma_write(
            &[Src::Slices(&[buf])],
            dest,
            &rma,
            None,
            0,
            Flags::INJECT,
            true,
        )
    }

    /// `fi_inject_writedata`.
    pub fn inject_writedata(
        &self,
        buf: &[u8],
        data: u64,
        dest: u64,
        addr: u64,
        key: u64,
    ) -> Result<()> {
        let rma = whole(buf.len(), addr, key);
        let flags = Flags::INJECT | Flags::REMOTE_CQ_DATA;
        self.rma_write(
            &[Src::Slices(&[buf])],
            dest,
            &rma,
            Some(data),
            0,
            flags,
            true,
        )
    }

    /// `fi_writemsg` (and `fi_writev`): gathered from `iov` into the remote range `rma`,
    /// with `data` as remote CQ data under `FI_REMOTE_CQ_DATA`, and `flags` (`FI_INJECT`,
    /// `FI_COMPLETION`, `FI_FENCE`, …).
    pub fn writemsg(
        &self,
        iov: &[&[u8]],
        dest: u64,
        rma: &RmaIov,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        self.rma_write(&[Src::Slices(iov)], dest, rma, data, context, flags, false)
    }

    /// A write of `len` bytes at `offset` of a registered region, of any size.
    #[allow(clippy::too_many_arguments)]
    pub fn write_region(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        dest: u64,
        rma: &RmaIov,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        let src = [Src::Region(mr, offset, len)];
        self.rma_write(&src, dest, rma, data, context, flags, false)
    }

    /// A write from application buffers valid until it completes (C callers): each a
    /// region of the application's (`Some`, from its descriptor) or its bare memory.
    #[allow(clippy::too_many_arguments)]
    pub fn write_foreign(
        &self,
        bufs: &[(ForeignBuf, Option<(&MemoryRegion, usize)>)],
        dest: u64,
        rma: &RmaIov,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        if bufs.len() > MAX_IOV {
            return Err(iov_limit(bufs.len()));
        }
        let mut src = [Src::Slices(&[]); MAX_IOV];
        for (s, (b, r)) in src.iter_mut().zip(bufs) {
            *s = match r {
                Some((mr, off)) => Src::Region(mr, *off, b.len()),
                None => Src::Foreign(*b),
            };
        }
        self.rma_write(&src[..bufs.len()], dest, rma, data, context, flags, false)
    }

    /// `fi_read`: `buf.len()` bytes at `addr` under `key` of peer `src` into `buf`.
    pub fn read(&self, buf: RecvBuf, src: u64, addr: u64, key: u64, context: u64) -> Result<()> {
        let rma = whole(buf.len(), addr, key);
        self.readmsg(&[buf], src, &rma, context, self.tx_op_flags())
    }

    /// `fi_readmsg` (and `fi_readv`): the remote range `rma` scattered into `bufs`.
    /// `FI_INJECT` and `FI_REMOTE_CQ_DATA` do not apply to reads: `EINVAL`.
    pub fn readmsg(
        &self,
        bufs: &[RecvBuf],
        src: u64,
        rma: &RmaIov,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        if flags.intersects(Flags::INJECT | Flags::REMOTE_CQ_DATA) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_INJECT and FI_REMOTE_CQ_DATA apply to writes, not reads",
            ));
        }
        if bufs.len() > MAX_IOV {
            return Err(iov_limit(bufs.len()));
        }
        if bufs.iter().any(|b| matches!(b, RecvBuf::Scatter(_))) {
            return Err(Error::new(
                errno::EINVAL,
                "an RMA iov's elements are single ranges (a scatter list is for receives)",
            ));
        }
        let total: usize = bufs.iter().map(RecvBuf::len).sum();
        let (en, rkey) = self.rma_check(Flags::READ, total, rma, context, flags)?;
        // Small ranges land in a send buffer (no registration); larger ones in the
        // application's memory, registered for the device to write.
        let mut exposed: [Option<Exposure>; MAX_IOV] = std::array::from_fn(|_| None);
        let mut n = 0;
        for (e, b) in exposed.iter_mut().zip(bufs) {
            if b.len() > en.slot || (b.writable() && !b.is_empty()) {
                *e = Some(
                    b.expose(&self.sh.domain, 0, b.len())
                        .map(|(x, sge)| (sge, Arc::new(x)))?,
                );
                n += b.len().div_ceil(self.piece_max());
            } else if !b.is_empty() {
                n += 1;
            }
        }
        let n = n.max(1);
        let g = en.inner.lock();
        let mut pieces = Pieces::take(self, en, g, src, n, false)?;
        let mut at = rma.addr;
        for (e, b) in exposed.iter_mut().zip(bufs) {
            match e.take() {
                Some((sge, hold)) => pieces.split(sge, &hold, &mut at, rkey, true),
                None if !b.is_empty() => {
                    let len = b.len() as u32;
                    pieces.push(None, len, at, rkey, true, Some(b.clone()), None);
                    at += len as u64;
                }
                None => {}
            }
        }
        if pieces.n == 0 {
            // Nothing to move: one empty read completes it, in order with the rest.
            pieces.push(None, 0, rma.addr, rkey, true, None, None);
        }
        let user = TxMeta {
            context,
            flags: Flags::RMA | Flags::READ,
            quiet: self.rma_quiet(en, flags),
            ..TxMeta::default()
        };
        if pieces.notice {
            // The target serves the read before it takes the next message on the connection.
            pieces = pieces.stage_notice(&Header::bare(Op::ReadEvent), user)?;
        }
        pieces.finish(user, flags)
    }

    /// Writes from `srcs` (one range of the operation each) to `rma` at peer `dest`; an
    /// `fi_inject_write*` call (`inject_call`) completes with nothing.
    #[allow(clippy::too_many_arguments)]
    fn rma_write(
        &self,
        srcs: &[Src<'_>],
        dest: u64,
        rma: &RmaIov,
        data: Option<u64>,
        context: u64,
        flags: Flags,
        inject_call: bool,
    ) -> Result<()> {
        let total: usize = srcs.iter().map(Src::len).sum();
        let (en, rkey) = self.rma_check(Flags::WRITE, total, rma, context, flags)?;
        if flags.contains(Flags::INJECT) {
            check_inject(total, self.inject_size())?;
        }
        let data = match (flags.contains(Flags::REMOTE_CQ_DATA), data) {
            (true, d) => Some(d.unwrap_or(0)),
            (false, _) => None,
        };
        // Up to a send buffer's size, copied into one; larger, from the application's
        // memory (registered for the operation when it is not already).
        let bounce = total <= en.slot;
        let mut exposed: [Option<Exposure>; MAX_IOV] = std::array::from_fn(|_| None);
        let mut n = 0;
        if bounce {
            n += 1;
        } else {
            for (e, s) in exposed.iter_mut().zip(srcs) {
                if s.len() == 0 {
                    continue;
                }
                *e = Some(match *s {
                    Src::Region(mr, off, len) => region_sge(mr, off, len)?,
                    Src::Foreign(f) => {
                        let p = self.sh.domain.pin(f.addr(), f.len(), 0)?;
                        let sge = p.sge_at(f.addr(), f.len()).ok_or_else(|| {
                            Error::new(errno::EINVAL, "a write's buffer outside its registration")
                        })?;
                        (sge, Arc::new(Exposed::Pinned(p)))
                    }
                    Src::Slices(_) | Src::Iov(_) => return Err(Error::new(
                        errno::EMSGSIZE,
                        format!("a {total}-byte write from a borrowed slice: writes larger than a send buffer ({} bytes) come from a MemoryRegion (write_region)", en.slot),
                    )),
                });
                n += s.len().div_ceil(self.piece_max());
            }
        }
        let g = en.inner.lock();
        let mut pieces = Pieces::take(self, en, g, dest, n, data.is_some())?;
        if bounce {
            let slot = pieces.slots[0];
            let mut off = slot as usize * en.slot;
            for s in srcs {
                if let Err(e) = s.copy_to(&en.tx_pool, off) {
                    return Err(pieces.abandon(e));
                }
                off += s.len();
            }
            pieces.push(None, total as u32, rma.addr, rkey, false, None, None);
        } else {
            let mut at = rma.addr;
            for e in exposed.iter_mut() {
                if let Some((sge, hold)) = e.take() {
                    pieces.split(sge, &hold, &mut at, rkey, false);
                }
            }
        }
        let user = TxMeta {
            context,
            // Marks an inject call: its failure has no context to report it by.
            flags: Flags::RMA
                | Flags::WRITE
                | if inject_call {
                    Flags::INJECT
                } else {
                    Flags::empty()
                },
            data: data.unwrap_or(0),
            quiet: inject_call || self.rma_quiet(en, flags),
            ..TxMeta::default()
        };
        if pieces.notice {
            // The data follows the write on the same connection, which delivers it after
            // the write's bytes are in place.
            let hdr = Header {
                tag: total as u64,
                data,
                total: rkey,
                ..Header::bare(Op::WriteData)
            };
            pieces = pieces.stage_notice(&hdr, user)?;
        }
        pieces.finish(user, flags)
    }

    /// `fi_atomic(3)` on the peer at `dest`: the base (`fi_atomic*`), fetching
    /// (`fi_fetch_atomic*`) or comparing (`fi_compare_atomic*`) call `a` on the remote word
    /// `rma` names. The device does it: [`atomic::valid`] says which operations it takes.
    /// A fetching call's original value is in `a.result` when it completes, which is
    /// after the target's device has answered (`FI_DELIVERY_COMPLETE`, as fi_atomic(3)
    /// says). An `fi_inject_atomic` call (`inject_call`) completes with nothing.
    pub fn atomicmsg(
        &self,
        a: &AtomicCall,
        dest: u64,
        rma: &RmaIov,
        context: u64,
        flags: Flags,
        inject_call: bool,
    ) -> Result<()> {
        check_atomic_cap(self.sh.info.caps)?;
        wr_id::check(context)?;
        check_send_flags(flags)?;
        if flags.contains(Flags::REMOTE_CQ_DATA) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_REMOTE_CQ_DATA with an atomic: rverbs carries remote CQ data on writes and sends",
            ));
        }
        let (plan, word) = atomic::plan(
            a.kind, a.datatype, a.op, a.count, a.operand, a.compare, rma.addr,
        )?;
        let fetch = a.kind != AtomicKind::Base;
        let size = a.datatype.size();
        let land = match (&a.result, fetch) {
            (Some(r), true) if r.len() >= size && !matches!(r, RecvBuf::Scatter(_)) => {
                Some(r.clone())
            }
            (_, true) => {
                return Err(Error::new(
                    errno::EINVAL,
                    format!("a fetching atomic needs one result buffer of {size} bytes"),
                ))
            }
            (_, false) => None,
        };
        let en = self.en()?;
        let rkey = rma.check(size)?;
        let g = en.inner.lock();
        let mut pieces = Pieces::take(self, en, g, dest, 1, false)?;
        let (device, emul) = match plan {
            DeviceAtomic::FetchAdd(v) => (sv::AtomicWr::FetchAdd(v), None),
            DeviceAtomic::CmpSwap(c, v) => (sv::AtomicWr::CmpSwap(c, v), None),
            // The first step reads the word (adding 0); `atomic_step` swaps.
            DeviceAtomic::Emulated(e) => (sv::AtomicWr::FetchAdd(0), Some((e, None))),
        };
        if pieces.notice && emul.is_some() {
            // The target's notice would count the operation before its last step.
            return Err(pieces.abandon(Error::new(
                errno::EOPNOTSUPP,
                format!(
                    "{:?} on {:?} toward an endpoint with FI_RMA_EVENT: only FI_SUM and \
                     FI_CSWAP on 64-bit integers are counted there",
                    a.op, a.datatype
                ),
            )));
        }
        let slot = pieces.slots[0];
        pieces.push(None, WORD as u32, word, rkey, true, land, None);
        if let Some(p) = pieces.g.tx_rma[slot as usize].as_mut() {
            p.wr.atomic = Some(device);
            p.emul = emul;
        }
        let dir = if fetch { Flags::READ } else { Flags::WRITE };
        let user = TxMeta {
            context,
            flags: Flags::ATOMIC
                | dir
                | if inject_call {
                    Flags::INJECT
                } else {
                    Flags::empty()
                },
            quiet: inject_call || self.rma_quiet(en, flags),
            ..TxMeta::default()
        };
        if pieces.notice {
            // The target counts what changed its memory as a remote write.
            let hdr = Header {
                tag: WORD as u64,
                total: rkey,
                ..Header::bare(Op::WriteData)
            };
            pieces = pieces.stage_notice(&hdr, user)?;
        }
        pieces.finish(user, flags)
    }

    /// What every RMA call checks: the caps, flags and context, the size, and the remote
    /// range (its rkey returned, with the enabled endpoint).
    fn rma_check(
        &self,
        dir: Flags,
        total: usize,
        rma: &RmaIov,
        context: u64,
        flags: Flags,
    ) -> Result<(&Enabled, u32)> {
        check_rma_cap(self.sh.info.caps, dir)?;
        wr_id::check(context)?;
        check_send_flags(flags)?;
        let en = self.en()?;
        let max = self.max_msg_size();
        if total > max {
            return Err(Error::new(
                errno::EMSGSIZE,
                format!("a {total}-byte RMA operation: at most {max} bytes (max_msg_size)"),
            ));
        }
        Ok((en, rma.check(total)?))
    }

    /// No success completion wanted: selective completion without `FI_COMPLETION`
    /// (`FI_INJECT` frees the buffer at once, and completes as any write).
    fn rma_quiet(&self, en: &Enabled, flags: Flags) -> bool {
        en.tx_selective && !flags.contains(Flags::COMPLETION)
    }

    /// The most one work request moves (the device's message size).
    fn piece_max(&self) -> usize {
        self.read_max()
    }

    /// The default flags of the endpoint's transmit operations (`tx_attr.op_flags`).
    pub fn tx_op_flags(&self) -> Flags {
        self.sh.info.tx_attr.op_flags
    }
}

fn iov_limit(n: usize) -> Error {
    Error::new(
        errno::EINVAL,
        format!("an RMA iov of {n} ranges: at most {MAX_IOV}"),
    )
}

/// The send buffers of one operation being staged, under the endpoint's lock.
struct Pieces<'a, 'e> {
    ep: &'a RdmEndpoint,
    en: &'e Enabled,
    g: LockGuard<'e, Inner>,
    peer: u32,
    slots: [u32; MAX_SEGS],
    /// Slots staged so far.
    n: usize,
    /// Slots taken.
    taken: usize,
    /// A notice follows the operation (its last slot): remote CQ data, or the target counts
    /// RMA (`FI_RMA_EVENT` in its name).
    notice: bool,
}

impl<'a, 'e> Pieces<'a, 'e> {
    /// Takes `n` send buffers for an operation to `addr`, and one more for a notice when
    /// it carries remote CQ data (`data`) or the target asked for RMA events.
    fn take(
        ep: &'a RdmEndpoint,
        en: &'e Enabled,
        mut g: LockGuard<'e, Inner>,
        addr: u64,
        n: usize,
        data: bool,
    ) -> Result<Self> {
        let peer = peer_of(en, &mut g, addr)?;
        let notice = data || g.peers[peer as usize].name.rma_event;
        let n = n + usize::from(notice);
        if n > MAX_SEGS {
            return Err(Error::new(
                errno::EINVAL,
                format!("an RMA operation of {n} work requests: at most {MAX_SEGS} (fewer ranges, or smaller ones)"),
            ));
        }
        if g.tx_free.len() < n {
            return Err(Error::new(
                errno::EAGAIN,
                "every send buffer is in flight: read the CQ to complete some",
            ));
        }
        let mut slots = [0u32; MAX_SEGS];
        for s in &mut slots[..n] {
            *s = g.tx_free.pop().unwrap_or_default();
            // Nothing of a previous use stays (`abandon` releases what is not staged yet).
            g.tx[*s as usize] = TxMeta {
                conn: NONE,
                rndv: NONE,
                ..TxMeta::default()
            };
        }
        Ok(Pieces {
            ep,
            en,
            g,
            peer,
            slots,
            n: 0,
            taken: n,
            notice,
        })
    }

    /// Stages the operation's notice `hdr` in the next slot (`user` is the operation's).
    fn stage_notice(mut self, hdr: &Header, user: TxMeta) -> Result<Self> {
        let slot = self.slots[self.n];
        if let Err(e) = self
            .en
            .tx_pool
            .write_at(slot as usize * self.en.slot, &hdr.encode())
        {
            return Err(self.abandon(e));
        }
        self.g.tx[slot as usize] = TxMeta {
            wire: Header::LEN as u32,
            conn: NONE,
            rndv: NONE,
            ..user
        };
        self.n += 1;
        Ok(self)
    }

    /// Stages the next slot with one work request.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        local: Option<sv::Sge>,
        len: u32,
        addr: u64,
        rkey: u32,
        read: bool,
        land: Option<RecvBuf>,
        hold: Option<Arc<Exposed>>,
    ) {
        let slot = self.slots[self.n] as usize;
        self.g.tx[slot] = TxMeta {
            rma: true,
            part: true,
            conn: NONE,
            rndv: NONE,
            ..TxMeta::default()
        };
        self.g.tx_rma[slot] = Some(RmaPiece {
            wr: RmaWr {
                local,
                len,
                addr,
                rkey,
                read,
                fence: false,
                atomic: None,
            },
            land,
            _hold: hold,
            last: 0,
            emul: None,
        });
        self.n += 1;
    }

    /// Stages the registered range `sge` in work requests of at most the device's size,
    /// to the remote range from `at` (moved past it).
    fn split(&mut self, sge: sv::Sge, hold: &Arc<Exposed>, at: &mut u64, rkey: u32, read: bool) {
        let max = self.ep.piece_max() as u64;
        let mut done = 0u64;
        loop {
            let len = (sge.length as u64 - done).min(max) as u32;
            let local = sv::Sge {
                addr: sge.addr + done,
                length: len,
                lkey: sge.lkey,
            };
            self.push(Some(local), len, *at, rkey, read, None, Some(hold.clone()));
            *at += len as u64;
            done += len as u64;
            if done >= sge.length as u64 {
                return;
            }
        }
    }

    /// Gives the buffers back (nothing was posted) and returns `e`.
    fn abandon(mut self, e: Error) -> Error {
        let held: Vec<_> = (0..self.taken)
            .map(|i| release_tx(&mut self.g, self.slots[i]))
            .collect();
        drop(self.g);
        drop(held);
        e
    }

    /// The last staged slot carries the operation's completion (`user`); the first its
    /// fence. Then all go to the peer in order.
    fn finish(mut self, user: TxMeta, flags: Flags) -> Result<()> {
        let n = self.n;
        debug_assert_eq!(n, self.taken);
        let last = self.slots[n - 1] as usize;
        let m = &mut self.g.tx[last];
        *m = TxMeta {
            rma: m.rma,
            wire: m.wire,
            conn: NONE,
            rndv: NONE,
            part: false,
            ..user
        };
        for &s in &self.slots[..n - 1] {
            if let Some(p) = self.g.tx_rma[s as usize].as_mut() {
                p.last = last as u32 + 1;
            }
        }
        if flags.contains(Flags::FENCE) {
            let first = self.slots[0] as usize;
            if let Some(p) = self.g.tx_rma[first].as_mut() {
                p.wr.fence = true;
            }
        }
        let Pieces {
            ep,
            en,
            g,
            peer,
            slots,
            ..
        } = self;
        let path = g.peers[peer as usize].link.send_path();
        ep.dispatch(en, g, peer, path, &slots[..n], None)
    }
}

/// Where a read's range may land directly: an application region the device may write.
impl RecvBuf {
    fn writable(&self) -> bool {
        matches!(self, RecvBuf::Region { mr, .. } if mr.access() & sv::access::LOCAL_WRITE != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_data_is_its_own_operation_on_the_wire() {
        let h = Header {
            op: Op::WriteData,
            tag: 4096,
            data: Some(u64::MAX),
            len: 0,
            ack: None,
            total: 0,
            peer: false,
        };
        let back = Header::decode(&h.encode(), Header::LEN).unwrap();
        assert_eq!(back, h);
        assert!(!back.op.tagged());
    }
}
