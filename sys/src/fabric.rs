//! The libfabric 1.17 ABI as bindgen sees it, plus the constants bindgen cannot evaluate.
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    unreachable_pub,
    unsafe_op_in_unsafe_fn,
    missing_debug_implementations,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]

include!(concat!(env!("OUT_DIR"), "/fabric.rs"));

/// `((uint64_t) -1)` in `fabric.h`: a cast bindgen does not evaluate.
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;
/// `((uint64_t) -1)` in `fabric.h`.
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
/// `((uint64_t) -1)` in `fabric.h`.
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;
/// `SIZE_MAX` in `fabric.h`.
pub const FI_SHARED_CONTEXT: usize = usize::MAX;

/// `FI_VERSION(major, minor)`.
pub const fn fi_version_of(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// The API version rfabric implements and pins its C layouts to.
pub const RFABRIC_FI_VERSION: u32 = fi_version_of(1, 17);

#[doc(hidden)]
pub mod layout {
    //! Sizes and offsets as the C compiler computed them (see `build.rs`).
    use std::ffi::{c_char, CStr};

    #[repr(C)]
    struct Entry {
        name: *const c_char,
        value: usize,
    }

    extern "C" {
        static rfab_layout_table: [Entry; 0];
    }

    /// Looks up `"struct"` (its size) or `"struct.field"` (its offset) in the C table.
    pub fn c_value(name: &str) -> Option<usize> {
        let mut i = 0;
        loop {
            // SAFETY: the table is a static array terminated by a NULL name (build.rs writes
            // it), so every index read before the terminator is in bounds.
            let e = unsafe { &*rfab_layout_table.as_ptr().add(i) };
            if e.name.is_null() {
                return None;
            }
            // SAFETY: names are NUL-terminated string literals in the C table.
            let n = unsafe { CStr::from_ptr(e.name) };
            if n.to_bytes() == name.as_bytes() {
                return Some(e.value);
            }
            i += 1;
        }
    }

    /// The same names as the C table, with bindgen's sizes and offsets.
    pub fn rust_values() -> &'static [(&'static str, usize)] {
        use super::*;
        include!(concat!(env!("OUT_DIR"), "/layout.rs"))
    }
}
