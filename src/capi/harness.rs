//! Hostile calls into every C entry point, for the `c_abi_handles` fuzz target (built with
//! the `test-support` feature, left out of the shipped library).
//!
//! Every slot of every ops table rverbs hands out is called with its own signature, with
//! handles drawn from a pool that holds what an application or a misbehaving peer can
//! pass: NULL, zeroed and random memory, forged headers of every class, other providers'
//! objects (same classes, other ops tables), closed handles (tombstones), and the live
//! objects that exist without a device: a fabric, and the peer objects of an owner SRX, CQ
//! and AV driven by peers that fail their callbacks. Each call must return 0, a count, or
//! a documented `-errno`; a caught panic (`-FI_EOTHER`) is a failure of the target.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, no_bind, no_control, Owned};
use crate::capi::peer::av::{peer_av, PeerAv, PeerAvSource};
use crate::capi::peer::cq::{peer_cq, PeerCq, PeerCqTarget};
use crate::capi::peer::srx::{OwnerSrx, PeerSrx};
use crate::core::cq::{CqEntry, CqErrEntry, CqState};
use crate::core::error::Result;

/// Zeroed memory any header fits in (a zeroed C struct is a valid one: NULL pointers).
const SLAB: usize = 512;

/// A source of choices (the fuzzer's bytes).
pub trait Choose {
    fn pick(&mut self, n: usize) -> usize;
    fn word(&mut self) -> u64;
}

/// The owner's CQ a peer writes to: a small software queue, so overruns happen.
struct Sink(Mutex<CqState>);
impl PeerCqTarget for Sink {
    fn write(&self, entry: CqEntry, src: u64) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_entry_from(entry, src)
    }
    fn writeerr(&self, entry: CqErrEntry) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_error(entry)
    }
    fn room(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).room()
    }
}

struct Source;
impl PeerAvSource for Source {
    fn query(&self) -> (u32, usize) {
        (fi::FI_AV_TABLE, 2)
    }
    fn ep_addr(&self, _ep: *mut fi::fid_ep) -> Option<u64> {
        None
    }
}

/// Whether the misbehaving peer's callbacks fail (switched by the fuzzer).
static PEER_FAILS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

unsafe extern "C" fn peer_cb(e: *mut fi::fi_peer_rx_entry) -> i32 {
    if PEER_FAILS.load(std::sync::atomic::Ordering::Relaxed) {
        return -crate::core::error::errno::EIO;
    }
    // The peer is done at once and gives the entry back (a second free is the fuzzer's).
    // SAFETY: the owner hands a valid entry whose srx carries the owner ops.
    unsafe {
        if let Some(f) = (*e)
            .srx
            .as_ref()
            .and_then(|s| s.owner_ops.as_ref())
            .and_then(|o| o.free_entry)
        {
            f(e);
        }
    }
    0
}

static PEER_SRX_OPS: fi::fi_ops_srx_peer = fi::fi_ops_srx_peer {
    size: std::mem::size_of::<fi::fi_ops_srx_peer>(),
    start_msg: Some(peer_cb),
    start_tag: Some(peer_cb),
    discard_msg: Some(peer_cb),
    discard_tag: Some(peer_cb),
};

unsafe extern "C" fn foreign_close(_f: *mut fi::fid) -> i32 {
    0
}
/// Another provider's ops table (shm's, say): same classes, not ours.
static FOREIGN_FI_OPS: fi::fi_ops = fi_ops_of!(foreign_close, no_bind, no_control);

/// The handles and buffers of one fuzz input.
pub struct Pool {
    handles: Vec<*mut c_void>,
    #[allow(clippy::vec_box)] // each slab stays at one address while pointers to it live
    bufs: Vec<Box<[u64; SLAB / 8]>>,
    fabric: *mut fi::fid_fabric,
    owner: Arc<OwnerSrx>,
    srx: Option<Owned<PeerSrx>>,
    cq: Option<Owned<PeerCq>>,
    av: Option<Owned<PeerAv>>,
    entries: Vec<*mut c_void>,
    _sink: Arc<dyn PeerCqTarget>,
    _source: Arc<dyn PeerAvSource>,
}

impl Pool {
    pub fn new(c: &mut dyn Choose) -> Pool {
        let prov = crate::capi::provider::fi_prov_ini();
        // SAFETY: a plain C struct; zero is valid.
        let mut attr: fi::fi_fabric_attr = unsafe { std::mem::zeroed() };
        attr.prov_name = c"rverbs".as_ptr().cast_mut();
        attr.api_version = fi::RFABRIC_FI_VERSION;
        let mut fabric = null_mut();
        // SAFETY: the provider's fabric entry, a valid attr and out-pointer.
        let _ = unsafe { ((*prov).fabric.expect("fabric"))(&mut attr, &mut fabric, null_mut()) };
        let owner = OwnerSrx::new(1 + c.pick(8));
        owner.set_min_multi_recv(1 + c.pick(64));
        let srx = owner.peer();
        // SAFETY: the peer fills its ops, as a peer's fi_srx_context does.
        unsafe { (*srx.raw()).peer_ops = std::ptr::from_ref(&PEER_SRX_OPS).cast_mut() };
        let sink: Arc<dyn PeerCqTarget> = Arc::new(Sink(Mutex::new(CqState::new(1 + c.pick(4)))));
        let cq = peer_cq(sink.clone());
        let source: Arc<dyn PeerAvSource> = Arc::new(Source);
        let av = peer_av(Arc::downgrade(&source));
        let mut p = Pool {
            handles: Vec::new(),
            bufs: Vec::new(),
            fabric,
            owner,
            srx: Some(srx),
            cq: Some(cq),
            av: Some(av),
            entries: Vec::new(),
            _sink: sink,
            _source: source,
        };
        p.handles.push(null_mut());
        p.handles.push(fabric.cast());
        p.handles
            .push(p.srx.as_ref().map_or(null_mut(), |s| s.raw().cast()));
        p.handles
            .push(p.cq.as_ref().map_or(null_mut(), |s| s.raw().cast()));
        p.handles
            .push(p.av.as_ref().map_or(null_mut(), |s| s.raw().cast()));
        // Zeroed, random, forged (every class, ours or a foreign table) memory.
        let zero = p.buf(|_| 0);
        p.handles.push(zero);
        let words: Vec<u64> = (0..SLAB / 8).map(|_| c.word()).collect();
        let random = p.buf(|i| words[i]);
        p.handles.push(random);
        for class in 0..=fi::FI_CLASS_PEER_AV_SET as u64 {
            let foreign = std::ptr::from_ref(&FOREIGN_FI_OPS) as u64;
            let forged = p.buf(|i| match i {
                0 => class,
                2 => foreign,
                _ => 0,
            });
            p.handles.push(forged);
            // Plain data that starts with the class value, as a garbage descriptor would.
            let plain = p.buf(|i| if i == 0 { class } else { words[i] });
            p.handles.push(plain);
        }
        p
    }

    fn buf(&mut self, f: impl Fn(usize) -> u64) -> *mut c_void {
        let mut b = Box::new([0u64; SLAB / 8]);
        for (i, w) in b.iter_mut().enumerate() {
            *w = f(i);
        }
        let p = b.as_mut_ptr().cast();
        self.bufs.push(b);
        p
    }

    fn handle(&mut self, c: &mut dyn Choose) -> *mut c_void {
        self.handles[c.pick(self.handles.len())]
    }

    /// An rx entry a peer hands back: one the owner gave out (perhaps freed, perhaps of a
    /// closed SRX), NULL, zeroed memory, or a forged entry naming a handle of the pool as
    /// its SRX. (A peer can crash any owner with a pointer into unreadable memory; the
    /// harness passes readable memory, as libfabric's contract asks.)
    fn entry(&mut self, c: &mut dyn Choose) -> *mut c_void {
        match c.pick(4) {
            0 if !self.entries.is_empty() => self.entries[c.pick(self.entries.len())],
            0 | 1 => null_mut(),
            2 => self.buf(|_| 0),
            _ => {
                let srx = self.handles[c.pick(5)] as u64;
                let at = std::mem::offset_of!(fi::fi_peer_rx_entry, srx) / 8;
                self.buf(|i| if i == at { srx } else { 0 })
            }
        }
    }

    /// A pointer argument: NULL, or zeroed memory big enough for any struct passed.
    fn arg(&mut self, c: &mut dyn Choose) -> *mut c_void {
        if c.pick(4) == 0 {
            null_mut()
        } else {
            self.buf(|_| 0)
        }
    }

    /// A length: what fits the zeroed buffers, or one no buffer has (which must be refused
    /// before any byte is read).
    fn len(&mut self, c: &mut dyn Choose) -> usize {
        const HUGE: [usize; 5] = [
            1 << 40,
            1 << 48,
            isize::MAX as usize,
            usize::MAX - 7,
            usize::MAX,
        ];
        match c.pick(3) {
            0 => c.pick(SLAB / 2),
            1 => HUGE[c.pick(HUGE.len())],
            _ => 0,
        }
    }

    /// Closes (retires) one of the live objects: later calls meet its tombstone.
    fn close_one(&mut self, c: &mut dyn Choose) {
        match c.pick(4) {
            0 => drop(self.srx.take()),
            1 => drop(self.cq.take()),
            2 => drop(self.av.take()),
            _ => {
                // SAFETY: the fabric's own close slot (a second close meets the tombstone).
                let _ = unsafe {
                    ((*(*self.fabric).fid.ops).close.expect("close"))(self.fabric.cast())
                };
            }
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pool({} handles, {} entries)",
            self.handles.len(),
            self.entries.len()
        )
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Tombstones keep handles readable; the fabric is closed once (its second close is
        // refused), the peers' objects retire with their owners.
        // SAFETY: the fabric, open or a tombstone.
        let _ = unsafe { ((*(*self.fabric).fid.ops).close.expect("close"))(self.fabric.cast()) };
        self.srx.take();
        self.cq.take();
        self.av.take();
    }
}

/// The errnos a call may answer with; anything else (a caught panic is `-FI_EOTHER`) is a
/// failure.
pub fn documented(rc: i64) -> bool {
    use crate::core::error::errno::*;
    if rc >= 0 {
        return true;
    }
    let e = (-rc) as i32;
    [
        EINVAL,
        ENOSYS,
        EAGAIN,
        EBADFLAGS,
        ENOMEM,
        ETOOSMALL,
        EOPBADSTATE,
        ENOPROTOOPT,
        EBUSY,
        ENOENT,
        EPERM,
        ENODATA,
        EOVERRUN,
        ENOEQ,
        ENOAV,
        EMSGSIZE,
        EOPNOTSUPP,
        EAVAIL,
        ENOMSG,
        ECANCELED,
        ETRUNC,
        EADDRNOTAVAIL,
        ENOTCONN,
        EISCONN,
        EIO,
        ENODEV,
    ]
    .contains(&e)
}

macro_rules! slot {
    ($t:expr, $f:ident) => {
        ($t).$f.expect(concat!("slot ", stringify!($f)))
    };
}

/// Makes one hostile call, chosen by `c`, and returns what it answered.
pub fn call(p: &mut Pool, c: &mut dyn Choose) -> i64 {
    let kind = c.pick(16);
    call_kind(p, c, kind)
}

/// As [`call`], playing only the misbehaving peer (the peer ops, the owner's receives meeting
/// what the peer holds, and closes of the owner's objects under it).
pub fn call_peer(p: &mut Pool, c: &mut dyn Choose) -> i64 {
    let kind = 13 + c.pick(3);
    call_kind(p, c, kind)
}

fn call_kind(p: &mut Pool, c: &mut dyn Choose, kind: usize) -> i64 {
    use crate::capi::*;
    PEER_FAILS.store(c.pick(3) == 0, std::sync::atomic::Ordering::Relaxed);
    let h = p.handle(c);
    let (a1, a2, a3) = (p.arg(c), p.arg(c), p.arg(c));
    let (l1, l2) = (p.len(c), p.len(c));
    let flags = c.word();
    let ctx = c.word() as *mut c_void; // the top byte set as often as not
    let fid_ops: [&fi::fi_ops; 26] = [
        &fabric::FABRIC_FI_OPS,
        &domain::DOMAIN_FI_OPS,
        &mr::MR_FI_OPS,
        &av::AV_FI_OPS,
        &avset::AV_SET_FI_OPS,
        &cq::CQ_FI_OPS,
        &eq::EQ_FI_OPS,
        &eq::CONNREQ_FI_OPS,
        &pep::PEP_FI_OPS,
        &msg_ep::MSG_EP_FI_OPS,
        &dgram_ep::DGRAM_EP_FI_OPS,
        &mc::MC_FI_OPS,
        &srx::SRX_FI_OPS,
        &soft_srx::SOFT_FI_OPS,
        &ext::IMPORT_FI_OPS,
        &ext::transfer::TRANSFER_FI_OPS,
        &peer::srx::PEER_SRX_FI_OPS,
        &peer::cq::PEER_CQ_FI_OPS,
        &peer::av::PEER_AV_FI_OPS,
        &peer::av_set::PEER_AV_SET_FI_OPS,
        &poll::POLL_FI_OPS,
        &wait::WAIT_FI_OPS,
        &crate::capi::fid::CLOSED_FI_OPS,
        &FOREIGN_FI_OPS,
        &fabric::FABRIC_FI_OPS,
        &cq::CQ_FI_OPS,
    ];
    let ep_ops: [&fi::fi_ops_ep; 5] = [
        &msg_ep::MSG_EP_OPS,
        &dgram_ep::DGRAM_EP_OPS,
        &pep::PEP_OPS,
        &srx::SRX_OPS,
        &soft_srx::SOFT_OPS,
    ];
    let cm_ops: [&fi::fi_ops_cm; 4] = [
        &msg_ep::MSG_EP_CM,
        &dgram_ep::DGRAM_EP_CM,
        &pep::PEP_CM,
        &srx::SRX_CM,
    ];
    let msg_ops: [&fi::fi_ops_msg; 5] = [
        &msg_ep::MSG_EP_MSG,
        &dgram_ep::DGRAM_EP_MSG,
        &srx::SRX_MSG,
        &soft_srx::SOFT_MSG,
        &ext::transfer::TRANSFER_MSG,
    ];
    let iov = a2.cast::<libc::iovec>();
    let desc = a3.cast::<*mut c_void>();
    let count = l2 % 40;
    // SAFETY: each slot is called with its own signature; the arguments are what the
    // fuzzer may pass: pointers are NULL or zeroed slabs of SLAB bytes, handles come from
    // the pool (readable memory), lengths are in the slabs or absurd.
    unsafe {
        let hf = h.cast::<fi::fid>();
        let he = h.cast::<fi::fid_ep>();
        match kind {
            0 => {
                let t = fid_ops[c.pick(fid_ops.len())];
                match c.pick(4) {
                    0 => slot!(t, close)(hf) as i64,
                    1 => slot!(t, bind)(hf, p.handle(c).cast(), flags) as i64,
                    2 => slot!(t, control)(hf, c.pick(40) as i32, a1) as i64,
                    _ => slot!(t, ops_open)(hf, c"rverbs_peer_v1".as_ptr(), flags, a1.cast(), ctx)
                        as i64,
                }
            }
            1 => {
                let t = ep_ops[c.pick(ep_ops.len())];
                match c.pick(5) {
                    0 => slot!(t, cancel)(hf, ctx) as i64,
                    1 => slot!(t, getopt)(hf, c.pick(3) as i32, c.pick(20) as i32, a1, a2.cast())
                        as i64,
                    2 => slot!(t, setopt)(hf, c.pick(3) as i32, c.pick(20) as i32, a1, l1) as i64,
                    3 => slot!(t, rx_size_left)(he) as i64,
                    _ => slot!(t, tx_size_left)(he) as i64,
                }
            }
            2 => {
                let t = cm_ops[c.pick(cm_ops.len())];
                match c.pick(9) {
                    0 => slot!(t, setname)(hf, a1, l1) as i64,
                    1 => slot!(t, getname)(hf, a1, a2.cast()) as i64,
                    2 => slot!(t, getpeer)(he, a1, a2.cast()) as i64,
                    3 => slot!(t, connect)(he, a1, a2, l1) as i64,
                    4 => slot!(t, listen)(h.cast()) as i64,
                    5 => slot!(t, accept)(he, a1, l1) as i64,
                    6 => slot!(t, reject)(h.cast(), p.handle(c).cast(), a1, l1) as i64,
                    7 => slot!(t, shutdown)(he, flags) as i64,
                    _ => slot!(t, join)(he, a1, flags, a2.cast(), ctx) as i64,
                }
            }
            3 | 4 if c.pick(4) == 0 => {
                // RDM atomics (their handle proved before use): operation and datatype
                // values in range and past it.
                let t = &rdm_atomic::RDM_EP_ATOMIC;
                let d = p.handle(c);
                let (dt, op) = (c.pick(18) as u32, c.pick(21) as u32);
                let (r, ioc) = (a2, iov.cast::<fi::fi_ioc>());
                let w = c.word();
                match c.pick(8) {
                    0 => slot!(t, write)(he, a1, count, d, w, w, w, dt, op, ctx) as i64,
                    1 => slot!(t, writev)(he, ioc, desc, count, w, w, w, dt, op, ctx) as i64,
                    2 => slot!(t, writemsg)(he, a1.cast(), flags) as i64,
                    3 => slot!(t, inject)(he, a1, count, w, w, w, dt, op) as i64,
                    4 => slot!(t, readwrite)(he, a1, count, d, r, d, w, w, w, dt, op, ctx) as i64,
                    5 => slot!(t, readwritemsg)(he, a1.cast(), ioc, desc, count, flags) as i64,
                    6 => slot!(t, compwrite)(he, a1, count, d, a3, d, r, d, w, w, w, dt, op, ctx)
                        as i64,
                    _ => {
                        let mut n = 0usize;
                        slot!(t, writevalid)(he, dt, op, &mut n) as i64
                    }
                }
            }
            3 | 4 => {
                let t = msg_ops[c.pick(msg_ops.len())];
                let d = p.handle(c);
                match c.pick(9) {
                    0 => slot!(t, send)(he, a1, l1, d, flags, ctx) as i64,
                    1 => slot!(t, sendv)(he, iov, desc, count, flags, ctx) as i64,
                    2 => slot!(t, sendmsg)(he, a1.cast(), flags) as i64,
                    3 => slot!(t, inject)(he, a1, l1, flags) as i64,
                    4 => slot!(t, senddata)(he, a1, l1, d, flags, flags, ctx) as i64,
                    5 => slot!(t, injectdata)(he, a1, l1, flags, flags) as i64,
                    6 => slot!(t, recv)(he, a1, l1, d, flags, ctx) as i64,
                    7 => slot!(t, recvv)(he, iov, desc, count, flags, ctx) as i64,
                    _ => slot!(t, recvmsg)(he, a1.cast(), flags) as i64,
                }
            }
            5 => {
                let t = &soft_srx::SOFT_TAGGED;
                let d = p.handle(c);
                match c.pick(3) {
                    0 => slot!(t, recv)(he, a1, l1, d, flags, flags, flags, ctx) as i64,
                    1 => slot!(t, recvv)(he, iov, desc, count, flags, flags, flags, ctx) as i64,
                    _ => slot!(t, recvmsg)(he, a1.cast(), flags) as i64,
                }
            }
            6 => {
                let t = &cq::CQ_OPS;
                let hc = h.cast::<fi::fid_cq>();
                match c.pick(6) {
                    0 => slot!(t, read)(hc, a1, count) as i64,
                    1 => slot!(t, readfrom)(hc, a1, count, a2.cast()) as i64,
                    2 => slot!(t, readerr)(hc, a1.cast(), flags) as i64,
                    3 => slot!(t, sread)(hc, a1, count, a2, 0) as i64,
                    4 => slot!(t, signal)(hc) as i64,
                    _ => {
                        slot!(t, strerror)(hc, 0, a1, a2.cast(), l1);
                        0
                    }
                }
            }
            7 => {
                let t = &eq::EQ_OPS;
                let hq = h.cast::<fi::fid_eq>();
                match c.pick(5) {
                    0 => slot!(t, read)(hq, a1.cast(), a2, l1, flags) as i64,
                    1 => slot!(t, readerr)(hq, a1.cast(), flags) as i64,
                    2 => slot!(t, write)(hq, flags as u32, a1, l1, flags) as i64,
                    3 => slot!(t, sread)(hq, a1.cast(), a2, l1, 0, flags) as i64,
                    _ => {
                        slot!(t, strerror)(hq, 0, a1, a2.cast(), l1);
                        0
                    }
                }
            }
            8 => {
                let t = &av::AV_OPS;
                let ha = h.cast::<fi::fid_av>();
                match c.pick(5) {
                    0 => slot!(t, insert)(ha, a1, count, a2.cast(), flags, ctx) as i64,
                    1 => slot!(t, remove)(ha, a1.cast(), count, flags) as i64,
                    2 => slot!(t, lookup)(ha, flags, a1, a2.cast()) as i64,
                    3 => {
                        slot!(t, straddr)(ha, a1, a2.cast(), a3.cast());
                        0
                    }
                    _ => slot!(t, av_set)(ha, a1.cast(), a2.cast(), ctx) as i64,
                }
            }
            9 => {
                let t = &avset::AV_SET_OPS;
                let hs = h.cast::<fi::fid_av_set>();
                let o = p.handle(c).cast::<fi::fid_av_set>();
                match c.pick(6) {
                    0 => slot!(t, set_union)(hs, o) as i64,
                    1 => slot!(t, intersect)(hs, o) as i64,
                    2 => slot!(t, diff)(hs, o) as i64,
                    3 => slot!(t, insert)(hs, flags) as i64,
                    4 => slot!(t, remove)(hs, flags) as i64,
                    _ => slot!(t, addr)(hs, a1.cast()) as i64,
                }
            }
            10 => {
                let t = &domain::DOMAIN_OPS;
                let hd = h.cast::<fi::fid_domain>();
                // A poll set's own ops, on any handle of the pool.
                let tp = &poll::POLL_OPS;
                let hp = h.cast::<fi::fid_poll>();
                match c.pick(9) {
                    0 => slot!(t, av_open)(hd, a1.cast(), a2.cast(), ctx) as i64,
                    1 => slot!(t, cq_open)(hd, a1.cast(), a2.cast(), ctx) as i64,
                    2 => slot!(t, endpoint)(hd, a1.cast(), a2.cast(), ctx) as i64,
                    3 => slot!(t, srx_ctx)(hd, a1.cast(), a2.cast(), ctx) as i64,
                    4 => slot!(t, poll_open)(hd, a1.cast(), a2.cast()) as i64,
                    5 => slot!(tp, poll_add)(hp, p.handle(c).cast(), flags) as i64,
                    6 => slot!(tp, poll_del)(hp, p.handle(c).cast(), flags) as i64,
                    7 => slot!(tp, poll)(hp, a1.cast(), count as i32 - 5) as i64,
                    _ => slot!(t, endpoint2)(hd, a1.cast(), a2.cast(), flags, ctx) as i64,
                }
            }
            11 => {
                let t = &domain::MR_OPS;
                let mut out = null_mut();
                match c.pick(3) {
                    0 => slot!(t, reg)(hf, a1, l1, flags, 0, 0, flags, &mut out, ctx) as i64,
                    1 => slot!(t, regv)(hf, iov, count, flags, 0, 0, flags, &mut out, ctx) as i64,
                    _ => slot!(t, regattr)(hf, a1.cast(), flags, &mut out) as i64,
                }
            }
            12 => {
                // The fabric's ops with hostile arguments (its handle from the pool).
                let hb = h.cast::<fi::fid_fabric>();
                let t = &*std::ptr::from_ref(&fabric::FABRIC_OPS);
                match c.pick(4) {
                    0 => slot!(t, eq_open)(hb, a1.cast(), a2.cast(), ctx) as i64,
                    1 => slot!(t, trywait)(hb, a1.cast(), count as i32) as i64,
                    2 => slot!(&wait::WAIT_OPS, wait)(h.cast(), 0) as i64,
                    _ => slot!(t, wait_open)(hb, a1.cast(), a2.cast()) as i64,
                }
            }
            13 => {
                // A misbehaving peer through the SRX owner ops: foreign and stale entries,
                // double frees, queueing what it never got.
                let t = &*crate::capi::fid::ops(&peer::srx::SRX_OWNER_OPS);
                let hs = h.cast::<fi::fid_peer_srx>();
                let mut e: *mut fi::fi_peer_rx_entry = null_mut();
                let r = match c.pick(5) {
                    0 => slot!(t, get_msg)(hs, flags, l1, &mut e) as i64,
                    1 => slot!(t, get_tag)(hs, flags, flags, &mut e) as i64,
                    2 => slot!(t, queue_msg)(p.entry(c).cast()) as i64,
                    3 => slot!(t, queue_tag)(p.entry(c).cast()) as i64,
                    _ => {
                        slot!(t, free_entry)(p.entry(c).cast());
                        0
                    }
                };
                if !e.is_null() {
                    // Entries it got stay in play: queued, freed, freed twice, or forgotten.
                    p.entries.push(e.cast());
                }
                r
            }
            14 => {
                let hc = h.cast::<fi::fid_peer_cq>();
                let t = &peer::cq::CQ_OWNER_OPS;
                match c.pick(2) {
                    0 => slot!(t, write)(hc, ctx, flags, l1, a1, flags, flags, flags) as i64,
                    _ => {
                        let e = a1.cast::<fi::fi_cq_err_entry>();
                        if !e.is_null() {
                            (*e).err_data = a2;
                            (*e).err_data_size = if a2.is_null() {
                                l1
                            } else {
                                l1.min(SLAB) | (l1 & !(usize::MAX >> 24))
                            };
                            (*e).err = c.word() as i32;
                        }
                        slot!(t, writeerr)(hc, e) as i64
                    }
                }
            }
            _ => match c.pick(4) {
                0 => {
                    let t = &peer::av::AV_OWNER_OPS;
                    let ha = h.cast::<fi::fid_peer_av>();
                    if c.pick(2) == 0 {
                        slot!(t, query)(ha, a1.cast()) as i64
                    } else {
                        slot!(t, ep_addr)(ha, p.handle(c).cast());
                        0
                    }
                }
                1 => {
                    let t = &peer::av_set::AV_SET_OWNER_OPS;
                    slot!(t, members)(h.cast(), a1.cast(), a2.cast()) as i64
                }
                2 => {
                    // The owner's side meanwhile: receives posted against what peers hold.
                    let b = crate::capi::peer::srx::RxBuf::one(p.buf(|_| 0), l1 % SLAB);
                    let kind = if c.pick(2) == 0 {
                        crate::core::srx::Kind::Msg
                    } else {
                        crate::core::srx::Kind::Tag
                    };
                    let fl = crate::core::flags::Flags::from_bits_retain(flags & fi::FI_MULTI_RECV);
                    match p.owner.recv(
                        kind,
                        crate::core::srx::Filter::ANY,
                        b,
                        ctx as u64 & 0xffff,
                        fl,
                    ) {
                        Ok(_) => 0,
                        Err(e) => -(e.errno() as i64),
                    }
                }
                _ => {
                    p.close_one(c);
                    0
                }
            },
        }
    }
}
