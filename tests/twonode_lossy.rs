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
        let info = getinfo(Some(&n.own), Some(&port.to_string()), Flags::SOURCE, None)
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
