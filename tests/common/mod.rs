//! Fixtures for device tests: a connected pair of MSG endpoints on the first device.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;

use rfabric::core::cq::CqEntry;
use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;

/// The first device's MSG info (asked for by type: an unspecified type lists RDM first),
/// or `None` (skip) on a machine without one. Where a device
/// is required (`RFABRIC_REQUIRE_DEVICE=1`, set by the VM harness) its absence fails the test.
pub fn device_info() -> Option<Info> {
    let required = std::env::var("RFABRIC_REQUIRE_DEVICE").is_ok_and(|v| v == "1");
    match getinfo(None, None, Flags::empty(), Some(&msg_hints())) {
        Ok(mut v) => Some(v.remove(0)),
        Err(e) if !required && e.errno() == errno::ENODATA => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("RDMA device required but getinfo failed: {e}"),
    }
}

/// Hints asking for MSG endpoints (an unspecified type lists RDM first).
pub fn msg_hints() -> Info {
    let mut h = Info::default();
    h.ep_attr.ep_type = EpType::Msg;
    h
}

/// Waits for the next event on `eq` (10 s at most).
pub fn next_event(eq: &EventQueue) -> EqEvent {
    match eq.sread(10_000) {
        Ok(ev) => ev,
        Err(e) if e.errno() == errno::EAVAIL => panic!("error event: {:?}", eq.readerr()),
        Err(e) => panic!("no event: {e}"),
    }
}

/// Reads one completion, polling up to 10 s. Error completions fail the test.
pub fn wait_one(cq: &CompletionQueue) -> CqEntry {
    wait_one_as(cq)
}

/// Reads one completion in the CQ's own format `E`, polling up to 10 s. Error completions
/// fail the test.
pub fn wait_one_as<E: rfabric::core::cq::FormatEntry>(cq: &CompletionQueue) -> E {
    let mut out = [E::default(); 1];
    let start = std::time::Instant::now();
    loop {
        match cq.read(&mut out) {
            Ok(1) => return out[0],
            Ok(_) => {}
            Err(e) if e.is_again() => {}
            Err(e) if e.errno() == errno::EAVAIL => panic!("error completion: {:?}", cq.readerr()),
            Err(e) => panic!("cq read: {e}"),
        }
        assert!(start.elapsed().as_secs() < 10, "no completion within 10 s");
        std::hint::spin_loop();
    }
}

/// Reads one error completion, polling up to 10 s.
pub fn wait_err(cq: &CompletionQueue) -> rfabric::core::cq::CqErrEntry {
    let mut out = [CqEntry::default(); 1];
    let start = std::time::Instant::now();
    loop {
        match cq.read(&mut out) {
            Err(e) if e.errno() == errno::EAVAIL => {
                return cq.readerr().expect("readerr after EAVAIL")
            }
            Err(e) if e.is_again() => {}
            Ok(n) => panic!(
                "expected an error completion, got {n} successful ones: {:?}",
                &out[..n]
            ),
            Err(e) => panic!("cq read: {e}"),
        }
        assert!(
            start.elapsed().as_secs() < 10,
            "no error completion within 10 s"
        );
    }
}

/// Both sides of a connection in one process.
pub struct Pair {
    pub info: Info,
    pub fabric: Arc<Fabric>,
    pub domain: Arc<Domain>,
    pub server_eq: Arc<EventQueue>,
    pub client_eq: Arc<EventQueue>,
    pub server_cq: Arc<CompletionQueue>,
    pub client_cq: Arc<CompletionQueue>,
    pub pep: PassiveEndpoint,
    pub server: MsgEndpoint,
    pub client: MsgEndpoint,
    pub accept_data: Vec<u8>,
    pub connreq_data: Vec<u8>,
    /// The counters `PairOpts::cntr` had each side bind.
    pub client_cntr: Option<Arc<Counter>>,
    pub server_cntr: Option<Arc<Counter>>,
}

pub const SERVER_FID: u64 = 0x5e;
pub const CLIENT_FID: u64 = 0xc1;
pub const PEP_FID: u64 = 0x9e9;

/// A listener on the device's address, an ephemeral port.
pub fn listener(info: &Info) -> (Arc<Fabric>, Arc<EventQueue>, PassiveEndpoint, SocketAddr) {
    listener_with_backlog(info, None)
}

/// A listener whose `FI_BACKLOG` is set (`None`: the provider's default).
pub fn listener_with_backlog(
    info: &Info,
    backlog: Option<i32>,
) -> (Arc<Fabric>, Arc<EventQueue>, PassiveEndpoint, SocketAddr) {
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let mut pinfo = getinfo(
        Some(&info.src_addr.unwrap().ip().to_string()),
        Some("0"),
        Flags::SOURCE,
        Some(&msg_hints()),
    )
    .unwrap()
    .remove(0);
    pinfo.src_addr.as_mut().unwrap().set_port(0);
    let pep = PassiveEndpoint::open(&fabric, &pinfo, PEP_FID).unwrap();
    pep.bind_eq(&eq).unwrap();
    if let Some(b) = backlog {
        pep.set_backlog(b).unwrap();
    }
    pep.listen().unwrap();
    let addr = pep.getname().unwrap();
    assert_ne!(addr.port(), 0, "listener got no port");
    (fabric, eq, pep, addr)
}

/// The info a client uses to reach `addr` (fi_getinfo with the node and service).
pub fn client_info(addr: &SocketAddr) -> Info {
    getinfo(
        Some(&addr.ip().to_string()),
        Some(&addr.port().to_string()),
        Flags::empty(),
        Some(&msg_hints()),
    )
    .unwrap()
    .remove(0)
}

/// Connects a pair; `before_connect` may post receives on both sides first.
pub fn connect_pair_with(
    info: &Info,
    connect_data: &[u8],
    accept_data: &[u8],
    before: impl FnOnce(&Arc<Domain>, &MsgEndpoint, &MsgEndpoint),
) -> Pair {
    connect_pair_full(
        info,
        &PairOpts::default(),
        connect_data,
        accept_data,
        before,
    )
}

/// A connected pair whose two CQs are opened with `cq_attr`.
pub fn connect_pair_cq(info: &Info, cq_attr: &CqAttr) -> Pair {
    connect_pair_full(
        info,
        &PairOpts {
            cq_attr: *cq_attr,
            ..Default::default()
        },
        b"",
        b"",
        |_, _, _| {},
    )
}

/// How a test pair is built.
#[derive(Default)]
pub struct PairOpts {
    pub cq_attr: CqAttr,
    /// Added to FI_TRANSMIT | FI_RECV when binding both endpoints' CQs.
    pub bind: Flags,
    /// Send queue depth of both endpoints (0: the provider default).
    pub tx_size: usize,
    /// `fi_setname` on the client (after binding its EQ) before it is enabled.
    pub client_name: Option<SocketAddr>,
    /// `rx_attr.op_flags` of both endpoints' infos (the default flags of `fi_recv`).
    pub rx_op_flags: Flags,
    /// Capabilities of both endpoints' infos (`None`: what fi_getinfo answered).
    pub caps: Option<Flags>,
    /// A counter for each side, bound with these flags (client, server).
    pub cntr: Option<(Flags, Flags)>,
    /// The counters' wait object (`None`: `FI_WAIT_UNSPEC`).
    pub cntr_wait: Option<WaitObj>,
}

pub fn connect_pair_full(
    info: &Info,
    opts: &PairOpts,
    connect_data: &[u8],
    accept_data: &[u8],
    before: impl FnOnce(&Arc<Domain>, &MsgEndpoint, &MsgEndpoint),
) -> Pair {
    let cq_attr = &opts.cq_attr;
    let bind = Flags::TRANSMIT | Flags::RECV | opts.bind;
    let (fabric, server_eq, pep, addr) = listener(info);
    let domain = Domain::open(&fabric, info).unwrap();
    let client_eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let server_cq = CompletionQueue::open(&domain, cq_attr).unwrap();
    let client_cq = CompletionQueue::open(&domain, cq_attr).unwrap();

    let mut cinfo = client_info(&addr);
    assert_eq!(cinfo.dest_addr, Some(addr));
    if opts.tx_size != 0 {
        cinfo.tx_attr.size = opts.tx_size;
    }
    cinfo.rx_attr.op_flags |= opts.rx_op_flags;
    if let Some(c) = opts.caps {
        cinfo.caps = c;
    }
    let client = MsgEndpoint::open(&domain, &cinfo, CLIENT_FID).unwrap();
    client.bind_eq(&client_eq).unwrap();
    if let Some(a) = &opts.client_name {
        client.setname(a).unwrap();
    }
    client.bind_cq(&client_cq, bind).unwrap();
    let cntr_attr = CntrAttr {
        wait_obj: opts.cntr_wait.unwrap_or(WaitObj::Unspec),
        ..Default::default()
    };
    let bind_cntr = |ep: &MsgEndpoint, flags: Flags| {
        let c = Counter::open(&domain, &cntr_attr).unwrap();
        ep.bind_cntr(&c, flags).unwrap();
        c
    };
    let client_cntr = opts.cntr.map(|(f, _)| bind_cntr(&client, f));
    client.enable().unwrap();

    // The server endpoint exists only once the request arrives; `before` gets both after that.
    client.connect(connect_data).unwrap();
    let (sinfo, connreq_data) = match next_event(&server_eq) {
        EqEvent::ConnReq { fid, info, data } => {
            assert_eq!(fid, PEP_FID);
            (*info, data)
        }
        other => panic!("expected FI_CONNREQ, got {other:?}"),
    };
    let mut sinfo = sinfo;
    if opts.tx_size != 0 {
        sinfo.tx_attr.size = opts.tx_size;
    }
    sinfo.rx_attr.op_flags |= opts.rx_op_flags;
    if let Some(c) = opts.caps {
        sinfo.caps = c;
    }
    let server = MsgEndpoint::open(&domain, &sinfo, SERVER_FID).unwrap();
    server.bind_eq(&server_eq).unwrap();
    server.bind_cq(&server_cq, bind).unwrap();
    let server_cntr = opts.cntr.map(|(_, f)| bind_cntr(&server, f));
    server.enable().unwrap();
    before(&domain, &server, &client);
    server.accept(accept_data).unwrap();
    let mut got_accept = None;
    let mut server_up = false;
    while got_accept.is_none() || !server_up {
        if got_accept.is_none() {
            if let Ok(ev) = client_eq.sread(50) {
                match ev {
                    EqEvent::Connected { fid, data } => {
                        assert_eq!(fid, CLIENT_FID);
                        got_accept = Some(data);
                    }
                    other => panic!("client expected FI_CONNECTED, got {other:?}"),
                }
            }
        }
        if !server_up {
            if let Ok(ev) = server_eq.sread(50) {
                match ev {
                    EqEvent::Connected { fid, .. } => {
                        assert_eq!(fid, SERVER_FID);
                        server_up = true;
                    }
                    other => panic!("server expected FI_CONNECTED, got {other:?}"),
                }
            }
        }
    }
    Pair {
        info: info.clone(),
        fabric,
        domain,
        server_eq,
        client_eq,
        server_cq,
        client_cq,
        pep,
        server,
        client,
        accept_data: got_accept.unwrap(),
        connreq_data,
        client_cntr,
        server_cntr,
    }
}

pub fn connect_pair(info: &Info) -> Pair {
    connect_pair_with(info, b"", b"", |_, _, _| {})
}

/// A deterministic byte pattern, different per size and direction.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed as u32 * 7 + (len as u32 >> 3)) as u8
        })
        .collect()
}

/// A fabric and domain for `info`, and a CQ of tagged entries on it (what RDM tests open).
pub fn domain_and_tagged_cq(info: &Info) -> (Arc<Domain>, Arc<CompletionQueue>) {
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, info).unwrap();
    let cq = CompletionQueue::open(
        &domain,
        &CqAttr {
            format: CqFormat::Tagged,
            ..Default::default()
        },
    )
    .unwrap();
    (domain, cq)
}

/// A child test process's output, line by line.
pub type ChildLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// Starts this binary's ignored test `test` as a child process (with `env` set), its stdin
/// and stdout piped; returns it, its output's lines and what it prints after `marker` (its
/// name, for the parent to insert).
pub fn spawn_test_child(
    test: &str,
    env: &[(&str, &str)],
    marker: &str,
) -> (std::process::Child, ChildLines, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let name = said(&mut lines, marker);
    (child, lines, name)
}

/// What a child says after `what` on a line of its output (the first such line).
pub fn said(lines: &mut ChildLines, what: &str) -> String {
    lines
        .by_ref()
        .map_while(|l| l.ok())
        .find_map(|l| l.find(what).map(|i| l[i + what.len()..].trim().to_string()))
        .unwrap_or_else(|| panic!("the child never said {what:?}"))
}
