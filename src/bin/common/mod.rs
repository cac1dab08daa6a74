//! What the perftest-style tools share: options, connection set-up through rverbs, the
//! ping-pong and windowed-send loops, and perftest's output tables.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfabric::core::cq::CqEntry;
use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;
use rfabric_sys::clock::{cycles, cycles_per_us};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Test {
    SendLat,
    SendBw,
}

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    pub(crate) test: Test,
    pub(crate) server: Option<String>,
    pub(crate) port: u16,
    pub(crate) device: Option<String>,
    pub(crate) size: usize,
    pub(crate) all: bool,
    pub(crate) iters: usize,
    pub(crate) tx_depth: usize,
    /// Largest send carried inline (`-I`); `None` leaves the provider's inject size.
    pub(crate) inline: Option<usize>,
    pub(crate) json: bool,
    pub(crate) timeout: Duration,
    /// `-c UD`: datagrams (`FI_EP_DGRAM` on UD QPs) instead of RC.
    pub(crate) ud: bool,
}

const RX_DEPTH: usize = 512;
const WARMUP: usize = 100;
/// Sends per requested completion in the bandwidth test (perftest's default `--cq-mod`).
const CQ_MOD: usize = 100;
const MAX_ALL: usize = 8 << 20;

pub(crate) fn usage(test: Test) -> String {
    let name = match test {
        Test::SendLat => "rfab_send_lat",
        Test::SendBw => "rfab_send_bw",
    };
    format!(
        "usage: {name} [options]            (server)\n       {name} [options] SERVER     (client)\n\
         \x20 -d, --ib-dev DEV     device (domain) to use, e.g. rxe0\n\
         \x20 -p, --port PORT      rdma_cm port (default 18515)\n\
         \x20 -s, --size BYTES     message size (default {})\n\
         \x20 -a, --all            every power of two from 2 B to 8 MiB (capped by max_msg_size)\n\
         \x20 -n, --iters N        iterations per size (default {})\n\
         \x20 -t, --tx-depth N     sends in flight for bandwidth (default 128)\n\
         \x20 -I, --inline_size N  largest send carried inline (default: the device's inject size)\n\
         \x20 -x, --gid-index N    accepted for perftest compatibility (rdma_cm picks the GID)\n\
         \x20 -c, --connection T   RC (default) or UD (latency only: datagrams up to the MTU)\n\
         \x20 -T, --timeout SEC    give up waiting for the peer after SEC seconds (default 60)\n\
         \x20     --json           one JSON object per size instead of the table\n",
        if test == Test::SendLat { 2 } else { 65536 },
        if test == Test::SendLat { 1000 } else { 5000 }
    )
}

pub(crate) fn parse(test: Test, args: impl Iterator<Item = String>) -> Result<Opts, String> {
    let mut o = Opts {
        test,
        server: None,
        port: 18515,
        device: None,
        size: if test == Test::SendLat { 2 } else { 65536 },
        all: false,
        iters: if test == Test::SendLat { 1000 } else { 5000 },
        tx_depth: 128,
        inline: None,
        json: false,
        timeout: Duration::from_secs(60),
        ud: false,
    };
    let mut args = args.peekable();
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "-d" | "--ib-dev" => o.device = Some(args.next().ok_or("-d needs a device name")?),
            "-p" | "--port" => o.port = num(&a, args.next())?,
            "-s" | "--size" => o.size = num(&a, args.next())?,
            "-a" | "--all" => o.all = true,
            "-n" | "--iters" => o.iters = num(&a, args.next())?,
            "-t" | "--tx-depth" => o.tx_depth = num(&a, args.next())?,
            "-I" | "--inline_size" => o.inline = Some(num(&a, args.next())?),
            // rdma_cm chooses the GID that routes to the peer; accepted for perftest's sake.
            "-x" | "--gid-index" => {
                let _: u32 = num(&a, args.next())?;
            }
            "-T" | "--timeout" => o.timeout = Duration::from_secs(num(&a, args.next())?),
            "--json" => o.json = true,
            "-c" | "--connection" => {
                o.ud = match args.next().as_deref() {
                    Some("RC") => false,
                    Some("UD") => true,
                    other => return Err(format!("-c {other:?}: RC or UD")),
                }
            }
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => {
                if o.server.replace(s.to_string()).is_some() {
                    return Err("only one server address may be given".into());
                }
            }
        }
    }
    if o.ud && test == Test::SendBw {
        return Err(
            "-c UD: datagrams may be dropped, which a bandwidth count cannot tell from slowness; use rfab_send_lat -c UD"
                .into(),
        );
    }
    if o.iters == 0 || o.tx_depth == 0 || o.tx_depth > 4096 {
        return Err("iterations must be > 0 and the tx depth between 1 and 4096".into());
    }
    Ok(o)
}

/// The client's parameters, sent to the server over the TCP control connection.
fn encode_params(o: &Opts) -> String {
    format!(
        "rfab1 test={} ud={} all={} size={} iters={} depth={} inline={}\n",
        o.test as u8,
        o.ud as u8,
        o.all as u8,
        o.size,
        o.iters,
        o.tx_depth,
        o.inline.map_or(-1, |i| i as i64)
    )
}

fn decode_params(o: &mut Opts, line: &str) -> Result<(), String> {
    let mut f = line.split_whitespace();
    if f.next() != Some("rfab1") {
        return Err(format!(
            "the peer is not an rfabric tool of this version (it sent {line:?})"
        ));
    }
    for kv in f {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("bad parameter {kv:?}"))?;
        let n: i64 = v.parse().map_err(|_| format!("bad parameter {kv:?}"))?;
        match k {
            "test" if n != o.test as i64 => {
                return Err(
                    "the client runs a different test: start both sides with the same tool".into(),
                )
            }
            "test" => {}
            "ud" => o.ud = n != 0,
            "all" => o.all = n != 0,
            "size" => o.size = n as usize,
            "iters" => o.iters = n as usize,
            "depth" => o.tx_depth = n as usize,
            "inline" => o.inline = (n >= 0).then_some(n as usize),
            _ => return Err(format!("unknown parameter {k:?}")),
        }
    }
    Ok(())
}

/// The server's side of the control connection: waits (saying so) for one client.
fn oob_accept(port: u16, deadline: Instant, o: &Opts, dev: &str) -> Result<TcpStream, String> {
    let l = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| format!("cannot listen on TCP port {port}: {e}"))?;
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    eprintln!(
        "waiting for a client on port {port} (device {dev}, giving up after {} s)...",
        o.timeout.as_secs()
    );
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(o.timeout))
                    .map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(format!(
                        "no client connected within {} s",
                        o.timeout.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The client's side: connects to the server's control port, retrying briefly while the
/// server starts, and fails with the cause rather than hang.
fn oob_connect(server: &str, port: u16, o: &Opts) -> Result<TcpStream, String> {
    let addrs: Vec<_> = (server, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {server}: {e}"))?
        .collect();
    let give_up = Instant::now() + o.timeout.min(Duration::from_secs(5));
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(s) => {
                    s.set_read_timeout(Some(o.timeout))
                        .map_err(|e| e.to_string())?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() > give_up {
            let e = last.map_or("no address".to_string(), |e| e.to_string());
            return Err(format!(
                "no server at {server}:{port} ({e}): start the server first"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn read_line(s: &mut BufReader<TcpStream>, what: &str) -> Result<String, String> {
    let mut line = String::new();
    match s.read_line(&mut line) {
        Ok(0) => Err(format!(
            "the peer closed the control connection before {what}"
        )),
        Ok(_) => Ok(line.trim_end().to_string()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(format!("timed out waiting for {what}"))
        }
        Err(e) => Err(format!("control connection: {e}")),
    }
}

/// The endpoint a tool measures: connected (RC) or datagram (UD, with its peer's address).
pub(crate) enum Ep {
    Msg(MsgEndpoint),
    Dgram {
        ep: Arc<DgramEndpoint>,
        peer: u64,
        av: Arc<AddressVector>,
    },
}

impl Ep {
    fn send(&self, mr: &MemoryRegion, off: usize, len: usize, ctx: u64) -> Result<()> {
        match self {
            Ep::Msg(e) => e.send(mr, off, len, ctx),
            Ep::Dgram { ep, peer, .. } => ep.send(mr, off, len, *peer, ctx),
        }
    }

    fn recv(&self, mr: &MemoryRegion, off: usize, len: usize, ctx: u64) -> Result<()> {
        match self {
            Ep::Msg(e) => e.recv(mr, off, len, ctx),
            Ep::Dgram { ep, .. } => ep.recv(mr, off, len, ctx),
        }
    }

    fn inject_size(&self) -> usize {
        match self {
            Ep::Msg(e) => e.inject_size(),
            Ep::Dgram { ep, .. } => ep.inject_size(),
        }
    }

    /// The local and remote names, as the banner prints them.
    fn names(&self) -> (String, String) {
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
        }
    }

    fn sendmsg(&self, mr: &MemoryRegion, len: usize, ctx: u64, flags: Flags) -> Result<()> {
        match self {
            Ep::Msg(e) => e.sendmsg(mr, 0, len, ctx, 0, flags),
            Ep::Dgram { ep, peer, .. } => ep.sendmsg(mr, 0, len, *peer, ctx, 0, flags),
        }
    }

    fn shutdown(&self) -> Result<()> {
        match self {
            Ep::Msg(e) => e.shutdown(),
            Ep::Dgram { .. } => Ok(()),
        }
    }

    fn msg(&self) -> Result<&MsgEndpoint> {
        match self {
            Ep::Msg(e) => Ok(e),
            Ep::Dgram { .. } => Err(Error::new(errno::EINVAL, "not a connected endpoint")),
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
    _eq: Option<Arc<EventQueue>>,
    _pep: Option<PassiveEndpoint>,
    _control: TcpStream,
}

fn hints(o: &Opts) -> Info {
    let mut h = Info::default();
    h.ep_attr.ep_type = EpType::Msg;
    h.caps = Flags::MSG;
    h.tx_attr.size = o.tx_depth.max(16);
    h.rx_attr.size = RX_DEPTH;
    // One buffer per operation, as perftest: smaller work queue entries.
    h.tx_attr.iov_limit = 1;
    h.rx_attr.iov_limit = 1;
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
            post_rx(&conn, RX_DEPTH, max)?;
            conn.ep.msg().map_err(e)?.accept(b"").map_err(e)?;
            wait_connected(&eq, deadline, "the client's connection")?;
            Ok(conn)
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
            let info = getinfo(Some(&server), Some(&port), Flags::empty(), Some(&h))
                .map_err(|e| format!("cannot reach {server}:{port} over RDMA: {e}"))?
                .remove(0);
            let max = if o.all { MAX_ALL } else { o.size }.min(info.ep_attr.max_msg_size);
            let fabric = Fabric::open(&info.fabric_attr).map_err(e)?;
            let eq = EventQueue::open(&fabric, &EqAttr::default()).map_err(e)?;
            let domain = Domain::open(&fabric, &info).map_err(e)?;
            let conn = endpoint(&domain, &info, &eq, None, max, o, control)?;
            post_rx(&conn, RX_DEPTH, max)?;
            conn.ep.msg().map_err(e)?.connect(b"").map_err(e)?;
            wait_connected(&eq, deadline, &format!("the server at {server}:{port}"))?;
            Ok(conn)
        }
    }
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
    let selective_tx = o.test == Test::SendBw && pep.is_none();
    let e = |e: Error| e.to_string();
    let is_server = pep.is_some();
    let mut info = info.clone();
    if let Some(i) = inline {
        info.tx_attr.inject_size = i.min(info.tx_attr.inject_size);
    }
    let cq = CompletionQueue::open(domain, &CqAttr::default()).map_err(e)?;
    let ep = MsgEndpoint::open(domain, &info, 0).map_err(e)?;
    ep.bind_eq(eq).map_err(e)?;
    // The bandwidth client asks for one send completion in CQ_MOD, as perftest does.
    let tx_bind = if selective_tx {
        Flags::TRANSMIT | Flags::SELECTIVE_COMPLETION
    } else {
        Flags::TRANSMIT
    };
    ep.bind_cq(&cq, tx_bind).map_err(e)?;
    ep.bind_cq(&cq, Flags::RECV).map_err(e)?;
    ep.enable().map_err(e)?;
    let tx = MemoryRegion::alloc(domain, max.max(1), Flags::SEND).map_err(e)?;
    let rx = MemoryRegion::alloc(domain, max.max(1), Flags::RECV).map_err(e)?;
    Ok(Conn {
        ep: Ep::Msg(ep),
        cq,
        tx,
        rx,
        info,
        is_server,
        _eq: Some(eq.clone()),
        _pep: pep,
        _control: control,
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
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).map_err(e)?;
    let ep = DgramEndpoint::open(&domain, &info).map_err(e)?;
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).map_err(e)?;
    ep.bind_av(&av).map_err(e)?;
    ep.enable().map_err(e)?;
    let tx = MemoryRegion::alloc(&domain, max.max(1), Flags::SEND).map_err(e)?;
    // Whole-MTU receives: a datagram cannot be longer, so no overflow element is needed.
    let rx = MemoryRegion::alloc(&domain, mtu, Flags::RECV).map_err(e)?;
    for _ in 0..RX_DEPTH {
        ep.recv(&rx, 0, rx.len(), 1).map_err(e)?;
    }
    let mine = format!("name {}\n", hex(&ep.getname().map_err(e)?.to_bytes()));
    let theirs = if is_server {
        (&control)
            .write_all(mine.as_bytes())
            .map_err(|e| e.to_string())?;
        read_line(&mut r, "the client's datagram name")?
    } else {
        let t = read_line(&mut r, "the server's datagram name")?;
        (&control)
            .write_all(mine.as_bytes())
            .map_err(|e| e.to_string())?;
        t
    };
    let name = theirs
        .strip_prefix("name ")
        .and_then(unhex)
        .ok_or_else(|| format!("bad datagram name from the peer: {theirs:?}"))?;
    let peer = av.insert(&name).map_err(e)?;
    Ok(Conn {
        ep: Ep::Dgram { ep, peer, av },
        cq,
        tx,
        rx,
        info,
        is_server,
        _eq: None,
        _pep: None,
        _control: control,
    })
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

/// The sizes to run: one, or every power of two from 2 B up to the largest message.
pub(crate) fn sizes(o: &Opts, c: &Conn) -> Vec<usize> {
    let max = c.info.ep_attr.max_msg_size.min(MAX_ALL).min(c.rx.len());
    if o.all {
        (1..)
            .map(|k| 1usize << k)
            .take_while(|&s| s <= max)
            .collect()
    } else {
        vec![o.size]
    }
}

/// A timeout that costs a TSC read to check, and is checked only every 4096 empty polls.
pub(crate) struct Deadline {
    end: u64,
    polls: u32,
}

impl Deadline {
    pub(crate) fn after(d: Duration) -> Self {
        Deadline {
            end: cycles() + (d.as_secs_f64() * 1e6 * cycles_per_us()) as u64,
            polls: 0,
        }
    }

    #[inline]
    pub(crate) fn passed(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        self.polls % 4096 == 0 && cycles() > self.end
    }
}

/// Counts completions until `recvs` receives were seen; sends are reaped on the way.
/// Returns how many send completions were reaped.
fn reap(c: &Conn, recvs: usize, deadline: &mut Deadline) -> Result<usize, String> {
    let mut out = [CqEntry::default(); 16];
    let (mut got, mut sends) = (0, 0);
    while got < recvs {
        match c.cq.read(&mut out) {
            Ok(n) => {
                for e in &out[..n] {
                    if e.flags & Flags::RECV.bits() != 0 {
                        got += 1;
                    } else {
                        sends += 1;
                    }
                }
            }
            Err(e) if e.is_again() => {
                if deadline.passed() {
                    return Err("the peer stopped answering".into());
                }
            }
            Err(e) if e.errno() == errno::EAVAIL => {
                let err = c.cq.readerr().map_err(|e| e.to_string())?;
                return Err(format!(
                    "completion error: {} ({})",
                    rfabric::core::error::strerror(err.err),
                    c.cq.strerror(err.prov_errno)
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(sends)
}

fn reap_sends(c: &Conn, mut n: usize, deadline: &mut Deadline) -> Result<(), String> {
    let mut out = [CqEntry::default(); 16];
    while n > 0 {
        match c.cq.read(&mut out) {
            Ok(k) => {
                n = n.saturating_sub(
                    out[..k]
                        .iter()
                        .filter(|e| e.flags & Flags::SEND.bits() != 0)
                        .count(),
                )
            }
            Err(e) if e.is_again() => {
                if deadline.passed() {
                    return Err("send completions stopped".into());
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Ping-pong: the client times round trips; one-way latency is half of each.
pub(crate) fn run_lat(
    c: &Conn,
    size: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Vec<f64>, String> {
    // A fixed warm-up: runs that differ only in -n then differ by exactly that many round
    // trips, which the instruction-count comparison relies on.
    let warmup = WARMUP;
    let mut samples = Vec::with_capacity(iters);
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let per_us = cycles_per_us();
    let mut unreaped = 0usize;
    for i in 0..warmup + iters {
        let t0 = cycles();
        if c.is_server {
            unreaped -= reap(c, 1, deadline)?.min(unreaped);
            c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
            c.ep.send(&c.tx, 0, size, 2).map_err(e)?;
            unreaped += 1;
        } else {
            c.ep.send(&c.tx, 0, size, 2).map_err(e)?;
            unreaped += 1;
            unreaped -= reap(c, 1, deadline)?.min(unreaped);
            c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
        }
        if i >= warmup && !c.is_server {
            samples.push(cycles().wrapping_sub(t0) as f64 / per_us / 2.0);
        }
    }
    reap_sends(c, unreaped, deadline)?;
    Ok(samples)
}

/// Windowed sends: the client keeps `depth` sends in flight; the server counts arrivals and
/// answers with one message when all have come. Returns (total seconds, best window MB/s).
pub(crate) fn run_bw(
    c: &Conn,
    size: usize,
    iters: usize,
    depth: usize,
    timeout: Duration,
) -> Result<(f64, f64), String> {
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let mut out = [CqEntry::default(); 16];
    if c.is_server {
        let mut got = 0;
        while got < iters {
            match c.cq.read(&mut out) {
                Ok(n) => {
                    for en in &out[..n] {
                        if en.flags & Flags::RECV.bits() != 0 {
                            if en.len != size {
                                return Err(format!("received {} bytes, expected {size}", en.len));
                            }
                            got += 1;
                            c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
                        }
                    }
                }
                Err(er) if er.is_again() => {
                    if deadline.passed() {
                        return Err(format!("only {got} of {iters} messages arrived"));
                    }
                }
                Err(er) => return Err(er.to_string()),
            }
        }
        c.ep.send(&c.tx, 0, 0, 3).map_err(e)?;
        reap_sends(c, 1, deadline)?;
        return Ok((0.0, 0.0));
    }
    let per_us = cycles_per_us();
    let (mut posted, mut done, mut answered) = (0usize, 0usize, 0usize);
    let start = cycles();
    let (mut window_start, mut window_done) = (start, 0usize);
    let mut peak: f64 = 0.0;
    while done < iters {
        while posted < iters && posted - done < depth {
            // One completion in CQ_MOD (and the last): RC completes sends in order, so a
            // completion for send k means sends 0..=k are done.
            let r = if (posted + 1) % CQ_MOD == 0 || posted + 1 == iters {
                c.ep.sendmsg(&c.tx, size, posted as u64, Flags::COMPLETION)
            } else {
                c.ep.send(&c.tx, 0, size, posted as u64)
            };
            match r {
                Ok(()) => posted += 1,
                Err(er) if er.is_again() => break,
                Err(er) => return Err(er.to_string()),
            }
        }
        match c.cq.read(&mut out) {
            Ok(n) => {
                for en in &out[..n] {
                    if en.flags & Flags::SEND.bits() != 0 {
                        done = done.max(en.op_context as usize + 1);
                    } else {
                        // The server's answer can overtake our last send completions.
                        answered += 1;
                    }
                }
                if done - window_done >= depth {
                    let now = cycles();
                    let us = now.wrapping_sub(window_start) as f64 / per_us;
                    if us > 0.0 {
                        peak = peak.max(((done - window_done) * size) as f64 / us);
                    }
                    (window_start, window_done) = (now, done);
                }
            }
            Err(er) if er.is_again() => {
                if deadline.passed() {
                    return Err(format!("only {done} of {iters} sends completed"));
                }
            }
            Err(er) if er.errno() == errno::EAVAIL => {
                let err = c.cq.readerr().map_err(|e| e.to_string())?;
                return Err(format!(
                    "send failed: {} ({})",
                    rfabric::core::error::strerror(err.err),
                    c.cq.strerror(err.prov_errno)
                ));
            }
            Err(er) => return Err(er.to_string()),
        }
    }
    let secs = cycles().wrapping_sub(start) as f64 / per_us / 1e6;
    // The server's answer closes the size: it has counted every message.
    if answered == 0 {
        reap(c, 1, deadline)?;
    }
    c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
    Ok((secs, peak))
}

pub(crate) fn banner(o: &Opts, c: &Conn) {
    if o.json {
        return;
    }
    let line = "-".repeat(87);
    let title = match o.test {
        Test::SendLat => "Send Latency Test",
        Test::SendBw => "Send BW Test",
    };
    println!("{line}");
    let (ep_type, transport) = match c.ep {
        Ep::Msg(_) => ("FI_EP_MSG", "RC over rdma_cm, manual progress"),
        Ep::Dgram { .. } => ("FI_EP_DGRAM", "UD, manual progress"),
    };
    let (local, remote) = c.ep.names();
    println!("                    {title} (rfabric rverbs, {ep_type})");
    println!(" Device         : {}", c.info.domain_attr.name);
    println!(" Transport type : {transport}");
    println!(" TX depth       : {}", o.tx_depth);
    println!(" Inline size    : {}", c.ep.inject_size());
    println!(" Local address  : {local}");
    println!(" Remote address : {remote}");
    println!("{line}");
    match o.test {
        Test::SendLat => println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        ),
        Test::SendBw => println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"),
    }
}

pub(crate) struct LatStats {
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) typical: f64,
    pub(crate) avg: f64,
    pub(crate) stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

pub(crate) fn lat_stats(samples: &mut [f64]) -> LatStats {
    samples.sort_by(|a, b| a.total_cmp(b));
    let n = samples.len().max(1) as f64;
    let avg = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / n;
    let pct = |p: f64| {
        samples[(((samples.len() as f64) * p).ceil() as usize).clamp(1, samples.len()) - 1]
    };
    LatStats {
        min: samples[0],
        max: samples[samples.len() - 1],
        typical: samples[samples.len() / 2],
        avg,
        stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

pub(crate) fn print_lat(o: &Opts, size: usize, s: &LatStats) {
    if o.json {
        println!(
            "{{\"test\":\"send_lat\",\"bytes\":{size},\"iterations\":{},\"t_min\":{:.2},\"t_max\":{:.2},\"t_typical\":{:.2},\"t_avg\":{:.2},\"t_stdev\":{:.2},\"p99\":{:.2},\"p999\":{:.2}}}",
            o.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
        );
    } else {
        println!(
            " {:<6} {:<10}       {:<7.2}        {:<7.2}      {:<7.2}            {:<7.2}        {:<7.2}         {:<7.2}                {:<7.2}",
            size, o.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
        );
    }
}

pub(crate) fn print_bw(o: &Opts, size: usize, secs: f64, peak: f64) {
    let avg = (size * o.iters) as f64 / secs / 1e6;
    let rate = o.iters as f64 / secs / 1e6;
    let peak = peak.max(avg);
    if o.json {
        println!("{{\"test\":\"send_bw\",\"bytes\":{size},\"iterations\":{},\"bw_peak\":{peak:.2},\"bw_avg\":{avg:.2},\"msg_rate\":{rate:.6}}}", o.iters);
    } else {
        println!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}              {:<.6}",
            size, o.iters, peak, avg, rate
        );
    }
}

/// Runs a tool: parses arguments, connects, runs every size, prints the table.
pub(crate) fn main(test: Test) -> std::process::ExitCode {
    use std::process::ExitCode;
    let mut o = match parse(test, std::env::args().skip(1)) {
        Ok(o) => o,
        Err(msg) => {
            if msg.is_empty() {
                print!("{}", usage(test));
                return ExitCode::SUCCESS;
            }
            eprint!("error: {msg}\n{}", usage(test));
            return ExitCode::from(2);
        }
    };
    let mut run = || -> Result<(), String> {
        let c = connect(&mut o)?;
        if c.is_server {
            eprintln!("client connected from {}", c.ep.names().1);
        }
        banner(&o, &c);
        for size in sizes(&o, &c) {
            match o.test {
                Test::SendLat => {
                    let mut s = run_lat(&c, size, o.iters, o.timeout)?;
                    if !c.is_server {
                        print_lat(&o, size, &lat_stats(&mut s));
                    }
                }
                Test::SendBw => {
                    let (secs, peak) = run_bw(&c, size, o.iters, o.tx_depth, o.timeout)?;
                    if !c.is_server {
                        print_bw(&o, size, secs, peak);
                    }
                }
            }
        }
        if !o.json {
            println!("{}", "-".repeat(87));
        }
        c.ep.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
