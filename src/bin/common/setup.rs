//! Connection set-up through rverbs: the measured endpoint (RC or UD) and its resources.

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;

use super::oob::{decode_params, encode_params, oob_accept, oob_connect, read_line};
use super::options::{Opts, MAX_ALL};

/// The endpoint a tool measures: connected (RC), datagram (UD) or reliable connectionless
/// (RDM), the last two with their peer's address.
pub(crate) enum Ep {
    Msg(MsgEndpoint),
    Dgram {
        ep: Arc<DgramEndpoint>,
        peer: u64,
        av: Arc<AddressVector>,
    },
    Rdm {
        ep: RdmEndpoint,
        peer: u64,
        /// Tagged messages (tag 0x5eed), or untagged.
        tag: Option<u64>,
    },
}

const TAG: u64 = 0x5eed;

/// The tools' CQs: `FI_CQ_FORMAT_MSG`, the narrowest format with what they read (context,
/// flags, length), as perftest reads what it needs of a work completion.
const TOOL_CQ: CqAttr = CqAttr {
    size: 0,
    flags: Flags::empty(),
    format: CqFormat::Msg,
    wait_obj: WaitObj::None,
    signaling_vector: 0,
    wait_cond: CqWaitCond::None,
};

impl Ep {
    pub(super) fn send(&self, mr: &MemoryRegion, off: usize, len: usize, ctx: u64) -> Result<()> {
        match self {
            Ep::Msg(e) => e.send(mr, off, len, ctx),
            Ep::Dgram { ep, peer, .. } => ep.send(mr, off, len, *peer, ctx),
            Ep::Rdm { ep, peer, tag } => {
                ep.send_region(mr, off, len, *peer, *tag, ctx, Flags::empty())
            }
        }
    }

    pub(super) fn recv(&self, mr: &MemoryRegion, off: usize, len: usize, ctx: u64) -> Result<()> {
        match self {
            Ep::Msg(e) => e.recv(mr, off, len, ctx),
            Ep::Dgram { ep, .. } => ep.recv(mr, off, len, ctx),
            Ep::Rdm { ep, tag, .. } => {
                let buf = RecvBuf::region(mr, off, len)?;
                match tag {
                    Some(t) => ep.trecv(buf, u64::MAX, *t, 0, ctx),
                    None => ep.recv(buf, u64::MAX, ctx),
                }
            }
        }
    }

    pub(super) fn inject_size(&self) -> usize {
        match self {
            Ep::Msg(e) => e.inject_size(),
            Ep::Dgram { ep, .. } => ep.inject_size(),
            Ep::Rdm { ep, .. } => ep.inject_size(),
        }
    }

    /// The local and remote names, as the banner prints them.
    pub(super) fn names(&self) -> (String, String) {
        match self {
            Ep::Msg(e) => (format!("{:?}", e.getname()), format!("{:?}", e.getpeer())),
            Ep::Dgram { ep, peer, av } => {
                let mut buf = [0u8; UdName::LEN];
                let mut len = buf.len();
                let remote = av
                    .lookup(*peer, &mut buf, &mut len)
                    .and_then(|_| AddressVector::straddr(&buf[..len]));
                let local = ep.getname().map(|n| n.to_str());
                (
                    local.unwrap_or_else(|e| e.to_string()),
                    remote.unwrap_or_else(|e| e.to_string()),
                )
            }
            Ep::Rdm { ep, peer, .. } => (
                ep.getname().map_or_else(|e| e.to_string(), |n| n.to_str()),
                format!("fi_addr {peer}"),
            ),
        }
    }

    pub(super) fn sendmsg(
        &self,
        mr: &MemoryRegion,
        len: usize,
        ctx: u64,
        flags: Flags,
    ) -> Result<()> {
        match self {
            Ep::Msg(e) => e.sendmsg(mr, 0, len, ctx, 0, flags),
            Ep::Dgram { ep, peer, .. } => ep.sendmsg(mr, 0, len, *peer, ctx, 0, flags),
            Ep::Rdm { ep, peer, tag } => ep.send_region(mr, 0, len, *peer, *tag, ctx, flags),
        }
    }

    pub(super) fn shutdown(&self) -> Result<()> {
        match self {
            Ep::Msg(e) => e.shutdown(),
            Ep::Dgram { .. } | Ep::Rdm { .. } => Ok(()),
        }
    }

    pub(super) fn msg(&self) -> Result<&MsgEndpoint> {
        match self {
            Ep::Msg(e) => Ok(e),
            _ => Err(Error::new(errno::EINVAL, "not a connected endpoint")),
        }
    }
}

pub(crate) struct Conn {
    pub(crate) ep: Ep,
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) tx: MemoryRegion,
    pub(crate) rx: MemoryRegion,
    pub(crate) info: Info,
    pub(crate) is_server: bool,
    /// Where the loops read completions: made once, not zeroed for every read.
    pub(crate) entries: std::cell::RefCell<[rfabric::core::cq::CqMsgEntry; 16]>,
    /// The peer's receive buffer as an RMA target: its address and key (write tests).
    pub(crate) remote: Option<(u64, u64)>,
    _eq: Option<Arc<EventQueue>>,
    _pep: Option<PassiveEndpoint>,
    /// The TCP control connection: parameters, RMA targets, one-sided sizes' ends.
    pub(crate) control: TcpStream,
}

/// How sends bind their CQ: with selective completion (`FI_COMPLETION` asked one in
/// `CQ_MOD` times, as perftest does) on both sides of a latency run and on the client of a
/// bandwidth run, whose server waits for the completion of its one answer.
fn send_bind(o: &Opts, is_server: bool) -> Flags {
    if o.test.is_lat() || !is_server {
        Flags::TRANSMIT | Flags::SELECTIVE_COMPLETION
    } else {
        Flags::TRANSMIT
    }
}

fn hints(o: &Opts) -> Info {
    let mut h = Info::default();
    h.ep_attr.ep_type = EpType::Msg;
    h.caps = if o.test.is_rma() {
        Flags::MSG | Flags::RMA
    } else {
        Flags::MSG
    };
    h.tx_attr.size = o.tx_depth.max(16);
    h.rx_attr.size = o.rx_depth;
    // One buffer per operation, as perftest: smaller work queue entries.
    h.tx_attr.iov_limit = 1;
    h.rx_attr.iov_limit = 1;
    // One thread per process uses the domain (fabtests ask the same).
    h.domain_attr.threading = Threading::Domain;
    if let Some(d) = &o.device {
        h.domain_attr.name = d.clone();
    }
    h
}

fn wait_connected(eq: &EventQueue, deadline: Instant, what: &str) -> Result<Vec<u8>, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out waiting for {what}"));
        }
        match eq.sread(left.as_millis().min(1000) as i32) {
            Ok(EqEvent::Connected { data, .. }) => return Ok(data),
            Ok(other) => {
                return Err(format!(
                    "unexpected event {other:?} while waiting for {what}"
                ))
            }
            Err(e) if e.errno() == errno::EAVAIL => {
                let err = eq.readerr().map_err(|e| e.to_string())?;
                return Err(format!(
                    "connection failed: {} (rdma_cm status {})",
                    rfabric::core::error::strerror(err.err),
                    err.prov_errno
                ));
            }
            Err(e) if e.is_again() => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn post_rx(c: &Conn, n: usize, len: usize) -> Result<(), String> {
    for _ in 0..n {
        c.ep.recv(&c.rx, 0, len, 1).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Sets up the connection: the server waits (saying so) for one client; the client connects.
pub(crate) fn connect(o: &mut Opts) -> Result<Conn, String> {
    let h = hints(o);
    let deadline = Instant::now() + o.timeout;
    let port = o.port.to_string();
    let e = |e: Error| e.to_string();
    match o.server.clone() {
        None => {
            let info = getinfo(None, Some(&port), Flags::SOURCE, Some(&h))
                .map_err(e)?
                .remove(0);
            let fabric = Fabric::open(&info.fabric_attr).map_err(e)?;
            let eq = EventQueue::open(&fabric, &EqAttr::default()).map_err(e)?;
            let pep = PassiveEndpoint::open(&fabric, &info, 0).map_err(e)?;
            pep.bind_eq(&eq).map_err(e)?;
            pep.listen().map_err(e)?;
            let control = oob_accept(o.port, deadline, o, &info.domain_attr.name)?;
            let mut r = BufReader::new(control.try_clone().map_err(|e| e.to_string())?);
            let params = read_line(&mut r, "the client's parameters")?;
            if let Err(msg) = decode_params(o, &params) {
                let _ = (&control).write_all(format!("err {msg}\n").as_bytes());
                return Err(msg);
            }
            (&control).write_all(b"ok\n").map_err(|e| e.to_string())?;
            if o.ud {
                return connect_ud(o, control, r, true);
            }
            if o.rdm {
                return connect_rdm(o, control, r, true);
            }
            let cinfo = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err("the client's rdma_cm connection did not arrive".into());
                }
                match eq.sread(left.as_millis().min(1000) as i32) {
                    Ok(EqEvent::ConnReq { info, .. }) => break *info,
                    Ok(_) => {}
                    Err(er) if er.is_again() => {}
                    Err(er) => return Err(er.to_string()),
                }
            };
            let max = if o.all { MAX_ALL } else { o.size }.min(cinfo.ep_attr.max_msg_size);
            let domain = Domain::open(&fabric, &cinfo).map_err(e)?;
            let conn = endpoint(&domain, &cinfo, &eq, Some(pep), max, o, control)?;
            post_rx(&conn, o.rx_depth, max)?;
            conn.ep.msg().map_err(e)?.accept(b"").map_err(e)?;
            wait_connected(&eq, deadline, "the client's connection")?;
            swap_rma_target(conn, o, &mut r)
        }
        Some(server) => {
            let control = oob_connect(&server, o.port, o)?;
            (&control)
                .write_all(encode_params(o).as_bytes())
                .map_err(|e| e.to_string())?;
            let mut r = BufReader::new(control.try_clone().map_err(|e| e.to_string())?);
            let reply = read_line(&mut r, "the server's answer")?;
            if let Some(msg) = reply.strip_prefix("err ") {
                return Err(format!("the server refused: {msg}"));
            }
            if reply != "ok" {
                return Err(format!("unexpected answer from the server: {reply:?}"));
            }
            if o.ud {
                return connect_ud(o, control, r, false);
            }
            if o.rdm {
                return connect_rdm(o, control, r, false);
            }
            let info = getinfo(Some(&server), Some(&port), Flags::empty(), Some(&h))
                .map_err(|e| format!("cannot reach {server}:{port} over RDMA: {e}"))?
                .remove(0);
            let max = if o.all { MAX_ALL } else { o.size }.min(info.ep_attr.max_msg_size);
            let fabric = Fabric::open(&info.fabric_attr).map_err(e)?;
            let eq = EventQueue::open(&fabric, &EqAttr::default()).map_err(e)?;
            let domain = Domain::open(&fabric, &info).map_err(e)?;
            let conn = endpoint(&domain, &info, &eq, None, max, o, control)?;
            post_rx(&conn, o.rx_depth, max)?;
            conn.ep.msg().map_err(e)?.connect(b"").map_err(e)?;
            wait_connected(&eq, deadline, &format!("the server at {server}:{port}"))?;
            swap_rma_target(conn, o, &mut r)
        }
    }
}

/// For write tests: tells the peer where its writes go (this side's receive buffer) over
/// the control connection, and learns where this side's go.
fn swap_rma_target(mut conn: Conn, o: &Opts, r: &mut BufReader<TcpStream>) -> Result<Conn, String> {
    if !o.test.is_rma() {
        return Ok(conn);
    }
    let line = format!("rma {:x} {:x}\n", conn.rx.addr(), conn.rx.key());
    (&conn.control)
        .write_all(line.as_bytes())
        .map_err(|e| e.to_string())?;
    let peer = read_line(r, "the peer's buffer address and key")?;
    let bad = || format!("the peer sent {peer:?}, not its buffer's address and key");
    let mut it = peer.strip_prefix("rma ").ok_or_else(bad)?.split(' ');
    let mut hex = || u64::from_str_radix(it.next().unwrap_or(""), 16).map_err(|_| bad());
    conn.remote = Some((hex()?, hex()?));
    Ok(conn)
}

fn endpoint(
    domain: &Arc<Domain>,
    info: &Info,
    eq: &Arc<EventQueue>,
    pep: Option<PassiveEndpoint>,
    max: usize,
    o: &Opts,
    control: TcpStream,
) -> Result<Conn, String> {
    let inline = o.inline;
    let e = |e: Error| e.to_string();
    let is_server = pep.is_some();
    let mut info = info.clone();
    // The receives it posts (`-r`): a server's info is its request's, made before the
    // client's parameters came.
    info.rx_attr.size = o.rx_depth;
    if let Some(i) = inline {
        info.tx_attr.inject_size = i.min(info.tx_attr.inject_size);
    }
    let cq = CompletionQueue::open(domain, &TOOL_CQ).map_err(e)?;
    let ep = MsgEndpoint::open(domain, &info, 0).map_err(e)?;
    ep.bind_eq(eq).map_err(e)?;
    ep.bind_cq(&cq, send_bind(o, is_server)).map_err(e)?;
    ep.bind_cq(&cq, Flags::RECV).map_err(e)?;
    ep.enable().map_err(e)?;
    // The receive buffer is the peer's RMA target, the send buffer the local end of writes
    // and reads.
    let tx_access = Flags::SEND | Flags::WRITE | Flags::READ;
    let rx_access = Flags::RECV | Flags::REMOTE_WRITE | Flags::REMOTE_READ;
    let tx = MemoryRegion::alloc(domain, max.max(1), tx_access).map_err(e)?;
    let rx = MemoryRegion::alloc(domain, max.max(1), rx_access).map_err(e)?;
    Ok(Conn {
        ep: Ep::Msg(ep),
        cq,
        tx,
        rx,
        info,
        is_server,
        entries: Default::default(),
        remote: None,
        _eq: Some(eq.clone()),
        _pep: pep,
        control,
    })
}

/// Sets up datagram endpoints: each side posts its receives, then sends its name over
/// the control connection and inserts the other's into its address vector.
fn connect_ud(
    o: &Opts,
    control: TcpStream,
    mut r: BufReader<TcpStream>,
    is_server: bool,
) -> Result<Conn, String> {
    let e = |e: Error| e.to_string();
    let mut h = hints(o);
    h.ep_attr.ep_type = EpType::Dgram;
    let mut info = getinfo(None, None, Flags::empty(), Some(&h))
        .map_err(e)?
        .remove(0);
    if let Some(i) = o.inline {
        info.tx_attr.inject_size = i.min(info.tx_attr.inject_size);
    }
    let mtu = info.ep_attr.max_msg_size;
    if !o.all && o.size > mtu {
        return Err(format!(
            "-s {}: a datagram carries at most the path MTU, {mtu} bytes",
            o.size
        ));
    }
    let max = if o.all { mtu } else { o.size };
    let fabric = Fabric::open(&info.fabric_attr).map_err(e)?;
    let domain = Domain::open(&fabric, &info).map_err(e)?;
    let av = AddressVector::open(&domain, &AvAttr::default()).map_err(e)?;
    let cq = CompletionQueue::open(&domain, &TOOL_CQ).map_err(e)?;
    let ep = DgramEndpoint::open(&domain, &info).map_err(e)?;
    ep.bind_cq(&cq, send_bind(o, is_server)).map_err(e)?;
    ep.bind_cq(&cq, Flags::RECV).map_err(e)?;
    ep.bind_av(&av).map_err(e)?;
    ep.enable().map_err(e)?;
    let tx = MemoryRegion::alloc(&domain, max.max(1), Flags::SEND).map_err(e)?;
    // Whole-MTU receives: a datagram cannot be longer, so no overflow element is needed.
    let rx = MemoryRegion::alloc(&domain, mtu, Flags::RECV).map_err(e)?;
    for _ in 0..o.rx_depth {
        ep.recv(&rx, 0, rx.len(), 1).map_err(e)?;
    }
    let name = swap_names(
        &control,
        &mut r,
        &ep.getname().map_err(e)?.to_bytes(),
        is_server,
    )?;
    let peer = av.insert(&name).map_err(e)?;
    Ok(Conn {
        ep: Ep::Dgram { ep, peer, av },
        cq,
        tx,
        rx,
        info,
        is_server,
        entries: Default::default(),
        remote: None,
        _eq: None,
        _pep: None,
        control,
    })
}

/// Exchanges endpoint names over the control connection (the server's first).
fn swap_names(
    control: &TcpStream,
    r: &mut BufReader<TcpStream>,
    mine: &[u8],
    is_server: bool,
) -> Result<Vec<u8>, String> {
    let mine = format!("name {}\n", hex(mine));
    let theirs = if is_server {
        (&*control)
            .write_all(mine.as_bytes())
            .map_err(|e| e.to_string())?;
        read_line(r, "the client's endpoint name")?
    } else {
        let t = read_line(r, "the server's endpoint name")?;
        (&*control)
            .write_all(mine.as_bytes())
            .map_err(|e| e.to_string())?;
        t
    };
    theirs
        .strip_prefix("name ")
        .and_then(unhex)
        .ok_or_else(|| format!("bad endpoint name from the peer: {theirs:?}"))
}

/// Sets up RDM endpoints: as datagram ones, names over the control connection; the first
/// message connects them.
fn connect_rdm(
    o: &Opts,
    control: TcpStream,
    mut r: BufReader<TcpStream>,
    is_server: bool,
) -> Result<Conn, String> {
    let e = |e: Error| e.to_string();
    let mut h = hints(o);
    h.ep_attr.ep_type = EpType::Rdm;
    h.caps = Flags::MSG | Flags::TAGGED;
    let info = getinfo(None, None, Flags::empty(), Some(&h))
        .map_err(e)?
        .remove(0);
    let most = info.ep_attr.max_msg_size;
    if !o.all && o.size > most {
        return Err(format!(
            "-s {}: RDM messages are at most {most} bytes (max_msg_size)",
            o.size
        ));
    }
    let max = if o.all { most.min(MAX_ALL) } else { o.size };
    let fabric = Fabric::open(&info.fabric_attr).map_err(e)?;
    let domain = Domain::open(&fabric, &info).map_err(e)?;
    let av = AddressVector::open(&domain, &AvAttr::default()).map_err(e)?;
    let cq = CompletionQueue::open(&domain, &TOOL_CQ).map_err(e)?;
    let ep = RdmEndpoint::open(&domain, &info).map_err(e)?;
    ep.bind_cq(&cq, send_bind(o, is_server)).map_err(e)?;
    ep.bind_cq(&cq, Flags::RECV).map_err(e)?;
    ep.bind_av(&av).map_err(e)?;
    ep.enable().map_err(e)?;
    // As through the C ABI: a peer on this host is reached over shm (FI_RVERBS_RDM_SHM=0: verbs).
    rfabric::capi::ext::local::import_shm(&ep).map_err(e)?;
    // The send buffer grants remote read: large messages are read from it by the receiver
    // (rendezvous) with no registration per message, as perftest's buffers are registered
    // once. Without it each large send registers its buffer for that send.
    let tx =
        MemoryRegion::alloc(&domain, max.max(1), Flags::SEND | Flags::REMOTE_READ).map_err(e)?;
    let rx = MemoryRegion::alloc(&domain, max.max(1), Flags::RECV).map_err(e)?;
    let tag = o.tagged.then_some(TAG);
    let theirs = swap_names(
        &control,
        &mut r,
        &ep.getname().map_err(e)?.to_bytes(),
        is_server,
    )?;
    let peer = av.insert(&theirs).map_err(e)?;
    let conn = Conn {
        ep: Ep::Rdm { ep, peer, tag },
        cq,
        tx,
        rx,
        info,
        is_server,
        entries: Default::default(),
        remote: None,
        _eq: None,
        _pep: None,
        control,
    };
    first_contact(&conn, o.timeout)?;
    post_rx(&conn, o.rx_depth.min(conn.info.rx_attr.size), max)?;
    Ok(conn)
}

/// The first message to a peer connects: one goes from client to server before anything
/// is timed, as perftest's queue pairs are connected before its loops start (otherwise a
/// short bandwidth run would time the connection too).
fn first_contact(c: &Conn, timeout: std::time::Duration) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let Ep::Rdm { ep, peer, tag } = &c.ep else {
        return Ok(());
    };
    const CONTACT: u64 = 7;
    let want = if c.is_server {
        let buf = RecvBuf::region(&c.rx, 0, c.rx.len()).map_err(e)?;
        match tag {
            Some(t) => ep.trecv(buf, u64::MAX, *t, 0, CONTACT),
            None => ep.recv(buf, u64::MAX, CONTACT),
        }
        .map_err(e)?;
        Flags::RECV
    } else {
        // A local peer's first send may be -FI_EAGAIN (shm's connection handshake) until
        // both sides have made progress.
        let t = Instant::now();
        let mut out = [rfabric::core::cq::CqMsgEntry::default(); 1];
        loop {
            match ep.send_region(&c.tx, 0, 1, *peer, *tag, CONTACT, Flags::COMPLETION) {
                Err(er) if er.is_again() && t.elapsed() < timeout => {
                    let _ = c.cq.read(&mut out[..0]);
                }
                r => break r.map_err(e)?,
            }
        }
        Flags::SEND
    };
    let t = Instant::now();
    let mut out = [rfabric::core::cq::CqMsgEntry::default(); 1];
    loop {
        match c.cq.read(&mut out) {
            Ok(1) if out[0].op_context == CONTACT && out[0].flags & want.bits() != 0 => {
                return Ok(())
            }
            Ok(_) => {}
            Err(er) if er.is_again() => {}
            Err(er) => return Err(format!("first message to the peer: {er}")),
        }
        if t.elapsed() > timeout {
            return Err("the peer did not answer the first message (connection)".into());
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}
