//! Passive endpoints: an rdma_cm identifier that listens for connection requests.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use rfabric_sys::cm::{CmId, REJECT_PRIVATE_DATA_MAX};

use crate::core::addr::{fill_name, sockaddr_bytes};
use crate::core::error::{errno, Error, Result};
use crate::core::info::Info;
use crate::verbs::eq::{encode_cm_data, ConnRequest, Owner};
use crate::verbs::{os_err, EventQueue, Fabric};

/// A passive endpoint (`fi_passive_ep`).
#[derive(Debug)]
pub struct PassiveEndpoint {
    id: CmId,
    info: Info,
    context: u64,
    eq: Mutex<Option<Arc<EventQueue>>>,
    /// `FI_BACKLOG`; 0 until set. Applied by `listen`.
    backlog: std::sync::atomic::AtomicI32,
    listening: std::sync::atomic::AtomicBool,
    /// Its address was given to an active endpoint (`grant_address`).
    granted: bool,
    _fabric: Arc<Fabric>,
}

/// Backlog of `fi_listen` (rdma_cm's own default is similar).
const DEFAULT_BACKLOG: i32 = 128;

impl PassiveEndpoint {
    /// Opens a passive endpoint bound to `info.src_addr` (any address, any port when unset).
    /// `context` is reported as the `fid` of its events.
    pub fn open(fabric: &Arc<Fabric>, info: &Info, context: u64) -> Result<Self> {
        let src = info
            .src_addr
            .unwrap_or(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)));
        let id = bound_id(&src)?;
        Ok(PassiveEndpoint {
            id,
            info: info.clone(),
            context,
            eq: Mutex::new(None),
            backlog: 0.into(),
            listening: false.into(),
            granted: false,
            _fabric: fabric.clone(),
        })
    }

    /// Binds the event queue that receives `FI_CONNREQ` events (`fi_pep_bind`).
    pub fn bind_eq(&self, eq: &Arc<EventQueue>) -> Result<()> {
        let mut cur = self.eq.lock().unwrap_or_else(|p| p.into_inner());
        if cur.is_some() {
            return Err(Error::new(
                errno::EINVAL,
                "passive endpoint already bound to an event queue",
            ));
        }
        self.id
            .migrate(eq.channel())
            .map_err(os_err("rdma_migrate_id"))?;
        self.register(eq);
        *cur = Some(eq.clone());
        Ok(())
    }

    /// Starts listening (`fi_listen`). Requires a bound event queue.
    pub fn listen(&self) -> Result<()> {
        if self.eq.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            return Err(Error::new(
                errno::ENOEQ,
                "bind an event queue before fi_listen: connection requests are reported there",
            ));
        }
        let backlog = match self.backlog.load(Ordering::Acquire) {
            0 => DEFAULT_BACKLOG,
            b => b,
        };
        if self.listening.swap(true, Ordering::AcqRel) {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "the passive endpoint is already listening",
            ));
        }
        if let Err(e) = self.id.listen(backlog) {
            self.listening.store(false, Ordering::Release);
            return Err(Error::os(e, "rdma_listen"));
        }
        crate::fi_info!(
            "cm",
            "listening on {:?}, backlog {backlog}",
            self.id.local_addr()
        );
        Ok(())
    }

    /// `fi_control(FI_BACKLOG)`: how many connection requests may wait for the
    /// application. Set it before `listen`; rdma_cm refuses requests beyond it, and
    /// refuses a second `rdma_listen` (tried on rxe, kernel 6.1), so it cannot change after.
    pub fn set_backlog(&self, backlog: i32) -> Result<()> {
        if backlog <= 0 {
            return Err(Error::new(
                errno::EINVAL,
                format!("backlog {backlog}: it must be positive"),
            ));
        }
        if self.listening.load(Ordering::Acquire) {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "set FI_BACKLOG before fi_listen",
            ));
        }
        self.backlog.store(backlog, Ordering::Release);
        Ok(())
    }

    /// The backlog `listen` uses.
    pub fn backlog(&self) -> i32 {
        match self.backlog.load(Ordering::Acquire) {
            0 => DEFAULT_BACKLOG,
            b => b,
        }
    }

    /// `FI_OPT_CM_DATA_SIZE` of a passive endpoint: the most data a connection request carries.
    pub fn cm_data_size(&self) -> usize {
        crate::verbs::eq::CM_DATA_SIZE
    }

    /// The bound address, with the port chosen when 0 was asked (`fi_getname`).
    pub fn getname(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// `fi_getname` into a caller's buffer, with fi_cm(3)'s `addrlen` rules.
    pub fn getname_into(&self, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        let name = self.getname().ok_or_else(|| {
            Error::new(errno::EADDRNOTAVAIL, "the passive endpoint has no address")
        })?;
        fill_name(&sockaddr_bytes(&name), buf, addrlen)
    }

    /// `fi_setname`: binds the passive endpoint to `addr` instead (port 0: any free port),
    /// before `listen`. On failure the endpoint keeps its address.
    pub fn setname(&mut self, addr: &SocketAddr) -> Result<()> {
        if self.listening.load(Ordering::Acquire) {
            return Err(Error::new(
                errno::EOPBADSTATE,
                "fi_setname on a listening passive endpoint: set the address before fi_listen",
            ));
        }
        let id = bound_id(addr)?;
        let eq = self.eq.get_mut().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(eq) = &eq {
            id.migrate(eq.channel())
                .map_err(os_err("rdma_migrate_id"))?;
            eq.unregister(self.id.ident());
        }
        self.id = id;
        self.info.src_addr = Some(*addr);
        self.granted = false;
        if let Some(eq) = &eq {
            self.register(eq);
        }
        Ok(())
    }

    fn register(&self, eq: &EventQueue) {
        eq.register(
            self.id.ident(),
            Owner::Passive {
                fid: self.context,
                info: Box::new(self.info.clone()),
            },
        );
    }

    /// Refuses a connection request, sending `data` to the connecting side (`fi_reject`).
    pub fn reject(&self, request: &ConnRequest, data: &[u8]) -> Result<()> {
        let id = request.take()?;
        let enc = encode_cm_data(data, REJECT_PRIVATE_DATA_MAX)?;
        id.reject(&enc).map_err(os_err("rdma_reject"))
    }
}

impl PassiveEndpoint {
    /// Gives this endpoint's address to an active endpoint (fi_endpoint(3): an info whose
    /// `handle` is a passive endpoint). The identifier bound to it moves, synchronous
    /// again, into the handle; this endpoint keeps an unbound one, with no address.
    pub fn grant_address(&mut self) -> Result<ReservedAddress> {
        if self.listening.load(Ordering::Acquire) {
            return Err(Error::new(
                errno::EINVAL,
                "a listening passive endpoint cannot give its address to an active endpoint",
            ));
        }
        if self.granted {
            return Err(Error::new(
                errno::EINVAL,
                "this passive endpoint's address was given to an active endpoint already",
            ));
        }
        let fresh = CmId::new(None).map_err(os_err("rdma_create_id"))?;
        let eq = self.eq.get_mut().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(eq) = &eq {
            fresh
                .migrate(eq.channel())
                .map_err(os_err("rdma_migrate_id"))?;
            self.id.migrate_sync().map_err(os_err("rdma_migrate_id"))?;
            eq.unregister(self.id.ident());
        }
        let id = std::mem::replace(&mut self.id, fresh);
        self.info.src_addr = None;
        self.granted = true;
        if let Some(eq) = &eq {
            self.register(eq);
        }
        Ok(ReservedAddress {
            id: Mutex::new(Some(id)),
        })
    }

    /// Takes back an address an active endpoint could not use.
    pub fn restore_address(&mut self, reserved: &ReservedAddress) {
        let Some(id) = reserved.take() else { return };
        let eq = self.eq.get_mut().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(eq) = &eq {
            if id.migrate(eq.channel()).is_err() {
                return;
            }
            eq.unregister(self.id.ident());
        }
        self.info.src_addr = id.local_addr();
        self.id = id;
        self.granted = false;
        if let Some(eq) = &eq {
            self.register(eq);
        }
    }
}

/// A passive endpoint's address given to an active endpoint (`fi_info.handle`): the
/// rdma_cm identifier bound to it, taken once.
#[derive(Debug)]
pub struct ReservedAddress {
    id: Mutex<Option<CmId>>,
}

impl ReservedAddress {
    pub(crate) fn take(&self) -> Option<CmId> {
        self.id.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Gives back an identifier its endpoint could not use.
    pub(crate) fn put_back(&self, id: CmId) {
        *self.id.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    }
}

impl Drop for PassiveEndpoint {
    fn drop(&mut self) {
        if let Some(eq) = self.eq.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            eq.unregister(self.id.ident());
        }
    }
}

/// A new rdma_cm identifier bound to `src`.
fn bound_id(src: &SocketAddr) -> Result<CmId> {
    let id = CmId::new(None).map_err(os_err("rdma_create_id"))?;
    id.bind_addr(src).map_err(|e| {
        let what = if e == libc::EADDRINUSE {
            "address in use"
        } else {
            "rdma_bind_addr"
        };
        Error::os(e, format!("cannot bind passive endpoint to {src}: {what}"))
    })?;
    Ok(id)
}
