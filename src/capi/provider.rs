//! The provider libfabric's core loads: `fi_prov_ini` and the `fi_provider` it returns.
//! Every entry catches panics and answers with a libfabric errno; nothing unwinds into C.

use std::cell::UnsafeCell;
use std::ffi::c_char;
use std::ptr;

use rfabric_sys::fabric as fi;

use crate::capi::fabric::fabric_open;
use crate::capi::fid::{c_str as arg, guarded};
use crate::capi::info::{from_c, list_to_c};
use crate::core::error::{errno, Error};
use crate::core::flags::Flags;
use crate::verbs::{getinfo as rverbs_getinfo, PROVIDER_NAME, PROVIDER_VERSION};

/// The flag libfabric's utility providers (`ofi_rxm`, `ofi_rxd`) add when they ask core
/// providers for endpoints to layer over (`OFI_CORE_PROV_ONLY` in `ofi.h`; not in the
/// public headers).
const OFI_CORE_PROV_ONLY: u64 = 1 << 59;

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
    fabric: Some(fabric_open),
    cleanup: Some(cleanup),
}));

/// The entry point libfabric's core looks up in `librverbs-fi.so`. It calls nothing back.
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut fi::fi_provider {
    debug_assert_eq!(PROVIDER_NAME, "rverbs");
    // The composition root: the domain finds the extension interface through this hook.
    crate::capi::ext::install();
    PROVIDER.0.get()
}

unsafe extern "C" fn getinfo(
    version: u32,
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
        if flags & OFI_CORE_PROV_ONLY != 0 {
            // rverbs has its own RDM endpoint: "rverbs;ofi_rxm" (RDM layered over rverbs' MSG
            // endpoints, RMA and all) and "rverbs;ofi_rxd" would only shadow it, and
            // applications that match providers by prefix would land there.
            return Err(Error::new(
                errno::ENODATA,
                "rverbs is not offered to libfabric's utility providers: its own FI_EP_RDM endpoint is RDM over rverbs (ask for provider \"rverbs\")",
            ));
        }
        let hints_c = hints;
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
        let mut infos = rverbs_getinfo(
            node,
            service,
            Flags::from_bits_retain(flags),
            hints.as_ref(),
        )?;
        crate::core::info::api_mr_rules(version, hints.as_ref(), &mut infos);
        if infos.is_empty() {
            return Err(Error::new(
                errno::ENODATA,
                "no rverbs interface matches the hints: FI_MR_LOCAL is required by MSG and DGRAM endpoints, and the hints' mr_mode is 0 with no FI_LOCAL_MR mode",
            ));
        }
        let list = list_to_c(&infos)?;
        // SAFETY: hints is NULL or the application's fi_info (read above); list is ours.
        unsafe {
            // An active endpoint takes its address from the passive endpoint the hints'
            // handle names (fi_endpoint(3)): libfabric's providers echo it, as does
            // `ofi_alter_info`, and fabtests' `fi_msg_sockets` asserts it.
            let handle = if hints_c.is_null() {
                std::ptr::null_mut()
            } else {
                (*hints_c).handle
            };
            let mut p = list;
            while !handle.is_null() && !p.is_null() {
                (*p).handle = handle;
                p = (*p).next;
            }
        }
        // SAFETY: info is non-NULL and writable, per fi_getinfo(3).
        unsafe { *info = list };
        Ok(())
    })
}

unsafe extern "C" fn cleanup() {
    // fi_prov_ini allocates nothing; the registration cache's monitor thread must end before
    // libfabric unloads this library.
    guarded("cleanup", || {
        crate::verbs::domain::stop_mr_monitor();
        Ok(())
    });
}
