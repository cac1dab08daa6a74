//! The registration cache of a domain, and the memory monitor that keeps it honest.
//!
//! A rendezvous of an application buffer that is not registered (a C caller's `fi_send`
//! with no descriptor, `mr_mode` without `FI_MR_LOCAL`) needs a registration for the
//! device to read or write it. Made per message, that is two system calls and a page walk
//! each time; cached, the next message from the same buffer finds it. A cached entry must
//! never outlive the memory it describes, or a later buffer at the same address would be
//! read from the old pages: so every cached range is watched with a userfaultfd, whose
//! events (unmap, `madvise` discard, `mremap`, and faults on missing pages) drop the
//! entries they touch. The kernel holds the thread that unmaps until its event is read, and
//! the monitor reads events only while holding the lock every lookup takes, then drops the
//! entries before letting go of it: no lookup can see an entry whose memory has gone.
//!
//! One monitor (one userfaultfd and one thread that reads it) serves the process: two
//! userfaultfds cannot watch the same pages, and two domains may cache the same buffer.
//! The thread is not on any data path; it sleeps in `poll` until memory it watches changes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use rfabric_sys::uffd::{Event, Userfaultfd};

use crate::core::mr_cache::{CacheStats, Coverage, RegCache, Removed};
use crate::verbs::ep_common::lock;

const PAGE: u64 = 4096;

fn page_down(a: u64) -> u64 {
    a & !(PAGE - 1)
}

fn page_up(a: u64) -> u64 {
    a.saturating_add(PAGE - 1) & !(PAGE - 1)
}

/// What the monitor guards: every domain's cache and what is watched for them.
#[derive(Debug)]
struct World<R> {
    caches: HashMap<u64, RegCache<R>>,
    coverage: Coverage,
    /// Events read so far: a registration made outside the lock is cached only when none
    /// came meanwhile (one might have emptied memory it spans).
    events: u64,
    next_id: u64,
}

/// A userfaultfd, the thread that reads it, and the caches it keeps honest.
#[derive(Debug)]
pub(crate) struct Monitor<R> {
    uffd: Userfaultfd,
    world: Mutex<World<R>>,
    /// Set by [`Monitor::stop`]: nothing is watched or cached any more.
    stopped: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<R: Clone + Send + 'static> Monitor<R> {
    /// Opens the userfaultfd and starts the thread that reads it (for the process's life).
    pub(crate) fn start() -> Result<Arc<Self>, i32> {
        let uffd = Userfaultfd::open()?;
        let m = Arc::new(Monitor {
            uffd,
            world: Mutex::new(World {
                caches: HashMap::new(),
                coverage: Coverage::default(),
                events: 0,
                next_id: 0,
            }),
            stopped: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let run = m.clone();
        let t = std::thread::Builder::new()
            .name("rverbs-mr-monitor".into())
            .spawn(move || run.run())
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EAGAIN))?;
        *lock(&m.thread) = Some(t);
        crate::fi_info!(
            "mr",
            "registration cache: memory monitor started (userfaultfd{})",
            if m.uffd.user_mode_only() {
                ", user-mode faults only"
            } else {
                ""
            }
        );
        Ok(m)
    }

    /// Whether this process started it (a child after fork has a copy it must not use).
    pub(crate) fn ours(&self) -> bool {
        self.uffd.ours()
    }

    /// Stops watching and caching for good (the provider is being unloaded: libfabric's
    /// `fi_fini` calls its `cleanup`, then `dlclose`): every entry leaves its cache, so no range
    /// is watched and no unmap waits for a reader, and the thread ends. Later lookups
    /// register for their operation alone.
    pub(crate) fn stop(&self) {
        if !self.ours() || self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut gone = vec![];
        {
            let mut w = lock(&self.world);
            let World {
                caches, coverage, ..
            } = &mut *w;
            for c in caches.values_mut() {
                for r in c.clear() {
                    gone.push(self.forget(coverage, r));
                }
            }
        }
        drop(gone);
        self.uffd.interrupt();
        if let Some(t) = lock(&self.thread).take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        crate::fi_info!("mr", "registration cache: memory monitor stopped");
    }

    fn run(&self) {
        loop {
            if let Err(e) = self.uffd.wait(-1) {
                crate::fi_warn!("mr", "memory monitor: poll failed (errno {e})");
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            let mut gone = vec![];
            {
                let mut w = lock(&self.world);
                loop {
                    match self.uffd.read_event() {
                        Ok(Some(ev)) => self.handle(&mut w, ev, &mut gone),
                        Ok(None) => break,
                        Err(e) => {
                            crate::fi_warn!("mr", "memory monitor: read failed (errno {e})");
                            break;
                        }
                    }
                }
            }
            // Deregistered outside the lock: lookups need not wait for the device.
            drop(gone);
        }
    }

    fn handle(&self, w: &mut World<R>, ev: Event, gone: &mut Vec<R>) {
        w.events += 1;
        crate::fi_debug!("mr", "memory monitor: {ev:?}");
        match ev {
            Event::Unmap { start, end } | Event::Remove { start, end } => {
                self.invalidate(w, start, end, gone)
            }
            Event::Remap { from, to, len } => {
                self.invalidate(w, from, from.saturating_add(len), gone);
                // The watch moved with the pages; nothing is cached there.
                let _ = self.uffd.unregister(page_down(to), page_up(len));
            }
            Event::PageFault { addr } => {
                // A watched page lost its frame before its entry went: drop what covers it
                // and stop watching it, which wakes the thread that faulted.
                let p = page_down(addr);
                self.invalidate(w, p, p + PAGE, gone);
                let r = self.uffd.unregister(p, PAGE);
                crate::fi_debug!("mr", "unwatch fault page {p:#x}: {r:?}");
            }
            Event::Other(_) => {}
        }
    }

    fn invalidate(&self, w: &mut World<R>, start: u64, end: u64, gone: &mut Vec<R>) {
        let World {
            caches, coverage, ..
        } = w;
        for c in caches.values_mut() {
            for r in c.invalidate(start, end) {
                gone.push(self.forget(coverage, r));
            }
        }
    }

    /// Stops watching what only `r`'s range needed; returns its registration.
    fn forget(&self, coverage: &mut Coverage, (s, e, reg): Removed<R>) -> R {
        for (a, b) in coverage.remove(s, e) {
            // An unmapped range is no longer watched: its error is no news.
            let r = self.uffd.unregister(a, b - a);
            crate::fi_debug!("mr", "unwatch {a:#x}..{b:#x}: {r:?}");
        }
        reg
    }
}

/// The registration cache of one domain.
#[derive(Debug)]
pub(crate) struct MrCache<R: Clone + Send + 'static> {
    monitor: Arc<Monitor<R>>,
    id: u64,
}

impl<R: Clone + Send + 'static> MrCache<R> {
    /// A cache of at most `max_count` entries and `max_bytes` bytes, kept by `monitor`.
    pub(crate) fn new(monitor: &Arc<Monitor<R>>, max_count: usize, max_bytes: u64) -> Self {
        let mut w = lock(&monitor.world);
        let id = w.next_id;
        w.next_id += 1;
        w.caches.insert(id, RegCache::new(max_count, max_bytes));
        MrCache {
            monitor: monitor.clone(),
            id,
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        if !self.monitor.ours() {
            return CacheStats::default();
        }
        lock(&self.monitor.world)
            .caches
            .get(&self.id)
            .map(|c| c.stats())
            .unwrap_or_default()
    }

    /// A registration covering `addr..addr+len`: a cached one, or one `register` makes
    /// (given a page-aligned start and length), cached when the monitor can watch its
    /// memory. An entry in use stays registered while its holder keeps it, even if it
    /// leaves the cache.
    pub(crate) fn get(
        &self,
        addr: u64,
        len: usize,
        register: impl Fn(u64, usize) -> Result<R, i32>,
    ) -> Result<R, i32> {
        let m = &*self.monitor;
        let (s, e) = (page_down(addr), page_up(addr.saturating_add(len as u64)));
        if !m.ours() || m.stopped.load(Ordering::Acquire) {
            // A child after fork (the monitor watches the parent's memory, not this one's),
            // or a provider being unloaded.
            return register(s, (e - s) as usize);
        }
        let (span, events) = {
            let mut w = lock(&m.world);
            let events = w.events;
            let Some(c) = w.caches.get_mut(&self.id) else {
                return register(s, (e - s) as usize);
            };
            if let Some(r) = c.lookup(s, e) {
                return Ok(r);
            }
            let span = c.span(s, e);
            if !c.fits(span.1 - span.0) {
                c.count_uncached();
                drop(w);
                return register(s, (e - s) as usize);
            }
            (span, events)
        };
        // Registered outside the lock: pinning pages may fault, and a fault on a watched
        // page waits for the monitor, which takes the lock.
        let (span, reg) = match register(span.0, (span.1 - span.0) as usize) {
            Ok(r) => (span, r),
            Err(err) => {
                let memlock = err == libc::ENOMEM || err == libc::EAGAIN;
                if memlock {
                    // Out of lockable memory (RLIMIT_MEMLOCK): give back what is cached.
                    self.flush();
                } else if span == (s, e) {
                    return Err(err); // nothing else to try (an unmapped buffer: EFAULT)
                }
                ((s, e), register(s, (e - s) as usize)?)
            }
        };
        let mut gone = vec![];
        {
            let mut w = lock(&m.world);
            let moved = w.events != events || m.stopped.load(Ordering::Acquire);
            let World {
                caches, coverage, ..
            } = &mut *w;
            let Some(c) = caches.get_mut(&self.id) else {
                return Ok(reg);
            };
            if moved {
                c.count_uncached();
                return Ok(reg);
            }
            let mut watched = vec![];
            for (a, b) in coverage.add(span.0, span.1) {
                crate::fi_debug!("mr", "watch {a:#x}..{b:#x}");
                match m.uffd.register(a, b - a) {
                    Ok(()) => watched.push((a, b)),
                    Err(err) => {
                        // Memory the monitor cannot watch (a file mapping, hugetlb pages,
                        // another userfaultfd's): used for this operation only.
                        crate::fi_debug!(
                            "mr",
                            "registration cache: {:#x}..{:#x} not cached (userfaultfd: errno {err})",
                            span.0,
                            span.1
                        );
                        for (a, b) in coverage.remove(span.0, span.1) {
                            let _ = m.uffd.unregister(a, b - a);
                        }
                        c.count_uncached();
                        return Ok(reg);
                    }
                }
            }
            for r in c.insert(span.0, span.1, reg.clone()) {
                gone.push(m.forget(coverage, r));
            }
        }
        drop(gone);
        Ok(reg)
    }

    /// Drops every entry (in use ones stay registered with their holders).
    pub(crate) fn flush(&self) {
        let m = &*self.monitor;
        if !m.ours() {
            return; // a child after fork holds its parent's entries: they are not its own
        }
        let mut gone = vec![];
        {
            let mut w = lock(&m.world);
            let World {
                caches, coverage, ..
            } = &mut *w;
            if let Some(c) = caches.get_mut(&self.id) {
                for r in c.clear() {
                    gone.push(m.forget(coverage, r));
                }
            }
        }
        drop(gone);
    }
}

impl<R: Clone + Send + 'static> Drop for MrCache<R> {
    fn drop(&mut self) {
        if !self.monitor.ours() {
            // A child after fork: the lock may have been held by the parent's monitor
            // thread, which did not come along; leave the copy alone.
            return;
        }
        let s = self.stats();
        crate::fi_info!(
            "mr",
            "registration cache closed: {} hits, {} misses, {} not cached, {} evicted, {} dropped by the memory monitor",
            s.hits,
            s.misses,
            s.uncached,
            s.evictions,
            s.invalidations
        );
        self.flush();
        lock(&self.monitor.world).caches.remove(&self.id);
    }
}

/// `FI_RVERBS_MR_CACHE_MAX_COUNT` (default 1024, libfabric's; 0 turns the cache off) and
/// `FI_RVERBS_MR_CACHE_MAX_SIZE` (default: half of the memory per online CPU, as
/// libfabric's `FI_MR_CACHE_MAX_SIZE`).
pub(crate) fn limits() -> crate::core::error::Result<(usize, u64)> {
    let count = crate::core::env::get_usize_or("FI_RVERBS_MR_CACHE_MAX_COUNT", 1024)?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(1 << 30, |kib| kib * 1024);
    let size =
        crate::core::env::get_usize_or("FI_RVERBS_MR_CACHE_MAX_SIZE", (mem / cpus / 2) as usize)?;
    Ok((count, size as u64))
}

/// The process's monitor for verbs registrations, started at first use (`None` when the
/// kernel offers no userfaultfd, or the cache is off: each rendezvous then registers for
/// itself).
pub(crate) fn monitor<R: Clone + Send + 'static>(
    slot: &'static OnceLock<Option<Arc<Monitor<R>>>>,
) -> Option<&'static Arc<Monitor<R>>> {
    slot.get_or_init(|| match Monitor::start() {
        Ok(m) => Some(m),
        Err(e) => {
            crate::fi_info!(
                "mr",
                "registration cache off: userfaultfd unavailable (errno {e}; allow it with sysctl vm.unprivileged_userfaultfd=1 or run as root): each rendezvous of unregistered memory registers it for that message"
            );
            None
        }
    })
    .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfabric_sys::uffd::AnonMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A stand-in registration: its range, and a count of the live ones.
    #[derive(Debug)]
    struct Fake(u64, usize, Arc<AtomicU64>);

    impl Drop for Fake {
        fn drop(&mut self) {
            self.2.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn fake(live: &Arc<AtomicU64>) -> impl Fn(u64, usize) -> Result<Arc<Fake>, i32> + '_ {
        move |a, n| {
            live.fetch_add(1, Ordering::SeqCst);
            Ok(Arc::new(Fake(a, n, live.clone())))
        }
    }

    /// A cache of 16 entries on a monitor of its own, and the count of live stand-ins.
    fn fixture() -> (MrCache<Arc<Fake>>, Arc<AtomicU64>) {
        let m = Monitor::<Arc<Fake>>::start().expect("userfaultfd");
        (MrCache::new(&m, 16, 1 << 30), Arc::new(AtomicU64::new(0)))
    }

    /// The monitor's thread handles an event before the call that caused it returns, but
    /// drops the registrations just after: wait for that.
    fn settle(live: &AtomicU64, want: u64) {
        for _ in 0..1000 {
            if live.load(Ordering::SeqCst) == want {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(live.load(Ordering::SeqCst), want);
    }

    #[test]
    fn a_buffer_is_registered_once_and_its_entry_goes_with_its_memory() {
        let (cache, live) = fixture();
        let mut buf = AnonMap::new(64 * 1024, None).unwrap();
        buf.fill(1);
        let a = cache.get(buf.addr(), 64 * 1024, fake(&live)).unwrap();
        let b = cache.get(buf.addr() + 100, 50_000, fake(&live)).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the second lookup hits");
        assert_eq!((a.0, a.1), (buf.addr(), 64 * 1024), "page-aligned");
        drop((a, b));
        assert_eq!(live.load(Ordering::SeqCst), 1);
        let at = buf.addr();
        drop(buf); // munmap: the entry goes before munmap returns
        assert_eq!(cache.stats().invalidations, 1);
        settle(&live, 0);
        // New memory at the same address is registered anew.
        let mut again = AnonMap::new(64 * 1024, Some(at)).unwrap();
        again.fill(2);
        let c = cache.get(again.addr(), 4096, fake(&live)).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 1);
        assert_eq!(cache.stats().misses, 2);
        drop(c);
    }

    #[test]
    fn discarded_moved_and_refaulted_memory_drops_its_entries() {
        let (cache, live) = fixture();
        let mut buf = AnonMap::new(16 * 4096, None).unwrap();
        buf.fill(3);
        let whole = cache.get(buf.addr(), 16 * 4096, fake(&live)).unwrap();
        drop(whole);
        // madvise(DONTNEED) of one page: the entry goes, and the page reads as zero (the
        // monitor stopped watching it, so the fault is an ordinary one).
        buf.discard(4 * 4096, 4096).unwrap();
        assert_eq!(buf.byte(4 * 4096), 0);
        assert_eq!(buf.byte(0), 3);
        settle(&live, 0);
        // mremap: the entry of the old address goes. (The whole mapping is cached: the
        // kernel splits a mapping at a watched range's ends, and mremap does not move a
        // range of several.)
        cache.get(buf.addr(), 16 * 4096, fake(&live)).unwrap();
        let old = buf.addr();
        buf.remap(1024 * 4096).unwrap();
        if buf.addr() != old {
            settle(&live, 0);
            assert_eq!(cache.stats().invalidations, 2);
        }
        // A watched page that was never there: the thread that touches it faults, the
        // monitor drops the entry and stops watching, and the thread goes on.
        let fresh = AnonMap::new(8 * 4096, None).unwrap();
        cache.get(fresh.addr(), 8 * 4096, fake(&live)).unwrap();
        assert_eq!(fresh.byte(4096), 0);
        settle(&live, 0);
        assert_eq!(
            cache.get(fresh.addr(), 4096, fake(&live)).map(|r| r.1),
            Ok(4096)
        );
    }

    #[test]
    fn two_caches_watch_shared_pages_until_both_let_go() {
        let m = Monitor::<Arc<Fake>>::start().expect("userfaultfd");
        let (one, two) = (MrCache::new(&m, 16, 1 << 30), MrCache::new(&m, 16, 1 << 30));
        let live = Arc::new(AtomicU64::new(0));
        let mut buf = AnonMap::new(8 * 4096, None).unwrap();
        buf.fill(4);
        drop(one.get(buf.addr(), 8 * 4096, fake(&live)).unwrap());
        drop(two.get(buf.addr() + 4096, 4096, fake(&live)).unwrap());
        drop(one); // its entry leaves; the page `two` caches stays watched
        assert_eq!(live.load(Ordering::SeqCst), 1);
        drop(buf);
        assert_eq!(two.stats().invalidations, 1);
        settle(&live, 0);
    }

    #[test]
    fn a_registration_that_fails_is_tried_once_and_its_error_returned() {
        let (cache, _) = fixture();
        let tries = AtomicU64::new(0);
        let r = cache.get(1 << 20, 4096, |_, _| -> Result<Arc<Fake>, i32> {
            tries.fetch_add(1, Ordering::SeqCst);
            Err(libc::EFAULT)
        });
        assert_eq!(r.map(|_| ()), Err(libc::EFAULT));
        assert_eq!(tries.load(Ordering::SeqCst), 1);
        assert_eq!(cache.stats().misses, 1);
    }

    #[test]
    fn a_stopped_monitor_lets_go_of_everything_and_caches_nothing_more() {
        let (cache, live) = fixture();
        let mut buf = AnonMap::new(8 * 4096, None).unwrap();
        buf.fill(5);
        drop(cache.get(buf.addr(), 8 * 4096, fake(&live)).unwrap());
        assert_eq!(live.load(Ordering::SeqCst), 1);
        let m = cache.monitor.clone();
        m.stop();
        assert!(lock(&m.thread).is_none(), "the thread was joined");
        assert_eq!(live.load(Ordering::SeqCst), 0, "entries deregistered");
        // Nothing is watched: emptying the memory waits for no reader.
        buf.discard(0, 8 * 4096).unwrap();
        drop(cache.get(buf.addr(), 4096, fake(&live)).unwrap());
        assert_eq!(live.load(Ordering::SeqCst), 0, "not cached");
        drop(buf);
        m.stop(); // twice is harmless
    }

    #[test]
    fn memory_the_monitor_cannot_watch_is_registered_for_the_operation_only() {
        let (cache, live) = fixture();
        // A file mapping (the test binary's text): userfaultfd refuses it.
        let text = page_down(settle as fn(&AtomicU64, u64) as usize as u64);
        let r = cache.get(text, 4096, fake(&live)).unwrap();
        assert_eq!(cache.stats().uncached, 1);
        drop(r);
        assert_eq!(live.load(Ordering::SeqCst), 0, "not kept");
        // Larger than the cache: the same.
        let small = MrCache::new(&cache.monitor, 16, 4096);
        let buf = AnonMap::new(2 * 4096, None).unwrap();
        drop(small.get(buf.addr(), 2 * 4096, fake(&live)).unwrap());
        assert_eq!(
            (small.stats().uncached, live.load(Ordering::SeqCst)),
            (1, 0)
        );
    }
}
