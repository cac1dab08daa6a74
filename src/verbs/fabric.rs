//! The fabric object: the root of the rverbs object tree.

use std::sync::Arc;

use crate::core::error::{errno, Error, Result};
use crate::core::info::FabricAttr;
use crate::verbs::PROVIDER_NAME;

/// An open fabric (`fi_fabric`).
#[derive(Debug)]
pub struct Fabric {
    attr: FabricAttr,
}

impl Fabric {
    /// Opens the fabric an info names (`fi_fabric(info->fabric_attr, …)`).
    pub fn open(attr: &FabricAttr) -> Result<Arc<Fabric>> {
        if !attr.prov_name.is_empty() && attr.prov_name != PROVIDER_NAME {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "fabric attributes name provider {:?}, not rverbs",
                    attr.prov_name
                ),
            ));
        }
        crate::verbs::install_sys_log();
        Ok(Arc::new(Fabric { attr: attr.clone() }))
    }

    pub fn attr(&self) -> &FabricAttr {
        &self.attr
    }
}
