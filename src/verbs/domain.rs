//! The domain: one verbs device and a protection domain on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rfabric_sys::verbs::{self as sv, PinnedPages, ProtectionDomain};

use crate::core::error::{errno, Error, Result};
use crate::core::flags::{Flags, MrMode};
use crate::core::info::Info;
use crate::verbs::info::{devices, Device};
use crate::verbs::mr::RegionCounters;
use crate::verbs::mr_cache::{self, Monitor, MrCache};
use crate::verbs::{os_err, CompletionQueue, Fabric};

/// An open domain (`fi_domain`): a PD on the device the info names.
#[derive(Debug)]
pub struct Domain {
    pd: Arc<ProtectionDomain>,
    device: Device,
    info: Info,
    fabric: Arc<Fabric>,
    /// RMA addresses are offsets into regions (`mr_mode` without `FI_MR_VIRT_ADDR`).
    offset_rma: bool,
    /// `FI_RVERBS_MR_CACHE_MAX_COUNT` and `_MAX_SIZE`, read at open.
    cache_limits: (usize, u64),
    /// Registrations of unregistered application memory, made at the first rendezvous
    /// that needs one (`None`: the cache is off or the kernel cannot monitor memory).
    mr_cache: OnceLock<Option<MrCache<Arc<PinnedPages>>>>,
    /// Counters bound to regions (`fi_mr_bind`), and the CQs that see remote writes.
    region_events: Mutex<RegionEvents>,
    /// Some region has a counter: notices of remote writes look it up.
    region_counted: AtomicBool,
}

/// The regions with counters bound (`FI_REMOTE_WRITE`), by the key peers write under, and
/// the CQs of the endpoints that learn of remote writes (RDM with `FI_RMA_EVENT`, and any
/// write with remote CQ data): a bound counter's reads drive those CQs.
#[derive(Debug, Default)]
struct RegionEvents {
    by_key: HashMap<u64, Weak<RegionCounters>>,
    targets: Vec<Weak<CompletionQueue>>,
}

/// The process's memory monitor for domains' registration caches.
static MONITOR: OnceLock<Option<Arc<Monitor<Arc<PinnedPages>>>>> = OnceLock::new();

/// Stops the registration caches' memory monitor, if it started: the provider is about to
/// be unloaded (libfabric's `fi_fini` calls the provider's `cleanup`, then `dlclose`), so
/// nothing may stay watched and its thread must not outlive the code it runs.
pub fn stop_mr_monitor() {
    if let Some(Some(m)) = MONITOR.get() {
        m.stop();
    }
}

impl Domain {
    pub fn open(fabric: &Arc<Fabric>, info: &Info) -> Result<Arc<Domain>> {
        let name = &info.domain_attr.name;
        let device = devices()?
            .into_iter()
            .find(|d| &d.name == name)
            .ok_or_else(|| {
                Error::new(
                    errno::ENODEV,
                    format!("no RDMA device named {name:?}: check fi_getinfo's domain name"),
                )
            })?;
        let cache_limits = mr_cache::limits()?;
        let pd = ProtectionDomain::new(device.context).map_err(os_err("ibv_alloc_pd"))?;
        crate::fi_info!("domain", "opened domain {} (pd on {})", name, device.name);
        Ok(Arc::new(Domain {
            pd,
            device,
            info: info.clone(),
            fabric: fabric.clone(),
            offset_rma: info.caps.contains(Flags::RMA)
                && !info.domain_attr.mr_mode.contains(MrMode::VIRT_ADDR),
            cache_limits,
            mr_cache: OnceLock::new(),
            region_events: Mutex::default(),
            region_counted: AtomicBool::new(false),
        }))
    }

    fn mr_cache(&self) -> Option<&MrCache<Arc<PinnedPages>>> {
        self.mr_cache
            .get_or_init(|| {
                let (count, bytes) = self.cache_limits;
                if count == 0 || bytes == 0 {
                    crate::fi_info!(
                        "mr",
                        "registration cache off (FI_RVERBS_MR_CACHE_MAX_COUNT or _MAX_SIZE is 0)"
                    );
                    return None;
                }
                // A child after fork cannot use its parent's monitor (it watches the parent).
                mr_cache::monitor(&MONITOR)
                    .filter(|m| m.ours())
                    .map(|m| MrCache::new(m, count, bytes))
            })
            .as_ref()
    }

    /// A registration of `len` bytes of the application's at `addr` for the device (a
    /// rendezvous's source or landing, an RMA's local side) with at least `access`: from the
    /// registration cache (kept while the memory stays mapped; local write and remote read),
    /// or, when the cache is off or cannot take it, made for this operation alone.
    pub(crate) fn pin(&self, addr: u64, len: usize, access: u32) -> Result<Arc<PinnedPages>> {
        const CACHED: u32 = sv::access::LOCAL_WRITE | sv::access::REMOTE_READ;
        let reg = |a, n, acc| PinnedPages::register(&self.pd, a, n, acc).map(Arc::new);
        let cached = match self.mr_cache() {
            Some(c) if access & !CACHED == 0 => c.get(addr, len, |a, n| reg(a, n, CACHED)),
            _ => Err(libc::EINVAL),
        };
        // Read-only memory cannot take local write: registered as asked, for this use.
        cached
            .or_else(|_| reg(addr, len, access))
            .map_err(|e| Error::os(e, "ibv_reg_mr of an application buffer"))
    }

    fn region_events(&self) -> std::sync::MutexGuard<'_, RegionEvents> {
        self.region_events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `region`'s counters count remote writes under its key from now on, and read
    /// through the CQs that learn of them.
    pub(crate) fn count_region(&self, region: &Arc<RegionCounters>) {
        let mut g = self.region_events();
        g.targets.retain(|w| w.strong_count() > 0);
        for cq in g.targets.iter().filter_map(Weak::upgrade) {
            region.feed_from(&cq);
        }
        g.by_key.insert(region.key(), Arc::downgrade(region));
        self.region_counted.store(true, Ordering::Release);
    }

    /// `region`, going away, counts no more (a later region may reuse its key).
    pub(crate) fn forget_region(&self, region: &RegionCounters) {
        let mut g = self.region_events();
        let ours = g
            .by_key
            .get(&region.key())
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), region));
        if ours {
            g.by_key.remove(&region.key());
        }
        self.region_counted
            .store(!g.by_key.is_empty(), Ordering::Release);
    }

    /// `cq` learns of remote writes (an RDM endpoint's receive CQ): counters bound to
    /// regions read through it.
    pub(crate) fn add_write_target(&self, cq: &Arc<CompletionQueue>) {
        let mut g = self.region_events();
        if g.targets
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(cq)))
        {
            return;
        }
        g.targets.retain(|w| w.strong_count() > 0);
        g.targets.push(Arc::downgrade(cq));
        let regions: Vec<_> = g.by_key.values().filter_map(Weak::upgrade).collect();
        // A region whose last holder is this list forgets itself under the lock: not held.
        drop(g);
        for r in regions {
            r.feed_from(cq);
        }
    }

    /// A remote write under `key` is in place: the counters bound to its region count it.
    #[inline]
    pub(crate) fn region_written(&self, key: u64) {
        if !self.region_counted.load(Ordering::Acquire) {
            return;
        }
        let r = self
            .region_events()
            .by_key
            .get(&key)
            .and_then(Weak::upgrade);
        if let Some(r) = r {
            r.count();
        }
    }

    /// Memory registrations made in this domain so far (tests: what a path registers).
    pub fn registrations(&self) -> u64 {
        self.pd().registrations()
    }

    /// What the registration cache has done (`None` while it is off or unused).
    pub fn mr_cache_stats(&self) -> Option<crate::core::mr_cache::CacheStats> {
        self.mr_cache.get()?.as_ref().map(|c| c.stats())
    }

    /// Whether peers address RMA by offset into a region (`mr_mode` without
    /// `FI_MR_VIRT_ADDR`, in a domain opened for `FI_RMA`) rather than by virtual address.
    pub fn offset_rma(&self) -> bool {
        self.offset_rma
    }

    pub fn info(&self) -> &Info {
        &self.info
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }

    pub(crate) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}
