//! The owner's AV as peers see it (`fid_peer_av`: `query`, `ep_addr`).

use std::mem::size_of;

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fid, guarded, no_bind, no_control, Class, Obj, Owned};
use crate::core::error::{errno, Error, Result};

/// What a peer may ask of the owner's AV.
pub(crate) trait PeerAvSource: Send + Sync {
    /// The AV's type and the number of addresses it holds now.
    fn query(&self) -> (u32, usize);
    /// The `fi_addr_t` of a local endpoint's own address, if it was inserted.
    fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64>;
}

/// The owner's AV as a peer imports it (`fid_peer_av`, passed in a `fi_peer_av_context`).
/// The 1.17 header declares that context's member as `struct fi_peer_av *`, a type it never
/// defines; it is used as a `struct fid_peer_av *`, which is what the man page says.
/// Weak: the owner's AV must outlive the peer's (fi_peer(3)) and must stay closable; the
/// `fid_peer_av` itself is kept by the owner's AV and retired with it, so a peer that
/// queries after the owner closed gets `-FI_EINVAL`.
pub(crate) type PeerAv = Obj<fi::fid_peer_av, std::sync::Weak<dyn PeerAvSource>>;
impl Class for PeerAv {
    type Header = fi::fid_peer_av;
    const FCLASS: u32 = fi::FI_CLASS_PEER_AV;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEER_AV_FI_OPS
    }
}

pub(crate) static PEER_AV_FI_OPS: fi::fi_ops =
    crate::capi::fid::fi_ops_of!(peer_av_close, no_bind, no_control);
pub(crate) static AV_OWNER_OPS: fi::fi_ops_av_owner = fi::fi_ops_av_owner {
    size: size_of::<fi::fi_ops_av_owner>(),
    query: Some(peer_av_query),
    ep_addr: Some(peer_av_ep_addr),
};

pub(crate) fn peer_av(av: std::sync::Weak<dyn PeerAvSource>) -> Owned<PeerAv> {
    Owned::new(
        fi::fid_peer_av {
            fid: fid(fi::FI_CLASS_PEER_AV, std::ptr::null_mut(), &PEER_AV_FI_OPS),
            owner_ops: crate::capi::fid::ops(&AV_OWNER_OPS),
        },
        av,
    )
}

/// # Safety
/// `av` is NULL or a `fid_peer_av` made by [`peer_av`].
unsafe fn peer_av_of<'a>(av: *mut fi::fid_peer_av) -> Result<&'a PeerAv> {
    // SAFETY: the caller's contract; the ops are checked.
    unsafe { PeerAv::from_c(av, "av") }
}

/// `query`: the AV's current attributes (its type and how many addresses it holds).
unsafe extern "C" fn peer_av_query(av: *mut fi::fid_peer_av, attr: *mut fi::fi_av_attr) -> i32 {
    guarded("peer av query", || {
        // SAFETY: the fid_peer_av the owner gave this peer, and NULL or a valid attr.
        let (a, out) = unsafe {
            (
                peer_av_of(av)?,
                attr.as_mut()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        let (av_type, count) = a
            .inner
            .upgrade()
            .ok_or_else(|| Error::new(errno::EINVAL, "the owner's AV is closed"))?
            .query();
        out.type_ = av_type;
        out.count = count;
        out.rx_ctx_bits = 0;
        out.ep_per_node = 0;
        out.name = std::ptr::null();
        out.map_addr = std::ptr::null_mut();
        out.flags = 0;
        Ok(())
    })
}

/// `ep_addr`: the address of a local endpoint in the AV, `FI_ADDR_NOTAVAIL` if absent.
unsafe extern "C" fn peer_av_ep_addr(
    av: *mut fi::fid_peer_av,
    ep: *mut fi::fid_ep,
) -> fi::fi_addr_t {
    let mut out = fi::FI_ADDR_NOTAVAIL;
    let _ = guarded("peer av ep_addr", || {
        // SAFETY: the fid_peer_av the owner gave this peer.
        let a = unsafe { peer_av_of(av) }?;
        if let Some(x) = a.inner.upgrade().and_then(|av| av.ep_addr(ep)) {
            out = x;
        }
        Ok(())
    });
    out
}

unsafe extern "C" fn peer_av_close(_f: *mut fi::fid) -> i32 {
    // The owner frees a peer's fid_peer_av when it is done with the peer.
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct FakeAv;
    impl PeerAvSource for FakeAv {
        fn query(&self) -> (u32, usize) {
            (fi::FI_AV_TABLE, 3)
        }
        fn ep_addr(&self, ep: *mut fi::fid_ep) -> Option<u64> {
            (!ep.is_null()).then_some(2)
        }
    }

    #[test]
    fn a_peer_queries_the_owner_av_and_finds_endpoints_in_it() {
        let fake: Arc<dyn PeerAvSource> = Arc::new(FakeAv);
        let pa = peer_av(Arc::downgrade(&fake));
        let av: *mut fi::fid_peer_av = pa.raw();
        // SAFETY: the owner ops, called as a peer does; attr is a plain C struct.
        unsafe {
            let o = &*pa.hdr.owner_ops;
            let mut attr: fi::fi_av_attr = std::mem::zeroed();
            attr.flags = 99;
            assert_eq!((o.query.unwrap())(av, &mut attr), 0);
            assert_eq!(
                (attr.type_, attr.count, attr.flags),
                (fi::FI_AV_TABLE, 3, 0)
            );
            assert_eq!((o.query.unwrap())(av, std::ptr::null_mut()), -errno::EINVAL);
            let mut some_ep: fi::fid_ep = std::mem::zeroed();
            assert_eq!((o.ep_addr.unwrap())(av, &mut some_ep), 2);
            assert_eq!(
                (o.ep_addr.unwrap())(av, std::ptr::null_mut()),
                fi::FI_ADDR_NOTAVAIL
            );
            let mut wrong = fid(fi::FI_CLASS_AV, std::ptr::null_mut(), &PEER_AV_FI_OPS);
            assert_eq!(
                (o.ep_addr.unwrap())((&raw mut wrong).cast(), &mut some_ep),
                fi::FI_ADDR_NOTAVAIL
            );
        }
    }
}
