//! Address vectors (`fi_av`): UD names mapped to address handles (datagram endpoints), and
//! RDM endpoint names (connected on first use by the RDM endpoint).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rfabric_sys::lock::{ReadGuard, RwLock, WriteGuard};
use rfabric_sys::verbs::{AddressHandle, UdDest};

use crate::core::addr::fill_name;
use crate::core::av::AvTable;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::AvType;
use crate::core::rdm::RdmName;
use crate::verbs::{os_err, Domain};

/// The Q_Key of every rverbs datagram endpoint (high bit clear: not a controlled key).
pub const DGRAM_QKEY: u32 = 0x5246_5642;

/// The name of a datagram endpoint (`FI_ADDR_IB_UD` for rverbs): the port's GID, the queue
/// pair number and its Q_Key, 24 bytes, numbers little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdName {
    pub gid: [u8; 16],
    pub qpn: u32,
    pub qkey: u32,
}

impl UdName {
    pub const LEN: usize = 24;

    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..16].copy_from_slice(&self.gid);
        b[16..20].copy_from_slice(&self.qpn.to_le_bytes());
        b[20..24].copy_from_slice(&self.qkey.to_le_bytes());
        b
    }

    pub fn parse(b: &[u8]) -> Result<Self> {
        if b.len() != Self::LEN {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "a datagram endpoint name is {} bytes (from fi_getname), not {}",
                    Self::LEN,
                    b.len()
                ),
            ));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[..16]);
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(UdName {
            gid,
            qpn: u(16),
            qkey: u(20),
        })
    }

    /// `fi_av_straddr`'s form: `fi_addr_ib_ud://<gid>/<qpn>/<qkey>`.
    pub fn to_str(&self) -> String {
        let gid = std::net::Ipv6Addr::from(self.gid);
        format!("fi_addr_ib_ud://{gid}/{:#x}/{:#x}", self.qpn, self.qkey)
    }
}

/// `fi_av_attr`: the type and the expected number of entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AvAttr {
    pub av_type: AvType,
    pub count: usize,
}

/// What an address names: a datagram endpoint (with the handle to reach it) or an RDM
/// endpoint, told apart by the name's length.
#[derive(Clone, Debug)]
pub(crate) enum Dest {
    Ud(UdDest),
    Rdm(RdmName),
}

/// An address vector of endpoint names (`fi_av_open`).
#[derive(Debug)]
pub struct AddressVector {
    table: RwLock<AvTable<Dest>>,
    /// Addresses removed so far: a cache of what an index names holds while this holds.
    removals: AtomicU64,
    /// Insertions and removals so far: an RDM endpoint's local routes follow it.
    changes: AtomicU64,
    /// One address handle per remote port, made on first use and shared by its entries.
    ahs: Mutex<HashMap<[u8; 16], Arc<AddressHandle>>>,
    attr: AvAttr,
    domain: Arc<Domain>,
}

impl AddressVector {
    /// Opens an address vector (`FI_AV_UNSPEC` becomes `FI_AV_TABLE`).
    pub fn open(domain: &Arc<Domain>, attr: &AvAttr) -> Result<Arc<Self>> {
        let av_type = match attr.av_type {
            AvType::Unspec => AvType::Table,
            t => t,
        };
        Ok(Arc::new(AddressVector {
            table: RwLock::new(AvTable::new(av_type, attr.count)?),
            removals: AtomicU64::new(0),
            changes: AtomicU64::new(0),
            ahs: Mutex::new(HashMap::new()),
            attr: AvAttr {
                av_type,
                count: attr.count,
            },
            domain: domain.clone(),
        }))
    }

    pub fn attr(&self) -> &AvAttr {
        &self.attr
    }

    /// Addresses it holds now.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The length of the names it takes: RDM names in a domain opened for RDM endpoints,
    /// UD names otherwise.
    pub fn name_len(&self) -> usize {
        if self.domain.info().ep_attr.ep_type == crate::core::flags::EpType::Rdm {
            RdmName::LEN
        } else {
            UdName::LEN
        }
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// Inserts one endpoint name (`fi_av_insert`); returns its `fi_addr_t`.
    pub fn insert(&self, name: &[u8]) -> Result<u64> {
        if name.len() == RdmName::LEN {
            let n = RdmName::parse(name)?;
            let a = self.write().insert(&n.to_bytes(), Dest::Rdm(n));
            self.changes.fetch_add(1, Ordering::Release);
            return Ok(a);
        }
        let n = UdName::parse(name)?;
        let ah = {
            let mut ahs = self.ahs.lock().unwrap_or_else(|p| p.into_inner());
            match ahs.get(&n.gid) {
                Some(ah) => ah.clone(),
                None => {
                    let dev = self.domain.device();
                    let ah = AddressHandle::new(
                        self.domain.pd(),
                        dev.port.port_num,
                        n.gid,
                        dev.ud_gid_index,
                    )
                    .map_err(os_err("ibv_create_ah"))?;
                    ahs.insert(n.gid, ah.clone());
                    ah
                }
            }
        };
        let peer = UdDest {
            ah,
            qpn: n.qpn,
            qkey: n.qkey,
        };
        Ok(self.write().insert(&n.to_bytes(), Dest::Ud(peer)))
    }

    /// Inserts a destination made elsewhere (a multicast group's), under `name`.
    pub(crate) fn insert_dest(&self, name: &UdName, dest: UdDest) -> u64 {
        self.write().insert(&name.to_bytes(), Dest::Ud(dest))
    }

    /// Removes an address (`fi_av_remove`); later sends to it fail with `-FI_EINVAL`.
    pub fn remove(&self, addr: u64) -> Result<()> {
        let r = self.write().remove(addr).map(|_| ());
        self.removals.fetch_add(1, Ordering::Release);
        self.changes.fetch_add(1, Ordering::Release);
        r
    }

    /// Changes with every insertion and removal.
    pub(crate) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// The RDM names it holds of endpoints on host `host`, with their addresses.
    pub(crate) fn rdm_on_host(&self, host: u64) -> Vec<(u64, RdmName)> {
        self.read()
            .entries()
            .filter_map(|(a, d)| match d {
                Dest::Rdm(n) if n.host == host => Some((a, *n)),
                _ => None,
            })
            .collect()
    }

    /// Changes with every removal (an index then may name someone else once reused).
    pub(crate) fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
    }

    /// `fi_av_lookup`: the name behind `addr`, with fi_cm(3)'s `addrlen` rules.
    pub fn lookup(&self, addr: u64, buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
        let t = self.read();
        fill_name(t.name(addr)?, buf, addrlen)
    }

    /// `fi_av_straddr`: a printable form of an endpoint name.
    pub fn straddr(name: &[u8]) -> Result<String> {
        if name.len() == RdmName::LEN {
            return RdmName::parse(name).map(|n| n.to_str());
        }
        UdName::parse(name).map(|n| n.to_str())
    }

    /// The address `name` was inserted at, for `FI_SOURCE`.
    pub fn find(&self, name: &UdName) -> Option<u64> {
        self.read().find(&name.to_bytes())
    }

    /// The address an RDM endpoint name was inserted at, for `FI_SOURCE`.
    pub fn find_rdm(&self, name: &RdmName) -> Option<u64> {
        self.read().find(&name.to_bytes())
    }

    /// The RDM endpoint name at `addr`.
    pub(crate) fn rdm_name(&self, addr: u64) -> Result<RdmName> {
        match self.read().get(addr) {
            Some(Dest::Rdm(n)) => Ok(*n),
            Some(Dest::Ud(_)) => Err(Error::new(
                errno::EINVAL,
                format!("fi_addr {addr:#x} names a datagram endpoint, not an RDM one"),
            )),
            None => Err(unknown(addr)),
        }
    }

    /// Runs `f` on the peer at `addr`, or fails with `-FI_EINVAL` for an unknown address.
    #[inline(always)]
    pub(crate) fn with_peer<R>(&self, addr: u64, f: impl FnOnce(&UdDest) -> R) -> Result<R> {
        let t = self.read();
        match t.get(addr) {
            Some(Dest::Ud(p)) => Ok(f(p)),
            Some(Dest::Rdm(_)) => Err(Error::new(
                errno::EINVAL,
                format!("fi_addr {addr:#x} names an RDM endpoint, not a datagram one"),
            )),
            None => Err(unknown(addr)),
        }
    }

    /// Runs `post` on the peer at `addr` (a datagram endpoint's), or fails with
    /// `-FI_EINVAL` for an unknown address: [`Self::with_peer`] for an operation that
    /// answers a result itself.
    #[inline(always)]
    pub(crate) fn post_to_peer(
        &self,
        addr: u64,
        post: impl FnOnce(&UdDest) -> Result<()>,
    ) -> Result<()> {
        let t = self.read();
        match t.get(addr) {
            Some(Dest::Ud(p)) => post(p),
            _ => Err(not_ud(addr, t.get(addr).is_some())),
        }
    }

    #[inline(always)]
    fn read(&self) -> ReadGuard<'_, AvTable<Dest>> {
        self.table.read()
    }

    fn write(&self) -> WriteGuard<'_, AvTable<Dest>> {
        self.table.write()
    }
}

/// The error for a datagram send to `addr`: an RDM peer's address (`rdm`) or none.
#[cold]
#[inline(never)]
fn not_ud(addr: u64, rdm: bool) -> Error {
    if rdm {
        Error::new(
            errno::EINVAL,
            format!("fi_addr {addr:#x} names an RDM endpoint, not a datagram one"),
        )
    } else {
        unknown(addr)
    }
}

fn unknown(addr: u64) -> Error {
    Error::new(
        errno::EINVAL,
        format!("fi_addr {addr:#x} is not in the endpoint's address vector (never inserted, or removed)"),
    )
}
