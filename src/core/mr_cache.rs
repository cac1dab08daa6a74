//! The bookkeeping of a memory registration cache (no I/O): registrations of application
//! memory kept after the operation that made them, so the next operation on the same
//! buffer finds one instead of registering again (two system calls and a page walk).
//!
//! Cached ranges are page-aligned and disjoint: a registration that overlaps cached ones
//! covers them all and replaces them. Past a count or byte limit, the least recently used
//! go. A memory monitor must watch every cached range, and must drop an entry the moment
//! its memory is unmapped, emptied or moved ([`RegCache::invalidate`]), so an entry never
//! outlives the memory it describes. Several caches (one per domain) share the monitor and
//! may cache the same pages, so what it watches is counted ([`Coverage`]).

use std::collections::BTreeMap;

/// What a cache has done, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups a cached registration served.
    pub hits: u64,
    /// Lookups that had to register.
    pub misses: u64,
    /// Registrations made but not cached (the monitor could not watch the memory, or it
    /// changed while they were made, or the cache is off).
    pub uncached: u64,
    /// Entries dropped for the limits.
    pub evictions: u64,
    /// Entries dropped because their memory went (unmapped, emptied, moved).
    pub invalidations: u64,
}

#[derive(Debug)]
struct Entry<R> {
    end: u64,
    tick: u64,
    reg: R,
}

/// A range that left the cache, with its registration.
pub type Removed<R> = (u64, u64, R);

/// Cached registrations of one domain, by address range.
#[derive(Debug)]
pub struct RegCache<R> {
    /// By start; disjoint.
    entries: BTreeMap<u64, Entry<R>>,
    /// Start of each entry by last use.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    bytes: u64,
    max_count: usize,
    max_bytes: u64,
    stats: CacheStats,
}

impl<R: Clone> RegCache<R> {
    /// A cache of at most `max_count` entries and `max_bytes` bytes (either 0: off).
    pub fn new(max_count: usize, max_bytes: u64) -> Self {
        RegCache {
            entries: BTreeMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            max_count,
            max_bytes,
            stats: CacheStats::default(),
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a registration of `len` bytes may be cached at all.
    pub fn fits(&self, len: u64) -> bool {
        self.max_count > 0 && len <= self.max_bytes
    }

    /// The registration that covers `start..end`, if one is cached (a hit makes it the most
    /// recently used); a miss is counted.
    pub fn lookup(&mut self, start: u64, end: u64) -> Option<R> {
        let found = match self.entries.range_mut(..=start).next_back() {
            Some((&s, e)) if e.end >= end => {
                self.lru.remove(&e.tick);
                self.tick += 1;
                e.tick = self.tick;
                self.lru.insert(self.tick, s);
                Some(e.reg.clone())
            }
            _ => None,
        };
        match found {
            Some(_) => self.stats.hits += 1,
            None => self.stats.misses += 1,
        }
        found
    }

    /// The range a registration for `start..end` (page-aligned) should cover: it joined
    /// with the cached ranges it overlaps, which it will replace.
    pub fn span(&self, start: u64, end: u64) -> (u64, u64) {
        let (mut s, mut e) = (start, end);
        for (&a, en) in self.overlapping(start, end) {
            s = s.min(a);
            e = e.max(en.end);
        }
        (s, e)
    }

    fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = (&u64, &Entry<R>)> {
        let before = self
            .entries
            .range(..start)
            .next_back()
            .filter(|(_, e)| e.end > start);
        before.into_iter().chain(self.entries.range(start..end))
    }

    fn take(&mut self, start: u64) -> Option<Removed<R>> {
        let e = self.entries.remove(&start)?;
        self.lru.remove(&e.tick);
        self.bytes -= e.end - start;
        Some((start, e.end, e.reg))
    }

    /// Caches `reg` for `start..end`. Cached ranges it overlaps leave (replaced), then the
    /// least recently used others while the limits are passed. Returns what left, whose
    /// ranges the monitor no longer needs to watch for this cache.
    pub fn insert(&mut self, start: u64, end: u64, reg: R) -> Vec<Removed<R>> {
        let overlapped: Vec<u64> = self.overlapping(start, end).map(|(&s, _)| s).collect();
        let mut out: Vec<_> = overlapped
            .into_iter()
            .filter_map(|s| self.take(s))
            .collect();
        self.tick += 1;
        self.entries.insert(
            start,
            Entry {
                end,
                tick: self.tick,
                reg,
            },
        );
        self.lru.insert(self.tick, start);
        self.bytes += end - start;
        while self.entries.len() > self.max_count.max(1) || self.bytes > self.max_bytes {
            let Some((_, &oldest)) = self.lru.iter().next() else {
                break;
            };
            if oldest == start {
                break; // the new entry alone passes the limits: callers check `fits` first
            }
            out.extend(self.take(oldest));
            self.stats.evictions += 1;
        }
        out
    }

    /// Drops every entry overlapping `start..end`, whose memory went.
    pub fn invalidate(&mut self, start: u64, end: u64) -> Vec<Removed<R>> {
        let hit: Vec<u64> = self.overlapping(start, end).map(|(&s, _)| s).collect();
        let out: Vec<_> = hit.into_iter().filter_map(|s| self.take(s)).collect();
        self.stats.invalidations += out.len() as u64;
        out
    }

    /// Drops every entry (the domain closes, or registration ran out of lockable memory).
    pub fn clear(&mut self) -> Vec<Removed<R>> {
        let all: Vec<u64> = self.entries.keys().copied().collect();
        all.into_iter().filter_map(|s| self.take(s)).collect()
    }

    /// Counts a registration made and not cached.
    pub fn count_uncached(&mut self) {
        self.stats.uncached += 1;
    }
}

/// How many cached ranges cover each address, as disjoint segments: what the monitor
/// watches (a segment is watched while its count is above 0).
#[derive(Debug, Default)]
pub struct Coverage {
    /// start → (end, count).
    segs: BTreeMap<u64, (u64, u32)>,
}

impl Coverage {
    /// Splits the segment across `at`, if one does.
    fn split(&mut self, at: u64) {
        let Some((&s, &(e, c))) = self.segs.range(..at).next_back() else {
            return;
        };
        if e > at {
            self.segs.insert(s, (at, c));
            self.segs.insert(at, (e, c));
        }
    }

    /// Counts `start..end` once more; returns the pieces it newly covers (to watch).
    pub fn add(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if start >= end {
            return vec![];
        }
        self.split(start);
        self.split(end);
        let mut gaps = vec![];
        let mut at = start;
        for (&s, seg) in self.segs.range_mut(start..end) {
            if s > at {
                gaps.push((at, s));
            }
            seg.1 += 1;
            at = seg.0;
        }
        if at < end {
            gaps.push((at, end));
        }
        for &(s, e) in &gaps {
            self.segs.insert(s, (e, 1));
        }
        gaps
    }

    /// Counts `start..end` once less (it was added); returns the pieces no longer covered
    /// (to stop watching), adjacent ones joined.
    pub fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if start >= end {
            return vec![];
        }
        self.split(start);
        self.split(end);
        let mut freed: Vec<(u64, u64)> = vec![];
        let keys: Vec<u64> = self.segs.range(start..end).map(|(&s, _)| s).collect();
        for s in keys {
            let Some(seg) = self.segs.get_mut(&s) else {
                continue;
            };
            seg.1 = seg.1.saturating_sub(1);
            if seg.1 == 0 {
                let e = seg.0;
                self.segs.remove(&s);
                match freed.last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => freed.push((s, e)),
                }
            }
        }
        freed
    }

    /// Whether any cached range covers `addr`.
    #[cfg(test)]
    fn covers(&self, addr: u64) -> bool {
        self.segs
            .range(..=addr)
            .next_back()
            .is_some_and(|(_, &(e, c))| e > addr && c > 0)
    }

    /// Segments kept (the map does not grow without bound).
    #[cfg(test)]
    fn segments(&self) -> usize {
        self.segs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    #[test]
    fn a_lookup_inside_a_cached_range_hits_and_one_past_it_misses() {
        let mut c = RegCache::new(8, 1 << 30);
        assert!(c.insert(P, 4 * P, "a").is_empty());
        assert_eq!(c.lookup(P + 100, 2 * P), Some("a"));
        assert_eq!(c.lookup(P, 4 * P), Some("a"));
        assert_eq!(c.lookup(3 * P, 4 * P + 1), None);
        assert_eq!(c.lookup(0, P + 1), None);
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (2, 2));
    }

    #[test]
    fn an_overlapping_registration_spans_and_replaces_the_ranges_it_overlaps() {
        let mut c = RegCache::new(8, 1 << 30);
        c.insert(0, 2 * P, "a");
        c.insert(5 * P, 6 * P, "b");
        c.insert(9 * P, 10 * P, "far");
        assert_eq!(c.span(P, 5 * P + 1), (0, 6 * P));
        assert_eq!(
            c.span(2 * P, 5 * P),
            (2 * P, 5 * P),
            "touching is not overlapping"
        );
        let gone = c.insert(0, 6 * P, "ab");
        assert_eq!(gone, vec![(0, 2 * P, "a"), (5 * P, 6 * P, "b")]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup(P, 5 * P), Some("ab"));
    }

    #[test]
    fn the_least_recently_used_leave_past_the_count_or_byte_limit() {
        let mut c = RegCache::new(2, 3 * P);
        c.insert(0, P, "a");
        c.insert(2 * P, 3 * P, "b");
        c.lookup(0, 1); // a is now the most recent
        assert_eq!(c.insert(4 * P, 5 * P, "c"), vec![(2 * P, 3 * P, "b")]);
        assert_eq!(
            c.insert(8 * P, 10 * P, "d"),
            vec![(0, P, "a")],
            "bytes: 3 pages"
        );
        assert_eq!(c.len(), 2);
        assert_eq!(c.stats().evictions, 2);
        assert!(!c.fits(4 * P));
        assert!(!RegCache::<u8>::new(0, 1 << 30).fits(P), "count 0: off");
    }

    #[test]
    fn invalidation_drops_every_entry_the_range_touches_and_no_other() {
        let mut c = RegCache::new(8, 1 << 30);
        c.insert(0, 2 * P, "a");
        c.insert(2 * P, 4 * P, "b");
        c.insert(6 * P, 8 * P, "c");
        let gone = c.invalidate(P + 5, 2 * P + 1);
        assert_eq!(gone, vec![(0, 2 * P, "a"), (2 * P, 4 * P, "b")]);
        assert!(c.invalidate(4 * P, 6 * P).is_empty());
        assert_eq!(c.lookup(6 * P, 8 * P), Some("c"));
        assert_eq!(c.stats().invalidations, 2);
        assert_eq!(c.clear().len(), 1);
        assert!(c.is_empty());
    }

    #[test]
    fn coverage_watches_a_page_while_any_range_covers_it() {
        let mut v = Coverage::default();
        assert_eq!(v.add(0, 4 * P), vec![(0, 4 * P)]);
        assert_eq!(v.add(2 * P, 6 * P), vec![(4 * P, 6 * P)]);
        assert_eq!(v.add(P, 2 * P), vec![]);
        assert_eq!(v.remove(0, 4 * P), vec![(0, P)]);
        assert!(v.covers(P) && v.covers(5 * P) && !v.covers(0));
        assert_eq!(v.remove(2 * P, 6 * P), vec![(2 * P, 6 * P)]);
        assert_eq!(v.remove(P, 2 * P), vec![(P, 2 * P)]);
        assert_eq!(v.segments(), 0);
        assert!(!v.covers(P));
    }
}
