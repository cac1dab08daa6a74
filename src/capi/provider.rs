//! The provider libfabric's core loads: `fi_prov_ini` and the `fi_provider` it returns.
//! Every entry catches panics and answers with a libfabric errno; nothing unwinds into C.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use rfabric_sys::fabric as fi;

use crate::capi::info::{from_c, list_to_c};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::verbs::{getinfo as rverbs_getinfo, PROVIDER_NAME, PROVIDER_VERSION};

/// The provider struct, in writable memory: the core writes its `context`.
struct ProviderCell(UnsafeCell<fi::fi_provider>);

// SAFETY: the core is the only writer (of `context`), once, while loading the provider.
unsafe impl Sync for ProviderCell {}

static PROVIDER: ProviderCell = ProviderCell(UnsafeCell::new(fi::fi_provider {
    version: PROVIDER_VERSION,
    fi_version: fi::RFABRIC_FI_VERSION,
    context: fi::fi_context {
        internal: [ptr::null_mut(); 4],
    },
    name: c"rverbs".as_ptr(),
    getinfo: Some(getinfo),
    fabric: Some(fabric),
    cleanup: Some(cleanup),
}));

/// The entry point libfabric's core looks up in `librverbs-fi.so`. It calls nothing back.
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut fi::fi_provider {
    debug_assert_eq!(PROVIDER_NAME, "rverbs");
    PROVIDER.0.get()
}

/// Runs `f`, turning an error into `-errno` and a panic into `-FI_EOTHER`.
fn guarded(what: &str, f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            crate::fi_info!("core", "{what}: {e}");
            -e.errno()
        }
        Err(_) => {
            crate::fi_warn!(
                "core",
                "{what}: internal error (panic caught at the C boundary)"
            );
            -errno::EOTHER
        }
    }
}

/// A C string argument (NULL: none).
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn arg<'a>(s: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(Some)
        .map_err(|_| Error::new(errno::EINVAL, format!("{what} is not UTF-8")))
}

unsafe extern "C" fn getinfo(
    _version: u32,
    node: *const c_char,
    service: *const c_char,
    flags: u64,
    hints: *const fi::fi_info,
    info: *mut *mut fi::fi_info,
) -> i32 {
    guarded("getinfo", || {
        if info.is_null() {
            return Err(Error::new(errno::EINVAL, "info is NULL"));
        }
        // SAFETY: libfabric passes NULL or valid strings and hints, per fi_getinfo(3).
        let (node, service, hints) = unsafe {
            (
                arg(node, "node")?,
                arg(service, "service")?,
                if hints.is_null() {
                    None
                } else {
                    Some(from_c(hints)?)
                },
            )
        };
        let infos = rverbs_getinfo(
            node,
            service,
            Flags::from_bits_retain(flags),
            hints.as_ref(),
        )?;
        let list = list_to_c(&infos)?;
        // SAFETY: info is non-NULL and writable, per fi_getinfo(3).
        unsafe { *info = list };
        Ok(())
    })
}

unsafe extern "C" fn fabric(
    _attr: *mut fi::fi_fabric_attr,
    _fabric: *mut *mut fi::fid_fabric,
    _context: *mut c_void,
) -> i32 {
    guarded("fabric", || {
        Err(Error::new(
            errno::ENOSYS,
            "fi_fabric through the C ABI is not implemented yet (issue 7)",
        ))
    })
}

unsafe extern "C" fn cleanup() {
    // fi_prov_ini allocates nothing.
}
