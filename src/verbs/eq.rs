//! The event queue on an rdma_cm event channel.
//!
//! rdma_cm events are read when the application reads the EQ and translated into
//! `FI_CONNREQ`, `FI_CONNECTED`, `FI_SHUTDOWN` and error entries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use rfabric_sys::cm::{event as ev, event_str, CmEvent, CmId, EventChannel, McastGroup};

use crate::core::eq::{EqErrEntry, EqEvent, EventQueueState};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::WaitObj;
use crate::core::info::Info;
use crate::verbs::{os_err, Fabric};

/// `fi_eq_attr`, as far as rverbs uses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EqAttr {
    /// Entries; 0 means 256.
    pub size: usize,
    pub wait_obj: WaitObj,
}

/// A pending connection request: `fi_info.handle` of an `FI_CONNREQ` event. Accept it by
/// opening an endpoint on that info, or refuse it with [`crate::verbs::PassiveEndpoint::reject`].
#[derive(Debug)]
pub struct ConnRequest {
    id: Mutex<Option<CmId>>,
}

impl ConnRequest {
    /// Takes the request's identifier; a request is accepted or rejected once.
    pub(crate) fn take(&self) -> Result<CmId> {
        self.id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                Error::new(
                    errno::EINVAL,
                    "this connection request was already accepted or rejected",
                )
            })
    }
}

/// Most CM data `fi_connect` / `fi_accept` carry (`FI_OPT_CM_DATA_SIZE`): rdma_cm's
/// connect private data, less the length byte rverbs puts in front.
pub const CM_DATA_SIZE: usize = rfabric_sys::cm::CONNECT_PRIVATE_DATA_MAX - 1;

/// What a connection event does to the endpoint it names (implemented by RC endpoints):
/// the EQ knows endpoints through this, not their types.
pub(crate) trait CmEndpoint: std::any::Any + Send + Sync + std::fmt::Debug {
    fn mark_connected(&self);
    /// Records a disconnect; true the first time (when `FI_SHUTDOWN` is due).
    fn mark_disconnected(&self) -> bool;
    fn disconnect_quietly(&self);
}

/// What a multicast join event does to the join it names (datagram endpoints).
pub(crate) trait CmJoin: std::any::Any + Send + Sync + std::fmt::Debug {
    fn joined(&self, group: &McastGroup) -> Result<()>;
}

/// Who an rdma_cm identifier belongs to.
#[derive(Debug)]
pub(crate) enum Owner {
    Passive {
        fid: u64,
        info: Box<Info>,
    },
    Active {
        fid: u64,
        ep: Weak<dyn CmEndpoint>,
    },
    /// A multicast join of a datagram endpoint.
    Multicast {
        fid: u64,
        mc: Weak<dyn CmJoin>,
    },
}

impl Owner {
    fn fid(&self) -> u64 {
        match self {
            Owner::Passive { fid, .. }
            | Owner::Active { fid, .. }
            | Owner::Multicast { fid, .. } => *fid,
        }
    }
}

#[derive(Debug)]
struct Inner {
    q: EventQueueState,
    owners: HashMap<usize, Owner>,
    /// Owners upgraded while translating events, dropped only once the lock is released:
    /// an owner's last drop unregisters it, which takes this lock.
    released: Vec<Arc<dyn std::any::Any + Send + Sync>>,
}

/// An event queue (`fi_eq`).
#[derive(Debug)]
pub struct EventQueue {
    channel: Arc<EventChannel>,
    /// Armed by `fi_eq_write`, so that a thread blocked in `sread` wakes for written events.
    written: EventFd,
    inner: Mutex<Inner>,
    _fabric: Arc<Fabric>,
}

/// CM private data travels behind a one-byte length: rdma_cm pads a connect request's data
/// to the transport's size and does not say how much was sent.
pub(crate) fn encode_cm_data(data: &[u8], transport_max: usize) -> Result<Vec<u8>> {
    let max = transport_max - 1;
    if data.len() > max {
        return Err(Error::new(
            errno::EINVAL,
            format!(
                "{} bytes of CM data exceed FI_OPT_CM_DATA_SIZE ({max})",
                data.len()
            ),
        ));
    }
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(data.len() as u8);
    v.extend_from_slice(data);
    Ok(v)
}

pub(crate) fn decode_cm_data(raw: &[u8]) -> Vec<u8> {
    match raw.split_first() {
        Some((&n, rest)) => rest[..(n as usize).min(rest.len())].to_vec(),
        None => Vec::new(),
    }
}

impl crate::verbs::wait::WaitMember for EventQueue {
    fn try_wait(&self) -> Result<()> {
        self.trywait()
    }
}

impl EventQueue {
    /// `fi_trywait` on an EQ: `EAGAIN` when an event or an error is ready.
    pub fn trywait(&self) -> Result<()> {
        match self.read_with(false, |_| Ok(())) {
            Ok(()) => Err(Error::new(errno::EAGAIN, "an event is ready: read it")),
            Err(e) if e.errno() == errno::EAVAIL => {
                Err(Error::new(errno::EAGAIN, "an error is ready: read it"))
            }
            Err(e) if e.is_again() => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub fn open(fabric: &Arc<Fabric>, attr: &EqAttr) -> Result<Arc<Self>> {
        match attr.wait_obj {
            // A wait set nests its descriptor.
            WaitObj::None | WaitObj::Unspec | WaitObj::Fd | WaitObj::Set => {}
            w => {
                return Err(Error::new(
                    errno::ENOSYS,
                    format!(
                    "EQ wait object {w:?} is not implemented yet: use FI_WAIT_UNSPEC or FI_WAIT_FD"
                ),
                ))
            }
        }
        let channel = Arc::new(EventChannel::new().map_err(os_err("rdma_create_event_channel"))?);
        let size = if attr.size == 0 { 256 } else { attr.size };
        let written =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Error::os(e as i32, "eventfd for the EQ"))?;
        Ok(Arc::new(EventQueue {
            channel,
            written,
            inner: Mutex::new(Inner {
                q: EventQueueState::new(size),
                owners: HashMap::new(),
                released: Vec::new(),
            }),
            _fabric: fabric.clone(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn channel(&self) -> &Arc<EventChannel> {
        &self.channel
    }

    pub(crate) fn register(&self, ident: usize, owner: Owner) {
        self.lock().owners.insert(ident, owner);
    }

    /// Forgets an identifier and the queued events of its owner (which is closing, or
    /// moving to another EQ).
    pub(crate) fn unregister(&self, ident: usize) {
        let mut g = self.lock();
        if let Some(o) = g.owners.remove(&ident) {
            g.q.forget(o.fid());
        }
    }

    /// Puts the EQ (opened with `FI_WAIT_SET`) in `set`: its rdma_cm channel and the
    /// descriptor its written events signal.
    pub fn join(self: &Arc<Self>, set: &crate::verbs::WaitSet) -> Result<()> {
        let me: Weak<dyn crate::verbs::wait::WaitMember> = Arc::downgrade(self) as _;
        set.join(&[self.channel.borrow_fd(), self.written.as_fd()], me)
    }

    /// The file descriptor that becomes readable when CM events arrive (`FI_GETWAIT`).
    pub fn fd(&self) -> i32 {
        self.channel.fd()
    }

    /// The next event (`fi_eq_read`): `EAGAIN` when none, `EAVAIL` when an error is next.
    pub fn read(&self) -> Result<EqEvent> {
        self.progressed(|g| g.q.read())
    }

    /// The head error entry (`fi_eq_readerr`).
    pub fn readerr(&self) -> Result<EqErrEntry> {
        self.progressed(|g| g.q.readerr())
    }

    /// `fi_eq_read` for the C ABI: the head event goes to `f`, and is removed only if `f`
    /// takes it and `consume` is set (no `FI_PEEK`).
    pub fn read_with<T>(&self, consume: bool, f: impl FnOnce(&EqEvent) -> Result<T>) -> Result<T> {
        self.progressed(|g| g.q.read_with(consume, f))
    }

    /// `fi_eq_readerr` for the C ABI, as [`Self::read_with`].
    pub fn readerr_with<T>(
        &self,
        consume: bool,
        f: impl FnOnce(&EqErrEntry) -> Result<T>,
    ) -> Result<T> {
        self.progressed(|g| g.q.readerr_with(consume, f))
    }

    /// Translates pending rdma_cm events, then runs `f`, under the lock; owners the
    /// translation held are let go after it.
    fn progressed<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T>) -> Result<T> {
        let (r, released) = {
            let mut g = self.lock();
            let r = self.progress(&mut g).and_then(|()| f(&mut g));
            (r, std::mem::take(&mut g.released))
        };
        drop(released);
        r
    }

    /// Waits up to `timeout_ms` (negative: forever) for an event (`fi_eq_sread`).
    pub fn sread(&self, timeout_ms: i32) -> Result<EqEvent> {
        self.sread_with(timeout_ms, |q| q.read())
    }

    /// Waits as [`Self::sread`], trying `attempt` (a read) until it finds something.
    pub fn sread_with<T>(
        &self,
        timeout_ms: i32,
        mut attempt: impl FnMut(&Self) -> Result<T>,
    ) -> Result<T> {
        let deadline =
            (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
        loop {
            match attempt(self) {
                Err(e) if e.is_again() => {}
                other => return other,
            }
            let left = match deadline {
                None => PollTimeout::NONE,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::new(errno::EAGAIN, "no event before the timeout"));
                    }
                    PollTimeout::try_from(d - now).unwrap_or(PollTimeout::MAX)
                }
            };
            let mut fds = [
                PollFd::new(self.channel.borrow_fd(), PollFlags::POLLIN),
                PollFd::new(self.written.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, left) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::os(e as i32, "poll on the rdma_cm channel")),
            }
            // Reset it; the written event is in the queue for the next attempt.
            let _ = self.written.read();
        }
    }

    /// Writes an event from the application (`fi_eq_write`).
    pub fn write(&self, event: EqEvent) -> Result<()> {
        self.lock().q.push_event(event)?;
        if let Err(e) = self.written.write(1) {
            crate::fi_warn!("eq", "eventfd write: {e}");
        }
        Ok(())
    }

    /// Moves rdma_cm events into the queue while it has room; the rest wait in the event
    /// channel (the kernel's queue) for the next read, so a flood loses nothing.
    fn progress(&self, g: &mut Inner) -> Result<()> {
        while g.q.has_room() {
            let Some(e) = self
                .channel
                .get_event()
                .map_err(os_err("rdma_get_cm_event"))?
            else {
                break;
            };
            Self::translate(g, e);
        }
        Ok(())
    }

    fn translate(g: &mut Inner, e: CmEvent) {
        crate::fi_debug!(
            "eq",
            "{} (status {}) on id {:#x}",
            event_str(e.kind),
            e.status,
            e.id
        );
        let owner_fid = |g: &mut Inner, id: usize| {
            let (fid, ep) = match g.owners.get(&id) {
                Some(Owner::Active { fid, ep }) => (*fid, ep.upgrade()),
                _ => return None,
            };
            if let Some(ep) = &ep {
                g.released
                    .push(ep.clone() as Arc<dyn std::any::Any + Send + Sync>);
            }
            Some((fid, ep))
        };
        let pushed = match e.kind {
            ev::RDMA_CM_EVENT_CONNECT_REQUEST => {
                let Some(Owner::Passive { fid, info }) = g.owners.get(&e.listen_id) else {
                    crate::fi_warn!(
                        "eq",
                        "connection request for an unknown listener: refusing it"
                    );
                    return; // Dropping the new id refuses the request.
                };
                let Some(id) = e.new_id else { return };
                let mut info = (**info).clone();
                info.src_addr = id.local_addr();
                info.dest_addr = id.peer_addr();
                if let Some(ctx) = id.context() {
                    info.domain_attr.name = ctx.name();
                }
                let fid = *fid;
                info.handle = Some(Arc::new(ConnRequest {
                    id: Mutex::new(Some(id)),
                }));
                crate::fi_info!("eq", "connection request from {:?}", info.dest_addr);
                g.q.push_event(EqEvent::ConnReq {
                    fid,
                    info: Box::new(info),
                    data: decode_cm_data(&e.private_data),
                })
            }
            ev::RDMA_CM_EVENT_ESTABLISHED => match owner_fid(g, e.id) {
                Some((fid, ep)) => {
                    if let Some(ep) = ep {
                        ep.mark_connected();
                    }
                    g.q.push_event(EqEvent::Connected {
                        fid,
                        data: decode_cm_data(&e.private_data),
                    })
                }
                None => return,
            },
            ev::RDMA_CM_EVENT_DISCONNECTED => match owner_fid(g, e.id) {
                Some((fid, ep)) => {
                    // FI_SHUTDOWN once per endpoint, for the peer's disconnect or our own.
                    if let Some(ep) = &ep {
                        if !ep.mark_disconnected() {
                            return;
                        }
                        // Answer the peer's disconnect: moves our QP to error, so posted
                        // operations complete as canceled instead of waiting forever.
                        ep.disconnect_quietly();
                    }
                    g.q.push_event(EqEvent::Shutdown { fid })
                }
                None => return,
            },
            ev::RDMA_CM_EVENT_REJECTED
            | ev::RDMA_CM_EVENT_CONNECT_ERROR
            | ev::RDMA_CM_EVENT_UNREACHABLE
            | ev::RDMA_CM_EVENT_ADDR_ERROR
            | ev::RDMA_CM_EVENT_ROUTE_ERROR
            | ev::RDMA_CM_EVENT_DEVICE_REMOVAL => match owner_fid(g, e.id) {
                Some((fid, _)) => {
                    let err = match e.kind {
                        ev::RDMA_CM_EVENT_REJECTED => errno::ECONNREFUSED,
                        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => errno::ENODEV,
                        ev::RDMA_CM_EVENT_UNREACHABLE
                        | ev::RDMA_CM_EVENT_ADDR_ERROR
                        | ev::RDMA_CM_EVENT_ROUTE_ERROR => errno::EHOSTUNREACH,
                        _ => errno::ECONNABORTED,
                    };
                    crate::fi_info!(
                        "eq",
                        "{} for endpoint {:#x} (status {})",
                        event_str(e.kind),
                        fid,
                        e.status
                    );
                    let err_data = if e.kind == ev::RDMA_CM_EVENT_REJECTED {
                        decode_cm_data(&e.private_data)
                    } else {
                        Vec::new()
                    };
                    g.q.push_error(EqErrEntry {
                        fid,
                        context: fid,
                        data: 0,
                        err,
                        prov_errno: e.status,
                        err_data,
                    })
                }
                None => return,
            },
            ev::RDMA_CM_EVENT_MULTICAST_JOIN | ev::RDMA_CM_EVENT_MULTICAST_ERROR => {
                let (fid, mc) = match g.owners.get(&e.id) {
                    Some(Owner::Multicast { fid, mc }) => (*fid, mc.upgrade()),
                    _ => return,
                };
                if let Some(mc) = &mc {
                    g.released
                        .push(mc.clone() as Arc<dyn std::any::Any + Send + Sync>);
                }
                let joined = match (e.mcast, mc) {
                    (Some(group), Some(mc)) => mc.joined(&group),
                    (_, None) => return,
                    (None, _) => Err(Error::new(
                        errno::EHOSTUNREACH,
                        format!("multicast join failed (rdma_cm status {})", e.status),
                    )),
                };
                match joined {
                    Ok(()) => g.q.push_event(EqEvent::JoinComplete { fid }),
                    Err(err) => {
                        crate::fi_info!("eq", "multicast join of {fid:#x}: {err}");
                        g.q.push_error(EqErrEntry {
                            fid,
                            context: fid,
                            data: 0,
                            err: err.errno(),
                            prov_errno: e.status,
                            err_data: Vec::new(),
                        })
                    }
                }
            }
            _ => return,
        };
        if let Err(err) = pushed {
            crate::fi_warn!("eq", "{err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cm_data_round_trips_behind_its_length_byte() {
        let enc = encode_cm_data(b"hello", 56).unwrap();
        assert_eq!(enc, b"\x05hello");
        let mut padded = enc.clone();
        padded.resize(56, 0xee);
        assert_eq!(decode_cm_data(&padded), b"hello");
        assert_eq!(decode_cm_data(&[]), b"");
        assert_eq!(decode_cm_data(&[9, 1, 2]), vec![1, 2]);
    }

    #[test]
    fn oversized_cm_data_is_refused() {
        assert_eq!(
            encode_cm_data(&[0; 56], 56).unwrap_err().errno(),
            errno::EINVAL
        );
        assert!(encode_cm_data(&[0; 55], 56).is_ok());
    }
}
