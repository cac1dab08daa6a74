//! The owner side of fi_peer(3), at the 1.17 C layouts of `rdma/fi_ext.h`: the shared
//! receive engine handed to peer providers as `fid_peer_srx`, and a CQ handed to them as
//! `fid_peer_cq`.
//!
//! Where the man page and the header disagree, the header wins: `start_msg`/`start_tag`
//! and `discard_msg`/`discard_tag` take the `fi_peer_rx_entry` (the man page shows the
//! `fid_peer_srx`), and `get_tag` has no size argument.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, MutexGuard};

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fid, guarded, guarded_len, no_bind, no_control, Class, Obj, Owned};
use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::peer::{Handoff, SharedRx};
use crate::core::srx::{Arrival, Entry, Filter, Kind, Recv, RxEngine};
use crate::verbs::CompletionQueue;

/// Ranges of one receive handed to a peer.
pub(crate) const PEER_IOV: usize = 4;

/// A receive buffer as the engine carries it: the application's ranges. Peers get no
/// memory descriptors: the owner's regions mean nothing in a peer's domain (shm would read
/// one as its own region), so `desc` entries are NULL.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RxBuf {
    pub iov: [libc::iovec; PEER_IOV],
    pub count: usize,
}

// SAFETY: addresses of application memory, never dereferenced here; they are only handed
// back to C (the peer), which owns the buffer contract.
unsafe impl Send for RxBuf {}

impl RxBuf {
    /// One range.
    pub(crate) fn one(buf: *mut c_void, len: usize) -> Self {
        let mut b = RxBuf {
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; PEER_IOV],
            count: 1,
        };
        b.iov[0] = libc::iovec {
            iov_base: buf,
            iov_len: len,
        };
        b
    }

    fn len(&self) -> usize {
        self.iov[..self.count].iter().map(|v| v.iov_len).sum()
    }
}

/// What `FI_PEEK` reports of a waiting message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Peeked {
    pub addr: u64,
    pub tag: u64,
    pub size: usize,
}

impl Peeked {
    fn of(e: &Entry<RxBuf>) -> Self {
        Peeked {
            addr: e.addr,
            tag: e.tag,
            size: e.size,
        }
    }
}

/// The C face of one engine slot: what peers get a pointer to.
#[repr(C)]
struct PeerEntry {
    c: UnsafeCell<fi::fi_peer_rx_entry>,
    iov: UnsafeCell<[libc::iovec; PEER_IOV]>,
    desc: UnsafeCell<[*mut c_void; PEER_IOV]>,
    owner: *const OwnerSrx,
}

/// The receive engine of one owner SRX, shared by the application (posting) and by every
/// peer (arrivals): the protocol is `core::peer::SharedRx`; here are its C entries.
pub(crate) struct OwnerSrx {
    rx: SharedRx<RxBuf, CEntries>,
}

/// One C entry per engine slot, at a fixed address for the engine's life.
struct CEntries(Box<[PeerEntry]>);

// SAFETY: a C entry is written only by whoever holds its slot in the engine's life cycle:
// the owner under the engine lock (get, post), the peer between handing out and
// `free_entry` (fi_peer(3)'s ownership rules), never both.
unsafe impl Send for CEntries {}
// SAFETY: as above.
unsafe impl Sync for CEntries {}

impl CEntries {
    fn c_entry(&self, id: u32) -> *mut fi::fi_peer_rx_entry {
        self.0[id as usize].c.get()
    }
}

impl Handoff<RxBuf> for CEntries {
    /// Writes what the engine knows of slot `id` into its C entry. With a buffer, the
    /// ranges start `offset` bytes in (a multi-receive slice).
    fn fill(&self, id: u32, e: &Entry<RxBuf>) {
        let pe = &self.0[id as usize];
        // SAFETY: `fill` is called on a slot nobody else holds (Handoff's contract).
        unsafe {
            let c = &mut *pe.c.get();
            c.addr = e.addr;
            c.size = e.size;
            c.tag = e.tag;
            c.flags = e.flags.bits();
            c.context = e.context as *mut c_void;
            c.owner_context = std::ptr::null_mut();
            match &e.buf {
                Some(b) => {
                    let iov = &mut *pe.iov.get();
                    let desc = &mut *pe.desc.get();
                    let mut skip = e.offset;
                    let mut n = 0;
                    for i in 0..b.count {
                        let v = b.iov[i];
                        if skip >= v.iov_len {
                            skip -= v.iov_len;
                            continue;
                        }
                        iov[n] = libc::iovec {
                            iov_base: v.iov_base.cast::<u8>().add(skip).cast(),
                            iov_len: v.iov_len - skip,
                        };
                        desc[n] = std::ptr::null_mut();
                        skip = 0;
                        n += 1;
                    }
                    c.iov = iov.as_mut_ptr().cast();
                    c.desc = desc.as_mut_ptr();
                    c.count = n;
                }
                None => {
                    c.iov = std::ptr::null_mut();
                    c.desc = std::ptr::null_mut();
                    c.count = 0;
                }
            }
        }
    }

    /// Hands entry `id` back to the peer that queued it: `start_*`, or `discard_*`.
    fn hand_back(&self, id: u32, kind: Kind, discard: bool) -> Result<()> {
        let c = self.c_entry(id);
        // SAFETY: the slot is claimed for us (Handoff's contract); its srx is the
        // fid_peer_srx of the peer that called get_* for it (proven by its ops table), whose
        // peer ops the peer filled at fi_srx_context.
        let rc = unsafe {
            let srx = PeerSrx::from_c((*c).srx, "the entry's srx")?;
            let ops = srx
                .hdr
                .peer_ops
                .as_ref()
                .ok_or_else(|| Error::new(errno::EINVAL, "the peer's SRX has no peer ops"))?;
            let f = match (kind, discard) {
                (Kind::Msg, false) => ops.start_msg,
                (Kind::Tag, false) => ops.start_tag,
                (Kind::Msg, true) => ops.discard_msg,
                (Kind::Tag, true) => ops.discard_tag,
            }
            .ok_or_else(|| Error::new(errno::EINVAL, "the peer left a callback NULL"))?;
            f(c)
        };
        if rc < 0 {
            return Err(Error::new(-rc, "the peer refused a matched message"));
        }
        Ok(())
    }
}

impl OwnerSrx {
    /// An engine of `capacity` entries (posted receives, messages in flight and unexpected
    /// messages together), with their C entries.
    pub(crate) fn new(capacity: usize) -> Arc<Self> {
        Arc::new_cyclic(|me| {
            let owner = me.as_ptr();
            let rx = SharedRx::new(capacity, CEntries(Box::new([])));
            let n = rx.lock().capacity();
            let entries = (0..n)
                .map(|_| PeerEntry {
                    // SAFETY: a plain C struct; all-zero (NULL pointers) is valid.
                    c: UnsafeCell::new(unsafe { std::mem::zeroed() }),
                    iov: UnsafeCell::new(
                        [libc::iovec {
                            iov_base: std::ptr::null_mut(),
                            iov_len: 0,
                        }; PEER_IOV],
                    ),
                    desc: UnsafeCell::new([std::ptr::null_mut(); PEER_IOV]),
                    owner,
                })
                .collect();
            OwnerSrx {
                rx: rx.with_handoff(CEntries(entries)),
            }
        })
    }

    fn lock(&self) -> MutexGuard<'_, RxEngine<RxBuf>> {
        self.rx.lock()
    }

    /// A `fid_peer_srx` for one peer's `fi_srx_context(FI_PEER)`. The peer fills
    /// `peer_ops`; the owner keeps it and retires it when done with the peer.
    pub(crate) fn peer(self: &Arc<Self>) -> Owned<PeerSrx> {
        Owned::new(
            fi::fid_peer_srx {
                ep_fid: fi::fid_ep {
                    fid: fid(
                        // Peers bind it to their endpoints as an SRX (shm checks the class).
                        fi::FI_CLASS_SRX_CTX,
                        std::ptr::null_mut(),
                        &PEER_SRX_FI_OPS,
                    ),
                    ops: std::ptr::null_mut(),
                    cm: std::ptr::null_mut(),
                    msg: std::ptr::null_mut(),
                    rma: std::ptr::null_mut(),
                    tagged: std::ptr::null_mut(),
                    atomic: std::ptr::null_mut(),
                    collective: std::ptr::null_mut(),
                },
                owner_ops: crate::capi::fid::ops(&SRX_OWNER_OPS),
                peer_ops: std::ptr::null_mut(),
            },
            self.clone(),
        )
    }

    pub(crate) fn set_min_multi_recv(&self, n: usize) {
        self.lock().set_min_multi_recv(n);
    }

    /// The slot of a C entry handed out by this engine.
    fn id_of(&self, e: *const fi::fi_peer_rx_entry) -> Result<u32> {
        let entries = &self.rx.handoff().0;
        let base = entries.as_ptr() as usize;
        let at = e as usize;
        let stride = size_of::<PeerEntry>();
        if at < base || (at - base) % stride != 0 || (at - base) / stride >= entries.len() {
            return Err(Error::new(
                errno::EINVAL,
                "not an rx entry of this owner's SRX",
            ));
        }
        Ok(((at - base) / stride) as u32)
    }

    /// An arrival from a peer (`get_msg` / `get_tag`).
    fn arrive(
        &self,
        srx: *mut fi::fid_peer_srx,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
    ) -> Result<(i32, *mut fi::fi_peer_rx_entry)> {
        let (a, id) = self.rx.arrive(kind, addr, tag, size, srx as u64)?;
        let rc = match a {
            Arrival::Matched(_) => 0,
            Arrival::Unexpected(_) => -errno::ENOENT,
        };
        let c = self.rx.handoff().c_entry(id);
        // SAFETY: the slot was just claimed or allocated for this peer, not handed out yet.
        unsafe {
            (*c).srx = srx;
            (*c).peer_context = std::ptr::null_mut();
        }
        Ok((rc, c))
    }

    /// Posts an application receive: every waiting message it claims goes back to its
    /// peer; those a peer refuses come back as the receive's error completions, for the
    /// caller to write to the CQ (see `core::peer::SharedRx::recv`).
    pub(crate) fn recv(
        &self,
        kind: Kind,
        from: Filter,
        buf: RxBuf,
        context: u64,
        flags: Flags,
    ) -> Result<Vec<CqErrEntry>> {
        let size = buf.len();
        self.rx.recv(Recv {
            kind,
            from,
            buf,
            size,
            context,
            flags,
        })
    }

    /// `fi_cancel` of a posted receive: the caller reports it cancelled.
    pub(crate) fn cancel(&self, context: u64) -> Option<Entry<RxBuf>> {
        self.lock().cancel(context)
    }

    /// The first unexpected message `from` accepts (`FI_PEEK`), left in place.
    pub(crate) fn peek(&self, kind: Kind, from: Filter) -> Option<Peeked> {
        let g = self.lock();
        g.peek(kind, from).map(|id| Peeked::of(g.entry(id)))
    }

    /// Discards the first unexpected message `from` accepts (`FI_DISCARD`): its peer drops
    /// it without a completion. None when none waits.
    pub(crate) fn discard(&self, kind: Kind, from: Filter) -> Result<Option<Peeked>> {
        Ok(self.rx.discard(kind, from)?.map(|e| Peeked::of(&e)))
    }

    pub(crate) fn min_multi_recv(&self) -> usize {
        self.lock().min_multi_recv()
    }

    /// Discards every unexpected message `peer` holds (its `fid_peer_srx`; the peer is
    /// going): each goes back to it with `discard_*`.
    pub(crate) fn discard_from(&self, peer: *const fi::fid_peer_srx) {
        self.rx.discard_from(peer as u64);
    }

    /// Entries in use (for tests and diagnostics).
    pub(crate) fn in_use(&self) -> usize {
        self.lock().in_use()
    }
}

/// What one peer holds: its `fid_peer_srx` (the owner fills the owner ops, the peer its
/// own), over the shared engine.
pub(crate) type PeerSrx = Obj<fi::fid_peer_srx, Arc<OwnerSrx>>;
impl Class for PeerSrx {
    type Header = fi::fid_peer_srx;
    const FCLASS: u32 = fi::FI_CLASS_SRX_CTX;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEER_SRX_FI_OPS
    }
}

static PEER_SRX_FI_OPS: fi::fi_ops =
    crate::capi::fid::fi_ops_of!(peer_srx_close, no_bind, no_control);
static SRX_OWNER_OPS: fi::fi_ops_srx_owner = fi::fi_ops_srx_owner {
    size: size_of::<fi::fi_ops_srx_owner>(),
    get_msg: Some(get_msg),
    get_tag: Some(get_tag),
    queue_msg: Some(queue_msg),
    queue_tag: Some(queue_tag),
    free_entry: Some(free_entry),
};

/// The owner of a C entry, from its back pointer.
///
/// # Safety
/// `e` is NULL or an entry handed out by an `OwnerSrx` that is still alive.
unsafe fn owner_of<'a>(e: *const fi::fi_peer_rx_entry) -> Result<(&'a OwnerSrx, u32)> {
    if e.is_null() {
        return Err(Error::new(errno::EINVAL, "entry is NULL"));
    }
    // SAFETY: the caller's contract: the entry is the first field of a PeerEntry.
    let o = unsafe { &*(*e.cast::<PeerEntry>()).owner };
    let id = o.id_of(e)?;
    Ok((o, id))
}

/// # Safety
/// `srx` is NULL or a `fid_peer_srx` made by [`OwnerSrx::peer`].
unsafe fn srx_of<'a>(srx: *mut fi::fid_peer_srx) -> Result<&'a PeerSrx> {
    // SAFETY: the caller's contract; the class is checked, and the ops table tells it
    // from the application-facing SRX of the same class.
    unsafe { PeerSrx::from_c(srx, "srx") }
}

unsafe extern "C" fn get_msg(
    srx: *mut fi::fid_peer_srx,
    addr: fi::fi_addr_t,
    size: usize,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    get(srx, Kind::Msg, addr, 0, size, entry)
}

unsafe extern "C" fn get_tag(
    srx: *mut fi::fid_peer_srx,
    addr: fi::fi_addr_t,
    tag: u64,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    // 1.17's get_tag carries no size: the peer checks the fit (fi_peer(3)).
    get(srx, Kind::Tag, addr, tag, 0, entry)
}

fn get(
    srx: *mut fi::fid_peer_srx,
    kind: Kind,
    addr: u64,
    tag: u64,
    size: usize,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    let mut rc = 0;
    let r = guarded("peer srx get", || {
        if entry.is_null() {
            return Err(Error::new(errno::EINVAL, "entry is NULL"));
        }
        // SAFETY: the fid_peer_srx the owner gave this peer.
        let s = unsafe { srx_of(srx) }?;
        let (code, e) = s.inner.arrive(srx, kind, addr, tag, size)?;
        // SAFETY: checked for NULL; the peer's out-pointer.
        unsafe { *entry = e };
        rc = code;
        Ok(())
    });
    if r != 0 {
        r
    } else {
        rc
    }
}

unsafe extern "C" fn queue_msg(entry: *mut fi::fi_peer_rx_entry) -> i32 {
    queue(entry)
}

unsafe extern "C" fn queue_tag(entry: *mut fi::fi_peer_rx_entry) -> i32 {
    queue(entry)
}

fn queue(entry: *mut fi::fi_peer_rx_entry) -> i32 {
    guarded("peer srx queue", || {
        // SAFETY: an entry this owner handed out by get_*.
        let (o, id) = unsafe { owner_of(entry) }?;
        let mut g = o.lock();
        // 1.17's get_tag carries no size: a peer may fill it in before queueing.
        // SAFETY: the peer hands the entry back; under the engine lock it is ours.
        let size = unsafe { (*entry).size };
        if size != 0 {
            g.entry_mut(id).size = size;
        }
        g.queue(id)
    })
}

unsafe extern "C" fn free_entry(entry: *mut fi::fi_peer_rx_entry) {
    let _ = guarded("peer srx free_entry", || {
        // SAFETY: an entry this owner handed out.
        let (o, id) = unsafe { owner_of(entry) }?;
        o.lock().free(id)
    });
}

unsafe extern "C" fn peer_srx_close(_f: *mut fi::fid) -> i32 {
    // The owner frees a peer's fid_peer_srx when it is done with the peer.
    0
}

// ---- peer CQ ---------------------------------------------------------------------------

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

static PEER_CQ_FI_OPS: fi::fi_ops =
    crate::capi::fid::fi_ops_of!(peer_cq_close, no_bind, no_control);
static CQ_OWNER_OPS: fi::fi_ops_cq_owner = fi::fi_ops_cq_owner {
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

// ---- peer AV ---------------------------------------------------------------------------

/// What a peer may ask of the owner's AV.
pub(crate) trait PeerAvSource: Send + Sync {
    /// The AV's type and the number of addresses it holds now.
    fn query(&self) -> (u32, usize);
    /// The `fi_addr_t` of a local endpoint's own address, if it was inserted.
    fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64>;
}

impl PeerAvSource for crate::verbs::AddressVector {
    fn query(&self) -> (u32, usize) {
        (self.attr().av_type.raw(), self.len())
    }

    fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64> {
        // SAFETY: the peer passes one of the owner's endpoints; the class is checked.
        let name = unsafe { crate::capi::ep::dgram_name(ep) }?;
        self.find(&name)
    }
}

/// The owner's AV as a peer imports it (`fid_peer_av`, passed in a `fi_peer_av_context`).
/// The 1.17 header declares that context's member as `struct fi_peer_av *`, a type it never
/// defines; it is used as a `struct fid_peer_av *`, which is what the man page says.
/// Weak: the owner's AV must outlive the peer's (fi_peer(3)) and must stay closable; the
/// `fid_peer_av` itself is kept by the owner's AV and retired with it, so a peer that
/// queries after the owner closed gets `-FI_EINVAL`.
pub(crate) type PeerAv = Obj<fi::fid_peer_av, std::sync::Weak<dyn PeerAvSource>>;
impl Class for PeerAv {
    type Header = fi::fid_peer_av;
    const FCLASS: u32 = fi::FI_CLASS_PEER_AV;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEER_AV_FI_OPS
    }
}

static PEER_AV_FI_OPS: fi::fi_ops =
    crate::capi::fid::fi_ops_of!(peer_av_close, no_bind, no_control);
static AV_OWNER_OPS: fi::fi_ops_av_owner = fi::fi_ops_av_owner {
    size: size_of::<fi::fi_ops_av_owner>(),
    query: Some(peer_av_query),
    ep_addr: Some(peer_av_ep_addr),
};

pub(crate) fn peer_av(av: std::sync::Weak<dyn PeerAvSource>) -> Owned<PeerAv> {
    Owned::new(
        fi::fid_peer_av {
            fid: fid(fi::FI_CLASS_PEER_AV, std::ptr::null_mut(), &PEER_AV_FI_OPS),
            owner_ops: crate::capi::fid::ops(&AV_OWNER_OPS),
        },
        av,
    )
}

/// # Safety
/// `av` is NULL or a `fid_peer_av` made by [`peer_av`].
unsafe fn peer_av_of<'a>(av: *mut fi::fid_peer_av) -> Result<&'a PeerAv> {
    // SAFETY: the caller's contract; the ops are checked.
    unsafe { PeerAv::from_c(av, "av") }
}

/// `query`: the AV's current attributes (its type and how many addresses it holds).
unsafe extern "C" fn peer_av_query(av: *mut fi::fid_peer_av, attr: *mut fi::fi_av_attr) -> i32 {
    guarded("peer av query", || {
        // SAFETY: the fid_peer_av the owner gave this peer, and NULL or a valid attr.
        let (a, out) = unsafe {
            (
                peer_av_of(av)?,
                attr.as_mut()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        let (av_type, count) = a
            .inner
            .upgrade()
            .ok_or_else(|| Error::new(errno::EINVAL, "the owner's AV is closed"))?
            .query();
        out.type_ = av_type;
        out.count = count;
        out.rx_ctx_bits = 0;
        out.ep_per_node = 0;
        out.name = std::ptr::null();
        out.map_addr = std::ptr::null_mut();
        out.flags = 0;
        Ok(())
    })
}

/// `ep_addr`: the address of a local endpoint in the AV, `FI_ADDR_NOTAVAIL` if absent.
unsafe extern "C" fn peer_av_ep_addr(
    av: *mut fi::fid_peer_av,
    ep: *mut fi::fid_ep,
) -> fi::fi_addr_t {
    let mut out = fi::FI_ADDR_NOTAVAIL;
    let _ = guarded("peer av ep_addr", || {
        // SAFETY: the fid_peer_av the owner gave this peer.
        let a = unsafe { peer_av_of(av) }?;
        if let Some(x) = a.inner.upgrade().and_then(|av| av.ep_addr(ep)) {
            out = x;
        }
        Ok(())
    });
    out
}

unsafe extern "C" fn peer_av_close(_f: *mut fi::fid) -> i32 {
    // The owner frees a peer's fid_peer_av when it is done with the peer.
    0
}

#[cfg(test)]
pub(crate) mod tests {
    //! An in-tree peer driving the owner through the C ops tables only, as a real peer
    //! provider would.
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// What the fake peers saw: (peer, callback, entry context, peer_context, first iov base).
    /// (peer, callback, entry context, peer_context, first iov base).
    type Seen = (usize, &'static str, u64, usize, usize);
    static SEEN: StdMutex<Vec<Seen>> = StdMutex::new(Vec::new());

    fn record(peer: usize, what: &'static str, e: *mut fi::fi_peer_rx_entry) -> i32 {
        // SAFETY: the owner hands a valid entry to the callback.
        let e = unsafe { &*e };
        let base = if e.count > 0 {
            // SAFETY: count ranges.
            unsafe { (*e.iov).iov_base as usize }
        } else {
            0
        };
        SEEN.lock()
            .unwrap()
            .push((peer, what, e.context as u64, e.peer_context as usize, base));
        // The peer is done at once: it gives the entry back, calling into the owner from
        // inside the callback (no lock may be held around it).
        // SAFETY: the entry's srx is the owner's fid_peer_srx with its owner ops.
        unsafe { ((*(*e.srx).owner_ops).free_entry.unwrap())(e as *const _ as *mut _) };
        0
    }

    macro_rules! fake_peer {
        ($ops:ident, $n:expr) => {
            static $ops: fi::fi_ops_srx_peer = {
                unsafe extern "C" fn start_msg(e: *mut fi::fi_peer_rx_entry) -> i32 {
                    record($n, "start_msg", e)
                }
                unsafe extern "C" fn start_tag(e: *mut fi::fi_peer_rx_entry) -> i32 {
                    record($n, "start_tag", e)
                }
                unsafe extern "C" fn discard_msg(e: *mut fi::fi_peer_rx_entry) -> i32 {
                    record($n, "discard_msg", e)
                }
                unsafe extern "C" fn discard_tag(e: *mut fi::fi_peer_rx_entry) -> i32 {
                    record($n, "discard_tag", e)
                }
                fi::fi_ops_srx_peer {
                    size: size_of::<fi::fi_ops_srx_peer>(),
                    start_msg: Some(start_msg),
                    start_tag: Some(start_tag),
                    discard_msg: Some(discard_msg),
                    discard_tag: Some(discard_tag),
                }
            };
        };
    }
    fake_peer!(PEER_A, 1);
    fake_peer!(PEER_B, 2);

    /// Tests share SEEN: one at a time.
    static SERIAL: StdMutex<()> = StdMutex::new(());

    fn setup(ops: &'static fi::fi_ops_srx_peer, owner: &Arc<OwnerSrx>) -> Owned<PeerSrx> {
        let p = owner.peer();
        // SAFETY: the peer fills its ops, as a peer's fi_srx_context does.
        unsafe { (*p.raw()).peer_ops = crate::capi::fid::ops(ops) };
        p
    }

    fn get(
        p: &Owned<PeerSrx>,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
    ) -> (i32, *mut fi::fi_peer_rx_entry) {
        let mut e = std::ptr::null_mut();
        let srx: *mut fi::fid_peer_srx = p.raw();
        // SAFETY: the owner ops of the fid_peer_srx, called as a peer does.
        let rc = unsafe {
            let o = &*p.hdr.owner_ops;
            match kind {
                Kind::Msg => (o.get_msg.unwrap())(srx, addr, size, &mut e),
                Kind::Tag => (o.get_tag.unwrap())(srx, addr, tag, &mut e),
            }
        };
        (rc, e)
    }

    fn owner_ops(p: &PeerSrx) -> &'static fi::fi_ops_srx_owner {
        // SAFETY: set by OwnerSrx::peer to a static table.
        unsafe { &*p.hdr.owner_ops }
    }

    #[test]
    fn posted_first_gives_the_peer_the_receive_and_it_frees_the_entry() {
        let _s = SERIAL.lock().unwrap();
        let owner = OwnerSrx::new(16);
        let a = setup(&PEER_A, &owner);
        let mut buf = [0u8; 64];
        let base = buf.as_mut_ptr() as usize;
        owner
            .recv(
                Kind::Msg,
                Filter::ANY,
                RxBuf::one(buf.as_mut_ptr().cast(), 64),
                11,
                Flags::empty(),
            )
            .unwrap();
        let (rc, e) = get(&a, Kind::Msg, 3, 0, 10);
        assert_eq!(rc, 0);
        // SAFETY: a valid entry handed out by get_msg.
        unsafe {
            assert_eq!((*e).context as u64, 11);
            assert_eq!(((*e).addr, (*e).size, (*e).count), (3, 10, 1));
            assert_eq!((*(*e).iov).iov_base as usize, base);
            assert_eq!((*e).srx, a.raw());
            (owner_ops(&a).free_entry.unwrap())(e);
        }
        assert_eq!(owner.in_use(), 0);
    }

    #[test]
    fn an_unexpected_message_waits_and_its_own_peer_is_started_with_its_context() {
        let _s = SERIAL.lock().unwrap();
        SEEN.lock().unwrap().clear();
        let owner = OwnerSrx::new(16);
        let a = setup(&PEER_A, &owner);
        let b = setup(&PEER_B, &owner);
        // Peer A's message, then peer B's, both before any receive.
        for (p, ctx) in [(&a, 0xa0usize), (&b, 0xb0)] {
            let (rc, e) = get(p, Kind::Msg, 5, 0, 20);
            assert_eq!(rc, -errno::ENOENT);
            // SAFETY: the peer fills its context and queues the entry, per fi_peer(3).
            unsafe {
                assert_eq!((*e).count, 0);
                (*e).peer_context = ctx as *mut c_void;
                assert_eq!((owner_ops(p).queue_msg.unwrap())(e), 0);
            }
        }
        let mut buf = [0u8; 64];
        let base = buf.as_mut_ptr() as usize;
        let one = RxBuf::one(buf.as_mut_ptr().cast(), 64);
        owner
            .recv(Kind::Msg, Filter::ANY, one, 21, Flags::empty())
            .unwrap();
        owner
            .recv(Kind::Msg, Filter::ANY, one, 22, Flags::empty())
            .unwrap();
        assert_eq!(
            *SEEN.lock().unwrap(),
            [
                (1, "start_msg", 21, 0xa0, base),
                (2, "start_msg", 22, 0xb0, base)
            ]
        );
        assert_eq!(
            owner.in_use(),
            0,
            "each peer freed its entry from the callback"
        );
    }

    /// A peer whose `start_msg` refuses entries of size 13 (and frees nothing then).
    static PEER_PICKY: fi::fi_ops_srx_peer = {
        unsafe extern "C" fn start_msg(e: *mut fi::fi_peer_rx_entry) -> i32 {
            // SAFETY: the owner hands a valid entry.
            if unsafe { (*e).size } == 13 {
                return -errno::EIO;
            }
            record(3, "start_msg", e)
        }
        unsafe extern "C" fn other(e: *mut fi::fi_peer_rx_entry) -> i32 {
            record(3, "other", e)
        }
        fi::fi_ops_srx_peer {
            size: size_of::<fi::fi_ops_srx_peer>(),
            start_msg: Some(start_msg),
            start_tag: Some(other),
            discard_msg: Some(other),
            discard_tag: Some(other),
        }
    };

    #[test]
    fn a_refused_start_completes_the_receive_in_error_and_the_others_still_start() {
        // Issue 15, finding 9: the first refusal used to end the post, leaving the other
        // claimed messages neither started nor freed, and the receive consumed silently.
        let _s = SERIAL.lock().unwrap();
        SEEN.lock().unwrap().clear();
        let owner = OwnerSrx::new(16);
        owner.set_min_multi_recv(16);
        let p = setup(&PEER_PICKY, &owner);
        for size in [10, 13, 12] {
            let (rc, e) = get(&p, Kind::Msg, 5, 0, size);
            assert_eq!(rc, -errno::ENOENT);
            // SAFETY: the peer queues the entry, per fi_peer(3).
            unsafe { assert_eq!((owner_ops(&p).queue_msg.unwrap())(e), 0) };
        }
        let mut buf = vec![0u8; 4096];
        let r = RxBuf::one(buf.as_mut_ptr().cast(), 4096);
        let refused = owner
            .recv(Kind::Msg, Filter::ANY, r, 61, Flags::MULTI_RECV)
            .unwrap();
        let started: Vec<_> = SEEN.lock().unwrap().iter().map(|s| (s.1, s.2)).collect();
        assert_eq!(started, [("start_msg", 61), ("start_msg", 61)]);
        assert_eq!(refused.len(), 1);
        assert_eq!(
            (refused[0].op_context, refused[0].err, refused[0].flags),
            (61, errno::EIO, fi::FI_RECV | fi::FI_MSG)
        );
        // Posted: 1 buffer, arrived: 3; started and freed by the peer: 2; refused and
        // freed by the owner: 1. Only the multi-receive buffer itself is still held.
        assert_eq!(owner.in_use(), 1);
    }

    #[test]
    fn tagged_messages_match_by_tag_and_discards_go_to_the_peer() {
        let _s = SERIAL.lock().unwrap();
        SEEN.lock().unwrap().clear();
        let owner = OwnerSrx::new(16);
        let a = setup(&PEER_A, &owner);
        for tag in [7u64, 8] {
            let (rc, e) = get(&a, Kind::Tag, 1, tag, 0);
            assert_eq!(rc, -errno::ENOENT);
            // SAFETY: queue the entry as a peer does.
            unsafe { assert_eq!((owner_ops(&a).queue_tag.unwrap())(e), 0) };
        }
        let mut buf = [0u8; 8];
        let from = Filter {
            addr: crate::core::srx::ADDR_UNSPEC,
            tag: 8,
            ignore: 0,
        };
        let one = RxBuf::one(buf.as_mut_ptr().cast(), 8);
        owner
            .recv(Kind::Tag, from, one, 31, Flags::empty())
            .unwrap();
        assert_eq!(SEEN.lock().unwrap()[0].1, "start_tag");
        assert_eq!(SEEN.lock().unwrap()[0].2, 31);
        // The tag-7 message is discarded: its peer drops it, and the entry comes back.
        assert!(owner.discard(Kind::Tag, Filter::ANY).unwrap().is_some());
        assert!(owner.discard(Kind::Tag, Filter::ANY).unwrap().is_none());
        assert_eq!(SEEN.lock().unwrap()[1].1, "discard_tag");
        assert_eq!(owner.in_use(), 0);
    }

    #[test]
    fn a_multi_receive_buffer_gives_each_message_its_slice() {
        let _s = SERIAL.lock().unwrap();
        let owner = OwnerSrx::new(16);
        owner.set_min_multi_recv(300);
        let a = setup(&PEER_A, &owner);
        let mut buf = vec![0u8; 1000];
        let base = buf.as_mut_ptr() as usize;
        let r = RxBuf::one(buf.as_mut_ptr().cast(), 1000);
        owner
            .recv(Kind::Msg, Filter::ANY, r, 41, Flags::MULTI_RECV)
            .unwrap();
        let mut seen = vec![];
        for size in [200, 300, 300] {
            let (rc, e) = get(&a, Kind::Msg, 1, 0, size);
            assert_eq!(rc, 0);
            // SAFETY: a valid entry; freed after reading.
            unsafe {
                let v = *(*e).iov;
                seen.push((
                    v.iov_base as usize - base,
                    v.iov_len,
                    (*e).flags & fi::FI_MULTI_RECV != 0,
                ));
                (owner_ops(&a).free_entry.unwrap())(e);
            }
        }
        assert_eq!(
            seen,
            [(0, 1000, false), (200, 800, false), (500, 500, true)]
        );
    }

    #[test]
    fn cancel_returns_the_receive_and_a_peer_going_discards_what_it_holds() {
        let _s = SERIAL.lock().unwrap();
        SEEN.lock().unwrap().clear();
        let owner = OwnerSrx::new(8);
        let a = setup(&PEER_A, &owner);
        let mut buf = [0u8; 8];
        let one = RxBuf::one(buf.as_mut_ptr().cast(), 8);
        let tags = Filter {
            addr: crate::core::srx::ADDR_UNSPEC,
            tag: 1,
            ignore: 0,
        };
        owner
            .recv(Kind::Tag, tags, one, 51, Flags::empty())
            .unwrap();
        assert_eq!(owner.cancel(51).unwrap().context, 51);
        assert!(owner.cancel(51).is_none());
        for kind in [Kind::Msg, Kind::Tag] {
            let (rc, e) = get(&a, kind, 0, 1, 4);
            assert_eq!(rc, -errno::ENOENT);
            // SAFETY: queue as a peer does.
            unsafe { assert_eq!((owner_ops(&a).queue_msg.unwrap())(e), 0) };
        }
        // Another peer going takes none of a's messages; a going takes both.
        let b = setup(&PEER_B, &owner);
        owner.discard_from(b.raw());
        assert_eq!(owner.in_use(), 2);
        owner.discard_from(a.raw());
        let seen: Vec<_> = SEEN.lock().unwrap().iter().map(|s| s.1).collect();
        assert_eq!(seen, ["discard_msg", "discard_tag"]);
        assert_eq!(owner.in_use(), 0);
    }

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
            // Error data a peer claims is 2^40 bytes: refused, not an aborted allocation
            // (the bytes are never read: the allocation is tried first).
            let huge = fi::fi_cq_err_entry {
                err_data_size: 1 << 40,
                ..err
            };
            assert_eq!((o.writeerr.unwrap())(cq, &huge), -(errno::ENOMEM as isize));
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

    struct FakeAv;
    impl PeerAvSource for FakeAv {
        fn query(&self) -> (u32, usize) {
            (fi::FI_AV_TABLE, 3)
        }
        fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64> {
            (!ep.is_null()).then_some(2)
        }
    }

    #[test]
    fn a_peer_queries_the_owner_av_and_finds_endpoints_in_it() {
        let fake: Arc<dyn PeerAvSource> = Arc::new(FakeAv);
        let pa = peer_av(Arc::downgrade(&fake));
        let av: *mut fi::fid_peer_av = pa.raw();
        // SAFETY: the owner ops, called as a peer does; attr is a plain C struct.
        unsafe {
            let o = &*pa.hdr.owner_ops;
            let mut attr: fi::fi_av_attr = std::mem::zeroed();
            attr.flags = 99;
            assert_eq!((o.query.unwrap())(av, &mut attr), 0);
            assert_eq!(
                (attr.type_, attr.count, attr.flags),
                (fi::FI_AV_TABLE, 3, 0)
            );
            assert_eq!((o.query.unwrap())(av, std::ptr::null_mut()), -errno::EINVAL);
            let mut some_ep: fi::fid_ep = std::mem::zeroed();
            assert_eq!((o.ep_addr.unwrap())(av, &mut some_ep), 2);
            assert_eq!(
                (o.ep_addr.unwrap())(av, std::ptr::null_mut()),
                fi::FI_ADDR_NOTAVAIL
            );
            let mut wrong = fid(fi::FI_CLASS_AV, std::ptr::null_mut(), &PEER_AV_FI_OPS);
            assert_eq!(
                (o.ep_addr.unwrap())((&raw mut wrong).cast(), &mut some_ep),
                fi::FI_ADDR_NOTAVAIL
            );
        }
        // The verbs AV answers for its own endpoints only: any other fid is not in it.
        // SAFETY: a zeroed fid is not of class FI_CLASS_EP.
        let mut z: fi::fid_ep = unsafe { std::mem::zeroed() };
        // SAFETY: a live (zeroed) fid_ep, refused by its class.
        assert!(unsafe { crate::capi::ep::dgram_name(&mut z) }.is_none());
    }

    #[test]
    fn bad_peer_calls_are_refused_without_crashing() {
        let _s = SERIAL.lock().unwrap();
        let owner = OwnerSrx::new(2);
        let a = setup(&PEER_A, &owner);
        let o = owner_ops(&a);
        let srx: *mut fi::fid_peer_srx = a.raw();
        let mut wrong = fid(fi::FI_CLASS_CQ, std::ptr::null_mut(), &PEER_SRX_FI_OPS);
        let mut e = std::ptr::null_mut();
        let mut local = [0u8; 64];
        // SAFETY: calls as a confused peer might make them.
        unsafe {
            assert_eq!(
                (o.get_msg.unwrap())(srx, 0, 0, std::ptr::null_mut()),
                -errno::EINVAL
            );
            assert_eq!(
                (o.get_msg.unwrap())((&raw mut wrong).cast(), 0, 0, &mut e),
                -errno::EINVAL
            );
            assert_eq!((o.queue_msg.unwrap())(std::ptr::null_mut()), -errno::EINVAL);
            (o.free_entry.unwrap())(std::ptr::null_mut());
            // A queued entry cannot be queued again or freed while queued.
            let (rc, e) = get(&a, Kind::Msg, 0, 0, 1);
            assert_eq!(rc, -errno::ENOENT);
            assert_eq!((o.queue_msg.unwrap())(e), 0);
            assert_eq!((o.queue_msg.unwrap())(e), -errno::EINVAL);
            (o.free_entry.unwrap())(e);
            assert_eq!(
                owner.in_use(),
                1,
                "a queued entry is not freed by free_entry"
            );
            // The engine is full after one more: the peer hears EAGAIN, nothing is lost.
            let (rc, _) = get(&a, Kind::Msg, 0, 0, 1);
            assert_eq!(rc, -errno::ENOENT);
            let (rc, _) = get(&a, Kind::Msg, 0, 0, 1);
            assert_eq!(rc, -errno::EAGAIN);
            let _ = &mut local;
        }
    }
}
