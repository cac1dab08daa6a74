//! Event queue state (`fi_eq(3)`): events and error entries in arrival order.
//!
//! A read returns the head event, or `-FI_EAVAIL` when the head is an error entry, which
//! `readerr` then removes. Transports push; applications read.

use std::collections::VecDeque;

use crate::core::error::{errno, Error, Result};
use crate::core::info::Info;

/// A connection management event (`fi_eq_cm_entry`), with the endpoint's context as `fid`.
#[derive(Debug)]
pub enum EqEvent {
    /// `FI_CONNREQ` on a passive endpoint: `info.handle` identifies the request to accept.
    ConnReq {
        fid: u64,
        info: Box<Info>,
        data: Vec<u8>,
    },
    /// `FI_CONNECTED` on either side, with the accept data on the connecting side.
    Connected { fid: u64, data: Vec<u8> },
    /// `FI_SHUTDOWN`: the peer disconnected or went away.
    Shutdown { fid: u64 },
    /// `FI_JOIN_COMPLETE`: a multicast join (`fi_join`) finished; `fid` is its context.
    JoinComplete { fid: u64 },
    /// An event written with `fi_eq_write` (by the application, or a peer provider sharing
    /// the EQ): its code and its bytes as written, read back unchanged.
    Written { event: u32, data: Vec<u8> },
}

impl EqEvent {
    pub fn fid(&self) -> u64 {
        match self {
            EqEvent::ConnReq { fid, .. }
            | EqEvent::Connected { fid, .. }
            | EqEvent::Shutdown { fid }
            | EqEvent::JoinComplete { fid } => *fid,
            // Written entries start with their fid (every fi_eq_*_entry does).
            EqEvent::Written { data, .. } => data
                .get(..8)
                .map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap_or_default())),
        }
    }

    /// The `FI_CONNREQ` / `FI_CONNECTED` / `FI_SHUTDOWN` code.
    pub fn code(&self) -> u32 {
        use rfabric_sys::fabric as fi;
        match self {
            EqEvent::ConnReq { .. } => fi::FI_CONNREQ,
            EqEvent::Connected { .. } => fi::FI_CONNECTED,
            EqEvent::Shutdown { .. } => fi::FI_SHUTDOWN,
            EqEvent::JoinComplete { .. } => fi::FI_JOIN_COMPLETE,
            EqEvent::Written { event, .. } => *event,
        }
    }
}

/// An error entry (`fi_eq_err_entry`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EqErrEntry {
    pub fid: u64,
    pub context: u64,
    pub data: u64,
    /// Positive libfabric errno.
    pub err: i32,
    pub prov_errno: i32,
    /// For a rejected connection, the reject data.
    pub err_data: Vec<u8>,
}

#[derive(Debug)]
enum Entry {
    Event(EqEvent),
    Error(EqErrEntry),
}

/// The queue behind an EQ. Bounded: pushing past `capacity` marks it overrun.
#[derive(Debug)]
pub struct EventQueueState {
    entries: VecDeque<Entry>,
    capacity: usize,
    overrun: bool,
}

impl EventQueueState {
    pub fn new(capacity: usize) -> Self {
        EventQueueState {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            overrun: false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether another entry fits: sources that can wait (rdma_cm's event channel) are
    /// read only while it does, so their events are never dropped.
    pub fn has_room(&self) -> bool {
        self.entries.len() < self.capacity
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn push(&mut self, e: Entry) -> Result<()> {
        if self.entries.len() >= self.capacity {
            self.overrun = true;
            return Err(Error::new(
                errno::EOVERRUN,
                "event queue full: open it with a larger fi_eq_attr.size",
            ));
        }
        self.entries.push_back(e);
        Ok(())
    }

    /// Drops the provider events and errors naming `fid` (its object closed: fi_eq(3)
    /// entries must not name a closed object, whose address a new one may take).
    pub fn forget(&mut self, fid: u64) {
        self.entries.retain(|e| match e {
            Entry::Event(EqEvent::Written { .. }) => true,
            Entry::Event(ev) => ev.fid() != fid,
            Entry::Error(er) => er.fid != fid,
        });
    }

    pub fn push_event(&mut self, ev: EqEvent) -> Result<()> {
        self.push(Entry::Event(ev))
    }

    pub fn push_error(&mut self, err: EqErrEntry) -> Result<()> {
        self.push(Entry::Error(err))
    }

    /// The head event; `EAGAIN` when empty, `EAVAIL` when the head is an error entry,
    /// `EOVERRUN` once events were lost.
    pub fn read(&mut self) -> Result<EqEvent> {
        match self.entries.front() {
            None if self.overrun => {
                // Said once: the queue works again after it (a flood must not leave every
                // later read an error, nor `sread` unable to block).
                self.overrun = false;
                Err(Error::new(
                    errno::EOVERRUN,
                    "event queue overrun: events were lost (open the EQ with a larger fi_eq_attr.size)",
                ))
            }
            None => Err(Error::new(errno::EAGAIN, "no event")),
            Some(Entry::Error(_)) => Err(Error::new(
                errno::EAVAIL,
                "an error entry is at the head: read it with readerr",
            )),
            Some(Entry::Event(_)) => match self.entries.pop_front() {
                Some(Entry::Event(ev)) => Ok(ev),
                _ => unreachable!("front was an event"),
            },
        }
    }

    /// Hands the head event to `f` and removes it only if `f` succeeds and `consume` is
    /// set (`FI_PEEK` leaves it), so an event the caller cannot take is not lost. Errors
    /// as [`Self::read`].
    pub fn read_with<T>(
        &mut self,
        consume: bool,
        f: impl FnOnce(&EqEvent) -> Result<T>,
    ) -> Result<T> {
        match self.entries.front() {
            Some(Entry::Event(ev)) => {
                let t = f(ev)?;
                if consume {
                    self.entries.pop_front();
                }
                Ok(t)
            }
            _ => self
                .read()
                .map(|_| unreachable!("the head is not an event")),
        }
    }

    /// As [`Self::read_with`], for the head error entry (`fi_eq_readerr`).
    pub fn readerr_with<T>(
        &mut self,
        consume: bool,
        f: impl FnOnce(&EqErrEntry) -> Result<T>,
    ) -> Result<T> {
        match self.entries.front() {
            Some(Entry::Error(e)) => {
                let t = f(e)?;
                if consume {
                    self.entries.pop_front();
                }
                Ok(t)
            }
            _ => Err(Error::new(errno::EAGAIN, "no error entry at the head")),
        }
    }

    /// Removes and returns the head error entry; `EAGAIN` when the head is not an error.
    pub fn readerr(&mut self) -> Result<EqErrEntry> {
        if matches!(self.entries.front(), Some(Entry::Error(_))) {
            if let Some(Entry::Error(e)) = self.entries.pop_front() {
                return Ok(e);
            }
        }
        Err(Error::new(errno::EAGAIN, "no error entry at the head"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(fid: u64) -> EqErrEntry {
        EqErrEntry {
            fid,
            context: 0,
            data: 0,
            err: errno::ECONNREFUSED,
            prov_errno: 28,
            err_data: b"no".to_vec(),
        }
    }

    #[test]
    fn a_closed_objects_events_are_forgotten_and_written_ones_kept() {
        let mut q = EventQueueState::new(8);
        q.push_event(EqEvent::Shutdown { fid: 1 }).unwrap();
        q.push_event(EqEvent::Connected {
            fid: 2,
            data: vec![],
        })
        .unwrap();
        q.push_error(err(1)).unwrap();
        let mut w = 1u64.to_ne_bytes().to_vec();
        w.extend([0; 8]);
        q.push_event(EqEvent::Written { event: 9, data: w })
            .unwrap();
        q.forget(1);
        assert_eq!(q.len(), 2);
        assert!(matches!(
            q.read().unwrap(),
            EqEvent::Connected { fid: 2, .. }
        ));
        assert!(matches!(
            q.read().unwrap(),
            EqEvent::Written { event: 9, .. }
        ));
        assert_eq!(q.read().unwrap_err().errno(), errno::EAGAIN);
    }

    #[test]
    fn empty_queue_reads_eagain() {
        let mut q = EventQueueState::new(4);
        assert_eq!(q.read().unwrap_err().errno(), errno::EAGAIN);
        assert_eq!(q.readerr().unwrap_err().errno(), errno::EAGAIN);
    }

    #[test]
    fn error_at_head_blocks_read_until_readerr_takes_it() {
        let mut q = EventQueueState::new(4);
        q.push_event(EqEvent::Shutdown { fid: 1 }).unwrap();
        q.push_error(err(2)).unwrap();
        q.push_event(EqEvent::Connected {
            fid: 3,
            data: vec![7],
        })
        .unwrap();
        assert!(matches!(q.read().unwrap(), EqEvent::Shutdown { fid: 1 }));
        assert_eq!(q.read().unwrap_err().errno(), errno::EAVAIL);
        assert_eq!(q.readerr().unwrap(), err(2));
        match q.read().unwrap() {
            EqEvent::Connected { fid, data } => assert_eq!((fid, data), (3, vec![7])),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn read_with_keeps_the_event_on_peek_and_on_failure() {
        let mut q = EventQueueState::new(4);
        q.push_event(EqEvent::Shutdown { fid: 1 }).unwrap();
        q.push_error(err(2)).unwrap();
        let code = q.read_with(false, |ev| Ok(ev.code())).unwrap();
        assert_eq!(code, rfabric_sys::fabric::FI_SHUTDOWN);
        let e = q
            .read_with(true, |_| -> Result<()> {
                Err(Error::new(errno::ETOOSMALL, "buffer too small"))
            })
            .unwrap_err();
        assert_eq!(e.errno(), errno::ETOOSMALL);
        assert!(q.read_with(true, |_| Ok(())).is_ok());
        assert_eq!(
            q.read_with(true, |_| Ok(())).unwrap_err().errno(),
            errno::EAVAIL
        );
        assert_eq!(q.readerr_with(false, |e| Ok(e.fid)).unwrap(), 2);
        assert_eq!(q.readerr_with(true, |e| Ok(e.fid)).unwrap(), 2);
        assert_eq!(
            q.readerr_with(true, |e| Ok(e.fid)).unwrap_err().errno(),
            errno::EAGAIN
        );
        assert_eq!(
            q.read_with(true, |_| Ok(())).unwrap_err().errno(),
            errno::EAGAIN
        );
    }

    #[test]
    fn overrun_is_reported_once_the_queue_drains() {
        let mut q = EventQueueState::new(1);
        q.push_event(EqEvent::Shutdown { fid: 1 }).unwrap();
        assert_eq!(
            q.push_event(EqEvent::Shutdown { fid: 2 })
                .unwrap_err()
                .errno(),
            errno::EOVERRUN
        );
        assert!(q.read().is_ok());
        assert_eq!(q.read().unwrap_err().errno(), errno::EOVERRUN);
        // Reported once, then the queue works again.
        assert_eq!(q.read().unwrap_err().errno(), errno::EAGAIN);
        q.push_event(EqEvent::Shutdown { fid: 3 }).unwrap();
        assert!(matches!(q.read(), Ok(EqEvent::Shutdown { fid: 3 })));
    }

    #[test]
    fn event_codes_are_the_header_values() {
        use rfabric_sys::fabric as fi;
        assert_eq!(EqEvent::Shutdown { fid: 0 }.code(), fi::FI_SHUTDOWN);
        assert_eq!(
            EqEvent::Connected {
                fid: 0,
                data: vec![]
            }
            .code(),
            fi::FI_CONNECTED
        );
    }
}
