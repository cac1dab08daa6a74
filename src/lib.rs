//! rfabric: a kernel-bypass RDMA provider on rdma-core verbs, in the libfabric provider model.
//!
//! - [`core`]: transport-agnostic state (flags, errors, info matching, EQ/CQ queues).
//! - [`verbs`]: the `rverbs` main provider: devices, domains, CQs, EQs, RC endpoints.

pub mod capi;
pub mod core;
pub mod verbs;

pub use crate::core::error::{errno, Error, Result};
pub use crate::core::flags::*;
pub use crate::core::info::*;
