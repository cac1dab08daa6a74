//! Address vector tables (`fi_av`): opaque endpoint names mapped to `fi_addr_t` values and to
//! whatever a transport keeps per peer (an address handle, a connection).
//!
//! `FI_AV_TABLE` hands out consecutive indices in insertion order, never reused.
//! `FI_AV_MAP` reuses freed slots, and carries a generation in the top half of each
//! `fi_addr_t`, so an address used after its entry was removed is refused instead of
//! reaching whoever took the slot.

use std::collections::HashMap;

use crate::core::error::{errno, Error, Result};
use crate::core::flags::AvType;

#[derive(Debug)]
struct Entry<T> {
    name: Box<[u8]>,
    data: T,
    generation: u32,
}

/// The most entries an AV holds: a 32-bit index (the top half of a MAP address is its
/// generation).
pub const MAX_COUNT: usize = u32::MAX as usize;
/// Entries made room for at open, at most: the rest as they are inserted.
const PREALLOCATED: usize = 4096;

/// The table behind an address vector.
#[derive(Debug)]
pub struct AvTable<T> {
    map: bool,
    slots: Vec<Option<Entry<T>>>,
    /// Generation of each slot's latest entry (MAP), so stale addresses stay stale.
    generations: Vec<u32>,
    free: Vec<usize>,
    /// Name to address, for turning a message's source back into an `fi_addr_t`.
    by_name: HashMap<Box<[u8]>, u64>,
}

impl<T> AvTable<T> {
    /// A table of `av_type` (`FI_AV_UNSPEC` is `FI_AV_TABLE`) for about `count` entries
    /// (fi_av(3): an estimate; room for more is made as they come). A count past what an
    /// `fi_addr_t`'s 32-bit index holds is `-FI_EINVAL`.
    pub fn new(av_type: AvType, count: usize) -> Result<Self> {
        if count > MAX_COUNT {
            return Err(Error::new(
                errno::EINVAL,
                format!("fi_av_attr.count {count} is more than an AV holds ({MAX_COUNT})"),
            ));
        }
        let pre = count.min(PREALLOCATED);
        Ok(AvTable {
            map: av_type == AvType::Map,
            slots: Vec::with_capacity(pre),
            generations: Vec::with_capacity(pre),
            free: Vec::new(),
            by_name: HashMap::with_capacity(pre),
        })
    }

    /// Inserts `name` with its transport data; returns its address. A name inserted twice
    /// gets two addresses; source lookups give the first.
    pub fn insert(&mut self, name: &[u8], data: T) -> u64 {
        let slot = match self.free.pop().filter(|_| self.map) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                self.slots.len() - 1
            }
        };
        let generation = self.generations[slot];
        self.slots[slot] = Some(Entry {
            name: name.into(),
            data,
            generation,
        });
        let addr = self.encode(slot, generation);
        self.by_name.entry(name.into()).or_insert(addr);
        addr
    }

    fn encode(&self, slot: usize, generation: u32) -> u64 {
        if self.map {
            (u64::from(generation) << 32) | slot as u64
        } else {
            slot as u64
        }
    }

    fn slot(&self, addr: u64) -> Option<usize> {
        self.entry(addr)?;
        self.decode(addr).map(|(slot, _)| slot)
    }

    /// The slot and generation `addr` names. One decoding for both types: a TABLE slot
    /// is never reused, so its entry keeps generation 0, and a TABLE address past 2^32
    /// carries a generation no entry has.
    #[inline(always)]
    fn decode(&self, addr: u64) -> Option<(usize, u32)> {
        Some(((addr & 0xffff_ffff) as usize, (addr >> 32) as u32))
    }

    /// The transport data of `addr`, or `None` for an address not (or no longer) in the table.
    #[inline]
    pub fn get(&self, addr: u64) -> Option<&T> {
        self.entry(addr).map(|e| &e.data)
    }

    /// The entry at `addr`, found with one index (a send's lookup).
    #[inline(always)]
    fn entry(&self, addr: u64) -> Option<&Entry<T>> {
        let (slot, generation) = self.decode(addr)?;
        self.slots
            .get(slot)?
            .as_ref()
            .filter(|e| e.generation == generation)
    }

    /// The name inserted for `addr` (`fi_av_lookup`).
    pub fn name(&self, addr: u64) -> Result<&[u8]> {
        self.entry(addr)
            .map(|e| &e.name[..])
            .ok_or_else(|| bad_addr(addr))
    }

    /// The address a name was inserted at (the first, if several), for `FI_SOURCE`.
    #[inline]
    pub fn find(&self, name: &[u8]) -> Option<u64> {
        self.by_name.get(name).copied()
    }

    /// Removes `addr` (`fi_av_remove`), returning its transport data.
    pub fn remove(&mut self, addr: u64) -> Result<T> {
        let slot = self.slot(addr).ok_or_else(|| bad_addr(addr))?;
        let e = self.slots[slot].take().ok_or_else(|| bad_addr(addr))?;
        if self.by_name.get(&e.name) == Some(&addr) {
            self.by_name.remove(&e.name);
            // Another entry of the same name, if any, answers source lookups from now on.
            if let Some((i, o)) = self
                .slots
                .iter()
                .enumerate()
                .find_map(|(i, o)| o.as_ref().filter(|o| o.name == e.name).map(|o| (i, o)))
            {
                let a = self.encode(i, o.generation);
                self.by_name.insert(e.name.clone(), a);
            }
        }
        self.generations[slot] = self.generations[slot].wrapping_add(1);
        self.free.push(slot);
        Ok(e.data)
    }

    /// Every entry: its address and transport data.
    pub fn entries(&self) -> impl Iterator<Item = (u64, &T)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|e| (self.encode(i, e.generation), &e.data)))
    }

    /// Entries in the table.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn bad_addr(addr: u64) -> Error {
    Error::new(
        errno::EINVAL,
        format!("fi_addr {addr:#x} is not in the address vector (never inserted, or removed)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_count_is_refused_and_a_large_one_is_not_preallocated() {
        let e = AvTable::<()>::new(AvType::Table, 1 << 40).unwrap_err();
        assert_eq!(e.errno(), errno::EINVAL);
        let t = AvTable::<()>::new(AvType::Map, 1 << 31).unwrap();
        assert!(t.slots.capacity() <= PREALLOCATED);
    }

    #[test]
    fn table_addresses_are_consecutive_and_never_reused() {
        let mut t = AvTable::new(AvType::Table, 4).unwrap();
        let a: Vec<u64> = (0..3u8).map(|i| t.insert(&[i; 4], i)).collect();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(t.remove(1).unwrap(), 1);
        assert_eq!(t.insert(&[9; 4], 9), 3, "a removed index is not reused");
        assert!(t.get(1).is_none());
        assert_eq!(t.name(1).unwrap_err().errno(), errno::EINVAL);
        assert_eq!(t.get(2), Some(&2));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn table_addresses_with_high_bits_name_nothing() {
        let mut t = AvTable::new(AvType::Table, 4).unwrap();
        let a = t.insert(b"peer", 7);
        for bad in [a | 1 << 32, a | 1 << 63, u64::MAX, a + 1] {
            assert!(t.get(bad).is_none(), "{bad:#x}");
            assert_eq!(
                t.remove(bad).unwrap_err().errno(),
                errno::EINVAL,
                "{bad:#x}"
            );
        }
        assert_eq!(t.get(a), Some(&7), "the real address still answers");
    }

    #[test]
    fn map_reuses_slots_but_refuses_stale_addresses() {
        let mut t = AvTable::new(AvType::Map, 4).unwrap();
        let a = t.insert(b"peer-a", 'a');
        t.remove(a).unwrap();
        let b = t.insert(b"peer-b", 'b');
        assert_ne!(a, b, "same slot, new generation");
        assert_eq!(a & 0xffff_ffff, b & 0xffff_ffff);
        assert!(
            t.get(a).is_none(),
            "the stale address does not reach the new peer"
        );
        assert_eq!(t.remove(a).unwrap_err().errno(), errno::EINVAL);
        assert_eq!(t.get(b), Some(&'b'));
    }

    #[test]
    fn names_map_back_to_addresses_for_source_lookups() {
        let mut t = AvTable::new(AvType::Table, 0).unwrap();
        let a = t.insert(b"x", 1);
        let b = t.insert(b"y", 2);
        let a2 = t.insert(b"x", 3);
        assert_eq!(
            (t.find(b"x"), t.find(b"y"), t.find(b"z")),
            (Some(a), Some(b), None)
        );
        assert_eq!(t.name(b).unwrap(), b"y");
        t.remove(a).unwrap();
        assert_eq!(
            t.find(b"x"),
            Some(a2),
            "the other entry of the name takes over"
        );
        t.remove(a2).unwrap();
        assert_eq!(t.find(b"x"), None);
    }
}
