//! The C ABI: libfabric 1.17's provider interface over the Rust API (issue 7, under way).
//! Unsafe code here is the FFI layer's: each block says why it is sound.

pub mod info;
pub mod provider;
