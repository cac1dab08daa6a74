//! Reading other providers' ops tables: a table is as long as its `size` says, and a
//! provider built against an older libfabric has fewer slots than 1.17's headers show.

/// Whether a provider's ops table of `size` bytes has the slot at `offset`.
pub(crate) fn has_slot(size: usize, offset: usize) -> bool {
    offset
        .checked_add(std::mem::size_of::<usize>())
        .is_some_and(|end| size >= end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_there_only_when_the_table_is_long_enough() {
        assert!(has_slot(16, 8));
        assert!(!has_slot(15, 8));
        assert!(!has_slot(0, 0));
        assert!(!has_slot(usize::MAX, usize::MAX));
    }
}
