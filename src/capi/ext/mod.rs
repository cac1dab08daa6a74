//! rverbs' extension interface, `fi_open_ops(&domain->fid, "rverbs_peer_v1", …)`
//! (`include/rfabric/fi_rverbs.h`): the owner side of fi_peer(3) for C applications:
//! importing libfabric's shm as a peer of a software SRX, and `FI_PEER_TRANSFER` links.

use std::ffi::{c_char, c_void};
use std::mem::size_of;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{c_str, fi_ops_of, fid, guarded, no_bind, no_control, put, Class, Obj};
use crate::capi::peer::av::PeerAvSource;

pub(crate) mod foreign;
pub mod import;
pub mod local;
pub(crate) mod transfer;

use crate::core::error::{errno, Error};
use import::ShmImport;

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
    open_peer_domain: unsafe extern "C" fn(
        *mut fi::fid_domain,
        *mut fi::fid_fabric,
        *mut fi::fi_info,
        *mut *mut fi::fid_domain,
    ) -> i32,
    open_peer_eq: unsafe extern "C" fn(
        *mut fi::fid_eq,
        *mut fi::fid_fabric,
        *mut fi::fi_eq_attr,
        *mut *mut fi::fid_eq,
    ) -> i32,
    open_peer_av_set:
        unsafe extern "C" fn(*mut fi::fid_av_set, *mut fi::fid_av, *mut *mut fi::fid_av_set) -> i32,
    open_peer_av: unsafe extern "C" fn(
        *mut fi::fid_av,
        *mut fi::fid_domain,
        *mut fi::fi_av_attr,
        *mut *mut fi::fid_av,
    ) -> i32,
}

static PEER_OPS: PeerOps = PeerOps {
    size: size_of::<PeerOps>(),
    import_shm,
    import_name,
    open_transfer: transfer::open_transfer,
    open_peer_domain,
    open_peer_eq,
    open_peer_av_set,
    open_peer_av,
};

/// A context handed to a peer's open (fi_peer(3)), kept by the owner object it names until
/// that object closes ([`crate::capi::fid::Obj::keep_for_peer`]).
struct Kept<T>(#[allow(dead_code)] T); // held for the peer to read, never read here
                                       // SAFETY: plain C structs holding the owner's own handle, and the owner's `fid_peer_av`;
                                       // only read by the peer.
unsafe impl<T> Send for Kept<T> {}

/// The owner's AV as a peer's `fid_peer_av` asks about it: its size, and where the owner's
/// own datagram endpoints are in it.
struct OwnerAv(std::sync::Weak<crate::verbs::AddressVector>);

impl PeerAvSource for OwnerAv {
    fn query(&self) -> (u32, usize) {
        match self.0.upgrade() {
            Some(av) => (av.attr().av_type.raw(), av.len()),
            None => (fi::FI_AV_UNSPEC, 0),
        }
    }

    fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64> {
        let av = self.0.upgrade()?;
        // SAFETY: the peer passes one of the owner's endpoints; its ops are checked.
        let name = unsafe { crate::capi::dgram_ep::dgram_name(ep) }?;
        av.find(&name)
    }
}

/// fi_peer(3) peer domain: the owner calls the peer's `fi_domain2(FI_PEER)` with a
/// `fi_peer_domain_context` naming the owner's domain, which the peer may then use (to
/// register memory with the owner, for one).
unsafe extern "C" fn open_peer_domain(
    owner: *mut fi::fid_domain,
    peer_fabric: *mut fi::fid_fabric,
    peer_info: *mut fi::fi_info,
    peer_domain: *mut *mut fi::fid_domain,
) -> i32 {
    guarded("open_peer_domain", || {
        // SAFETY: the application's rverbs domain and the peer's fabric (fi_rverbs.h).
        let (dom, domain2) = unsafe {
            let dom = crate::capi::domain::CDomain::from_c(owner, "domain")?;
            let f = peer_fabric
                .as_ref()
                .and_then(|f| f.ops.as_ref())
                .ok_or_else(|| Error::new(errno::EINVAL, "peer_fabric is NULL"))?;
            let d2 = if foreign::has_slot(f.size, std::mem::offset_of!(fi::fi_ops_fabric, domain2))
            {
                f.domain2
            } else {
                None
            };
            (dom, d2)
        };
        let domain2 = domain2.ok_or_else(|| {
            Error::new(
                errno::ENOSYS,
                "the peer provider has no fi_domain2: it cannot take a peer domain",
            )
        })?;
        let mut ctx = Box::new(fi::fi_peer_domain_context {
            size: size_of::<fi::fi_peer_domain_context>(),
            domain: owner,
        });
        // SAFETY: the peer's fi_domain2 with FI_PEER and its context (fi_peer(3)).
        let rc = unsafe {
            domain2(
                peer_fabric,
                peer_info,
                peer_domain,
                fi::FI_PEER,
                (&raw mut *ctx).cast(),
            )
        };
        if rc != 0 {
            return Err(Error::new(-rc, "the peer's fi_domain2(FI_PEER)"));
        }
        dom.keep_for_peer(Box::new(Kept(ctx)));
        Ok(())
    })
}

/// fi_peer(3) peer EQ: the owner calls the peer's `fi_eq_open` with `FI_PEER` in the
/// attributes' flags and a `fi_peer_eq_context` naming the owner's EQ, where the peer then
/// writes its events (`fi_eq_write`).
unsafe extern "C" fn open_peer_eq(
    owner: *mut fi::fid_eq,
    peer_fabric: *mut fi::fid_fabric,
    attr: *mut fi::fi_eq_attr,
    peer_eq: *mut *mut fi::fid_eq,
) -> i32 {
    guarded("open_peer_eq", || {
        // SAFETY: the application's rverbs EQ, the peer's fabric and NULL or an attr.
        let (eq, eq_open, mut a) = unsafe {
            let eq = crate::capi::eq::CEq::from_c(owner, "eq")?;
            let f = peer_fabric
                .as_ref()
                .and_then(|f| f.ops.as_ref())
                .ok_or_else(|| Error::new(errno::EINVAL, "peer_fabric is NULL"))?;
            let a = attr.as_ref().copied().unwrap_or_else(|| std::mem::zeroed());
            (eq, f.eq_open, a)
        };
        let eq_open = eq_open
            .ok_or_else(|| Error::new(errno::ENOSYS, "the peer provider has no fi_eq_open"))?;
        a.flags |= fi::FI_PEER;
        let mut ctx = Box::new(fi::fi_peer_eq_context {
            size: size_of::<fi::fi_peer_eq_context>(),
            eq: owner,
        });
        // SAFETY: the peer's fi_eq_open with FI_PEER and its context (fi_peer(3)).
        let rc = unsafe { eq_open(peer_fabric, &mut a, peer_eq, (&raw mut *ctx).cast()) };
        if rc != 0 {
            return Err(Error::new(-rc, "the peer's fi_eq_open(FI_PEER)"));
        }
        eq.keep_for_peer(Box::new(Kept(ctx)));
        Ok(())
    })
}

/// Lets `fi_open_ops` of a domain find this interface (see `fid::DOMAIN_EXTENSION`).
pub(crate) fn install() {
    let _ = crate::capi::fid::DOMAIN_EXTENSION.set(domain_ops_open);
}

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
    fn fi_ops() -> &'static fi::fi_ops {
        &IMPORT_FI_OPS
    }
}

pub(crate) static IMPORT_FI_OPS: fi::fi_ops = fi_ops_of!(import_close, no_bind, no_control);

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

/// fi_peer(3) peer AV set: the peer's `fi_av_set(FI_PEER)` with the owner's set.
unsafe extern "C" fn open_peer_av_set(
    set: *mut fi::fid_av_set,
    peer_av: *mut fi::fid_av,
    peer_set: *mut *mut fi::fid_av_set,
) -> i32 {
    guarded("open_peer_av_set", || {
        // SAFETY: the application's rverbs AV set and the peer's AV (fi_rverbs.h).
        let (s, ctx) = unsafe { crate::capi::avset::open_peer(set, peer_av, peer_set) }?;
        s.keep_for_peer(Box::new(Kept(ctx)));
        Ok(())
    })
}

/// fi_peer(3) peer AV: the peer's `fi_av_open` with `FI_PEER` in the attributes' flags and
/// a `fi_peer_av_context` naming the owner's AV as a `fid_peer_av` (`query`, `ep_addr`).
/// The 1.17 header types that member as `struct fi_peer_av *`, which it never defines.
unsafe extern "C" fn open_peer_av(
    owner: *mut fi::fid_av,
    peer_domain: *mut fi::fid_domain,
    attr: *mut fi::fi_av_attr,
    peer_av: *mut *mut fi::fid_av,
) -> i32 {
    guarded("open_peer_av", || {
        // SAFETY: the application's rverbs AV, the peer's domain and NULL or an attr.
        let (c_av, av_open, mut a) = unsafe {
            let av = crate::capi::av::CAv::from_c(owner, "av")?;
            let d = peer_domain
                .as_ref()
                .and_then(|d| d.ops.as_ref())
                .ok_or_else(|| Error::new(errno::EINVAL, "peer_domain is NULL"))?;
            let a = attr.as_ref().copied().unwrap_or_else(|| std::mem::zeroed());
            (av, d.av_open, a)
        };
        let av_open = av_open
            .ok_or_else(|| Error::new(errno::ENOSYS, "the peer domain has no fi_av_open"))?;
        let src: std::sync::Arc<dyn PeerAvSource> =
            std::sync::Arc::new(OwnerAv(std::sync::Arc::downgrade(&c_av.inner)));
        let p = crate::capi::peer::av::peer_av(std::sync::Arc::downgrade(&src));
        // The adapter lives as long as the context that names it.
        c_av.keep_for_peer(Box::new(Kept(src.clone())));
        drop(src);
        let mut ctx = Box::new(fi::fi_peer_av_context {
            size: size_of::<fi::fi_peer_av_context>(),
            av: p.raw().cast(),
        });
        a.flags |= fi::FI_PEER;
        // SAFETY: the peer's fi_av_open with FI_PEER and its context (fi_peer(3)).
        let rc = unsafe { av_open(peer_domain, &mut a, peer_av, (&raw mut *ctx).cast()) };
        if rc != 0 {
            return Err(Error::new(-rc, "the peer's fi_av_open(FI_PEER)"));
        }
        c_av.keep_for_peer(Box::new(Kept((p, ctx))));
        Ok(())
    })
}
