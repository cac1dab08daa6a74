//! Echo traffic for the reliability cases: one side sends messages of random sizes and
//! checks every byte that comes back, counting each operation it posted until its
//! completion is read; the other side echoes. Shared by the one-node and two-node cases.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::{Outcome, Resources, Rng};
use crate::common::*;
use rfabric::core::cq::CqEntry;
use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;

/// Largest message the echo traffic sends, and how many are in flight at once.
pub const MAX_MSG: usize = 16 << 10;
pub const WINDOW: usize = 16;
pub const RECV_TAG: u64 = 1 << 40;
pub const SEND_TAG: u64 = 2 << 40;

/// One side of a connection in its own objects, as an application would hold it.
pub struct Side {
    pub _fabric: Arc<Fabric>,
    pub domain: Arc<Domain>,
    pub eq: Arc<EventQueue>,
    pub cq: Arc<CompletionQueue>,
    pub ep: MsgEndpoint,
    pub _pep: Option<PassiveEndpoint>,
}

pub fn open_side(info: &Info, fabric: Arc<Fabric>, eq: Arc<EventQueue>, fid: u64) -> Side {
    let domain = Domain::open(&fabric, info).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let ep = MsgEndpoint::open(&domain, info, fid).unwrap();
    ep.bind_eq(&eq).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.enable().unwrap();
    Side {
        _fabric: fabric,
        domain,
        eq,
        cq,
        ep,
        _pep: None,
    }
}

/// The two sides of an in-process pair: (client, server).
pub fn sides(p: Pair) -> (Side, Side) {
    let client = Side {
        _fabric: p.fabric.clone(),
        domain: p.domain.clone(),
        eq: p.client_eq,
        cq: p.client_cq,
        ep: p.client,
        _pep: None,
    };
    let server = Side {
        _fabric: p.fabric,
        domain: p.domain,
        eq: p.server_eq,
        cq: p.server_cq,
        ep: p.server,
        _pep: Some(p.pep),
    };
    (client, server)
}

/// Runs `cycles` of `cycle` and records what grew between the end of the first (the
/// warm-up) and the end of the last.
pub fn cycles_leak_checked(out: &mut Outcome, cycles: usize, mut cycle: impl FnMut(&mut Outcome)) {
    let mut base = None;
    for i in 0..cycles {
        cycle(out);
        if i == 0 {
            base = Some(Resources::now());
        }
    }
    if let Some(b) = base {
        out.leaks = b.leaks_to(&Resources::now(), 16 << 10);
    }
}

/// Connects to `addr` (the active side).
pub fn connect_to(addr: &SocketAddr) -> Side {
    let info = client_info(addr);
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let side = open_side(&info, fabric, eq, CLIENT_FID);
    side.ep.connect(b"").unwrap();
    match next_event(&side.eq) {
        EqEvent::Connected { .. } => side,
        other => panic!("expected FI_CONNECTED, got {other:?}"),
    }
}

/// Accepts the next request on a listener (the passive side); `before` posts receives.
pub fn accept_next(
    fabric: Arc<Fabric>,
    eq: Arc<EventQueue>,
    pep: PassiveEndpoint,
    before: impl FnOnce(&Side),
) -> Side {
    let EqEvent::ConnReq { info, .. } = next_event(&eq) else {
        panic!("expected FI_CONNREQ")
    };
    let mut side = open_side(&info, fabric, eq, SERVER_FID);
    side._pep = Some(pep);
    before(&side);
    side.ep.accept(b"").unwrap();
    match next_event(&side.eq) {
        EqEvent::Connected { .. } => side,
        other => panic!("expected FI_CONNECTED, got {other:?}"),
    }
}

/// The bytes of message `seq`: its number first, then a pattern of its own.
pub fn message(seq: u64, len: usize) -> Vec<u8> {
    let mut m = pattern(len, seq as u8);
    let n = len.min(8);
    m[..n].copy_from_slice(&seq.to_le_bytes()[..n]);
    m
}

/// Echo traffic from the surviving side: messages of random sizes go out, come back
/// from the peer, and are checked byte by byte; every operation posted is tracked until
/// its completion (success or error) is read.
pub struct Pinger {
    pub tx: MemoryRegion,
    pub rx: MemoryRegion,
    /// Posted and not yet completed: context -> when it was posted.
    pub outstanding: HashMap<u64, Instant>,
    /// Receive slots free to post, send slots free to use.
    pub next_send: u64,
    pub next_echo: u64,
    pub lens: HashMap<u64, usize>,
    pub send_failed: bool,
    /// Largest message it sends (at most `MAX_MSG`).
    pub max_len: usize,
    /// Error completions that said `FI_ETIMEDOUT` (the transport gave up retrying).
    pub timed_out: u64,
}

impl Pinger {
    pub fn new(domain: &Arc<Domain>) -> Pinger {
        Pinger {
            tx: MemoryRegion::alloc(domain, MAX_MSG * WINDOW, Flags::SEND).unwrap(),
            rx: MemoryRegion::alloc(domain, MAX_MSG * WINDOW, Flags::RECV).unwrap(),
            outstanding: HashMap::new(),
            next_send: 0,
            next_echo: 0,
            lens: HashMap::new(),
            send_failed: false,
            max_len: MAX_MSG,
            timed_out: 0,
        }
    }

    pub fn post_recv(&mut self, ep: &MsgEndpoint, slot: usize, out: &mut Outcome) -> bool {
        let ctx = RECV_TAG | slot as u64;
        match ep.recv(&self.rx, slot * MAX_MSG, MAX_MSG, ctx) {
            Ok(()) => {
                out.posted += 1;
                self.outstanding.insert(ctx, Instant::now());
                true
            }
            Err(_) => false,
        }
    }

    pub fn post_send(&mut self, ep: &MsgEndpoint, rng: &mut Rng, out: &mut Outcome) -> bool {
        let seq = self.next_send;
        let slot = (seq as usize) % WINDOW;
        let len = rng.range(1, self.max_len.min(MAX_MSG) as u64) as usize;
        self.tx
            .write_at(slot * MAX_MSG, &message(seq, len))
            .unwrap();
        let ctx = SEND_TAG | seq;
        match ep.send(&self.tx, slot * MAX_MSG, len, ctx) {
            Ok(()) => {
                out.posted += 1;
                self.outstanding.insert(ctx, Instant::now());
                self.lens.insert(seq, len);
                self.next_send += 1;
                true
            }
            Err(_) => {
                self.send_failed = true;
                false
            }
        }
    }

    /// Reads what the CQ has: checks echoes, reposts their slots and sends the next
    /// message while `more` allows. Returns how many completions it read.
    pub fn poll(
        &mut self,
        side: &Side,
        rng: &mut Rng,
        more: bool,
        out: &mut Outcome,
        fault_at: Option<Instant>,
    ) -> usize {
        let mut buf = [CqEntry::default(); 16];
        let mut done = Vec::new();
        match side.cq.read(&mut buf) {
            Ok(n) => done.extend(buf[..n].iter().map(|e| Ok(*e))),
            Err(e) if e.is_again() => {}
            Err(e) if e.errno() == errno::EAVAIL => {
                let err = side.cq.readerr().unwrap();
                done.push(Err(err));
            }
            Err(e) => out.problem(format!("cq read: {e}")),
        }
        let n = done.len();
        for c in done {
            let (ctx, ok) = match &c {
                Ok(e) => (e.op_context, true),
                Err(e) => (e.op_context, false),
            };
            let Some(posted) = self.outstanding.remove(&ctx) else {
                out.problem(format!("completion for {ctx:#x}, which is not outstanding"));
                continue;
            };
            // How long it waited under the fault: since the fault, or since it was
            // posted if that came later.
            if let Some(t) = fault_at {
                out.waited(posted.max(t).elapsed());
            }
            if ok {
                out.succeeded += 1;
            } else {
                out.failed += 1;
                let e = c.as_ref().unwrap_err();
                if e.err == errno::ETIMEDOUT {
                    self.timed_out += 1;
                }
                if fault_at.is_none() {
                    out.problem(format!("error completion before any fault: {e:?}"));
                }
                continue;
            }
            let e = c.unwrap();
            if ctx & RECV_TAG != 0 {
                let slot = (ctx & 0xffff) as usize;
                let seq = self.next_echo;
                self.next_echo += 1;
                match self.lens.remove(&seq) {
                    Some(len) if len == e.len => {
                        let mut got = vec![0u8; len];
                        self.rx.read_at(slot * MAX_MSG, &mut got).unwrap();
                        if got == message(seq, len) {
                            out.bytes_verified += len as u64;
                        } else {
                            out.problem(format!("echo {seq}: bytes differ"));
                        }
                    }
                    other => {
                        out.problem(format!("echo {seq}: {} bytes, expected {other:?}", e.len))
                    }
                }
                if more && self.post_recv(&side.ep, slot, out) {
                    self.post_send(&side.ep, rng, out);
                }
            }
        }
        n
    }
}

/// The far side of the echo traffic: sends each message back as it came, while
/// `keep_going` says so. Stops at the first error (a killed peer, a failed link), and
/// says which: the side that checks the traffic accounts for it.
pub fn echo_while(side: &Side, keep_going: impl Fn() -> bool) -> Result<()> {
    let buf =
        MemoryRegion::alloc(&side.domain, MAX_MSG * WINDOW, Flags::SEND | Flags::RECV).unwrap();
    for slot in 0..WINDOW {
        side.ep
            .recv(&buf, slot * MAX_MSG, MAX_MSG, RECV_TAG | slot as u64)
            .unwrap();
    }
    let mut cq = [CqEntry::default(); 16];
    while keep_going() {
        match side.cq.read(&mut cq) {
            Ok(n) => {
                for e in &cq[..n] {
                    let slot = (e.op_context & 0xffff) as usize;
                    let r = if e.op_context & RECV_TAG != 0 {
                        side.ep
                            .send(&buf, slot * MAX_MSG, e.len, SEND_TAG | slot as u64)
                    } else {
                        side.ep
                            .recv(&buf, slot * MAX_MSG, MAX_MSG, RECV_TAG | slot as u64)
                    };
                    r?;
                }
            }
            Err(e) if e.is_again() => {}
            Err(e) if e.errno() == errno::EAVAIL => {
                let c = side.cq.readerr()?;
                return Err(Error::new(
                    c.err,
                    format!(
                        "error completion {:#x}: {}",
                        c.op_context,
                        side.cq.strerror(c.prov_errno)
                    ),
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
