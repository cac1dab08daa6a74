//! The shared receive engine behind an SRX: receives the application posts, and messages
//! that arrived before any receive matched them ("unexpected"), matched by source and tag
//! in posting order, as fi_msg(3), fi_tagged(3) and the peer SRX of fi_peer(3) describe.
//!
//! Entries live in a slab allocated once and are linked into four intrusive lists (posted
//! and unexpected, untagged and tagged), so matching, queueing and freeing allocate
//! nothing. An entry's index is stable for its life: the C layer keeps a
//! `fi_peer_rx_entry` per slot and hands peers pointers to it.

use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;

/// `FI_ADDR_UNSPEC`: a receive that accepts any source.
pub const ADDR_UNSPEC: u64 = u64::MAX;
const NIL: u32 = u32::MAX;

/// Untagged (`fi_msg`) or tagged (`fi_tagged`) traffic: separate queues, never matched
/// across. A peer provider's transfers (fi_peer(3) `FI_PEER_TRANSFER`) have queues of
/// their own too: they never take the application's receives, nor it theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Msg = 0,
    Tag = 1,
    PeerMsg = 2,
    PeerTag = 3,
}

impl Kind {
    /// Matched by tag (`Tag`, `PeerTag`).
    #[inline]
    pub fn tagged(self) -> bool {
        matches!(self, Kind::Tag | Kind::PeerTag)
    }

    /// A peer provider's transfer.
    #[inline]
    pub fn peer(self) -> bool {
        matches!(self, Kind::PeerMsg | Kind::PeerTag)
    }

    /// The kind of a transfer tagged or not, the application's or a peer's.
    #[inline]
    pub fn of(tagged: bool, peer: bool) -> Kind {
        match (tagged, peer) {
            (false, false) => Kind::Msg,
            (true, false) => Kind::Tag,
            (false, true) => Kind::PeerMsg,
            (true, true) => Kind::PeerTag,
        }
    }
}

/// Where an entry is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Free,
    /// A receive waiting for a message (in a posted list).
    Posted,
    /// A message handed to whoever delivers it, with a receive's buffer: a posted receive
    /// an arrival matched, or an unexpected message a new receive matched.
    Claimed,
    /// An arrival nothing matched, handed back to its transport to fill and queue.
    Arriving,
    /// An arrival waiting for a receive (in an unexpected list).
    Unexpected,
}

/// One receive or message.
#[derive(Clone, Debug)]
pub struct Entry<B> {
    pub kind: Kind,
    pub state: State,
    /// Posted: the source accepted (`ADDR_UNSPEC`: any). Arrivals: the sender.
    pub addr: u64,
    pub tag: u64,
    /// Posted: tag bits that do not take part in matching.
    pub ignore: u64,
    /// Posted: the buffer's capacity. Arrivals: the message's size.
    pub size: usize,
    /// The receive's context (claimed and posted entries).
    pub context: u64,
    /// The receive's flags; a claimed slice of a multi-receive buffer that releases it
    /// carries `FI_MULTI_RECV`.
    pub flags: Flags,
    /// The receive's buffer (posted and claimed entries).
    pub buf: Option<B>,
    /// Where the message goes in `buf`: non-zero for slices of a multi-receive buffer.
    pub offset: usize,
    /// The transport holding an arrival (its token), so a later match or a discard goes
    /// back to it.
    pub owner: u64,
    /// Multi-receive buffer: bytes given out so far.
    used: usize,
    prev: u32,
    next: u32,
}

impl<B> Entry<B> {
    /// A posted receive's filter takes an arrival of `kind` from `addr` with `tag`.
    #[inline(always)]
    fn accepts(&self, kind: Kind, addr: u64, tag: u64) -> bool {
        Filter {
            addr: self.addr,
            tag: self.tag,
            ignore: self.ignore,
        }
        .accepts(kind, addr, tag)
    }

    fn vacant() -> Self {
        Entry {
            kind: Kind::Msg,
            state: State::Free,
            addr: ADDR_UNSPEC,
            tag: 0,
            ignore: 0,
            size: 0,
            context: 0,
            flags: Flags::empty(),
            buf: None,
            offset: 0,
            owner: 0,
            used: 0,
            prev: NIL,
            next: NIL,
        }
    }

    /// Bytes of the buffer a posted receive still offers.
    pub fn remaining(&self) -> usize {
        self.size - self.used
    }
}

/// What a receive accepts: a source (`ADDR_UNSPEC`: any) and, if tagged, a tag under a mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filter {
    pub addr: u64,
    pub tag: u64,
    pub ignore: u64,
}

impl Filter {
    pub const ANY: Filter = Filter {
        addr: ADDR_UNSPEC,
        tag: 0,
        ignore: u64::MAX,
    };

    #[inline]
    fn accepts(&self, kind: Kind, addr: u64, tag: u64) -> bool {
        (self.addr == ADDR_UNSPEC || self.addr == addr)
            && (!kind.tagged() || (self.tag ^ tag) & !self.ignore == 0)
    }
}

/// A receive to post.
#[derive(Clone, Debug)]
pub struct Recv<B> {
    pub kind: Kind,
    pub from: Filter,
    pub buf: B,
    pub size: usize,
    pub context: u64,
    /// `FI_MULTI_RECV` (untagged only), `FI_COMPLETION`, … as posted.
    pub flags: Flags,
}

/// What a receive that takes one message found ([`RxEngine::post_one`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// It waits, posted, in this entry.
    Waiting(u32),
    /// It claimed the unexpected message in this entry: the transport delivers it.
    Claimed(u32),
}

/// The answer to an arrival (`get_msg` / `get_tag`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A posted receive took it: this claimed entry says where it goes.
    Matched(u32),
    /// No receive yet: this arriving entry is the transport's to fill and queue.
    Unexpected(u32),
}

#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const POSTED: usize = 0;
const UNEXPECTED: usize = 4;

fn list_of(which: usize, kind: Kind) -> usize {
    which + kind as usize
}

/// The matching engine of one shared receive context.
#[derive(Debug)]
pub struct RxEngine<B> {
    slots: Vec<Entry<B>>,
    free: u32,
    in_use: usize,
    /// Posted (untagged, tagged, a peer's untagged, a peer's tagged), then unexpected
    /// (the same four).
    lists: [List; 8],
    min_multi_recv: usize,
}

/// The default of `FI_OPT_MIN_MULTI_RECV`.
pub const DEFAULT_MIN_MULTI_RECV: usize = 64;

impl<B: Clone> RxEngine<B> {
    /// An engine holding at most `capacity` entries (posted receives, messages in flight
    /// and unexpected messages together); all allocated now.
    pub fn new(capacity: usize) -> Self {
        let n = capacity.clamp(1, NIL as usize - 1);
        let mut slots: Vec<Entry<B>> = (0..n).map(|_| Entry::vacant()).collect();
        for (i, s) in slots.iter_mut().enumerate() {
            s.next = if i + 1 < n { i as u32 + 1 } else { NIL };
        }
        RxEngine {
            slots,
            free: 0,
            in_use: 0,
            lists: [List {
                head: NIL,
                tail: NIL,
                len: 0,
            }; 8],
            min_multi_recv: DEFAULT_MIN_MULTI_RECV,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Adds `extra` free entries (an endpoint whose unexpected messages outgrow what it
    /// planned for: they are kept, not dropped).
    pub fn grow(&mut self, extra: usize) -> Result<()> {
        let n = self.slots.len();
        let extra = extra.min(NIL as usize - 1 - n);
        if extra == 0 {
            return Err(Error::new(
                errno::ENOSPC,
                "the receive engine is at its largest",
            ));
        }
        self.slots
            .try_reserve(extra)
            .map_err(|_| Error::new(errno::ENOMEM, "no memory to grow the receive engine"))?;
        for i in n..n + extra {
            let mut e = Entry::vacant();
            e.next = if i + 1 < n + extra {
                i as u32 + 1
            } else {
                self.free
            };
            self.slots.push(e);
        }
        self.free = n as u32;
        Ok(())
    }

    /// Entries not free.
    pub fn in_use(&self) -> usize {
        self.in_use
    }

    pub fn posted(&self, kind: Kind) -> usize {
        self.lists[list_of(POSTED, kind)].len
    }

    pub fn unexpected(&self, kind: Kind) -> usize {
        self.lists[list_of(UNEXPECTED, kind)].len
    }

    pub fn min_multi_recv(&self) -> usize {
        self.min_multi_recv
    }

    /// `FI_OPT_MIN_MULTI_RECV`: a multi-receive buffer is released once less is left.
    pub fn set_min_multi_recv(&mut self, n: usize) {
        self.min_multi_recv = n;
    }

    /// The entry at `id` (any state).
    pub fn entry(&self, id: u32) -> &Entry<B> {
        &self.slots[id as usize]
    }

    /// The entry at `id`, for the transport filling an arrival.
    pub fn entry_mut(&mut self, id: u32) -> &mut Entry<B> {
        &mut self.slots[id as usize]
    }

    #[inline(always)]
    fn alloc(&mut self) -> Result<u32> {
        let id = self.take_free()?;
        self.slots[id as usize] = Entry::vacant();
        Ok(id)
    }

    /// A free entry off the free list, as it was left (the caller writes all of it).
    #[inline(always)]
    fn take_free(&mut self) -> Result<u32> {
        let id = self.free;
        if id == NIL {
            return Err(Error::new(
                errno::EAGAIN,
                "every entry of the receive engine is in use: read completions, or open the SRX with a larger size",
            ));
        }
        self.free = self.slots[id as usize].next;
        self.in_use += 1;
        Ok(id)
    }

    #[inline(always)]
    fn release(&mut self, id: u32) {
        let free = self.free;
        let s = &mut self.slots[id as usize];
        debug_assert!(s.state != State::Free, "entry {id} freed twice");
        s.state = State::Free;
        s.buf = None;
        s.next = free;
        s.prev = NIL;
        self.free = id;
        self.in_use -= 1;
    }

    fn push_back(&mut self, l: usize, id: u32) {
        let tail = self.lists[l].tail;
        {
            let s = &mut self.slots[id as usize];
            s.prev = tail;
            s.next = NIL;
        }
        self.link_tail(l, tail, id);
    }

    /// Makes `id`, whose links already say `prev: tail, next: NIL`, list `l`'s tail.
    #[inline(always)]
    fn link_tail(&mut self, l: usize, tail: u32, id: u32) {
        if tail == NIL {
            self.lists[l].head = id;
        } else {
            self.slots[tail as usize].next = id;
        }
        self.lists[l].tail = id;
        self.lists[l].len += 1;
    }

    fn unlink(&mut self, l: usize, id: u32) {
        let (prev, next) = {
            let s = &self.slots[id as usize];
            (s.prev, s.next)
        };
        if prev == NIL {
            self.lists[l].head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lists[l].tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.lists[l].len -= 1;
        let s = &mut self.slots[id as usize];
        s.prev = NIL;
        s.next = NIL;
    }

    /// The first entry of list `l` for which `pred` holds, in order.
    #[inline]
    fn find(&self, l: usize, pred: impl Fn(&Entry<B>) -> bool) -> Option<u32> {
        let mut at = self.lists[l].head;
        while at != NIL {
            let s = &self.slots[at as usize];
            if pred(s) {
                return Some(at);
            }
            at = s.next;
        }
        None
    }

    /// An arrival of `size` bytes from `addr` (with `tag` when tagged): `get_msg` /
    /// `get_tag`. The first posted receive that accepts it claims it; a multi-receive
    /// buffer gives a slice and stays posted until less than the minimum is left, the
    /// slice that releases it carrying `FI_MULTI_RECV`. Otherwise the arrival gets an
    /// entry for its transport to fill and pass to [`Self::queue`].
    pub fn arrive(
        &mut self,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
        owner: u64,
    ) -> Result<Arrival> {
        let l = list_of(POSTED, kind);
        let Some(id) = self.first_accepting(l, kind, addr, tag) else {
            let id = self.alloc()?;
            let s = &mut self.slots[id as usize];
            s.kind = kind;
            s.state = State::Arriving;
            s.addr = addr;
            s.tag = tag;
            s.size = size;
            s.owner = owner;
            return Ok(Arrival::Unexpected(id));
        };
        if !self.slots[id as usize].flags.contains(Flags::MULTI_RECV) {
            self.claim_posted(l, id, addr, tag, size, owner);
            return Ok(Arrival::Matched(id));
        }
        let child = self.alloc()?;
        let released = self.carve(id, child, size);
        let c = &mut self.slots[child as usize];
        c.addr = addr;
        c.tag = tag;
        c.owner = owner;
        if released {
            self.unlink(l, id);
            self.release(id);
        }
        Ok(Arrival::Matched(child))
    }

    /// [`Self::arrive`] when the first receive posted for `kind` takes the message (the
    /// common case: one look, no scan); `None`, with nothing changed, otherwise, and for a
    /// multi-receive buffer (the caller then arrives the general way).
    #[inline(always)]
    pub fn arrive_at_head(
        &mut self,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
        owner: u64,
    ) -> Option<u32> {
        let l = list_of(POSTED, kind);
        let id = self.lists[l].head;
        if id == NIL {
            return None;
        }
        let s = &self.slots[id as usize];
        if s.flags.contains(Flags::MULTI_RECV) || !s.accepts(kind, addr, tag) {
            return None;
        }
        self.claim_posted(l, id, addr, tag, size, owner);
        Some(id)
    }

    /// [`Self::arrive`] for a message whose bytes come later, in pieces: the first posted
    /// receive that accepts it claims it, unless that is a multi-receive buffer (whose
    /// slices must complete in the order they are cut, the one that releases it last).
    /// `None`: nothing is claimed, and the message arrives whole once it is.
    pub fn arrive_in_pieces(
        &mut self,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
        owner: u64,
    ) -> Option<u32> {
        let l = list_of(POSTED, kind);
        let id = self.first_accepting(l, kind, addr, tag)?;
        if self.slots[id as usize].flags.contains(Flags::MULTI_RECV) {
            return None;
        }
        self.claim_posted(l, id, addr, tag, size, owner);
        Some(id)
    }

    /// The first posted receive of list `l` that accepts an arrival of `kind` from `addr`
    /// with `tag`, in posting order.
    #[inline(always)]
    fn first_accepting(&self, l: usize, kind: Kind, addr: u64, tag: u64) -> Option<u32> {
        self.find(l, |s| s.accepts(kind, addr, tag))
    }

    /// Posted entry `id` of list `l` claimed by an arrival.
    #[inline(always)]
    fn claim_posted(&mut self, l: usize, id: u32, addr: u64, tag: u64, size: usize, owner: u64) {
        self.unlink(l, id);
        let s = &mut self.slots[id as usize];
        s.state = State::Claimed;
        s.addr = addr;
        s.tag = tag;
        s.size = size;
        s.owner = owner;
    }

    /// Gives `into` (a fresh or an arrived entry) the next slice of the multi-receive
    /// buffer `parent` for a message of `size` bytes; true when that releases the buffer.
    fn carve(&mut self, parent: u32, into: u32, size: usize) -> bool {
        let min = self.min_multi_recv;
        let p = &mut self.slots[parent as usize];
        let offset = p.used;
        p.used += size.min(p.size - p.used);
        let released = p.size - p.used < min;
        let (buf, context, flags) = (p.buf.clone(), p.context, p.flags);
        let c = &mut self.slots[into as usize];
        c.kind = Kind::Msg;
        c.state = State::Claimed;
        c.buf = buf;
        c.context = context;
        c.offset = offset;
        c.size = size;
        c.flags = if released {
            flags
        } else {
            flags - Flags::MULTI_RECV
        };
        released
    }

    /// Queues an arrival its transport has filled (`queue_msg` / `queue_tag`): it waits
    /// for a receive, in arrival order.
    pub fn queue(&mut self, id: u32) -> Result<()> {
        let s = &mut self.slots[id as usize];
        if s.state != State::Arriving {
            return Err(Error::new(
                errno::EINVAL,
                format!("entry {id} is {:?}, not an arrival to queue", s.state),
            ));
        }
        s.state = State::Unexpected;
        let l = list_of(UNEXPECTED, s.kind);
        self.push_back(l, id);
        Ok(())
    }

    /// Posts a receive. Unexpected messages it accepts are claimed first, in arrival
    /// order, each passed to `start` (the transport then delivers it): one for an
    /// ordinary receive, as many as fit for a multi-receive buffer. Returns the posted
    /// entry, or `None` when nothing of the receive is left to post.
    pub fn post(
        &mut self,
        r: Recv<B>,
        mut start: impl FnMut(&mut Self, u32),
    ) -> Result<Option<u32>> {
        if !r.flags.contains(Flags::MULTI_RECV) {
            return Ok(match self.post_one(r)? {
                Posted::Waiting(id) => Some(id),
                Posted::Claimed(m) => {
                    start(self, m);
                    None
                }
            });
        }
        if r.kind.tagged() {
            return Err(Error::new(
                errno::EINVAL,
                "FI_MULTI_RECV applies to untagged receives",
            ));
        }
        let ul = list_of(UNEXPECTED, r.kind);
        let (from, kind) = (r.from, r.kind);
        // A multi-receive buffer has its own entry while it gives out slices.
        let id = self.alloc_posted(r, NIL)?;
        while let Some(m) = self.find(ul, |s| from.accepts(kind, s.addr, s.tag)) {
            self.unlink(ul, m);
            let size = self.slots[m as usize].size;
            let released = self.carve(id, m, size);
            start(self, m);
            if released {
                self.release(id);
                return Ok(None);
            }
        }
        self.push_back(list_of(POSTED, kind), id);
        Ok(Some(id))
    }

    /// Posts a receive that takes one message (not `FI_MULTI_RECV`, which [`Self::post`]
    /// takes): it claims the first unexpected message it accepts, in arrival order, or
    /// waits for one.
    #[inline(always)]
    pub fn post_one(&mut self, r: Recv<B>) -> Result<Posted> {
        if r.flags.contains(Flags::MULTI_RECV) {
            return Err(Error::new(
                errno::EINVAL,
                "FI_MULTI_RECV buffers are posted with post, not post_one",
            ));
        }
        let ul = list_of(UNEXPECTED, r.kind);
        // A receive that finds its message needs no entry of its own, so a full engine
        // still delivers what waits in it.
        if let Some(m) = self.find(ul, |s| r.from.accepts(r.kind, s.addr, s.tag)) {
            self.unlink(ul, m);
            let s = &mut self.slots[m as usize];
            s.state = State::Claimed;
            s.buf = Some(r.buf);
            s.context = r.context;
            s.flags = r.flags;
            return Ok(Posted::Claimed(m));
        }
        // The entry is written whole, its links included, then made the list's tail.
        let l = list_of(POSTED, r.kind);
        let tail = self.lists[l].tail;
        let id = self.alloc_posted(r, tail)?;
        self.link_tail(l, tail, id);
        Ok(Posted::Waiting(id))
    }

    /// A new entry holding receive `r`, linked after `prev` but not yet on a list.
    #[inline(always)]
    fn alloc_posted(&mut self, r: Recv<B>, prev: u32) -> Result<u32> {
        let id = self.take_free()?;
        // Written once, field by field (not reset to vacant first, nor assigned whole: that
        // drops the old entry through its drop glue, a call on every post). A free entry
        // holds no buffer (`release`), so the old one is dropped only if that ever changes.
        let s = &mut self.slots[id as usize];
        if let Some(stale) = s.buf.replace(r.buf) {
            drop(stale);
        }
        s.kind = r.kind;
        s.state = State::Posted;
        s.addr = r.from.addr;
        s.tag = r.from.tag;
        s.ignore = r.from.ignore;
        s.size = r.size;
        s.context = r.context;
        s.flags = r.flags;
        s.offset = 0;
        s.owner = 0;
        s.used = 0;
        s.prev = prev;
        s.next = NIL;
        Ok(id)
    }

    /// Frees a claimed or arriving entry once its transport is done with it
    /// (`free_entry`).
    #[inline]
    pub fn free(&mut self, id: u32) -> Result<()> {
        match self.slots[id as usize].state {
            State::Claimed | State::Arriving => {
                self.release(id);
                Ok(())
            }
            s => Err(not_freeable(id, s)),
        }
    }

    /// Takes back every posted receive of the application (the endpoint closes), in
    /// posting order per kind: the caller reports each cancelled.
    pub fn cancel_all(&mut self) -> Vec<Entry<B>> {
        self.cancel_all_of(&[Kind::Msg, Kind::Tag])
    }

    /// Takes back every posted receive of `kinds`, in posting order per kind.
    pub fn cancel_all_of(&mut self, kinds: &[Kind]) -> Vec<Entry<B>> {
        let mut out = Vec::new();
        for &kind in kinds {
            let l = list_of(POSTED, kind);
            while self.lists[l].head != NIL {
                let id = self.lists[l].head;
                self.unlink(l, id);
                out.push(self.slots[id as usize].clone());
                self.release(id);
            }
        }
        out
    }

    /// Takes back the posted receive with `context` (`fi_cancel`): the caller reports it
    /// cancelled. A multi-receive buffer stops taking messages; slices given out stay.
    pub fn cancel(&mut self, context: u64) -> Option<Entry<B>> {
        for kind in [Kind::Msg, Kind::Tag] {
            let l = list_of(POSTED, kind);
            if let Some(id) = self.find(l, |s| s.context == context) {
                self.unlink(l, id);
                let e = self.slots[id as usize].clone();
                self.release(id);
                return Some(e);
            }
        }
        None
    }

    /// The first unexpected message `from` accepts, left queued (`FI_PEEK`).
    pub fn peek(&self, kind: Kind, from: Filter) -> Option<u32> {
        self.find(list_of(UNEXPECTED, kind), |s| {
            from.accepts(kind, s.addr, s.tag)
        })
    }

    /// Removes an unexpected message (`FI_CLAIM`, `FI_DISCARD`, or closing the SRX): it
    /// becomes claimed, for the caller to start or have its transport discard, then free.
    pub fn take_unexpected(&mut self, id: u32) -> Result<()> {
        let s = &self.slots[id as usize];
        if s.state != State::Unexpected {
            return Err(Error::new(
                errno::EINVAL,
                format!("entry {id} is {:?}, not an unexpected message", s.state),
            ));
        }
        let l = list_of(UNEXPECTED, s.kind);
        self.unlink(l, id);
        self.slots[id as usize].state = State::Claimed;
        Ok(())
    }

    /// The first unexpected message of either kind held by transport `owner` (`None`:
    /// any), for draining when it goes.
    pub fn first_unexpected(&self, owner: Option<u64>) -> Option<u32> {
        for k in [Kind::Msg, Kind::Tag, Kind::PeerMsg, Kind::PeerTag] {
            let mut at = self.lists[list_of(UNEXPECTED, k)].head;
            while at != NIL {
                let e = &self.slots[at as usize];
                if owner.is_none_or(|o| e.owner == o) {
                    return Some(at);
                }
                at = e.next;
            }
        }
        None
    }

    /// The first unexpected message of one of `kinds`.
    pub fn first_unexpected_of(&self, kinds: &[Kind]) -> Option<u32> {
        kinds
            .iter()
            .map(|&k| self.lists[list_of(UNEXPECTED, k)].head)
            .find(|&h| h != NIL)
    }
}

/// Why entry `id` in state `s` cannot be freed (kept out of `free`'s inlined path).
#[cold]
#[inline(never)]
fn not_freeable(id: u32, s: State) -> Error {
    Error::new(
        errno::EINVAL,
        format!("entry {id} is {s:?}: only claimed or arriving entries are freed"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(kind: Kind, from: Filter, size: usize, context: u64) -> Recv<u32> {
        Recv {
            kind,
            from,
            buf: context as u32,
            size,
            context,
            flags: Flags::empty(),
        }
    }

    fn any(context: u64) -> Recv<u32> {
        recv(Kind::Msg, Filter::ANY, 4096, context)
    }

    fn from(addr: u64) -> Filter {
        Filter {
            addr,
            ..Filter::ANY
        }
    }

    fn tagged(tag: u64, ignore: u64) -> Filter {
        Filter {
            addr: ADDR_UNSPEC,
            tag,
            ignore,
        }
    }

    fn no_start(_: &mut RxEngine<u32>, id: u32) {
        panic!("nothing should be started, got {id}");
    }

    #[test]
    fn post_one_claims_a_waiting_message_or_waits_and_refuses_multi_receive_buffers() {
        let mut e = RxEngine::new(4);
        let Arrival::Unexpected(u) = e.arrive(Kind::Tag, 5, 9, 64, 1).unwrap() else {
            panic!()
        };
        e.queue(u).unwrap();
        // A tag the message does not carry waits; the one it carries claims it.
        let Posted::Waiting(w) = e.post_one(recv(Kind::Tag, tagged(8, 0), 64, 2)).unwrap() else {
            panic!()
        };
        assert_eq!(e.posted(Kind::Tag), 1);
        assert_eq!(
            e.post_one(recv(Kind::Tag, tagged(9, 0), 64, 3)).unwrap(),
            Posted::Claimed(u)
        );
        assert_eq!((e.entry(u).context, e.entry(u).buf), (3, Some(3)));
        assert_eq!(e.unexpected(Kind::Tag), 0);
        let mut m = any(4);
        m.flags = Flags::MULTI_RECV;
        assert_eq!(e.post_one(m).unwrap_err().errno(), errno::EINVAL);
        assert_eq!((e.in_use(), e.posted(Kind::Msg)), (2, 0), "nothing posted");
        assert_eq!(e.entry(w).context, 2);
    }

    #[test]
    fn arrivals_in_pieces_claim_a_posted_receive_but_never_a_multi_receive_buffer() {
        let mut e = RxEngine::new(8);
        // Nothing posted: nothing claimed, nothing allocated.
        assert_eq!(e.arrive_in_pieces(Kind::Tag, 5, 9, 20_000, 1), None);
        assert_eq!(e.in_use(), 0);
        // A directed receive for another source is passed over; the next one claims it.
        e.post(
            recv(
                Kind::Tag,
                Filter {
                    addr: 6,
                    ..tagged(9, 0)
                },
                64,
                1,
            ),
            no_start,
        )
        .unwrap();
        e.post(recv(Kind::Tag, tagged(9, 0), 64, 2), no_start)
            .unwrap();
        let c = e.arrive_in_pieces(Kind::Tag, 5, 9, 20_000, 7).unwrap();
        let x = e.entry(c);
        assert_eq!(
            (x.context, x.state, x.size, x.addr, x.owner),
            (2, State::Claimed, 20_000, 5, 7)
        );
        assert_eq!(e.posted(Kind::Tag), 1);
        // A multi-receive buffer first in line: nothing claimed, the buffer left whole.
        let mut m = any(3);
        m.flags = Flags::MULTI_RECV;
        e.post(m, no_start).unwrap();
        let before = e.in_use();
        assert_eq!(e.arrive_in_pieces(Kind::Msg, 5, 0, 20_000, 1), None);
        assert_eq!((e.in_use(), e.posted(Kind::Msg)), (before, 1));
        // Arriving whole, the message gets its slice as any other.
        assert!(matches!(
            e.arrive(Kind::Msg, 5, 0, 1000, 1),
            Ok(Arrival::Matched(_))
        ));
    }

    #[test]
    fn arrive_at_head_claims_only_the_first_posted_receive_and_never_a_multi_receive_buffer() {
        let mut e = RxEngine::new(8);
        // Nothing posted: nothing claimed, nothing allocated.
        assert_eq!(e.arrive_at_head(Kind::Tag, 5, 9, 64, 1), None);
        assert_eq!(e.in_use(), 0);
        // The first receive does not take it: nothing changes, and `arrive` finds the second.
        e.post_one(recv(Kind::Tag, tagged(8, 0), 64, 1)).unwrap();
        e.post_one(recv(Kind::Tag, tagged(9, 0), 64, 2)).unwrap();
        assert_eq!(e.arrive_at_head(Kind::Tag, 5, 9, 64, 7), None);
        assert_eq!((e.in_use(), e.posted(Kind::Tag)), (2, 2));
        let Ok(Arrival::Matched(m)) = e.arrive(Kind::Tag, 5, 9, 64, 7) else {
            panic!()
        };
        assert_eq!(e.entry(m).context, 2);
        // The first takes it: claimed with the arrival's particulars, off the posted list.
        let c = e.arrive_at_head(Kind::Tag, 5, 8, 48, 3).unwrap();
        let x = e.entry(c);
        assert_eq!(
            (x.context, x.state, x.size, x.addr, x.tag, x.owner),
            (1, State::Claimed, 48, 5, 8, 3)
        );
        assert_eq!(e.posted(Kind::Tag), 0);
        // A directed receive for another source, or an untagged arrival against tagged
        // receives, is not taken.
        e.post_one(recv(
            Kind::Tag,
            Filter {
                addr: 6,
                ..tagged(9, 0)
            },
            64,
            4,
        ))
        .unwrap();
        assert_eq!(e.arrive_at_head(Kind::Tag, 5, 9, 64, 1), None);
        assert_eq!(e.arrive_at_head(Kind::Msg, 6, 9, 64, 1), None);
        // A multi-receive buffer first in line is left whole for `arrive` to slice.
        let mut mr = any(5);
        mr.flags = Flags::MULTI_RECV;
        e.post(mr, no_start).unwrap();
        let before = e.in_use();
        assert_eq!(e.arrive_at_head(Kind::Msg, 5, 0, 100, 1), None);
        assert_eq!((e.in_use(), e.posted(Kind::Msg)), (before, 1));
    }

    #[test]
    fn cancel_all_takes_every_posted_receive_and_leaves_unexpected_messages() {
        let mut e = RxEngine::new(8);
        e.post(any(1), no_start).unwrap();
        e.post(recv(Kind::Tag, tagged(7, 0), 64, 2), no_start)
            .unwrap();
        e.post(any(3), no_start).unwrap();
        let Arrival::Unexpected(u) = e.arrive(Kind::Tag, 5, 9, 64, 1).unwrap() else {
            panic!()
        };
        e.queue(u).unwrap();
        let gone: Vec<u64> = e.cancel_all().iter().map(|x| x.context).collect();
        assert_eq!(gone, vec![1, 3, 2]);
        assert_eq!(e.in_use(), 1, "the unexpected message stays");
        assert!(e.cancel_all().is_empty());
        assert!(matches!(
            e.arrive(Kind::Msg, 5, 0, 8, 1),
            Ok(Arrival::Unexpected(_))
        ));
    }

    #[test]
    fn posted_receives_match_arrivals_in_posting_order() {
        let mut e = RxEngine::new(8);
        e.post(any(1), no_start).unwrap();
        e.post(any(2), no_start).unwrap();
        let Arrival::Matched(a) = e.arrive(Kind::Msg, 5, 0, 100, 9).unwrap() else {
            panic!()
        };
        assert_eq!(
            (e.entry(a).context, e.entry(a).addr, e.entry(a).size),
            (1, 5, 100)
        );
        assert_eq!(e.entry(a).state, State::Claimed);
        assert_eq!(e.entry(a).owner, 9);
        let Arrival::Matched(b) = e.arrive(Kind::Msg, 6, 0, 10, 9).unwrap() else {
            panic!()
        };
        assert_eq!(e.entry(b).context, 2);
        e.free(a).unwrap();
        e.free(b).unwrap();
        assert_eq!(e.in_use(), 0);
    }

    #[test]
    fn unexpected_messages_wait_and_a_later_receive_starts_the_first() {
        let mut e = RxEngine::new(8);
        let Arrival::Unexpected(u1) = e.arrive(Kind::Msg, 5, 0, 64, 1).unwrap() else {
            panic!()
        };
        e.queue(u1).unwrap();
        let Arrival::Unexpected(u2) = e.arrive(Kind::Msg, 6, 0, 32, 2).unwrap() else {
            panic!()
        };
        e.queue(u2).unwrap();
        assert_eq!(e.unexpected(Kind::Msg), 2);
        let mut started = vec![];
        let left = e.post(any(7), |_, id| started.push(id)).unwrap();
        assert_eq!((left, started.as_slice()), (None, &[u1][..]));
        let s = e.entry(u1);
        assert_eq!(
            (s.state, s.context, s.buf, s.size, s.owner),
            (State::Claimed, 7, Some(7), 64, 1)
        );
        assert_eq!(e.posted(Kind::Msg), 0);
        assert_eq!(e.unexpected(Kind::Msg), 1);
        // A queue call on something not arriving is refused.
        assert_eq!(e.queue(u1).unwrap_err().errno(), errno::EINVAL);
    }

    #[test]
    fn directed_receives_take_only_their_source() {
        let mut e = RxEngine::new(8);
        e.post(recv(Kind::Msg, from(7), 64, 1), no_start).unwrap();
        assert!(matches!(
            e.arrive(Kind::Msg, 5, 0, 8, 0).unwrap(),
            Arrival::Unexpected(_)
        ));
        assert!(matches!(
            e.arrive(Kind::Msg, 7, 0, 8, 0).unwrap(),
            Arrival::Matched(_)
        ));
        // Unexpected from 5 then 7: a receive from 7 skips the first.
        let mut e = RxEngine::new(8);
        for src in [5, 7, 7] {
            let Arrival::Unexpected(u) = e.arrive(Kind::Msg, src, 0, src as usize, 0).unwrap()
            else {
                panic!()
            };
            e.queue(u).unwrap();
        }
        let mut got = vec![];
        e.post(recv(Kind::Msg, from(7), 64, 1), |e, id| {
            got.push(e.entry(id).addr)
        })
        .unwrap();
        assert_eq!(got, [7]);
        assert_eq!(e.entry(e.peek(Kind::Msg, Filter::ANY).unwrap()).addr, 5);
    }

    #[test]
    fn tags_match_under_the_ignore_mask_and_kinds_never_cross() {
        let mut e = RxEngine::new(8);
        e.post(recv(Kind::Tag, tagged(0x10, 0x0f), 64, 1), no_start)
            .unwrap();
        assert!(matches!(
            e.arrive(Kind::Tag, 1, 0x20, 8, 0).unwrap(),
            Arrival::Unexpected(_)
        ));
        // An untagged arrival does not take a tagged receive.
        assert!(matches!(
            e.arrive(Kind::Msg, 1, 0x1f, 8, 0).unwrap(),
            Arrival::Unexpected(_)
        ));
        let Arrival::Matched(m) = e.arrive(Kind::Tag, 1, 0x1f, 8, 0).unwrap() else {
            panic!()
        };
        assert_eq!((e.entry(m).context, e.entry(m).tag), (1, 0x1f));
    }

    #[test]
    fn a_multi_receive_buffer_is_carved_and_released_below_the_minimum() {
        let mut e = RxEngine::new(8);
        e.set_min_multi_recv(300);
        let mut r = any(1);
        r.size = 1000;
        r.flags = Flags::MULTI_RECV;
        e.post(r, no_start).unwrap();
        let mut seen = vec![];
        for size in [200, 300, 300] {
            let Arrival::Matched(m) = e.arrive(Kind::Msg, 1, 0, size, 0).unwrap() else {
                panic!()
            };
            let s = e.entry(m);
            seen.push((
                s.offset,
                s.size,
                s.context,
                s.flags.contains(Flags::MULTI_RECV),
            ));
            e.free(m).unwrap();
        }
        assert_eq!(
            seen,
            [
                (0, 200, 1, false),
                (200, 300, 1, false),
                (500, 300, 1, true)
            ]
        );
        assert_eq!(e.posted(Kind::Msg), 0);
        assert_eq!(e.in_use(), 0);
        assert!(matches!(
            e.arrive(Kind::Msg, 1, 0, 8, 0).unwrap(),
            Arrival::Unexpected(_)
        ));
    }

    #[test]
    fn a_multi_receive_buffer_posted_late_takes_the_waiting_messages() {
        let mut e = RxEngine::new(8);
        e.set_min_multi_recv(300);
        for _ in 0..4 {
            let Arrival::Unexpected(u) = e.arrive(Kind::Msg, 1, 0, 300, 0).unwrap() else {
                panic!()
            };
            e.queue(u).unwrap();
        }
        let mut r = any(1);
        r.size = 1000;
        r.flags = Flags::MULTI_RECV;
        let mut got = vec![];
        let left = e
            .post(r, |e, id| {
                let s = e.entry(id);
                got.push((s.offset, s.flags.contains(Flags::MULTI_RECV)));
            })
            .unwrap();
        assert_eq!(left, None);
        assert_eq!(got, [(0, false), (300, false), (600, true)]);
        assert_eq!(e.unexpected(Kind::Msg), 1);
    }

    #[test]
    fn a_cancelled_receive_is_returned_and_no_longer_matches() {
        let mut e = RxEngine::new(4);
        e.post(any(1), no_start).unwrap();
        e.post(recv(Kind::Tag, tagged(3, 0), 8, 2), no_start)
            .unwrap();
        assert_eq!(e.cancel(2).unwrap().context, 2);
        assert!(e.cancel(2).is_none());
        assert!(matches!(
            e.arrive(Kind::Tag, 0, 3, 8, 0).unwrap(),
            Arrival::Unexpected(_)
        ));
        assert_eq!(e.cancel(1).unwrap().buf, Some(1));
    }

    #[test]
    fn a_full_engine_refuses_with_eagain_and_loses_nothing() {
        let mut e = RxEngine::new(2);
        e.post(any(1), no_start).unwrap();
        e.post(any(2), no_start).unwrap();
        let full = e.post(any(3), no_start).unwrap_err();
        assert_eq!(full.errno(), errno::EAGAIN);
        assert!(full.cause_is_static(), "a routine EAGAIN allocates nothing");
        assert_eq!(e.posted(Kind::Msg), 2);
        let Arrival::Matched(m) = e.arrive(Kind::Msg, 0, 0, 1, 0).unwrap() else {
            panic!()
        };
        e.free(m).unwrap();
        assert!(e.post(any(3), no_start).unwrap().is_some());
        assert_eq!(e.capacity(), 2);
    }

    #[test]
    fn unexpected_messages_can_be_peeked_and_taken() {
        let mut e = RxEngine::<u32>::new(4);
        let Arrival::Unexpected(u) = e.arrive(Kind::Tag, 3, 9, 8, 0).unwrap() else {
            panic!()
        };
        assert_eq!(e.peek(Kind::Tag, tagged(9, 0)), None, "not queued yet");
        e.queue(u).unwrap();
        assert_eq!(e.peek(Kind::Tag, tagged(9, 0)), Some(u));
        assert_eq!(e.peek(Kind::Tag, tagged(8, 0)), None);
        assert_eq!(e.first_unexpected(None), Some(u));
        e.take_unexpected(u).unwrap();
        assert_eq!(e.first_unexpected(None), None);
        e.free(u).unwrap();
        assert_eq!(e.free(u).unwrap_err().errno(), errno::EINVAL);
    }

    /// Random traffic against a plain model: the same receive matches the same message.
    #[test]
    fn random_traffic_matches_a_simple_model() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut e = RxEngine::new(256);
        // Model: posted (context, src filter, tag, ignore) and unexpected (id, src, tag).
        let mut posted: Vec<(u64, u64, u64, u64)> = vec![];
        let mut unexp: Vec<(u32, u64, u64)> = vec![];
        let mut claimed = vec![];
        for step in 0..20_000u64 {
            let tagged_op = next() % 2 == 0;
            let kind = if tagged_op { Kind::Tag } else { Kind::Msg };
            let k = kind as u64;
            if next() % 2 == 0 && e.in_use() < 200 {
                let src = if next() % 3 == 0 {
                    ADDR_UNSPEC
                } else {
                    next() % 4
                };
                let (tag, ignore) = (next() % 4, if next() % 4 == 0 { 1 } else { 0 });
                let f = Filter {
                    addr: src,
                    tag,
                    ignore,
                };
                let want = unexp
                    .iter()
                    .position(|&(id, s, t)| e.entry(id).kind == kind && f.accepts(kind, s, t));
                let mut started = None;
                let r = recv(kind, f, 64, step << 1 | k);
                e.post(r, |_, id| started = Some(id)).unwrap();
                match want {
                    Some(i) => {
                        assert_eq!(started, Some(unexp[i].0), "step {step}");
                        claimed.push(unexp.remove(i).0);
                    }
                    None => {
                        assert_eq!(started, None);
                        posted.push((step << 1 | k, src, tag, ignore));
                    }
                }
            } else if e.in_use() < 200 {
                let (src, tag) = (next() % 4, next() % 4);
                let want = posted.iter().position(|&(c, a, t, ig)| {
                    c & 1 == k
                        && Filter {
                            addr: a,
                            tag: t,
                            ignore: ig,
                        }
                        .accepts(kind, src, tag)
                });
                match (e.arrive(kind, src, tag, 8, 0).unwrap(), want) {
                    (Arrival::Matched(id), Some(i)) => {
                        assert_eq!(e.entry(id).context, posted.remove(i).0, "step {step}");
                        claimed.push(id);
                    }
                    (Arrival::Unexpected(id), None) => {
                        e.queue(id).unwrap();
                        unexp.push((id, src, tag));
                    }
                    (got, want) => panic!("step {step}: {got:?} but model {want:?}"),
                }
            }
            if claimed.len() > 8 {
                for id in claimed.drain(..) {
                    e.free(id).unwrap();
                }
            }
        }
        assert_eq!(e.posted(Kind::Msg) + e.posted(Kind::Tag), posted.len());
        assert_eq!(
            e.unexpected(Kind::Msg) + e.unexpected(Kind::Tag),
            unexp.len()
        );
    }

    #[test]
    fn a_grown_engine_keeps_its_entries_and_hands_out_the_new_ones() {
        let mut e: RxEngine<u32> = RxEngine::new(2);
        let a = e.arrive(Kind::Tag, 1, 7, 10, 100).unwrap();
        let b = e.arrive(Kind::Tag, 1, 8, 10, 101).unwrap();
        for x in [a, b] {
            let Arrival::Unexpected(id) = x else {
                panic!("{x:?}")
            };
            e.queue(id).unwrap();
        }
        assert_eq!(
            e.arrive(Kind::Tag, 1, 9, 10, 102).unwrap_err().errno(),
            errno::EAGAIN
        );
        e.grow(3).unwrap();
        assert_eq!(e.capacity(), 5);
        for t in 9..12 {
            let Arrival::Unexpected(id) = e.arrive(Kind::Tag, 1, t, 10, 100 + t).unwrap() else {
                panic!("matched nothing posted")
            };
            e.queue(id).unwrap();
        }
        assert_eq!(
            e.arrive(Kind::Tag, 1, 12, 10, 112).unwrap_err().errno(),
            errno::EAGAIN
        );
        // The older messages still match first, in order.
        for t in 7..12 {
            let mut got = None;
            e.post(
                Recv {
                    kind: Kind::Tag,
                    from: Filter {
                        addr: ADDR_UNSPEC,
                        tag: t,
                        ignore: 0,
                    },
                    buf: 0,
                    size: 10,
                    context: t,
                    flags: Flags::empty(),
                },
                |eng, id| got = Some(eng.entry(id).owner),
            )
            .unwrap();
            assert_eq!(got, Some(if t < 9 { 93 + t } else { 100 + t }));
        }
    }
}
