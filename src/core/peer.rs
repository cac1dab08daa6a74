//! The owner side of fi_peer(3) as plain Rust: what a shared receive context does with the
//! entries peers claim (`get_*`, `queue_*`, `free_entry`, `start_*`, `discard_*`), how
//! completions are delivered to a peer's callbacks without re-entering them, and how a
//! peer's completions are moved into the owner's CQ without losing any. The C layer
//! (`capi::peer`, `capi::ext`) only translates C entries and ops tables to these.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::core::cq::CqErrEntry;
use crate::core::error::{Error, Result};
use crate::core::srx::{Arrival, Entry, Filter, Kind, Recv, RxEngine};

/// How entries go back to the peers that hold them: the C layer's side of [`SharedRx`].
pub trait Handoff<B> {
    /// Makes slot `id`'s state visible to its peer (its C entry). Called with the engine
    /// locked, on a slot nobody else holds.
    fn fill(&self, id: u32, entry: &Entry<B>);
    /// The peer's `start_*` (or `discard_*`) of slot `id`. Called with no lock held: a
    /// peer may call back into the owner from it.
    fn hand_back(&self, id: u32, kind: Kind, discard: bool) -> Result<()>;
}

/// A receive engine shared by the application (posting) and peers (arrivals).
#[derive(Debug)]
pub struct SharedRx<B, H> {
    engine: Mutex<RxEngine<B>>,
    handoff: H,
}

/// Claimed entries to start once the engine lock is dropped; most posts start none or one.
struct Started {
    ids: [u32; 16],
    n: usize,
    more: Vec<u32>,
}

impl Started {
    fn new() -> Self {
        Started {
            ids: [0; 16],
            n: 0,
            more: Vec::new(),
        }
    }
    fn push(&mut self, id: u32) {
        if self.n < self.ids.len() {
            self.ids[self.n] = id;
            self.n += 1;
        } else {
            self.more.push(id);
        }
    }
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.ids[..self.n].iter().chain(&self.more).copied()
    }
}

impl<B: Clone, H: Handoff<B>> SharedRx<B, H> {
    pub fn new(capacity: usize, handoff: H) -> Self {
        SharedRx {
            engine: Mutex::new(RxEngine::new(capacity)),
            handoff,
        }
    }

    pub fn handoff(&self) -> &H {
        &self.handoff
    }

    /// The same engine with another handoff (for a handoff that needs the engine's size).
    pub fn with_handoff<H2: Handoff<B>>(self, handoff: H2) -> SharedRx<B, H2> {
        SharedRx {
            engine: self.engine,
            handoff,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, RxEngine<B>> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An arrival from peer `peer` (`get_msg` / `get_tag`): the slot, filled, and whether a
    /// posted receive matched it.
    pub fn arrive(
        &self,
        kind: Kind,
        addr: u64,
        tag: u64,
        size: usize,
        peer: u64,
    ) -> Result<(Arrival, u32)> {
        let mut g = self.lock();
        let a = g.arrive(kind, addr, tag, size, peer)?;
        let id = match a {
            Arrival::Matched(id) | Arrival::Unexpected(id) => id,
        };
        let e = g.entry(id).clone();
        self.handoff.fill(id, &e);
        Ok((a, id))
    }

    /// Posts an application receive. Every waiting message it claims goes back to its peer
    /// (`start_*`) after the engine lock is dropped, whatever the others do; one whose peer
    /// refuses is freed here and returned as the receive's error completion, for the
    /// caller to write (the receive was taken: it must complete).
    pub fn recv(&self, r: Recv<B>) -> Result<Vec<CqErrEntry>> {
        let kind = r.kind;
        let mut started = Started::new();
        self.lock().post(r, |eng, id| {
            let e = eng.entry(id).clone();
            self.handoff.fill(id, &e);
            started.push(id);
        })?;
        let mut refused = Vec::new();
        for id in started.iter() {
            if let Err(e) = self.handoff.hand_back(id, kind, false) {
                refused.push(self.refused(id, kind, &e));
            }
        }
        Ok(refused)
    }

    /// A claimed entry whose peer refused `start_*`: the peer keeps nothing of it, so its
    /// slot is freed here; the receive's error completion says why.
    #[cold]
    fn refused(&self, id: u32, kind: Kind, e: &Error) -> CqErrEntry {
        crate::fi_warn!("peer", "a peer refused to start a matched message: {e}");
        let mut g = self.lock();
        let entry = g.entry(id).clone();
        if let Err(f) = g.free(id) {
            crate::fi_warn!("peer", "{f}");
        }
        let what = if kind.tagged() {
            rfabric_sys::fabric::FI_TAGGED
        } else {
            rfabric_sys::fabric::FI_MSG
        };
        CqErrEntry {
            op_context: entry.context,
            flags: rfabric_sys::fabric::FI_RECV | what,
            tag: entry.tag,
            err: e.errno(),
            ..CqErrEntry::default()
        }
    }

    /// Discards the first unexpected message `from` accepts (`FI_DISCARD`): its peer drops
    /// it without a completion. The entry as it was, or None when none waits.
    pub fn discard(&self, kind: Kind, from: Filter) -> Result<Option<Entry<B>>> {
        let (id, seen) = {
            let mut g = self.lock();
            let Some(id) = g.peek(kind, from) else {
                return Ok(None);
            };
            let seen = g.entry(id).clone();
            g.take_unexpected(id)?;
            (id, seen)
        };
        self.handoff.hand_back(id, kind, true)?;
        Ok(Some(seen))
    }

    /// Discards every unexpected message peer `peer` holds (it is going): each goes back
    /// to it with `discard_*`, one at a time with no lock held.
    pub fn discard_from(&self, peer: u64) {
        loop {
            let taken = {
                let mut g = self.lock();
                g.first_unexpected(Some(peer)).map(|id| {
                    let kind = g.entry(id).kind;
                    let _ = g.take_unexpected(id);
                    (id, kind)
                })
            };
            let Some((id, kind)) = taken else { return };
            if let Err(e) = self.handoff.hand_back(id, kind, true) {
                crate::fi_warn!("peer", "discarding an unexpected message: {e}");
            }
        }
    }
}

/// Completions for a peer's callbacks (fi_peer(3) `FI_PEER_TRANSFER`), delivered in order
/// and never re-entering them: one that comes while a delivery runs (on this thread, from
/// inside a callback, or on another) is queued and delivered by the running delivery.
#[derive(Debug)]
pub struct Delivery<C> {
    pending: Mutex<VecDeque<C>>,
    delivering: AtomicBool,
    /// Cleared by [`Self::detach`]: what comes after is dropped.
    open: AtomicBool,
}

thread_local! {
    /// The delivery whose callbacks this thread is running, if any.
    static IN_DELIVERY: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl<C> Delivery<C> {
    /// Closed until [`Self::open`]: completions wait until the peer's callbacks are known.
    pub fn new(depth: usize) -> Self {
        Delivery {
            pending: Mutex::new(VecDeque::with_capacity(depth)),
            delivering: AtomicBool::new(false),
            open: AtomicBool::new(false),
        }
    }

    fn me(&self) -> usize {
        std::ptr::from_ref(self) as *const () as usize
    }

    fn pop(&self) -> Option<C> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    /// Queues `c` and delivers what waits with `call`, unless a delivery is running.
    pub fn push(&self, c: C, call: impl Fn(C)) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(c);
        self.deliver(call);
    }

    /// Lets deliveries run, and delivers what came meanwhile.
    pub fn open(&self, call: impl Fn(C)) {
        self.open.store(true, Ordering::SeqCst);
        self.deliver(call);
    }

    fn deliver(&self, call: impl Fn(C)) {
        loop {
            // SeqCst pairs with `detach`: either it sees this delivering, or this sees it
            // closed.
            if !self.open.load(Ordering::SeqCst) || self.delivering.swap(true, Ordering::SeqCst) {
                return;
            }
            let outer = IN_DELIVERY.replace(self.me());
            while let Some(c) = self.pop() {
                if !self.open.load(Ordering::SeqCst) {
                    break;
                }
                call(c);
            }
            IN_DELIVERY.set(outer);
            self.delivering.store(false, Ordering::SeqCst);
            // One queued between the last pop and the store would wait otherwise.
            if self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return;
            }
        }
    }

    /// Ends deliveries (the link is closing): no callback starts after this, and one
    /// running on another thread is waited for, so the peer's endpoint can be closed once
    /// no callback is inside it. A callback that closes its own link is not waited for (it
    /// is this thread). Returns how many completions were dropped undelivered.
    pub fn detach(&self) -> usize {
        self.open.store(false, Ordering::SeqCst);
        if IN_DELIVERY.get() != self.me() {
            while self.delivering.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
        }
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let n = p.len();
        p.clear();
        n
    }
}

/// Moves a peer's completions into the owner's CQ, no more at a time than the CQ has
/// `room` for: the rest waits in the peer's own queue, unlost, until a read makes room.
/// `move_some(n)` moves at most `n` (0 only drives the peer's progress) and says how many;
/// returns how many moved in all.
pub fn drain(
    mut room: impl FnMut() -> usize,
    mut move_some: impl FnMut(usize) -> Result<usize>,
    batch: usize,
) -> Result<usize> {
    let mut moved = 0;
    loop {
        let n = batch.min(room());
        let k = move_some(n)?;
        moved += k;
        if n == 0 || k < n {
            return Ok(moved);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::error::errno;
    use crate::core::flags::Flags;
    use std::sync::Arc;

    /// A peer that records what it is handed and refuses the sizes it is told to.
    #[derive(Default)]
    struct FakePeer {
        seen: Mutex<Vec<(u32, bool)>>,
        filled: Mutex<Vec<u32>>,
        refuse: usize,
        sizes: Mutex<std::collections::HashMap<u32, usize>>,
    }
    impl Handoff<()> for FakePeer {
        fn fill(&self, id: u32, e: &Entry<()>) {
            self.filled.lock().unwrap().push(id);
            self.sizes.lock().unwrap().insert(id, e.size);
        }
        fn hand_back(&self, id: u32, _kind: Kind, discard: bool) -> Result<()> {
            if !discard && self.sizes.lock().unwrap()[&id] == self.refuse {
                return Err(Error::new(errno::EIO, "refused"));
            }
            self.seen.lock().unwrap().push((id, discard));
            Ok(())
        }
    }

    fn recv(context: u64, size: usize, flags: Flags) -> Recv<()> {
        Recv {
            kind: Kind::Msg,
            from: Filter::ANY,
            buf: (),
            size,
            context,
            flags,
        }
    }

    #[test]
    fn every_claimed_message_is_started_and_a_refusal_completes_the_receive_in_error() {
        let rx = SharedRx::new(
            16,
            FakePeer {
                refuse: 13,
                ..Default::default()
            },
        );
        rx.lock().set_min_multi_recv(16);
        for size in [10, 13, 12] {
            let (a, id) = rx.arrive(Kind::Msg, 5, 0, size, 7).unwrap();
            assert!(matches!(a, Arrival::Unexpected(_)));
            rx.lock().queue(id).unwrap();
        }
        let refused = rx.recv(recv(61, 4096, Flags::MULTI_RECV)).unwrap();
        assert_eq!(
            rx.handoff().seen.lock().unwrap().len(),
            2,
            "both others started"
        );
        assert_eq!(refused.len(), 1);
        assert_eq!((refused[0].op_context, refused[0].err), (61, errno::EIO));
        // Posted 1 buffer, arrived 3: 2 held by their peer until free_entry, 1 freed here.
        assert_eq!(rx.lock().in_use(), 3);
    }

    #[test]
    fn a_going_peer_gets_back_every_message_it_holds_and_only_those() {
        let rx = SharedRx::new(8, FakePeer::default());
        for (peer, size) in [(1, 4), (2, 5), (1, 6)] {
            let (_, id) = rx.arrive(Kind::Msg, 0, 0, size, peer).unwrap();
            rx.lock().queue(id).unwrap();
        }
        rx.discard_from(1);
        let seen = rx.handoff().seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        assert!(seen.iter().all(|&(_, d)| d));
        assert_eq!(rx.lock().unexpected(Kind::Msg), 1);
        let e = rx.discard(Kind::Msg, Filter::ANY).unwrap().unwrap();
        assert_eq!(e.size, 5);
        assert!(rx.discard(Kind::Msg, Filter::ANY).unwrap().is_none());
    }

    #[test]
    fn deliveries_wait_for_open_keep_order_and_never_reenter() {
        let d = Arc::new(Delivery::new(4));
        let got = Arc::new(Mutex::new(Vec::new()));
        let inside = Arc::new(AtomicBool::new(false));
        let f = {
            let (d, got, inside) = (d.clone(), got.clone(), inside.clone());
            move |c: u32| {
                assert!(!inside.swap(true, Ordering::SeqCst), "re-entered");
                got.lock().unwrap().push(c);
                if c == 2 {
                    // Queued behind the running delivery, which delivers it with its own
                    // callback after this one returns.
                    d.push(20, |_| panic!("a nested push must not deliver itself"));
                }
                inside.store(false, Ordering::SeqCst);
            }
        };
        d.push(1, &f);
        assert!(got.lock().unwrap().is_empty(), "closed until open");
        d.open(&f);
        d.push(2, &f);
        d.push(3, &f);
        assert_eq!(*got.lock().unwrap(), [1, 2, 20, 3]);
        assert_eq!(d.detach(), 0);
        d.push(4, &f);
        assert_eq!(got.lock().unwrap().len(), 4, "nothing after detach");
    }

    #[test]
    fn detach_waits_for_a_callback_running_on_another_thread() {
        let d = Arc::new(Delivery::new(4));
        let entered = Arc::new(AtomicBool::new(false));
        let left = Arc::new(AtomicBool::new(false));
        d.open(|_: u32| {});
        let (d2, e2, l2) = (d.clone(), entered.clone(), left.clone());
        let t = std::thread::spawn(move || {
            d2.push(1, |_| {
                e2.store(true, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(100));
                l2.store(true, Ordering::SeqCst);
            })
        });
        while !entered.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        d.detach();
        assert!(
            left.load(Ordering::SeqCst),
            "detach returned with a callback running"
        );
        t.join().unwrap();
    }

    #[test]
    fn a_drain_moves_no_more_than_the_cq_has_room_for_and_loses_nothing() {
        let source = std::cell::RefCell::new((0..10).collect::<VecDeque<u32>>());
        let cq = std::cell::RefCell::new(Vec::new());
        let cap = 3;
        let mut total = 0;
        while !source.borrow().is_empty() {
            total += drain(
                || cap - cq.borrow().len(),
                |n| {
                    let mut s = source.borrow_mut();
                    let k = n.min(s.len());
                    for e in s.drain(..k) {
                        assert!(cq.borrow().len() < cap, "written past the CQ's room");
                        cq.borrow_mut().push(e);
                    }
                    Ok(k)
                },
                16,
            )
            .unwrap();
            cq.borrow_mut().clear(); // the application reads
        }
        assert_eq!(total, 10);
    }
}
