//! The local path of an RDM endpoint (DESIGN.md decisions 4 and 11): a peer provider that
//! carries messages between endpoints of one host (libfabric's shm, imported by the C layer,
//! `capi::ext::local`). Sends to a peer whose name says it is on this host go to it; its
//! arrivals take their receives from the endpoint's own engine (`get`, `queue`, `free`, as
//! a peer SRX's owner ops), so receives posted once match messages from either path; its
//! completions come back through [`LocalOwner`].
//!
//! Locks: the path is called with no lock of the endpoint held, and calls back into it
//! (from its progress) the same way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;

use super::{lock, Enabled, Inner, Shared, Src, TxMeta};
use crate::core::cq::CqEntry;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::rdm::RdmName;
use crate::core::srx::Kind as RxKind;

/// An engine entry's owner token for messages the local path holds (not a bounce buffer).
pub(super) const LOCAL_HOLDER: u64 = u64::MAX - 1;

/// One send, as the local path gets it: copied during the call (`FI_INJECT`), with no
/// completion from the path.
#[derive(Debug)]
pub struct LocalSend<'a> {
    pub tagged: bool,
    pub tag: u64,
    pub data: Option<u64>,
    /// Address and length of each range of the application's memory (at most 4).
    pub iov: &'a [(u64, usize)],
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
}

/// A provider carrying an RDM endpoint's traffic with peers on the same host.
pub trait LocalPath: Send + Sync {
    /// Makes the endpoint named `name` (on this host) reachable: its handle for `send`,
    /// and the address its arrivals carry (translated back by the endpoint).
    fn insert(&self, name: &RdmName) -> Result<u64>;
    /// The largest send it copies during the call (what it carries).
    fn inject_size(&self) -> usize;
    fn send(&self, to: u64, m: &LocalSend<'_>) -> Result<()>;
    /// Starts (or discards) the unexpected message it holds in engine slot `id`: `e`
    /// names the receive's buffer.
    fn hand_back(&self, id: u32, e: &LocalEntry, discard: bool) -> Result<()>;
    /// Drives it; its completions come back through the owner.
    fn progress(&self);
    /// Closes it (the endpoint is closing): later calls fail.
    fn close(&self);
}

/// Routes between the endpoint's AV addresses and the path's handles, for the names on
/// this host; rebuilt when the AV changes.
#[derive(Debug, Default)]
struct Routes {
    to: HashMap<u64, u64>,
    from: HashMap<u64, u64>,
    /// Handles by name: a name inserted once keeps its handle.
    by_name: HashMap<[u8; RdmName::LEN], u64>,
}

/// An endpoint's local path and its routes.
pub(super) struct LocalLink {
    pub(super) path: Arc<dyn LocalPath>,
    routes: Mutex<Routes>,
    /// The AV's change count the routes follow (`u64::MAX`: never built).
    seen: AtomicU64,
    /// Messages it carried: sent, and arrived (tests and logs).
    pub(super) sent: AtomicU64,
    pub(super) arrived: AtomicU64,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLink").finish_non_exhaustive()
    }
}

impl LocalLink {
    pub(super) fn new(path: Arc<dyn LocalPath>) -> Self {
        LocalLink {
            path,
            routes: Mutex::new(Routes::default()),
            seen: AtomicU64::new(u64::MAX),
            sent: AtomicU64::new(0),
            arrived: AtomicU64::new(0),
        }
    }

    /// Brings the routes up to the AV: a name of this host inserted since is made known
    /// to the path (locality is the name's: decided when it enters the AV).
    pub(super) fn sync(&self, en: &Enabled) {
        let now = en.av.changes();
        if self.seen.load(Ordering::Acquire) == now {
            return;
        }
        let mut r = lock(&self.routes);
        let local = en.av.rdm_on_host(en.name.host);
        r.to.clear();
        r.from.clear();
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
            r.to.insert(addr, h);
            r.from.entry(h).or_insert(addr);
        }
        self.seen.store(now, Ordering::Release);
    }

    /// The path's handle of `dest`, when it is on this host.
    #[inline]
    pub(super) fn route(&self, en: &Enabled, dest: u64) -> Option<u64> {
        self.sync(en);
        lock(&self.routes).to.get(&dest).copied()
    }

    /// The endpoint's address of what the path calls `h` (`FI_ADDR_NOTAVAIL` if none).
    fn addr_of(&self, h: u64) -> u64 {
        lock(&self.routes)
            .from
            .get(&h)
            .copied()
            .unwrap_or(FI_ADDR_NOTAVAIL)
    }
}

/// The endpoint as its local path calls it back (a weak reference: the path never keeps
/// the endpoint alive).
#[derive(Clone, Debug)]
pub struct LocalOwner {
    pub(super) sh: Weak<Shared>,
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

    /// An arrival from the path (`get_msg`/`get_tag`, `from` its own address): the engine
    /// slot and, when a posted receive took it, true and the receive's buffer.
    pub fn get(
        &self,
        tagged: bool,
        from: u64,
        tag: u64,
        size: usize,
    ) -> Result<(bool, u32, LocalEntry)> {
        self.with(|en, l| {
            l.arrived.fetch_add(1, Ordering::Relaxed);
            let addr = l.addr_of(from);
            let kind = if tagged { RxKind::Tag } else { RxKind::Msg };
            let mut g = lock(&en.inner);
            let a = match g.engine.arrive(kind, addr, tag, size, LOCAL_HOLDER) {
                Err(e) if e.errno() == errno::EAGAIN => {
                    let n = g.engine.capacity();
                    g.engine.grow(n)?;
                    g.engine.arrive(kind, addr, tag, size, LOCAL_HOLDER)?
                }
                r => r?,
            };
            Ok(match a {
                crate::core::srx::Arrival::Matched(id) => (true, id, entry_of(en, &g, id)),
                crate::core::srx::Arrival::Unexpected(id) => (false, id, entry_of(en, &g, id)),
            })
        })
    }

    /// The path queues an unexpected arrival it filled (`queue_*`); `size` if it knows it.
    pub fn queue(&self, id: u32, size: usize) -> Result<()> {
        self.with(|en, _| {
            let mut g = lock(&en.inner);
            let e = g.engine.entry_mut(id);
            if e.owner != LOCAL_HOLDER {
                return Err(Error::new(errno::EINVAL, "not an entry of the local path"));
            }
            if size != 0 && e.state == crate::core::srx::State::Arriving {
                e.size = size;
            }
            g.engine.queue(id)
        })
    }

    /// The path is done with entry `id` (`free_entry`).
    pub fn free(&self, id: u32) -> Result<()> {
        self.with(|en, _| {
            let mut g = lock(&en.inner);
            if g.engine.entry(id).owner != LOCAL_HOLDER {
                return Err(Error::new(errno::EINVAL, "not an entry of the local path"));
            }
            g.engine.free(id)
        })
    }

    /// The endpoint's address of the path's `h` (a receive completion's source).
    pub fn addr_of(&self, h: u64) -> u64 {
        self.with(|_, l| Ok(l.addr_of(h)))
            .unwrap_or(FI_ADDR_NOTAVAIL)
    }

    /// A receive completion (or error) the path made: to the endpoint's receive CQ.
    pub fn recv_done(
        &self,
        c: std::result::Result<(CqEntry, u64), crate::core::cq::CqErrEntry>,
    ) -> Result<()> {
        self.with(|en, _| match c {
            Ok((e, from)) => en.rx_cq.write(e, from),
            Err(e) => en.rx_cq.writeerr(e),
        })
    }

    /// Completions the CQs can take now (the path moves no more).
    pub fn room(&self) -> usize {
        self.with(|en, _| Ok(en.rx_cq.room().min(en.tx_cq.room())))
            .unwrap_or(0)
    }
}

/// Slot `id` as the path sees it: for a claimed one, the receive's buffer from where the
/// message goes (a multi-receive slice's offset applied; no more than an untagged
/// message's size).
pub(super) fn entry_of(en: &Enabled, g: &Inner, id: u32) -> LocalEntry {
    let e = g.engine.entry(id);
    let quiet = en.rx_selective && !e.flags.contains(Flags::COMPLETION);
    let buf = e.buf.as_ref().map(|b| {
        let cap = b.len().saturating_sub(e.offset);
        let cap = if e.kind == RxKind::Msg && e.size != 0 {
            cap.min(e.size)
        } else {
            cap
        };
        (b.addr() + e.offset as u64, cap)
    });
    LocalEntry {
        tagged: e.kind == RxKind::Tag,
        addr: e.addr,
        tag: e.tag,
        size: e.size,
        flags: (e.flags & Flags::MULTI_RECV)
            | if quiet {
                Flags::empty()
            } else {
                Flags::COMPLETION
            },
        context: e.context,
        buf,
    }
}

/// Sends `src` to the local peer `to` if the path copies it during the call (its inject
/// size; the completion, if wanted, is written here). False otherwise: verbs carries it.
/// 1.17's shm copies larger messages by CMA from the sender's memory, and loops forever
/// when a smaller receive truncates one (`smr_progress_iov` copies the full size); its
/// `FI_DELIVERY_COMPLETE` goes the same way.
pub(super) fn post_local(
    en: &Enabled,
    l: &LocalLink,
    to: u64,
    src: &Src<'_>,
    user: TxMeta,
    data: Option<u64>,
    flags: Flags,
) -> Result<bool> {
    let len = src.len();
    if len > l.path.inject_size() || flags.contains(Flags::DELIVERY_COMPLETE) {
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
        Src::Slices(_) => return Ok(false),
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
    };
    l.path.send(
        to,
        &LocalSend {
            tagged: user.flags.contains(Flags::TAGGED),
            tag: user.tag,
            data,
            iov: &iov[..n],
        },
    )?;
    l.sent.fetch_add(1, Ordering::Relaxed);
    if !user.quiet {
        en.tx_cq.write(
            CqEntry {
                op_context: user.context,
                flags: user.flags.bits(),
                ..Default::default()
            },
            FI_ADDR_NOTAVAIL,
        )?;
    }
    Ok(true)
}

/// Hands claimed local entries back to the path (`start_*`), after the endpoint's lock
/// is dropped; one it refuses completes its receive in error.
pub(super) fn start_all(en: &Enabled, starts: &[(u32, LocalEntry)]) {
    let Some(l) = en.local.get() else { return };
    for (id, e) in starts {
        if let Err(err) = l.path.hand_back(*id, e, false) {
            crate::fi_warn!("rdm", "the local path refused a matched message: {err}");
            let _ = lock(&en.inner).engine.free(*id);
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
    let mut g = lock(&en.inner);
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
            let mut g = lock(&en.inner);
            g.engine.first_unexpected(Some(LOCAL_HOLDER)).map(|id| {
                let _ = g.engine.take_unexpected(id);
                (id, entry_of(en, &g, id))
            })
        };
        let Some((id, e)) = taken else { break };
        discard_one(en, l, id, &e);
    }
    l.path.close();
}
