//! Memory registration (`fi_mr_reg`) on the domain's protection domain.

use std::sync::{Arc, Mutex};

use rfabric_sys::verbs::{self as sv, access};

use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::{os_err, CompletionQueue, Counter, Domain};

/// A registered memory region. Cloning shares the registration.
#[derive(Clone, Debug)]
pub struct MemoryRegion {
    mr: Arc<sv::MemoryRegion>,
    /// Under offset addressing (`mr_mode` without `FI_MR_VIRT_ADDR`), the same memory
    /// registered again from address 0: its key is the one peers use (`fi_mr_key`), so
    /// their addresses are offsets into the region. rverbs' own use keeps `mr`'s.
    remote: Option<Arc<sv::MemoryRegion>>,
    /// Counters bound to it (`fi_mr_bind`), unbound when the last clone goes.
    cntrs: Arc<RegionCounters>,
    domain: Arc<Domain>,
}

/// The counters bound to one region with `FI_REMOTE_WRITE` (fi_mr(3)): each counts the
/// remote writes that modify it.
#[derive(Debug)]
pub(crate) struct RegionCounters {
    key: u64,
    cntrs: Mutex<Vec<Arc<Counter>>>,
    domain: Arc<Domain>,
}

impl RegionCounters {
    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Counter>>> {
        self.cntrs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One more remote write in place.
    pub(crate) fn count(&self) {
        for c in self.list().iter() {
            c.count(true);
        }
    }

    /// Its counters' reads drive `cq`, which learns of remote writes.
    pub(crate) fn feed_from(&self, cq: &Arc<CompletionQueue>) {
        for c in self.list().iter() {
            c.feed_from(cq);
        }
    }
}

impl Drop for RegionCounters {
    fn drop(&mut self) {
        let list = std::mem::take(self.cntrs.get_mut().unwrap_or_else(|p| p.into_inner()));
        if list.is_empty() {
            return;
        }
        self.domain.forget_region(self);
        for c in list {
            c.unbind();
        }
    }
}

/// Verbs access rights for libfabric access flags. Local write is always granted: the
/// device needs it for receives and RMA read targets, and remote write requires it.
fn verbs_access(acc: Flags) -> u32 {
    // The device writes a region that receives, is read into, or is written remotely
    // (verbs requires local write with remote write); a send-only region stays read-only.
    let mut a = 0;
    if acc.intersects(Flags::RECV | Flags::READ | Flags::REMOTE_WRITE) {
        a |= access::LOCAL_WRITE;
    }
    // Atomics are remote writes too (fi_mr(3)), done by the device under remote atomic access.
    if acc.contains(Flags::REMOTE_WRITE) {
        a |= access::REMOTE_WRITE | access::REMOTE_ATOMIC;
    }
    if acc.contains(Flags::REMOTE_READ) {
        a |= access::REMOTE_READ;
    }
    a
}

/// The verbs access rights for `fi_mr_reg` access flags, refusing flags that are not
/// memory access flags.
pub fn verbs_access_checked(access: Flags) -> Result<u32> {
    let allowed = Flags::SEND
        | Flags::RECV
        | Flags::READ
        | Flags::WRITE
        | Flags::REMOTE_READ
        | Flags::REMOTE_WRITE;
    if !(access - allowed).is_empty() {
        return Err(Error::new(
            errno::EINVAL,
            format!(
                "access flags {:?} are not memory access flags",
                access - allowed
            ),
        ));
    }
    Ok(verbs_access(access))
}

impl MemoryRegion {
    /// Allocates `len` bytes owned by the region and registers them for `access`
    /// (`FI_SEND`, `FI_RECV`, `FI_READ`, `FI_WRITE`, `FI_REMOTE_READ`, `FI_REMOTE_WRITE`).
    pub fn alloc(domain: &Arc<Domain>, len: usize, access: Flags) -> Result<Self> {
        let access = verbs_access_checked(access)?;
        let mr = sv::MemoryRegion::alloc(domain.pd(), len, access).map_err(os_err("ibv_reg_mr"))?;
        Self::from_registered(domain, mr)
    }

    /// Wraps a registration made through `rfabric-sys` (the C ABI registers caller memory),
    /// registering it again for peers when the domain uses offset addressing.
    pub fn from_registered(domain: &Arc<Domain>, mr: sv::MemoryRegion) -> Result<Self> {
        let remote_access = access::REMOTE_READ | access::REMOTE_WRITE;
        let mr = Arc::new(mr);
        let remote = if domain.offset_rma() && mr.access() & remote_access != 0 {
            let r = sv::MemoryRegion::register_iova(&mr, 0)
                .map_err(os_err("ibv_reg_mr_iova2 (offset addressing)"))?;
            Some(Arc::new(r))
        } else {
            None
        };
        let key = u64::from(remote.as_ref().unwrap_or(&mr).rkey());
        Ok(MemoryRegion {
            mr,
            remote,
            cntrs: Arc::new(RegionCounters {
                key,
                cntrs: Mutex::default(),
                domain: domain.clone(),
            }),
            domain: domain.clone(),
        })
    }

    /// Whether posted work still holds this registration (a multi-receive buffer, a
    /// receive whose `FI_SOURCE` header lands in it): the device may still write there.
    pub fn in_use(&self) -> bool {
        // The offset registration holds the memory too.
        Arc::strong_count(&self.mr) > 1 + usize::from(self.remote.is_some())
    }

    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }
    pub fn len(&self) -> usize {
        self.mr.len()
    }
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }
    /// The remote key (`fi_mr_key`): peers address the region by virtual address under
    /// it, or by offset under offset addressing.
    pub fn key(&self) -> u64 {
        u64::from(self.remote.as_ref().unwrap_or(&self.mr).rkey())
    }

    /// The address peers name its first byte by: its virtual address, or 0 under offset
    /// addressing.
    pub fn remote_addr(&self) -> u64 {
        if self.remote.is_some() {
            0
        } else {
            self.addr()
        }
    }

    #[inline(always)]
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.mr
            .write_at(offset, src)
            .map_err(|_| self.range_error(offset, src.len()))
    }
    #[inline]
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.mr
            .read_at(offset, dst)
            .map_err(|_| self.range_error(offset, dst.len()))
    }
    /// The byte at `offset`, read from memory every call: a loop may poll it for a remote
    /// write's arrival (as perftest's write latency test does).
    #[inline]
    pub fn byte_at(&self, offset: usize) -> Result<u8> {
        self.mr
            .load_byte(offset)
            .map_err(|_| self.range_error(offset, 1))
    }
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.mr
            .fill(offset, len, byte)
            .map_err(|_| self.range_error(offset, len))
    }

    pub(crate) fn range_error(&self, offset: usize, len: usize) -> Error {
        Error::new(
            errno::EINVAL,
            format!(
                "{len} bytes at offset {offset} do not fit a {}-byte memory region",
                self.len()
            ),
        )
    }

    /// `fi_mr_bind` of a counter with `FI_REMOTE_WRITE`: it counts each remote write that
    /// modifies the region, as RDM endpoints with `FI_RMA_EVENT` (or a write's remote CQ
    /// data) learn of them; reading it drives those endpoints. Bound until the region is
    /// closed.
    pub fn bind_cntr(&self, cntr: &Arc<Counter>, flags: Flags) -> Result<()> {
        if flags != Flags::REMOTE_WRITE {
            return Err(Error::new(
                errno::EINVAL,
                format!("a region counts remote writes only: bind it with FI_REMOTE_WRITE, not {flags:?}"),
            ));
        }
        if self.mr.access() & access::REMOTE_WRITE == 0 {
            return Err(Error::new(
                errno::EINVAL,
                "the region was not registered for FI_REMOTE_WRITE: no remote write can reach it to count",
            ));
        }
        if !Arc::ptr_eq(cntr.domain(), &self.domain) {
            return Err(Error::new(
                errno::EINVAL,
                "the counter belongs to another domain",
            ));
        }
        let mut list = self.cntrs.list();
        if list.iter().any(|c| Arc::ptr_eq(c, cntr)) {
            return Ok(());
        }
        cntr.bind()?;
        list.push(cntr.clone());
        drop(list);
        self.domain.count_region(&self.cntrs);
        Ok(())
    }

    pub(crate) fn sys(&self) -> &Arc<sv::MemoryRegion> {
        &self.mr
    }

    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_write_only_where_the_device_writes() {
        assert_eq!(verbs_access(Flags::SEND), 0);
        assert_eq!(
            verbs_access(Flags::WRITE | Flags::REMOTE_READ),
            access::REMOTE_READ
        );
        for f in [Flags::RECV, Flags::READ, Flags::REMOTE_WRITE] {
            assert_ne!(verbs_access(f) & access::LOCAL_WRITE, 0, "{f:?}");
        }
    }
}
