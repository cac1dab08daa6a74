//! Application memory the provider writes into after the call that named it returns: a
//! C buffer given to a receive, which fi_msg(3) keeps valid until the receive completes.

use std::ptr;

use crate::verbs::MemoryRegion;

/// A buffer of the application's, trusted by the contract of the call that gave it (see
/// [`ForeignBuf::new`]): a receive's (written) or a large send's (read, or registered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignBuf {
    addr: usize,
    len: usize,
}

impl ForeignBuf {
    /// No bytes: valid for any operation.
    pub const EMPTY: ForeignBuf = ForeignBuf { addr: 0, len: 0 };

    /// # Safety
    /// `addr..addr+len` must be memory that stays valid until the provider is done with it
    /// (the operation completed or was cancelled): writable, with nothing else relying on
    /// its contents meanwhile, for a receive; readable, and unchanged meanwhile, for a send.
    /// The contract fi_msg(3) and fi_tagged(3) place on the buffers of both.
    pub unsafe fn new(addr: *mut u8, len: usize) -> Self {
        ForeignBuf {
            addr: addr as usize,
            len,
        }
    }

    /// A buffer that lives for the rest of the process (leaked, and borrowed by nothing
    /// else): valid for any operation, so no contract is left to the caller.
    pub fn from_static(buf: &'static mut [u8]) -> Self {
        ForeignBuf {
            addr: buf.as_mut_ptr() as usize,
            len: buf.len(),
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

    /// `len` bytes at `offset` of this buffer, if inside it (the same contract holds).
    pub fn slice(&self, offset: usize, len: usize) -> Option<ForeignBuf> {
        offset
            .checked_add(len)
            .filter(|e| *e <= self.len)
            .map(|_| ForeignBuf {
                addr: self.addr + offset,
                len,
            })
    }

    /// Copies `src` to `offset`; `EINVAL` past the end.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), i32> {
        let end = offset.checked_add(src.len()).ok_or(libc::EINVAL)?;
        if end > self.len {
            return Err(libc::EINVAL);
        }
        // SAFETY: in bounds; the memory is valid and ours to write by `new`'s contract.
        unsafe { copy_bytes(src.as_ptr(), (self.addr as *mut u8).add(offset), src.len()) };
        Ok(())
    }
}

/// The largest piece a copy hands glibc at once: its `rep movsb` threshold on the CI guest
/// (`ld.so --list-tunables`). glibc copies more than that with `rep movsb`, which QEMU under
/// TCG, where the device tests and benchmarks run, executes several times slower than the
/// vector loop it uses up to the threshold (16 KiB: 35 µs against 8 µs in the guest); on
/// hardware a piece costs one more call per 8 KiB.
const COPY_PIECE: usize = 8192;

/// `ptr::copy` (the ranges may overlap) of `len` bytes, in pieces of at most
/// [`COPY_PIECE`].
///
/// # Safety
/// As `ptr::copy`: `from` readable and `to` writable for `len` bytes.
#[inline(always)]
pub(crate) unsafe fn copy_bytes(from: *const u8, to: *mut u8, len: usize) {
    if len <= SMALL_COPY {
        // SAFETY: the caller's contract.
        unsafe { copy_small(from, to, len) }
    } else if len <= COPY_PIECE {
        // SAFETY: the caller's contract.
        unsafe { ptr::copy(from, to, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_in_pieces(from, to, len) }
    }
}

/// Copies up to this many bytes inline (`copy_small`) rather than through glibc, whose
/// call and AVX path cost more than the copy under TCG (2 B: 28 ns against 6 for two
/// moves, `scripts/tcg-costs.c`); small messages are most of a latency test's copies.
const SMALL_COPY: usize = 64;

/// [`copy_bytes`] of at most [`SMALL_COPY`] bytes, in the two overlapping moves of the
/// widest kind that fits (`ends`).
///
/// # Safety
/// As [`copy_bytes`].
#[inline(always)]
unsafe fn copy_small(from: *const u8, to: *mut u8, len: usize) {
    // SAFETY: in every arm the range of `len` gives `size_of::<T>() <= len <= 2 *
    // size_of::<T>()`, what `ends::<T>` needs; the memory is the caller's.
    unsafe {
        match len {
            0 => {}
            1 => ends::<u8>(from, to, len),
            2..=3 => ends::<u16>(from, to, len),
            4..=7 => ends::<u32>(from, to, len),
            8..=16 => ends::<u64>(from, to, len),
            17..=32 => ends::<u128>(from, to, len),
            33..=SMALL_COPY => ends::<[u128; 2]>(from, to, len),
            _ => ptr::copy(from, to, len),
        }
    }
}

/// Copies the first and the last `size_of::<T>()` of `len` bytes, which together cover all
/// of them: both are loaded before either is stored, so overlapping ranges copy as
/// `ptr::copy` does.
///
/// # Safety
/// `size_of::<T>() <= len <= 2 * size_of::<T>()`, and the ranges as for [`copy_bytes`].
#[inline(always)]
unsafe fn ends<T: Copy>(from: *const u8, to: *mut u8, len: usize) {
    let k = std::mem::size_of::<T>();
    // SAFETY: both moves lie in the first and last `k <= len` bytes of each range.
    unsafe {
        let head = ptr::read_unaligned(from as *const T);
        let tail = ptr::read_unaligned(from.add(len - k) as *const T);
        ptr::write_unaligned(to as *mut T, head);
        ptr::write_unaligned(to.add(len - k) as *mut T, tail);
    }
}

/// [`copy_bytes`] past one piece: forwards, or from the end when `to` lies inside the
/// source above `from`, so that no piece overwrites source bytes not yet copied.
///
/// # Safety
/// As [`copy_bytes`].
#[inline(never)]
unsafe fn copy_in_pieces(from: *const u8, to: *mut u8, len: usize) {
    let backwards = (to as usize) > (from as usize) && (to as usize) - (from as usize) < len;
    let mut done = 0;
    while done < len {
        let k = (len - done).min(COPY_PIECE);
        let at = if backwards { len - done - k } else { done };
        // SAFETY: `at + k <= len`, inside both ranges by the caller's contract; each piece
        // may overlap itself, which `ptr::copy` allows.
        unsafe { ptr::copy(from.add(at), to.add(at), k) };
        done += k;
    }
}

/// One end of a copy: a place in a registered region, or in an application's buffer.
#[derive(Clone, Copy, Debug)]
pub enum Place<'a> {
    Region(&'a MemoryRegion, usize),
    Foreign(&'a ForeignBuf, usize),
}

impl Place<'_> {
    /// The address of `len` bytes here, if they lie inside the memory (inlined: a small
    /// copy's two checks cost less than the calls to them).
    #[inline(always)]
    fn range(&self, len: usize) -> Option<usize> {
        match *self {
            Place::Region(mr, off) => mr.sge(off, len).map(|s| s.addr as usize),
            Place::Foreign(f, off) => off
                .checked_add(len)
                .filter(|e| *e <= f.len)
                .map(|_| f.addr + off),
        }
    }
}

/// Copies `len` bytes from `src` to `dst`, with no bounce in between; `EINVAL` when either
/// range leaves its memory.
#[inline]
pub fn copy(src: Place<'_>, dst: Place<'_>, len: usize) -> Result<(), i32> {
    let (from, to) = (
        src.range(len).ok_or(libc::EINVAL)?,
        dst.range(len).ok_or(libc::EINVAL)?,
    );
    if len == 0 {
        return Ok(());
    }
    // SAFETY: both ranges checked above; region memory is valid for the region's life and
    // foreign memory by ForeignBuf's contract; `copy` allows overlap, which two views of
    // one application buffer could have.
    unsafe { copy_bytes(from as *const u8, to as *mut u8, len) };
    Ok(())
}

/// Copies `src` (provider memory, such as a message set aside) to `dst`.
pub fn copy_in(src: &[u8], dst: Place<'_>) -> Result<(), i32> {
    let to = dst.range(src.len()).ok_or(libc::EINVAL)?;
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: the range was checked above and is valid as in `copy`; `src` is a Rust slice,
    // which no application buffer aliases mutably while we hold it.
    unsafe { copy_bytes(src.as_ptr(), to as *mut u8, src.len()) };
    Ok(())
}

/// Appends `len` bytes at `src` to `dst` (provider memory setting a message aside), without
/// zeroing the room first.
pub fn append_from(src: Place<'_>, len: usize, dst: &mut Vec<u8>) -> Result<(), i32> {
    let from = src.range(len).ok_or(libc::EINVAL)?;
    dst.try_reserve(len).map_err(|_| libc::ENOMEM)?;
    if len == 0 {
        return Ok(());
    }
    let at = dst.len();
    // SAFETY: the source range was checked above; `try_reserve` made room for `len` more
    // bytes, all of which the copy initializes before `set_len` exposes them.
    unsafe {
        copy_bytes(from as *const u8, dst.as_mut_ptr().add(at), len);
        dst.set_len(at + len);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_copies_match_ptr_copy_with_overlap() {
        // Every length up to past SMALL_COPY, forwards and backwards overlap and apart.
        for len in 0..=SMALL_COPY + 8 {
            for shift in [-9isize, -1, 0, 1, 7, 100] {
                let mut a: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
                let mut b = a.clone();
                let from = 120usize;
                let to = (from as isize + shift) as usize;
                // SAFETY: both ranges lie inside the 300-byte vectors.
                unsafe {
                    copy_bytes(a.as_ptr().add(from), a.as_mut_ptr().add(to), len);
                    ptr::copy(b.as_ptr().add(from), b.as_mut_ptr().add(to), len);
                }
                assert_eq!(a, b, "len {len} shift {shift}");
            }
        }
    }

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

    #[test]
    fn appends_and_copies_in_stay_in_bounds() {
        let mut v = *b"0123456789";
        // SAFETY: v outlives f and is only read after f's last use.
        let f = unsafe { ForeignBuf::new(v.as_mut_ptr(), v.len()) };
        let mut out = b"ab".to_vec();
        append_from(Place::Foreign(&f, 7), 3, &mut out).unwrap();
        assert_eq!(out, b"ab789");
        assert_eq!(
            append_from(Place::Foreign(&f, 8), 3, &mut out),
            Err(libc::EINVAL)
        );
        assert_eq!(out, b"ab789", "nothing appended on error");
        copy_in(b"xy", Place::Foreign(&f, 8)).unwrap();
        assert_eq!(copy_in(b"xyz", Place::Foreign(&f, 8)), Err(libc::EINVAL));
        assert_eq!(&v, b"01234567xy");
    }

    #[test]
    fn copies_in_pieces_match_memmove_whatever_the_overlap() {
        // Lengths around the piece, and sources and targets overlapping both ways.
        let n = 4 * COPY_PIECE + 64;
        let pattern: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [
            0,
            1,
            COPY_PIECE - 1,
            COPY_PIECE,
            COPY_PIECE + 1,
            3 * COPY_PIECE + 17,
        ] {
            for (src, dst) in [
                (0, 2 * COPY_PIECE),
                (0, 1),
                (1, 0),
                (5, 4 * COPY_PIECE + 64 - len),
                (3 * 17, 3 * 17),
            ] {
                if src + len > n || dst + len > n {
                    continue;
                }
                let mut want = pattern.clone();
                want.copy_within(src..src + len, dst);
                let mut got = pattern.clone();
                let p = got.as_mut_ptr();
                // SAFETY: both ranges lie inside `got`, checked above.
                unsafe { copy_bytes(p.add(src), p.add(dst), len) };
                assert!(got == want, "len {len}, from {src} to {dst}");
            }
        }
    }
}
