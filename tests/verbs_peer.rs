//! Device tests of the owner side of fi_peer(3) on real verbs objects: rverbs' C objects
//! (opened through this library's provider entry, as libfabric would) with libfabric's shm
//! imported as a peer. Messages sent by another process over shm land in receives posted to
//! rverbs' software SRX and complete in rverbs' verbs CQ, whose reads drive shm.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use rfabric::capi::ext::import::tests_support::{run_receiver, run_sender_child};
use rfabric::capi::ext::import::ShmImport;
use rfabric::core::cq::CqEntry;
use rfabric::core::srx::Kind;
use rfabric_sys::fabric as fi;

const EAGAIN: isize = -(fi::FI_EAGAIN as isize);
const EAVAIL: isize = -(fi::FI_EAVAIL as isize);

/// rverbs' fabric, domain, CQ (tagged format) and software SRX bound to it, as C objects.
struct Owner {
    info: *mut fi::fi_info,
    fabric: *mut fi::fid_fabric,
    domain: *mut fi::fid_domain,
    cq: *mut fi::fid_cq,
    srx: *mut fi::fid_ep,
}

fn close(f: *mut fi::fid) {
    // SAFETY: an open fid of this library, closed once.
    let rc = unsafe { ((*(*f).ops).close.unwrap())(f) };
    assert_eq!(rc, 0, "fi_close");
}

impl Owner {
    /// `None` (skip) without a device, unless one is required (then `device_info` fails).
    fn open() -> Option<Owner> {
        common::device_info()?;
        let prov = rfabric::capi::provider::fi_prov_ini();
        let mut o = Owner {
            info: null_mut(),
            fabric: null_mut(),
            domain: null_mut(),
            cq: null_mut(),
            srx: null_mut(),
        };
        // SAFETY: the provider's entry points used as libfabric's core uses them; every
        // out-pointer is a field of `o`, and attributes are zeroed C structs.
        unsafe {
            let p = &*prov;
            let rc = (p.getinfo.unwrap())(
                fi::RFABRIC_FI_VERSION,
                null(),
                null(),
                0,
                null(),
                &mut o.info,
            );
            assert_eq!(rc, 0, "getinfo");
            let rc = (p.fabric.unwrap())((*o.info).fabric_attr, &mut o.fabric, null_mut());
            assert_eq!(rc, 0, "fabric");
            let rc =
                ((*(*o.fabric).ops).domain.unwrap())(o.fabric, o.info, &mut o.domain, null_mut());
            assert_eq!(rc, 0, "domain");
            let d = &*(*o.domain).ops;
            let mut ca: fi::fi_cq_attr = std::mem::zeroed();
            ca.format = fi::FI_CQ_FORMAT_TAGGED;
            ca.wait_obj = fi::FI_WAIT_NONE;
            assert_eq!(
                (d.cq_open.unwrap())(o.domain, &mut ca, &mut o.cq, null_mut()),
                0,
                "cq"
            );
            let mut ra: fi::fi_rx_attr = std::mem::zeroed();
            ra.caps = fi::FI_MSG | fi::FI_TAGGED | fi::FI_RECV;
            ra.size = 64;
            let rc = (d.srx_ctx.unwrap())(o.domain, &mut ra, &mut o.srx, null_mut());
            assert_eq!(rc, 0, "fi_srx_context with FI_TAGGED");
            let s = &mut (*o.srx).fid;
            assert_eq!(
                ((*s.ops).bind.unwrap())(s, &mut (*o.cq).fid, fi::FI_RECV),
                0,
                "bind"
            );
        }
        Some(o)
    }

    fn recv(&self, kind: Kind, tag: u64, buf: &mut [u8], ctx: u64) -> isize {
        // SAFETY: the open SRX; buf outlives the receive (the test waits for it).
        unsafe {
            let s = self.srx;
            match kind.tagged() {
                false => ((*(*s).msg).recv.unwrap())(
                    s,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    null_mut(),
                    fi::FI_ADDR_UNSPEC,
                    ctx as *mut c_void,
                ),
                true => ((*(*s).tagged).recv.unwrap())(
                    s,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    null_mut(),
                    fi::FI_ADDR_UNSPEC,
                    tag,
                    0,
                    ctx as *mut c_void,
                ),
            }
        }
    }

    /// One `fi_cq_read` of the verbs CQ: an entry, or the error code.
    fn read(&self) -> Result<CqEntry, isize> {
        let mut e = CqEntry::default();
        // SAFETY: the open CQ (tagged format, laid out as CqEntry); one entry.
        let rc = unsafe { ((*(*self.cq).ops).read.unwrap())(self.cq, (&raw mut e).cast(), 1) };
        if rc == 1 {
            Ok(e)
        } else {
            Err(rc)
        }
    }

    fn readerr(&self) -> fi::fi_cq_err_entry {
        // SAFETY: a zeroed entry is valid C; the open CQ.
        unsafe {
            let mut e: fi::fi_cq_err_entry = std::mem::zeroed();
            let rc = ((*(*self.cq).ops).readerr.unwrap())(self.cq, &mut e, 0);
            assert_eq!(rc, 1, "fi_cq_readerr");
            e
        }
    }

    /// The next completion of the verbs CQ (30 s at most); errors fail the test.
    fn next(&self) -> CqEntry {
        let t0 = Instant::now();
        loop {
            match self.read() {
                Ok(e) => return e,
                Err(EAGAIN) => {}
                Err(EAVAIL) => panic!("error completion: {:?}", self.readerr().err),
                Err(rc) => panic!("fi_cq_read: {rc}"),
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no completion");
            std::thread::yield_now();
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        close(self.srx.cast());
        close(self.cq.cast());
        close(self.domain.cast());
        close(self.fabric.cast());
        // SAFETY: the list getinfo returned, freed once.
        unsafe { fi::fi_freeinfo(self.info) };
    }
}

#[test]
#[ignore = "child process of shm_peer_messages_complete_in_the_verbs_cq"]
fn shm_sender_child() {
    run_sender_child();
}

#[test]
fn shm_peer_messages_complete_in_the_verbs_cq() {
    let Some(o) = Owner::open() else { return };
    // SAFETY: the SRX stays open until the import is dropped (below, before `o`).
    let shm = unsafe { ShmImport::open(o.srx) }.expect("import shm as a peer of the SRX");
    // The SRX's own completions: a cancelled receive, a peek that finds nothing.
    let mut buf = [0u8; 16];
    assert_eq!(o.recv(Kind::Msg, 0, &mut buf, 77), 0);
    // SAFETY: the open SRX; 77 is the context of the receive just posted.
    let rc = unsafe { ((*(*o.srx).ops).cancel.unwrap())(&mut (*o.srx).fid, 77 as *mut c_void) };
    assert_eq!(rc, 0, "fi_cancel");
    assert_eq!(o.read().unwrap_err(), EAVAIL);
    let e = o.readerr();
    assert_eq!((e.op_context as u64, e.err), (77, fi::FI_ECANCELED));
    assert_eq!(e.flags, fi::FI_RECV | fi::FI_MSG);
    // SAFETY: the open SRX; a peek needs no buffer.
    let rc = unsafe {
        let m = fi::fi_msg_tagged {
            msg_iov: null(),
            desc: null_mut(),
            iov_count: 0,
            addr: fi::FI_ADDR_UNSPEC,
            tag: 5,
            ignore: 0,
            context: 78 as *mut c_void,
            data: 0,
        };
        ((*(*o.srx).tagged).recvmsg.unwrap())(o.srx, &m, fi::FI_PEEK)
    };
    assert_eq!(rc, 0, "fi_trecvmsg(FI_PEEK)");
    assert_eq!(o.read().unwrap_err(), EAVAIL);
    let e = o.readerr();
    assert_eq!((e.op_context as u64, e.err), (78, fi::FI_ENOMSG));
    assert_eq!(shm.in_use(), 0);

    let waiting = |n| {
        let t0 = Instant::now();
        while shm.in_use() < n {
            // Reads of the verbs CQ are what drive shm.
            assert_eq!(
                o.read().unwrap_err(),
                EAGAIN,
                "nothing completes before its receive"
            );
            assert!(t0.elapsed() < Duration::from_secs(30), "no message arrived");
            std::thread::yield_now();
        }
    };
    let recv = |kind, tag, buf: &mut Vec<u8>, ctx| assert_eq!(o.recv(kind, tag, buf, ctx), 0);
    run_receiver(
        &shm.name().unwrap(),
        "shm_sender_child",
        recv,
        || o.next(),
        waiting,
    );
    assert_eq!(shm.in_use(), 0, "shm freed every entry");
    // The SRX refuses to close while shm shares it.
    // SAFETY: the open SRX.
    let rc = unsafe { ((*(*o.srx).fid.ops).close.unwrap())(&mut (*o.srx).fid) };
    assert_eq!(rc, -fi::FI_EBUSY);
    drop(shm);
}
