//! An AV set as peers see it (`fid_peer_av_set`: `members`), over the set's members.

use std::mem::size_of;
use std::sync::{Arc, Mutex};

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, no_control, ops, Class, Obj, Owned};
use crate::core::error::{errno, Error};

/// `struct fid_peer_av_set`, then the members of the set it belongs to.
pub(crate) type PeerAvSet = Obj<fi::fid_peer_av_set, Arc<Mutex<Vec<u64>>>>;
impl Class for PeerAvSet {
    type Header = fi::fid_peer_av_set;
    const FCLASS: u32 = fi::FI_CLASS_AV_SET;
    fn fi_ops() -> &'static fi::fi_ops {
        &PEER_AV_SET_FI_OPS
    }
}

pub(crate) static PEER_AV_SET_FI_OPS: fi::fi_ops = fi_ops_of!(peer_close, no_bind, no_control);
pub(crate) static AV_SET_OWNER_OPS: fi::fi_ops_av_set_owner = fi::fi_ops_av_set_owner {
    size: size_of::<fi::fi_ops_av_set_owner>(),
    members: Some(peer_members),
};
/// The owner's peer face is freed with its set, not by the peer.
unsafe extern "C" fn peer_close(_f: *mut fi::fid) -> i32 {
    -errno::EPERM
}
/// `fi_ops_av_set_owner::members`: the set's addresses, or `-FI_ETOOSMALL` with `count`
/// set to how many there are.
unsafe extern "C" fn peer_members(
    set: *mut fi::fid_peer_av_set,
    addr: *mut fi::fi_addr_t,
    count: *mut usize,
) -> i32 {
    guarded("peer av set members", || {
        // SAFETY: the fid_peer_av_set the owner gave the peer (its ops are checked: a
        // closed set's is a tombstone).
        let s = unsafe { PeerAvSet::from_c(set, "set") }?;
        if count.is_null() {
            return Err(Error::new(errno::EINVAL, "count is NULL"));
        }
        let m = s.inner.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: checked non-NULL; the peer's in/out count.
        let room = unsafe { count.replace(m.len()) };
        if room < m.len() {
            return Err(Error::new(
                errno::ETOOSMALL,
                format!("the set has {} members, the array room for {room}", m.len()),
            ));
        }
        if !m.is_empty() {
            // SAFETY: the peer's array of `room` >= len entries, per fi_peer(3).
            let out = unsafe { crate::capi::fid::bytes_mut(addr.cast(), m.len() * 8, "addr")? };
            for (o, x) in out.chunks_exact_mut(8).zip(m.iter()) {
                o.copy_from_slice(&x.to_ne_bytes());
            }
        }
        Ok(())
    })
}
/// The `fid_peer_av_set` of a set with these members: retired with the set, so a peer
/// that asks after the set closed gets `-FI_EINVAL`.
pub(crate) fn peer_av_set(members: Arc<Mutex<Vec<u64>>>) -> Owned<PeerAvSet> {
    Owned::new(
        fi::fid_peer_av_set {
            fid: fid(
                fi::FI_CLASS_AV_SET,
                std::ptr::null_mut(),
                &PEER_AV_SET_FI_OPS,
            ),
            owner_ops: ops(&AV_SET_OWNER_OPS),
        },
        members,
    )
}
