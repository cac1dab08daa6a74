//! rverbs' extension interface, `fi_open_ops(&domain->fid, "rverbs_peer_v1", …)`
//! (`include/rfabric/fi_rverbs.h`): the owner side of fi_peer(3) for C applications:
//! importing libfabric's shm as a peer of a software SRX, and `FI_PEER_TRANSFER` links.

use std::ffi::{c_char, c_void};
use std::mem::size_of;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{c_str, fi_ops_of, fid, guarded, no_bind, no_control, put, Class, Obj};
use crate::capi::import::ShmImport;
use crate::core::error::{errno, Error};

pub(crate) const PEER_OPS_NAME: &str = "rverbs_peer_v1";

/// `struct fi_rverbs_peer_ops` of fi_rverbs.h.
#[repr(C)]
pub(crate) struct PeerOps {
    size: usize,
    import_shm: unsafe extern "C" fn(*mut fi::fid_ep, *mut *mut fi::fid) -> i32,
    import_name: unsafe extern "C" fn(*mut fi::fid, *mut c_void, *mut usize) -> i32,
    open_transfer: unsafe extern "C" fn(
        *mut fi::fid_ep,
        *mut fi::fid_domain,
        *mut fi::fi_info,
        *mut fi::fi_info,
        *mut *mut fi::fid_ep,
        *mut *mut fi::fid_ep,
    ) -> i32,
}

static PEER_OPS: PeerOps = PeerOps {
    size: size_of::<PeerOps>(),
    import_shm,
    import_name,
    open_transfer,
};

/// `fi_open_ops` of an rverbs domain.
pub(crate) unsafe extern "C" fn domain_ops_open(
    _fid: *mut fi::fid,
    name: *const c_char,
    _flags: u64,
    ops: *mut *mut c_void,
    _context: *mut c_void,
) -> i32 {
    guarded("fi_open_ops", || {
        // SAFETY: libfabric passes NULL or a string.
        let name = unsafe { c_str(name, "name") }?.unwrap_or("");
        if name != PEER_OPS_NAME {
            return Err(Error::new(
                errno::ENOSYS,
                format!("rverbs has no extension interface {name:?} (it has {PEER_OPS_NAME:?})"),
            ));
        }
        let p = std::ptr::from_ref(&PEER_OPS).cast_mut().cast::<c_void>();
        // SAFETY: the caller's out-pointer (fi_open_ops(3)).
        unsafe { put(ops, p, "ops") }
    })
}

/// The C face of a [`ShmImport`]: closed with `fi_close`.
type CImport = Obj<fi::fid, ShmImport>;
impl Class for CImport {
    type Header = fi::fid;
    const FCLASS: u32 = fi::FI_CLASS_UNSPEC;
    fn owns(f: &fi::fid) -> bool {
        std::ptr::eq(f.ops, &IMPORT_FI_OPS)
    }
}

static IMPORT_FI_OPS: fi::fi_ops = fi_ops_of!(import_close, no_bind, no_control);

unsafe extern "C" fn import_shm(srx: *mut fi::fid_ep, import: *mut *mut fi::fid) -> i32 {
    guarded("import_shm", || {
        // SAFETY: the application's SRX (fi_rverbs.h).
        let i = unsafe { ShmImport::open(srx) }?;
        let p = CImport::into_raw(
            fid(fi::FI_CLASS_UNSPEC, std::ptr::null_mut(), &IMPORT_FI_OPS),
            i,
        );
        // SAFETY: the caller's out-pointer.
        unsafe { put(import, p, "import") }.inspect_err(|_| {
            // SAFETY: just made, never handed out.
            let _ = unsafe { CImport::close(p, |_| Ok(())) };
        })
    })
}

unsafe extern "C" fn import_name(f: *mut fi::fid, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    guarded("import_name", || {
        // SAFETY: the application's import fid.
        let i = unsafe { CImport::from_c(f, "import") }?;
        let name = i.inner.name()?;
        if addrlen.is_null() {
            return Err(Error::new(errno::EINVAL, "addrlen is NULL"));
        }
        // SAFETY: non-NULL; the caller's buffer has *addrlen bytes, as in fi_getname(3).
        unsafe {
            let len = &mut *addrlen;
            let buf = crate::capi::fid::bytes_mut(addr, *len, "addr")?;
            crate::core::addr::fill_name(&name, buf, len)
        }
    })
}

unsafe extern "C" fn import_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid import_shm returned.
    guarded("fi_close(import)", || unsafe {
        CImport::close(f, |_| Ok(()))
    })
}

unsafe extern "C" fn open_transfer(
    ep: *mut fi::fid_ep,
    peer_domain: *mut fi::fid_domain,
    peer_info: *mut fi::fi_info,
    owner_info: *mut fi::fi_info,
    transfer: *mut *mut fi::fid_ep,
    peer_ep: *mut *mut fi::fid_ep,
) -> i32 {
    crate::capi::transfer::open_guarded(ep, peer_domain, peer_info, owner_info, transfer, peer_ep)
}
