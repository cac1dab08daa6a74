//! The C ABI: libfabric 1.17's provider interface over the Rust API, in three parts whose
//! imports run one way (`peer` ← provider face ← `ext`):
//!
//! - the provider face that libfabric's core calls: `provider` (`fi_prov_ini`), `info`, and
//!   one file per libfabric object (`fabric`, `domain`, `mr`, `av`, `avset`, `cq`, `eq`,
//!   `pep`, `msg_ep`, `dgram_ep`, `mc`, `srx`, `soft_srx`), each MSG and DGRAM endpoint
//!   type with ops tables of its own; what they share is in `fid` (the C object model and
//!   argument helpers), `ep` (what endpoints share) and `nosys` (`-FI_ENOSYS` slots);
//! - `peer`: what other providers call into (fi_peer(3) owner side: peer SRX, CQ, AV, AV set);
//! - `ext`: what calls other providers (shm imported as a peer, `FI_PEER_TRANSFER` links,
//!   checks of foreign ops tables), reached from applications through `fi_open_ops`.
//!
//! Each C object is a libfabric header followed by the Rust object it stands for
//! (`fid::Obj`), proven ours by its ops table before use. Unsafe code here is the FFI
//! layer's: each block says why it is sound.

pub(crate) mod av;
pub(crate) mod avset;
pub(crate) mod cntr;
pub(crate) mod cq;
pub(crate) mod dgram_ep;
pub(crate) mod domain;
pub(crate) mod ep;
pub(crate) mod eq;
pub mod ext;
pub(crate) mod fabric;
pub(crate) mod fid;
#[cfg(feature = "test-support")]
pub mod harness;
pub mod info;
pub(crate) mod mc;
pub(crate) mod mr;
pub(crate) mod msg_ep;
pub(crate) mod nosys;
pub(crate) mod peer;
pub(crate) mod pep;
pub(crate) mod poll;
pub mod provider;
pub(crate) mod rdm_atomic;
pub(crate) mod rdm_ep;
pub(crate) mod rdm_rma;
pub(crate) mod soft_srx;
pub(crate) mod srx;
pub(crate) mod wait;
