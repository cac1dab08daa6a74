//! The local path of an RDM endpoint (DESIGN.md decisions 4 and 11): a peer provider that
//! carries messages between endpoints of one host (libfabric's shm, imported by the C layer,
//! `capi::ext::local`). Sends to a peer whose name says it is on this host go to it; its
//! arrivals take their receives from the endpoint's own engine (`get`, `queue`, `free`, as
//! a peer SRX's owner ops), so receives posted once match messages from either path; its
//! completions come back through [`LocalOwner`].
//!
//! Locks: the path is called with no lock of the endpoint held, and calls back into it
//! (from its progress) the same way.
//!
//! Waking: a thread blocked in `fi_cq_sread` is not driving the path, so a local message
//! would wait for its next look. Each endpoint with a path has a bell
//! (`rfabric_sys::bell`) in its CQ's wait set, named after its endpoint name, and a sender
//! rings the bell of the peer it sent to when that peer says it sleeps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rfabric_sys::bell::{Bell, BellRemote};
use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;
use rfabric_sys::lock::RwLock;

use super::{
    lock, release_tx, tx_error, Enabled, Exposed, Inner, RndvSend, Shared, Src, TxMeta, NONE,
};
use crate::verbs::cq::{CompletionQueue, QpnHash, ReadSink};
use crate::verbs::wr_id::{self, Kind};

/// A send buffer's `TxMeta::conn` while the local path carries it.
pub(super) const LOCAL_CONN: u32 = u32::MAX - 1;
use crate::core::cq::CqEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::rdm::RdmName;
use crate::core::srx::Kind as RxKind;

/// An engine entry's owner token for messages the local path holds (not a bounce buffer).
pub(super) const LOCAL_HOLDER: u64 = u64::MAX - 1;

/// One send, as the local path gets it.
#[derive(Debug)]
pub struct LocalSend<'a> {
    pub tagged: bool,
    pub tag: u64,
    pub data: Option<u64>,
    /// Address and length of each range (at most 4): the application's memory or a send
    /// buffer, valid until the send completes.
    pub iov: &'a [(u64, usize)],
    /// `None`: copied during the call (`FI_INJECT`), no completion. Otherwise what its
    /// completion carries to [`LocalOwner::send_done`].
    pub context: Option<u64>,
    pub delivery_complete: bool,
}

/// An engine entry as the local path sees it (`fi_peer_rx_entry`).
#[derive(Clone, Copy, Debug)]
pub struct LocalEntry {
    pub tagged: bool,
    pub addr: u64,
    pub tag: u64,
    pub size: usize,
    /// `FI_COMPLETION` when the receive reports success, `FI_MULTI_RECV` on the slice that
    /// releases a multi-receive buffer.
    pub flags: Flags,
    pub context: u64,
    /// Where the message goes (address, bytes), for a matched entry.
    pub buf: Option<(u64, usize)>,
    /// The next ranges of a receive that scatters (`RecvBuf::scatter`; empty ones unused).
    pub more: [(u64, usize); super::RX_IOV_MAX - 1],
    /// Bytes of scratch to append past `buf` for what does not fit (discarded; the owner
    /// reports the truncation): the path must never be handed less room than the message.
    pub scratch: usize,
}

/// What the owner keeps of a matched local receive until its completion comes back.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LocalRx {
    context: u64,
    /// The sender's address in the endpoint's AV.
    from: u64,
    /// Bytes of the receive's buffer (past them, the message was truncated).
    cap: usize,
    quiet: bool,
    live: bool,
}

/// A provider carrying an RDM endpoint's traffic with peers on the same host.
pub trait LocalPath: Send + Sync {
    /// Makes the endpoint named `name` (on this host) reachable: its handle for `send`,
    /// and the address its arrivals carry (translated back by the endpoint).
    fn insert(&self, name: &RdmName) -> Result<u64>;
    /// The largest send it copies during the call (what it carries).
    fn inject_size(&self) -> usize;
    fn send(&self, to: u64, m: &LocalSend<'_>) -> Result<()>;
    /// `send` of one range copied during the call with no completion (the `fi_inject`
    /// family), tagged when `tag` is given.
    fn inject(
        &self,
        to: u64,
        tag: Option<u64>,
        data: Option<u64>,
        addr: u64,
        len: usize,
    ) -> Result<()> {
        let m = LocalSend {
            tagged: tag.is_some(),
            tag: tag.unwrap_or(0),
            data,
            iov: &[(addr, len)],
            context: None,
            delivery_complete: false,
        };
        self.send(to, &m)
    }
    /// Starts (or discards) the unexpected message it holds in engine slot `id`: `e`
    /// names the receive's buffer.
    fn hand_back(&self, id: u32, e: &LocalEntry, discard: bool) -> Result<()>;
    /// Drives it; its completions come back through the owner, given `driven` when the
    /// endpoint's own progress calls (a CQ read may then take them at once).
    fn progress(&self, driven: Option<&mut Driven<'_, '_>>);
    /// Closes it (the endpoint is closing): later calls fail.
    fn close(&self);
}

/// Routes between the endpoint's AV addresses and the path's handles, for the names on
/// this host; rebuilt when the AV changes (under the link's `routes` lock).
#[derive(Debug, Default)]
struct Routes {
    /// Handles by name: a name inserted once keeps its handle.
    by_name: HashMap<[u8; RdmName::LEN], u64>,
    /// The bells of the peers, by handle.
    bells: HashMap<u64, Arc<PeerBell>, QpnHash>,
}

/// A local peer as a send reaches it (looked up per send in a `RouteTable`).
#[derive(Debug)]
struct Route {
    handle: u64,
    bell: Arc<PeerBell>,
}

/// A map keyed by an address or handle: by index below `DENSE_KEYS` (the AV's small
/// `FI_AV_TABLE` addresses, shm's handles), hashed above (`FI_AV_MAP`'s addresses carry a
/// generation in their high bits).
#[derive(Debug)]
pub(super) struct ByAddr<T> {
    dense: Vec<Option<T>>,
    sparse: HashMap<u64, T, QpnHash>,
}

impl<T> Default for ByAddr<T> {
    fn default() -> Self {
        ByAddr {
            dense: Vec::new(),
            sparse: HashMap::default(),
        }
    }
}

/// Keys below this are found by index.
const DENSE_KEYS: u64 = 1 << 16;

impl<T> ByAddr<T> {
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<&T> {
        match self.dense.get(key as usize) {
            Some(r) => r.as_ref(),
            None if self.sparse.is_empty() => None,
            None => self.sparse.get(&key),
        }
    }

    /// The entry of `key`, made with `f` if there is none.
    fn get_or_insert_with(&mut self, key: u64, f: impl FnOnce() -> T) -> &mut T {
        if key < DENSE_KEYS {
            self.dense_slot(key).get_or_insert_with(f)
        } else {
            self.sparse.entry(key).or_insert_with(f)
        }
    }

    fn insert(&mut self, key: u64, v: T) {
        if key < DENSE_KEYS {
            *self.dense_slot(key) = Some(v);
        } else {
            self.sparse.insert(key, v);
        }
    }

    /// The by-index slot of `key` (below `DENSE_KEYS`), the table grown to it.
    fn dense_slot(&mut self, key: u64) -> &mut Option<T> {
        let i = key as usize;
        if self.dense.len() <= i {
            self.dense.resize_with(i + 1, || None);
        }
        &mut self.dense[i]
    }
}

/// The routes a send looks up, by AV address.
type RouteTable = ByAddr<Route>;

/// The endpoint's AV address of each path handle (an arrival's source), looked up under
/// the endpoint's lock.
pub(super) type LocalFrom = ByAddr<u64>;

/// The bell of an endpoint on this host (`bell_name`), opened once its owner made it.
#[derive(Debug)]
struct PeerBell {
    name: String,
    open: OnceLock<BellRemote>,
    /// When to try opening it again (`rfabric_sys::clock::cycles`), read per send without
    /// a lock; the wait after that (from 1 ms, doubling up to 1 s: a peer whose CQ cannot
    /// wait on a bell never makes one, and a failed open is a system call) is `backoff`,
    /// whose lock also keeps two threads from opening at once.
    retry_at: AtomicU64,
    backoff: Mutex<u64>,
}

impl PeerBell {
    fn new(name: String) -> Self {
        PeerBell {
            name,
            open: OnceLock::new(),
            retry_at: AtomicU64::new(0),
            backoff: Mutex::new(20 * idle_interval()),
        }
    }

    #[inline]
    fn get(&self) -> Option<&BellRemote> {
        if let Some(b) = self.open.get() {
            return Some(b);
        }
        if rfabric_sys::clock::cycles() < self.retry_at.load(Ordering::Relaxed) {
            return None;
        }
        self.try_open()
    }

    #[cold]
    fn try_open(&self) -> Option<&BellRemote> {
        let mut backoff = lock(&self.backoff);
        if let Some(b) = self.open.get() {
            return Some(b);
        }
        let now = rfabric_sys::clock::cycles();
        if now < self.retry_at.load(Ordering::Relaxed) {
            return None;
        }
        match BellRemote::open(&self.name) {
            Ok(b) => Some(self.open.get_or_init(|| b)),
            // Its endpoint has no bell yet (or none: shm off there, or a CQ without a
            // descriptor): look again later, less often each time.
            Err(_) => {
                self.retry_at.store(now + *backoff, Ordering::Relaxed);
                *backoff = (2 * *backoff).min(20_000 * idle_interval());
                None
            }
        }
    }
}

/// The name of the bell of the endpoint named `name`: unique on its host.
pub(super) fn bell_name(name: &RdmName) -> String {
    format!("{:016x}-{}-{:08x}", name.host, name.port, name.nonce)
}

/// After a send to a peer (or one refused while shm's handshake waits for that peer's
/// progress): wake the peer if it sleeps.
#[inline]
fn ring<T>(bell: Option<&BellRemote>, r: &Result<T>) {
    if let Some(b) = bell {
        if r.is_ok() || r.as_ref().is_err_and(|e| e.is_again()) {
            b.ring();
        }
    }
}

/// How often an endpoint with a local path that has carried nothing looks at it.
const LOCAL_IDLE_US: f64 = 50.0;

/// `LOCAL_IDLE_US` in cycles of `rfabric_sys::clock::cycles` (measured once per process).
pub(super) fn idle_interval() -> u64 {
    static C: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *C.get_or_init(|| (rfabric_sys::clock::cycles_per_us() * LOCAL_IDLE_US) as u64)
}

/// An endpoint's local path and its routes.
pub(super) struct LocalLink {
    pub(super) path: Arc<dyn LocalPath>,
    /// Rung by local senders while a thread of this endpoint sleeps on its CQ (whose wait
    /// set holds it); none when the CQ cannot wait on it (its CQ then keeps polling).
    pub(super) bell: Option<Bell>,
    /// Sends the path carries whose completion is still to come: until it has, a sleeper
    /// must keep looking (nothing rings for a completion).
    pending: AtomicU64,
    routes: Mutex<Routes>,
    /// Where each AV address on this host goes, read per send (rebuilt by `sync`).
    table: RwLock<RouteTable>,
    /// The AV's change count the routes follow (`u64::MAX`: never built).
    seen: AtomicU64,
    /// Some name in the AV is on this host (read per send without the routes' lock).
    any: AtomicBool,
    /// While it has carried nothing and has no route, the cycle count from which the next
    /// idle look at it is due (`LOCAL_IDLE_US`): remote traffic does not pay for it.
    idle_next: AtomicU64,
    /// Messages it carried: sent, and arrived (tests and logs).
    pub(super) sent: AtomicU64,
    pub(super) arrived: AtomicU64,
    /// The largest message it carries (the endpoint's `max_msg_size`).
    pub(super) max: usize,
    /// What it copies during a send (`LocalPath::inject_size`, asked once).
    inject: usize,
    /// Names of this host that reached this endpoint by its listener's address alone
    /// (`RdmName::listener`): they send over verbs, so they are answered over verbs too,
    /// whatever the AV says.
    verbs_only: Mutex<std::collections::HashSet<[u8; RdmName::LEN]>>,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLink").finish_non_exhaustive()
    }
}

impl LocalLink {
    pub(super) fn new(path: Arc<dyn LocalPath>, max: usize, bell: Option<Bell>) -> Self {
        LocalLink {
            inject: path.inject_size(),
            path,
            bell,
            pending: AtomicU64::new(0),
            max,
            routes: Mutex::new(Routes::default()),
            table: RwLock::new(RouteTable::default()),
            seen: AtomicU64::new(u64::MAX),
            any: AtomicBool::new(false),
            idle_next: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            arrived: AtomicU64::new(0),
            verbs_only: Mutex::default(),
        }
    }

    /// Brings the routes up to the AV: a name of this host inserted since is made known
    /// to the path (locality is the name's: decided when it enters the AV).
    #[inline]
    pub(super) fn sync(&self, en: &Enabled) {
        if self.seen.load(Ordering::Acquire) != en.av.changes() {
            self.rebuild(en);
        }
    }

    #[cold]
    fn rebuild(&self, en: &Enabled) {
        let mut r = lock(&self.routes);
        let now = en.av.changes();
        if self.seen.load(Ordering::Acquire) == now {
            return;
        }
        let mut local = en.av.rdm_on_host(en.name.host);
        {
            let pinned = lock(&self.verbs_only);
            local.retain(|(_, n)| !pinned.contains(&n.to_bytes()));
        }
        let mut to = RouteTable::default();
        let mut any = false;
        let mut from = LocalFrom::default();
        for (addr, name) in local {
            let bytes = name.to_bytes();
            let h = match r.by_name.get(&bytes) {
                Some(&h) => h,
                None => match self.path.insert(&name) {
                    Ok(h) => {
                        r.by_name.insert(bytes, h);
                        h
                    }
                    Err(e) => {
                        crate::fi_warn!(
                            "rdm",
                            "{} goes over verbs: the local path refused it: {e}",
                            name.to_str()
                        );
                        continue;
                    }
                },
            };
            let bell = r
                .bells
                .entry(h)
                .or_insert_with(|| Arc::new(PeerBell::new(bell_name(&name))))
                .clone();
            to.insert(addr, Route { handle: h, bell });
            any = true;
            // The first address of a name answers for its arrivals.
            from.get_or_insert_with(h, || addr);
        }
        self.any.store(any, Ordering::Relaxed);
        // Arrivals translate under the endpoint's lock, which they take anyway; released
        // before the table's (a sender holds the table while it takes the endpoint's).
        en.inner.lock().local_from = from;
        *self.table.write() = to;
        self.seen.store(now, Ordering::Release);
    }

    /// `name` reached this endpoint by its listener's address alone: answered over verbs
    /// from now on (the routes are built again at the next send).
    pub(super) fn pin_to_verbs(&self, name: &RdmName) {
        if lock(&self.verbs_only).insert(name.to_bytes()) {
            crate::fi_info!(
                "rdm",
                "{} knows this endpoint by its address alone: answered over verbs",
                name.to_str()
            );
            self.seen.store(u64::MAX, Ordering::Release);
        }
    }

    /// `f(handle, bell)` when `dest` is on this host (its bell once known), else `None`.
    /// The routes stay read-locked during `f`, which must not change the AV's routes.
    #[inline]
    pub(super) fn with_route<R>(
        &self,
        en: &Enabled,
        dest: u64,
        f: impl FnOnce(u64, Option<&BellRemote>) -> R,
    ) -> Option<R> {
        self.sync(en);
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let t = self.table.read();
        let r = t.get(dest)?;
        Some(f(r.handle, r.bell.get()))
    }

    /// A thread of the endpoint sleeps on its CQ (`on`) or woke (see
    /// `PeerProgress::sleeping`): true when its bell will wake it for all it waits for.
    pub(super) fn sleeping(&self, on: bool) -> bool {
        let Some(b) = &self.bell else { return false };
        if on {
            b.sleep_begin();
            // What came before the senders could see us asleep is taken now (the idle
            // pacing of `due` must not skip this look).
            self.path.progress(None);
            self.pending.load(Ordering::SeqCst) == 0
        } else {
            b.sleep_end();
            false
        }
    }

    /// Whether this progress call drives the path: always once it has a route or has
    /// carried a message; until then (a job whose peers are all remote) one call in
    /// `LOCAL_IDLE_US`, enough for an unknown local sender's first message to be seen.
    #[inline]
    pub(super) fn due(&self, en: &Enabled) -> bool {
        self.sync(en);
        if self.any.load(Ordering::Relaxed)
            || self.arrived.load(Ordering::Relaxed) != 0
            || self.sent.load(Ordering::Relaxed) != 0
        {
            return true;
        }
        let now = rfabric_sys::clock::cycles();
        if now < self.idle_next.load(Ordering::Relaxed) {
            return false;
        }
        self.idle_next
            .store(now + idle_interval(), Ordering::Relaxed);
        true
    }
}

/// The endpoint's progress driving its local path: the owner's callbacks from it reach
/// the endpoint without upgrading a weak reference, and give what they complete to the
/// CQ read behind the call (`sink`), if any.
pub struct Driven<'a, 'b> {
    pub(super) sh: &'a Shared,
    pub(super) en: &'a Enabled,
    pub(super) sink: Option<&'a mut ReadSink<'b>>,
}

impl std::fmt::Debug for Driven<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Driven")
    }
}

/// The endpoint as its local path calls it back (a weak reference: the path never keeps
/// the endpoint alive).
#[derive(Clone, Debug)]
pub struct LocalOwner {
    pub(super) sh: Weak<Shared>,
    /// The endpoint's receive and transmit CQs (made after `enable`), whose room each
    /// progress call asks without reaching the endpoint. The CQs hold no endpoint.
    pub(super) cqs: Option<(Arc<CompletionQueue>, Arc<CompletionQueue>)>,
}

impl LocalOwner {
    fn with<R>(&self, f: impl FnOnce(&Enabled, &LocalLink) -> Result<R>) -> Result<R> {
        let sh = self
            .sh
            .upgrade()
            .ok_or_else(|| Error::new(errno::EOPBADSTATE, "the RDM endpoint is closed"))?;
        let en = sh.on.get().ok_or_else(super::not_enabled)?;
        let l = en
            .local
            .get()
            .ok_or_else(|| Error::new(errno::EOPBADSTATE, "no local path is attached"))?;
        f(en, l)
    }

    /// `f(endpoint, sink)`: from `driven` when it is this owner's endpoint driving, else
    /// reached through the weak reference (with no sink).
    #[inline(always)]
    fn with_driven<R>(
        &self,
        driven: Option<&mut Driven<'_, '_>>,
        f: impl FnOnce(&Enabled, Option<&mut ReadSink<'_>>) -> Result<R>,
    ) -> Result<R> {
        match driven {
            Some(d) if std::ptr::eq(self.sh.as_ptr(), d.sh) => f(d.en, d.sink.as_deref_mut()),
            _ => self.with(|en, _| f(en, None)),
        }
    }

    /// An arrival from the path (`get_msg`/`get_tag`, `from` its own address):
    /// `fill(matched, slot, entry)` with the engine slot it takes and, when a posted
    /// receive took it (`matched`), the receive's buffer in `entry`. `fill` runs under the
    /// endpoint's lock: it must not call the endpoint.
    pub fn get<T>(
        &self,
        tagged: bool,
        from: u64,
        tag: u64,
        size: usize,
        fill: impl FnOnce(bool, u32, &LocalEntry) -> Result<T>,
    ) -> Result<T> {
        self.with(|en, l| {
            let kind = if tagged { RxKind::Tag } else { RxKind::Msg };
            let mut g = en.inner.lock();
            // Counted only here, under the lock: a load and a store, not an atomic add.
            l.arrived
                .store(l.arrived.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            let addr = g.local_from.get(from).copied().unwrap_or(FI_ADDR_NOTAVAIL);
            // The receive at the head of the posted list takes it (the common case), else
            // the general arrival.
            let (matched, id) = match g.engine.arrive_at_head(kind, addr, tag, size, LOCAL_HOLDER) {
                Some(id) => (true, id),
                None => arrive_slow(&mut g, kind, addr, tag, size)?,
            };
            fill(matched, id, &entry_at(en, &mut g, id))
        })
    }

    /// The path queues an unexpected arrival it filled (`queue_*`): `size` if it knows it,
    /// and its remote CQ data (what `FI_PEEK` reports of it).
    pub fn queue(&self, id: u32, size: usize, data: Option<u64>) -> Result<()> {
        self.with(|en, _| {
            let mut g = en.inner.lock();
            let e = g.engine.entry_mut(id);
            if e.owner != LOCAL_HOLDER {
                return Err(Error::new(errno::EINVAL, "not an entry of the local path"));
            }
            if size != 0 && e.state == crate::core::srx::State::Arriving {
                e.size = size;
            }
            // Every queued entry sets or clears its slot's data: none outlives its message.
            match data {
                Some(d) => g.local_data.insert(id, d),
                None => g.local_data.remove(&id),
            };
            g.engine.queue(id)
        })
    }

    /// The path is done with entry `id` (`free_entry`). A matched receive's slot stays
    /// until its completion is moved (`recv_done`: it names the slot); any other goes now.
    pub fn free(&self, id: u32) -> Result<()> {
        self.with(|en, _| {
            let mut g = en.inner.lock();
            if g.local_rx.get(id as usize).is_some_and(|m| m.live) {
                return Ok(());
            }
            if g.engine.entry(id).owner != LOCAL_HOLDER {
                return Err(Error::new(errno::EINVAL, "not an entry of the local path"));
            }
            g.engine.free(id)
        })
    }

    /// The completion the path made of the receive in slot `id` (its context), or its
    /// error (`err`): the receive's own completion goes to the endpoint's CQ (truncated
    /// past the receive's buffer: `FI_ETRUNC` with `olen`), from the source the arrival
    /// named, and the slot is freed.
    ///
    /// `driven`: the endpoint's progress call behind it, if any.
    #[inline(always)]
    pub fn recv_done(
        &self,
        id: u32,
        c: CqEntry,
        err: Option<i32>,
        driven: Option<&mut Driven<'_, '_>>,
    ) -> Result<()> {
        self.with_driven(
            driven,
            #[inline(always)]
            |en, sink| {
                let m = {
                    let mut g = en.inner.lock();
                    let Some(m) = g.local_rx.get_mut(id as usize).filter(|m| m.live) else {
                        return Err(Error::new(
                            errno::EINVAL,
                            format!("a local completion names slot {id}, not a receive in flight"),
                        ));
                    };
                    m.live = false;
                    let m = *m;
                    if g.engine.entry(id).owner == LOCAL_HOLDER {
                        let _ = g.engine.free(id);
                    }
                    m
                };
                let flags = c.flags & !Flags::COMPLETION.bits();
                let failed = err.or((c.len > m.cap).then_some(errno::ETRUNC));
                en.cntrs.recv_done(failed.is_none());
                if let Some(e) = failed {
                    let n = c.len.min(m.cap);
                    return en.rx_cq.writeerr(crate::core::cq::CqErrEntry {
                        op_context: m.context,
                        flags,
                        len: n,
                        buf: c.buf,
                        data: c.data,
                        tag: c.tag,
                        olen: c.len - n,
                        err: e,
                        ..Default::default()
                    });
                }
                if m.quiet {
                    return Ok(());
                }
                en.rx_cq.write_via(
                    sink,
                    CqEntry {
                        op_context: m.context,
                        flags,
                        ..c
                    },
                    m.from,
                )
            },
        )
    }

    /// The completion of a send carried with `context` (`LocalSend::context`): its send
    /// buffer is free, and the application's completion, if it wants one, is written.
    pub fn send_done(
        &self,
        context: u64,
        err: Option<i32>,
        driven: Option<&mut Driven<'_, '_>>,
    ) -> Result<()> {
        self.with_driven(
            driven,
            #[inline(always)]
            |en, sink| {
                if wr_id::owner_key(context) != Some(en.key) {
                    return Err(Error::new(errno::EINVAL, "not a send of this endpoint"));
                }
                let slot = wr_id::index(context);
                let mut g = en.inner.lock();
                if g.tx.get(slot as usize).is_none_or(|m| m.conn != LOCAL_CONN) {
                    return Err(Error::new(errno::EINVAL, "not a local send in flight"));
                }
                let m = g.tx[slot as usize];
                g.tx[slot as usize].conn = NONE;
                let held = release_tx(&mut g, slot);
                drop(g);
                drop(held);
                if let Some(l) = en.local.get() {
                    l.pending.fetch_sub(1, Ordering::SeqCst);
                }
                en.cntrs.done(m.flags, err.is_none());
                match err {
                    None if m.quiet => Ok(()),
                    None => en.tx_cq.write_via(
                        sink,
                        CqEntry {
                            op_context: m.context,
                            flags: m.flags.bits(),
                            ..Default::default()
                        },
                        FI_ADDR_NOTAVAIL,
                    ),
                    Some(e) => match tx_error(&m, e) {
                        e if super::unreported(&e) => Ok(()),
                        e => en.tx_cq.writeerr(e),
                    },
                }
            },
        )
    }

    /// Completions the CQs can take now (the path moves no more).
    #[inline]
    pub fn room(&self) -> usize {
        #[inline(always)]
        fn room(rx: &Arc<CompletionQueue>, tx: &Arc<CompletionQueue>) -> usize {
            if Arc::ptr_eq(rx, tx) {
                rx.room()
            } else {
                rx.room().min(tx.room())
            }
        }
        match &self.cqs {
            Some((rx, tx)) => room(rx, tx),
            None => self
                .with(|en, _| Ok(room(&en.rx_cq, &en.tx_cq)))
                .unwrap_or(0),
        }
    }
}

/// A local arrival the posted list's head does not take: matched further on, or
/// unexpected (the engine grown when full); (matched, slot).
#[cold]
#[inline(never)]
fn arrive_slow(
    g: &mut Inner,
    kind: RxKind,
    addr: u64,
    tag: u64,
    size: usize,
) -> Result<(bool, u32)> {
    let a = match g.engine.arrive(kind, addr, tag, size, LOCAL_HOLDER) {
        Err(e) if e.errno() == errno::EAGAIN => {
            let n = g.engine.capacity();
            g.engine.grow(n)?;
            g.engine.arrive(kind, addr, tag, size, LOCAL_HOLDER)?
        }
        r => r?,
    };
    Ok(match a {
        crate::core::srx::Arrival::Matched(id) => (true, id),
        crate::core::srx::Arrival::Unexpected(id) => (false, id),
    })
}

/// Slot `id` as the path sees it. For a claimed one (a receive took the message): the
/// receive's buffer from where the message goes (a multi-receive slice's offset applied),
/// and scratch for what may not fit (an untagged message's excess; for a tagged one, whose
/// size 1.17's `get_tag` does not give, up to the largest message); the owner remembers
/// the receive until its completion comes back. The path is always asked for a completion.
#[inline(never)]
pub(super) fn entry_of(en: &Enabled, g: &mut Inner, id: u32) -> LocalEntry {
    entry_at(en, g, id)
}

/// [`entry_of`], inlined into an arrival's `get`: its fill then takes the fields where
/// they are computed, with no `LocalEntry` written out and read back.
#[inline(always)]
fn entry_at(en: &Enabled, g: &mut Inner, id: u32) -> LocalEntry {
    let Inner {
        engine, local_rx, ..
    } = g;
    let e = engine.entry(id);
    let quiet = en.rx_selective && !e.flags.contains(Flags::COMPLETION);
    let tagged = e.kind.tagged();
    let max = en.local.get().map_or(0, |l| l.max);
    let mut more = [(0, 0); super::RX_IOV_MAX - 1];
    let (buf, scratch) = match e.buf.as_ref() {
        Some(b) => {
            let cap = b.len().saturating_sub(e.offset);
            let (n, scratch) = if tagged {
                (cap, max.saturating_sub(cap))
            } else {
                (cap.min(e.size), e.size.saturating_sub(cap))
            };
            if local_rx.len() <= id as usize {
                local_rx.resize(id as usize + 1, LocalRx::default());
            }
            local_rx[id as usize] = LocalRx {
                context: e.context,
                from: e.addr,
                cap: n,
                quiet,
                live: true,
            };
            let r = b.ranges(e.offset, n);
            more.copy_from_slice(&r[1..]);
            (Some(r[0]), scratch)
        }
        None => (None, 0),
    };
    LocalEntry {
        tagged,
        addr: e.addr,
        tag: e.tag,
        size: e.size,
        flags: (e.flags & Flags::MULTI_RECV) | Flags::COMPLETION,
        context: u64::from(id),
        buf,
        more,
        scratch,
    }
}

/// A send to the local peer `to` in one step (`RdmEndpoint::post_now`): an application's
/// one range up to the path's inject size, copied during the call, with `FI_INJECT` and
/// `FI_COMPLETION` at most in `flags` (no completion for an `inject` call). `None` when it
/// is not one: the general way sends it (and says what is wrong).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn inject_now(
    en: &Enabled,
    l: &LocalLink,
    to: u64,
    bell: Option<&BellRemote>,
    src: &Src<'_>,
    len: usize,
    op: crate::core::rdm::Op,
    tag: u64,
    data: Option<u64>,
    context: u64,
    flags: Flags,
    inject_call: bool,
) -> Option<Result<()>> {
    // Past the endpoint's own inject size an `FI_INJECT` is refused the general way.
    if len > l.inject || len > en.slot - super::Header::LEN {
        return None;
    }
    let addr = match src {
        Src::Slices([b]) => b.as_ptr() as u64,
        Src::Foreign(f) => f.addr(),
        Src::Region(mr, off, n) => mr.sys().sge(*off, *n)?.addr,
        _ => return None,
    };
    // As the general way: quiet for an inject call (marked so its failure goes unreported),
    // or when selective completion leaves it out.
    let inject = if inject_call {
        Flags::INJECT
    } else {
        Flags::empty()
    };
    let quiet = inject_call || (en.tx_selective && !flags.contains(Flags::COMPLETION));
    // Only its flags are used (and computed): the send's own meta is not kept.
    let done = super::send_meta(op, tag, data, context, inject, quiet, false).flags;
    let iov = [(addr, len)];
    Some(send_copied(
        en, l, to, bell, &iov, tag, data, context, done, quiet,
    ))
}

/// An inject call's send (`fi_inject`, `fi_tinject` and their `data` forms) of `buf` to
/// `dest` when it is a peer on this host, in one step: `None` when it is not one (or the
/// path cannot copy it during the call), and the general way sends it.
#[inline(always)]
pub(super) fn inject_call(
    en: &Enabled,
    l: &LocalLink,
    buf: &[u8],
    dest: u64,
    tag: Option<u64>,
    data: Option<u64>,
) -> Option<Result<()>> {
    if buf.len() > l.inject || buf.len() > en.slot - super::Header::LEN {
        return None;
    }
    l.with_route(en, dest, |to, bell| {
        let r = l.path.inject(to, tag, data, buf.as_ptr() as u64, buf.len());
        ring(bell, &r);
        r?;
        l.sent.fetch_add(1, Ordering::Relaxed);
        en.cntrs.send_done(true);
        Ok(())
    })
}

/// A send the path copies during the call (`iov`): nothing of it comes back, so its count
/// and its completion (`done` its flags, none when `quiet`) are written here.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn send_copied(
    en: &Enabled,
    l: &LocalLink,
    to: u64,
    bell: Option<&BellRemote>,
    iov: &[(u64, usize)],
    tag: u64,
    data: Option<u64>,
    context: u64,
    done: Flags,
    quiet: bool,
) -> Result<()> {
    let r = l.path.send(
        to,
        &LocalSend {
            tagged: done.contains(Flags::TAGGED),
            tag,
            data,
            iov,
            context: None,
            delivery_complete: false,
        },
    );
    ring(bell, &r);
    r?;
    l.sent.fetch_add(1, Ordering::Relaxed);
    en.cntrs.done(done, true);
    if quiet {
        return Ok(());
    }
    en.tx_cq.write(
        CqEntry {
            op_context: context,
            flags: done.bits(),
            ..Default::default()
        },
        FI_ADDR_NOTAVAIL,
    )
}

/// Sends `src` (`len` bytes) to the local peer `to`. Up to the path's inject size it is
/// copied during the call (the completion, if wanted, is written here); larger, from a send
/// buffer (copied) or from the application's memory (a region, held until the path's
/// completion; a C buffer). False when the path cannot carry it: a borrowed slice past a
/// send buffer, or past the largest message; verbs carries those.
#[allow(clippy::too_many_arguments)]
pub(super) fn post_local(
    en: &Enabled,
    l: &LocalLink,
    to: u64,
    bell: Option<&BellRemote>,
    src: &Src<'_>,
    len: usize,
    user: TxMeta,
    data: Option<u64>,
    flags: Flags,
) -> Result<bool> {
    let tagged = user.flags.contains(Flags::TAGGED);
    let dc = flags.contains(Flags::DELIVERY_COMPLETE);
    if len > l.max {
        return Ok(false);
    }
    let mut iov = [(0u64, 0usize); 4];
    let n = match src {
        Src::Slices(v) if v.len() <= iov.len() => {
            for (d, b) in iov.iter_mut().zip(v.iter()) {
                *d = (b.as_ptr() as u64, b.len());
            }
            v.len()
        }
        Src::Slices(_) => 0,
        Src::Region(mr, off, n) => {
            let sge = mr
                .sys()
                .sge(*off, *n)
                .ok_or_else(|| mr.range_error(*off, *n))?;
            iov[0] = (sge.addr, len);
            1
        }
        Src::Foreign(f) => {
            iov[0] = (f.addr(), len);
            1
        }
        Src::Iov(v) if v.len() <= iov.len() => {
            for (d, f) in iov.iter_mut().zip(v.iter()) {
                *d = (f.addr(), f.len());
            }
            v.len()
        }
        Src::Iov(_) => 0,
    };
    if len <= l.inject && !dc && n > 0 {
        let (ctx, done, quiet) = (user.context, user.flags, user.quiet);
        send_copied(en, l, to, bell, &iov[..n], user.tag, data, ctx, done, quiet)?;
        return Ok(true);
    }
    let eager = en.slot - super::Header::LEN;
    // A gathered C send goes from the application's ranges (as many as the path takes)
    // past a send buffer's worth; below, it is copied as borrowed slices are.
    let copy = matches!(src, Src::Slices(_))
        || (matches!(src, Src::Region(..) | Src::Iov(_)) && len <= eager)
        || (matches!(src, Src::Iov(_)) && n == 0);
    if copy && len > eager {
        return Ok(false);
    }
    let mut g = en.inner.lock();
    let Some(slot) = g.tx_free.pop() else {
        return Err(Error::new(
            errno::EAGAIN,
            "every send buffer is in flight: read the CQ to complete some",
        ));
    };
    let (at, hold) = if copy {
        let off = slot as usize * en.slot;
        if let Err(e) = src.copy_to(&en.tx_pool, off) {
            g.tx_free.push(slot);
            return Err(e);
        }
        let addr = en.tx_pool.sys().sge(off, len.max(1)).map_or(0, |s| s.addr);
        iov[0] = (addr, len);
        (&iov[..1], None)
    } else {
        match src {
            Src::Region(mr, ..) => (&iov[..1], Some(mr.sys().clone())),
            Src::Iov(_) => (&iov[..n], None),
            _ => (&iov[..1], None),
        }
    };
    let rndv = match hold {
        Some(mr) => g.sends.insert(RndvSend {
            meta: user,
            _reg: Some(Exposed::App(mr)),
        }),
        None => NONE,
    };
    g.tx[slot as usize] = TxMeta {
        conn: LOCAL_CONN,
        rndv,
        ..user
    };
    drop(g);
    // Counted before the send: its completion may come (and be counted off) at once.
    l.pending.fetch_add(1, Ordering::SeqCst);
    let r = l.path.send(
        to,
        &LocalSend {
            tagged,
            tag: user.tag,
            data,
            iov: at,
            context: Some(wr_id::keyed(slot, en.key, Kind::RdmSend)),
            delivery_complete: dc,
        },
    );
    ring(bell, &r);
    if let Err(e) = r {
        l.pending.fetch_sub(1, Ordering::SeqCst);
        let mut g = en.inner.lock();
        g.tx[slot as usize].conn = NONE;
        let held = release_tx(&mut g, slot);
        drop(g);
        drop(held);
        return Err(e);
    }
    l.sent.fetch_add(1, Ordering::Relaxed);
    Ok(true)
}

/// Hands claimed local entries back to the path (`start_*`), after the endpoint's lock
/// is dropped; one it refuses completes its receive in error.
pub(super) fn start_all(en: &Enabled, starts: &[(u32, LocalEntry)]) {
    let Some(l) = en.local.get() else { return };
    for (id, e) in starts {
        if let Err(err) = l.path.hand_back(*id, e, false) {
            crate::fi_warn!("rdm", "the local path refused a matched message: {err}");
            let _ = en.inner.lock().engine.free(*id);
            en.cntrs.recv_done(false);
            let _ = en.rx_cq.writeerr(crate::core::cq::CqErrEntry {
                op_context: e.context,
                flags: (Flags::RECV | if e.tagged { Flags::TAGGED } else { Flags::MSG }).bits(),
                tag: e.tag,
                err: err.errno(),
                ..Default::default()
            });
        }
    }
}

/// Discards entries the path holds (`discard_*`), after the endpoint's lock is dropped.
pub(super) fn discard_all(en: &Enabled, ids: &[(u32, LocalEntry)]) {
    let Some(l) = en.local.get() else { return };
    for (id, e) in ids {
        discard_one(en, l, *id, e);
    }
}

/// `discard_*` of one entry, then its slot is freed (1.17's shm frees nothing of ours).
fn discard_one(en: &Enabled, l: &LocalLink, id: u32, e: &LocalEntry) {
    if let Err(err) = l.path.hand_back(id, e, true) {
        crate::fi_warn!("rdm", "discarding a local message: {err}");
    }
    let mut g = en.inner.lock();
    let s = g.engine.entry(id);
    if s.owner == LOCAL_HOLDER && s.state == crate::core::srx::State::Claimed {
        let _ = g.engine.free(id);
    }
}

/// The endpoint closes: every unexpected message the path holds goes back to it
/// (discarded), then the path closes.
pub(super) fn close(en: &Enabled) {
    let Some(l) = en.local.get() else { return };
    loop {
        let taken = {
            let mut g = en.inner.lock();
            g.engine.first_unexpected(Some(LOCAL_HOLDER)).map(|id| {
                let _ = g.engine.take_unexpected(id);
                (id, entry_of(en, &mut g, id))
            })
        };
        let Some((id, e)) = taken else { break };
        discard_one(en, l, id, &e);
    }
    l.path.close();
}
