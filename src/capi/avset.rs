//! AV sets (`fi_av_set`, fi_av_set(3)) over an rverbs AV, and their owner face for peers
//! (fi_peer(3) peer AV set): a `fid_peer_av_set` whose `members` lists the set's
//! addresses. rverbs runs no collectives, so `fi_av_set_addr` is `-FI_ENOSYS`.
//!
//! The 1.17 header types `fi_peer_av_set_context.av_set` as `struct fi_peer_av_set *`, a
//! type it never defines (the man page too); the header wins, and the pointer given is the
//! owner's `struct fid_peer_av_set`.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex, MutexGuard};

use rfabric_sys::fabric as fi;

use crate::capi::fid::{fi_ops_of, fid, guarded, no_bind, no_control, ops, put, Class, Obj, Owned};
use crate::capi::peer::av_set::{peer_av_set, PeerAvSet};
use crate::core::error::{errno, Error, Result};
use crate::verbs::AddressVector;

pub(crate) struct AvSet {
    av: Arc<AddressVector>,
    members: Arc<Mutex<Vec<u64>>>,
    /// What peers import, over the same members; retired with the set, so a peer that
    /// asks after the set closed gets `-FI_EINVAL`.
    peer: Owned<PeerAvSet>,
}

impl AvSet {
    fn members(&self) -> MutexGuard<'_, Vec<u64>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The owner's `fid_peer_av_set`, for a peer's `fi_av_set(FI_PEER)`.
    pub(crate) fn peer(&self) -> *mut fi::fid_peer_av_set {
        self.peer.raw()
    }

    fn check(&self, addr: u64) -> Result<()> {
        self.av.with_peer(addr, |_| ()).map_err(|_| {
            Error::new(
                errno::EINVAL,
                format!("fi_addr {addr} is not in the set's AV"),
            )
        })
    }
}

pub(crate) type CAvSet = Obj<fi::fid_av_set, AvSet>;
impl Class for CAvSet {
    type Header = fi::fid_av_set;
    const FCLASS: u32 = fi::FI_CLASS_AV_SET;
    fn fi_ops() -> &'static fi::fi_ops {
        &AV_SET_FI_OPS
    }
}

pub(crate) static AV_SET_FI_OPS: fi::fi_ops = fi_ops_of!(set_close, no_bind, no_control);
pub(crate) static AV_SET_OPS: fi::fi_ops_av_set = fi::fi_ops_av_set {
    size: size_of::<fi::fi_ops_av_set>(),
    set_union: Some(set_union),
    intersect: Some(set_intersect),
    diff: Some(set_diff),
    insert: Some(set_insert),
    remove: Some(set_remove),
    addr: Some(set_addr),
};

/// `fi_av_set`: `count` addresses from `start_addr` to `end_addr` by `stride` (none when
/// `count` is 0).
///
/// # Safety
/// `attr` is NULL or valid; `set` is NULL or writable.
pub(crate) unsafe fn open(
    av: &Arc<AddressVector>,
    attr: *mut fi::fi_av_set_attr,
    set: *mut *mut fi::fid_av_set,
    context: *mut c_void,
) -> i32 {
    guarded("fi_av_set", || {
        // SAFETY: the application's AV and NULL or an attr (fi_av_set(3)).
        let (av, a) = unsafe {
            (
                av,
                attr.as_ref()
                    .ok_or_else(|| Error::new(errno::EINVAL, "attr is NULL"))?,
            )
        };
        crate::capi::fid::no_peer_open(a.flags, "fi_av_set")?;
        if a.flags != 0 {
            return Err(Error::new(
                errno::EBADFLAGS,
                format!("fi_av_set flags {:#x} are not supported", a.flags),
            ));
        }
        if a.comm_key_size != 0 {
            return Err(crate::capi::fid::enosys(
                "fi_av_set with a comm_key (collective offload)",
            ));
        }
        // count is what the caller asks for, not what the range holds: grown as filled.
        let mut members = Vec::with_capacity(a.count.min(1024));
        if a.count > 0 {
            if a.stride == 0 || a.end_addr < a.start_addr {
                return Err(Error::new(
                    errno::EINVAL,
                    "an AV set range needs stride > 0 and start_addr <= end_addr",
                ));
            }
            let mut at = a.start_addr;
            while members.len() < a.count && at <= a.end_addr {
                members.push(at);
                at = match at.checked_add(a.stride) {
                    Some(n) => n,
                    None => break,
                };
            }
        }
        let members = Arc::new(Mutex::new(members));
        let s = CAvSet::into_raw(
            fi::fid_av_set {
                fid: fid(fi::FI_CLASS_AV_SET, context, &AV_SET_FI_OPS),
                ops: ops(&AV_SET_OPS),
            },
            AvSet {
                av: av.clone(),
                members: members.clone(),
                peer: peer_av_set(members),
            },
        );
        // SAFETY: just made, open.
        let r = unsafe {
            let o = CAvSet::from_c(s, "set")?;
            let m = o.inner.members().clone();
            m.iter().try_for_each(|&x| o.inner.check(x))
        };
        // SAFETY: checked for NULL, writable per fi_av_set(3).
        r.and_then(|()| unsafe { put(set, s, "set") })
            .inspect_err(|_| {
                // SAFETY: just made, never handed out.
                let _ = unsafe { CAvSet::close(s, |_| Ok(())) };
            })
    })
}

unsafe extern "C" fn set_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid fi_av_set returned.
    guarded("fi_close(av set)", || unsafe {
        CAvSet::close(f.cast(), |_| Ok(()))?;
        Ok(())
    })
}

/// `dst` changed by what `src` holds.
fn combine(
    what: &str,
    dst: *mut fi::fid_av_set,
    src: *const fi::fid_av_set,
    f: impl FnOnce(&mut Vec<u64>, &[u64]),
) -> i32 {
    guarded(what, || {
        // SAFETY: the application's sets.
        let (d, s) = unsafe { (CAvSet::from_c(dst, "dst")?, CAvSet::from_c(src, "src")?) };
        if !Arc::ptr_eq(&d.inner.av, &s.inner.av) {
            return Err(Error::new(
                errno::EINVAL,
                "the two AV sets belong to different AVs",
            ));
        }
        if std::ptr::eq(d, s) {
            let copy = d.inner.members().clone();
            f(&mut d.inner.members(), &copy);
        } else {
            let from = s.inner.members().clone();
            f(&mut d.inner.members(), &from);
        }
        Ok(())
    })
}

unsafe extern "C" fn set_union(dst: *mut fi::fid_av_set, src: *const fi::fid_av_set) -> i32 {
    combine("fi_av_set_union", dst, src, |d, s| {
        for &x in s {
            if !d.contains(&x) {
                d.push(x);
            }
        }
    })
}

unsafe extern "C" fn set_intersect(dst: *mut fi::fid_av_set, src: *const fi::fid_av_set) -> i32 {
    combine("fi_av_set_intersect", dst, src, |d, s| {
        d.retain(|x| s.contains(x))
    })
}

unsafe extern "C" fn set_diff(dst: *mut fi::fid_av_set, src: *const fi::fid_av_set) -> i32 {
    combine("fi_av_set_diff", dst, src, |d, s| {
        d.retain(|x| !s.contains(x))
    })
}

unsafe extern "C" fn set_insert(set: *mut fi::fid_av_set, addr: fi::fi_addr_t) -> i32 {
    guarded("fi_av_set_insert", || {
        // SAFETY: the application's set.
        let s = &unsafe { CAvSet::from_c(set, "set") }?.inner;
        s.check(addr)?;
        let mut m = s.members();
        if m.contains(&addr) {
            return Err(Error::new(
                errno::EINVAL,
                format!("fi_addr {addr} is already in the set"),
            ));
        }
        m.push(addr);
        Ok(())
    })
}

unsafe extern "C" fn set_remove(set: *mut fi::fid_av_set, addr: fi::fi_addr_t) -> i32 {
    guarded("fi_av_set_remove", || {
        // SAFETY: the application's set.
        let s = &unsafe { CAvSet::from_c(set, "set") }?.inner;
        let mut m = s.members();
        let at = m.iter().position(|&x| x == addr).ok_or_else(|| {
            Error::new(errno::EINVAL, format!("fi_addr {addr} is not in the set"))
        })?;
        m.remove(at);
        Ok(())
    })
}

unsafe extern "C" fn set_addr(_set: *mut fi::fid_av_set, _coll: *mut fi::fi_addr_t) -> i32 {
    guarded("fi_av_set_addr", || {
        Err(crate::capi::fid::enosys(
            "fi_av_set_addr (collective addresses: rverbs runs no collectives)",
        ))
    })
}

/// Calls the peer's `fi_av_set` on its AV with `FI_PEER` and a `fi_peer_av_set_context`
/// naming this set's owner face.
///
/// # Safety
/// `set` is NULL or a live fid of this library; `peer_av` NULL or the peer's live AV.
pub(crate) unsafe fn open_peer<'a>(
    set: *mut fi::fid_av_set,
    peer_av: *mut fi::fid_av,
    peer_set: *mut *mut fi::fid_av_set,
) -> Result<(&'a CAvSet, Box<fi::fi_peer_av_set_context>)> {
    // SAFETY: the caller's contract.
    let c = unsafe { CAvSet::from_c(set, "set") }?;
    let s = &c.inner;
    // SAFETY: the caller's contract; the ops table's size says which slots exist.
    let av_set = unsafe {
        peer_av
            .as_ref()
            .and_then(|a| a.ops.as_ref())
            .ok_or_else(|| Error::new(errno::EINVAL, "peer_av is NULL"))?
            .av_set
    }
    .ok_or_else(|| Error::new(errno::ENOSYS, "the peer's AV has no fi_av_set"))?;
    let mut ctx = Box::new(fi::fi_peer_av_set_context {
        size: size_of::<fi::fi_peer_av_set_context>(),
        av_set: s.peer().cast(),
    });
    // SAFETY: a zeroed attr is valid C.
    let mut a: fi::fi_av_set_attr = unsafe { std::mem::zeroed() };
    a.flags = fi::FI_PEER;
    // SAFETY: the peer's fi_av_set with the context fi_peer(3) defines.
    let rc = unsafe { av_set(peer_av, &mut a, peer_set, (&raw mut *ctx).cast()) };
    if rc != 0 {
        return Err(Error::new(-rc, "the peer's fi_av_set(FI_PEER)"));
    }
    Ok((c, ctx))
}
