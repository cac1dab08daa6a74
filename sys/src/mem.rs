//! Application memory the provider writes into after the call that named it returns: a
//! C buffer given to a receive, which fi_msg(3) keeps valid until the receive completes.

use std::ptr;

use crate::verbs::MemoryRegion;

/// A writable buffer of the application's, trusted by the contract of the call that gave
/// it (see [`ForeignBuf::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignBuf {
    addr: usize,
    len: usize,
}

impl ForeignBuf {
    /// # Safety
    /// `addr..addr+len` must be writable memory that stays valid until the provider is done
    /// with it (the receive completed or was cancelled), and nothing else may rely on its
    /// contents meanwhile: the contract fi_msg(3) and fi_tagged(3) place on receive buffers.
    pub unsafe fn new(addr: *mut u8, len: usize) -> Self {
        ForeignBuf {
            addr: addr as usize,
            len,
        }
    }

    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to `offset`; `EINVAL` past the end.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), i32> {
        let end = offset.checked_add(src.len()).ok_or(libc::EINVAL)?;
        if end > self.len {
            return Err(libc::EINVAL);
        }
        // SAFETY: in bounds; the memory is valid and ours to write by `new`'s contract.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), (self.addr as *mut u8).add(offset), src.len())
        };
        Ok(())
    }
}

/// Where a copy out of a registered region goes.
#[derive(Clone, Copy, Debug)]
pub enum CopyTarget<'a> {
    Region(&'a MemoryRegion, usize),
    Foreign(&'a ForeignBuf, usize),
}

/// Copies `len` bytes at `offset` of `src` to `dst`, with no bounce in between; `EINVAL`
/// when either range leaves its memory.
pub fn copy_out(
    src: &MemoryRegion,
    offset: usize,
    len: usize,
    dst: CopyTarget<'_>,
) -> Result<(), i32> {
    src.sge(offset, len).ok_or(libc::EINVAL)?;
    let to = match dst {
        CopyTarget::Region(mr, off) => {
            mr.sge(off, len).ok_or(libc::EINVAL)?;
            (mr.addr() as usize + off) as *mut u8
        }
        CopyTarget::Foreign(f, off) => {
            if off.checked_add(len).is_none_or(|e| e > f.len) {
                return Err(libc::EINVAL);
            }
            (f.addr + off) as *mut u8
        }
    };
    // SAFETY: both ranges checked above; region memory is valid for the region's life and
    // foreign memory by ForeignBuf's contract; `copy` allows overlap, which two views of
    // one application buffer could have.
    unsafe { ptr::copy((src.addr() as usize + offset) as *const u8, to, len) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_writes_stay_in_bounds() {
        let mut v = vec![0u8; 8];
        // SAFETY: v outlives f and is not read until f is done.
        let f = unsafe { ForeignBuf::new(v.as_mut_ptr(), v.len()) };
        assert_eq!(f.write_at(6, b"abc"), Err(libc::EINVAL));
        assert_eq!(f.write_at(usize::MAX, b"a"), Err(libc::EINVAL));
        f.write_at(5, b"abc").unwrap();
        assert_eq!(&v[5..], b"abc");
    }
}
