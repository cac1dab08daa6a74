//! The reliability suite's lossy and slow links: two SoftRoCE nodes (`ci/vm-run-2node`)
//! with `tc netem` on their link. Node 0 echoes, node 1 sends messages of random sizes,
//! checks every byte that comes back in order, and accounts for every operation: RC
//! delivers everything, or (past its retry budget) reports error completions in time.
//!
//! Both nodes run the same tests in the same order; each case has its own port. Without
//! `RFABRIC_NODE` (set by the two-node runner) these skip: they need a second node.

mod common;
mod reliability;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use reliability::traffic::*;
use reliability::*;
use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;

struct Node {
    /// 0 echoes (and listens), 1 drives the traffic.
    index: u32,
    peer: String,
    own: String,
    netdev: String,
}

/// This node's part, or `None` (skip) outside the two-node runner.
fn node() -> Option<Node> {
    let index = std::env::var("RFABRIC_NODE").ok()?.parse().ok()?;
    let info = device_info().expect("a two-node run has a device on each node");
    let dev = info.domain_attr.name;
    let netdev = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0"
    ))
    .expect("the netdev under the device")
    .trim()
    .to_string();
    Some(Node {
        index,
        peer: std::env::var("RFABRIC_PEER_ADDR").expect("RFABRIC_PEER_ADDR"),
        own: std::env::var("RFABRIC_SELF_ADDR").expect("RFABRIC_SELF_ADDR"),
        netdev,
    })
}

/// `tc qdisc replace ... netem SPEC` on this node's link (egress), or removes it.
fn netem(netdev: &str, spec: Option<&str>) {
    let mut cmd = std::process::Command::new("tc");
    match spec {
        Some(s) => {
            cmd.args(["qdisc", "replace", "dev", netdev, "root", "netem"]);
            cmd.args(s.split_whitespace());
        }
        None => {
            // Nothing to delete is fine (node 0 of a one-sided case added none).
            cmd.args(["qdisc", "del", "dev", netdev, "root"]);
            cmd.stderr(std::process::Stdio::null());
        }
    }
    let st = cmd.status().expect("tc (iproute2)");
    assert!(
        st.success() || spec.is_none(),
        "tc netem {spec:?} on {netdev} failed"
    );
}

/// Node 1 connects to node 0's listener on `port`, trying again while node 0 is not up
/// yet (each node runs the cases on its own clock).
fn connect_with_retry(addr: SocketAddr) -> Side {
    let start = Instant::now();
    loop {
        let info = client_info(&addr);
        let fabric = Fabric::open(&info.fabric_attr).unwrap();
        let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
        let side = open_side(&info, fabric, eq, CLIENT_FID);
        side.ep.connect(b"").unwrap();
        match side.eq.sread(20_000) {
            Ok(EqEvent::Connected { .. }) => return side,
            Ok(other) => panic!("expected FI_CONNECTED, got {other:?}"),
            Err(_) => {
                let e = side.eq.readerr();
                assert!(
                    start.elapsed() < Duration::from_secs(90),
                    "node 0 never accepted on {addr}: {e:?}"
                );
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
}

/// One case: `spec` on both nodes' egress (`both`) or node 1's only, for the whole
/// traffic or, with `for_a_while`, only that long after the traffic starts.
struct Case {
    name: &'static str,
    /// Node 0 listens there: each case its own, so a late node cannot mix two cases.
    port: u16,
    spec: &'static str,
    both: bool,
    for_a_while: Option<Duration>,
    messages: u64,
    max_len: usize,
    bound: Duration,
    /// The link stays down past RC's retry budget: sends must fail with `FI_ETIMEDOUT`.
    expect_timeout: bool,
}

fn lossy_case(c: Case) {
    let Case {
        name: case,
        port,
        spec,
        both,
        for_a_while,
        messages,
        max_len,
        bound,
        expect_timeout,
    } = c;
    let Some(n) = node() else {
        eprintln!("skipped: a two-node case (run by ci/vm-run-2node)");
        return;
    };
    if n.index == 0 {
        let mut h = Info::default();
        h.ep_attr.ep_type = EpType::Msg;
        let info = getinfo(
            Some(&n.own),
            Some(&port.to_string()),
            Flags::SOURCE,
            Some(&h),
        )
        .unwrap()
        .remove(0);
        let fabric = Fabric::open(&info.fabric_attr).unwrap();
        let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
        let pep = PassiveEndpoint::open(&fabric, &info, PEP_FID).unwrap();
        pep.bind_eq(&eq).unwrap();
        pep.listen().unwrap();
        let side = accept_next(fabric, eq, pep, |_| {});
        if both {
            netem(&n.netdev, Some(spec));
        }
        // Echo until node 1 shuts the connection down (or its link failed for good).
        let end = Instant::now() + Duration::from_secs(300);
        let shut = std::cell::Cell::new(false);
        let stopped = echo_while(&side, || {
            if let Ok(EqEvent::Shutdown { .. }) = side.eq.read() {
                shut.set(true);
            }
            !shut.get() && Instant::now() < end
        });
        netem(&n.netdev, None);
        assert!(Instant::now() < end, "[{case}] node 1 never finished");
        // Node 1 accounts for the traffic; an echo stopped by an error is said here.
        if let Err(e) = stopped {
            // A blackout past the retry budget fails the connection; nothing else may.
            assert!(
                for_a_while.is_some(),
                "[{case}] node 0: the echo stopped: {e}"
            );
            // Wait for node 1's shutdown, so the next case starts clean.
            while !shut.get() && Instant::now() < end {
                if let Ok(EqEvent::Shutdown { .. }) = side.eq.sread(1000) {
                    shut.set(true);
                }
            }
        }
        return;
    }
    let addr: SocketAddr = format!("{}:{port}", n.peer).parse().unwrap();
    let side = connect_with_retry(addr);
    let mut rng = Rng::for_case(case);
    let mut out = Outcome::new(case, &format!("netem {spec}"), bound);
    let mut ping = Pinger::new(&side.domain);
    ping.max_len = max_len;
    netem(&n.netdev, Some(spec));
    let fault = Instant::now();
    out.faults += 1;
    let mut lifted = false;
    for slot in 0..WINDOW {
        assert!(ping.post_recv(&side.ep, slot, &mut out));
        assert!(ping.post_send(&side.ep, &mut rng, &mut out));
    }
    // New messages for `messages` or half the bound, whichever ends first (a lossy link
    // under TCG is slow); then what is in flight must complete, each operation within
    // the bound of the last progress.
    let start = Instant::now();
    let mut progress = Instant::now();
    loop {
        if let Some(d) = for_a_while {
            if !lifted && fault.elapsed() >= d {
                netem(&n.netdev, None);
                lifted = true;
            }
        }
        let more = ping.next_send < messages && !ping.send_failed && start.elapsed() < bound / 2;
        if ping.poll(&side, &mut rng, more, &mut out, Some(fault)) > 0 {
            progress = Instant::now();
        }
        if !more && ping.outstanding.is_empty() {
            break;
        }
        if progress.elapsed() > bound {
            out.problem(format!(
                "{} operations outstanding, no completion for {:?}",
                ping.outstanding.len(),
                progress.elapsed()
            ));
            break;
        }
    }
    if !lifted {
        netem(&n.netdev, None);
    }
    if expect_timeout && ping.timed_out == 0 {
        out.problem(
            "the link stayed down past the retry budget, yet no send failed with FI_ETIMEDOUT",
        );
    }
    if !expect_timeout && out.failed > 0 {
        out.problem(format!(
            "{} operations failed on a link that never stayed down",
            out.failed
        ));
    }
    side.ep.shutdown().ok();
    eprintln!(
        "[{case}] {} messages sent, {} echoed whole, {} operations failed, {:.1} s",
        ping.next_send,
        ping.next_echo,
        out.failed,
        start.elapsed().as_secs_f64()
    );
    out.finish();
}

#[test]
fn rc_delivers_everything_at_1_percent_loss() {
    lossy_case(Case {
        name: "lossy link 1%",
        port: 7471,
        spec: "loss 1%",
        both: true,
        for_a_while: None,
        messages: 400,
        max_len: 16 << 10,
        bound: Duration::from_secs(60),
        expect_timeout: false,
    });
}

#[test]
fn rc_delivers_everything_at_10_percent_loss() {
    lossy_case(Case {
        name: "lossy link 10%",
        port: 7472,
        spec: "loss 10%",
        both: true,
        for_a_while: None,
        messages: 150,
        max_len: 4 << 10,
        bound: Duration::from_secs(90),
        expect_timeout: false,
    });
}

#[test]
fn rc_delivers_everything_through_corruption() {
    lossy_case(Case {
        name: "corrupting link 0.1%",
        port: 7473,
        spec: "corrupt 0.1%",
        both: true,
        for_a_while: None,
        messages: 400,
        max_len: 16 << 10,
        bound: Duration::from_secs(60),
        expect_timeout: false,
    });
}

#[test]
fn rc_delivers_everything_in_order_through_reordering() {
    lossy_case(Case {
        name: "reordering link",
        port: 7474,
        spec: "delay 5ms reorder 25% 50%",
        both: true,
        for_a_while: None,
        messages: 300,
        max_len: 16 << 10,
        bound: Duration::from_secs(60),
        expect_timeout: false,
    });
}

#[test]
fn rc_delivers_everything_over_a_50ms_link() {
    lossy_case(Case {
        name: "slow link 50 ms",
        port: 7475,
        spec: "delay 50ms",
        both: true,
        for_a_while: None,
        messages: 200,
        max_len: 16 << 10,
        bound: Duration::from_secs(60),
        expect_timeout: false,
    });
}

#[test]
fn rc_recovers_from_a_one_second_blackout() {
    lossy_case(Case {
        name: "blackout 1 s",
        port: 7476,
        spec: "loss 100%",
        both: false,
        for_a_while: Some(Duration::from_secs(1)),
        messages: 200,
        max_len: 16 << 10,
        bound: Duration::from_secs(60),
        expect_timeout: false,
    });
}

/// With `FI_RVERBS_RETRY_COUNT` below 7 (rxe retries forever at 7), a blackout longer
/// than the retry budget fails the sends with `FI_ETIMEDOUT` and flushes the rest.
#[test]
fn rc_reports_a_blackout_past_its_retry_budget_in_time() {
    // One test thread per node, and the knob is read when connecting: no one else reads it.
    std::env::set_var("FI_RVERBS_RETRY_COUNT", "3");
    let _restore = Restore("FI_RVERBS_RETRY_COUNT");
    lossy_case(Case {
        name: "blackout 30 s, retry count 3",
        port: 7477,
        spec: "loss 100%",
        both: false,
        for_a_while: Some(Duration::from_secs(30)),
        messages: 200,
        max_len: 16 << 10,
        bound: Duration::from_secs(30),
        expect_timeout: true,
    });
}

/// Unsets an environment variable when dropped.
struct Restore(&'static str);

impl Drop for Restore {
    fn drop(&mut self) {
        std::env::remove_var(self.0);
    }
}

/// A datagram of `len` bytes numbered `seq`: its number, its length, then a pattern, and
/// an FNV-1a sum of all of it in the last 8 bytes.
fn datagram(seq: u64, len: usize) -> Vec<u8> {
    let mut d = pattern(len, seq as u8);
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    let sum = fnv(&d[..len - 8]);
    d[len - 8..].copy_from_slice(&sum.to_le_bytes());
    d
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Whether `d` is a whole datagram as [`datagram`] made it; its number if so.
fn check_datagram(d: &[u8]) -> Option<u64> {
    if d.len() < 24 {
        return None;
    }
    let seq = u64::from_le_bytes(d[..8].try_into().ok()?);
    let len = u64::from_le_bytes(d[8..16].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(d[d.len() - 8..].try_into().ok()?);
    (len == d.len() && sum == fnv(&d[..len - 8])).then_some(seq)
}

/// UD under loss, corruption and reordering at once: node 0 receives, node 1 sends. The
/// link may drop datagrams, but every one that arrives is whole (the device checks each
/// packet), none twice, and node 1's sends all complete. Names and the final counts go
/// over a TCP connection beside the link.
#[test]
fn ud_never_delivers_a_corrupt_datagram() {
    use std::io::{Read, Write};
    let Some(n) = node() else {
        eprintln!("skipped: a two-node case (run by ci/vm-run-2node)");
        return;
    };
    let spec = "loss 10% corrupt 1% delay 2ms reorder 25% 50%";
    let mut hints = Info::default();
    hints.ep_attr.ep_type = EpType::Dgram;
    let info = getinfo(None, None, Flags::empty(), Some(&hints))
        .unwrap()
        .remove(0);
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let av = AddressVector::open(&domain, &AvAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let ep = DgramEndpoint::open(&domain, &info).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.bind_av(&av).unwrap();
    ep.enable().unwrap();
    let mtu = info.ep_attr.max_msg_size;
    let count = Profile::get().pick(3000u64, 100_000);
    let port = 7478;
    netem(&n.netdev, Some(spec));
    if n.index == 0 {
        let listener = std::net::TcpListener::bind((n.own.as_str(), port)).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&ep.getname().unwrap().to_bytes()).unwrap();
        let depth = 256.min(info.rx_attr.size);
        let buf = MemoryRegion::alloc(&domain, depth * mtu, Flags::RECV).unwrap();
        for slot in 0..depth {
            ep.recv(&buf, slot * mtu, mtu, slot as u64).unwrap();
        }
        s.set_nonblocking(true).unwrap();
        let mut seen = std::collections::HashSet::new();
        let (mut whole, mut corrupt, mut twice, mut bytes) = (0u64, 0u64, 0u64, 0u64);
        let mut done = [0u8; 8];
        let mut got = 0;
        let mut e = [rfabric::core::cq::CqEntry::default(); 16];
        let mut quiet_since: Option<Instant> = None;
        let start = Instant::now();
        loop {
            match cq.read(&mut e) {
                Ok(k) => {
                    for c in &e[..k] {
                        let slot = c.op_context as usize;
                        let mut d = vec![0u8; c.len];
                        buf.read_at(slot * mtu, &mut d).unwrap();
                        match check_datagram(&d) {
                            Some(seq) if seen.insert(seq) => {
                                whole += 1;
                                bytes += d.len() as u64;
                            }
                            Some(_) => twice += 1,
                            None => corrupt += 1,
                        }
                        ep.recv(&buf, slot * mtu, mtu, slot as u64).unwrap();
                    }
                    quiet_since = None;
                }
                Err(err) if err.is_again() => {}
                Err(err) => panic!("cq: {err}: {:?}", cq.readerr()),
            }
            if got < 8 {
                match s.read(&mut done[got..]) {
                    Ok(k) => got += k,
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(err) => panic!("control connection: {err}"),
                }
            } else if quiet_since.get_or_insert_with(Instant::now).elapsed()
                > Duration::from_secs(1)
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "node 1 never finished"
            );
        }
        netem(&n.netdev, None);
        s.set_nonblocking(false).unwrap();
        for v in [whole, corrupt, twice, bytes] {
            s.write_all(&v.to_le_bytes()).unwrap();
        }
        return;
    }
    let addr = format!("{}:{port}", n.peer);
    let start = Instant::now();
    let mut s = loop {
        match std::net::TcpStream::connect(&addr) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(90) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(err) => panic!("node 0 never listened on {addr}: {err}"),
        }
    };
    let mut name = [0u8; UdName::LEN];
    s.read_exact(&mut name).unwrap();
    let to = av.insert(&name).unwrap();
    let mut rng = Rng::for_case("UD lossy link");
    let mut out = Outcome::new(
        "UD lossy link",
        &format!("netem {spec}"),
        Duration::from_secs(10),
    );
    out.faults = 1;
    let tx = MemoryRegion::alloc(&domain, 64 * mtu, Flags::SEND).unwrap();
    let mut e = [rfabric::core::cq::CqEntry::default(); 16];
    let mut outstanding = 0u64;
    for seq in 0..count {
        let len = rng.range(24, mtu as u64) as usize;
        let slot = (seq % 64) as usize;
        while outstanding >= 64 {
            match cq.read(&mut e) {
                Ok(k) => {
                    outstanding -= k as u64;
                    out.succeeded += k as u64;
                }
                Err(err) if err.is_again() => {}
                Err(err) => panic!("send cq: {err}: {:?}", cq.readerr()),
            }
        }
        tx.write_at(slot * mtu, &datagram(seq, len)).unwrap();
        ep.send(&tx, slot * mtu, len, to, seq).unwrap();
        out.posted += 1;
        outstanding += 1;
        if seq % 16 == 15 {
            // Paced, so the receiver's queue does not run dry: loss is the link's.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let t = Instant::now();
    while outstanding > 0 && t.elapsed() < out.bound {
        if let Ok(k) = cq.read(&mut e) {
            outstanding -= k as u64;
            out.succeeded += k as u64;
        }
    }
    out.waited(t.elapsed());
    netem(&n.netdev, None);
    s.write_all(&count.to_le_bytes()).unwrap();
    let mut r = [0u8; 32];
    s.read_exact(&mut r).unwrap();
    let v: Vec<u64> = r
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (whole, corrupt, twice, bytes) = (v[0], v[1], v[2], v[3]);
    out.bytes_verified = bytes;
    if corrupt > 0 || twice > 0 {
        out.problem(format!(
            "{corrupt} corrupt and {twice} duplicated datagrams delivered"
        ));
    }
    if whole == 0 {
        out.problem("no datagram arrived at all");
    }
    eprintln!(
        "[UD lossy link] {count} datagrams sent, {whole} arrived whole ({:.1} %), {corrupt} corrupt, {twice} twice",
        whole as f64 * 100.0 / count as f64
    );
    out.fault = format!("netem {spec}: {whole} of {count} datagrams delivered, all whole");
    out.finish();
}
