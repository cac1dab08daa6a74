//! Reliable connectionless endpoints (`FI_EP_RDM`, DESIGN.md decision 11): RC connections
//! made on first use from either side, provider bounce buffers on one SRQ per endpoint
//! (receive memory O(1) in peers), and software matching in `core::srx`.
//!
//! Small messages travel eagerly: a header (`core::rdm::Header`) and the payload, copied
//! into a registered send buffer, so application buffers need no registration; middle sizes
//! go in several such buffers (segments), larger ones are read by the receiver (rendezvous).
//! Peers on this host go over a local path (the shm peer, `local`) when one is attached.
//!
//! Locks: `Inner` is taken inside a CQ poll (owned completions), so nothing that holds it
//! may take a CQ lock: completions made outside a poll are written once it is released,
//! and connections are opened and bound outside it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;
use rfabric_sys::lock::{Lock, LockGuard};
use rfabric_sys::mem::{append_from, copy, copy_in, ForeignBuf, Place};
use rfabric_sys::verbs::{self as sv, send_flags, WorkCompletion};

use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::eq::EqEvent;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::{EpType, Flags};
use crate::core::info::{Info, RxAttr};
use crate::core::rdm::{
    host_id, Fin, FixedRing, Header, HeaderBase, Op, PeerLink, RdmName, ReadPlan, Request, Rts,
    RtsRange, SendPath, RTS_RANGES_MAX,
};
use crate::core::srx::{
    Arrival, Entry as RxEntry, Filter, Kind as RxKind, Posted, Recv, RxEngine, ADDR_UNSPEC,
};
use crate::verbs::cntr::{Counter, EpCounters};
use crate::verbs::cq::{Owned, PeerProgress, PeerTransferSink, QpnHash, ReadSink, RecvOwner};
use crate::verbs::ep_common::{check_send_flags, lock, region_post_error, CqBinding};
use crate::verbs::eq::ConnRequest;
use crate::verbs::wr_id::{self, Kind};
use crate::verbs::{
    AddressVector, CompletionQueue, Domain, EqAttr, EventQueue, MemoryRegion, MsgEndpoint,
    PassiveEndpoint, SharedRxContext,
};

mod local;
mod rma;
pub use local::{Driven, LocalEntry, LocalOwner, LocalPath, LocalSend};
use local::{LocalLink, LOCAL_HOLDER};
pub use rma::AtomicCall;

/// The context of the listener's events on the endpoint's own EQ (connections use their
/// index).
const LISTENER: u64 = u64::MAX >> 8;

/// Bytes of each bounce buffer, header included (`FI_RVERBS_RDM_BUFFER_SIZE`): a segment
/// (header and payload) fills whole 1 KiB, 2 KiB and 4 KiB packets, and a message that
/// goes without its header (`eager_now`) takes the whole buffer: 16 KiB (libfabric's rxm
/// eager limit too) is one send, not three segments with an ACK each.
const BUFFER_SIZE_DEFAULT: usize = 16384;

/// Bytes at the start of each bounce buffer kept in the receive pool's head area
/// (`Enabled::rx_head`; `FI_RVERBS_RDM_RX_HEAD`): a message this size or smaller, header
/// and all, touches one page that 15 other buffers share.
const RX_HEAD: usize = 256;

/// `FI_RVERBS_RDM_RX_HEAD`: 0 (one piece per buffer) up to the buffer's size less one.
fn rx_head(slot: usize) -> Result<usize> {
    match crate::core::env::get_usize_or("FI_RVERBS_RDM_RX_HEAD", RX_HEAD)? {
        n if n < slot => Ok(n),
        n => Err(Error::new(
            errno::EINVAL,
            format!(
                "FI_RVERBS_RDM_RX_HEAD={n}: use 0 to {} bytes (below FI_RVERBS_RDM_BUFFER_SIZE)",
                slot - 1
            ),
        )),
    }
}

fn buffer_size() -> Result<usize> {
    match crate::core::env::get_usize_or("FI_RVERBS_RDM_BUFFER_SIZE", BUFFER_SIZE_DEFAULT)? {
        n @ 256..=1048576 => Ok(n),
        n => Err(Error::new(
            errno::EINVAL,
            format!("FI_RVERBS_RDM_BUFFER_SIZE={n}: use 256 to 1048576 bytes"),
        )),
    }
}

/// The largest message the eager protocol carries: a bounce buffer less its header.
pub(crate) fn eager_size() -> Result<usize> {
    Ok(buffer_size()? - Header::LEN)
}

/// Ranges a send may gather (`tx_attr.iov_limit`): as many as an announcement lists in one
/// bounce buffer, at most [`RTS_RANGES_MAX`] (32 with the default buffers).
pub(crate) fn tx_iov_limit() -> Result<usize> {
    let room = buffer_size()? - Header::LEN - Rts::LEN;
    Ok((room / RtsRange::LEN).min(RTS_RANGES_MAX))
}

/// RDMA reads one rendezvous message may take, at most, for the RDM `max_msg_size`.
const READ_PIECES: usize = 16;

/// The largest RDM message for a port whose messages (one RDMA read) go up to `one` bytes:
/// [`READ_PIECES`] reads' worth, up to 1 GiB, and never less than one read.
pub(crate) fn max_msg_size(one: usize) -> usize {
    one.max(one.saturating_mul(READ_PIECES).min(1 << 30))
}

/// Rendezvous reads in flight on an endpoint, at most: each holds a place in its
/// connection's send queue and an entry of the send CQ, reserved at `fi_enable` beside the
/// send buffers'; more wait, in the order their messages matched, for one to finish.
const READS_MAX: usize = 32;

/// The most ranges one receive scatters into (`rx_attr.iov_limit`): with the scratch the
/// endpoint appends for a local message, shm's limit of 4.
pub const RX_IOV_MAX: usize = 3;

/// Where a receive's bytes go: registered memory of the application's, a C buffer, or
/// several of those filled in order ([`RecvBuf::scatter`]).
#[derive(Clone, Debug)]
pub enum RecvBuf {
    Region {
        mr: Arc<sv::MemoryRegion>,
        offset: usize,
        len: usize,
    },
    Foreign(ForeignBuf),
    Scatter(Scatter),
}

/// Two to [`RX_IOV_MAX`] ranges a receive fills in order, as one buffer (`fi_recvv`,
/// `fi_trecvmsg` with an iov): made by [`RecvBuf::scatter`], so no range is itself a list.
#[derive(Clone, Debug)]
pub struct Scatter {
    parts: Arc<[RecvBuf]>,
    len: usize,
}

impl RecvBuf {
    /// `len` bytes at `offset` of `mr`.
    pub fn region(mr: &MemoryRegion, offset: usize, len: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|e| e > mr.len()) {
            return Err(mr.range_error(offset, len));
        }
        Ok(RecvBuf::Region {
            mr: mr.sys().clone(),
            offset,
            len,
        })
    }

    /// One buffer made of `parts` in order: the part itself when there is one, else a
    /// scatter list of at most [`RX_IOV_MAX`] ranges, none of them a list.
    pub fn scatter(parts: impl IntoIterator<Item = RecvBuf>) -> Result<Self> {
        let parts: Arc<[RecvBuf]> = parts.into_iter().collect();
        let bad = |why: String| Err(Error::new(errno::EINVAL, why));
        if parts.len() > RX_IOV_MAX {
            return bad(format!(
                "a receive iov of {} ranges: at most {RX_IOV_MAX} (rx_attr.iov_limit)",
                parts.len()
            ));
        }
        if parts.iter().any(|p| matches!(p, RecvBuf::Scatter(_))) {
            return bad("a scatter list inside a scatter list".into());
        }
        let Some(len) = parts.iter().try_fold(0usize, |s, p| s.checked_add(p.len())) else {
            return bad("a receive iov larger than memory".into());
        };
        match &parts[..] {
            [] => Ok(RecvBuf::Foreign(ForeignBuf::EMPTY)),
            [one] => Ok(one.clone()),
            _ => Ok(RecvBuf::Scatter(Scatter { parts, len })),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            RecvBuf::Region { len, .. } => *len,
            RecvBuf::Foreign(f) => f.len(),
            RecvBuf::Scatter(s) => s.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn addr(&self) -> u64 {
        match self {
            RecvBuf::Region { mr, offset, .. } => mr.addr() + *offset as u64,
            RecvBuf::Foreign(f) => f.addr(),
            RecvBuf::Scatter(s) => s.parts.first().map_or(0, RecvBuf::addr),
        }
    }

    /// Its ranges, in order (itself, unless it is a scatter list).
    fn parts(&self) -> &[RecvBuf] {
        match self {
            RecvBuf::Scatter(s) => &s.parts,
            one => std::slice::from_ref(one),
        }
    }

    /// Where byte `at` of a one-range buffer is.
    fn target(&self, at: usize) -> Place<'_> {
        match self {
            RecvBuf::Region { mr, offset, .. } => Place::Region(mr, offset + at),
            RecvBuf::Foreign(f) => Place::Foreign(f, at),
            // Callers split a scatter list into its ranges first (`fill`).
            RecvBuf::Scatter(_) => Place::Foreign(&EMPTY, at),
        }
    }

    /// Writes `n` bytes from offset `at` on, with `put(to, from, k)`: `k` bytes of the
    /// source from its offset `from` to `to`, once per range they touch.
    #[inline(always)]
    fn fill(
        &self,
        at: usize,
        n: usize,
        mut put: impl FnMut(Place<'_>, usize, usize) -> std::result::Result<(), i32>,
    ) -> std::result::Result<(), i32> {
        let RecvBuf::Scatter(s) = self else {
            return put(self.target(at), 0, n);
        };
        let lens = s.parts.iter().map(RecvBuf::len);
        match walk(lens, at, n, |i, skip, k, done| {
            put(s.parts[i].target(skip), done, k)
        })? {
            done if done < n => Err(errno::EINVAL),
            _ => Ok(()),
        }
    }

    /// `(address, bytes)` of each range the `n` bytes from `at` cover, in order.
    #[inline(always)]
    fn ranges(&self, at: usize, n: usize) -> [(u64, usize); RX_IOV_MAX] {
        if matches!(self, RecvBuf::Scatter(_)) {
            return self.scatter_ranges(at, n);
        }
        // One range, as `walk` would cut it (a local arrival asks this of every receive).
        let mut out = [(0u64, 0usize); RX_IOV_MAX];
        let len = self.len();
        if at < len && n > 0 {
            out[0] = (self.addr() + at as u64, (len - at).min(n));
        }
        out
    }

    /// [`Self::ranges`] of a scatter list.
    #[inline(never)]
    fn scatter_ranges(&self, at: usize, n: usize) -> [(u64, usize); RX_IOV_MAX] {
        let mut out = [(0u64, 0usize); RX_IOV_MAX];
        let parts = self.parts();
        let mut j = 0;
        let _ = walk(parts.iter().map(RecvBuf::len), at, n, |i, skip, k, _| {
            // A scatter list holds at most RX_IOV_MAX ranges.
            if let Some(o) = out.get_mut(j) {
                *o = (parts[i].addr() + skip as u64, k);
                j += 1;
            }
            Ok::<(), ()>(())
        });
        out
    }

    /// `n` bytes from `at` for the device to write, range by range ([`Self::expose`]).
    fn expose_landing(&self, domain: &Domain, at: usize, n: usize) -> Result<(Exposed, Landing)> {
        let RecvBuf::Scatter(s) = self else {
            let (reg, sge) = self.expose(domain, at, n)?;
            return Ok((reg, Landing::One(sge)));
        };
        let (mut regs, mut sges) = (Vec::new(), Vec::new());
        walk(s.parts.iter().map(RecvBuf::len), at, n, |i, skip, k, _| {
            if k > 0 {
                let (reg, sge) = s.parts[i].expose(domain, skip, k)?;
                regs.push(reg);
                sges.push(sge);
            }
            Ok::<(), Error>(())
        })?;
        Ok((Exposed::Many(regs.into()), Landing::Many(sges.into())))
    }

    /// `n` bytes at `at` for the device to write (a rendezvous read lands there): the
    /// application's own registration when it lets the device write (`FI_RECV`), else a
    /// registration for this read alone.
    fn expose(&self, domain: &Domain, at: usize, n: usize) -> Result<(Exposed, sv::Sge)> {
        let range = || {
            Error::new(
                errno::EINVAL,
                "a rendezvous read outside its receive buffer",
            )
        };
        let r = match self {
            RecvBuf::Region { mr, offset, .. } if mr.access() & sv::access::LOCAL_WRITE != 0 => {
                let sge = mr.sge(offset + at, n).ok_or_else(range)?;
                return Ok((Exposed::App(mr.clone()), sge));
            }
            RecvBuf::Region { mr, offset, .. } => {
                sv::MemoryRegion::register_view(mr, offset + at, n, sv::access::LOCAL_WRITE)
            }
            RecvBuf::Foreign(f) => {
                let b = f.slice(at, n).ok_or_else(range)?;
                let p = domain.pin(b.addr(), n, sv::access::LOCAL_WRITE)?;
                let sge = p.sge_at(b.addr(), n).ok_or_else(range)?;
                return Ok((Exposed::Pinned(p), sge));
            }
            RecvBuf::Scatter(_) => return Err(range()),
        };
        let r = r.map_err(|e| Error::os(e, "ibv_reg_mr of a receive buffer (rendezvous)"))?;
        let sge = r.sge(0, n).ok_or_else(range)?;
        Ok((Exposed::Own(r), sge))
    }
}

/// Walks `n` bytes from offset `at` of consecutive ranges of lengths `lens`: `f(i, skip,
/// k, done)` for each range `i` they touch, with `k` bytes from its offset `skip` and
/// `done` bytes before them. Returns the bytes the ranges held (less than `n` when short).
fn walk<E>(
    lens: impl Iterator<Item = usize>,
    at: usize,
    n: usize,
    mut f: impl FnMut(usize, usize, usize, usize) -> std::result::Result<(), E>,
) -> std::result::Result<usize, E> {
    let (mut skip, mut done) = (at, 0);
    for (i, len) in lens.enumerate() {
        if done == n {
            break;
        }
        if skip >= len {
            skip -= len;
            continue;
        }
        let k = (len - skip).min(n - done);
        f(i, skip, k, done)?;
        done += k;
        skip = 0;
    }
    Ok(done)
}

/// An empty buffer, for a scatter list asked for one place (never written: `fill` splits).
static EMPTY: ForeignBuf = ForeignBuf::EMPTY;

/// Where a rendezvous read lands: the receive's one range, or each range of a scatter list.
#[derive(Debug)]
enum Landing {
    One(sv::Sge),
    Many(Box<[sv::Sge]>),
}

impl Landing {
    /// Where byte `pos` lands, and how many bytes from there the range holds.
    fn at(&self, mut pos: usize) -> Option<(u64, u32, usize)> {
        match self {
            Landing::One(s) => Some((s.addr + pos as u64, s.lkey, usize::MAX)),
            Landing::Many(v) => v.iter().find_map(|s| {
                if pos < s.length as usize {
                    Some((s.addr + pos as u64, s.lkey, s.length as usize - pos))
                } else {
                    pos -= s.length as usize;
                    None
                }
            }),
        }
    }
}

/// Memory a rendezvous exposes (the sender's to the peer's read, the receiver's to the
/// read's landing): a registration for that operation alone, the application's own
/// region when its access already allows it, or a C buffer's pages (from the domain's
/// registration cache); each held until the operation ends.
#[derive(Debug)]
enum Exposed {
    Own(#[allow(dead_code)] sv::MemoryRegion),
    App(#[allow(dead_code)] Arc<sv::MemoryRegion>),
    Pinned(#[allow(dead_code)] Arc<sv::PinnedPages>),
    /// A gathered send's ranges, one exposure each.
    Many(#[allow(dead_code)] Box<[Exposed]>),
}

/// Where a send's bytes come from.
#[derive(Clone, Copy)]
enum Src<'a> {
    /// Borrowed for the call: copied (eager or segmented) or refused (larger).
    Slices(&'a [&'a [u8]]),
    Region(&'a MemoryRegion, usize, usize),
    /// An application buffer valid until the send completes (C callers).
    Foreign(ForeignBuf),
    /// Application buffers gathered in order, valid until the send completes (C callers'
    /// `fi_sendv`, `fi_sendmsg`).
    Iov(&'a [ForeignBuf]),
}

impl Src<'_> {
    fn len(&self) -> usize {
        match self {
            Src::Slices(v) => v.iter().map(|b| b.len()).sum(),
            Src::Region(_, _, len) => *len,
            Src::Foreign(f) => f.len(),
            Src::Iov(v) => v.iter().map(ForeignBuf::len).sum(),
        }
    }

    /// Copies the bytes to `at` in `pool`.
    #[inline]
    fn copy_to(&self, pool: &MemoryRegion, mut at: usize) -> Result<()> {
        let to = |at| Place::Region(pool.sys(), at);
        match self {
            Src::Slices(v) => v.iter().try_for_each(|b| {
                pool.write_at(at, b)?;
                at += b.len();
                Ok(())
            }),
            Src::Region(mr, off, len) => copy(Place::Region(mr.sys(), *off), to(at), *len)
                .map_err(|_| mr.range_error(*off, *len)),
            Src::Foreign(f) => copy(Place::Foreign(f, 0), to(at), f.len())
                .map_err(|e| Error::os(e, "copying a send buffer")),
            Src::Iov(_) => self.copy_gathered(pool, at),
        }
    }

    /// Posts the bytes as one inline send on `qp` (no header: `imm` says it), when they are
    /// one range that fits the QP's inline size; `None` when they must be copied instead.
    #[inline(always)]
    fn post_inline(&self, qp: &sv::QpHandle, wr: u64, flags: u32, imm: u32) -> Option<Result<()>> {
        let r = match self {
            Src::Region(mr, off, len) if *len <= qp.max_inline() as usize => qp
                .post_send_mr(wr, mr.sys(), *off, *len, flags, Some(imm))
                .map_err(|e| region_post_error(e, mr, *off, *len, "send")),
            Src::Foreign(f) if f.len() <= qp.max_inline() as usize => qp
                .post_send_inline_foreign(wr, f, flags, Some(imm))
                .map_err(|e| Error::os(e, "ibv_post_send")),
            Src::Slices([b]) if b.len() <= qp.max_inline() as usize => qp
                .post_send_inline(wr, b, flags, Some(imm))
                .map_err(|e| Error::os(e, "ibv_post_send")),
            _ => return None,
        };
        Some(r)
    }

    /// `copy_to` of a gathered send (kept out of the one-buffer path).
    #[cold]
    #[inline(never)]
    fn copy_gathered(&self, pool: &MemoryRegion, at: usize) -> Result<()> {
        self.copy_range_to(pool, at, 0, self.len())
    }

    /// Copies `n` bytes from offset `from` to `at` in `pool` (one segment).
    fn copy_range_to(&self, pool: &MemoryRegion, at: usize, from: usize, n: usize) -> Result<()> {
        let to = Place::Region(pool.sys(), at);
        match self {
            Src::Slices(v) => walk(v.iter().map(|b| b.len()), from, n, |i, skip, k, done| {
                pool.write_at(at + done, &v[i][skip..skip + k])
            })
            .map(drop),
            Src::Region(mr, off, _) => copy(Place::Region(mr.sys(), off + from), to, n)
                .map_err(|_| mr.range_error(off + from, n)),
            Src::Foreign(f) => copy(Place::Foreign(f, from), to, n)
                .map_err(|e| Error::os(e, "copying a send buffer")),
            Src::Iov(v) => walk(
                v.iter().map(ForeignBuf::len),
                from,
                n,
                |i, skip, k, done| {
                    let to = Place::Region(pool.sys(), at + done);
                    copy(Place::Foreign(&v[i], skip), to, k)
                        .map_err(|e| Error::os(e, "copying a send buffer"))
                },
            )
            .map(drop),
        }
    }

    /// The bytes for one peer to read (rendezvous), and the ranges the announcement names:
    /// the application's own registration when it grants remote read (`FI_REMOTE_READ`),
    /// else a registration for this send alone; each non-empty range of a gathered C send
    /// (listed when there are two or more). A borrowed slice cannot be read later.
    fn expose(&self, domain: &Domain) -> Result<(Exposed, Remote)> {
        let len = self.len() as u64;
        let one = |addr, rkey| Remote::One(RtsRange { addr, len, rkey });
        if let Src::Region(mr, off, len) = self {
            let m = mr.sys();
            if m.access() & sv::access::REMOTE_READ != 0 {
                let sge = m
                    .sge(*off, *len)
                    .ok_or_else(|| mr.range_error(*off, *len))?;
                return Ok((Exposed::App(m.clone()), one(sge.addr, m.rkey())));
            }
        }
        let r = match self {
            Src::Slices(_) => {
                return Err(Error::new(
                    errno::EMSGSIZE,
                    "a message larger than the segmented size (FI_RVERBS_RDM_SEGMENTED_MAX) cannot be sent from a borrowed slice (it would be read after the call returns): send it from a MemoryRegion with send_region",
                ))
            }
            Src::Region(mr, off, len) => {
                sv::MemoryRegion::register_view(mr.sys(), *off, *len, sv::access::REMOTE_READ)
            }
            Src::Foreign(f) => {
                let p = domain.pin(f.addr(), f.len(), sv::access::REMOTE_READ)?;
                let rkey = p.rkey();
                return Ok((Exposed::Pinned(p), one(f.addr(), rkey)));
            }
            Src::Iov(v) => return expose_gathered(v, domain),
        };
        let r = r.map_err(|e| Error::os(e, "ibv_reg_mr of a send buffer (rendezvous)"))?;
        let (addr, rkey) = (r.addr(), r.rkey());
        Ok((Exposed::Own(r), one(addr, rkey)))
    }
}

/// `Src::expose` of a gathered C send: each non-empty range registered (one with bytes
/// is announced as a plain send).
#[cold]
fn expose_gathered(v: &[ForeignBuf], domain: &Domain) -> Result<(Exposed, Remote)> {
    let parts = v.iter().filter(|f| !f.is_empty());
    if let (Some(one), None) = (parts.clone().next(), parts.clone().nth(1)) {
        return Src::Foreign(*one).expose(domain);
    }
    let mut regs = Vec::with_capacity(v.len());
    let mut ranges = Vec::with_capacity(v.len());
    for f in parts {
        let p = domain.pin(f.addr(), f.len(), sv::access::REMOTE_READ)?;
        ranges.push(RtsRange {
            addr: f.addr(),
            len: f.len() as u64,
            rkey: p.rkey(),
        });
        regs.push(Exposed::Pinned(p));
    }
    Ok((Exposed::Many(regs.into()), Remote::Many(ranges.into())))
}

/// Where a queue pair's messages come from: the peer (kept after its connection went, for
/// messages still in the CQ) and the connection while it is installed (`NONE` after), and
/// what the headers that came on it last said (messages without one read it).
#[derive(Clone, Copy, Debug)]
struct QpRoute {
    peer: u32,
    conn: u32,
    base: HeaderBase,
}

/// A send buffer in flight.
#[derive(Clone, Copy, Debug, Default)]
struct TxMeta {
    context: u64,
    flags: Flags,
    tag: u64,
    data: u64,
    /// No success completion wanted (`fi_inject`, or selective completion without
    /// `FI_COMPLETION`).
    quiet: bool,
    /// The connection it was posted on (`u32::MAX` while it waits for one).
    conn: u32,
    /// The rendezvous send it announces (`NONE` for an eager message or a notice).
    rndv: u32,
    /// Bytes it puts on the wire (header and body).
    wire: u32,
    /// A segment before a segmented message's last: it completes nothing, and its failure
    /// is reported by the last segment's (flushed with it).
    part: bool,
    /// Its place in its connection's send queue (`Conn::seq` when posted).
    seq: u64,
    /// A peer provider's transfer: its completion goes to the transfer link.
    peer: bool,
    /// An RDMA write or read (its work request is `Inner::tx_rma`'s entry), not a message.
    rma: bool,
    /// An eager message whose header its connection's base takes once posted
    /// (`Header::sets_base`).
    sets_base: bool,
}

/// Quiet sends (no completion wanted) left unsignalled in a row per connection, at most: the
/// next is signalled, and its completion frees them all (RC completes a queue's sends in order).
const UNSIGNALED_MAX: usize = 32;

/// Unsignalled sends a connection holds, at most: several runs, so that a stream does not go
/// signalled while the completion closing its previous run is still unread.
const UNSIGNALED_HELD: usize = 128;

/// Segments of one segmented message, at most.
const MAX_SEGS: usize = 64;

/// The largest message sent in segments (`FI_RVERBS_RDM_SEGMENTED_MAX`); larger ones
/// go by rendezvous. Unset, it is 64 KiB or 64 buffers' worth, whichever is less: a
/// smaller `FI_RVERBS_RDM_BUFFER_SIZE` alone never makes the default invalid.
fn segmented_max(eager: usize) -> Result<usize> {
    let max = eager * MAX_SEGS;
    match crate::core::env::get_usize("FI_RVERBS_RDM_SEGMENTED_MAX")? {
        None => Ok(max.min(65536)),
        Some(n) if n <= max => Ok(n),
        Some(n) => Err(Error::new(
            errno::EINVAL,
            format!("FI_RVERBS_RDM_SEGMENTED_MAX={n}: at most {MAX_SEGS} bounce buffers ({max} bytes); 0 turns segments off"),
        )),
    }
}

/// Copies a segmented message into bounce buffers `slots` (the first segment says the
/// message's size); the last carries the send's completion (and its notice handle `ack`).
#[allow(clippy::too_many_arguments)]
fn stage_segments(
    en: &Enabled,
    g: &mut Inner,
    slots: &[u32],
    src: &Src<'_>,
    op: Op,
    tag: u64,
    data: Option<u64>,
    ack: Option<u32>,
    user: TxMeta,
) -> Result<()> {
    let eager = en.slot - Header::LEN;
    let len = src.len();
    let last = slots.len() - 1;
    for (i, &s) in slots.iter().enumerate() {
        let from = i * eager;
        let n = eager.min(len - from);
        let hdr = if i == 0 {
            Header {
                op: if op.tagged() { Op::SegTag } else { Op::SegMsg },
                tag,
                data,
                len: n as u32,
                ack,
                total: len as u32,
                peer: user.peer,
            }
        } else {
            Header {
                op: Op::Cont,
                tag: 0,
                data: None,
                len: n as u32,
                ack: None,
                total: 0,
                peer: user.peer,
            }
        };
        g.tx[s as usize] = match (i == last, ack) {
            (true, None) => user,
            (true, Some(id)) => TxMeta {
                quiet: true,
                rndv: id,
                ..user
            },
            (false, _) => TxMeta {
                quiet: true,
                part: true,
                ..user
            },
        };
        // The first segment's header sets its connection's base once posted, as an eager
        // one's does (`Header::sets_base`).
        g.tx[s as usize].sets_base = i == 0 && hdr.sets_base();
        g.tx[s as usize].wire = (Header::LEN + n) as u32;
        let off = s as usize * en.slot;
        en.tx_pool.write_at(off, &hdr.encode())?;
        src.copy_range_to(&en.tx_pool, off + Header::LEN, from, n)?;
    }
    Ok(())
}

/// Stages the announcement of a rendezvous send of `len` bytes in send buffer `slot`: its
/// exposed memory `reg` (held until the receiver's notice) and the ranges it names.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn stage_rts(
    en: &Enabled,
    g: &mut Inner,
    slot: u32,
    reg: Exposed,
    remote: Remote,
    op: Op,
    tag: u64,
    data: Option<u64>,
    len: usize,
    user: TxMeta,
) -> Result<()> {
    let off = slot as usize * en.slot;
    // A gathered send lists its ranges after the head (whose own are unused).
    let (addr, rkey, ranges) = match &remote {
        Remote::One(r) => (r.addr, r.rkey, &[][..]),
        Remote::Many(v) => (0, 0, &v[..]),
    };
    let body = Rts::LEN + ranges.len() * RtsRange::LEN;
    let id = g.sends.insert(RndvSend {
        meta: user,
        _reg: Some(reg),
    });
    let rts = Rts {
        addr,
        rkey,
        size: len as u64,
        id,
    };
    g.tx[slot as usize] = TxMeta {
        quiet: true,
        rndv: id,
        wire: (Header::LEN + body) as u32,
        ..user
    };
    let hdr = Header {
        op: if op.tagged() { Op::RtsTag } else { Op::RtsMsg },
        tag,
        data,
        len: body as u32,
        ack: None,
        total: 0,
        peer: user.peer,
    };
    let at = off + Header::LEN + Rts::LEN;
    en.tx_pool
        .write_at(off, &hdr.encode())
        .and_then(|_| en.tx_pool.write_at(off + Header::LEN, &rts.encode()))
        .and_then(|_| {
            ranges
                .iter()
                .enumerate()
                .try_for_each(|(i, r)| en.tx_pool.write_at(at + i * RtsRange::LEN, &r.encode()))
        })
}

const NONE: u32 = u32::MAX;

/// What a received bounce buffer holds beyond its header: its remote CQ data, a
/// rendezvous announcement, and the connection it came on.
#[derive(Clone, Copy, Debug, Default)]
struct RxMeta {
    data: Option<u64>,
    rts: Option<Rts>,
    /// The sender's `FI_DELIVERY_COMPLETE` handle, for the notice once delivered.
    ack: Option<u32>,
    conn: u32,
    /// An unexpected message that keeps its bounce buffer until a receive takes it.
    held: bool,
    /// A gathered announcement's ranges, listed after its head in the buffer (0: the head
    /// names the one range).
    ranges: u8,
    /// Where the message's bytes begin in its bounce buffer: past its header (short or
    /// full), or at 0 for one that came without.
    body: u8,
}

impl RxMeta {
    /// Where the message's bytes begin in its bounce buffer.
    #[inline]
    fn body(&self) -> usize {
        self.body as usize
    }
}

/// A segmented message being put together from its segments.
#[derive(Debug)]
struct Asm {
    into: AsmInto,
    /// The message's size, as its first segment said.
    total: usize,
    /// Bytes of it come so far.
    got: usize,
    /// A copy into the receive's buffer failed: it completes in error.
    failed: bool,
    kind: RxKind,
    tag: u64,
    addr: u64,
    meta: RxMeta,
}

/// Where a segmented message's bytes go as they come.
#[derive(Debug, Clone, Copy)]
enum AsmInto {
    /// A copy aside (`Inner::spill` index): the message arrives once whole.
    Spill(usize),
    /// The buffer of the receive (claimed engine entry) it matched on its first segment.
    Recv(u32),
}

/// A large send waiting for its receiver to read it and say so.
#[derive(Debug)]
struct RndvSend {
    meta: TxMeta,
    /// Exposed to the peer's read until the notice comes (none for an eager message sent
    /// with `FI_DELIVERY_COMPLETE`, which waits for the same notice).
    _reg: Option<Exposed>,
}

/// What a rendezvous reads (the sender's memory, as its announcement names it): one range,
/// or a gathered send's list.
#[derive(Debug)]
enum Remote {
    One(RtsRange),
    Many(Box<[RtsRange]>),
}

impl Remote {
    fn ranges(&self) -> &[RtsRange] {
        match self {
            Remote::One(r) => std::slice::from_ref(r),
            Remote::Many(v) => v,
        }
    }
}

/// A rendezvous read under way, for a matched receive: the sender's ranges, read in order
/// into the receive's buffer in pieces of at most the port's message size, at most
/// [`READS_MAX`] pieces of the endpoint's reads in flight at a time.
#[derive(Debug)]
struct RndvRead {
    context: u64,
    flags: Flags,
    tag: u64,
    data: Option<u64>,
    from: u64,
    /// The message's size and what of it the buffer takes.
    size: usize,
    n: usize,
    quiet: bool,
    conn: u32,
    /// The sender's handle, echoed in the notice.
    id: u32,
    /// A peer's transfer: its completion goes to the transfer link.
    peer: bool,
    remote: Remote,
    /// The receive's buffer as the device writes it (its first `n` bytes).
    local: Landing,
    /// The pieces posted so far, and the next.
    plan: ReadPlan,
    /// Pieces posted and not completed.
    out: u32,
    /// In `Inner::read_wait`: pieces of it remain to be posted.
    waiting: bool,
    /// The first failure (a libfabric errno; 0 for none): no piece is posted after it.
    status: i32,
    _reg: Option<Exposed>,
}

impl RndvRead {
    /// Nothing of it in flight or left to post: its receive completes.
    fn finished(&self) -> bool {
        self.out == 0 && !self.waiting
    }

    /// The notice that tells the sender it is done (its status: 0, or why it failed).
    fn tell_sender(&self, en: &Enabled, g: &mut Inner) {
        let fin = Fin {
            id: self.id,
            status: self.status,
        };
        queue_fin(en, g, self.conn, fin);
    }
}

/// Slots reused by index, for in-flight operations.
#[derive(Debug)]
struct Slab<T> {
    v: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            v: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    fn insert(&mut self, t: T) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.v[i as usize] = Some(t);
                i
            }
            None => {
                self.v.push(Some(t));
                self.v.len() as u32 - 1
            }
        }
    }

    fn take(&mut self, i: u32) -> Option<T> {
        let t = self.v.get_mut(i as usize)?.take();
        if t.is_some() {
            self.free.push(i);
        }
        t
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        self.v.get_mut(i as usize)?.as_mut()
    }

    /// Takes every entry out (the endpoint closing).
    fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.free.clear();
        self.v.drain(..).flatten()
    }
}

#[derive(Debug)]
struct Peer {
    name: RdmName,
    bytes: [u8; RdmName::LEN],
    /// Its address in the endpoint's AV (`FI_ADDR_NOTAVAIL` until found there).
    addr: u64,
    link: PeerLink<u32>,
    /// Send buffers waiting for the link.
    waiting: VecDeque<u32>,
    /// Connects refused since the first (nobody listening at the peer's address yet):
    /// when that was, when to try again, and how many tries so far.
    refused: Option<Refused>,
}

/// A peer whose connect was refused, tried again until [`connect_retry_budget`] has passed
/// since the first refusal: a server started a moment after its client (fabtests' scripts,
/// a job launcher) is reached rather than failed.
#[derive(Clone, Copy, Debug)]
struct Refused {
    first: std::time::Instant,
    /// `None` while the connect that tries again is under way.
    next: Option<std::time::Instant>,
    tries: u32,
}

/// How long refused connects to a peer are tried again (`FI_RVERBS_RDM_CONNECT_RETRY_MS`,
/// default 2000; 0 fails the waiting sends at the first refusal).
fn connect_retry_budget() -> std::time::Duration {
    let ms = crate::core::env::get_usize_or("FI_RVERBS_RDM_CONNECT_RETRY_MS", 2000).unwrap_or_else(
        |e| {
            crate::fi_warn!("rdm", "{e}: refused connects are tried again for 2000 ms");
            2000
        },
    );
    std::time::Duration::from_millis(ms as u64)
}

// An open connection (the state every message finds) stays inline, with its ring of
// unsignalled sends: a box would cost a pointer chase per post and per completion.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum ConnSlot {
    /// Being opened outside the lock.
    Opening {
        peer: u32,
    },
    Open(Conn),
}

#[derive(Debug)]
struct Conn {
    ep: MsgEndpoint,
    peer: u32,
    /// Sends posted and not yet completed: the connection goes once it is down and this is 0.
    in_flight: u32,
    down: bool,
    /// Sends posted so far (the next one's `TxMeta::seq`).
    seq: u64,
    /// Quiet sends posted unsignalled, oldest first: the low 32 bits of their `seq` (fewer
    /// than 2^31 are ever in flight, so they order by wrapping difference) and their send
    /// buffer. A later completion on this connection (a signalled send's, or a flushed one's)
    /// frees them.
    unsignaled: FixedRing<(u32, u32), UNSIGNALED_HELD>,
    /// How many of the last of those came after the connection's last signalled send: no
    /// completion is due to free them yet.
    run: u32,
    /// What this side's headers last said, which lets later messages go without one.
    tx_base: HeaderBase,
}

impl Conn {
    /// Whether a send with nothing to report (`quiet`) goes unsignalled here; `room`: the
    /// endpoint's own bound (`unsignaled_room`).
    #[inline(always)]
    fn unsignaled_ok(&self, quiet: bool, room: bool) -> bool {
        quiet
            && room
            && (self.run as usize) + 1 < UNSIGNALED_MAX
            && self.unsignaled.len() < UNSIGNALED_HELD
    }

    /// Send buffer `slot`, just posted (`unsignaled` as `unsignaled_ok` said): its place in
    /// the queue, and the change in the endpoint's count of unsignalled sends no completion
    /// is due to free (`Inner::unsignaled`): one more, or the run this signalled send closes.
    #[inline(always)]
    fn posted(&mut self, slot: u32, unsignaled: bool) -> (u64, i32) {
        self.in_flight += 1;
        let seq = self.seq;
        self.seq += 1;
        if unsignaled && self.unsignaled.push_back((seq as u32, slot)) {
            self.run += 1;
            return (seq, 1);
        }
        (seq, -(std::mem::take(&mut self.run) as i32))
    }
}

/// Whether the endpoint may leave one more send unsignalled (a quarter of its buffers).
#[inline(always)]
fn unsignaled_room(g: &Inner) -> bool {
    (g.unsignaled as usize) < g.tx.len() / 4
}

/// `Inner::unsignaled` after `Conn::posted` said `d`.
#[inline(always)]
fn count_unsignaled(g: &mut Inner, d: i32) {
    g.unsignaled = g.unsignaled.wrapping_add_signed(d);
}

#[derive(Debug)]
struct Inner {
    engine: RxEngine<RecvBuf>,
    peers: Vec<Peer>,
    by_name: HashMap<[u8; RdmName::LEN], u32>,
    conns: Vec<Option<ConnSlot>>,
    /// The peer behind each queue pair ever connected (messages may still be polled after
    /// their connection went); the CQs route these QPs' completions here until close.
    qpns: HashMap<u32, QpRoute, QpnHash>,
    /// The last message's queue pair and its route: consecutive messages mostly come on
    /// one connection, which then costs no hashing. Cleared whenever `qpns` changes.
    last_route: Option<(u32, QpRoute)>,
    tx_free: Vec<u32>,
    tx: Vec<TxMeta>,
    /// The RDMA work request of each send buffer carrying one (`TxMeta::rma`).
    tx_rma: Vec<Option<rma::RmaPiece>>,
    /// By the send buffer of an operation's last work request: how an earlier part of it
    /// failed (a work completion status; 0 for none). The parts after that one are flushed,
    /// so it, not the flush, is the operation's error.
    tx_failed: Vec<u32>,
    rx: Vec<RxMeta>,
    sends: Slab<RndvSend>,
    reads: Slab<RndvRead>,
    /// Rendezvous reads with pieces left to post, oldest first, and the pieces of all
    /// reads in flight (at most `READS_MAX`).
    read_wait: VecDeque<u32>,
    reads_out: u32,
    /// Reads that failed to post a piece outside a completion of theirs, finished (their
    /// receives completed) by the next progress call.
    reads_failed: Vec<u32>,
    /// Receive completions found in a completion handler, written by the next progress
    /// call (`park_done`).
    done_parked: Vec<Done>,
    /// Notices waiting for a send buffer, by connection.
    fins: VecDeque<(u32, Fin)>,
    /// Messages set aside by `FI_PEEK|FI_CLAIM`, by the claiming context.
    claimed: HashMap<u64, u32>,
    /// Bounce buffers held by unexpected messages. Past half of them, unexpected messages
    /// are copied aside (`spill`) and their buffers go back to the SRQ at once: a flood of
    /// unexpected messages never leaves the endpoint without buffers to receive the
    /// messages its application waits for (as MPI's unexpected floods would).
    held: u32,
    /// Messages copied aside, as holders `rx_n + i` (their metadata in `rx` there too).
    spill: Vec<Vec<u8>>,
    spill_free: Vec<u32>,
    /// Segmented messages being put together, by the queue pair they arrive on.
    asm: HashMap<u32, Asm, QpnHash>,
    /// Peer by AV index (`NONE` where unknown), valid while the AV's removal count is
    /// `addr_gen`.
    addr_peer: Vec<u32>,
    addr_gen: u64,
    /// Send buffers held by unsignalled sends after their connection's last signalled one
    /// (`Conn::run`), all connections: kept below a quarter of them, so that connections that
    /// go quiet cannot hold the buffers others need.
    unsignaled: u32,
    /// Matched receives the local path is filling, by engine slot.
    local_rx: Vec<local::LocalRx>,
    /// The endpoint's address of each local path handle (its arrivals' sources).
    local_from: local::LocalFrom,
    /// Remote CQ data of unexpected local messages, by engine slot (`FI_PEEK` reports it).
    local_data: HashMap<u32, u64, QpnHash>,
    /// Bounce buffers done with and not yet on the SRQ: posted `Enabled::repost_batch` at a
    /// time, in one call (`repost`).
    repost: Vec<u32>,
}

#[derive(Debug)]
struct Enabled {
    /// First to go: connections (their QPs) before the SRQ and buffers they use.
    inner: Lock<Inner>,
    pep: PassiveEndpoint,
    eq: Arc<EventQueue>,
    name: RdmName,
    bytes: [u8; RdmName::LEN],
    srx: Arc<SharedRxContext>,
    rx_pool: MemoryRegion,
    tx_pool: MemoryRegion,
    slot: usize,
    /// Bounce buffers on the SRQ (holders below this are bounce buffers).
    rx_n: usize,
    /// The first bytes of each bounce buffer (`FI_RVERBS_RDM_RX_HEAD`, or 0 when the device
    /// takes one element per SRQ receive) lie in a compact area at the pool's start, the rest behind
    /// it (`rx_pieces`): a small message lands in a page that the next 15 share, instead
    /// of a page of its own 16 KiB from the last one's.
    rx_head: usize,
    /// Bounce buffers reposted together (`repost`); 1: each at once.
    repost_batch: usize,
    /// Messages up to this size larger than a bounce buffer go in segments (never more
    /// segments than send buffers).
    seg_max: usize,
    tx_cq: Arc<CompletionQueue>,
    rx_cq: Arc<CompletionQueue>,
    av: Arc<AddressVector>,
    domain: Arc<Domain>,
    /// The most one RDMA read moves (the port's `max_msg_sz`): a rendezvous read's pieces.
    read_max: usize,
    /// `ep_attr.max_msg_size`, checked by every send.
    max_msg: usize,
    tx_selective: bool,
    rx_selective: bool,
    /// Connections opened, for tests and logs; while 0, no device completion of this
    /// endpoint can be waiting (`PeerProgress::progress` skips the other CQ).
    opened: AtomicU32,
    /// Notices wait for a send buffer (checked without the lock).
    fins_waiting: std::sync::atomic::AtomicBool,
    /// `Inner::reads_failed` or `Inner::done_parked` hold receives to finish (checked
    /// without the lock).
    parked: AtomicBool,
    /// Connections being set up: while any is, every progress call reads the connection
    /// events; otherwise one in `CM_POLL_EVERY` does, at most once per `CM_POLL_GAP` (a read
    /// is a system call).
    in_setup: AtomicU32,
    /// Peers whose refused connect waits to be tried again (`retry_refused`).
    retrying: AtomicU32,
    polls: AtomicU32,
    /// When the next look at connection events may be (`rfabric_sys::clock::cycles`).
    cm_next: AtomicU64,
    /// Its connection events' descriptor is in its CQs' wait sets (`add_wait_fd`): the
    /// receive CQ's, and with two CQs the send CQ's.
    cm_wakes: [bool; 2],
    /// With two CQs, each one's completion channel is in the other's wait set
    /// (`add_bell_fd`): the send CQ's in the receive CQ's, the receive CQ's in the send CQ's.
    other_wakes: [bool; 2],
    /// What its work request ids carry for its CQs to find it (`wr_id::keyed`).
    key: u32,
    /// `FI_DIRECTED_RECV` in its caps: receives filter by source.
    directed: bool,
    /// `FI_MULTI_RECV` in `rx_attr.op_flags`: every untagged receive is a multi-receive.
    multi_recv_default: bool,
    /// Counters bound to it; with one counting transmits, every send is signalled (an
    /// unsignalled one would complete uncounted).
    cntrs: EpCounters,
    tx_counted: bool,
    /// Peers on this host go over it (`RdmEndpoint::set_local_path`).
    local: OnceLock<LocalLink>,
    /// A peer provider's transfers over it (`FI_PEER_TRANSFER`): where their completions
    /// go, and those waiting to go there (delivered at the next progress call, with no
    /// lock held: the peer's callbacks may post or read CQs).
    transfers: Mutex<Transfers>,
    transfer_open: AtomicBool,
}

/// A peer provider's transfer link (`RdmEndpoint::peer_transfer`).
#[derive(Default)]
struct Transfers {
    sink: Option<Weak<dyn PeerTransferSink>>,
    /// Completions for the peer, with their sources, in order.
    out: VecDeque<(std::result::Result<CqEntry, CqErrEntry>, u64)>,
}

impl std::fmt::Debug for Transfers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfers")
            .field("open", &self.sink.is_some())
            .field("waiting", &self.out.len())
            .finish()
    }
}

/// Queues a completion of a peer's transfer for its link (delivered by `deliver_transfers`).
fn to_transfer(en: &Enabled, c: std::result::Result<CqEntry, CqErrEntry>, src: u64) {
    let mut t = lock(&en.transfers);
    if t.sink.is_some() {
        t.out.push_back((c, src));
    }
}

/// Hands the peer what completed for it, one at a time with no lock held (its callbacks
/// may post again, or read the CQs).
fn deliver_transfers(en: &Enabled) {
    loop {
        let (sink, c) = {
            let mut t = lock(&en.transfers);
            let Some(c) = t.out.pop_front() else { return };
            (t.sink.clone(), c)
        };
        match sink.and_then(|w| w.upgrade()) {
            Some(s) => s.completion(c.0, c.1),
            None => crate::fi_info!("rdm", "a completion of a closed peer transfer link dropped"),
        }
    }
}

/// How often an idle endpoint's progress looks for connection events (requests from new
/// peers, disconnects): one call in this many.
const CM_POLL_EVERY: u32 = 64;

/// At most one look at connection events in this many cycles of the TSC while no
/// connection is being set up (0.3 to 1 ms on TSCs of 1 to 3 GHz; 1 ms where `cycles` is a
/// clock in nanoseconds).
const CM_POLL_GAP: u64 = 1 << 20;

/// With a local path (every read drives the endpoint, and a read can take a few
/// microseconds): one look at connection events in this many calls.
const CM_POLL_EVERY_LOCAL: u32 = 256;

#[derive(Debug, Default)]
struct Ctl {
    av: Option<Arc<AddressVector>>,
    min_multi_recv: Option<usize>,
    cqs: CqBinding,
    tx_selective: bool,
    rx_selective: bool,
}

#[derive(Debug)]
struct Shared {
    me: Weak<Shared>,
    on: OnceLock<Enabled>,
    ctl: Mutex<Ctl>,
    info: Info,
    domain: Arc<Domain>,
}

/// A reliable connectionless endpoint (`fi_endpoint` with `FI_EP_RDM`).
#[derive(Debug)]
pub struct RdmEndpoint {
    sh: Arc<Shared>,
    /// A peer provider's handle ([`Self::peer_transfer`]): what it posts is matched and
    /// completed apart from the application's, and dropping it closes nothing.
    peer: bool,
}

fn not_enabled() -> Error {
    Error::new(
        errno::EOPBADSTATE,
        "endpoint not enabled: bind an AV and CQs, then enable it",
    )
}

/// A process-unique nonce for names: the process id and a counter.
fn nonce() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::process::id().rotate_left(12) ^ NEXT.fetch_add(1, Ordering::Relaxed)
}

fn this_host() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    host_id(boot.as_deref(), host.trim())
}

impl RdmEndpoint {
    /// Opens an RDM endpoint on `domain` with the attributes of `info` (an RDM info).
    pub fn open(domain: &Arc<Domain>, info: &Info) -> Result<Self> {
        if info.ep_attr.ep_type != EpType::Rdm {
            return Err(Error::new(
                errno::EINVAL,
                format!("{:?} info given to an RDM endpoint", info.ep_attr.ep_type),
            ));
        }
        Ok(RdmEndpoint {
            sh: Arc::new_cyclic(|me| Shared {
                me: me.clone(),
                on: OnceLock::new(),
                ctl: Mutex::default(),
                info: info.clone(),
                domain: domain.clone(),
            }),
            peer: false,
        })
    }

    /// A handle on this endpoint for a peer provider (fi_peer(3) `FI_PEER_TRANSFER`): what
    /// it sends and receives through the handle goes over the endpoint's connections
    /// (never its local path), is matched apart from the application's traffic (a flag in
    /// the header: neither takes the other's receives), and completes to `sink`, never on
    /// the endpoint's CQs. One link per endpoint; [`Self::end_peer_transfer`] ends it.
    pub(crate) fn peer_transfer(&self, sink: Weak<dyn PeerTransferSink>) -> Result<RdmEndpoint> {
        if self.peer {
            return Err(Error::new(errno::EINVAL, "this is already a peer's handle"));
        }
        let en = self.en()?;
        {
            let mut t = lock(&en.transfers);
            if t.sink.is_some() {
                return Err(Error::new(
                    errno::EBUSY,
                    "the endpoint already carries a peer transfer link",
                ));
            }
            t.sink = Some(sink);
        }
        en.transfer_open.store(true, Ordering::Release);
        // Every read delivers what completed for the peer since the last one.
        en.rx_cq.want_progress(true);
        Ok(RdmEndpoint {
            sh: self.sh.clone(),
            peer: true,
        })
    }

    /// Completions a peer's transfer link may hold at once (its sends and receives).
    pub(crate) fn queue_depth(&self) -> usize {
        self.sh.info.tx_attr.size + self.sh.info.rx_attr.size
    }

    /// Ends the link [`Self::peer_transfer`] opened (on the peer's handle): the peer's
    /// receives still posted are dropped (the peer is closing; nothing of theirs reaches
    /// the application), and its messages arriving later are dropped too.
    pub(crate) fn end_peer_transfer(&self) {
        let Some(en) = self.sh.on.get() else { return };
        let was = {
            let mut t = lock(&en.transfers);
            t.out.clear();
            t.sink.take().is_some()
        };
        if !was {
            return;
        }
        en.transfer_open.store(false, Ordering::Release);
        en.rx_cq.want_progress(false);
        let (posted, held) = {
            let mut g = en.inner.lock();
            let posted = g.engine.cancel_all_of(&[RxKind::PeerMsg, RxKind::PeerTag]);
            let mut held = Vec::new();
            while let Some(id) = g
                .engine
                .first_unexpected_of(&[RxKind::PeerMsg, RxKind::PeerTag])
            {
                let _ = g.engine.take_unexpected(id);
                discard(en, &mut g, id, &mut held);
            }
            (posted, held)
        };
        if !posted.is_empty() {
            crate::fi_info!(
                "rdm",
                "{} receives of a closing peer transfer link dropped",
                posted.len()
            );
        }
        drop((posted, held));
    }

    /// Binds the address vector its destinations come from (`fi_ep_bind` of an AV).
    pub fn bind_av(&self, av: &Arc<AddressVector>) -> Result<()> {
        let mut c = lock(&self.sh.ctl);
        if self.sh.on.get().is_some() {
            return Err(Error::new(errno::EOPBADSTATE, "bind before enabling"));
        }
        if c.av.is_some() {
            return Err(Error::new(errno::EINVAL, "endpoint already bound to an AV"));
        }
        if !Arc::ptr_eq(av.domain(), &self.sh.domain) {
            return Err(Error::new(
                errno::EINVAL,
                "the AV belongs to another domain",
            ));
        }
        c.av = Some(av.clone());
        Ok(())
    }

    /// Binds a CQ for `FI_TRANSMIT` and/or `FI_RECV` completions, with
    /// `FI_SELECTIVE_COMPLETION` if asked.
    pub fn bind_cq(&self, cq: &Arc<CompletionQueue>, flags: Flags) -> Result<()> {
        let mut c = lock(&self.sh.ctl);
        if self.sh.on.get().is_some() {
            return Err(Error::new(errno::EOPBADSTATE, "bind before enabling"));
        }
        let (tx, rx) = (flags.contains(Flags::TRANSMIT), flags.contains(Flags::RECV));
        if !tx && !rx {
            return Err(Error::new(
                errno::EINVAL,
                "bind a CQ with FI_TRANSMIT and/or FI_RECV",
            ));
        }
        if (tx && c.cqs.tx_cq.is_some()) || (rx && c.cqs.rx_cq.is_some()) {
            return Err(Error::new(
                errno::EINVAL,
                "a CQ is already bound for that direction",
            ));
        }
        let sel = flags.contains(Flags::SELECTIVE_COMPLETION);
        if tx {
            cq.bind()?;
            c.cqs.tx_cq = Some(cq.clone());
            c.tx_selective = sel;
        }
        if rx {
            cq.bind()?;
            c.cqs.rx_cq = Some(cq.clone());
            c.rx_selective = sel;
        }
        Ok(())
    }

    /// `fi_ep_bind` of a counter for `FI_SEND`, `FI_RECV`, `FI_READ` and/or `FI_WRITE`,
    /// before the endpoint is enabled. The endpoint counts each operation as it finishes
    /// (selective completion and injects included), and reads of the counter drive it.
    pub fn bind_cntr(&self, cntr: &Arc<Counter>, flags: Flags) -> Result<()> {
        let mut c = lock(&self.sh.ctl);
        if self.sh.on.get().is_some() {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "bind counters before enabling the endpoint",
            ));
        }
        if !Arc::ptr_eq(cntr.domain(), &self.sh.domain) {
            return Err(Error::new(
                errno::EINVAL,
                "the counter belongs to another domain",
            ));
        }
        let rma_event = self.sh.info.caps.contains(Flags::RMA_EVENT);
        c.cqs.bind_cntr(cntr, flags, rma_event)
    }

    /// Starts the endpoint (`fi_enable`): its listener, SRQ and buffers.
    pub fn enable(&self) -> Result<()> {
        let mut c = lock(&self.sh.ctl);
        if self.sh.on.get().is_some() {
            return Ok(());
        }
        let av = c.av.clone().ok_or_else(|| {
            Error::new(
                errno::ENOAV,
                "bind an address vector before enabling an RDM endpoint",
            )
        })?;
        let info = &self.sh.info;
        let dev = self.sh.domain.device();
        let slot = buffer_size()?;
        // Buffer indices travel in work request ids below 2^24 (`wr_id::keyed`).
        let tx_n = info
            .tx_attr
            .size
            .clamp(1, (dev.attr.max_qp_wr as usize).min(1 << wr_id::INDEX_BITS));
        let rx_n = info.rx_attr.size.clamp(
            1,
            (dev.attr.max_srq_wr.max(1) as usize).min(1 << wr_id::INDEX_BITS),
        );
        // One CQ entry per send buffer, rendezvous read and SRQ receive, whatever the
        // number of peers.
        c.cqs.reserve((tx_n + READS_MAX) as u32, rx_n as u32)?;
        let reserved = (|| {
            let (Some(tx_cq), Some(rx_cq)) = (c.cqs.tx_cq.clone(), c.cqs.rx_cq.clone()) else {
                unreachable!("reserve checked both CQs are bound")
            };
            let rx_head = if dev.attr.max_srq_sge >= 2 {
                rx_head(slot)?
            } else {
                0
            };
            let srx = SharedRxContext::open(
                &self.sh.domain,
                &RxAttr {
                    size: rx_n,
                    iov_limit: if rx_head > 0 { 2 } else { 1 },
                    ..Default::default()
                },
            )?;
            let rx_pool = MemoryRegion::alloc(&self.sh.domain, rx_n * slot, Flags::RECV)?;
            // Writable by the device too: small RDMA reads land in a send buffer.
            let tx_pool =
                MemoryRegion::alloc(&self.sh.domain, tx_n * slot, Flags::SEND | Flags::RECV)?;
            let eq = EventQueue::open(self.sh.domain.fabric(), &EqAttr::default())?;
            let mut linfo = self.sh.msg_info()?;
            let ip = linfo.src_addr.map(|a| a.ip()).ok_or_else(|| {
                Error::new(
                    errno::EADDRNOTAVAIL,
                    format!(
                        "{} has no IP address: RDM endpoints connect through rdma_cm",
                        dev.name
                    ),
                )
            })?;
            // The listener takes the port the info names (`fi_getinfo` with `FI_SOURCE` and a
            // service: a server at a well-known port, as fabtests' are), else one of its own.
            let port = info.src_addr.map_or(0, |a| a.port());
            linfo.src_addr = Some(std::net::SocketAddr::new(ip, port));
            let pep = PassiveEndpoint::open(self.sh.domain.fabric(), &linfo, LISTENER)?;
            pep.bind_eq(&eq)?;
            // Every peer of a job may connect at once (an all-to-all's first round).
            pep.set_backlog(1024)?;
            pep.listen()?;
            let at = pep
                .getname()
                .ok_or_else(|| Error::new(errno::EADDRNOTAVAIL, "the listener has no address"))?;
            let name = RdmName {
                rma_event: info.caps.contains(Flags::RMA_EVENT),
                ..RdmName::new(at, this_host(), nonce())
            };
            let mut engine = RxEngine::new(rx_n + info.rx_attr.size.max(1));
            if let Some(n) = c.min_multi_recv {
                engine.set_min_multi_recv(n);
            }
            Ok::<_, Error>(Enabled {
                inner: Lock::new(Inner {
                    engine,
                    peers: Vec::new(),
                    by_name: HashMap::new(),
                    conns: Vec::new(),
                    qpns: HashMap::default(),
                    last_route: None,
                    sends: Slab::default(),
                    reads: Slab::default(),
                    read_wait: VecDeque::new(),
                    reads_out: 0,
                    reads_failed: Vec::new(),
                    done_parked: Vec::new(),
                    fins: VecDeque::new(),
                    claimed: HashMap::new(),
                    addr_peer: Vec::new(),
                    held: 0,
                    spill: Vec::new(),
                    spill_free: Vec::new(),
                    asm: HashMap::default(),
                    addr_gen: 0,
                    unsignaled: 0,
                    local_rx: Vec::new(),
                    local_from: local::LocalFrom::default(),
                    local_data: HashMap::default(),
                    repost: Vec::with_capacity(repost_batch(rx_n)),
                    tx_free: (0..tx_n as u32).rev().collect(),
                    tx: vec![TxMeta::default(); tx_n],
                    tx_rma: (0..tx_n).map(|_| None).collect(),
                    tx_failed: vec![0; tx_n],
                    rx: vec![RxMeta::default(); rx_n],
                }),
                pep,
                eq,
                name,
                bytes: name.to_bytes(),
                srx,
                rx_pool,
                tx_pool,
                slot,
                rx_n,
                rx_head,
                repost_batch: repost_batch(rx_n),
                seg_max: segmented_max(slot - Header::LEN)?.min((slot - Header::LEN) * tx_n),
                tx_cq,
                rx_cq,
                av,
                domain: self.sh.domain.clone(),
                read_max: self.read_max(),
                max_msg: self.max_msg_size(),
                tx_selective: c.tx_selective,
                rx_selective: c.rx_selective,
                opened: AtomicU32::new(0),
                fins_waiting: std::sync::atomic::AtomicBool::new(false),
                parked: AtomicBool::new(false),
                in_setup: AtomicU32::new(0),
                retrying: AtomicU32::new(0),
                polls: AtomicU32::new(0),
                cm_next: AtomicU64::new(0),
                cm_wakes: [false; 2],
                other_wakes: [false; 2],
                key: crate::verbs::cq::new_owner_key(),
                directed: (info.caps | info.rx_attr.caps).contains(Flags::DIRECTED_RECV),
                multi_recv_default: info.rx_attr.op_flags.contains(Flags::MULTI_RECV),
                cntrs: c.cqs.cntrs().clone(),
                tx_counted: c.cqs.cntrs().counts_transmits(),
                local: OnceLock::new(),
                transfers: Mutex::default(),
                transfer_open: AtomicBool::new(false),
            })
        })();
        let en = match reserved {
            Ok(en) => en,
            Err(e) => {
                c.cqs.unreserve();
                return Err(e);
            }
        };
        // Reads of its CQs drive it; until it is enabled, that does nothing. With separate
        // CQs each read drives the other CQ too, so both need every read.
        let me: Weak<dyn PeerProgress> = self.sh.me.clone();
        let split = !Arc::ptr_eq(&en.rx_cq, &en.tx_cq);
        // Its completions (every connection's) find it by the key their ids carry.
        let owner: Weak<dyn RecvOwner> = self.sh.me.clone();
        en.rx_cq.register_keyed_owner(en.key, owner.clone());
        if split {
            en.tx_cq.register_keyed_owner(en.key, owner);
        }
        let ready = en
            .rx_cq
            .add_peer(me.clone(), split)
            .and_then(|()| {
                if split {
                    en.tx_cq.add_peer(me.clone(), true)
                } else {
                    Ok(())
                }
            })
            .and_then(|()| (0..rx_n as u32).try_for_each(|i| post_bounce(&en, i)));
        if let Err(e) = ready {
            en.rx_cq.remove_peer(&me);
            en.tx_cq.remove_peer(&me);
            en.rx_cq.unregister_keyed_owner(en.key);
            en.tx_cq.unregister_keyed_owner(en.key);
            c.cqs.unreserve();
            return Err(e);
        }
        // Counter reads drive the endpoint through its CQs, as CQ reads do; those bound to
        // regions through the CQ its write notices arrive at.
        for cntr in en.cntrs.all() {
            cntr.feed_from(&en.tx_cq);
            cntr.feed_from(&en.rx_cq);
        }
        en.domain.add_write_target(&en.rx_cq);
        let mut en = en;
        (en.cm_wakes, en.other_wakes) = watch_for_sleepers(&en, split);
        let _ = self.sh.on.set(en);
        let Some(en) = self.sh.on.get() else {
            unreachable!()
        };
        crate::fi_info!(
            "rdm",
            "RDM endpoint {} enabled: {} send and {} receive buffers of {} bytes",
            en.name.to_str(),
            tx_n,
            rx_n,
            slot
        );
        Ok(())
    }

    fn en(&self) -> Result<&Enabled> {
        self.sh.on.get().ok_or_else(not_enabled)
    }

    /// The endpoint's name (`fi_getname`): what peers insert into their AVs.
    pub fn getname(&self) -> Result<RdmName> {
        Ok(self.en()?.name)
    }

    /// `fi_getname` into a C buffer, with fi_cm(3)'s `addrlen` rules.
    pub fn getname_into(&self, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        crate::core::addr::fill_name(&self.getname()?.to_bytes(), buf, addrlen)
    }

    /// The largest message it carries (`ep_attr.max_msg_size`): larger than the eager
    /// size, the receiver reads it (rendezvous), in pieces of at most [`Self::read_max`].
    pub fn max_msg_size(&self) -> usize {
        max_msg_size(self.read_max())
    }

    /// The most one RDMA work request moves: the port's `max_msg_sz`.
    pub(crate) fn read_max(&self) -> usize {
        (self.sh.domain.device().port.max_msg_sz as usize).clamp(1, u32::MAX as usize)
    }

    /// `fi_inject` size: every message up to the eager size is copied at once.
    pub fn inject_size(&self) -> usize {
        self.sh.on.get().map_or_else(
            || eager_size().unwrap_or(BUFFER_SIZE_DEFAULT - Header::LEN),
            |en| en.slot - Header::LEN,
        )
    }

    /// A send from an application buffer valid until the send completes (C callers'
    /// `fi_send`, `fi_tsend`, …): copied when it is eager or segmented, read by the receiver
    /// (rendezvous) when it is larger. `tag` makes it tagged.
    pub fn send_foreign(
        &self,
        buf: ForeignBuf,
        dest: u64,
        tag: Option<u64>,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        self.post_to(Src::Foreign(buf), dest, tag, data, context, flags)
    }

    /// A send gathered from application buffers valid until it completes (C callers'
    /// `fi_sendv`, `fi_sendmsg`, …): copied when eager or segmented; larger, the receiver
    /// reads the ranges in order (rendezvous). At most `tx_attr.iov_limit` ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn send_foreign_iov(
        &self,
        bufs: &[ForeignBuf],
        dest: u64,
        tag: Option<u64>,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        let limit = tx_iov_limit()?;
        if bufs.len() > limit {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "a send iov of {} ranges: at most {limit} (tx_attr.iov_limit)",
                    bufs.len()
                ),
            ));
        }
        self.post_to(Src::Iov(bufs), dest, tag, data, context, flags)
    }

    /// Bytes of registered memory it receives into: its bounce buffers, fixed at enable
    /// whatever the number of peers.
    pub fn receive_memory(&self) -> usize {
        self.sh.on.get().map_or(0, |en| en.rx_pool.len())
    }

    /// Whether a verbs connection to the peer at `addr` is up (tests and diagnostics).
    pub fn connected(&self, addr: u64) -> bool {
        let Some(en) = self.sh.on.get() else {
            return false;
        };
        let Ok(name) = en.av.rdm_name(addr) else {
            return false;
        };
        let g = en.inner.lock();
        g.by_name
            .get(&name.to_bytes())
            .is_some_and(|&p| matches!(g.peers[p as usize].link.send_path(), SendPath::Post(_)))
    }

    /// Connections made so far (from either side).
    pub fn connections_opened(&self) -> u32 {
        self.sh
            .on
            .get()
            .map_or(0, |e| e.opened.load(Ordering::Relaxed))
    }

    /// Send buffers free now, and all there are (for tests and logs: every buffer comes
    /// back once what it carried is done).
    pub fn send_buffers(&self) -> (usize, usize) {
        self.sh.on.get().map_or((0, 0), |e| {
            let g = e.inner.lock();
            (g.tx_free.len(), g.tx.len())
        })
    }

    /// Sends posted unsignalled whose buffers no completion has freed yet, all connections
    /// (tests and diagnostics).
    pub fn unsignaled_sends(&self) -> usize {
        self.sh.on.get().map_or(0, |e| {
            let g = e.inner.lock();
            g.conns
                .iter()
                .filter_map(|c| match c {
                    Some(ConnSlot::Open(conn)) => Some(conn.unsignaled.len()),
                    _ => None,
                })
                .sum()
        })
    }

    /// The flags of sends made by calls without a flags argument (`fi_send`, `fi_tsend`, …):
    /// the completion flags of `tx_attr.op_flags` (fi_endpoint(3)). Open MPI binds its CQ
    /// with `FI_SELECTIVE_COMPLETION` and asks for `FI_COMPLETION` there.
    pub fn tx_default(&self) -> Flags {
        self.sh.info.tx_attr.op_flags
            & (Flags::COMPLETION
                | Flags::INJECT_COMPLETE
                | Flags::TRANSMIT_COMPLETE
                | Flags::DELIVERY_COMPLETE)
    }

    /// The flags of receives made by calls without a flags argument: `FI_COMPLETION` of
    /// `rx_attr.op_flags` (its `FI_MULTI_RECV` applies to untagged receives in `recvmsg`).
    pub fn rx_default(&self) -> Flags {
        self.sh.info.rx_attr.op_flags & Flags::COMPLETION
    }

    /// `fi_send`.
    pub fn send(&self, buf: &[u8], dest: u64, context: u64) -> Result<()> {
        self.sendmsg(&[buf], dest, None, None, context, self.tx_default())
    }

    /// `fi_senddata`: with `FI_REMOTE_CQ_DATA`.
    pub fn senddata(&self, buf: &[u8], data: u64, dest: u64, context: u64) -> Result<()> {
        self.sendmsg(&[buf], dest, None, Some(data), context, self.tx_default())
    }

    /// `fi_tsend`.
    pub fn tsend(&self, buf: &[u8], tag: u64, dest: u64, context: u64) -> Result<()> {
        self.sendmsg(&[buf], dest, Some(tag), None, context, self.tx_default())
    }

    /// `fi_tsenddata`.
    pub fn tsenddata(
        &self,
        buf: &[u8],
        data: u64,
        tag: u64,
        dest: u64,
        context: u64,
    ) -> Result<()> {
        self.sendmsg(
            &[buf],
            dest,
            Some(tag),
            Some(data),
            context,
            self.tx_default(),
        )
    }

    /// `fi_inject`: the buffer is free at return and no completion is written (a
    /// `sendmsg` with `FI_INJECT` frees the buffer too, but completes as any send).
    pub fn inject(&self, buf: &[u8], dest: u64) -> Result<()> {
        self.inject_to(buf, dest, None, None)
    }

    /// `fi_tinject`.
    pub fn tinject(&self, buf: &[u8], tag: u64, dest: u64) -> Result<()> {
        self.inject_to(buf, dest, Some(tag), None)
    }

    /// `fi_injectdata`: `inject` with remote CQ data.
    pub fn injectdata(&self, buf: &[u8], data: u64, dest: u64) -> Result<()> {
        self.inject_to(buf, dest, None, Some(data))
    }

    /// `fi_tinjectdata`.
    pub fn tinjectdata(&self, buf: &[u8], data: u64, tag: u64, dest: u64) -> Result<()> {
        self.inject_to(buf, dest, Some(tag), Some(data))
    }

    fn inject_to(&self, buf: &[u8], dest: u64, tag: Option<u64>, data: Option<u64>) -> Result<()> {
        // A peer on this host: to the local path at once (a peer's transfers go over verbs;
        // the default delivery completion waits for the path's completion).
        if let (Some(en), false) = (self.sh.on.get(), self.peer) {
            if let Some(l) = en.local.get() {
                if !self
                    .sh
                    .info
                    .tx_attr
                    .op_flags
                    .contains(Flags::DELIVERY_COMPLETE)
                {
                    if let Some(r) = local::inject_call(en, l, buf, dest, tag, data) {
                        return r;
                    }
                }
            }
        }
        let flags = if data.is_some() {
            Flags::INJECT | Flags::REMOTE_CQ_DATA
        } else {
            Flags::INJECT
        };
        let op = if tag.is_some() { Op::Tag } else { Op::Msg };
        let src = Src::Slices(&[buf]);
        self.post(src, dest, op, tag.unwrap_or(0), data, 0, flags, true)
    }

    /// `fi_sendmsg` / `fi_tsendmsg` (with `tag`): gathered from `iov`, with `data` as
    /// `FI_REMOTE_CQ_DATA`, and `flags` (`FI_INJECT`, `FI_COMPLETION`, …).
    pub fn sendmsg(
        &self,
        iov: &[&[u8]],
        dest: u64,
        tag: Option<u64>,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        self.post_to(Src::Slices(iov), dest, tag, data, context, flags)
    }

    /// A send of `len` bytes at `offset` of a registered region (`FI_MR_LOCAL` callers,
    /// and the tools): `tag` makes it tagged; `flags` as [`Self::sendmsg`].
    #[allow(clippy::too_many_arguments)]
    pub fn send_region(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        dest: u64,
        tag: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        self.post_to(
            Src::Region(mr, offset, len),
            dest,
            tag,
            None,
            context,
            flags,
        )
    }

    /// Posts a send: tagged with `tag`, untagged without.
    fn post_to(
        &self,
        src: Src<'_>,
        dest: u64,
        tag: Option<u64>,
        data: Option<u64>,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        let op = if tag.is_some() { Op::Tag } else { Op::Msg };
        self.post(src, dest, op, tag.unwrap_or(0), data, context, flags, false)
    }

    /// The common send in the fewest steps: an application's, with `FI_INJECT`,
    /// `FI_COMPLETION` and `FI_REMOTE_CQ_DATA` at most (an inject call's too), one buffer's
    /// worth, to a peer over verbs whose connection is up and explains it without a header
    /// (`eager_now`). `None`, with nothing changed, sends it the general way (which checks
    /// everything again and says what is wrong).
    ///
    /// A send to a peer on this host goes to the local path here in one step
    /// (`local::inject_now`) when it is copied during the call.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn post_now(
        &self,
        src: &Src<'_>,
        dest: u64,
        op: Op,
        tag: u64,
        data: Option<u64>,
        context: u64,
        flags: Flags,
        inject_call: bool,
    ) -> Option<Result<()>> {
        let en = self.sh.on.get()?;
        let len = src.len();
        if self
            .sh
            .info
            .tx_attr
            .op_flags
            .contains(Flags::DELIVERY_COMPLETE)
            || wr_id::check(context).is_err()
        {
            return None;
        }
        // A peer on this host goes over shm: at once when it is copied during the call,
        // else the general way.
        if let Some(l) = en.local.get() {
            let sent = l.with_route(en, dest, |to, bell| {
                local::inject_now(
                    en,
                    l,
                    to,
                    bell,
                    src,
                    len,
                    op,
                    tag,
                    data,
                    context,
                    flags,
                    inject_call,
                )
            });
            if let Some(r) = sent {
                return r;
            }
        }
        // One buffer's worth (the inject size too), its flags `FI_INJECT` (copied here
        // anyway), `FI_COMPLETION` and `FI_REMOTE_CQ_DATA` at most: MPI's small sends are
        // `fi_tinjectdata`.
        if len > en.slot - Header::LEN {
            return None;
        }
        let inject = if inject_call {
            Flags::INJECT
        } else {
            Flags::empty()
        };
        let quiet = inject_call || (en.tx_selective && !flags.contains(Flags::COMPLETION));
        let mut g = en.inner.lock();
        let peer = peer_of(en, &mut g, dest).ok()?;
        let SendPath::Post(c) = g.peers[peer as usize].link.send_path() else {
            return None;
        };
        let user = send_meta(op, tag, data, context, inject, quiet, false);
        eager_now(en, &mut g, c, src, len, op, user, data)
    }

    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        src: Src<'_>,
        dest: u64,
        op: Op,
        tag: u64,
        data: Option<u64>,
        context: u64,
        flags: Flags,
        inject_call: bool,
    ) -> Result<()> {
        // `FI_REMOTE_CQ_DATA` says no more than `data` does.
        let plain = flags - (Flags::INJECT | Flags::COMPLETION);
        let plain = if data.is_some() {
            plain - Flags::REMOTE_CQ_DATA
        } else {
            plain
        };
        if plain.is_empty() && !self.peer {
            let now = self.post_now(&src, dest, op, tag, data, context, flags, inject_call);
            if let Some(r) = now {
                return r;
            }
        }
        wr_id::check(context)?;
        // The endpoint's default completion level applies to sends that name none.
        let dc = self.sh.info.tx_attr.op_flags & Flags::DELIVERY_COMPLETE;
        let len = src.len();
        // A send with no flags of its own (`fi_send`, `fi_tsend` by default) has nothing to
        // check: its completion level is the default, and it is quiet under selective
        // completion.
        let (en, flags, quiet) = if flags.is_empty() && !self.peer {
            let en = self.en()?;
            (en, dc, en.tx_selective)
        } else {
            check_send_flags(flags)?;
            let flags = if flags.intersects(
                Flags::INJECT_COMPLETE | Flags::TRANSMIT_COMPLETE | Flags::DELIVERY_COMPLETE,
            ) {
                flags
            } else {
                flags | dc
            };
            let en = self.en()?;
            let eager = en.slot - Header::LEN;
            if flags.contains(Flags::INJECT) && len > eager && len <= en.max_msg {
                return Err(Error::new(
                    errno::EINVAL,
                    format!("FI_INJECT of {len} bytes: the inject size is {eager}"),
                ));
            }
            // A peer's transfers always complete to it (its callbacks count on them).
            let quiet = inject_call
                || (!self.peer && en.tx_selective && !flags.contains(Flags::COMPLETION));
            (en, flags, quiet)
        };
        let eager = en.slot - Header::LEN;
        let max = en.max_msg;
        if len > max {
            return Err(Error::new(
                errno::EMSGSIZE,
                format!(
                    "a {len}-byte message: RDM messages are at most {max} bytes (max_msg_size)"
                ),
            ));
        }
        let user = send_meta(
            op,
            tag,
            data,
            context,
            // Marks an inject call: its failure has no context to report it by.
            if inject_call {
                Flags::INJECT
            } else {
                Flags::empty()
            },
            quiet,
            self.peer,
        );
        // Up to the segmented size, in several bounce buffers; larger, announced and read by
        // the receiver once matched.
        let segs = if len > eager && len <= seg_max(en, &src, eager) {
            len.div_ceil(eager)
        } else {
            1
        };
        // Kept from one buffer by its header alone (a 16 KiB message in 16 KiB buffers): it
        // goes bare when its connection's base explains it (`eager_now`), else in segments.
        let bare = segs > 1 && len <= en.slot;
        // A peer's transfers go over the endpoint's connections (verbs) only.
        if let Some(l) = en.local.get().filter(|_| !self.peer) {
            let sent = l.with_route(en, dest, |to, bell| {
                local::post_local(en, l, to, bell, &src, len, user, data, flags)
            });
            if let Some(sent) = sent {
                if sent? {
                    return Ok(());
                }
            }
        }
        let reg = if len > eager && segs == 1 {
            Some(src.expose(&self.sh.domain)?)
        } else {
            None
        };
        let mut g = en.inner.lock();
        let peer = peer_of(en, &mut g, dest)?;
        let path = g.peers[peer as usize].link.send_path();
        // Before the buffer count: a bare send needs one buffer, not its segments' count
        // (`eager_now` declines when none is free).
        if let (SendPath::Post(c), None) = (path, &reg) {
            if (segs == 1 || bare) && !user.peer && !flags.contains(Flags::DELIVERY_COMPLETE) {
                if let Some(r) = eager_now(en, &mut g, c, &src, len, op, user, data) {
                    return r;
                }
            }
        }
        if g.tx_free.len() < segs {
            return Err(Error::new(
                errno::EAGAIN,
                "every send buffer is in flight: read the CQ to complete some",
            ));
        }
        // One buffer (the common case) without setting up the array segments need.
        let (one, mut many);
        let slots: &[u32] = if segs == 1 {
            one = [g.tx_free.pop().unwrap_or_default()];
            &one
        } else {
            many = [0u32; MAX_SEGS];
            for x in &mut many[..segs] {
                *x = g.tx_free.pop().unwrap_or_default();
            }
            &many[..segs]
        };
        // The last buffer carries the send's completion.
        let slot = slots[segs - 1];
        let off = slot as usize * en.slot;
        // The immediate an eager message goes with instead of its header (`HeaderBase`).
        let mut imm = None;
        let copied = match reg {
            None if segs > 1 => {
                let ack = flags.contains(Flags::DELIVERY_COMPLETE).then(|| {
                    g.sends.insert(RndvSend {
                        meta: user,
                        _reg: None,
                    })
                });
                let r = stage_segments(en, &mut g, slots, &src, op, tag, data, ack, user);
                if r.is_err() {
                    // Nothing is posted: the notice handle goes with the buffers.
                    if let Some(id) = ack {
                        drop(g.sends.take(id));
                    }
                    g.tx[slot as usize].rndv = NONE;
                }
                r
            }
            None => {
                // FI_DELIVERY_COMPLETE: the send completes on the receiver's notice, sent
                // once the message is in the receive's buffer.
                let ack = flags.contains(Flags::DELIVERY_COMPLETE).then(|| {
                    g.sends.insert(RndvSend {
                        meta: user,
                        _reg: None,
                    })
                });
                g.tx[slot as usize] = match ack {
                    Some(id) => TxMeta {
                        quiet: true,
                        rndv: id,
                        ..user
                    },
                    None => user,
                };
                let hdr = Header {
                    op,
                    tag,
                    data,
                    len: len as u32,
                    ack,
                    total: 0,
                    peer: user.peer,
                };
                // No header at all when the connection it goes on at once has said the
                // rest (`HeaderBase`); else its header, which then sets the base.
                let sets = hdr.sets_base();
                imm = match (sets, path) {
                    (true, SendPath::Post(c)) => open_conn_mut(&mut g, c)
                        .and_then(|k| k.tx_base.imm(op == Op::Tag, tag, data)),
                    _ => None,
                };
                let head = match imm {
                    Some(_) => Ok(0),
                    None => write_header(en, off, &hdr),
                };
                head.and_then(|n| {
                    let t = &mut g.tx[slot as usize];
                    t.wire = (n + len) as u32;
                    t.sets_base = sets && imm.is_none();
                    src.copy_to(&en.tx_pool, off + n)
                })
            }
            Some((reg, remote)) => {
                stage_rts(en, &mut g, slot, reg, remote, op, tag, data, len, user)
            }
        };
        if let Err(e) = copied {
            let regs: Vec<_> = slots.iter().map(|s| release_tx(&mut g, *s)).collect();
            drop(g);
            drop(regs);
            return Err(e);
        }
        self.dispatch(en, g, peer, path, slots, imm)
    }

    /// Sends the staged send buffers `slots` to `peer`, in order: posted on its connection,
    /// queued while one is being made, or queued behind a connection this starts.
    #[inline(always)]
    fn dispatch(
        &self,
        en: &Enabled,
        mut g: LockGuard<'_, Inner>,
        peer: u32,
        path: SendPath<u32>,
        slots: &[u32],
        imm: Option<u32>,
    ) -> Result<()> {
        match path {
            SendPath::Post(c) if slots.len() == 1 => {
                if let Err(e) = post_on_inline(en, &mut g, c, slots[0], imm) {
                    let reg = release_tx(&mut g, slots[0]);
                    drop(g);
                    drop(reg);
                    return Err(e);
                }
                Ok(())
            }
            SendPath::Post(c) => {
                for (i, s) in slots.iter().enumerate() {
                    if let Err(e) = post_on(en, &mut g, c, *s) {
                        // What was posted completes quietly (its connection is failing).
                        let regs: Vec<_> =
                            slots[i..].iter().map(|s| release_tx(&mut g, *s)).collect();
                        drop(g);
                        drop(regs);
                        return Err(e);
                    }
                }
                Ok(())
            }
            SendPath::Wait => {
                g.peers[peer as usize].waiting.extend(slots.iter().copied());
                Ok(())
            }
            SendPath::Connect => self.connect_first(en, g, peer, slots),
        }
    }

    /// The first send to `peer` (its buffers `slots` staged): [`Shared::connect_first`].
    #[cold]
    #[inline(never)]
    fn connect_first(
        &self,
        en: &Enabled,
        g: LockGuard<'_, Inner>,
        peer: u32,
        slots: &[u32],
    ) -> Result<()> {
        self.sh.connect_first(en, g, peer, slots)
    }

    /// `fi_recv`: a receive from `from` (`FI_ADDR_UNSPEC`: anyone).
    #[inline(always)]
    pub fn recv(&self, buf: RecvBuf, from: u64, context: u64) -> Result<()> {
        self.recv_default(buf, RxKind::Msg, from, 0, 0, context)
    }

    /// `fi_trecv`: a receive of tags equal to `tag` outside the `ignore` bits.
    #[inline(always)]
    pub fn trecv(
        &self,
        buf: RecvBuf,
        from: u64,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<()> {
        self.recv_default(buf, RxKind::Tag, from, tag, ignore, context)
    }

    /// `fi_recv` / `fi_trecv`: a receive with the default flags (`FI_COMPLETION` at most),
    /// which need none of `recvmsg`'s checks, straight to the engine; a peer's transfer
    /// and an untagged receive under a default `FI_MULTI_RECV` go the general way.
    #[inline(always)]
    fn recv_default(
        &self,
        buf: RecvBuf,
        kind: RxKind,
        from: u64,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<()> {
        let flags = self.rx_default();
        wr_id::check(context)?;
        let en = self.en()?;
        if self.peer || (kind == RxKind::Msg && en.multi_recv_default) {
            return self.recvmsg(buf, kind, from, tag, ignore, context, flags);
        }
        // A directed receive's source is proven in the AV under the engine's lock, where
        // the send path's cache of AV indexes answers without the AV's (MPI's receives all
        // name their source).
        let directed = from != ADDR_UNSPEC && en.directed;
        let recv = Recv {
            kind,
            from: Filter {
                addr: if directed { from } else { ADDR_UNSPEC },
                tag,
                ignore,
            },
            size: buf.len(),
            buf,
            context,
            flags,
        };
        self.recv_one(en, recv, directed)
    }

    /// `fi_recvmsg` / `fi_trecvmsg`.
    #[allow(clippy::too_many_arguments)]
    pub fn recvmsg(
        &self,
        buf: RecvBuf,
        kind: RxKind,
        from: u64,
        tag: u64,
        ignore: u64,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        wr_id::check(context)?;
        let en = self.en()?;
        let unsupported = flags
            - (Flags::COMPLETION
                | Flags::MSG
                | Flags::TAGGED
                | Flags::RECV
                | Flags::REMOTE_CQ_DATA
                | Flags::MORE
                | Flags::PEEK
                | Flags::CLAIM
                | Flags::DISCARD
                | Flags::MULTI_RECV);
        if !unsupported.is_empty() {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("receive flags {unsupported:?} are not receive flags"),
            ));
        }
        let (kind, flags) = if self.peer {
            if flags.intersects(Flags::PEEK | Flags::CLAIM | Flags::DISCARD | Flags::MULTI_RECV) {
                return Err(Error::new(
                    errno::EINVAL,
                    "FI_PEEK, FI_CLAIM, FI_DISCARD and FI_MULTI_RECV are not offered to peer transfers",
                ));
            }
            // Matched apart from the application's, and always completed to the peer.
            (RxKind::of(kind.tagged(), true), flags | Flags::COMPLETION)
        } else {
            (kind, flags)
        };
        let filter = filter(en, from, tag, ignore)?;
        if flags.contains(Flags::PEEK) {
            return self.peek(en, kind, filter, context, flags);
        }
        if flags.contains(Flags::CLAIM) {
            return self.claim(en, buf, context, flags);
        }
        if flags.contains(Flags::DISCARD) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_DISCARD goes with FI_PEEK or FI_CLAIM",
            ));
        }
        // `rx_attr.op_flags` with FI_MULTI_RECV makes every untagged receive one.
        let flags = if kind == RxKind::Msg && en.multi_recv_default {
            flags | Flags::MULTI_RECV
        } else {
            flags
        };
        if flags.contains(Flags::MULTI_RECV) && matches!(buf, RecvBuf::Scatter(_)) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_MULTI_RECV takes one buffer, not an iov of several",
            ));
        }
        let size = buf.len();
        let recv = Recv {
            kind,
            from: filter,
            buf,
            size,
            context,
            flags: flags & (Flags::COMPLETION | Flags::MULTI_RECV),
        };
        if !flags.contains(Flags::MULTI_RECV) {
            return self.recv_one(en, recv, false);
        }
        let mut g = en.inner.lock();
        // A multi-receive buffer takes as many waiting messages as fit.
        let mut took = Vec::new();
        g.engine.post(recv, |_, id| took.push(id))?;
        let mut starts = Vec::new();
        let mut take = |g: &mut Inner, id: u32| {
            if g.engine.entry(id).owner == LOCAL_HOLDER {
                starts.push((id, local::entry_of(en, g, id)));
                None
            } else {
                deliver(en, g, id)
            }
        };
        let done: Vec<_> = took.into_iter().map(|id| take(&mut g, id)).collect();
        drop(g);
        for d in done {
            write_out(&en.rx_cq, Some(d));
        }
        local::start_all(en, &starts);
        Ok(())
    }

    /// A receive that takes one message: it waits posted (the common case, which calls
    /// nothing more), or takes the first waiting message it accepts. With `check_src`, its
    /// source must be an RDM address of the AV (`filter`'s check, made here).
    #[inline(always)]
    fn recv_one(&self, en: &Enabled, recv: Recv<RecvBuf>, check_src: bool) -> Result<()> {
        let mut g = en.inner.lock();
        if check_src {
            known_source(en, &g, recv.from.addr)?;
        }
        let id = match g.engine.post_one(recv)? {
            Posted::Waiting(_) => return Ok(()),
            Posted::Claimed(id) => id,
        };
        if g.engine.entry(id).owner == LOCAL_HOLDER {
            let start = [(id, local::entry_of(en, &mut g, id))];
            drop(g);
            local::start_all(en, &start);
            return Ok(());
        }
        let done = deliver(en, &mut g, id);
        drop(g);
        write_out(&en.rx_cq, Some(done));
        Ok(())
    }

    /// `FI_PEEK`: a completion with the length, tag and data of the first waiting message
    /// the receive would take, without its bytes, or an `FI_ENOMSG` error completion when
    /// none waits. With `FI_CLAIM` the message is set aside for a later `FI_CLAIM` receive
    /// of the same context; with `FI_DISCARD` it is dropped (fi_tagged(3)).
    fn peek(
        &self,
        en: &Enabled,
        kind: RxKind,
        from: Filter,
        context: u64,
        flags: Flags,
    ) -> Result<()> {
        // What the device already holds counts as arrived.
        en.rx_cq.drive();
        let kflags = Flags::RECV
            | if kind.tagged() {
                Flags::TAGGED
            } else {
                Flags::MSG
            };
        let mut g = en.inner.lock();
        let Some(id) = g.engine.peek(kind, from) else {
            drop(g);
            return en.rx_cq.writeerr(CqErrEntry {
                op_context: context,
                flags: kflags.bits(),
                tag: from.tag,
                err: errno::ENOMSG,
                ..Default::default()
            });
        };
        let e = g.engine.entry(id).clone();
        // A local path's message: its data as the path queued it.
        let data = match e.owner {
            LOCAL_HOLDER => g.local_data.get(&id).copied(),
            o => g.rx[o as usize].data,
        };
        let mut dropped = Vec::new();
        if flags.intersects(Flags::CLAIM | Flags::DISCARD) {
            g.engine.take_unexpected(id)?;
            if flags.contains(Flags::CLAIM) {
                if let Some(old) = g.claimed.insert(context, id) {
                    // A context claims one message at a time: the older one is dropped.
                    discard(en, &mut g, old, &mut dropped);
                }
            } else {
                discard(en, &mut g, id, &mut dropped);
            }
        }
        drop(g);
        local::discard_all(en, &dropped);
        en.rx_cq.write(
            CqEntry {
                op_context: context,
                flags: (kflags
                    | if data.is_some() {
                        Flags::REMOTE_CQ_DATA
                    } else {
                        Flags::empty()
                    })
                .bits(),
                len: e.size,
                buf: 0,
                data: data.unwrap_or(0),
                tag: e.tag,
            },
            e.addr,
        )
    }

    /// `FI_CLAIM`: receives (or with `FI_DISCARD`, drops) the message an `FI_PEEK|FI_CLAIM`
    /// of the same context set aside.
    fn claim(&self, en: &Enabled, buf: RecvBuf, context: u64, flags: Flags) -> Result<()> {
        let mut g = en.inner.lock();
        let Some(id) = g.claimed.remove(&context) else {
            return Err(Error::new(
                errno::EINVAL,
                "no message was claimed with this context (FI_PEEK|FI_CLAIM comes first)",
            ));
        };
        if flags.contains(Flags::DISCARD) {
            let e = g.engine.entry(id).clone();
            let mut dropped = Vec::new();
            discard(en, &mut g, id, &mut dropped);
            drop(g);
            local::discard_all(en, &dropped);
            let kind = if e.kind.tagged() {
                Flags::TAGGED
            } else {
                Flags::MSG
            };
            return en.rx_cq.write(
                CqEntry {
                    op_context: context,
                    flags: (kind | Flags::RECV).bits(),
                    tag: e.tag,
                    ..Default::default()
                },
                e.addr,
            );
        }
        {
            let e = g.engine.entry_mut(id);
            e.buf = Some(buf);
            e.context = context;
            e.flags = flags & Flags::COMPLETION;
            e.offset = 0;
        }
        if g.engine.entry(id).owner == LOCAL_HOLDER {
            let e = local::entry_of(en, &mut g, id);
            drop(g);
            local::start_all(en, &[(id, e)]);
            return Ok(());
        }
        let done = deliver(en, &mut g, id);
        drop(g);
        write_out(&en.rx_cq, Some(done));
        Ok(())
    }

    /// `FI_OPT_MIN_MULTI_RECV`: a multi-receive buffer is released once less is left
    /// (before or after `enable`).
    pub fn set_min_multi_recv(&self, n: usize) -> Result<()> {
        let mut c = lock(&self.sh.ctl);
        c.min_multi_recv = Some(n);
        if let Some(en) = self.sh.on.get() {
            en.inner.lock().engine.set_min_multi_recv(n);
        }
        Ok(())
    }

    /// The `FI_OPT_MIN_MULTI_RECV` in force.
    pub fn min_multi_recv(&self) -> Result<usize> {
        Ok(lock(&self.sh.ctl)
            .min_multi_recv
            .unwrap_or(crate::core::srx::DEFAULT_MIN_MULTI_RECV))
    }

    /// `fi_cancel`: takes back the posted receive with `context`; its completion is an
    /// `FI_ECANCELED` error. `-FI_ENOENT` when none waits.
    pub fn cancel(&self, context: u64) -> Result<()> {
        let en = self.en()?;
        let e = en.inner.lock().engine.cancel(context);
        match e {
            Some(e) => {
                let kind = if e.kind.tagged() {
                    Flags::TAGGED
                } else {
                    Flags::MSG
                };
                en.rx_cq.writeerr(CqErrEntry {
                    op_context: context,
                    flags: (kind | Flags::RECV).bits(),
                    tag: e.tag,
                    err: errno::ECANCELED,
                    ..Default::default()
                })
            }
            None => Err(Error::new(
                errno::ENOENT,
                "no posted receive has that context",
            )),
        }
    }

    /// Drives connection events (reading a bound CQ does this too).
    pub fn progress(&self) {
        self.sh.progress();
    }

    /// What a local path calls back (its arrivals, completions).
    pub fn local_owner(&self) -> LocalOwner {
        LocalOwner {
            sh: self.sh.me.clone(),
            cqs: self
                .sh
                .on
                .get()
                .map(|en| (en.rx_cq.clone(), en.tx_cq.clone())),
        }
    }

    /// Sends to peers on this host (their names say so) over `path` from now on, and takes
    /// its arrivals: set once, after `enable` and before the first send. Every read of the
    /// endpoint's CQs drives it.
    pub fn set_local_path(&self, path: Arc<dyn LocalPath>) -> Result<()> {
        let en = self.en()?;
        if en.local.get().is_some() {
            return Err(Error::new(
                errno::EALREADY,
                "a local path is already attached",
            ));
        }
        // A blocked read of either CQ wakes when a local sender rings: the bell is in
        // both wait sets, or in none (a sleeper trusts it to wake it).
        let bell = match rfabric_sys::bell::Bell::create(&local::bell_name(&en.name)) {
            Ok(b) => {
                let mut all = true;
                for cq in en.cqs() {
                    match cq.add_bell_fd(b.fd()) {
                        Ok(w) => all &= w,
                        Err(e) => {
                            crate::fi_info!("rdm", "a blocked read polls local peers: {e}");
                            all = false;
                        }
                    }
                }
                if all {
                    Some(b)
                } else {
                    en.cqs().for_each(|cq| cq.remove_bell_fd(b.fd()));
                    None
                }
            }
            Err(e) => {
                crate::fi_info!(
                    "rdm",
                    "no bell for local senders ({}): a blocked read polls them",
                    std::io::Error::from_raw_os_error(e)
                );
                None
            }
        };
        if let Err(l) = en
            .local
            .set(LocalLink::new(path, self.max_msg_size(), bell))
        {
            if let Some(b) = &l.bell {
                en.cqs().for_each(|cq| cq.remove_bell_fd(b.fd()));
            }
            return Err(Error::new(
                errno::EALREADY,
                "a local path is already attached",
            ));
        }
        // Measured now, not in the first read it paces (the first measure sleeps 20 ms).
        let _ = local::idle_interval();
        // Driven by every read from now on (the local path's latency is a read's).
        let me: Weak<dyn PeerProgress> = self.sh.me.clone();
        for cq in [&en.rx_cq, &en.tx_cq] {
            cq.remove_peer(&me);
        }
        en.rx_cq.add_peer(me.clone(), true)?;
        if !Arc::ptr_eq(&en.rx_cq, &en.tx_cq) {
            en.tx_cq.add_peer(me, true)?;
        }
        Ok(())
    }

    /// Whether peers on this host go over a local path.
    pub fn has_local_path(&self) -> bool {
        self.sh.on.get().is_some_and(|en| en.local.get().is_some())
    }

    /// Messages its local path carried so far: (sent, arrived).
    pub fn local_messages(&self) -> (u64, u64) {
        self.sh
            .on
            .get()
            .and_then(|en| en.local.get())
            .map_or((0, 0), |l| {
                (
                    l.sent.load(Ordering::Relaxed),
                    l.arrived.load(Ordering::Relaxed),
                )
            })
    }
}

/// The peer named `name` (at `addr` in the AV, or `FI_ADDR_NOTAVAIL`), added on first use.
/// The send path's lookup: by AV index while nothing was removed from the AV (an index
/// removed and reused names someone else), else by the name the AV holds.
#[inline(always)]
fn peer_of(en: &Enabled, g: &mut Inner, addr: u64) -> Result<u32> {
    if en.av.removals() == g.addr_gen {
        if let Some(&p) = g.addr_peer.get(addr as usize) {
            if p != NONE {
                return Ok(p);
            }
        }
    }
    peer_of_slow(en, g, addr)
}

/// [`peer_of`] past its cache: the AV changed, or the address is new to it.
#[cold]
#[inline(never)]
fn peer_of_slow(en: &Enabled, g: &mut Inner, addr: u64) -> Result<u32> {
    let gen = en.av.removals();
    if gen != g.addr_gen {
        g.addr_peer.clear();
        g.addr_gen = gen;
    }
    let name = en.av.rdm_name(addr)?;
    Ok(peer_for(g, &name, addr))
}

fn peer_for(g: &mut Inner, name: &RdmName, addr: u64) -> u32 {
    let p = peer_by_name(g, name, addr);
    if addr < ADDR_CACHE as u64 {
        let i = addr as usize;
        if g.addr_peer.len() <= i {
            g.addr_peer.resize(i + 1, NONE);
        }
        g.addr_peer[i] = p;
    }
    p
}

/// Peers the send path finds by AV index without hashing their names.
const ADDR_CACHE: usize = 1 << 16;

fn peer_by_name(g: &mut Inner, name: &RdmName, addr: u64) -> u32 {
    let bytes = name.to_bytes();
    if let Some(&p) = g.by_name.get(&bytes) {
        let peer = &mut g.peers[p as usize];
        if peer.addr == FI_ADDR_NOTAVAIL {
            peer.addr = addr;
        }
        return p;
    }
    let p = g.peers.len() as u32;
    g.peers.push(Peer {
        name: *name,
        bytes,
        addr,
        link: PeerLink::default(),
        waiting: VecDeque::new(),
        refused: None,
    });
    g.by_name.insert(bytes, p);
    p
}

fn new_conn(g: &mut Inner, peer: u32) -> u32 {
    let slot = ConnSlot::Opening { peer };
    match g.conns.iter().position(Option::is_none) {
        Some(i) => {
            g.conns[i] = Some(slot);
            i as u32
        }
        None => {
            g.conns.push(Some(slot));
            g.conns.len() as u32 - 1
        }
    }
}

fn install(en: &Enabled, g: &mut Inner, c: u32, peer: u32, ep: MsgEndpoint) {
    let qpn = ep.qp().map(|q| q.qp_num()).unwrap_or(0);
    g.qpns.insert(
        qpn,
        QpRoute {
            peer,
            conn: c,
            base: HeaderBase::default(),
        },
    );
    g.last_route = None;
    g.conns[c as usize] = Some(ConnSlot::Open(Conn {
        ep,
        peer,
        in_flight: 0,
        down: false,
        seq: 0,
        unsignaled: FixedRing::default(),
        run: 0,
        tx_base: HeaderBase::default(),
    }));
    crate::fi_debug!(
        "rdm",
        "{} connection {c} (QP {qpn}) to {}",
        en.name.to_str(),
        g.peers[peer as usize].name.to_str()
    );
}

#[inline]
fn open_conn_mut(g: &mut Inner, c: u32) -> Option<&mut Conn> {
    match g.conns.get_mut(c as usize) {
        Some(Some(ConnSlot::Open(conn))) => Some(conn),
        _ => None,
    }
}

/// The largest message that goes in segments from `src` (`eager`: one buffer's payload).
/// A region that already grants remote read needs no registration for the rendezvous read,
/// which then beats copying past four buffers' worth (measured on rxe: 16 KiB in segments
/// 6-8% faster than read, 32 KiB even).
fn seg_max(en: &Enabled, src: &Src<'_>, eager: usize) -> usize {
    match src {
        Src::Region(mr, ..) if mr.sys().access() & sv::access::REMOTE_READ != 0 => {
            en.seg_max.min(4 * eager)
        }
        _ => en.seg_max,
    }
}

/// A send's `TxMeta` before it is posted: its completion's flags (`inject`: the caller's
/// `FI_INJECT`), and whether it reports nothing (`quiet`) or is a peer's transfer.
#[inline(always)]
fn send_meta(
    op: Op,
    tag: u64,
    data: Option<u64>,
    context: u64,
    inject: Flags,
    quiet: bool,
    peer: bool,
) -> TxMeta {
    let kind = if op.tagged() {
        Flags::TAGGED
    } else {
        Flags::MSG
    };
    let cq_data = if data.is_some() {
        Flags::REMOTE_CQ_DATA
    } else {
        Flags::empty()
    };
    TxMeta {
        context,
        flags: kind | Flags::SEND | inject | cq_data,
        tag,
        data: data.unwrap_or(0),
        quiet,
        conn: NONE,
        rndv: NONE,
        wire: 0,
        part: false,
        seq: 0,
        peer,
        rma: false,
        sets_base: false,
    }
}

/// The common send in one step: one buffer's worth (a whole buffer: no header takes room),
/// no header (connection `c` is open and its base explains the message: `HeaderBase::imm`),
/// inline from the application's bytes when they fit (else copied into the buffer). `None`,
/// with nothing changed, when that does not hold or no send buffer is free: the general
/// path then stages it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn eager_now(
    en: &Enabled,
    g: &mut Inner,
    c: u32,
    src: &Src<'_>,
    len: usize,
    op: Op,
    user: TxMeta,
    data: Option<u64>,
) -> Option<Result<()>> {
    let slot = *g.tx_free.last()?;
    let room = unsignaled_room(g);
    let conn = open_conn_mut(g, c)?;
    let imm = conn.tx_base.imm(op == Op::Tag, user.tag, data)?;
    let qp = conn.ep.qp().ok()?;
    let unsignaled = conn.unsignaled_ok(user.quiet && !en.tx_counted, room);
    let wr = wr_id::keyed(slot, en.key, Kind::RdmSend);
    let flags = if unsignaled { 0 } else { send_flags::SIGNALED };
    let posted = match src.post_inline(qp, wr, flags, imm) {
        Some(r) => r,
        None => {
            let off = slot as usize * en.slot;
            src.copy_to(&en.tx_pool, off).and_then(|_| {
                qp.post_send_mr(wr, en.tx_pool.sys(), off, len, flags, Some(imm))
                    .map_err(|e| Error::os(e, "ibv_post_send"))
            })
        }
    };
    if let Err(e) = posted {
        return Some(Err(e));
    }
    let (seq, d) = conn.posted(slot, unsignaled);
    count_unsignaled(g, d);
    g.tx_free.pop();
    g.tx[slot as usize] = TxMeta {
        conn: c,
        seq,
        wire: len as u32,
        ..user
    };
    Some(Ok(()))
}

/// Posts send buffer `slot` on connection `c`. A quiet eager send (nothing to report, no
/// notice to wait for) goes unsignalled while its connection and the endpoint have room
/// for one more: a productive CQ poll less per message.
#[inline(never)]
fn post_on(en: &Enabled, g: &mut Inner, c: u32, slot: u32) -> Result<()> {
    post_on_inline(en, g, c, slot, None)
}

/// `post_on`, inlined where one eager send posts its buffer: with `imm` when it goes
/// without its header (`HeaderBase`).
#[inline(always)]
fn post_on_inline(en: &Enabled, g: &mut Inner, c: u32, slot: u32, imm: Option<u32>) -> Result<()> {
    let m = &g.tx[slot as usize];
    let quiet = m.quiet && m.rndv == NONE && !m.part && !m.rma && !en.tx_counted;
    let (wire, sets) = (m.wire as usize, m.sets_base);
    let rdma = if m.rma {
        g.tx_rma[slot as usize].as_ref().map(|p| p.wr)
    } else {
        None
    };
    let room = unsignaled_room(g);
    let Some(conn) = open_conn_mut(g, c) else {
        return Err(Error::new(errno::EIO, "the peer's connection is gone"));
    };
    let unsignaled = conn.unsignaled_ok(quiet, room);
    let qp = conn.ep.qp()?;
    let wr = wr_id::keyed(slot, en.key, Kind::RdmSend);
    let off = slot as usize * en.slot;
    let flags = if unsignaled { 0 } else { send_flags::SIGNALED };
    match rdma {
        Some(w) => rma::post_wr(en, qp, wr, off, &w, flags)?,
        None => {
            qp.post_send_mr(wr, en.tx_pool.sys(), off, wire, flags, imm)
                .map_err(|e| Error::os(e, "ibv_post_send"))?;
        }
    }
    let (seq, d) = conn.posted(slot, unsignaled);
    count_unsignaled(g, d);
    let t = &mut g.tx[slot as usize];
    t.conn = c;
    t.seq = seq;
    if sets {
        note_tx_base(g, c, slot);
    }
    Ok(())
}

/// Eager send `slot`, posted on connection `c` with its header, sets the connection's base.
#[cold]
#[inline(never)]
fn note_tx_base(g: &mut Inner, c: u32, slot: u32) {
    let h = eager_header(&g.tx[slot as usize]);
    if let Some(conn) = open_conn_mut(g, c) {
        conn.tx_base.note(&h);
    }
}

/// Writes eager header `h` at `off` of the send buffers, short when it can be; returns its
/// length.
fn write_header(en: &Enabled, off: usize, h: &Header) -> Result<usize> {
    match h.encode_short() {
        Some(b) => en.tx_pool.write_at(off, &b).map(|_| Header::SHORT_LEN),
        None => en.tx_pool.write_at(off, &h.encode()).map(|_| Header::LEN),
    }
}

/// The header values of eager send `m` that its connection's base takes (`HeaderBase::note`).
#[cold]
fn eager_header(m: &TxMeta) -> Header {
    Header {
        op: if m.flags.contains(Flags::TAGGED) {
            Op::Tag
        } else {
            Op::Msg
        },
        tag: m.tag,
        data: m.flags.contains(Flags::REMOTE_CQ_DATA).then_some(m.data),
        ..Header::bare(Op::Msg)
    }
}

/// A completion of the send at `seq` on connection `c`: the unsignalled sends posted before
/// it completed too (in order, without a completion of their own), so their buffers are free.
/// The send itself, if it was unsignalled (a flushed one's error), leaves the list.
#[inline]
fn retire_unsignaled(g: &mut Inner, c: u32, seq: u64) {
    let Inner {
        conns,
        tx_free,
        unsignaled,
        ..
    } = g;
    let Some(Some(ConnSlot::Open(conn))) = conns.get_mut(c as usize) else {
        return;
    };
    let (held, seq) = (conn.unsignaled.len(), seq as u32);
    while let Some((s, slot)) = conn.unsignaled.front() {
        let after = s.wrapping_sub(seq) as i32;
        if after > 0 {
            break;
        }
        conn.unsignaled.pop_front();
        if after < 0 {
            tx_free.push(slot);
            conn.in_flight -= 1;
        }
    }
    // Those of the last `run` that left (a flushed send's error completion came first) are
    // no longer waiting for a signalled send.
    let gone = (held - conn.unsignaled.len()) as u32;
    let covered = held as u32 - conn.run;
    if gone > covered {
        conn.run -= gone - covered;
        *unsignaled -= gone - covered;
    }
}

/// Connection `c` went down with unsignalled sends whose success left no completion: a
/// signalled empty send behind them (flushed at once, the queue pair being in error) frees
/// them when its completion comes, and lets the connection go.
fn drain_unsignaled(en: &Enabled, g: &mut Inner, c: u32) {
    if open_conn_mut(g, c).is_none_or(|conn| conn.unsignaled.is_empty()) {
        return;
    }
    let Some(slot) = g.tx_free.pop() else {
        crate::fi_info!(
            "rdm",
            "connection {c} keeps its unsignalled sends' buffers until close"
        );
        return;
    };
    g.tx[slot as usize] = TxMeta {
        quiet: true,
        part: true,
        conn: NONE,
        rndv: NONE,
        wire: 0,
        ..TxMeta::default()
    };
    if let Err(e) = post_on(en, g, c, slot) {
        crate::fi_info!("rdm", "connection {c}: {e}");
        g.tx_free.push(slot);
    }
}

#[inline]
fn post_bounce(en: &Enabled, i: u32) -> Result<()> {
    if i as usize >= en.rx_n {
        return Err(Error::new(errno::EINVAL, "bounce buffer outside its pool"));
    }
    let (head, tail) = rx_sges(en, i);
    let sges = [head, tail.unwrap_or(head)];
    en.srx
        .srq()
        .post_recv(
            wr_id::keyed(i, en.key, Kind::RdmRecv),
            &sges[..1 + usize::from(tail.is_some())],
        )
        .map_err(|e| Error::os(e, "ibv_post_srq_recv"))
}

/// Frees send buffer `slot`, and the rendezvous send it announced or the RDMA work request
/// it carried (returned, to drop once the lock is released: dropping them deregisters the
/// application's buffer).
fn release_tx(g: &mut Inner, slot: u32) -> (Option<RndvSend>, Option<rma::RmaPiece>) {
    g.tx_free.push(slot);
    g.tx_failed[slot as usize] = 0; // a part's failure for a last request never posted
    let piece = if std::mem::take(&mut g.tx[slot as usize].rma) {
        g.tx_rma[slot as usize].take()
    } else {
        None
    };
    let r = std::mem::replace(&mut g.tx[slot as usize].rndv, NONE);
    if r == NONE {
        (None, piece)
    } else {
        (g.sends.take(r), piece)
    }
}

/// A send's error entry, and whether it is a peer's transfer (see `write_tx_err`).
fn tx_failed(m: &TxMeta, err: i32) -> (bool, CqErrEntry) {
    (m.peer, tx_error(m, err))
}

/// Reports a failed send: on the send CQ, or to the transfer link for a peer's.
fn write_tx_err(en: &Enabled, (peer, e): (bool, CqErrEntry)) {
    if !peer {
        en.cntrs.done(Flags::from_bits_retain(e.flags), false);
    }
    if unreported(&e) {
        return;
    }
    if peer {
        to_transfer(en, Err(e), FI_ADDR_NOTAVAIL);
    } else if let Err(err) = en.tx_cq.writeerr(e) {
        crate::fi_warn!("rdm", "a send's error completion lost: {err}");
    }
}

/// A failed inject's error goes to the log and the error counter, not the CQ: it has no
/// context to name it by, and applications read an error entry's context as theirs (Open
/// MPI's mtl ofi dereferences it), as libfabric's verbs provider leaves such failures out.
#[cold]
fn unreported(e: &CqErrEntry) -> bool {
    if !Flags::from_bits_retain(e.flags).contains(Flags::INJECT) {
        return false;
    }
    crate::fi_warn!(
        "rdm",
        "an injected send failed ({}): injects have no completion to report it",
        crate::core::error::strerror(e.err)
    );
    true
}

fn tx_error(m: &TxMeta, err: i32) -> CqErrEntry {
    CqErrEntry {
        op_context: m.context,
        flags: m.flags.bits(),
        tag: m.tag,
        data: m.data,
        err,
        ..Default::default()
    }
}

/// What a receive from `from` with `tag` outside `ignore` matches. fi_msg(3): the source is
/// ignored unless the endpoint has `FI_DIRECTED_RECV`.
#[inline(always)]
fn filter(en: &Enabled, from: u64, tag: u64, ignore: u64) -> Result<Filter> {
    let addr = if from == ADDR_UNSPEC || !en.directed {
        ADDR_UNSPEC
    } else {
        en.av.rdm_name(from)?;
        from
    };
    Ok(Filter { addr, tag, ignore })
}

/// [`filter`]'s check of a directed receive's source `addr`, under the engine's lock: an
/// AV index the send path has cached (`peer_of`) is an RDM address while the AV has
/// removed nothing since; any other is looked up.
#[inline(always)]
fn known_source(en: &Enabled, g: &Inner, addr: u64) -> Result<()> {
    if en.av.removals() == g.addr_gen && g.addr_peer.get(addr as usize).is_some_and(|&p| p != NONE)
    {
        return Ok(());
    }
    known_source_slow(en, addr)
}

#[cold]
#[inline(never)]
fn known_source_slow(en: &Enabled, addr: u64) -> Result<()> {
    en.av.rdm_name(addr).map(|_| ())
}

/// A receive's completion and its source, or its error entry (boxed: the success, moved
/// through each layer of a delivery, stays 64 bytes).
type Done = std::result::Result<(CqEntry, u64), Box<CqErrEntry>>;

/// Counts a receive that finished with `d` (`None`: a success selective completion keeps
/// off the CQ) on the endpoint's receive counter; a peer's transfer is not the
/// application's to count. Always inlined: out of line, the 64-byte `Done` is copied in
/// and back out (45 instructions per arrival, more than the count itself).
#[inline(always)]
fn counted_rx(en: &Enabled, peer: bool, d: Option<Done>) -> Option<Done> {
    if !peer {
        en.cntrs.recv_done(!matches!(d, Some(Err(_))));
    }
    d
}

/// What a receive of `size` bytes, `n` of which its buffer took, completes with: `failed`
/// (a positive errno), truncation (`FI_ETRUNC` with `olen`), success, or nothing when its
/// success is not asked for.
#[allow(clippy::too_many_arguments)]
#[inline]
fn recv_done(
    context: u64,
    flags: Flags,
    tag: u64,
    data: Option<u64>,
    from: u64,
    size: usize,
    n: usize,
    buf: u64,
    quiet: bool,
    failed: Option<i32>,
) -> Option<Done> {
    let flags = if data.is_some() {
        flags | Flags::REMOTE_CQ_DATA
    } else {
        flags
    };
    if n < size || failed.is_some() {
        return Some(Err(Box::new(CqErrEntry {
            op_context: context,
            flags: flags.bits(),
            len: n,
            buf,
            data: data.unwrap_or(0),
            tag,
            olen: size - n,
            err: failed.unwrap_or(errno::ETRUNC),
            ..Default::default()
        })));
    }
    if quiet {
        return None;
    }
    Some(Ok((
        CqEntry {
            op_context: context,
            flags: flags.bits(),
            len: n,
            buf,
            data: data.unwrap_or(0),
            tag,
        },
        from,
    )))
}

/// What `deliver` needs of a claimed entry, copied out before the entry is freed.
#[derive(Clone, Copy)]
struct Took {
    kind: RxKind,
    addr: u64,
    tag: u64,
    size: usize,
    context: u64,
    flags: Flags,
    offset: usize,
    owner: u64,
}

/// Delivers the message of claimed entry `id` from the bounce buffer it holds into the
/// receive's buffer (or starts reading it, for an announced one), frees the entry and
/// posts the bounce buffer again; returns the receive's completion and its source, unless
/// a read is under way.
#[inline(always)]
fn deliver(en: &Enabled, g: &mut Inner, id: u32) -> Option<Done> {
    let m = g.rx[g.engine.entry(id).owner as usize];
    deliver_as(en, g, id, m)
}

/// `deliver`, with the message's `RxMeta` from the caller (an arrival matched at once
/// never stores it in its holder).
#[inline(always)]
fn deliver_as(en: &Enabled, g: &mut Inner, id: u32, m: RxMeta) -> Option<Done> {
    let e = g.engine.entry(id);
    if !e.kind.peer() {
        return deliver_one(en, g, id, m);
    }
    let from = e.addr;
    let done = deliver_one(en, g, id, m);
    to_link(en, done, from);
    None
}

/// A claimed entry as `deliver` needs it, with what its completion reports.
struct Claimed {
    e: Took,
    /// The message's holder (bounce buffer or copy aside).
    slot: u32,
    flags: Flags,
    /// Where the message lands (what a multi-receive buffer's slices report).
    buf: u64,
    quiet: bool,
    /// The bytes the buffer takes.
    n: usize,
}

/// The room a receive's buffer has from `offset`, and where that starts.
#[inline(always)]
fn room(buf: &Option<RecvBuf>, offset: usize) -> (usize, u64) {
    match buf {
        Some(b) => (b.len().saturating_sub(offset), b.addr() + offset as u64),
        None => (0, 0),
    }
}

/// Copies `n` bytes at `body` of bounce buffer `id` into `b` from `offset`.
#[inline(always)]
fn from_bounce(
    en: &Enabled,
    b: &RecvBuf,
    offset: usize,
    n: usize,
    id: u32,
    body: usize,
) -> std::result::Result<(), i32> {
    // One range (the common case) copies without the closure `fill` calls per range: under
    // TCG a call and its return end translated blocks and cost about six loads.
    if !matches!(b, RecvBuf::Scatter(_)) {
        return rx_copy(en, id, body, b.target(offset), n);
    }
    b.fill(offset, n, |to, from, k| rx_copy(en, id, body + from, to, k))
}

/// Where bytes `off..off + n` of bounce buffer `id` lie in the receive pool: at most two
/// pieces (pool offset, length), in its head and in its tail (`Enabled::rx_head`).
#[inline(always)]
fn rx_pieces(en: &Enabled, id: u32, off: usize, n: usize) -> [(usize, usize); 2] {
    let (h, i) = (en.rx_head, id as usize);
    let tail = en.rx_n * h + i * (en.slot - h);
    if off >= h {
        return [(tail + off - h, n), (tail, 0)];
    }
    let k = n.min(h - off);
    [(i * h + off, k), (tail, n - k)]
}

/// Reads `dst.len()` bytes at `off` of bounce buffer `id`.
#[inline(always)]
fn rx_read(en: &Enabled, id: u32, off: usize, dst: &mut [u8]) -> Result<()> {
    let [(a, k), (b, _)] = rx_pieces(en, id, off, dst.len());
    let (head, tail) = dst.split_at_mut(k);
    en.rx_pool.read_at(a, head)?;
    if !tail.is_empty() {
        en.rx_pool.read_at(b, tail)?;
    }
    Ok(())
}

/// Copies `n` bytes at `off` of bounce buffer `id` to `to`.
#[inline(always)]
fn rx_copy(
    en: &Enabled,
    id: u32,
    off: usize,
    to: Place<'_>,
    n: usize,
) -> std::result::Result<(), i32> {
    let h = en.rx_head;
    // The common small message: all of it in the head.
    if off + n <= h {
        return copy(
            Place::Region(en.rx_pool.sys(), id as usize * h + off),
            to,
            n,
        );
    }
    rx_copy_cut(en, id, off, to, n)
}

/// `rx_copy` of bytes that reach past the head: one copy from the tail, or two.
#[inline(never)]
fn rx_copy_cut(
    en: &Enabled,
    id: u32,
    off: usize,
    to: Place<'_>,
    n: usize,
) -> std::result::Result<(), i32> {
    let pool = en.rx_pool.sys();
    let [(a, k), (b, m)] = rx_pieces(en, id, off, n);
    copy(Place::Region(pool, a), to, k)?;
    if m == 0 {
        return Ok(());
    }
    let rest = match to {
        Place::Region(mr, o) => Place::Region(mr, o + k),
        Place::Foreign(f, o) => Place::Foreign(f, o + k),
    };
    copy(Place::Region(pool, b), rest, m)
}

/// Appends `n` bytes at `off` of bounce buffer `id` to `dst` (a message set aside).
fn rx_append(
    en: &Enabled,
    id: u32,
    off: usize,
    n: usize,
    dst: &mut Vec<u8>,
) -> std::result::Result<(), i32> {
    let pool = en.rx_pool.sys();
    let [(a, k), (b, m)] = rx_pieces(en, id, off, n);
    append_from(Place::Region(pool, a), k, dst)?;
    append_from(Place::Region(pool, b), m, dst)
}

/// The SRQ elements of bounce buffer `id`: its head and its tail, or the whole buffer.
#[inline(always)]
fn rx_sges(en: &Enabled, id: u32) -> (sv::Sge, Option<sv::Sge>) {
    let (addr, lkey) = (en.rx_pool.sys().addr(), en.rx_pool.sys().lkey());
    let [(a, k), (b, m)] = rx_pieces(en, id, 0, en.slot);
    let sge = |at: usize, len: usize| sv::Sge {
        addr: addr + at as u64,
        length: len as u32,
        lkey,
    };
    (sge(a, k), (m > 0).then(|| sge(b, m)))
}

/// What `deliver` needs of claimed entry `ent`, read in place (its buffer stays in it: no
/// reference count moves).
#[inline(always)]
fn claimed(en: &Enabled, ent: &RxEntry<RecvBuf>) -> Claimed {
    let e = Took {
        kind: ent.kind,
        addr: ent.addr,
        tag: ent.tag,
        size: ent.size,
        context: ent.context,
        flags: ent.flags,
        offset: ent.offset,
        owner: ent.owner,
    };
    let (cap, buf) = room(&ent.buf, e.offset);
    let kind = if e.kind.tagged() {
        Flags::TAGGED
    } else {
        Flags::MSG
    };
    // Carved slices of a multi-receive buffer before the last no longer carry
    // FI_MULTI_RECV: the flag is the entry's.
    let flags = kind | Flags::RECV | (e.flags & Flags::MULTI_RECV);
    Claimed {
        slot: e.owner as u32,
        flags,
        buf,
        quiet: en.rx_selective && !e.flags.contains(Flags::COMPLETION),
        n: e.size.min(cap),
        e,
    }
}

/// `deliver` of an entry of either kind (the caller routes the completion). An eager
/// message is copied here; an announced one is read by `deliver_announced`, out of line so
/// that the eager path keeps a small frame.
fn deliver_one(en: &Enabled, g: &mut Inner, id: u32, m: RxMeta) -> Option<Done> {
    if let Some(rts) = m.rts {
        return deliver_announced(en, g, id, m, rts);
    }
    let Inner { engine, spill, .. } = &mut *g;
    let ent = engine.entry(id);
    let c = claimed(en, ent);
    let (slot, n) = (c.slot, c.n);
    let copied = match &ent.buf {
        Some(b) if n > 0 => match spilled(en, slot) {
            None => from_bounce(en, b, c.e.offset, n, slot, m.body()),
            Some(i) => {
                let kept = &spill[i][..n.min(spill[i].len())];
                b.fill(c.e.offset, kept.len(), |to, from, k| {
                    copy_in(&kept[from..from + k], to)
                })
            }
        },
        _ => Ok(()),
    };
    let _ = engine.free(id);
    release_holder(en, g, slot);
    let failed = copied.err().map(|_| errno::EIO);
    received(en, g, &c, n, &m, failed)
}

/// What a receive whose bytes are in place (`n` of them, its entry freed) finishes with:
/// the sender's notice when it asked for one (unless `failed` is its connection's end), and
/// the receive's completion, counted.
#[inline(always)]
fn received(
    en: &Enabled,
    g: &mut Inner,
    c: &Claimed,
    n: usize,
    m: &RxMeta,
    failed: Option<i32>,
) -> Option<Done> {
    if let Some(id) = m.ack.filter(|_| failed != Some(errno::ECONNABORTED)) {
        let status = failed.unwrap_or(0);
        queue_fin(en, g, m.conn, Fin { id, status });
    }
    let e = &c.e;
    let d = recv_done(
        e.context, c.flags, e.tag, m.data, e.addr, e.size, n, c.buf, c.quiet, failed,
    );
    counted_rx(en, e.kind.peer(), d)
}

/// A peer transfer's receive completion `done` goes to its link, never on the CQ (`from`:
/// the source an error reports).
fn to_link(en: &Enabled, done: Option<Done>, from: u64) {
    match done {
        Some(Ok((c, src))) => to_transfer(en, Ok(c), src),
        Some(Err(c)) => to_transfer(en, Err(*c), from),
        None => {}
    }
}

/// `deliver_one` of an announced message (`rts`): its ranges are read into the receive's
/// buffer, in pieces within the endpoint's read budget, and the sender told once done.
#[inline(never)]
fn deliver_announced(en: &Enabled, g: &mut Inner, id: u32, m: RxMeta, rts: Rts) -> Option<Done> {
    let c = claimed(en, g.engine.entry(id));
    let ebuf = g.engine.entry_mut(id).buf.take();
    let (e, slot, flags, buf, quiet, n) = (c.e, c.slot, c.flags, c.buf, c.quiet, c.n);
    let _ = g.engine.free(id);
    // A gathered announcement's ranges are read before its buffer goes back.
    let remote = remote_of(en, g, slot, &rts, m.ranges);
    release_holder(en, g, slot);
    // Rendezvous: read what fits, then tell the sender.
    let fin = |g: &mut Inner, status| queue_fin(en, g, m.conn, Fin { id: rts.id, status });
    let failed = |g: &mut Inner, err: Error| {
        crate::fi_warn!("rdm", "rendezvous read of {} bytes: {err}", n);
        fin(g, errno::EIO);
        let d = recv_done(
            e.context,
            flags,
            e.tag,
            m.data,
            e.addr,
            e.size,
            0,
            buf,
            quiet,
            Some(errno::EIO),
        );
        counted_rx(en, e.kind.peer(), d)
    };
    if n == 0 {
        fin(g, 0);
        let d = recv_done(
            e.context, flags, e.tag, m.data, e.addr, e.size, 0, buf, quiet, None,
        );
        return counted_rx(en, e.kind.peer(), d);
    }
    let remote = match remote {
        Ok(r) => r,
        Err(err) => return failed(g, err),
    };
    let (reg, local) = match ebuf
        .as_ref()
        .map(|b| b.expose_landing(&en.domain, e.offset, n))
    {
        Some(Ok(r)) => r,
        Some(Err(err)) => return failed(g, err),
        None => return failed(g, Error::new(errno::EINVAL, "a receive without a buffer")),
    };
    let rid = g.reads.insert(RndvRead {
        context: e.context,
        flags,
        tag: e.tag,
        data: m.data,
        from: e.addr,
        size: e.size,
        n,
        quiet,
        conn: m.conn,
        id: rts.id,
        peer: e.kind.peer(),
        remote,
        local,
        plan: ReadPlan::new(n, en.read_max),
        out: 0,
        waiting: true,
        status: 0,
        _reg: Some(reg),
    });
    // Read indices travel in work request ids below 2^24.
    if rid >= 1 << wr_id::INDEX_BITS {
        drop(g.reads.take(rid));
        return failed(
            g,
            Error::new(errno::EAGAIN, "too many rendezvous reads under way"),
        );
    }
    g.read_wait.push_back(rid);
    // Reads that wait mean the budget is spent: this one goes when their pieces complete.
    if g.read_wait.len() == 1 {
        pump_reads(en, g);
    }
    // Its first piece could not be posted (its connection went): it fails here.
    if g.reads_failed.last() == Some(&rid) {
        g.reads_failed.pop();
        let r = g.reads.take(rid);
        let err = Error::new(errno::ECONNABORTED, "the sender's connection is gone");
        drop(r);
        return failed(g, err);
    }
    None
}

/// The announcement in bounce buffer `id` (`got` bytes received, `len` after the header),
/// with the number of ranges it lists after its head (kept off the eager path).
#[inline(never)]
fn announcement(en: &Enabled, id: u32, got: usize, len: u32) -> Result<(Rts, u8)> {
    let (b, n) = body_head(en, id, got);
    Ok((Rts::decode(&b[..n])?, Rts::ranges_in(len as usize)? as u8))
}

/// The first bytes after the header of the message in bounce buffer `id` (`got` bytes
/// received): a notice, or an announcement's head. Bytes past the message are not returned.
#[inline(never)]
fn body_head(en: &Enabled, id: u32, got: usize) -> ([u8; Rts::LEN], usize) {
    let mut b = [0u8; Rts::LEN];
    let n = got.saturating_sub(Header::LEN).min(b.len());
    // Inside the pool: every bounce buffer holds more than a header and an announcement.
    match rx_read(en, id, Header::LEN, &mut b) {
        Ok(()) => (b, n),
        Err(_) => (b, 0),
    }
}

/// The ranges announced message `rts` (in holder `slot`, listing `ranges` after its head)
/// is read from.
fn remote_of(en: &Enabled, g: &Inner, slot: u32, rts: &Rts, ranges: u8) -> Result<Remote> {
    if ranges == 0 {
        return Ok(Remote::One(RtsRange {
            addr: rts.addr,
            len: rts.size,
            rkey: rts.rkey,
        }));
    }
    let mut tail = [0u8; RTS_RANGES_MAX * RtsRange::LEN];
    let tail = &mut tail[..ranges as usize * RtsRange::LEN];
    match spilled(en, slot) {
        Some(i) => {
            let kept = g.spill[i].get(Rts::LEN..Rts::LEN + tail.len());
            tail.copy_from_slice(kept.ok_or_else(|| {
                Error::new(errno::EIO, "an announcement set aside without its ranges")
            })?);
        }
        None => rx_read(en, slot, Header::LEN + Rts::LEN, tail)?,
    }
    rts.decode_ranges(tail).map(Remote::Many)
}

/// Posts pieces of the waiting rendezvous reads, oldest first, while fewer than
/// [`READS_MAX`] are in flight. A read that cannot post one (its connection went) posts no
/// more; with nothing of it in flight, it goes to `reads_failed` to be finished.
fn pump_reads(en: &Enabled, g: &mut Inner) {
    while (g.reads_out as usize) < READS_MAX {
        let Some(&rid) = g.read_wait.front() else {
            return;
        };
        let more = post_piece(en, g, rid);
        if matches!(more, Ok(true)) {
            continue;
        }
        g.read_wait.pop_front();
        let Some(r) = g.reads.get_mut(rid) else {
            continue;
        };
        r.waiting = false;
        if let Err(err) = more {
            crate::fi_warn!("rdm", "rendezvous read of {} bytes: {err}", r.n);
            if r.status == 0 {
                r.status = errno::EIO;
            }
        }
        if r.finished() && r.status != 0 {
            g.reads_failed.push(rid);
        }
    }
}

/// Posts the next piece of read `rid`; true when more remain to post.
fn post_piece(en: &Enabled, g: &mut Inner, rid: u32) -> Result<bool> {
    let Some(r) = g.reads.get_mut(rid) else {
        return Ok(false);
    };
    if r.status != 0 {
        return Ok(false);
    }
    let landing = r.local.at(r.plan.planned());
    let room = landing.map_or(0, |(_, _, room)| room);
    let Some(p) = r.plan.next(r.remote.ranges(), room)? else {
        return Ok(false);
    };
    let (to, lkey, _) = landing.unwrap_or_default();
    let sge = sv::Sge {
        addr: to,
        length: p.len,
        lkey,
    };
    let range = r.remote.ranges()[p.range];
    let (addr, rkey, conn) = (range.addr + p.offset, range.rkey, r.conn);
    match open_conn_mut(g, conn) {
        Some(c) => {
            c.ep.qp().and_then(|qp| {
                qp.post_read(
                    wr_id::keyed(rid, en.key, Kind::RdmRead),
                    sge,
                    addr,
                    rkey,
                    send_flags::SIGNALED,
                )
                .map_err(|e| Error::os(e, "ibv_post_send (RDMA read)"))
            })?;
            c.in_flight += 1;
        }
        None => {
            return Err(Error::new(
                errno::ECONNABORTED,
                "the sender's connection is gone",
            ))
        }
    }
    g.reads_out += 1;
    let Some(r) = g.reads.get_mut(rid) else {
        unreachable!("looked up above")
    };
    r.out += 1;
    r.plan.advance(&p);
    Ok(r.plan.planned() < r.n)
}

/// Drops the message of claimed entry `id`: its bounce buffer goes back to the SRQ, and an
/// announced message's sender is told it may complete.
fn discard(en: &Enabled, g: &mut Inner, id: u32, local: &mut Vec<(u32, LocalEntry)>) {
    if g.engine.entry(id).owner == LOCAL_HOLDER {
        // Its path drops it once the lock is released.
        local.push((id, local::entry_of(en, g, id)));
        return;
    }
    let slot = g.engine.entry(id).owner as u32;
    let m = g.rx[slot as usize];
    let _ = g.engine.free(id);
    release_holder(en, g, slot);
    // An announced message's sender, or one that asked for delivery completion, waits for
    // word: discarded counts as delivered.
    if let Some(fid) = m.rts.map(|r| r.id).or(m.ack) {
        queue_fin(en, g, m.conn, Fin { id: fid, status: 0 });
    }
}

/// The spill index of holder `slot`, if it is a message copied aside.
#[inline]
fn spilled(en: &Enabled, slot: u32) -> Option<usize> {
    (slot as usize).checked_sub(en.rx_n)
}

/// A message is done with where it was kept: a bounce buffer goes back to the SRQ, a
/// copy aside to the free list (its memory kept for the next one).
#[inline]
fn release_holder(en: &Enabled, g: &mut Inner, slot: u32) {
    if let Some(i) = spilled(en, slot) {
        g.spill_free.push(i as u32);
        return;
    }
    if std::mem::take(&mut g.rx[slot as usize].held) {
        g.held -= 1;
    }
    repost(en, g, slot);
}

/// Bounce buffers reposted in one call: at most an eighth of them wait off the SRQ (a
/// sender that finds it empty retries; none is lost); an endpoint with fewer than 16
/// reposts each at once.
fn repost_batch(rx_n: usize) -> usize {
    (rx_n / 8).clamp(1, 16)
}

/// Bounce buffer `slot` goes back to the SRQ: with the next ones, `repost_batch` in one
/// call (the device provider takes its queue's lock once for them).
#[inline]
fn repost(en: &Enabled, g: &mut Inner, slot: u32) {
    g.repost.push(slot);
    if g.repost.len() >= en.repost_batch {
        flush_reposts(en, g);
    }
}

/// Posts the bounce buffers `repost` holds (up to a chain's worth) in one call.
#[inline(never)]
fn flush_reposts(en: &Enabled, g: &mut Inner) {
    let n = g.repost.len().min(sv::Srq::POST_EACH_MAX);
    // Indices below `rx_n` only (the pool's), so each element lies inside the pool.
    let ids = &g.repost[..n];
    let posted = en.srx.srq().post_recv_each(n, |i| {
        let (head, tail) = rx_sges(en, ids[i]);
        (wr_id::keyed(ids[i], en.key, Kind::RdmRecv), head, tail)
    });
    let done = match posted {
        Ok(()) => n,
        Err((k, e)) => {
            // What was not posted stays for the next try.
            crate::fi_warn!(
                "rdm",
                "reposting {} bounce buffers: {}",
                n - k,
                Error::os(e, "ibv_post_srq_recv")
            );
            k
        }
    };
    g.repost.drain(..done);
}

/// Copies the unexpected message in bounce buffer `slot` (`len` bytes after its header)
/// aside; returns its new holder. The buffer is the caller's to post again.
fn spill(en: &Enabled, g: &mut Inner, slot: u32, len: usize) -> Result<u32> {
    let i = spill_slot(g, len)?;
    let at = g.rx[slot as usize].body();
    if let Err(e) = rx_append(en, slot, at, len, &mut g.spill[i]) {
        g.spill_free.push(i as u32);
        return Err(Error::os(e, "setting an unexpected message aside"));
    }
    g.rx[en.rx_n + i] = RxMeta {
        held: false,
        ..g.rx[slot as usize]
    };
    Ok((en.rx_n + i) as u32)
}

/// An empty copy-aside with room for `len` bytes.
fn spill_slot(g: &mut Inner, len: usize) -> Result<usize> {
    let i = match g.spill_free.pop() {
        Some(i) => i as usize,
        None => {
            g.spill.try_reserve(1).map_err(|_| no_memory())?;
            g.rx.try_reserve(1).map_err(|_| no_memory())?;
            g.spill.push(Vec::new());
            g.rx.push(RxMeta::default());
            g.spill.len() - 1
        }
    };
    let v = &mut g.spill[i];
    v.clear();
    if v.try_reserve(len).is_err() {
        g.spill_free.push(i as u32);
        return Err(no_memory());
    }
    Ok(i)
}

/// A message arrives at the receive engine from `holder` (bounce buffer or copy aside);
/// an engine full of unexpected messages (more than planned for, set aside) grows rather
/// than drop one.
#[inline(always)]
fn arrive(
    g: &mut Inner,
    kind: RxKind,
    addr: u64,
    tag: u64,
    size: usize,
    holder: u32,
) -> Result<Arrival> {
    let a = Arrive {
        kind,
        addr,
        tag,
        size,
        holder,
    };
    match g.engine.arrive(kind, addr, tag, size, holder as u64) {
        Ok(r) => Ok(r),
        Err(_) => arrive_grown(g, a),
    }
}

/// An arrival's particulars, for [`arrive_grown`].
#[derive(Clone, Copy)]
struct Arrive {
    kind: RxKind,
    addr: u64,
    tag: u64,
    size: usize,
    holder: u32,
}

/// `arrive` once the engine had no free entry: it doubles, and the arrival tries again.
#[cold]
#[inline(never)]
fn arrive_grown(g: &mut Inner, a: Arrive) -> Result<Arrival> {
    let n = g.engine.capacity();
    g.engine.grow(n).and_then(|()| {
        g.engine
            .arrive(a.kind, a.addr, a.tag, a.size, a.holder as u64)
    })
}

/// A segment of a segmented message on queue pair `qpn`, in bounce buffer `id` (posted
/// again once copied). The first one matches the message: to a posted receive, whose
/// buffer then takes each segment as it comes (no copy aside), or else the segments are
/// put together aside and the whole message arrives with the last one. The last one
/// completes the receive.
fn segment(
    en: &Enabled,
    g: &mut Inner,
    qpn: u32,
    id: u32,
    h: &Header,
    addr: u64,
    conn: u32,
) -> Option<Owned> {
    let n = h.len as usize;
    let begun = if h.op == Op::Cont {
        Ok(())
    } else {
        if let Some(old) = g.asm.remove(&qpn) {
            // A peer breaking the protocol: said, and what it left finishes in error.
            crate::fi_warn!("rdm", "a segmented message on QP {qpn} was left incomplete");
            let done = abandon(en, g, old, errno::EIO);
            park_done(en, g, done);
        }
        first_segment(g, qpn, h, addr, conn)
    };
    let copied = begun.and_then(|()| match g.asm.get_mut(&qpn) {
        Some(a) => {
            put_segment(en, &mut g.spill, &g.engine, a, id, n);
            Ok(())
        }
        None => Err(Error::new(
            errno::EIO,
            "a segment without the message's first one",
        )),
    });
    repost(en, g, id);
    if let Err(err) = copied {
        // Out of memory, or a peer breaking the protocol: said, not silent.
        crate::fi_warn!("rdm", "segmented message from QP {qpn} dropped: {err}");
        return None;
    }
    match g.asm.get(&qpn) {
        Some(a) if a.got >= a.total => {}
        _ => return None,
    }
    let a = g.asm.remove(&qpn)?;
    let i = match a.into {
        AsmInto::Recv(e) => {
            let failed = a.failed.then_some(errno::EIO);
            return to_owned(assembled(en, g, e, a.meta, a.got, failed));
        }
        AsmInto::Spill(i) => i,
    };
    let holder = (en.rx_n + i) as u32;
    g.rx[holder as usize] = a.meta;
    match arrive(g, a.kind, a.addr, a.tag, a.total, holder) {
        Ok(Arrival::Matched(e)) => to_owned(deliver(en, g, e)),
        Ok(Arrival::Unexpected(e)) => {
            let _ = g.engine.queue(e);
            None
        }
        Err(err) => {
            crate::fi_warn!("rdm", "receive engine full, message dropped: {err}");
            g.spill_free.push(i as u32);
            None
        }
    }
}

/// The first segment of a message of `h.total` bytes on queue pair `qpn`: the message is
/// matched now if a posted receive takes it (not a multi-receive buffer: see
/// `RxEngine::arrive_in_pieces`). Otherwise it arrives once whole (a receive posted
/// meanwhile must find it then), put together aside until then.
fn first_segment(g: &mut Inner, qpn: u32, h: &Header, addr: u64, conn: u32) -> Result<()> {
    let total = h.total as usize;
    if total > MAX_SEGS << 20 {
        return Err(Error::new(
            errno::EIO,
            format!("a {total}-byte segmented message: more than any peer sends"),
        ));
    }
    let kind = RxKind::of(h.op.tagged(), h.peer);
    let into = match g
        .engine
        .arrive_in_pieces(kind, addr, h.tag, total, NONE as u64)
    {
        Some(e) => AsmInto::Recv(e),
        None => AsmInto::Spill(spill_slot(g, total)?),
    };
    g.asm.insert(
        qpn,
        Asm {
            into,
            total,
            got: 0,
            failed: false,
            kind,
            tag: h.tag,
            addr,
            meta: RxMeta {
                data: h.data,
                rts: None,
                ack: h.ack,
                conn,
                held: false,
                ranges: 0,
                body: Header::LEN as u8,
            },
        },
    );
    Ok(())
}

/// Puts a segment's `n` bytes (at `body` of the receive buffers) where message `a` is being
/// put together: past what came before, up to the size its first segment said (a receive's
/// buffer takes what fits: the rest is reported truncated). A copy that fails marks it
/// failed; the rest of its segments are still taken.
fn put_segment(
    en: &Enabled,
    spill: &mut [Vec<u8>],
    engine: &RxEngine<RecvBuf>,
    a: &mut Asm,
    id: u32,
    n: usize,
) {
    let k = n.min(a.total - a.got);
    let body = Header::LEN;
    let copied = match a.into {
        AsmInto::Spill(i) => rx_append(en, id, body, k, &mut spill[i]),
        AsmInto::Recv(e) => {
            let ent = engine.entry(e);
            match &ent.buf {
                Some(b) if !a.failed => {
                    let room = b.len().saturating_sub(ent.offset).saturating_sub(a.got);
                    match k.min(room) {
                        0 => Ok(()),
                        fits => b.fill(ent.offset + a.got, fits, |to, from, m| {
                            rx_copy(en, id, body + from, to, m)
                        }),
                    }
                }
                _ => Ok(()),
            }
        }
    };
    if copied.is_err() {
        a.failed = true;
    }
    a.got += k;
}

/// The receive that segmented message went straight into (`Asm::Recv` entry `id`), once
/// `got` bytes of it came: its completion (`failed`: a positive errno), routed as
/// `deliver_as` routes one; the sender's notice goes unless its connection is gone.
fn assembled(
    en: &Enabled,
    g: &mut Inner,
    id: u32,
    m: RxMeta,
    got: usize,
    failed: Option<i32>,
) -> Option<Done> {
    let c = claimed(en, g.engine.entry(id));
    let _ = g.engine.free(id);
    let d = received(en, g, &c, c.n.min(got), &m, failed);
    if !c.e.kind.peer() {
        return d;
    }
    to_link(en, d, c.e.addr);
    None
}

/// A segmented message that stops short (`err`): its copy aside is freed; a receive it
/// went into completes in error with what came.
fn abandon(en: &Enabled, g: &mut Inner, a: Asm, err: i32) -> Option<Done> {
    match a.into {
        AsmInto::Spill(i) => {
            g.spill_free.push(i as u32);
            None
        }
        AsmInto::Recv(e) => assembled(en, g, e, a.meta, a.got, Some(err)),
    }
}

/// A completion found where the CQ may not be written (a completion handler): written by
/// the next progress call.
fn park_done(en: &Enabled, g: &mut Inner, done: Option<Done>) {
    if let Some(d) = done {
        g.done_parked.push(d);
        park(en);
    }
}

fn no_memory() -> Error {
    Error::new(
        errno::ENOMEM,
        "no memory to set an unexpected message aside",
    )
}

/// Sends notice `fin` on connection `c`, or queues it until a send buffer is free.
fn queue_fin(en: &Enabled, g: &mut Inner, c: u32, fin: Fin) {
    let Some(slot) = g.tx_free.pop() else {
        g.fins.push_back((c, fin));
        if !en.fins_waiting.swap(true, Ordering::Relaxed) {
            en.tx_cq.want_progress(true);
        }
        return;
    };
    let off = slot as usize * en.slot;
    let hdr = Header {
        len: Fin::LEN as u32,
        ..Header::bare(Op::Fin)
    };
    g.tx[slot as usize] = TxMeta {
        quiet: true,
        conn: NONE,
        rndv: NONE,
        wire: (Header::LEN + Fin::LEN) as u32,
        ..TxMeta::default()
    };
    let r = en
        .tx_pool
        .write_at(off, &hdr.encode())
        .and_then(|_| en.tx_pool.write_at(off + Header::LEN, &fin.encode()))
        .and_then(|_| post_on(en, g, c, slot));
    if let Err(e) = r {
        // Its connection is gone: the sender's own transfer fails with it.
        crate::fi_info!("rdm", "rendezvous notice not sent: {e}");
        g.tx_free.push(slot);
    }
}

/// Sends the notices that waited for a send buffer.
#[inline]
fn flush_fins(en: &Enabled, g: &mut Inner) {
    while !g.tx_free.is_empty() {
        let Some((c, fin)) = g.fins.pop_front() else {
            if en.fins_waiting.swap(false, Ordering::Relaxed) {
                en.tx_cq.want_progress(false);
            }
            return;
        };
        queue_fin(en, g, c, fin);
    }
}

#[inline]
fn write_out(cq: &CompletionQueue, c: Option<Option<Done>>) {
    let r = match c.flatten() {
        Some(Ok((e, from))) => cq.write(e, from),
        Some(Err(e)) => cq.writeerr(*e),
        None => Ok(()),
    };
    if let Err(e) = r {
        crate::fi_warn!("rdm", "completion not written: {e}");
    }
}

#[inline(always)]
fn to_owned(c: Option<Done>) -> Option<Owned> {
    match c? {
        Ok((e, from)) => Some(Owned::Entry(e, from)),
        Err(e) => Some(Owned::Errors(vec![*e])),
    }
}

impl Shared {
    /// The MSG info its connections are opened with: the device's own MSG attributes (an
    /// RDM info's inject size is the eager size, far above what a QP inlines), one send
    /// element, send queues as deep as the endpoint's send buffers and rendezvous reads.
    fn msg_info(&self) -> Result<Info> {
        let dev = self.domain.device();
        let mut i = crate::verbs::info::msg_info(dev)?;
        i.tx_attr.size = (self.info.tx_attr.size + READS_MAX).clamp(1, dev.attr.max_qp_wr as usize);
        i.tx_attr.iov_limit = 1;
        i.rx_attr.size = 1;
        i.rx_attr.iov_limit = 1;
        // The connections' own ends take any port: only the listener has the info's.
        i.src_addr = self
            .info
            .src_addr
            .map(|a| std::net::SocketAddr::new(a.ip(), 0))
            .or_else(|| dev.ipv4.map(|ip| std::net::SocketAddr::new(ip.into(), 0)));
        Ok(i)
    }

    /// The first send to `peer` (its buffers `slots` staged; none when a refused connect
    /// is tried again): queued, and a connection started; if that fails at once, the send
    /// fails and what else waits completes in error.
    #[cold]
    #[inline(never)]
    fn connect_first(
        &self,
        en: &Enabled,
        mut g: LockGuard<'_, Inner>,
        peer: u32,
        slots: &[u32],
    ) -> Result<()> {
        g.peers[peer as usize].waiting.extend(slots.iter().copied());
        let c = new_conn(&mut g, peer);
        setup_begin(en);
        g.peers[peer as usize].link.connecting(c);
        drop(g);
        let (mut g, started) = self.open_and_start(en, c, peer, None, |ep, name| ep.connect(name));
        match started {
            Ok(()) => Ok(()),
            Err(e) => {
                crate::fi_warn!(
                    "rdm",
                    "connecting to {}: {e}",
                    g.peers[peer as usize].name.to_str()
                );
                let gone = uninstall(&mut g, c);
                setup_done(en);
                g.peers[peer as usize].link.failed(c);
                // The send that started it fails at once; others queued meanwhile
                // complete in error.
                let q = std::mem::take(&mut g.peers[peer as usize].waiting);
                let mut errs = Vec::new();
                let mut regs = Vec::new();
                for s in q {
                    // The parts before a segmented send's last report nothing.
                    if !slots.contains(&s) && !g.tx[s as usize].part {
                        errs.push(tx_failed(&g.tx[s as usize], e.errno()));
                    }
                    regs.push(release_tx(&mut g, s));
                }
                drop(g);
                drop((gone, regs));
                for x in errs {
                    write_tx_err(en, x);
                }
                Err(e)
            }
        }
    }

    /// Opens, binds and enables a connection's MSG endpoint (outside the lock): to `to`
    /// (its listener) when connecting, or on the request in `info` when accepting.
    /// Opens connection `c`'s endpoint to `peer` (the lock not held), installs it, and starts
    /// it with `start` (connect, or accept `accept`'s request) given this endpoint's name.
    /// Installed first, so that its first message finds it. Returns the lock, taken again.
    fn open_and_start<'a>(
        &self,
        en: &'a Enabled,
        c: u32,
        peer: u32,
        accept: Option<&Info>,
        start: impl FnOnce(&MsgEndpoint, &[u8]) -> Result<()>,
    ) -> (LockGuard<'a, Inner>, Result<()>) {
        let opened = self.open_conn(en, c, accept);
        let mut g = en.inner.lock();
        let started = opened.and_then(|ep| {
            install(en, &mut g, c, peer, ep);
            // A peer known by its listener alone is told so (it then answers over verbs).
            let by_listener = accept.is_none() && g.peers[peer as usize].name.is_listener();
            let Some(conn) = open_conn_mut(&mut g, c) else {
                unreachable!("installed above")
            };
            start(&conn.ep, &RdmName::request_bytes(&en.bytes, by_listener))
        });
        (g, started)
    }

    fn open_conn(&self, en: &Enabled, c: u32, accept: Option<&Info>) -> Result<MsgEndpoint> {
        let info = match accept {
            Some(i) => {
                let mut i = i.clone();
                i.ep_attr.ep_type = EpType::Msg;
                i
            }
            None => {
                let mut i = self.msg_info()?;
                let g = en.inner.lock();
                let Some(ConnSlot::Opening { peer }) = g.conns[c as usize] else {
                    unreachable!("a connection being opened")
                };
                i.dest_addr = Some(g.peers[peer as usize].name.sockaddr());
                i
            }
        };
        let ep = MsgEndpoint::open(&self.domain, &info, c as u64)?;
        ep.reserved_by_owner();
        // The peer reads announced messages from this side, and this side from the peer.
        let a = &self.domain.device().attr;
        ep.allow_reads(a.max_qp_rd_atom.min(a.max_qp_init_rd_atom).clamp(1, 16) as u8);
        ep.bind_eq(&en.eq)?;
        ep.bind_cq(&en.tx_cq, Flags::TRANSMIT)?;
        ep.bind_cq(&en.rx_cq, Flags::RECV)?;
        ep.bind_srx(&en.srx)?;
        ep.enable()?;
        en.opened.fetch_add(1, Ordering::Relaxed);
        Ok(ep)
    }

    fn progress(&self) {
        self.progress_into(None)
    }

    /// [`Self::progress`] from a read of a CQ: what the local path completes may go to
    /// the reader's `sink`.
    fn progress_into(&self, sink: Option<&mut ReadSink<'_>>) {
        let Some(en) = self.on.get() else { return };
        let local = en.local.get();
        if let Some(l) = local {
            if l.due(en) {
                l.path
                    .progress(Some(&mut local::Driven { sh: self, en, sink }));
            }
        }
        if en.transfer_open.load(Ordering::Acquire) {
            deliver_transfers(en);
        }
        if en.fins_waiting.load(Ordering::Relaxed) {
            let mut g = en.inner.lock();
            flush_fins(en, &mut g);
        }
        if en.parked.load(Ordering::Relaxed) {
            finish_failed(en);
        }
        // One CQ and no local path: it calls this one read in PEER_POLL_EVERY while
        // nothing is being set up. Otherwise every read calls it, and it looks for
        // connection events one call in CM_POLL_EVERY (CM_POLL_EVERY_LOCAL with a local
        // path, whose reads take longer: a system call per 64 of them would be a large
        // share). A plain load and store: a count lost to a race only shifts the next look.
        if en.in_setup.load(Ordering::Relaxed) == 0
            && (local.is_some() || !Arc::ptr_eq(&en.tx_cq, &en.rx_cq))
        {
            let every = if local.is_some() {
                CM_POLL_EVERY_LOCAL
            } else {
                CM_POLL_EVERY
            };
            let polls = en.polls.load(Ordering::Relaxed);
            en.polls.store(polls.wrapping_add(1), Ordering::Relaxed);
            if polls % every != 0 {
                return;
            }
        }
        if en.in_setup.load(Ordering::Relaxed) == 0 {
            // A look is a system call (rdma_cm's event read), which a reader spinning on
            // an empty CQ would make every `every` reads, thousands a second: one per
            // CM_POLL_GAP cycles is enough to see new peers and disconnects.
            let now = rfabric_sys::clock::cycles();
            if now < en.cm_next.load(Ordering::Relaxed) {
                return;
            }
            en.cm_next.store(now + CM_POLL_GAP, Ordering::Relaxed);
        }
        self.progress_cm(en);
    }

    /// Reads every pending connection event, then connects again to refused peers whose
    /// time has come.
    fn progress_cm(&self, en: &Enabled) {
        loop {
            match en.eq.read() {
                Ok(ev) => self.on_event(en, ev),
                Err(e) if e.errno() == errno::EAVAIL => match en.eq.readerr() {
                    Ok(err) => self.on_failed(en, err.fid as u32, err.err),
                    Err(_) => break,
                },
                Err(_) => break,
            }
        }
        if en.retrying.load(Ordering::Relaxed) > 0 {
            self.retry_refused(en);
        }
    }

    /// Connects again to each refused peer that is due, its sends still waiting; one whose
    /// link came up meanwhile (the peer connected to us) needs nothing more.
    #[cold]
    #[inline(never)]
    fn retry_refused(&self, en: &Enabled) {
        let now = std::time::Instant::now();
        let mut g = en.inner.lock();
        let due: Vec<u32> = (0..g.peers.len() as u32)
            .filter(|&p| {
                g.peers[p as usize]
                    .refused
                    .is_some_and(|r| r.next.is_some_and(|t| t <= now))
            })
            .collect();
        for p in due {
            let peer = &mut g.peers[p as usize];
            let idle = peer.link.send_path() == SendPath::Connect;
            let waiting = !peer.waiting.is_empty();
            if idle && waiting {
                // Still refused: stays marked until the connect succeeds or its budget ends.
                if let Some(r) = peer.refused.as_mut() {
                    r.next = None;
                }
            } else {
                peer.refused = None;
            }
            en.retrying.fetch_sub(1, Ordering::Relaxed);
            setup_done(en);
            if idle && waiting {
                crate::fi_info!("rdm", "connecting to {} again", peer.name.to_str());
                if let Err(e) = self.connect_first(en, g, p, &[]) {
                    crate::fi_warn!("rdm", "connecting again: {e}");
                }
                g = en.inner.lock();
            }
        }
    }

    fn on_event(&self, en: &Enabled, ev: EqEvent) {
        match ev {
            EqEvent::ConnReq { info, data, .. } => self.on_request(en, *info, &data),
            EqEvent::Connected { fid, .. } => {
                let c = fid as u32;
                let mut g = en.inner.lock();
                let Some(conn) = open_conn_mut(&mut g, c) else {
                    return;
                };
                let peer = conn.peer;
                setup_done(en);
                if !g.peers[peer as usize].link.established(c) {
                    return; // the passive side of a loopback, or a superseded connect
                }
                g.peers[peer as usize].refused = None;
                let q = std::mem::take(&mut g.peers[peer as usize].waiting);
                let mut errs = Vec::new();
                let mut regs = Vec::new();
                for s in q {
                    if let Err(e) = post_on(en, &mut g, c, s) {
                        errs.push(tx_failed(&g.tx[s as usize], e.errno()));
                        regs.push(release_tx(&mut g, s));
                    }
                }
                drop(g);
                drop(regs);
                for x in errs {
                    write_tx_err(en, x);
                }
            }
            EqEvent::Shutdown { fid } => {
                let c = fid as u32;
                // What the peer sent before it went is in the CQ already: taken first,
                // while its route stands, so that a segmented message it left short has
                // its assembly (its first segments may not have been read yet) and only
                // what never comes fails.
                en.rx_cq.drive();
                let mut g = en.inner.lock();
                let Some(conn) = open_conn_mut(&mut g, c) else {
                    return;
                };
                conn.down = true;
                let peer = conn.peer;
                let qpn = conn.ep.qp().ok().map(|q| q.qp_num());
                let torn = qpn.filter(|q| g.asm.contains_key(q));
                drain_unsignaled(en, &mut g, c);
                g.peers[peer as usize].link.disconnected(c);
                // Sends that waited for a link that went down before carrying them.
                let q = std::mem::take(&mut g.peers[peer as usize].waiting);
                let mut regs = Vec::new();
                let errs: Vec<_> = q
                    .into_iter()
                    .map(|s| {
                        let e = tx_failed(&g.tx[s as usize], errno::ECONNABORTED);
                        regs.push(release_tx(&mut g, s));
                        e
                    })
                    .collect();
                let gone = reap(&mut g, c);
                drop(g);
                drop((gone, regs));
                for x in errs {
                    write_tx_err(en, x);
                }
                if let Some(q) = torn {
                    // A segmented message the peer left short.
                    let mut g = en.inner.lock();
                    if let Some(a) = g.asm.remove(&q) {
                        crate::fi_info!(
                            "rdm",
                            "a segmented message on QP {q} ended with its connection"
                        );
                        let done = abandon(en, &mut g, a, errno::ECONNABORTED);
                        drop(g);
                        write_out(&en.rx_cq, Some(done));
                    }
                }
            }
            _ => {}
        }
    }

    /// A connect of ours failed (refused, or the peer unreachable).
    fn on_failed(&self, en: &Enabled, c: u32, err: i32) {
        let mut g = en.inner.lock();
        let peer = match g.conns.get(c as usize) {
            Some(Some(ConnSlot::Open(conn))) => conn.peer,
            _ => return,
        };
        setup_done(en);
        let fail = g.peers[peer as usize].link.failed(c);
        let mut errs = Vec::new();
        let mut regs = Vec::new();
        if fail && err == errno::ECONNREFUSED && refused_again(&mut g.peers[peer as usize]) {
            // Tried again from the reads that follow (`retry_refused`); every read looks
            // meanwhile, as while a connection is being set up.
            setup_begin(en);
            en.retrying.fetch_add(1, Ordering::Relaxed);
        } else if fail {
            g.peers[peer as usize].refused = None;
            crate::fi_warn!(
                "rdm",
                "connection to {} failed: errno {err}",
                g.peers[peer as usize].name.to_str()
            );
            let q = std::mem::take(&mut g.peers[peer as usize].waiting);
            for s in q {
                errs.push(tx_failed(&g.tx[s as usize], err));
                regs.push(release_tx(&mut g, s));
            }
        }
        if let Some(conn) = open_conn_mut(&mut g, c) {
            conn.down = true;
        }
        let gone = reap(&mut g, c);
        drop(g);
        drop((gone, regs));
        for x in errs {
            write_tx_err(en, x);
        }
    }

    fn on_request(&self, en: &Enabled, info: Info, data: &[u8]) {
        let Some(req) = info
            .handle
            .clone()
            .and_then(|h| h.downcast::<ConnRequest>().ok())
        else {
            return;
        };
        let remote = match RdmName::parse(data) {
            Ok(n) => n,
            Err(e) => {
                crate::fi_warn!("rdm", "refusing a connection request: {e}");
                let _ = en.pep.reject(&req, &[]);
                return;
            }
        };
        if RdmName::requested_by_listener(data) && remote.host == en.name.host {
            if let Some(l) = en.local.get() {
                l.pin_to_verbs(&remote);
            }
        }
        let mut g = en.inner.lock();
        let addr = en.av.find_rdm(&remote).unwrap_or(FI_ADDR_NOTAVAIL);
        let peer = peer_for(&mut g, &remote, addr);
        let loopback = remote == en.name;
        if !loopback {
            let p = &g.peers[peer as usize];
            if p.link.request(&en.bytes, &p.bytes) == Request::Reject {
                drop(g);
                crate::fi_debug!("rdm", "refusing {}: our connect wins", remote.to_str());
                let _ = en.pep.reject(&req, &[]);
                return;
            }
        }
        let c = new_conn(&mut g, peer);
        setup_begin(en);
        if !loopback {
            g.peers[peer as usize].link.accepting(c);
        }
        drop(g);
        let (mut g, accepted) =
            self.open_and_start(en, c, peer, Some(&info), |ep, name| ep.accept(name));
        if let Err(e) = accepted {
            crate::fi_warn!("rdm", "accepting {}: {e}", remote.to_str());
            let gone = uninstall(&mut g, c);
            setup_done(en);
            if !loopback {
                g.peers[peer as usize].link.failed(c);
            }
            drop(g);
            drop(gone);
        }
    }

    /// A completion of one of the endpoint's connections: a send from a bounce buffer, a
    /// rendezvous read, or a message in a bounce buffer. What it completes for the
    /// application goes to that operation's CQ: returned when it is the one being read,
    /// written into the other otherwise.
    #[inline(always)]
    fn completion(&self, en: &Enabled, wc: &WorkCompletion) -> Option<Owned> {
        let id = wr_id::index(wc.wr_id());
        let ok = wc.status() == sv::wc_status::IBV_WC_SUCCESS;
        if wr_id::is_kind(wc.wr_id(), Kind::RdmSend) {
            return send_completion(en, id, wc.status());
        }
        if wr_id::is_kind(wc.wr_id(), Kind::RdmRead) {
            return read_completion(en, id, wc.status());
        }
        if !ok {
            // Bounce buffers flushed as the endpoint closes: nothing the application posted.
            return None;
        }
        message(en, id, wc)
    }
}

/// A send buffer's completion: the buffer is free again; the send completes unless it
/// waits for a notice (rendezvous, delivery complete) or is a segment before the last.
#[inline]
fn send_completion(en: &Enabled, id: u32, status: u32) -> Option<Owned> {
    let ok = status == sv::wc_status::IBV_WC_SUCCESS;
    let mut g = en.inner.lock();
    let m = g.tx[id as usize];
    retire_unsignaled(&mut g, m.conn, m.seq);
    let qp_failed = !ok && status != sv::wc_status::IBV_WC_WR_FLUSH_ERR;
    // An atomic done by compare-and-swap takes its next step in the same buffer.
    let status = match m.rma && ok {
        true => match rma::atomic_step(en, &mut g, id, m.conn) {
            Some(Ok(())) => {
                let gone = conn_done(&mut g, m.conn);
                drop(g);
                drop(gone);
                return None;
            }
            Some(Err(e)) => {
                crate::fi_info!("rdm", "an atomic's next step was not posted: {e}");
                sv::wc_status::IBV_WC_GENERAL_ERR
            }
            None => status,
        },
        false => status,
    };
    let ok = status == sv::wc_status::IBV_WC_SUCCESS;
    // A read that landed in the buffer is copied out before the buffer is free again.
    let status = match m.rma && ok {
        true => rma::land(en, &mut g, id),
        false => status,
    };
    // Flushed after an earlier part of the operation failed: that is its error.
    let status = match std::mem::take(&mut g.tx_failed[id as usize]) {
        0 => status,
        cause => cause,
    };
    let ok = status == sv::wc_status::IBV_WC_SUCCESS;
    // An announcement's send waits for the receiver's notice; a failed one fails it.
    let held = if ok {
        g.tx[id as usize].rndv = NONE;
        let piece = match std::mem::take(&mut g.tx[id as usize].rma) {
            true => g.tx_rma[id as usize].take(),
            false => None,
        };
        g.tx_free.push(id);
        (None, piece)
    } else {
        release_tx(&mut g, id)
    };
    if qp_failed {
        // The queue pair is in error: the connection goes (a later send makes a new one).
        if let Some(conn) = open_conn_mut(&mut g, m.conn).filter(|c| !c.down) {
            conn.ep.disconnect();
        }
        if let Some(last) = held.1.as_ref().and_then(rma::RmaPiece::last) {
            g.tx_failed[last as usize] = status;
        }
    }
    let gone = conn_done(&mut g, m.conn);
    flush_fins(en, &mut g);
    drop(g);
    drop((gone, held));
    if m.part {
        return None;
    }
    let ok = status == sv::wc_status::IBV_WC_SUCCESS;
    // Done unless it waits for the receiver's notice (rendezvous, delivery complete).
    if !m.peer && (!ok || m.rndv == NONE) {
        en.cntrs.done(m.flags, ok);
    }
    if m.peer {
        match ok {
            true if m.quiet => {}
            true => to_transfer(en, Ok(send_cq_entry(&m)), FI_ADDR_NOTAVAIL),
            false => {
                let mut e = tx_error(&m, crate::verbs::cq::status_errno(status));
                e.prov_errno = status as i32;
                to_transfer(en, Err(e), FI_ADDR_NOTAVAIL);
            }
        }
        return None;
    }
    if ok {
        (!m.quiet).then(|| send_entry(&m))
    } else {
        let mut e = tx_error(&m, crate::verbs::cq::status_errno(status));
        e.prov_errno = status as i32;
        (!unreported(&e)).then(|| Owned::Errors(vec![e]))
    }
}

/// A rendezvous read's completion: the sender is told, and the receive completes (on the
/// receive CQ).
#[cold]
#[inline(never)]
fn read_completion(en: &Enabled, id: u32, wc_status: u32) -> Option<Owned> {
    let ok = wc_status == sv::wc_status::IBV_WC_SUCCESS;
    let mut g = en.inner.lock();
    let r = g.reads.get_mut(id)?;
    r.out -= 1;
    if !ok && r.status == 0 {
        r.status = crate::verbs::cq::status_errno(wc_status);
    }
    let (finished, conn) = (r.finished(), r.conn);
    g.reads_out -= 1;
    let gone = conn_done(&mut g, conn);
    // Its place in the budget goes to the next piece waiting.
    if !g.read_wait.is_empty() {
        pump_reads(en, &mut g);
        park_failed(en, &g);
    }
    let r = if finished { g.reads.take(id) } else { None };
    if let Some(r) = &r {
        r.tell_sender(en, &mut g);
    }
    drop(g);
    drop(gone);
    let done = read_done(en, r?)?;
    // Polled from the send CQ: the receive's completion belongs to the receive CQ.
    if Arc::ptr_eq(&en.tx_cq, &en.rx_cq) {
        return to_owned(Some(done));
    }
    write_out(&en.rx_cq, Some(Some(done)));
    None
}

/// The receive of finished read `r` (its notice queued): its completion, or `None` for a
/// success nobody asked to see or a peer's transfer (which goes to its link here).
fn read_done(en: &Enabled, r: RndvRead) -> Option<Done> {
    let ok = r.status == 0;
    drop(r._reg);
    let done = recv_done(
        r.context,
        r.flags,
        r.tag,
        r.data,
        r.from,
        r.size,
        if ok { r.n } else { 0 },
        0,
        r.quiet,
        (!ok).then_some(r.status),
    );
    let done = counted_rx(en, r.peer, done);
    if r.peer {
        to_link(en, done, r.from);
        return None;
    }
    done
}

/// Has the next progress call finish the reads `pump_reads` failed (a completion handler
/// may not write its own CQ).
fn park_failed(en: &Enabled, g: &Inner) {
    if !g.reads_failed.is_empty() {
        park(en);
    }
}

/// Has the next progress call finish what is parked (`finish_failed`).
fn park(en: &Enabled) {
    if !en.parked.swap(true, Ordering::Relaxed) {
        en.rx_cq.want_progress(true);
    }
}

/// Finishes the reads parked by `park_failed` (each receive completes in error) and writes
/// the completions `park_done` kept.
#[cold]
fn finish_failed(en: &Enabled) {
    let mut g = en.inner.lock();
    if en.parked.swap(false, Ordering::Relaxed) {
        en.rx_cq.want_progress(false);
    }
    let failed: Vec<_> = std::mem::take(&mut g.reads_failed)
        .into_iter()
        .filter_map(|id| g.reads.take(id))
        .collect();
    for r in &failed {
        r.tell_sender(en, &mut g);
    }
    let parked = std::mem::take(&mut g.done_parked);
    drop(g);
    for r in failed {
        let done = read_done(en, r);
        write_out(&en.rx_cq, Some(done));
    }
    for d in parked {
        write_out(&en.rx_cq, Some(Some(d)));
    }
}

/// A message in bounce buffer `id`: matched and delivered, or queued unexpected.
#[inline]
fn message(en: &Enabled, id: u32, wc: &WorkCompletion) -> Option<Owned> {
    let mut g = en.inner.lock();
    let got = wc.byte_len() as usize;
    // One lookup per message: who sent it, on which connection, and what its headers said.
    let qpn = wc.qp_num();
    let route = route_of(&mut g, qpn);
    if let (Some(imm), Some(r)) = (wc.imm_data(), route) {
        if let Some(d) = arrive_now(en, &mut g, id, imm, got, r) {
            return to_owned(d);
        }
    }
    let (h, body) = match wc.imm_data() {
        // No header: its values are the connection's base and the immediate.
        Some(imm) => match route
            .map_or_else(HeaderBase::default, |r| r.base)
            .expand(imm, got)
        {
            Some(h) => (h, 0),
            None => return dropped(en, id, HeaderBase::unexplained(imm, got)),
        },
        None => {
            // The header alone (a bounce buffer holds at least 256 bytes): a fixed-size
            // copy, no call; what lies past the message is stale and `decode` checks the
            // length received.
            let mut hdr = [0u8; Header::LEN];
            let parsed = rx_read(en, id, 0, &mut hdr).and_then(|_| Header::decode_at(&hdr, got));
            match parsed {
                Ok((h, body)) => {
                    if let Some(r) = route.filter(|_| h.sets_base()) {
                        note_base(&mut g, qpn, r.base, &h);
                    }
                    (h, body)
                }
                Err(e) => return dropped(en, id, e),
            }
        }
    };
    if h.op == Op::Fin {
        let (b, n) = body_head(en, id, got);
        return notice(en, g, id, &b[..n]);
    }
    if h.op == Op::ReadEvent {
        drop(g);
        return rma::remote_read(en, id);
    }
    let (rts, ranges) = match h.op {
        Op::RtsMsg | Op::RtsTag => match announcement(en, id, got, h.len) {
            Ok((r, n)) => (Some(r), n),
            Err(e) => return dropped(en, id, e),
        },
        _ => (None, 0),
    };
    let src = route.map(|r| r.peer);
    let addr = match src {
        Some(p) => {
            let peer = &mut g.peers[p as usize];
            if peer.addr == FI_ADDR_NOTAVAIL {
                peer.addr = en.av.find_rdm(&peer.name).unwrap_or(FI_ADDR_NOTAVAIL);
            }
            peer.addr
        }
        None => FI_ADDR_NOTAVAIL,
    };
    let conn = route.map_or(NONE, |r| r.conn);
    if h.peer && !en.transfer_open.load(Ordering::Acquire) {
        return peer_gone(en, g, id, &h, rts, conn);
    }
    if h.op == Op::WriteData {
        drop(g);
        return rma::remote_write(en, id, &h, addr);
    }
    if matches!(h.op, Op::SegMsg | Op::SegTag | Op::Cont) {
        return segment(en, &mut g, qpn, id, &h, addr, conn);
    }
    let kind = RxKind::of(h.op.tagged(), h.peer);
    let size = rts.map_or(h.len as usize, |r| r.size as usize);
    let meta = RxMeta {
        data: h.data,
        rts,
        ack: h.ack,
        conn,
        held: false,
        ranges,
        body: body as u8,
    };
    match arrive(&mut g, kind, addr, h.tag, size, id) {
        // Delivered now: the holder's `RxMeta` is never read (its `held` stays false).
        Ok(Arrival::Matched(e)) => to_owned(deliver_as(en, &mut g, e, meta)),
        Ok(Arrival::Unexpected(e)) => {
            g.rx[id as usize] = meta;
            unexpected(
                en,
                &mut g,
                id,
                e,
                // An announcement's body is set aside only for the ranges it lists.
                if rts.is_some() && ranges == 0 {
                    0
                } else {
                    h.len as usize
                },
            );
            None
        }
        Err(e) => {
            // Only when the engine cannot grow (no memory left): lost, and said so.
            crate::fi_warn!("rdm", "receive engine full, message dropped: {e}");
            let _ = post_bounce(en, id);
            None
        }
    }
}

/// The common arrival in the fewest steps: an eager message without a header (immediate
/// `imm`, `got` bytes in bounce buffer `id`) from a known peer on route `r`, taken by the
/// first receive posted for it (not a multi-receive buffer): copied into the receive's
/// buffer, the bounce buffer posted again, its completion returned (`Some(None)`: a success
/// nobody asked to see). `None`, with nothing changed, sends it the general way.
#[inline(always)]
fn arrive_now(
    en: &Enabled,
    g: &mut Inner,
    id: u32,
    imm: u32,
    got: usize,
    r: QpRoute,
) -> Option<Option<Done>> {
    let h = r.base.expand(imm, got)?;
    let addr = g.peers[r.peer as usize].addr;
    if addr == FI_ADDR_NOTAVAIL {
        return None;
    }
    let kind = RxKind::of(h.op.tagged(), false);
    let e = g
        .engine
        .arrive_at_head(kind, addr, h.tag, got, u64::from(id))?;
    let ent = g.engine.entry(e);
    let (cap, buf) = room(&ent.buf, ent.offset);
    let n = got.min(cap);
    let copied = match &ent.buf {
        Some(b) if n > 0 => from_bounce(en, b, ent.offset, n, id, 0),
        _ => Ok(()),
    };
    let flags = if kind.tagged() {
        Flags::TAGGED
    } else {
        Flags::MSG
    } | Flags::RECV;
    let (context, quiet) = (
        ent.context,
        en.rx_selective && !ent.flags.contains(Flags::COMPLETION),
    );
    let _ = g.engine.free(e);
    release_holder(en, g, id);
    let failed = copied.err().map(|_| errno::EIO);
    let d = recv_done(
        context, flags, h.tag, h.data, addr, got, n, buf, quiet, failed,
    );
    Some(counted_rx(en, false, d))
}

/// A peer's transfer arrived with no link open to take it (the peer closed): dropped,
/// and a sender waiting for word is told it was not delivered.
#[cold]
#[inline(never)]
fn peer_gone(
    en: &Enabled,
    mut g: LockGuard<'_, Inner>,
    id: u32,
    h: &Header,
    rts: Option<Rts>,
    conn: u32,
) -> Option<Owned> {
    crate::fi_info!(
        "rdm",
        "a peer transfer arrived after its link closed: dropped"
    );
    if let Some(fid) = rts.map(|r| r.id).or(h.ack) {
        queue_fin(
            en,
            &mut g,
            conn,
            Fin {
                id: fid,
                status: errno::ECANCELED,
            },
        );
    }
    drop(g);
    if let Err(err) = post_bounce(en, id) {
        crate::fi_warn!("rdm", "reposting bounce buffer {id}: {err}");
    }
    None
}

/// A delivery or rendezvous notice in bounce buffer `id`: the send it names completes.
#[cold]
#[inline(never)]
fn notice(en: &Enabled, mut g: LockGuard<'_, Inner>, id: u32, body: &[u8]) -> Option<Owned> {
    let same = Arc::ptr_eq(&en.tx_cq, &en.rx_cq);
    let _ = post_bounce(en, id);
    let fin = Fin::decode(body).ok()?;
    crate::fi_debug!("rdm", "notice {fin:?}");
    let s = g.sends.take(fin.id);
    drop(g);
    let s = s?;
    if !s.meta.peer {
        en.cntrs.done(s.meta.flags, fin.status == 0);
    }
    if s.meta.peer {
        match fin.status {
            0 if s.meta.quiet => {}
            0 => to_transfer(en, Ok(send_cq_entry(&s.meta)), FI_ADDR_NOTAVAIL),
            st => to_transfer(en, Err(tx_error(&s.meta, st)), FI_ADDR_NOTAVAIL),
        }
        return None;
    }
    let done = if fin.status == 0 {
        (!s.meta.quiet).then(|| send_entry(&s.meta))
    } else {
        let e = tx_error(&s.meta, fin.status);
        (!unreported(&e)).then(|| Owned::Errors(vec![e]))
    };
    drop(s);
    // Polled from the receive CQ: the send's completion belongs to the send CQ.
    if same {
        return done;
    }
    let w = match done {
        Some(Owned::Entry(e, from)) => en.tx_cq.write(e, from),
        Some(Owned::Errors(v)) => v.into_iter().try_for_each(|e| en.tx_cq.writeerr(e)),
        None => Ok(()),
    };
    if let Err(e) = w {
        crate::fi_warn!("rdm", "send completion not written: {e}");
    }
    None
}

/// Unexpected message `e` in bounce buffer `id`: the buffer holds it until a receive
/// comes, or, once half the buffers are held, its `payload` bytes are copied aside and the
/// buffer goes back to the SRQ at once.
#[cold]
#[inline(never)]
fn unexpected(en: &Enabled, g: &mut Inner, id: u32, e: u32, payload: usize) {
    let aside = if (g.held as usize) < en.rx_n / 2 {
        None
    } else {
        spill(en, g, id, payload)
            .map_err(|err| crate::fi_info!("rdm", "{err}: the message keeps its buffer"))
            .ok()
    };
    match aside {
        Some(holder) => {
            g.engine.entry_mut(e).owner = holder as u64;
            repost(en, g, id);
        }
        None => {
            g.rx[id as usize].held = true;
            g.held += 1;
        }
    }
    let _ = g.engine.queue(e);
}

/// A send's completion entry.
#[inline]
fn send_entry(m: &TxMeta) -> Owned {
    Owned::Entry(send_cq_entry(m), FI_ADDR_NOTAVAIL)
}

fn send_cq_entry(m: &TxMeta) -> CqEntry {
    CqEntry {
        op_context: m.context,
        flags: m.flags.bits(),
        ..Default::default()
    }
}

/// One operation on connection `c` finished; returns the connection when it is down and
/// that was its last (to drop once the lock is released).
#[inline]
fn conn_done(g: &mut Inner, c: u32) -> Option<MsgEndpoint> {
    let down = open_conn_mut(g, c).and_then(|conn| {
        conn.in_flight -= 1;
        conn.down.then_some(())
    });
    down.and_then(|_| reap(g, c))
}

/// Who sent on queue pair `qpn`, and on which connection.
#[inline(always)]
fn route_of(g: &mut Inner, qpn: u32) -> Option<QpRoute> {
    match g.last_route {
        Some((q, r)) if q == qpn => Some(r),
        _ => {
            let r = g.qpns.get(&qpn).copied();
            g.last_route = r.map(|r| (qpn, r));
            r
        }
    }
}

/// A message that does not parse: said, and its bounce buffer posted again.
#[cold]
#[inline(never)]
fn dropped(en: &Enabled, id: u32, e: Error) -> Option<Owned> {
    crate::fi_warn!("rdm", "dropping a message: {e}");
    let _ = post_bounce(en, id);
    None
}

/// A header that sets its queue pair's base (`Header::sets_base`) came: the base (`was`)
/// takes its values, written back only when they differ (mostly they do not).
#[inline]
fn note_base(g: &mut Inner, qpn: u32, was: HeaderBase, h: &Header) {
    let mut b = was;
    b.note(h);
    if b == was {
        return;
    }
    if let Some(r) = g.qpns.get_mut(&qpn) {
        r.base = b;
    }
    if let Some((q, r)) = &mut g.last_route {
        if *q == qpn {
            r.base = b;
        }
    }
}

/// Stops naming a connection by its queue pair (its number may be reused).
fn forget_qp(g: &mut Inner, ep: &MsgEndpoint) {
    if let Ok(qp) = ep.qp() {
        if let Some(r) = g.qpns.get_mut(&qp.qp_num()) {
            r.conn = NONE;
        }
        g.last_route = None;
    }
}

/// A connect to `peer` was refused: true (and the next try set) while the retry budget
/// since its first refusal lasts, with a back-off from 10 ms doubling to 200 ms.
fn refused_again(peer: &mut Peer) -> bool {
    if peer.waiting.is_empty() {
        return false;
    }
    let now = std::time::Instant::now();
    let r = peer.refused.get_or_insert(Refused {
        first: now,
        next: None,
        tries: 0,
    });
    if now.duration_since(r.first) >= connect_retry_budget() {
        return false;
    }
    let wait = std::time::Duration::from_millis((10u64 << r.tries.min(5)).min(200));
    r.tries += 1;
    r.next = Some(now + wait);
    crate::fi_info!(
        "rdm",
        "connection to {} refused (is its endpoint up yet?): trying again in {} ms",
        peer.name.to_str(),
        wait.as_millis()
    );
    true
}

/// A connection starts being set up (or a refused one waits to be tried again): until it
/// is done, every read of the endpoint's CQ reads the connection events too.
fn setup_begin(en: &Enabled) {
    en.in_setup.fetch_add(1, Ordering::Relaxed);
    en.rx_cq.want_progress(true);
}

/// A connection finished setting up (connected, or failed to).
fn setup_done(en: &Enabled) {
    if en
        .in_setup
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
    {
        en.rx_cq.want_progress(false);
    }
}

/// Takes connection `c` out whatever its state (a connect or accept that failed).
fn uninstall(g: &mut Inner, c: u32) -> Option<MsgEndpoint> {
    match g.conns.get_mut(c as usize).and_then(Option::take) {
        Some(ConnSlot::Open(conn)) => {
            forget_qp(g, &conn.ep);
            Some(conn.ep)
        }
        _ => None,
    }
}

/// Takes connection `c` out once it is down with nothing in flight (dropped by the caller
/// once the lock is released: dropping it unregisters it from the EQ and CQ).
fn reap(g: &mut Inner, c: u32) -> Option<MsgEndpoint> {
    match g.conns.get(c as usize) {
        Some(Some(ConnSlot::Open(conn))) if conn.down && conn.in_flight == 0 => {}
        _ => return None,
    }
    let Some(ConnSlot::Open(conn)) = g.conns[c as usize].take() else {
        return None;
    };
    forget_qp(g, &conn.ep);
    Some(conn.ep)
}

impl Enabled {
    /// Its CQs: the receive CQ, and the send CQ when it is another.
    fn cqs(&self) -> impl Iterator<Item = &Arc<CompletionQueue>> {
        let split = !Arc::ptr_eq(&self.rx_cq, &self.tx_cq);
        std::iter::once(&self.rx_cq).chain(split.then_some(&self.tx_cq))
    }
}

/// Puts what a blocked read of the endpoint's CQs must wake for in their wait sets: its
/// connection events, and with two CQs each one's completion channel in the other's set
/// (reads complete on the send CQ, notices arrive on the receive CQ). Whether each went in.
fn watch_for_sleepers(en: &Enabled, split: bool) -> ([bool; 2], [bool; 2]) {
    let watch = |what: &str, r: Result<bool>| {
        r.unwrap_or_else(|e| {
            crate::fi_info!("rdm", "{e}: blocked reads poll for {what}");
            false
        })
    };
    let cm = en.eq.channel().borrow_fd();
    let mut cm_wakes = [watch("connections", en.rx_cq.add_wait_fd(cm)), false];
    let mut other = [false; 2];
    if split {
        cm_wakes[1] = watch("connections", en.tx_cq.add_wait_fd(cm));
        // Only a channel no notifier thread reads (a CQ that waits on a descriptor): the
        // sleeper consumes its events as it arms it.
        fn channel(cq: &CompletionQueue) -> Option<std::os::fd::BorrowedFd<'_>> {
            cq.epoll_fd()
                .and_then(|_| cq.raw().channel().map(|ch| ch.borrow_fd()))
        }
        if let Some(ch) = channel(&en.tx_cq) {
            other[0] = watch("the send CQ", en.rx_cq.add_bell_fd(ch));
        }
        if let Some(ch) = channel(&en.rx_cq) {
            other[1] = watch("the receive CQ", en.tx_cq.add_bell_fd(ch));
        }
    }
    (cm_wakes, other)
}

/// Undoes [`watch_for_sleepers`], and takes the local path's bell out of the wait sets.
fn unwatch_for_sleepers(en: &Enabled) {
    let cm = en.eq.channel().borrow_fd();
    if en.cm_wakes[0] {
        en.rx_cq.remove_wait_fd(cm);
    }
    if en.cm_wakes[1] {
        en.tx_cq.remove_wait_fd(cm);
    }
    if let (true, Some(ch)) = (en.other_wakes[0], en.tx_cq.raw().channel()) {
        en.rx_cq.remove_bell_fd(ch.borrow_fd());
    }
    if let (true, Some(ch)) = (en.other_wakes[1], en.rx_cq.raw().channel()) {
        en.tx_cq.remove_bell_fd(ch.borrow_fd());
    }
    if let Some(b) = en.local.get().and_then(|l| l.bell.as_ref()) {
        en.cqs().for_each(|cq| cq.remove_bell_fd(b.fd()));
    }
}

impl RecvOwner for Shared {
    fn recv_completion(&self, wc: &WorkCompletion) -> Option<Owned> {
        let en = self.on.get()?;
        self.completion(en, wc)
    }
}

impl PeerProgress for Shared {
    fn fd_woke(&self) {
        // Its connection events' descriptor (`cm_wakes`): the next progress reads them.
        if let Some(en) = self.on.get() {
            en.cm_next.store(0, Ordering::Relaxed);
        }
    }

    fn sleeping(&self, cq: &CompletionQueue, on: bool) -> bool {
        let Some(en) = self.on.get() else {
            return false;
        };
        // The local path's bell wakes the sleeper for it; without one it must be polled.
        let local = en.local.get().map(|l| l.sleeping(on));
        if Arc::ptr_eq(&en.rx_cq, &en.tx_cq) {
            return local.unwrap_or(false);
        }
        // With two CQs the sleeper also waits for the other one, armed now: its
        // completions wake the sleeper, whose next progress drives them.
        let (other, wakes) = if std::ptr::eq(cq, &*en.rx_cq) {
            (&en.tx_cq, en.other_wakes[0])
        } else {
            (&en.rx_cq, en.other_wakes[1])
        };
        let armed = wakes
            && (!on
                || other.rearm().map_or_else(
                    |e| {
                        crate::fi_warn!("rdm", "{e}: a blocked read polls the other CQ");
                        false
                    },
                    |()| true,
                ));
        armed && local.unwrap_or(true)
    }

    fn progress(&self, cq: &CompletionQueue, sink: Option<&mut ReadSink<'_>>) {
        self.progress_into(sink);
        // Reads complete on the send CQ and notices arrive on the receive CQ: a reader of
        // either one alone moves the other's completions (into its queue) as well.
        // Until a connection was made (peers all on this host, say) no device completion
        // of this endpoint can be waiting on the other CQ.
        if let Some(en) = self.on.get() {
            if !Arc::ptr_eq(&en.tx_cq, &en.rx_cq) && en.opened.load(Ordering::Relaxed) != 0 {
                let other = if std::ptr::eq(cq, &*en.tx_cq) {
                    &en.rx_cq
                } else {
                    &en.tx_cq
                };
                other.drive();
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let Some(en) = self.on.get_mut() else { return };
        // What it asked of its CQs ends with it.
        for _ in 0..*en.in_setup.get_mut() {
            en.rx_cq.want_progress(false);
        }
        if *en.fins_waiting.get_mut() {
            en.tx_cq.want_progress(false);
        }
        if *en.parked.get_mut() {
            en.rx_cq.want_progress(false);
        }
        let g = en.inner.get_mut();
        for c in g.conns.iter().flatten() {
            if let ConnSlot::Open(conn) = c {
                conn.ep.disconnect();
            }
        }
        g.conns.clear();
        en.tx_cq.unregister_keyed_owner(en.key);
        en.rx_cq.unregister_keyed_owner(en.key);
    }
}

impl Drop for RdmEndpoint {
    fn drop(&mut self) {
        if self.peer {
            // A peer's handle: the endpoint lives on (end_peer_transfer ends the link).
            return;
        }
        if let Some(en) = self.sh.on.get() {
            local::close(en);
            // Nothing posted is lost: each receive still waiting completes as cancelled, as
            // does each whose message was still being read.
            let mut g = en.inner.lock();
            let reading: Vec<_> = g.reads.drain().filter(|r| !r.peer).collect();
            // Receives that segmented messages were going into.
            let into: Vec<_> = g
                .asm
                .drain()
                .filter_map(|(_, a)| match a.into {
                    AsmInto::Recv(e) => Some(e),
                    AsmInto::Spill(_) => None,
                })
                .collect();
            let assembling: Vec<_> = into
                .into_iter()
                .filter_map(|e| {
                    let x = g.engine.entry(e).clone();
                    let _ = g.engine.free(e);
                    (!x.kind.peer()).then_some(x)
                })
                .collect();
            g.read_wait.clear();
            g.reads_failed.clear();
            let posted = g.engine.cancel_all();
            drop(g);
            for r in reading {
                let _ = en.rx_cq.writeerr(CqErrEntry {
                    op_context: r.context,
                    flags: r.flags.bits(),
                    tag: r.tag,
                    err: errno::ECANCELED,
                    ..Default::default()
                });
            }
            for e in assembling.into_iter().chain(posted) {
                let kind = if e.kind.tagged() {
                    Flags::TAGGED
                } else {
                    Flags::MSG
                };
                let _ = en.rx_cq.writeerr(CqErrEntry {
                    op_context: e.context,
                    flags: (kind | Flags::RECV).bits(),
                    tag: e.tag,
                    err: errno::ECANCELED,
                    ..Default::default()
                });
            }
            unwatch_for_sleepers(en);
            let me: Weak<dyn PeerProgress> = self.sh.me.clone();
            en.rx_cq.remove_peer(&me);
            en.tx_cq.remove_peer(&me);
        }
    }
}
