//! Completion queue entries and the software queue behind a CQ (`fi_cq(3)`).
//!
//! Transports with a hardware queue translate straight into the caller's buffer; what must
//! be staged (errors and everything polled after them, software completions) waits here,
//! ahead of the hardware queue, so order is kept.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::core::error::{errno, Error, Result};
use crate::core::flags::{CqFormat, Flags};

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

/// `struct fi_cq_entry` (`FI_CQ_FORMAT_CONTEXT`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqContextEntry {
    pub op_context: u64,
}

/// `struct fi_cq_msg_entry` (`FI_CQ_FORMAT_MSG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqMsgEntry {
    pub op_context: u64,
    pub flags: u64,
    pub len: usize,
}

/// `struct fi_cq_data_entry` (`FI_CQ_FORMAT_DATA`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqDataEntry {
    pub op_context: u64,
    pub flags: u64,
    pub len: usize,
    pub buf: u64,
    pub data: u64,
}

/// An entry type of one CQ format: what a read writes into the caller's array.
pub trait FormatEntry: Copy + Default {
    const FORMAT: CqFormat;
    /// The fields of this format, taken from the widest one.
    fn from_tagged(e: &CqEntry) -> Self;
}

impl FormatEntry for CqContextEntry {
    const FORMAT: CqFormat = CqFormat::Context;
    #[inline(always)]
    fn from_tagged(e: &CqEntry) -> Self {
        CqContextEntry {
            op_context: e.op_context,
        }
    }
}

impl FormatEntry for CqMsgEntry {
    const FORMAT: CqFormat = CqFormat::Msg;
    #[inline(always)]
    fn from_tagged(e: &CqEntry) -> Self {
        CqMsgEntry {
            op_context: e.op_context,
            flags: e.flags,
            len: e.len,
        }
    }
}

impl FormatEntry for CqDataEntry {
    const FORMAT: CqFormat = CqFormat::Data;
    #[inline(always)]
    fn from_tagged(e: &CqEntry) -> Self {
        CqDataEntry {
            op_context: e.op_context,
            flags: e.flags,
            len: e.len,
            buf: e.buf,
            data: e.data,
        }
    }
}

impl FormatEntry for CqEntry {
    const FORMAT: CqFormat = CqFormat::Tagged;
    #[inline(always)]
    fn from_tagged(e: &CqEntry) -> Self {
        *e
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
    /// A completion and its source address (`FI_ADDR_NOTAVAIL` when unknown).
    Entry(CqEntry, u64),
    /// Boxed: errors are rare, and every entry's move is the size of the largest kind.
    Error(Box<CqErrEntry>),
}

/// The software part of a CQ. Bounded; an overflow puts it in the overrun state.
#[derive(Debug)]
pub struct CqState {
    q: VecDeque<Staged>,
    capacity: usize,
    overrun: bool,
    /// Error data of the last error read with a zero `err_data_size`: the provider keeps
    /// it valid until the next read (`fi_cq_readerr(3)`).
    held_err_data: Vec<u8>,
}

impl CqState {
    pub fn new(capacity: usize) -> Self {
        CqState {
            // Grows as entries are staged (a cold path), so an idle CQ holds no memory here.
            q: VecDeque::new(),
            capacity: capacity.max(1),
            overrun: false,
            held_err_data: Vec::new(),
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

    /// Enters the overrun state from outside (the device dropped completions).
    pub fn mark_overrun(&mut self) {
        self.overrun = true;
    }

    /// What a read has to look at: the staged entries, plus one for an overrun to report
    /// (so the fast path, which skips an empty queue, still reaches it).
    pub fn pending(&self) -> usize {
        self.q.len() + usize::from(self.overrun)
    }

    /// Entries that can still be staged before the queue overruns.
    pub fn room(&self) -> usize {
        self.capacity.saturating_sub(self.q.len())
    }

    /// Lets the queue hold `capacity` entries, when that is more than it holds now: it
    /// grows with the device queue that feeds it.
    pub fn grow_to(&mut self, capacity: usize) {
        self.capacity = self.capacity.max(capacity);
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
        self.push(Staged::Entry(e, rfabric_sys::fabric::FI_ADDR_NOTAVAIL))
    }

    /// A completion whose source address is known (`fi_cq_readfrom`).
    pub fn push_entry_from(&mut self, e: CqEntry, src: u64) -> Result<()> {
        self.push(Staged::Entry(e, src))
    }

    pub fn push_error(&mut self, e: CqErrEntry) -> Result<()> {
        self.push(Staged::Error(Box::new(e)))
    }

    /// Moves staged successful completions into `out` (in `E`'s format) up to the first
    /// error entry, with their source addresses into `src` when given.
    /// `Ok(0)` when nothing is staged; `EAVAIL` when an error entry is at the head.
    pub fn read_into<E: FormatEntry>(
        &mut self,
        out: &mut [E],
        mut src: Option<&mut [u64]>,
    ) -> Result<usize> {
        let mut n = 0;
        while n < out.len() {
            match self.q.front() {
                Some(Staged::Entry(e, a)) => {
                    out[n] = E::from_tagged(e);
                    if let Some(s) = src.as_deref_mut() {
                        s[n] = *a;
                    }
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
        if n > 0 {
            self.held_err_data.clear();
        }
        Ok(n)
    }

    /// Removes the head error entry, if the head is one.
    pub fn readerr(&mut self) -> Option<CqErrEntry> {
        if matches!(self.q.front(), Some(Staged::Error(_))) {
            if let Some(Staged::Error(e)) = self.q.pop_front() {
                return Some(*e);
            }
        }
        None
    }

    /// `fi_cq_readerr` with C semantics for error data: with a caller buffer
    /// (`caller_buf` of `err_data_size` bytes) the data is copied into it, truncated to fit;
    /// without one (`err_data_size` 0) the returned slice is provider-owned and stays valid
    /// until the next read or readerr. Returns the entry and the data the caller sees.
    pub fn readerr_with<'a>(
        &'a mut self,
        caller_buf: Option<&mut [u8]>,
    ) -> Option<(CqErrEntry, ErrData<'a>)> {
        let e = self.readerr()?;
        match caller_buf {
            Some(buf) => {
                let n = e.err_data.len().min(buf.len());
                buf[..n].copy_from_slice(&e.err_data[..n]);
                Some((e, ErrData::Copied(n)))
            }
            None => {
                self.held_err_data.clone_from(&e.err_data);
                Some((e, ErrData::Held(&self.held_err_data)))
            }
        }
    }
}

/// What a blocking read needs from a completion queue. Transport-agnostic, so the
/// blocking-read rules (threshold, signal, timeout) are tested on the host.
pub trait Waitable {
    /// Non-blocking read; `EAGAIN` when nothing is ready.
    fn try_read<E: FormatEntry>(&self, out: &mut [E], src: Option<&mut [u64]>) -> Result<usize>;
    /// Arms the wait object, so that a completion from now on wakes [`Waitable::sleep`].
    fn arm(&self) -> Result<()>;
    /// Sleeps until woken or `timeout` passes (`None`: no limit).
    fn sleep(&self, timeout: Option<Duration>) -> Result<()>;
    /// Consumes a pending `fi_cq_signal`.
    fn take_signal(&self) -> bool;
}

/// `fi_cq_sread` / `fi_cq_sreadfrom`: reads at least one entry (or `threshold`, when the
/// wait condition is `FI_CQ_COND_THRESHOLD`), waiting up to `timeout_ms` (negative: forever).
/// `EAGAIN` on timeout or when `fi_cq_signal` wakes it with nothing read.
pub fn sread<W: Waitable, E: FormatEntry>(
    w: &W,
    out: &mut [E],
    mut src: Option<&mut [u64]>,
    threshold: usize,
    timeout_ms: i32,
) -> Result<usize> {
    let deadline =
        (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    let want = threshold.clamp(1, out.len().max(1));
    let mut n = 0;
    let mut armed = false;
    loop {
        match w.try_read(&mut out[n..], src.as_deref_mut().map(|s| &mut s[n..])) {
            Ok(k) => n += k,
            Err(e) if e.is_again() => {}
            Err(e) if n > 0 => {
                let _ = e; // Report what was read; the error is read next time.
                return Ok(n);
            }
            Err(e) => return Err(e),
        }
        if n >= want || n == out.len() {
            return Ok(n);
        }
        if w.take_signal() {
            return if n > 0 {
                Ok(n)
            } else {
                Err(Error::new(errno::EAGAIN, "woken by fi_cq_signal"))
            };
        }
        let left = match deadline {
            None => None,
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(l) if !l.is_zero() => Some(l),
                _ => {
                    return if n > 0 {
                        Ok(n)
                    } else {
                        Err(Error::new(
                            errno::EAGAIN,
                            "no completion before the timeout",
                        ))
                    }
                }
            },
        };
        if !armed {
            // Arm, then read again before sleeping: a completion between the read and the
            // arm would otherwise be slept through.
            w.arm()?;
            armed = true;
            continue;
        }
        w.sleep(left)?;
        armed = false;
    }
}

/// Where the error data of a `readerr_with` went.
#[derive(Debug, PartialEq, Eq)]
pub enum ErrData<'a> {
    /// This many bytes were copied into the caller's buffer.
    Copied(usize),
    /// Provider-owned bytes, valid until the next read.
    Held(&'a [u8]),
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
        assert_eq!(s.read_into(&mut out, None).unwrap(), 2);
        assert_eq!((out[0].op_context, out[1].op_context), (1, 2));
        assert_eq!(
            s.read_into(&mut out, None).unwrap_err().errno(),
            errno::EAVAIL
        );
        assert_eq!(s.readerr().unwrap().op_context, 3);
        assert!(s.readerr().is_none());
        assert_eq!(s.read_into(&mut out, None).unwrap(), 1);
        assert_eq!(out[0].op_context, 4);
        assert_eq!(s.read_into(&mut out, None).unwrap(), 0);
    }

    #[test]
    fn reads_fill_at_most_the_callers_buffer() {
        let mut s = CqState::new(8);
        for i in 0..5 {
            s.push_entry(ok(i)).unwrap();
        }
        let mut out = [CqEntry::default(); 3];
        assert_eq!(s.read_into(&mut out, None).unwrap(), 3);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn each_format_carries_exactly_its_fields() {
        let mut s = CqState::new(8);
        let e = CqEntry {
            op_context: 1,
            flags: 2,
            len: 3,
            buf: 4,
            data: 5,
            tag: 6,
        };
        for _ in 0..4 {
            s.push_entry(e).unwrap();
        }
        let mut c = [CqContextEntry::default(); 1];
        s.read_into(&mut c, None).unwrap();
        assert_eq!(c[0], CqContextEntry { op_context: 1 });
        let mut m = [CqMsgEntry::default(); 1];
        s.read_into(&mut m, None).unwrap();
        assert_eq!(
            m[0],
            CqMsgEntry {
                op_context: 1,
                flags: 2,
                len: 3
            }
        );
        let mut d = [CqDataEntry::default(); 1];
        s.read_into(&mut d, None).unwrap();
        assert_eq!(
            d[0],
            CqDataEntry {
                op_context: 1,
                flags: 2,
                len: 3,
                buf: 4,
                data: 5
            }
        );
        let mut t = [CqEntry::default(); 1];
        s.read_into(&mut t, None).unwrap();
        assert_eq!(t[0], e);
    }

    #[test]
    fn format_entries_have_the_c_layouts() {
        use rfabric_sys::fabric::{fi_cq_data_entry, fi_cq_entry, fi_cq_msg_entry};
        assert_eq!(size_of::<CqContextEntry>(), size_of::<fi_cq_entry>());
        assert_eq!(size_of::<CqMsgEntry>(), size_of::<fi_cq_msg_entry>());
        assert_eq!(
            offset_of!(CqMsgEntry, len),
            offset_of!(fi_cq_msg_entry, len)
        );
        assert_eq!(size_of::<CqDataEntry>(), size_of::<fi_cq_data_entry>());
        assert_eq!(
            offset_of!(CqDataEntry, data),
            offset_of!(fi_cq_data_entry, data)
        );
    }

    #[test]
    fn readfrom_returns_each_entrys_source_address() {
        let mut s = CqState::new(8);
        s.push_entry_from(ok(1), 17).unwrap();
        s.push_entry(ok(2)).unwrap();
        let mut out = [CqEntry::default(); 2];
        let mut src = [0u64; 2];
        assert_eq!(s.read_into(&mut out, Some(&mut src)).unwrap(), 2);
        assert_eq!(src, [17, rfabric_sys::fabric::FI_ADDR_NOTAVAIL]);
    }

    #[test]
    fn error_data_goes_to_the_callers_buffer_truncated_or_stays_held_until_the_next_read() {
        let mut s = CqState::new(8);
        let mut e = bad(1);
        e.err_data = b"0123456789".to_vec();
        s.push_error(e.clone()).unwrap();
        s.push_error(e).unwrap();
        s.push_entry(ok(3)).unwrap();
        let mut buf = [0u8; 4];
        let (got, data) = s.readerr_with(Some(&mut buf)).unwrap();
        assert_eq!((got.op_context, data), (1, ErrData::Copied(4)));
        assert_eq!(&buf, b"0123");
        let (_, data) = s.readerr_with(None).unwrap();
        assert_eq!(data, ErrData::Held(b"0123456789"));
        assert_eq!(s.held_err_data, b"0123456789");
        let mut out = [CqEntry::default(); 1];
        s.read_into(&mut out, None).unwrap();
        assert!(
            s.held_err_data.is_empty(),
            "held data lives only until the next read"
        );
    }

    /// A software CQ with a condition variable: the host model of a waitable CQ.
    struct Model {
        s: std::sync::Mutex<CqState>,
        cv: std::sync::Condvar,
        signaled: std::sync::atomic::AtomicBool,
        arms: std::sync::atomic::AtomicUsize,
    }

    impl Model {
        fn new() -> std::sync::Arc<Self> {
            std::sync::Arc::new(Model {
                s: std::sync::Mutex::new(CqState::new(64)),
                cv: std::sync::Condvar::new(),
                signaled: false.into(),
                arms: 0.into(),
            })
        }
        fn push(&self, ctx: u64) {
            self.s.lock().unwrap().push_entry(ok(ctx)).unwrap();
            self.cv.notify_all();
        }
        fn signal(&self) {
            self.signaled
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.cv.notify_all();
        }
    }

    impl Waitable for Model {
        fn try_read<E: FormatEntry>(
            &self,
            out: &mut [E],
            src: Option<&mut [u64]>,
        ) -> Result<usize> {
            match self.s.lock().unwrap().read_into(out, src)? {
                0 => Err(Error::new(errno::EAGAIN, "empty")),
                n => Ok(n),
            }
        }
        fn arm(&self) -> Result<()> {
            self.arms.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn sleep(&self, timeout: Option<Duration>) -> Result<()> {
            let g = self.s.lock().unwrap();
            if !g.is_empty() || self.signaled.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            let _ = self
                .cv
                .wait_timeout(g, timeout.unwrap_or(Duration::from_secs(3600)))
                .unwrap();
            Ok(())
        }
        fn take_signal(&self) -> bool {
            self.signaled
                .swap(false, std::sync::atomic::Ordering::SeqCst)
        }
    }

    #[test]
    fn sread_returns_what_is_ready_without_waiting() {
        let m = Model::new();
        m.push(1);
        let mut out = [CqEntry::default(); 4];
        assert_eq!(sread(&*m, &mut out, None, 0, 1000).unwrap(), 1);
        assert_eq!(
            m.arms.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "no arming when entries are ready"
        );
    }

    #[test]
    fn sread_times_out_with_eagain() {
        let m = Model::new();
        let mut out = [CqEntry::default(); 1];
        let t = Instant::now();
        assert_eq!(
            sread(&*m, &mut out, None, 0, 50).unwrap_err().errno(),
            errno::EAGAIN
        );
        assert!(t.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn sread_wakes_on_a_completion_from_another_thread() {
        let m = Model::new();
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            m2.push(7);
        });
        let mut out = [CqEntry::default(); 1];
        assert_eq!(sread(&*m, &mut out, None, 0, -1).unwrap(), 1);
        assert_eq!(out[0].op_context, 7);
        t.join().unwrap();
    }

    #[test]
    fn signal_wakes_sread_with_eagain() {
        let m = Model::new();
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            m2.signal();
        });
        let mut out = [CqEntry::default(); 1];
        assert_eq!(
            sread(&*m, &mut out, None, 0, -1).unwrap_err().errno(),
            errno::EAGAIN
        );
        t.join().unwrap();
    }

    #[test]
    fn threshold_waits_for_that_many_entries_or_returns_what_came_at_the_timeout() {
        let m = Model::new();
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            for i in 0..3 {
                std::thread::sleep(Duration::from_millis(10));
                m2.push(i);
            }
        });
        let mut out = [CqEntry::default(); 8];
        assert_eq!(sread(&*m, &mut out, None, 3, 5000).unwrap(), 3);
        t.join().unwrap();
        m.push(9);
        assert_eq!(
            sread(&*m, &mut out, None, 4, 30).unwrap(),
            1,
            "partial at timeout"
        );
    }

    #[test]
    fn sreadfrom_fills_source_addresses() {
        let m = Model::new();
        m.s.lock().unwrap().push_entry_from(ok(1), 5).unwrap();
        let mut out = [CqMsgEntry::default(); 2];
        let mut src = [0u64; 2];
        assert_eq!(sread(&*m, &mut out, Some(&mut src), 0, 0).unwrap(), 1);
        assert_eq!(src[0], 5);
    }

    #[test]
    fn overflow_enters_the_overrun_state() {
        let mut s = CqState::new(1);
        s.push_entry(ok(1)).unwrap();
        assert_eq!(s.push_entry(ok(2)).unwrap_err().errno(), errno::EOVERRUN);
        assert!(s.is_overrun());
        let mut out = [CqEntry::default(); 2];
        assert_eq!(s.read_into(&mut out, None).unwrap(), 1);
        assert_eq!(
            s.read_into(&mut out, None).unwrap_err().errno(),
            errno::EOVERRUN
        );
    }
}
