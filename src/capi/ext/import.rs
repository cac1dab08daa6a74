//! Importing libfabric's own shm provider as a peer (fi_peer(3)), through libfabric's API:
//! shm's endpoint takes its receives from the owner's receive engine (a peer SRX), and its
//! completions end up in the owner's CQ.
//!
//! libfabric 1.17.0's shm refuses `FI_PEER` at `fi_cq_open` (its attribute check rejects
//! every flag but `FI_AFFINITY`; fixed in 1.18 by e32cd9de4). The import asks for a peer CQ
//! first and, when refused, opens a plain shm CQ and moves its entries into the owner's CQ
//! on every progress call. Either way the application reads one CQ.
//!
//! [`ShmImport`] attaches shm to an application's software SRX (`fi_srx_context` with
//! `FI_TAGGED`/`FI_DIRECTED_RECV` caps) and the CQ bound to it: reads of that CQ drive
//! shm. `ShmSender` (with the `test-support` feature) is a plain shm endpoint, what the
//! two-process tests send with.

use std::ffi::c_void;
use std::mem::size_of;
use std::ptr::null_mut;
use std::sync::{Arc, Weak};

use rfabric_sys::fabric as fi;

use crate::capi::fid::Owned;
use crate::core::peer::drain;

/// shm completions moved per read of its CQ.
const SHM_BATCH: usize = 16;
use crate::capi::peer::cq::{peer_cq, PeerCq, PeerCqTarget};
use crate::capi::peer::srx::{OwnerSrx, PeerSrx};
use crate::capi::soft_srx::CSoftSrx;
use crate::core::cq::CqEntry;
use crate::core::error::{errno, Error, Result};
use crate::verbs::cq::PeerProgress;
use crate::verbs::CompletionQueue;

/// `-errno` from a libfabric call as an error naming it.
#[inline]
pub(crate) fn check(rc: isize, what: &str) -> Result<isize> {
    if rc < 0 {
        return Err(failed(rc, what));
    }
    Ok(rc)
}

#[cold]
#[inline(never)]
fn failed(rc: isize, what: &str) -> Error {
    let e = (-rc) as i32;
    Error::new(e, format!("{what}: {}", crate::core::error::strerror(e)))
}

/// Closes a libfabric object through its own ops.
///
/// # Safety
/// `f` is NULL or an open fid.
unsafe fn close(f: *mut fi::fid) {
    if f.is_null() {
        return;
    }
    // SAFETY: the caller's contract: an open fid with its provider's ops.
    let rc = unsafe { ((*(*f).ops).close.expect("close"))(f) };
    if rc != 0 {
        crate::fi_warn!(
            "peer",
            "closing an shm object: {}",
            crate::core::error::strerror(-rc)
        );
    }
}

/// An shm endpoint and what it was opened with; closed in reverse order on drop.
pub(crate) struct ShmEp {
    pub info: *mut fi::fi_info,
    pub fabric: *mut fi::fid_fabric,
    pub domain: *mut fi::fid_domain,
    pub av: *mut fi::fid_av,
    pub cq: *mut fi::fid_cq,
    pub ep: *mut fi::fid_ep,
}

impl ShmEp {
    /// Opens shm's fabric, domain and AV for an RDM endpoint with untagged and tagged
    /// messages.
    pub(crate) fn open_domain() -> Result<ShmEp> {
        let mut s = ShmEp {
            info: null_mut(),
            fabric: null_mut(),
            domain: null_mut(),
            av: null_mut(),
            cq: null_mut(),
            ep: null_mut(),
        };
        // SAFETY: libfabric's API used as documented: fi_dupinfo(NULL) allocates hints the
        // way fi_freeinfo frees them; every out-pointer is a local.
        unsafe {
            let hints = fi::fi_dupinfo(std::ptr::null());
            if hints.is_null() {
                return Err(Error::new(errno::ENOMEM, "fi_allocinfo"));
            }
            (*hints).caps = fi::FI_MSG | fi::FI_TAGGED;
            (*(*hints).ep_attr).type_ = fi::FI_EP_RDM;
            (*(*hints).domain_attr).av_type = fi::FI_AV_TABLE;
            // fi_freeinfo frees it with free(): a malloc'd copy.
            (*(*hints).fabric_attr).prov_name = libc::strdup(c"shm".as_ptr());
            let rc = fi::fi_getinfo(
                fi::RFABRIC_FI_VERSION,
                std::ptr::null(),
                std::ptr::null(),
                0,
                hints,
                &mut s.info,
            );
            fi::fi_freeinfo(hints);
            check(rc as isize, "fi_getinfo(shm)")?;
            check(
                fi::fi_fabric((*s.info).fabric_attr, &mut s.fabric, null_mut()) as isize,
                "fi_fabric(shm)",
            )?;
            let f = &*(*s.fabric).ops;
            check(
                (f.domain.expect("domain"))(s.fabric, s.info, &mut s.domain, null_mut()) as isize,
                "fi_domain(shm)",
            )?;
            let mut aa: fi::fi_av_attr = std::mem::zeroed();
            aa.type_ = fi::FI_AV_TABLE;
            let d = &*(*s.domain).ops;
            check(
                (d.av_open.expect("av_open"))(s.domain, &mut aa, &mut s.av, null_mut()) as isize,
                "fi_av_open(shm)",
            )?;
        }
        Ok(s)
    }

    /// A plain shm endpoint with its own CQ (tagged format), enabled.
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn open_plain() -> Result<ShmEp> {
        let mut s = Self::open_domain()?;
        // SAFETY: the objects just opened; libfabric's API used as documented.
        unsafe {
            s.cq = open_cq(s.domain, 0, null_mut())?;
            s.finish(None, None, 0)?;
        }
        Ok(s)
    }

    /// Opens the endpoint, names it `name` (if given), binds the SRX (if any), CQ (with
    /// `cq_flags` besides `FI_TRANSMIT|FI_RECV`) and AV, and enables it.
    ///
    /// # Safety
    /// `self` holds an open domain, AV and CQ; `srx` is a live fid.
    pub(crate) unsafe fn finish(
        &mut self,
        srx: Option<*mut fi::fid>,
        name: Option<&std::ffi::CStr>,
        cq_flags: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            let d = &*(*self.domain).ops;
            check(
                (d.endpoint.expect("endpoint"))(self.domain, self.info, &mut self.ep, null_mut())
                    as isize,
                "fi_endpoint(shm)",
            )?;
            if let Some(n) = name {
                // shm takes a name before it is enabled (its region is made then).
                check(
                    ((*(*self.ep).cm).setname.expect("setname"))(
                        &mut (*self.ep).fid,
                        n.as_ptr() as *mut c_void,
                        n.to_bytes_with_nul().len(),
                    ) as isize,
                    "fi_setname(shm)",
                )?;
            }
            let ep = &mut (*self.ep).fid;
            let bind = (*ep.ops).bind.expect("bind");
            if let Some(srx) = srx {
                // Before fi_enable: shm swaps its receive calls out then.
                check(bind(ep, srx, 0) as isize, "fi_ep_bind(shm, srx)")?;
            }
            check(
                bind(
                    ep,
                    &mut (*self.cq).fid,
                    fi::FI_TRANSMIT | fi::FI_RECV | cq_flags,
                ) as isize,
                "fi_ep_bind(shm, cq)",
            )?;
            check(
                bind(ep, &mut (*self.av).fid, 0) as isize,
                "fi_ep_bind(shm, av)",
            )?;
            check(
                ((*ep.ops).control.expect("control"))(ep, fi::FI_ENABLE as i32, null_mut())
                    as isize,
                "fi_enable(shm)",
            )?;
        }
        Ok(())
    }

    /// The endpoint's name (`fi_shm://…`, NUL included).
    pub(crate) fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: an enabled endpoint; buf has len bytes.
        let rc = unsafe {
            ((*(*self.ep).cm).getname.expect("getname"))(
                &mut (*self.ep).fid,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        check(rc as isize, "fi_getname(shm)")?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Inserts a peer's name; its `fi_addr_t` in this endpoint's AV.
    pub(crate) fn insert(&self, name: &[u8]) -> Result<u64> {
        let mut addr = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: the open AV; name is one address.
        let rc = unsafe {
            ((*(*self.av).ops).insert.expect("insert"))(
                self.av,
                name.as_ptr().cast(),
                1,
                &mut addr,
                0,
                null_mut(),
            )
        };
        if check(rc as isize, "fi_av_insert(shm)")? != 1 {
            return Err(Error::new(
                errno::EINVAL,
                "fi_av_insert(shm) took no address",
            ));
        }
        Ok(addr)
    }
}

impl Drop for ShmEp {
    fn drop(&mut self) {
        // SAFETY: each fid is NULL or open, and closed once, children first.
        unsafe {
            close(self.ep.cast());
            close(self.cq.cast());
            close(self.av.cast());
            close(self.domain.cast());
            close(self.fabric.cast());
            if !self.info.is_null() {
                fi::fi_freeinfo(self.info);
            }
        }
    }
}

/// Opens an shm CQ in the tagged format (`flags` `FI_PEER` with `context` a
/// `fi_peer_cq_context`, or plain).
///
/// # Safety
/// `domain` is open; `context` is what `flags` asks for.
pub(crate) unsafe fn open_cq(
    domain: *mut fi::fid_domain,
    flags: u64,
    context: *mut c_void,
) -> Result<*mut fi::fid_cq> {
    // SAFETY: the caller's contract; a zeroed attr is valid C.
    unsafe {
        let mut a: fi::fi_cq_attr = std::mem::zeroed();
        a.format = fi::FI_CQ_FORMAT_TAGGED;
        a.wait_obj = fi::FI_WAIT_NONE;
        a.flags = flags;
        let mut cq = null_mut();
        let d = &*(*domain).ops;
        check(
            (d.cq_open.expect("cq_open"))(domain, &mut a, &mut cq, context) as isize,
            "fi_cq_open(shm)",
        )?;
        Ok(cq)
    }
}

/// Gives shm the owner's SRX (`fi_srx_context` with `FI_PEER` in `op_flags`, as 1.17
/// reads it), which shm fills the peer ops of.
///
/// # Safety
/// `domain` is shm's open domain; `ctx` names `srx`, and both outlive shm's use of them
/// (its endpoint closes first).
pub(crate) unsafe fn open_peer_srx(
    domain: *mut fi::fid_domain,
    ctx: &mut fi::fi_peer_srx_context,
    srx: *mut fi::fid_peer_srx,
) -> Result<()> {
    // SAFETY: the caller's contract; a zeroed attr is valid C, the out-pointer a local.
    unsafe {
        let mut ra: fi::fi_rx_attr = std::mem::zeroed();
        ra.op_flags = fi::FI_PEER;
        let mut rx_ep: *mut fi::fid_ep = null_mut();
        let d = &*(*domain).ops;
        check(
            (d.srx_ctx.expect("srx_ctx"))(
                domain,
                &mut ra,
                &mut rx_ep,
                (ctx as *mut fi::fi_peer_srx_context).cast(),
            ) as isize,
            "fi_srx_context(shm, FI_PEER)",
        )?;
        if (*srx).peer_ops.is_null() {
            return Err(Error::new(
                errno::EOTHER,
                "shm accepted the peer SRX but did not fill its peer ops",
            ));
        }
    }
    Ok(())
}

/// libfabric's shm as the owner's peer: receives from the owner's engine, completions to
/// the owner's CQ.
pub(crate) struct ShmPeer {
    // Dropped first: the endpoint goes before what it refers to.
    ep: ShmEp,
    /// Set when shm took the owner's CQ as a peer CQ; otherwise shm's CQ is drained.
    peer_cq: Option<Owned<PeerCq>>,
    sink: Arc<dyn PeerCqTarget>,
    _srx: Owned<PeerSrx>,
    _srx_ctx: Box<fi::fi_peer_srx_context>,
    _cq_ctx: Box<fi::fi_peer_cq_context>,
}

impl ShmPeer {
    /// Opens shm with the owner's SRX (`fi_srx_context` with `FI_PEER` in `op_flags`, as
    /// 1.17 reads it) and the owner's CQ.
    pub(crate) fn open(owner: &Arc<OwnerSrx>, sink: Arc<dyn PeerCqTarget>) -> Result<ShmPeer> {
        let mut ep = ShmEp::open_domain()?;
        let srx = owner.peer();
        let mut srx_ctx = Box::new(fi::fi_peer_srx_context {
            size: size_of::<fi::fi_peer_srx_context>(),
            srx: srx.raw(),
        });
        let pcq = peer_cq(sink.clone());
        let mut cq_ctx = Box::new(fi::fi_peer_cq_context {
            size: size_of::<fi::fi_peer_cq_context>(),
            cq: pcq.raw(),
        });
        // SAFETY: shm's open domain; the contexts and the peer objects are boxed and kept
        // in the ShmPeer, which outlives shm's use of them (its endpoint is closed first).
        let peer_cq = unsafe {
            match open_cq(ep.domain, fi::FI_PEER, (&raw mut *cq_ctx).cast()) {
                Ok(cq) => {
                    ep.cq = cq;
                    Some(pcq)
                }
                Err(e) if e.errno() == errno::EINVAL => {
                    crate::fi_info!(
                        "peer",
                        "shm refuses FI_PEER on its CQ (libfabric 1.17.0; fixed in 1.18): its completions are moved into the owner's CQ at each progress call"
                    );
                    ep.cq = open_cq(ep.domain, 0, null_mut())?;
                    None
                }
                Err(e) => return Err(e),
            }
        };
        // SAFETY: as above; shm fills srx.peer_ops and keeps the pointer.
        unsafe {
            open_peer_srx(ep.domain, &mut srx_ctx, srx.raw())?;
            ep.finish(Some(srx.raw().cast()), None, 0)?;
        }
        Ok(ShmPeer {
            ep,
            peer_cq,
            sink,
            _srx: srx,
            _srx_ctx: srx_ctx,
            _cq_ctx: cq_ctx,
        })
    }

    pub(crate) fn name(&self) -> Result<Vec<u8>> {
        self.ep.name()
    }

    /// Drives shm (a read of its CQ progresses its endpoint) and, without a peer CQ, moves
    /// its completions into the owner's CQ, only as many as it has room for (the rest
    /// waits in shm's CQ, unlost: `core::peer::drain`). Returns how many were moved.
    pub(crate) fn progress(&self) -> Result<usize> {
        let room = || {
            if self.peer_cq.is_some() {
                0
            } else {
                self.sink.room()
            }
        };
        drain(room, |n| self.move_some(n), SHM_BATCH)
    }

    /// Reads at most `n` of shm's completions (0: drives its progress only) into the
    /// owner's CQ; how many moved.
    fn move_some(&self, n: usize) -> Result<usize> {
        read_shm_cq(self.ep.cq, n, |c| match c {
            Ok((e, s)) => self.sink.write(e, s),
            Err(e) => self.sink.writeerr(e),
        })
    }
}

/// Reads at most `n` of an shm CQ's completions (0: drives shm's progress only), each
/// (or the error entry waiting, alone) handed to `each`; how many were read. shm 1.17
/// leaves `FI_COMPLETION` in an error's flags and its errno negative: both are put right.
#[inline(always)]
pub(crate) fn read_shm_cq(
    cq: *mut fi::fid_cq,
    n: usize,
    mut each: impl FnMut(std::result::Result<(CqEntry, u64), crate::core::cq::CqErrEntry>) -> Result<()>,
) -> Result<usize> {
    // Left unwritten: shm writes the first k it returns, and only those are read.
    let mut out = [const { std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit() }; SHM_BATCH];
    let mut src = [const { std::mem::MaybeUninit::<fi::fi_addr_t>::uninit() }; SHM_BATCH];
    let n = n.min(SHM_BATCH);
    // SAFETY: an open shm CQ (the caller's); out and src hold n entries.
    let rc = unsafe {
        ((*(*cq).ops).readfrom.expect("readfrom"))(
            cq,
            out.as_mut_ptr().cast(),
            n,
            src.as_mut_ptr().cast(),
        )
    };
    if rc == -(errno::EAGAIN as isize) || rc == 0 {
        return Ok(0);
    }
    if rc == -(errno::EAVAIL as isize) {
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: a zeroed entry is valid C; err_data_size 0 asks for shm's own buffer.
        let mut e: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: the open CQ and a valid entry.
        let rc = unsafe { ((*(*cq).ops).readerr.expect("readerr"))(cq, &mut e, 0) };
        check(rc, "fi_cq_readerr(shm)")?;
        // SAFETY: err_data has err_data_size bytes until the next read, per fi_cq(3).
        let mut c = unsafe { crate::capi::peer::cq::err_entry(&e) }?;
        c.flags &= !fi::FI_COMPLETION;
        c.err = c.err.abs();
        each(Err(c))?;
        return Ok(1);
    }
    let k = (check(rc, "fi_cq_readfrom(shm)")? as usize).min(n);
    for (e, s) in out[..k].iter().zip(&src[..k]) {
        // SAFETY: fi_cq_readfrom wrote its first k entries and sources.
        let (e, s) = unsafe { (e.assume_init_ref(), s.assume_init()) };
        each(Ok((
            CqEntry {
                op_context: e.op_context as u64,
                flags: e.flags,
                len: e.len,
                buf: e.buf as u64,
                data: e.data,
                tag: e.tag,
            },
            s,
        )))?;
    }
    Ok(k)
}

impl Drop for ShmPeer {
    fn drop(&mut self) {
        // Messages shm still holds for the engine go back to it before its endpoint closes.
        self._srx.inner.discard_from(self._srx.raw());
    }
}

// SAFETY: shm's objects are opened FI_THREAD_SAFE (its default), so they may be used from
// any thread; the raw pointers are only handed back to shm.
unsafe impl Send for ShmPeer {}
// SAFETY: as above.
unsafe impl Sync for ShmPeer {}

impl PeerProgress for ShmPeer {
    fn progress(
        &self,
        _cq: &crate::verbs::CompletionQueue,
        _sink: Option<&mut crate::verbs::ReadSink<'_>>,
    ) {
        if let Err(e) = ShmPeer::progress(self) {
            crate::fi_warn!("peer", "shm progress: {e}");
        }
    }
}

/// libfabric's shm imported as the peer of an application's software SRX: messages sent
/// to [`Self::name`] by shm endpoints (in this process or others) land in receives posted
/// to the SRX, and complete in the SRX's CQ, whose reads drive shm. Drop it (close the
/// import) before closing the SRX.
pub struct ShmImport {
    peer: Arc<ShmPeer>,
    cq: Arc<CompletionQueue>,
    hook: Weak<dyn PeerProgress>,
}

impl ShmImport {
    /// Imports shm on `srx`, a software SRX of this library with its CQ bound.
    ///
    /// # Safety
    /// `srx` is NULL or a live fid returned by this library's `fi_srx_context`, which
    /// outlives the import.
    pub unsafe fn open(srx: *mut fi::fid_ep) -> Result<ShmImport> {
        // SAFETY: the caller's contract.
        let s = &unsafe { CSoftSrx::from_c(srx, "srx") }?.inner;
        let cq = s.cq()?.clone();
        let peer = Arc::new(ShmPeer::open(&s.owner, cq.clone())?);
        let hook: Weak<dyn PeerProgress> = Arc::downgrade(&peer) as Weak<dyn PeerProgress>;
        cq.add_peer(hook.clone(), true)?;
        crate::fi_info!("peer", "shm imported as a peer of the SRX");
        Ok(ShmImport { peer, cq, hook })
    }

    /// The name shm endpoints send to (`fi_shm://…`, NUL included; `FI_ADDR_STR`).
    pub fn name(&self) -> Result<Vec<u8>> {
        self.peer.name()
    }

    /// Entries in use in the SRX's engine: posted receives, and messages shm holds waiting
    /// for one (diagnostics and tests).
    pub fn in_use(&self) -> usize {
        self.peer._srx.inner.in_use()
    }
}

impl std::fmt::Debug for ShmImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.name().unwrap_or_default();
        write!(f, "ShmImport({})", String::from_utf8_lossy(&name))
    }
}

#[cfg(any(test, feature = "test-support"))]
impl std::fmt::Debug for ShmSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmSender({} pending)", self.pending)
    }
}

impl Drop for ShmImport {
    fn drop(&mut self) {
        self.cq.remove_peer(&self.hook);
    }
}

/// A plain shm endpoint (tagged CQ), for sending to an imported peer from any process.
#[cfg(any(test, feature = "test-support"))]
pub struct ShmSender {
    ep: ShmEp,
    pending: usize,
}

#[cfg(any(test, feature = "test-support"))]
impl ShmSender {
    pub fn open() -> Result<ShmSender> {
        Ok(ShmSender {
            ep: ShmEp::open_plain()?,
            pending: 0,
        })
    }

    /// Inserts a peer's name (`fi_shm://…`); its address for [`Self::send`].
    pub fn insert(&self, name: &[u8]) -> Result<u64> {
        self.ep.insert(name)
    }

    /// Sends `data` to `dest` (tagged with `tag` when given), retrying while shm connects
    /// or its queue is full. `data` must stay untouched until [`Self::wait`] returns.
    pub fn send(&mut self, dest: u64, data: &[u8], tag: Option<u64>) -> Result<()> {
        self.send_with(dest, data, tag, || {})
    }

    /// As [`Self::send`], calling `idle` between retries (to progress a receiver in the
    /// same thread).
    pub fn send_with(
        &mut self,
        dest: u64,
        data: &[u8],
        tag: Option<u64>,
        mut idle: impl FnMut(),
    ) -> Result<()> {
        let ep = self.ep.ep;
        let t0 = std::time::Instant::now();
        loop {
            // SAFETY: an enabled endpoint; the caller keeps data alive until `wait`.
            let rc = unsafe {
                match tag {
                    None => ((*(*ep).msg).send.expect("send"))(
                        ep,
                        data.as_ptr().cast(),
                        data.len(),
                        null_mut(),
                        dest,
                        null_mut(),
                    ),
                    Some(t) => ((*(*ep).tagged).send.expect("tsend"))(
                        ep,
                        data.as_ptr().cast(),
                        data.len(),
                        null_mut(),
                        dest,
                        t,
                        null_mut(),
                    ),
                }
            };
            if rc == 0 {
                self.pending += 1;
                return Ok(());
            }
            if rc != -(errno::EAGAIN as isize) || t0.elapsed().as_secs() >= 30 {
                check(rc, "fi_send(shm)")?;
                return Err(Error::new(
                    errno::ETIMEDOUT,
                    "fi_send(shm) kept answering EAGAIN for 30 s: is the receiving process progressing?",
                ));
            }
            self.poll()?;
            idle();
        }
    }

    /// Reads send completions; returns how many sends are still outstanding.
    pub fn poll(&mut self) -> Result<usize> {
        let mut e = [fi::fi_cq_tagged_entry {
            op_context: null_mut(),
            flags: 0,
            len: 0,
            buf: null_mut(),
            data: 0,
            tag: 0,
        }; 8];
        let cq = self.ep.cq;
        // SAFETY: the open CQ; e holds 8 tagged entries.
        let rc = unsafe { ((*(*cq).ops).read.expect("read"))(cq, e.as_mut_ptr().cast(), 8) };
        if rc == -(errno::EAGAIN as isize) {
            return Ok(self.pending);
        }
        if rc == -(errno::EAVAIL as isize) {
            // SAFETY: a zeroed entry is valid C; the open CQ.
            let mut err: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            unsafe { ((*(*cq).ops).readerr.expect("readerr"))(cq, &mut err, 0) };
            return Err(Error::new(err.err.abs(), "an shm send completed in error"));
        }
        self.pending -= check(rc, "fi_cq_read(shm)")? as usize;
        Ok(self.pending)
    }

    /// Polls until every send has completed (`timeout` at most).
    pub fn wait(&mut self, timeout: std::time::Duration) -> Result<()> {
        let t0 = std::time::Instant::now();
        while self.poll()? > 0 {
            if t0.elapsed() > timeout {
                return Err(Error::new(
                    errno::ETIMEDOUT,
                    format!("{} shm sends did not complete", self.pending),
                ));
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! libfabric 1.17's shm as the owner's peer, in one process: a plain shm endpoint sends
    //! to the imported one, whose receives come from the owner's engine.
    use super::*;
    use crate::capi::peer::cq::tests::SoftCq;
    use crate::capi::peer::srx::RxBuf;
    use crate::core::cq::CqState;
    use crate::core::flags::Flags;
    use crate::core::srx::{Filter, Kind, ADDR_UNSPEC};
    use std::sync::Mutex;

    struct Pair {
        owner: Arc<OwnerSrx>,
        cq: Arc<SoftCq>,
        peer: ShmPeer,
        sender: ShmSender,
        to_peer: u64,
    }

    fn pair() -> Pair {
        let owner = OwnerSrx::new(64);
        let cq = Arc::new(SoftCq(Mutex::new(CqState::new(256))));
        let peer = ShmPeer::open(&owner, cq.clone()).expect("import shm as a peer");
        // SAFETY: a plain query of the loaded libfabric.
        if unsafe { fi::fi_version() } < fi::fi_version_of(1, 18) {
            assert!(peer.peer_cq.is_none(), "1.17.0's shm refuses FI_PEER CQs");
        }
        let sender = ShmSender::open().expect("a plain shm endpoint");
        let to_peer = sender.insert(&peer.name().unwrap()).unwrap();
        Pair {
            owner,
            cq,
            peer,
            sender,
            to_peer,
        }
    }

    impl Pair {
        /// Sends `data` (tagged with `tag` when given); in one process the receiver must
        /// progress too while shm connects.
        fn send(&mut self, data: &[u8], tag: Option<u64>) {
            let peer = &self.peer;
            self.sender
                .send_with(self.to_peer, data, tag, || {
                    peer.progress().unwrap();
                })
                .expect("send");
        }

        /// Progresses both sides once.
        fn poll(&mut self) {
            self.sender.poll().expect("sender CQ");
            self.peer.progress().unwrap();
        }

        /// The owner CQ's next completion (10 s at most).
        fn completion(&mut self) -> CqEntry {
            let t0 = std::time::Instant::now();
            loop {
                self.poll();
                let mut out = [CqEntry::default(); 1];
                let mut q = self.cq.0.lock().unwrap();
                if let Ok(1) = q.read_into(&mut out, None) {
                    return out[0];
                }
                if let Some(e) = q.readerr() {
                    panic!("error completion {e:?}");
                }
                drop(q);
                assert!(t0.elapsed().as_secs() < 10, "no completion");
            }
        }
    }

    use super::tests_support::pattern;

    #[test]
    fn shm_messages_land_in_owner_receives_posted_first_and_unexpected() {
        let mut p = pair();
        for (i, size) in [8usize, 200, 4000, 65536, 1 << 20].into_iter().enumerate() {
            let data = pattern(size, i as u8);
            let mut buf = vec![0u8; size];
            let (ctx_a, ctx_b) = (100 + i as u64 * 2, 101 + i as u64 * 2);
            // Posted first.
            p.owner
                .recv(
                    Kind::Msg,
                    Filter::ANY,
                    RxBuf::one(buf.as_mut_ptr().cast(), size),
                    ctx_a,
                    Flags::COMPLETION,
                )
                .unwrap();
            p.send(&data, None);
            let c = p.completion();
            assert_eq!((c.op_context, c.len), (ctx_a, size), "posted-first {size}");
            assert!(c.flags & fi::FI_RECV != 0);
            assert!(buf == data, "posted-first {size}: bytes differ");
            // Unexpected first: the message waits in shm until the receive is posted.
            let data = pattern(size, 100 + i as u8);
            buf.fill(0);
            p.send(&data, None);
            for _ in 0..50 {
                p.poll();
            }
            assert!(p.cq.0.lock().unwrap().is_empty());
            p.owner
                .recv(
                    Kind::Msg,
                    Filter::ANY,
                    RxBuf::one(buf.as_mut_ptr().cast(), size),
                    ctx_b,
                    Flags::COMPLETION,
                )
                .unwrap();
            let c = p.completion();
            assert_eq!((c.op_context, c.len), (ctx_b, size), "unexpected {size}");
            assert!(buf == data, "unexpected {size}: bytes differ");
        }
        assert_eq!(p.owner.in_use(), 0, "shm freed every entry");
    }

    #[test]
    fn shm_tagged_messages_match_by_tag() {
        let mut p = pair();
        let (a, b) = (pattern(100, 1), pattern(5000, 2));
        p.send(&a, Some(7));
        p.send(&b, Some(9));
        for _ in 0..50 {
            p.poll();
        }
        let mut buf9 = vec![0u8; 8192];
        let mut buf7 = vec![0u8; 8192];
        let f = |tag| Filter {
            addr: ADDR_UNSPEC,
            tag,
            ignore: 0,
        };
        // The later message first, by its tag.
        p.owner
            .recv(
                Kind::Tag,
                f(9),
                RxBuf::one(buf9.as_mut_ptr().cast(), 8192),
                9,
                Flags::COMPLETION,
            )
            .unwrap();
        let c = p.completion();
        assert_eq!((c.op_context, c.len, c.tag), (9, 5000, 9));
        assert!(c.flags & fi::FI_TAGGED != 0);
        assert!(buf9[..5000] == b[..]);
        p.owner
            .recv(
                Kind::Tag,
                f(7),
                RxBuf::one(buf7.as_mut_ptr().cast(), 8192),
                7,
                Flags::COMPLETION,
            )
            .unwrap();
        let c = p.completion();
        assert_eq!((c.op_context, c.len, c.tag), (7, 100, 7));
        assert!(buf7[..100] == a[..]);
    }
}

#[cfg(test)]
mod process_tests {
    //! shm in another process: the sender is this test binary run again as a child.
    use super::tests_support::*;
    use super::*;
    use crate::capi::peer::cq::tests::SoftCq;
    use crate::capi::peer::srx::RxBuf;
    use crate::core::cq::CqState;
    use crate::core::flags::Flags;
    use crate::core::srx::{Filter, ADDR_UNSPEC};
    use std::sync::Mutex;
    use std::time::Duration;

    const CHILD: &str = "capi::ext::import::process_tests::shm_sender_child";

    /// Not a test of its own: the sending process of the test below (it fails when run
    /// without the receiver's name).
    #[test]
    #[ignore = "child process of shm_messages_from_another_process"]
    fn shm_sender_child() {
        run_sender_child();
    }

    #[test]
    fn shm_messages_from_another_process() {
        let owner = OwnerSrx::new(64);
        // A CQ of one entry: shm's completions are moved one at a time as reads make room,
        // none dropped (the drain used to move a batch and lose what did not fit).
        let cq = Arc::new(SoftCq(Mutex::new(CqState::new(1))));
        let peer = ShmPeer::open(&owner, cq.clone()).expect("import shm as a peer");
        let recv = |kind, tag, buf: &mut Vec<u8>, ctx| {
            let f = Filter {
                addr: ADDR_UNSPEC,
                tag,
                ignore: 0,
            };
            let b = RxBuf::one(buf.as_mut_ptr().cast(), buf.len());
            owner.recv(kind, f, b, ctx, Flags::COMPLETION).unwrap();
        };
        let next = || -> CqEntry {
            let t0 = std::time::Instant::now();
            loop {
                peer.progress().unwrap();
                let mut out = [CqEntry::default(); 1];
                let mut q = cq.0.lock().unwrap();
                if let Ok(1) = q.read_into(&mut out, None) {
                    return out[0];
                }
                assert!(q.readerr().is_none(), "error completion");
                drop(q);
                assert!(t0.elapsed() < Duration::from_secs(30), "no completion");
                std::thread::yield_now();
            }
        };
        let waiting = |n| {
            let t0 = std::time::Instant::now();
            while owner.in_use() < n {
                peer.progress().unwrap();
                assert!(t0.elapsed() < Duration::from_secs(30), "no message arrived");
                std::thread::yield_now();
            }
        };
        run_receiver(&peer.name().unwrap(), CHILD, recv, next, waiting);
        assert_eq!(owner.in_use(), 0, "shm freed every entry");
    }
}

/// The traffic of the two-process tests (the host test here, the device test of the verbs
/// CQ in `tests/verbs_peer.rs`), shared by the sender and the receiver.
#[cfg(any(test, feature = "test-support"))]
pub mod tests_support {
    use super::*;
    use crate::core::srx::Kind;
    use std::process::{Child, Command};
    use std::time::Duration;

    const ENV: &str = "RFABRIC_TEST_SHM_PEER";

    /// Untagged messages of these sizes, then tagged ones (tag, size).
    pub const SIZES: [usize; 5] = [8, 200, 4000, 65536, 1 << 20];
    pub const TAGGED: [(u64, usize); 2] = [(7, 100), (9, 5000)];

    pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Every message of the plan, in sending order.
    pub fn plan() -> Vec<(Option<u64>, Vec<u8>)> {
        let mut v: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| (None, pattern(n, i as u8)))
            .collect();
        v.extend(TAGGED.iter().map(|&(t, n)| (Some(t), pattern(n, t as u8))));
        v
    }

    /// The child's side: sends the plan to the name in the environment.
    pub fn run_sender_child() {
        let hex = std::env::var(ENV).expect("run by the two-process test only");
        let name: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let mut s = ShmSender::open().expect("shm endpoint in the child");
        let to = s.insert(&name).expect("insert the receiver's name");
        let msgs = plan();
        for (tag, data) in &msgs {
            s.send(to, data, *tag).expect("send");
        }
        s.wait(Duration::from_secs(60)).expect("sends complete");
    }

    /// Starts this test binary again as the sending child, aimed at `name`.
    pub fn spawn_sender(name: &[u8], child_test: &str) -> Child {
        let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
        Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", child_test, "-q"])
            .env(ENV, hex)
            .spawn()
            .expect("start the sending process")
    }

    /// The receiver's side: the first message posted before the child starts, the others
    /// left waiting (unexpected) before their receive is posted, the tagged ones received in
    /// reverse order by tag. Every byte is checked.
    pub fn run_receiver(
        name: &[u8],
        child_test: &str,
        recv: impl Fn(Kind, u64, &mut Vec<u8>, u64),
        next: impl Fn() -> CqEntry,
        waiting: impl Fn(usize),
    ) {
        let msgs = plan();
        let mut bufs: Vec<Vec<u8>> = msgs.iter().map(|(_, d)| vec![0u8; d.len()]).collect();
        recv(Kind::Msg, 0, &mut bufs[0], 1000);
        let mut child = spawn_sender(name, child_test);
        let c = next();
        assert_eq!((c.op_context, c.len), (1000, SIZES[0]), "posted first");
        for i in 1..SIZES.len() {
            // The message waits in the engine until its receive comes.
            waiting(1);
            recv(Kind::Msg, 0, &mut bufs[i], 1000 + i as u64);
            let c = next();
            assert_eq!(
                (c.op_context, c.len),
                (1000 + i as u64, SIZES[i]),
                "unexpected {}",
                SIZES[i]
            );
            assert!(c.flags & fi::FI_RECV != 0 && c.flags & fi::FI_MSG != 0);
        }
        waiting(2);
        for (j, &(tag, n)) in TAGGED.iter().enumerate().rev() {
            let i = SIZES.len() + j;
            recv(Kind::Tag, tag, &mut bufs[i], 2000 + tag);
            let c = next();
            assert_eq!((c.op_context, c.len, c.tag), (2000 + tag, n, tag));
            assert!(c.flags & fi::FI_TAGGED != 0);
        }
        for (i, ((_, sent), got)) in msgs.iter().zip(&bufs).enumerate() {
            assert!(
                sent == got,
                "message {i} ({} bytes): bytes differ",
                sent.len()
            );
        }
        let st = child.wait().unwrap();
        assert!(st.success(), "the sending process failed: {st}");
    }
}
