//! Completion queue entries and the software queue behind a CQ (`fi_cq(3)`).
//!
//! Transports with a hardware queue translate straight into the caller's buffer; what must
//! be staged (errors and everything polled after them, software completions) waits here,
//! ahead of the hardware queue, so order is kept.

use std::collections::VecDeque;

use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;

/// A completion, laid out as `struct fi_cq_tagged_entry` (the widest successful format).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqEntry {
    pub op_context: u64,
    pub flags: u64,
    pub len: usize,
    pub buf: u64,
    pub data: u64,
    pub tag: u64,
}

impl CqEntry {
    pub fn flags(&self) -> Flags {
        Flags::from_bits_retain(self.flags)
    }
}

/// An error completion (`struct fi_cq_err_entry`), with owned error data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CqErrEntry {
    pub op_context: u64,
    pub flags: u64,
    pub len: usize,
    pub buf: u64,
    pub data: u64,
    pub tag: u64,
    /// Bytes that did not fit a truncated receive.
    pub olen: usize,
    /// Positive libfabric errno.
    pub err: i32,
    /// Provider errno: the `ibv_wc_status` for verbs completions.
    pub prov_errno: i32,
    pub err_data: Vec<u8>,
}

#[derive(Debug)]
enum Staged {
    Entry(CqEntry),
    Error(CqErrEntry),
}

/// The software part of a CQ. Bounded; an overflow puts it in the overrun state.
#[derive(Debug)]
pub struct CqState {
    q: VecDeque<Staged>,
    capacity: usize,
    overrun: bool,
}

impl CqState {
    pub fn new(capacity: usize) -> Self {
        CqState {
            q: VecDeque::with_capacity(capacity.min(4096)),
            capacity: capacity.max(1),
            overrun: false,
        }
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    pub fn is_overrun(&self) -> bool {
        self.overrun
    }

    fn push(&mut self, s: Staged) -> Result<()> {
        if self.q.len() >= self.capacity {
            self.overrun = true;
            return Err(Error::new(
                errno::EOVERRUN,
                "completion queue overrun: size the CQ for every outstanding operation",
            ));
        }
        self.q.push_back(s);
        Ok(())
    }

    pub fn push_entry(&mut self, e: CqEntry) -> Result<()> {
        self.push(Staged::Entry(e))
    }

    pub fn push_error(&mut self, e: CqErrEntry) -> Result<()> {
        self.push(Staged::Error(e))
    }

    /// Moves staged successful completions into `out` up to the first error entry.
    /// `Ok(0)` when nothing is staged; `EAVAIL` when an error entry is at the head.
    pub fn read_into(&mut self, out: &mut [CqEntry]) -> Result<usize> {
        let mut n = 0;
        while n < out.len() {
            match self.q.front() {
                Some(Staged::Entry(e)) => {
                    out[n] = *e;
                    self.q.pop_front();
                    n += 1;
                }
                Some(Staged::Error(_)) if n == 0 => {
                    return Err(Error::new(
                        errno::EAVAIL,
                        "an error completion is at the head: read it with readerr",
                    ));
                }
                _ => break,
            }
        }
        if n == 0 && self.overrun {
            return Err(Error::new(
                errno::EOVERRUN,
                "completion queue overrun: completions were lost",
            ));
        }
        Ok(n)
    }

    /// Removes the head error entry, if the head is one.
    pub fn readerr(&mut self) -> Option<CqErrEntry> {
        if matches!(self.q.front(), Some(Staged::Error(_))) {
            if let Some(Staged::Error(e)) = self.q.pop_front() {
                return Some(e);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfabric_sys::fabric::fi_cq_tagged_entry;
    use std::mem::{offset_of, size_of};

    #[test]
    fn entry_is_laid_out_as_fi_cq_tagged_entry() {
        assert_eq!(size_of::<CqEntry>(), size_of::<fi_cq_tagged_entry>());
        assert_eq!(
            offset_of!(CqEntry, flags),
            offset_of!(fi_cq_tagged_entry, flags)
        );
        assert_eq!(
            offset_of!(CqEntry, len),
            offset_of!(fi_cq_tagged_entry, len)
        );
        assert_eq!(
            offset_of!(CqEntry, buf),
            offset_of!(fi_cq_tagged_entry, buf)
        );
        assert_eq!(
            offset_of!(CqEntry, data),
            offset_of!(fi_cq_tagged_entry, data)
        );
        assert_eq!(
            offset_of!(CqEntry, tag),
            offset_of!(fi_cq_tagged_entry, tag)
        );
    }

    fn ok(ctx: u64) -> CqEntry {
        CqEntry {
            op_context: ctx,
            flags: (Flags::MSG | Flags::RECV).bits(),
            len: 8,
            ..Default::default()
        }
    }

    fn bad(ctx: u64) -> CqErrEntry {
        CqErrEntry {
            op_context: ctx,
            err: errno::ECANCELED,
            prov_errno: 5,
            ..Default::default()
        }
    }

    #[test]
    fn reads_stop_at_an_error_and_resume_after_readerr() {
        let mut s = CqState::new(8);
        s.push_entry(ok(1)).unwrap();
        s.push_entry(ok(2)).unwrap();
        s.push_error(bad(3)).unwrap();
        s.push_entry(ok(4)).unwrap();
        let mut out = [CqEntry::default(); 4];
        assert_eq!(s.read_into(&mut out).unwrap(), 2);
        assert_eq!((out[0].op_context, out[1].op_context), (1, 2));
        assert_eq!(s.read_into(&mut out).unwrap_err().errno(), errno::EAVAIL);
        assert_eq!(s.readerr().unwrap().op_context, 3);
        assert!(s.readerr().is_none());
        assert_eq!(s.read_into(&mut out).unwrap(), 1);
        assert_eq!(out[0].op_context, 4);
        assert_eq!(s.read_into(&mut out).unwrap(), 0);
    }

    #[test]
    fn reads_fill_at_most_the_callers_buffer() {
        let mut s = CqState::new(8);
        for i in 0..5 {
            s.push_entry(ok(i)).unwrap();
        }
        let mut out = [CqEntry::default(); 3];
        assert_eq!(s.read_into(&mut out).unwrap(), 3);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn overflow_enters_the_overrun_state() {
        let mut s = CqState::new(1);
        s.push_entry(ok(1)).unwrap();
        assert_eq!(s.push_entry(ok(2)).unwrap_err().errno(), errno::EOVERRUN);
        assert!(s.is_overrun());
        let mut out = [CqEntry::default(); 2];
        assert_eq!(s.read_into(&mut out).unwrap(), 1);
        assert_eq!(s.read_into(&mut out).unwrap_err().errno(), errno::EOVERRUN);
    }
}
