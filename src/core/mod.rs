//! The transport-agnostic engine: flags, errors, info and hint matching, event and
//! completion queue state. No I/O here, so all of it is tested on the host.

#![forbid(unsafe_code)]

pub mod addr;
pub mod atomic;
pub mod av;
pub mod cq;
pub mod env;
pub mod eq;
pub mod error;
pub mod flags;
pub mod info;
pub mod log;
pub mod mr_cache;
pub mod peer;
pub mod rdm;
pub mod srx;
