//! The libfabric provider library. scripts/install-provider copies it as librverbs-fi.so, the
//! name libfabric 1.17's core loads `fi_prov_ini` from; the provider itself is `rfabric::capi`.

pub use rfabric::capi::provider::fi_prov_ini;
