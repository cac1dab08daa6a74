//! libfabric's shm as the local path of an rverbs RDM endpoint (`verbs::rdm_ep::LocalPath`):
//! one shm endpoint per RDM endpoint, named after it (`RdmName::shm_name`) so a peer on the
//! same host finds it from the RDM name in its AV; its arrivals take receives from the RDM
//! endpoint's engine through a peer SRX whose owner ops call `LocalOwner`; its completions
//! are read from its own CQ at each progress call and moved into the endpoint's CQs (a
//! plain CQ works with every libfabric; 1.17.0's shm refuses a peer CQ anyway, see
//! `import`). shm's AV reports its own addresses (1.17.0 drops `FI_AV_USER_ID`: it
//! overwrites the caller's id before reading it): the endpoint translates them back.

use std::cell::UnsafeCell;
use std::ffi::{c_void, CString};
use std::mem::size_of;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use rfabric_sys::fabric as fi;

use crate::capi::ext::import::{check, open_cq, open_peer_srx, read_shm_cq, ShmEp};
use crate::capi::fid::guarded;
use crate::core::cq::CqEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::rdm::RdmName;
use crate::verbs::rdm_ep::RX_IOV_MAX;
use crate::verbs::rdm_ep::{Driven, LocalEntry, LocalOwner, LocalPath, LocalSend};
use crate::verbs::RdmEndpoint;

/// shm completions moved per read of its CQ.
const BATCH: usize = 16;
/// C entries made at a time (their addresses never move).
const CHUNK: usize = 256;
/// Chunks at most: as many engine slots as any endpoint holds (about a million).
const MAX_CHUNKS: usize = 4096;

/// Ranges of a C entry: a receive's (it may scatter) and the scratch past them.
const ENTRY_IOV: usize = RX_IOV_MAX + 1;

/// One engine slot's C face: the receive's ranges, and scratch past them.
#[repr(C)]
struct PeerEntry {
    c: UnsafeCell<fi::fi_peer_rx_entry>,
    iov: UnsafeCell<[libc::iovec; ENTRY_IOV]>,
    desc: UnsafeCell<[*mut c_void; ENTRY_IOV]>,
    /// Handed out with a receive's buffer: the owner frees the slot when shm's completion
    /// of it is read (`LocalOwner::recv_done`), so shm's `free_entry` has nothing to do.
    matched: UnsafeCell<bool>,
}

impl PeerEntry {
    fn new() -> Self {
        PeerEntry {
            // SAFETY: a plain C struct; all-zero (NULL pointers) is valid.
            c: UnsafeCell::new(unsafe { std::mem::zeroed() }),
            iov: UnsafeCell::new(
                [libc::iovec {
                    iov_base: null_mut(),
                    iov_len: 0,
                }; ENTRY_IOV],
            ),
            desc: UnsafeCell::new([null_mut(); ENTRY_IOV]),
            matched: UnsafeCell::new(false),
        }
    }
}

/// The `fid_peer_srx` shm holds, first in a struct whose address it keeps, and the C
/// entries of the engine's slots.
#[repr(C)]
struct LocalSrx {
    srx: UnsafeCell<fi::fid_peer_srx>,
    owner: LocalOwner,
    /// Made on first use, never moved or freed before the SRX: found without a lock.
    chunks: Box<[OnceLock<Box<[PeerEntry]>>]>,
    /// Where shm puts what does not fit a receive (never read): as large as the largest
    /// message, shared by every entry (its bytes are thrown away), untouched until used.
    scratch: Scratch,
}

/// Zeroed memory that only C writes into (no Rust reference to it is ever made).
struct Scratch {
    at: *mut u8,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> Result<Scratch> {
        let len = len.max(1);
        let layout = std::alloc::Layout::from_size_align(len, 64)
            .map_err(|_| Error::new(errno::EINVAL, "scratch size"))?;
        // SAFETY: a non-zero size; zeroed pages of a large allocation stay untouched.
        let at = unsafe { std::alloc::alloc_zeroed(layout) };
        if at.is_null() {
            return Err(Error::new(errno::ENOMEM, "local path scratch"));
        }
        Ok(Scratch { at, len })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; shm's endpoint (the only writer) is
        // closed before the LocalSrx holding this goes.
        unsafe {
            std::alloc::dealloc(
                self.at,
                std::alloc::Layout::from_size_align_unchecked(self.len, 64),
            )
        }
    }
}

// SAFETY: a C entry is written by whoever holds its slot (the owner under the endpoint's
// engine lock or before handing it out, shm between handing out and free/queue), as
// fi_peer(3) orders it; the fid is written once, before shm gets it, and then by shm alone
// (`peer_ops`).
unsafe impl Send for LocalSrx {}
// SAFETY: as above.
unsafe impl Sync for LocalSrx {}

static LOCAL_OWNER_OPS: fi::fi_ops_srx_owner = fi::fi_ops_srx_owner {
    size: size_of::<fi::fi_ops_srx_owner>(),
    get_msg: Some(get_msg),
    get_tag: Some(get_tag),
    queue_msg: Some(queue_entry),
    queue_tag: Some(queue_entry),
    free_entry: Some(free_entry),
};

static LOCAL_SRX_FI_OPS: fi::fi_ops = crate::capi::fid::fi_ops_of!(
    local_srx_close,
    crate::capi::fid::no_bind,
    crate::capi::fid::no_control
);

unsafe extern "C" fn local_srx_close(_f: *mut fi::fid) -> i32 {
    // Freed with the local path, after shm's endpoint is closed.
    0
}

impl LocalSrx {
    /// The C entry of slot `id`, made if the engine grew past what exists.
    fn entry(&self, id: u32) -> Result<&PeerEntry> {
        let (k, i) = (id as usize / CHUNK, id as usize % CHUNK);
        let chunk = self.chunks.get(k).ok_or_else(|| {
            Error::new(
                errno::ENOMEM,
                format!(
                    "engine slot {id}: the local path holds at most {} entries",
                    MAX_CHUNKS * CHUNK
                ),
            )
        })?;
        Ok(&chunk.get_or_init(|| (0..CHUNK).map(|_| PeerEntry::new()).collect())[i])
    }

    /// The slot of an entry this SRX handed out: the slot its `owner_context` names,
    /// proven by the entry's address being that slot's.
    fn id_of(&self, e: *const fi::fi_peer_rx_entry, claimed: usize) -> Result<(u32, &PeerEntry)> {
        let (k, i) = (claimed / CHUNK, claimed % CHUNK);
        match self.chunks.get(k).and_then(OnceLock::get) {
            Some(c) if std::ptr::eq(c[i].c.get(), e) => Ok((claimed as u32, &c[i])),
            _ => Err(Error::new(
                errno::EINVAL,
                "not an rx entry of this endpoint's local path",
            )),
        }
    }

    /// Writes what the endpoint says of slot `id` into its C entry.
    #[inline(always)]
    fn fill(&self, id: u32, e: &LocalEntry) -> Result<*mut fi::fi_peer_rx_entry> {
        let pe = self.entry(id)?;
        let c = pe.c.get();
        // SAFETY: the slot is ours now (claimed or arriving for this call, not with shm).
        unsafe {
            let c = &mut *c;
            c.srx = self.srx.get();
            c.addr = e.addr;
            c.size = e.size;
            c.tag = e.tag;
            c.flags = e.flags.bits();
            c.context = e.context as *mut c_void;
            // Ours to use (fi_ext.h 1.17; the man page calls it user_context): the slot.
            c.owner_context = id as usize as *mut c_void;
            *pe.matched.get() = e.buf.is_some();
            match e.buf {
                Some((addr, len)) => {
                    let iov = &mut *pe.iov.get();
                    // The receive's ranges (a scatter list's non-empty ones), then scratch.
                    iov[0] = libc::iovec {
                        iov_base: addr as *mut c_void,
                        iov_len: len,
                    };
                    let mut n = 1;
                    for &(addr, len) in &e.more {
                        if len > 0 {
                            iov[n] = libc::iovec {
                                iov_base: addr as *mut c_void,
                                iov_len: len,
                            };
                            n += 1;
                        }
                    }
                    let extra = e.scratch.min(self.scratch.len);
                    if extra > 0 {
                        iov[n] = libc::iovec {
                            iov_base: self.scratch.at.cast(),
                            iov_len: extra,
                        };
                        n += 1;
                    }
                    // Its descriptors stay NULL from `PeerEntry::new` (shm only reads them).
                    c.iov = iov.as_mut_ptr();
                    c.desc = (*pe.desc.get()).as_mut_ptr();
                    c.count = n;
                }
                None => {
                    c.iov = null_mut();
                    c.desc = null_mut();
                    c.count = 0;
                }
            }
        }
        Ok(c)
    }
}

/// The local SRX behind a `fid_peer_srx` shm passes back.
///
/// # Safety
/// `srx` is NULL or a readable `fid_peer_srx`.
unsafe fn srx_of<'a>(srx: *const fi::fid_peer_srx) -> Result<&'a LocalSrx> {
    // Ours only if it carries our owner ops (nothing else does); the struct it heads
    // lives as long as shm's endpoint, which is closed before it.
    // SAFETY: the caller's contract.
    if srx.is_null() || !std::ptr::eq(unsafe { (*srx).owner_ops }, &LOCAL_OWNER_OPS) {
        return Err(Error::new(errno::EINVAL, "not this provider's local SRX"));
    }
    // SAFETY: proven ours above; LocalSrx is repr(C) with the fid first.
    Ok(unsafe { &*srx.cast::<LocalSrx>() })
}

unsafe extern "C" fn get_msg(
    srx: *mut fi::fid_peer_srx,
    addr: fi::fi_addr_t,
    size: usize,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    get(srx, false, addr, 0, size, entry)
}

unsafe extern "C" fn get_tag(
    srx: *mut fi::fid_peer_srx,
    addr: fi::fi_addr_t,
    tag: u64,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    // 1.17's get_tag carries no size: shm checks the fit as it copies.
    get(srx, true, addr, tag, 0, entry)
}

fn get(
    srx: *mut fi::fid_peer_srx,
    tagged: bool,
    addr: u64,
    tag: u64,
    size: usize,
    entry: *mut *mut fi::fi_peer_rx_entry,
) -> i32 {
    let mut rc = 0;
    let r = guarded("local srx get", || {
        if entry.is_null() {
            return Err(Error::new(errno::EINVAL, "entry is NULL"));
        }
        // SAFETY: what shm got from us at fi_srx_context.
        let s = unsafe { srx_of(srx) }?;
        let (matched, c) = s
            .owner
            .get(tagged, addr, tag, size, |m, id, e| Ok((m, s.fill(id, e)?)))?;
        // SAFETY: checked for NULL; shm's out-pointer.
        unsafe { *entry = c };
        rc = if matched { 0 } else { -errno::ENOENT };
        Ok(())
    });
    if r != 0 {
        r
    } else {
        rc
    }
}

/// The local SRX and slot of an entry shm hands back.
///
/// # Safety
/// `e` is NULL or an entry shm got from `get`.
unsafe fn owner_of<'a>(
    e: *const fi::fi_peer_rx_entry,
) -> Result<(&'a LocalSrx, u32, &'a PeerEntry)> {
    if e.is_null() {
        return Err(Error::new(errno::EINVAL, "entry is NULL"));
    }
    // SAFETY: the caller's contract; its srx is proven ours, the entry by its address.
    let s = unsafe { srx_of((*e).srx) }?;
    // SAFETY: as above; read as a number, only trusted once id_of proves it.
    let claimed = unsafe { (*e).owner_context } as usize;
    let (id, pe) = s.id_of(e, claimed)?;
    Ok((s, id, pe))
}

unsafe extern "C" fn queue_entry(entry: *mut fi::fi_peer_rx_entry) -> i32 {
    guarded("local srx queue", || {
        // SAFETY: an entry handed out by get.
        let (s, id, _) = unsafe { owner_of(entry) }?;
        // SAFETY: shm hands it back: ours again, with its peer_context set.
        let (size, tag, ctx) = unsafe { ((*entry).size, (*entry).tag, (*entry).peer_context) };
        // SAFETY: shm 1.17 queues an entry whose peer_context is its command context.
        let (size, data) = match unsafe { shm_queued(ctx, tag) } {
            Some((n, data)) if size == 0 => (n, data),
            _ => (size, None),
        };
        s.owner.queue(id, size, data)
    })
}

/// The size and remote CQ data of an unexpected message libfabric 1.17's shm queues. Its
/// `get_tag` carries no size and the peer API no CQ data, yet `FI_PEEK` (MPI_Probe,
/// mpi4py's pickled receives) must report both. shm's `peer_context` is then its
/// `struct smr_cmd_ctx` (prov/shm/src/smr.h 1.17: a `dlist_entry`, the endpoint pointer,
/// then the 16-byte-aligned `struct smr_cmd` whose `smr_msg_hdr` (include/ofi_shm.h) holds
/// `op` at 16, `op_flags` at 22, `size` at 24, `data` at 40, `tag` at 48). Trusted only
/// when the header names a message operation with the tag the entry carries; otherwise
/// `None` (the owner reports what it knows).
///
/// # Safety
/// `ctx` is NULL or the `peer_context` shm set on an entry it queues (an allocation of at
/// least `sizeof(struct smr_cmd_ctx)`, 288 bytes).
unsafe fn shm_queued(ctx: *mut c_void, tag: u64) -> Option<(usize, Option<u64>)> {
    const CMD: usize = 32;
    const OFI_OP_MSG: u32 = 0;
    const OFI_OP_TAGGED: u32 = 1;
    const SMR_REMOTE_CQ_DATA: u16 = 1;
    // The layout is 1.17's own (DESIGN.md decision 5: pin to 1.17, check fi_version()).
    static IS_117: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: a plain query of the loaded libfabric.
    let is_117 = *IS_117.get_or_init(
        || unsafe { fi::fi_version() } >> 16 == 1 && unsafe { fi::fi_version() } & 0xffff == 17,
    );
    if ctx.is_null() || !is_117 {
        return None;
    }
    let b = ctx.cast::<u8>();
    // SAFETY: within the command context (the caller's contract); unaligned reads.
    let (op, flags, size, data, htag) = unsafe {
        (
            b.add(CMD + 16).cast::<u32>().read_unaligned(),
            b.add(CMD + 22).cast::<u16>().read_unaligned(),
            b.add(CMD + 24).cast::<u64>().read_unaligned(),
            b.add(CMD + 40).cast::<u64>().read_unaligned(),
            b.add(CMD + 48).cast::<u64>().read_unaligned(),
        )
    };
    let ok = match op {
        OFI_OP_TAGGED => htag == tag,
        OFI_OP_MSG => true,
        _ => false,
    };
    (ok && size <= isize::MAX as u64).then(|| {
        (
            size as usize,
            (flags & SMR_REMOTE_CQ_DATA != 0).then_some(data),
        )
    })
}

unsafe extern "C" fn free_entry(entry: *mut fi::fi_peer_rx_entry) {
    let _ = guarded("local srx free_entry", || {
        // SAFETY: an entry handed out by get.
        let (s, id, pe) = unsafe { owner_of(entry) }?;
        // SAFETY: shm hands the slot back: ours again (see LocalSrx's Sync).
        if unsafe { *pe.matched.get() } {
            return Ok(());
        }
        s.owner.free(id)
    });
}

/// libfabric's shm carrying one RDM endpoint's local traffic.
pub struct ShmLocal {
    // Dropped first: shm's endpoint goes before the SRX it holds.
    ep: ShmEp,
    srx: Box<LocalSrx>,
    _srx_ctx: Box<fi::fi_peer_srx_context>,
    owner: LocalOwner,
    inject: usize,
    closed: AtomicBool,
}

// SAFETY: shm's objects are opened FI_THREAD_SAFE (its default), so they may be used from
// any thread; the raw pointers are only handed back to shm.
unsafe impl Send for ShmLocal {}
// SAFETY: as above.
unsafe impl Sync for ShmLocal {}

impl std::fmt::Debug for ShmLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmLocal(inject {})", self.inject)
    }
}

impl ShmLocal {
    /// Opens shm for the endpoint named `name`, with `owner`'s engine as its receive side.
    pub fn open(name: &RdmName, owner: LocalOwner, max: usize) -> Result<ShmLocal> {
        let mut ep = ShmEp::open_domain()?;
        let srx = Box::new(LocalSrx {
            srx: UnsafeCell::new(fi::fid_peer_srx {
                ep_fid: fi::fid_ep {
                    fid: crate::capi::fid::fid(fi::FI_CLASS_SRX_CTX, null_mut(), &LOCAL_SRX_FI_OPS),
                    ops: null_mut(),
                    cm: null_mut(),
                    msg: null_mut(),
                    rma: null_mut(),
                    tagged: null_mut(),
                    atomic: null_mut(),
                    collective: null_mut(),
                },
                owner_ops: crate::capi::fid::ops(&LOCAL_OWNER_OPS),
                peer_ops: null_mut(),
            }),
            owner: owner.clone(),
            chunks: (0..MAX_CHUNKS).map(|_| OnceLock::new()).collect(),
            scratch: Scratch::new(max)?,
        });
        let mut srx_ctx = Box::new(fi::fi_peer_srx_context {
            size: size_of::<fi::fi_peer_srx_context>(),
            srx: srx.srx.get(),
        });
        let shm_name = CString::new(name.shm_name())
            .map_err(|_| Error::new(errno::EINVAL, "an shm name with a NUL"))?;
        // SAFETY: shm's open domain; the SRX and its context are boxed and kept in the
        // ShmLocal, which closes shm's endpoint before dropping them.
        let inject = unsafe {
            ep.cq = open_cq(ep.domain, 0, null_mut())?;
            open_peer_srx(ep.domain, &mut srx_ctx, srx.srx.get())?;
            ep.finish(
                Some(srx.srx.get().cast()),
                Some(&shm_name),
                fi::FI_SELECTIVE_COMPLETION,
            )?;
            (*(*ep.info).tx_attr).inject_size
        };
        crate::fi_info!(
            "rdm",
            "{}: peers on this host go over shm ({})",
            name.to_str(),
            name.shm_name()
        );
        Ok(ShmLocal {
            ep,
            srx,
            _srx_ctx: srx_ctx,
            owner,
            inject,
            closed: AtomicBool::new(false),
        })
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(errno::EOPBADSTATE, "the local path is closed"));
        }
        Ok(())
    }

    /// Reads at most `n` of shm's completions (0: drives its progress only) into the
    /// endpoint; how many moved. A receive's context is its engine slot
    /// (`LocalEntry::context`), a send's what `LocalSend::context` gave.
    /// `driven`: the endpoint's progress call behind it, if any.
    fn move_some(&self, n: usize, mut driven: Option<&mut Driven<'_, '_>>) -> Result<usize> {
        read_shm_cq(
            self.ep.cq,
            n,
            #[inline(always)]
            |c| match c {
                Ok((e, _)) if e.flags & fi::FI_SEND != 0 => {
                    self.owner
                        .send_done(e.op_context, None, driven.as_deref_mut())
                }
                Ok((e, _)) => {
                    self.owner
                        .recv_done(e.op_context as u32, e, None, driven.as_deref_mut())
                }
                Err(c) if c.flags & fi::FI_SEND != 0 => {
                    self.owner.send_done(c.op_context, Some(c.err), None)
                }
                Err(c) => {
                    let e = CqEntry {
                        op_context: c.op_context,
                        flags: c.flags,
                        len: c.len,
                        buf: c.buf,
                        data: c.data,
                        tag: c.tag,
                    };
                    self.owner
                        .recv_done(c.op_context as u32, e, Some(c.err), None)
                }
            },
        )
    }
}

impl LocalPath for ShmLocal {
    fn insert(&self, name: &RdmName) -> Result<u64> {
        self.check_open()?;
        let n = CString::new(name.shm_name())
            .map_err(|_| Error::new(errno::EINVAL, "an shm name with a NUL"))?;
        self.ep.insert(n.as_bytes_with_nul())
    }

    fn inject_size(&self) -> usize {
        self.inject
    }

    fn send(&self, to: u64, m: &LocalSend<'_>) -> Result<()> {
        self.check_open()?;
        if let ([(addr, len)], None, false) = (m.iov, m.context, m.delivery_complete) {
            return self.inject(to, m.tagged.then_some(m.tag), m.data, *addr, *len);
        }
        let mut iov = [libc::iovec {
            iov_base: null_mut(),
            iov_len: 0,
        }; 4];
        if m.iov.len() > iov.len() {
            return Err(Error::new(errno::EINVAL, "more than 4 ranges for shm"));
        }
        for (v, &(a, n)) in iov.iter_mut().zip(m.iov) {
            *v = libc::iovec {
                iov_base: a as *mut c_void,
                iov_len: n,
            };
        }
        let mut desc = [null_mut::<c_void>(); 4];
        // Under the selective completion its CQ is bound with: an inject completes
        // nothing, any other send completes (its buffer is held until then).
        let flags = match m.context {
            None => fi::FI_INJECT,
            Some(_) => fi::FI_COMPLETION,
        } | if m.data.is_some() {
            fi::FI_REMOTE_CQ_DATA
        } else {
            0
        } | if m.delivery_complete {
            fi::FI_DELIVERY_COMPLETE
        } else {
            0
        };
        let context = m.context.unwrap_or(0) as *mut c_void;
        // SAFETY: shm's enabled endpoint; the ranges are memory valid for the call (an
        // inject) or until the send's completion (the caller holds them).
        let rc = unsafe {
            if m.tagged {
                let msg = fi::fi_msg_tagged {
                    msg_iov: iov.as_ptr(),
                    desc: desc.as_mut_ptr(),
                    iov_count: m.iov.len(),
                    addr: to,
                    tag: m.tag,
                    ignore: 0,
                    context,
                    data: m.data.unwrap_or(0),
                };
                ((*(*self.ep.ep).tagged).sendmsg.expect("tsendmsg"))(self.ep.ep, &msg, flags)
            } else {
                let msg = fi::fi_msg {
                    msg_iov: iov.as_ptr(),
                    desc: desc.as_mut_ptr(),
                    iov_count: m.iov.len(),
                    addr: to,
                    context,
                    data: m.data.unwrap_or(0),
                };
                ((*(*self.ep.ep).msg).sendmsg.expect("sendmsg"))(self.ep.ep, &msg, flags)
            }
        };
        if rc == -(errno::EAGAIN as isize) {
            // shm's queue to that peer is full until it (and we) make progress.
            self.progress(None);
        }
        check(rc, "fi_sendmsg(shm)").map(|_| ())
    }

    /// shm's `fi_inject` family, which goes straight to its inject protocol (`fi_sendmsg`
    /// with `FI_INJECT` picks one among all of them first).
    fn inject(
        &self,
        to: u64,
        tag: Option<u64>,
        data: Option<u64>,
        addr: u64,
        len: usize,
    ) -> Result<()> {
        self.check_open()?;
        let buf = addr as *const c_void;
        // SAFETY: shm's enabled endpoint; `len` bytes at `addr` are readable for the call,
        // which copies them; shm fills every op of its tables at open.
        let rc = unsafe {
            let ep = self.ep.ep;
            match (tag, data) {
                (Some(t), None) => ((*(*ep).tagged).inject.expect("tinject"))(ep, buf, len, to, t),
                (Some(t), Some(d)) => {
                    ((*(*ep).tagged).injectdata.expect("tinjectdata"))(ep, buf, len, d, to, t)
                }
                (None, None) => ((*(*ep).msg).inject.expect("inject"))(ep, buf, len, to),
                (None, Some(d)) => {
                    ((*(*ep).msg).injectdata.expect("injectdata"))(ep, buf, len, d, to)
                }
            }
        };
        if rc == -(errno::EAGAIN as isize) {
            self.progress(None);
        }
        check(rc, "fi_inject(shm)").map(|_| ())
    }

    fn hand_back(&self, id: u32, e: &LocalEntry, discard: bool) -> Result<()> {
        self.check_open()?;
        let c = self.srx.fill(id, e)?;
        // SAFETY: the slot is claimed for shm's message; shm filled peer_ops at
        // fi_srx_context (checked at open) and keeps the entry's peer_context.
        let rc = unsafe {
            let ops = &*(*self.srx.srx.get()).peer_ops;
            let f = match (e.tagged, discard) {
                (false, false) => ops.start_msg,
                (true, false) => ops.start_tag,
                (false, true) => ops.discard_msg,
                (true, true) => ops.discard_tag,
            }
            .ok_or_else(|| Error::new(errno::EINVAL, "shm left a peer callback NULL"))?;
            f(c)
        };
        if rc < 0 {
            return Err(Error::new(-rc, "shm refused a matched message"));
        }
        Ok(())
    }

    fn progress(&self, mut driven: Option<&mut Driven<'_, '_>>) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let r = crate::core::peer::drain(
            || self.owner.room(),
            |n| self.move_some(n, driven.as_deref_mut()),
            BATCH,
        );
        if let Err(e) = r {
            crate::fi_warn!("rdm", "shm progress: {e}");
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// Imports shm as the local path of `ep` (enabled), unless `FI_RVERBS_RDM_SHM=0`. When shm
/// cannot be opened (libfabric filtered it out with `FI_PROVIDER`, say) every peer goes
/// over verbs, as it logs. True when imported.
pub fn import_shm(ep: &RdmEndpoint) -> Result<bool> {
    if crate::core::env::get_usize_or("FI_RVERBS_RDM_SHM", 1)? == 0 {
        crate::fi_info!(
            "rdm",
            "FI_RVERBS_RDM_SHM=0: peers on this host go over verbs"
        );
        return Ok(false);
    }
    let name = ep.getname()?;
    match ShmLocal::open(&name, ep.local_owner(), ep.max_msg_size()) {
        Ok(l) => {
            ep.set_local_path(Arc::new(l))?;
            Ok(true)
        }
        Err(e) => {
            crate::fi_info!(
                "rdm",
                "shm is not available ({e}): peers on this host go over verbs"
            );
            Ok(false)
        }
    }
}
