//! The domain: one verbs device and a protection domain on it.

use std::sync::Arc;

use rfabric_sys::verbs::ProtectionDomain;

use crate::core::error::{errno, Error, Result};
use crate::core::flags::{Flags, MrMode};
use crate::core::info::Info;
use crate::verbs::info::{devices, Device};
use crate::verbs::{os_err, Fabric};

/// An open domain (`fi_domain`): a PD on the device the info names.
#[derive(Debug)]
pub struct Domain {
    pd: Arc<ProtectionDomain>,
    device: Device,
    info: Info,
    fabric: Arc<Fabric>,
    /// RMA addresses are offsets into regions (`mr_mode` without `FI_MR_VIRT_ADDR`).
    offset_rma: bool,
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
        let pd = ProtectionDomain::new(device.context).map_err(os_err("ibv_alloc_pd"))?;
        crate::fi_info!("domain", "opened domain {} (pd on {})", name, device.name);
        Ok(Arc::new(Domain {
            pd,
            device,
            info: info.clone(),
            fabric: fabric.clone(),
            offset_rma: info.caps.contains(Flags::RMA)
                && !info.domain_attr.mr_mode.contains(MrMode::VIRT_ADDR),
        }))
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
