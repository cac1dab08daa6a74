//! Poll sets (`fi_poll(3)`): one call that drives a group of CQs and counters and says
//! which of them have something to read.
//!
//! As libfabric's utility poll set: a CQ is reported while it holds an unread entry (the
//! application reads it, the next poll looks again), a counter when its success or error
//! count moved since this set last reported it. Members stay bound (their `fi_close` is
//! `-FI_EBUSY`) until `fi_poll_del` or the set's close: it never holds a closed object.

use std::sync::{Arc, Mutex};

use crate::core::error::{errno, Error, Result};
use crate::verbs::{CompletionQueue, Counter, Domain};

/// What a poll set can hold.
#[derive(Clone, Debug)]
pub enum Pollable {
    Cq(Arc<CompletionQueue>),
    Cntr(Arc<Counter>),
}

impl Pollable {
    fn same(&self, other: &Pollable) -> bool {
        match (self, other) {
            (Pollable::Cq(a), Pollable::Cq(b)) => Arc::ptr_eq(a, b),
            (Pollable::Cntr(a), Pollable::Cntr(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

#[derive(Debug)]
struct Member {
    what: Pollable,
    context: u64,
    /// A counter's (successes, errors) when this set last reported it.
    reported: (u64, u64),
}

/// `fid_poll`.
#[derive(Debug)]
pub struct PollSet {
    members: Mutex<Vec<Member>>,
    _domain: Arc<Domain>,
}

impl PollSet {
    /// `fi_poll_open`.
    pub fn open(domain: &Arc<Domain>) -> Arc<Self> {
        Arc::new(PollSet {
            members: Mutex::new(Vec::new()),
            _domain: domain.clone(),
        })
    }

    /// `fi_poll_add`: `what` is reported as `context`. Adding a member twice changes
    /// nothing (as libfabric's utility poll set).
    pub fn add(&self, what: Pollable, context: u64) -> Result<()> {
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        if m.iter().any(|x| x.what.same(&what)) {
            return Ok(());
        }
        match &what {
            Pollable::Cq(q) => q.bind()?,
            Pollable::Cntr(c) => c.bind()?,
        }
        m.push(Member {
            what,
            context,
            reported: (0, 0),
        });
        Ok(())
    }

    /// `fi_poll_del`: a member that is not in the set is no error (as libfabric's utility
    /// poll set).
    pub fn del(&self, what: &Pollable) {
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = m.iter().position(|x| x.what.same(what)) {
            match &m.remove(i).what {
                Pollable::Cq(q) => q.unbind(),
                Pollable::Cntr(c) => c.unbind(),
            }
        }
    }

    /// `fi_poll`: drives every member and writes the contexts of those with events to
    /// `out`, in the order they were added; how many it wrote.
    pub fn poll(&self, out: &mut [u64]) -> Result<usize> {
        self.poll_with(out.len(), |i, c| out[i] = c)
    }

    /// [`Self::poll`], each context `c` handed to `put(i, c)` (`i < max`): the C call
    /// writes the application's array with no buffer between.
    pub fn poll_with(&self, max: usize, mut put: impl FnMut(usize, u64)) -> Result<usize> {
        if max == 0 {
            return Err(Error::new(
                errno::EINVAL,
                "fi_poll needs room for at least one context",
            ));
        }
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for x in m.iter_mut() {
            let event = match &x.what {
                Pollable::Cq(q) => q.has_events()?,
                Pollable::Cntr(c) => {
                    let now = (c.read(), c.readerr());
                    let moved = now != x.reported;
                    if moved {
                        x.reported = now;
                    }
                    moved
                }
            };
            if event {
                put(n, x.context);
                n += 1;
                if n == max {
                    break;
                }
            }
        }
        Ok(n)
    }

    /// Members still in the set.
    pub fn len(&self) -> usize {
        self.members.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `fi_close`: its members are released (as libfabric's utility poll set does).
    pub fn close(&self) {
        self.release_all(&mut self.members.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn release_all(&self, m: &mut Vec<Member>) {
        for x in m.drain(..) {
            match x.what {
                Pollable::Cq(q) => q.unbind(),
                Pollable::Cntr(c) => c.unbind(),
            }
        }
    }
}

impl Drop for PollSet {
    fn drop(&mut self) {
        // Dropped unclosed (a Rust owner): its members are free again all the same.
        self.close();
    }
}
