//! The C ABI: libfabric 1.17's provider interface over the Rust API. Each C object is a
//! libfabric header followed by the Rust object it stands for (`fid::Obj`); the ops tables
//! translate C calls into Rust calls. Unsafe code here is the FFI layer's: each block says
//! why it is sound.

pub(crate) mod avset;
pub(crate) mod cq;
pub(crate) mod domain;
pub(crate) mod ep;
pub(crate) mod eq;
pub(crate) mod ext;
pub(crate) mod fid;
pub mod import;
pub mod info;
pub(crate) mod nosys;
pub(crate) mod peer;
pub mod provider;
pub(crate) mod srx;
pub(crate) mod transfer;
