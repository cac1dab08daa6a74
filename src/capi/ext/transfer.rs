//! `FI_PEER_TRANSFER` (fi_peer(3)) from the owner's side: rverbs opens a peer provider's
//! endpoint with `fi_endpoint2(FI_PEER_TRANSFER)`, handing it a transfer endpoint over one
//! of rverbs' connected endpoints. What the peer posts there (sends and receives on the same
//! RC queue pair) completes through the peer's `complete`/`comperr` callbacks, never on the
//! application's CQ.
//!
//! Callbacks run from inside reads of the endpoint's CQ, with no lock of ours held, so a
//! callback may post again, read or write CQs, or register memory. A completion that comes
//! while one of the same link's callbacks runs (on this thread, from a read inside the
//! callback, or on another) is queued and delivered by the running delivery after the
//! callback returns: the callbacks are never entered recursively.
//!
//! The `ep` argument of the callbacks is the peer's endpoint (the one `fi_endpoint2`
//! returned), the object whose `peer_ops` they are. Receives posted through the transfer
//! endpoint share the queue pair's receive queue with the application's, in posting order:
//! RC has no header to tell them apart.

use std::ffi::c_void;
use std::mem::size_of;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Weak};

use rfabric_sys::fabric as fi;

use crate::capi::ep::{on_buf, on_iov, on_msg};
use crate::capi::fid::{
    fi_ops_of, fid, guarded, guarded_len, no_bind, no_control, ops, Class, Obj,
};
use crate::capi::msg_ep::CMsgEp;
use crate::capi::nosys;
use crate::capi::rdm_ep::{
    CRdmEp, CRdmTransferEp, RdmTransferEp, TransferClose, RDM_EP_MSG, RDM_EP_TAGGED,
    RDM_TRANSFER_FI_OPS,
};
use crate::capi::srx::{SRX_CM, SRX_OPS};
use crate::core::cq::{CqEntry, CqErrEntry};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;
use crate::core::peer::Delivery;
use crate::verbs::cq::PeerTransferSink;
use crate::verbs::{MsgEndpoint, RdmEndpoint};

/// A transfer's completion, and its source (`FI_ADDR_NOTAVAIL` over a connected endpoint).
type Completion = (std::result::Result<CqEntry, CqErrEntry>, u64);

/// The owner's end of one peer transfer link: where completions wait for the peer
/// (delivered by `core::peer::Delivery`: in order, never re-entering the callbacks).
pub(crate) struct TransferLink {
    peer_ep: AtomicPtr<fi::fid_ep>,
    peer_ops: AtomicPtr<fi::fi_ops_transfer_peer>,
    delivery: Delivery<Completion>,
}

impl TransferLink {
    fn new(depth: usize) -> Self {
        TransferLink {
            peer_ep: AtomicPtr::new(null_mut()),
            peer_ops: AtomicPtr::new(null_mut()),
            delivery: Delivery::new(depth),
        }
    }

    /// The peer's endpoint and callbacks are known: deliver what waited and what comes.
    fn open(&self, peer_ep: *mut fi::fid_ep, ops: *mut fi::fi_ops_transfer_peer) {
        self.peer_ep.store(peer_ep, Ordering::SeqCst);
        self.peer_ops.store(ops, Ordering::SeqCst);
        self.delivery.open(|c| self.call(c));
    }

    /// Ends deliveries for a closing link (waiting for one running on another thread) and
    /// returns the peer's endpoint to close.
    fn detach(&self) -> *mut fi::fid_ep {
        let dropped = self.delivery.detach();
        if dropped > 0 {
            crate::fi_info!(
                "peer",
                "{dropped} completions of a closing peer transfer link dropped"
            );
        }
        self.peer_ops.store(null_mut(), Ordering::SeqCst);
        self.peer_ep.swap(null_mut(), Ordering::SeqCst)
    }

    fn call(&self, (c, src): Completion) {
        let ep = self.peer_ep.load(Ordering::SeqCst);
        let ops = self.peer_ops.load(Ordering::SeqCst);
        // SAFETY: set together once the peer's fi_endpoint2 returned; the peer's endpoint and
        // ops stay valid until the link is closed, which unregisters it first.
        let Some(ops) = (unsafe { ops.as_ref() }) else {
            // Only once the link is closed: the peer's endpoint is gone.
            crate::fi_info!(
                "peer",
                "a completion for a closed peer transfer link dropped"
            );
            return;
        };
        let rc = match c {
            Ok(e) => {
                let mut t = fi::fi_cq_tagged_entry {
                    op_context: e.op_context as *mut c_void,
                    flags: e.flags,
                    len: e.len,
                    buf: e.buf as *mut c_void,
                    data: e.data,
                    tag: e.tag,
                };
                let mut src = src;
                // SAFETY: the peer's callback, checked non-NULL at setup, with valid entries.
                unsafe { (ops.complete.expect("checked at setup"))(ep, &mut t, &mut src) }
            }
            Err(e) => {
                // SAFETY: a zeroed entry is valid C (NULL error data).
                let mut ce: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
                crate::capi::cq::put_err_entry(&mut ce, &e);
                // SAFETY: as above.
                unsafe { (ops.comperr.expect("checked at setup"))(ep, &mut ce) }
            }
        };
        if rc < 0 {
            crate::fi_warn!(
                "peer",
                "a peer's completion callback returned {}",
                crate::core::error::strerror((-rc) as i32)
            );
        }
    }
}

impl PeerTransferSink for TransferLink {
    fn completion(&self, c: std::result::Result<CqEntry, CqErrEntry>, src: u64) {
        self.delivery.push((c, src), |c| self.call(c));
    }
}

/// The endpoint a peer posts its transfers on (`fi_peer_transfer_context.ep`).
pub(crate) struct TransferEp {
    ep: MsgEndpoint,
    link: Arc<TransferLink>,
    ctx: Box<fi::fi_peer_transfer_context>,
}

pub(crate) type CTransferEp = Obj<fi::fid_ep, TransferEp>;
impl Class for CTransferEp {
    type Header = fi::fid_ep;
    const FCLASS: u32 = fi::FI_CLASS_EP;
    fn fi_ops() -> &'static fi::fi_ops {
        &TRANSFER_FI_OPS
    }
}

pub(crate) static TRANSFER_FI_OPS: fi::fi_ops = fi_ops_of!(transfer_close, no_bind, no_control);
pub(crate) static TRANSFER_MSG: fi::fi_ops_msg = fi::fi_ops_msg {
    size: size_of::<fi::fi_ops_msg>(),
    recv: Some(t_recv),
    recvv: Some(t_recvv),
    recvmsg: Some(t_recvmsg),
    send: Some(t_send),
    sendv: Some(t_sendv),
    sendmsg: Some(t_sendmsg),
    inject: Some(t_inject),
    senddata: Some(t_senddata),
    injectdata: Some(t_injectdata),
};

/// Opens `peer_domain`'s endpoint with `FI_PEER_TRANSFER` over rverbs' enabled MSG or
/// RDM endpoint `ep`. Returns the transfer endpoint (closing it closes the peer's endpoint
/// first) and the peer's endpoint.
///
/// # Safety
/// `ep` is NULL or a live fid of this library; `peer_domain` is NULL or a live domain of
/// the peer provider; the infos are NULL or valid and outlive the link.
pub(crate) unsafe fn open(
    ep: *mut fi::fid_ep,
    peer_domain: *mut fi::fid_domain,
    peer_info: *mut fi::fi_info,
    owner_info: *mut fi::fi_info,
) -> Result<(*mut fi::fid_ep, *mut fi::fid_ep)> {
    let wrong = || {
        Error::new(
            errno::EINVAL,
            "peer transfers go over connected (FI_EP_MSG) or reliable connectionless (FI_EP_RDM) endpoints of rverbs",
        )
    };
    // SAFETY: the caller's contract.
    let over = match unsafe { CMsgEp::from_c(ep, "ep") } {
        Ok(m) => Over::Msg(&m.inner.ep),
        // SAFETY: as above.
        Err(_) => Over::Rdm(
            &unsafe { CRdmEp::from_c(ep, "ep") }
                .map_err(|_| wrong())?
                .inner,
        ),
    };
    // SAFETY: the caller's contract.
    let endpoint2 = unsafe { peer_endpoint2(peer_domain) }?;
    let ctx = Box::new(fi::fi_peer_transfer_context {
        size: size_of::<fi::fi_peer_transfer_context>(),
        info: owner_info,
        ep: null_mut(),
        peer_ops: null_mut(),
    });
    let (t, link, ctx_ptr, undo): (_, _, _, Box<dyn Fn(*mut fi::fid_ep)>) = match over {
        Over::Msg(m) => {
            let link = Arc::new(TransferLink::new(m.queue_depth()));
            let handle = m.peer_transfer(Arc::downgrade(&link) as Weak<dyn PeerTransferSink>)?;
            let t = CTransferEp::into_raw(
                transfer_header(&TRANSFER_FI_OPS, &TRANSFER_MSG, &nosys::TAGGED),
                TransferEp {
                    ep: handle,
                    link: link.clone(),
                    ctx,
                },
            );
            // SAFETY: t was just made; its context box lives as long as it.
            let ctx_ptr = unsafe {
                let o = &mut *t.cast::<CTransferEp>();
                o.inner.ctx.ep = t;
                &raw mut *o.inner.ctx
            };
            let undo = move |peer_ep: *mut fi::fid_ep| {
                // SAFETY: made just above and not handed out except to the peer, whose
                // endpoint is closed first.
                unsafe {
                    close_peer(peer_ep);
                    let o = &mut *t.cast::<CTransferEp>();
                    o.inner.ep.end_peer_transfer();
                    let _ = crate::capi::fid::retire::<CTransferEp>(t.cast(), &TRANSFER_FI_OPS);
                }
            };
            (
                t,
                link,
                ctx_ptr,
                Box::new(undo) as Box<dyn Fn(*mut fi::fid_ep)>,
            )
        }
        Over::Rdm(r) => {
            let link = Arc::new(TransferLink::new(r.queue_depth()));
            let handle = r.peer_transfer(Arc::downgrade(&link) as Weak<dyn PeerTransferSink>)?;
            let mut ctx = ctx;
            // The box's contents stay where they are when the box moves into the endpoint.
            let ctx_ptr: *mut fi::fi_peer_transfer_context = &raw mut *ctx;
            let t = CRdmTransferEp::into_raw(
                transfer_header(&RDM_TRANSFER_FI_OPS, &RDM_EP_MSG, &RDM_EP_TAGGED),
                RdmTransferEp {
                    ep: handle,
                    link: Box::new(RdmLinkClose {
                        link: link.clone(),
                        _ctx: ctx,
                    }),
                },
            );
            // SAFETY: the context the endpoint just made holds; nothing else uses it yet.
            unsafe { (*ctx_ptr).ep = t };
            let undo = move |peer_ep: *mut fi::fid_ep| {
                // SAFETY: made just above and not handed out except to the peer, whose
                // endpoint is closed first.
                unsafe {
                    close_peer(peer_ep);
                    let o = &mut *t.cast::<CRdmTransferEp>();
                    o.inner.ep.end_peer_transfer();
                    let _ =
                        crate::capi::fid::retire::<CRdmTransferEp>(t.cast(), &RDM_TRANSFER_FI_OPS);
                }
            };
            (
                t,
                link,
                ctx_ptr,
                Box::new(undo) as Box<dyn Fn(*mut fi::fid_ep)>,
            )
        }
    };
    let mut peer_ep: *mut fi::fid_ep = null_mut();
    // SAFETY: the peer's fi_endpoint2 with the context fi_peer(3) defines for the flag.
    let rc = unsafe {
        endpoint2(
            peer_domain,
            peer_info,
            &mut peer_ep,
            fi::FI_PEER_TRANSFER,
            ctx_ptr.cast(),
        )
    };
    if rc != 0 {
        undo(null_mut());
        return Err(Error::new(
            -rc,
            format!(
                "the peer's fi_endpoint2(FI_PEER_TRANSFER): {}",
                crate::core::error::strerror(-rc)
            ),
        ));
    }
    // SAFETY: the peer filled peer_ops before returning (fi_peer(3)), or left it NULL.
    let callbacks = unsafe { (*ctx_ptr).peer_ops.as_ref() }
        .is_some_and(|o| o.complete.is_some() && o.comperr.is_some());
    if peer_ep.is_null() || !callbacks {
        undo(peer_ep);
        return Err(Error::new(
            errno::EINVAL,
            "the peer's fi_endpoint2(FI_PEER_TRANSFER) left its endpoint or its complete/comperr callbacks unset",
        ));
    }
    // What completed while the peer was still setting up is delivered now.
    // SAFETY: as above.
    link.open(peer_ep, unsafe { (*ctx_ptr).peer_ops });
    crate::fi_info!(
        "peer",
        "peer transfer link open over an {} endpoint",
        if matches!(over, Over::Msg(_)) {
            "RC"
        } else {
            "RDM"
        }
    );
    Ok((t, peer_ep))
}

/// The endpoint a transfer link goes over.
#[derive(Clone, Copy)]
enum Over<'a> {
    Msg(&'a MsgEndpoint),
    Rdm(&'a RdmEndpoint),
}

/// A transfer endpoint's header: no cancel, options or contexts of its own (like an
/// SRX's), the data calls of the endpoint it goes over.
fn transfer_header(
    fi_ops: &'static fi::fi_ops,
    msg: &'static fi::fi_ops_msg,
    tagged: &'static fi::fi_ops_tagged,
) -> fi::fid_ep {
    fi::fid_ep {
        fid: fid(fi::FI_CLASS_EP, null_mut(), fi_ops),
        ops: ops(&SRX_OPS),
        cm: ops(&SRX_CM),
        msg: ops(msg),
        rma: ops(&nosys::RMA),
        tagged: ops(tagged),
        atomic: ops(&nosys::ATOMIC),
        collective: ops(&nosys::COLLECTIVE),
    }
}

/// The peer domain's `fi_endpoint2`, if its ops table has one.
///
/// # Safety
/// `peer_domain` is NULL or a live domain of the peer provider.
unsafe fn peer_endpoint2(
    peer_domain: *mut fi::fid_domain,
) -> Result<
    unsafe extern "C" fn(
        *mut fi::fid_domain,
        *mut fi::fi_info,
        *mut *mut fi::fid_ep,
        u64,
        *mut c_void,
    ) -> i32,
> {
    // SAFETY: the caller's contract; the ops table's size says which slots exist.
    unsafe {
        let d = peer_domain
            .as_ref()
            .and_then(|d| d.ops.as_ref())
            .ok_or_else(|| Error::new(errno::EINVAL, "peer_domain is NULL"))?;
        if crate::capi::ext::foreign::has_slot(
            d.size,
            std::mem::offset_of!(fi::fi_ops_domain, endpoint2),
        ) {
            d.endpoint2
        } else {
            None
        }
    }
    .ok_or_else(|| {
        Error::new(
            errno::ENOSYS,
            "the peer provider has no fi_endpoint2: it cannot take FI_PEER_TRANSFER",
        )
    })
}

/// The link's side of an RDM transfer endpoint: closing it closes the peer's endpoint,
/// then ends the link.
struct RdmLinkClose {
    link: Arc<TransferLink>,
    /// Handed to the peer's fi_endpoint2: lives as long as the transfer endpoint.
    _ctx: Box<fi::fi_peer_transfer_context>,
}

// SAFETY: the context holds pointers only handed to the peer (its info and endpoint), read
// by it while the link is open; nothing here reads them.
unsafe impl Send for RdmLinkClose {}
// SAFETY: as above.
unsafe impl Sync for RdmLinkClose {}

impl TransferClose for RdmLinkClose {
    fn close(&self, ep: &RdmEndpoint) {
        // SAFETY: the peer's endpoint, closed once (detach hands it out once).
        unsafe { close_peer(self.link.detach()) };
        ep.end_peer_transfer();
    }
}

/// Closes the peer's endpoint through its own ops.
///
/// # Safety
/// NULL or a live endpoint of the peer.
unsafe fn close_peer(peer_ep: *mut fi::fid_ep) {
    // SAFETY: the caller's contract.
    let Some(f) = (unsafe { peer_ep.as_mut() }) else {
        return;
    };
    // SAFETY: the peer's live endpoint and its ops.
    let rc = unsafe {
        match (*f.fid.ops).close {
            Some(close) => close(&mut f.fid),
            None => -errno::ENOSYS,
        }
    };
    if rc != 0 {
        crate::fi_warn!(
            "peer",
            "closing the peer's transfer endpoint: {}",
            crate::core::error::strerror(-rc)
        );
    }
}

unsafe extern "C" fn transfer_close(f: *mut fi::fid) -> i32 {
    // SAFETY: the fid the owner got from `open`; the peer's endpoint goes first.
    guarded("fi_close(peer transfer)", || unsafe {
        CTransferEp::close(f.cast(), |t| {
            close_peer(t.link.detach());
            t.ep.end_peer_transfer();
            Ok(())
        })
    })
}

/// Every transfer asks for its completion: the peer counts on its callbacks.
const ALWAYS: Flags = Flags::COMPLETION;

unsafe extern "C" fn t_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the peer's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf(
            "fi_send(peer transfer)",
            ep,
            buf,
            desc,
            |t: &CTransferEp, mr, off| t.inner.ep.sendmsg(mr, off, len, context as u64, 0, ALWAYS),
        )
    }
}

unsafe extern "C" fn t_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    let fl = ALWAYS | Flags::REMOTE_CQ_DATA;
    // SAFETY: the peer's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf(
            "fi_senddata(peer transfer)",
            ep,
            buf,
            desc,
            |t: &CTransferEp, mr, off| t.inner.ep.sendmsg(mr, off, len, context as u64, data, fl),
        )
    }
}

unsafe extern "C" fn t_sendv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _dest: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the peer's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov(
            "fi_sendv(peer transfer)",
            ep,
            iov,
            desc,
            count,
            |t: &CTransferEp, v| t.inner.ep.sendmsgv(v, context as u64, 0, ALWAYS),
        )
    }
}

unsafe extern "C" fn t_sendmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags) | ALWAYS;
    // SAFETY: the peer's handle and message (fi_msg(3)).
    unsafe {
        on_msg(
            "fi_sendmsg(peer transfer)",
            ep,
            msg,
            |t: &CTransferEp, v, m| t.inner.ep.sendmsgv(v, m.context as u64, m.data, fl),
        )
    }
}

unsafe extern "C" fn t_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _dest: fi::fi_addr_t,
) -> isize {
    t_inject_with("fi_inject(peer transfer)", ep, buf, len, None)
}

unsafe extern "C" fn t_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    _dest: fi::fi_addr_t,
) -> isize {
    t_inject_with("fi_injectdata(peer transfer)", ep, buf, len, Some(data))
}

fn t_inject_with(
    what: &str,
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: Option<u64>,
) -> isize {
    guarded_len(what, || {
        // SAFETY: the peer's handle and buffer (fi_msg(3)).
        let (t, b) = unsafe {
            (
                CTransferEp::from_c(ep, "ep")?,
                crate::capi::fid::bytes(buf, len, "buf")?,
            )
        };
        match data {
            None => t.inner.ep.inject(b),
            Some(d) => t.inner.ep.injectdata(b, d),
        }
        .map(|()| 0)
    })
}

unsafe extern "C" fn t_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the peer's handle, buffer and descriptor (fi_msg(3)).
    unsafe {
        on_buf(
            "fi_recv(peer transfer)",
            ep,
            buf,
            desc,
            |t: &CTransferEp, mr, off| t.inner.ep.recvmsg(mr, off, len, context as u64, ALWAYS),
        )
    }
}

unsafe extern "C" fn t_recvv(
    ep: *mut fi::fid_ep,
    iov: *const libc::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _src: fi::fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: the peer's handle, iov and descriptors (fi_msg(3)).
    unsafe {
        on_iov(
            "fi_recvv(peer transfer)",
            ep,
            iov,
            desc,
            count,
            |t: &CTransferEp, v| t.inner.ep.recvmsgv(v, context as u64, ALWAYS),
        )
    }
}

unsafe extern "C" fn t_recvmsg(ep: *mut fi::fid_ep, msg: *const fi::fi_msg, flags: u64) -> isize {
    let fl = Flags::from_bits_retain(flags) | ALWAYS;
    // SAFETY: the peer's handle and message (fi_msg(3)).
    unsafe {
        on_msg(
            "fi_recvmsg(peer transfer)",
            ep,
            msg,
            |t: &CTransferEp, v, m| match v {
                &[(mr, off, len)] => t.inner.ep.recvmsg(mr, off, len, m.context as u64, fl),
                v => t.inner.ep.recvmsgv(v, m.context as u64, fl),
            },
        )
    }
}

/// `open_transfer` of the extension interface (fi_rverbs.h).
pub(crate) unsafe extern "C" fn open_transfer(
    ep: *mut fi::fid_ep,
    peer_domain: *mut fi::fid_domain,
    peer_info: *mut fi::fi_info,
    owner_info: *mut fi::fi_info,
    transfer: *mut *mut fi::fid_ep,
    peer_ep: *mut *mut fi::fid_ep,
) -> i32 {
    guarded("open_transfer", || {
        if transfer.is_null() || peer_ep.is_null() {
            return Err(Error::new(
                errno::EINVAL,
                "transfer and peer_ep must be non-NULL",
            ));
        }
        // SAFETY: the application's objects (fi_rverbs.h).
        let (t, p) = unsafe { open(ep, peer_domain, peer_info, owner_info) }?;
        // SAFETY: checked non-NULL; the caller's out-pointers.
        unsafe {
            *transfer = t;
            *peer_ep = p;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    static ENTERED: AtomicUsize = AtomicUsize::new(0);
    static LEFT: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn slow_complete(
        _ep: *mut fi::fid_ep,
        _e: *mut fi::fi_cq_tagged_entry,
        _src: *mut fi::fi_addr_t,
    ) -> isize {
        ENTERED.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        LEFT.fetch_add(1, Ordering::SeqCst);
        0
    }
    unsafe extern "C" fn comperr(_ep: *mut fi::fid_ep, _e: *mut fi::fi_cq_err_entry) -> isize {
        0
    }
    static PEER_OPS: fi::fi_ops_transfer_peer = fi::fi_ops_transfer_peer {
        size: size_of::<fi::fi_ops_transfer_peer>(),
        complete: Some(slow_complete),
        comperr: Some(comperr),
    };

    fn entry() -> std::result::Result<CqEntry, CqErrEntry> {
        Ok(CqEntry::default())
    }

    #[test]
    fn closing_a_link_waits_for_a_callback_running_on_another_thread() {
        let link = Arc::new(TransferLink::new(4));
        let peer_ep = 0x1000 as *mut fi::fid_ep;
        link.open(peer_ep, ops(&PEER_OPS));
        let l = link.clone();
        let t = std::thread::spawn(move || l.completion(entry(), fi::FI_ADDR_NOTAVAIL));
        while ENTERED.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // The close comes while the callback runs: it returns only after the callback did.
        assert_eq!(link.detach(), peer_ep);
        assert_eq!(
            LEFT.load(Ordering::SeqCst),
            1,
            "detach returned with a callback inside the peer"
        );
        t.join().unwrap();
        // Nothing is delivered to a closed link; what comes is dropped, not called.
        link.completion(entry(), fi::FI_ADDR_NOTAVAIL);
        assert_eq!(ENTERED.load(Ordering::SeqCst), 1);
        assert!(link.detach().is_null());
    }
}
